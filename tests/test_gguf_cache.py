"""A GGUF base dequantised once per host: the cache's mechanics (keyed by contents, built once under concurrency,
never half-published), and the shipped SmolLM2 through it: the cached weights are the GGUF file's own tensors as the
`gguf` library dequantises them, independently of transformers' loader."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from nebula_fl.model.gguf_cache import CACHE_ENV, dequantised, model_folder


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def test_a_file_is_built_once_even_by_processes_asking_together_and_found_by_its_contents(tmp_path, cache):
    calls = []

    def build(gguf, folder):
        calls.append(gguf.read_bytes())
        time.sleep(0.3)  # the others arrive while it builds, and must wait, not build again
        (folder / "model.safetensors").write_bytes(gguf.read_bytes())

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF one")
    found = []
    threads = [threading.Thread(target=lambda: found.append(dequantised(gguf, build=build))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(found)) == 1 and (found[0] / "model.safetensors").read_bytes() == b"GGUF one"
    gguf.write_bytes(b"GGUF two")  # a replaced file under the same name gets a folder of its own
    again = dequantised(gguf, build=build)
    assert again != found[0] and (again / "model.safetensors").read_bytes() == b"GGUF two" and len(calls) == 2
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == sorted([found[0].name, again.name])


def test_a_files_digest_is_read_once_per_process_while_the_file_is_unchanged(tmp_path, monkeypatch):
    """The tokenizer and the model of one process both ask for the folder: the file is hashed once, and again
    only once it changes."""
    import hashlib

    from nebula_fl.model import gguf_cache

    reads, real = [], hashlib.sha256
    monkeypatch.setattr(gguf_cache.hashlib, "sha256", lambda: reads.append(1) or real())
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF a")
    assert gguf_cache.file_digest(gguf) == gguf_cache.file_digest(gguf) == real(b"GGUF a").hexdigest()
    assert len(reads) == 1
    gguf.write_bytes(b"GGUF bb")
    assert gguf_cache.file_digest(gguf) == real(b"GGUF bb").hexdigest() and len(reads) == 2


def test_a_build_that_fails_publishes_nothing_and_the_next_one_builds(tmp_path, cache):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")

    def broken(_gguf, folder):
        (folder / "half").write_bytes(b"x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        dequantised(gguf, build=broken)
    assert [p for p in cache.iterdir() if not p.name.endswith(".lock")] == []
    folder = dequantised(gguf, build=lambda _g, f: (f / "ok").write_bytes(b"1"))
    assert (folder / "ok").exists() and not (folder / "half").exists()


def test_the_shipped_smollm2_loads_through_its_dequantised_folder_with_the_gguf_files_own_tensors(cache):
    """The folder holds a plain transformers model; two of its tensors that transformers does not permute equal the
    `gguf` library's dequantisation of the file's Q4_1 blocks, and a second ask is a lookup, not a build."""
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import load_file

    from nebula_fl.model.locate import resolve_model_path

    path = resolve_model_path("smollm2")
    folder = model_folder(path)
    assert (folder / "config.json").exists() and (folder / "tokenizer.json").exists()
    weights = load_file(str(folder / "model.safetensors"))
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    for ours, theirs in (("model.embed_tokens.weight", "token_embd.weight"),
                         ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight")):
        t = tensors[theirs]
        want = dequantize(t.data, t.tensor_type).reshape(weights[ours].shape)
        np.testing.assert_array_equal(weights[ours].numpy(), want.astype(np.float32), err_msg=ours)
        assert weights[ours].dtype == torch.float32
    began = time.monotonic()
    assert model_folder(path) == folder and time.monotonic() - began < 5  # hashing the file, no dequantising
