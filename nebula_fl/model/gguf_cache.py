"""A GGUF base dequantised once per host: a transformers folder (fp32 safetensors, config, tokenizer) keyed by the
file's SHA-256, which every later process loads in about a second instead of dequantising again.

transformers dequantises a GGUF file on every load (SmolLM2-135M here: 13.0 s for the weights, 2.9 s for its
tokenizer, against 0.2 s for both from the folder),
and a causal-lm run loads its base in the ServerApp, every rank of every trainer and `nebula-fl generate`. The first
process to need a file builds its folder under a lock, written whole or not at all (``storage.durable``), so a
reader finds a whole folder or none, and processes started together build it once. The key is the file's
contents, not its path: an edited or replaced file gets a folder of its own. The cache lives in
``$NEBULA_FL_CACHE/gguf`` (default ``~/.cache/nebula-fl/gguf``), about 4 bytes per parameter; deleting it only costs
the next load its dequantisation.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from nebula_fl.storage.durable import write_folder_durably

CACHE_ENV = "NEBULA_FL_CACHE"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "nebula-fl") / "gguf"


_DIGESTS: dict[tuple[str, int, int, int], str] = {}


def file_digest(path: Path) -> str:
    """The file's SHA-256, read once per process while the file is unchanged (size, mtime and inode the same): the
    tokenizer and the model of one process each ask."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def dequantised(gguf: Path, *, build: Callable[[Path, Path], None]) -> Path:
    """The cached folder of `gguf`, made by `build(gguf, folder)` (which fills an empty folder) if absent."""
    root = cache_root()
    final = root / f"{gguf.stem}-{file_digest(gguf)[:32]}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with (root / f"{final.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per file; the others wait, then find the folder
        if final.is_dir():
            return final
        write_folder_durably(final, lambda folder: build(gguf, folder) or True)
    return final


def build_from_gguf(gguf: Path, folder: Path) -> None:
    """transformers' own GGUF loading, saved as a plain model folder: the weights (fp32, as loaded), the config
    and the tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True,
                                                 dtype=torch.float32)
    # transformers marks a GGUF-loaded model quantised and will not save it; its weights are plain fp32 tensors by
    # now, written as they are beside a config that no longer names the GGUF quantisation. A tied weight is written
    # once, under its first name (the input embeddings, which transformers ties the output layer to on load).
    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if (tensor.data_ptr(), tuple(tensor.shape)) not in seen:
            seen.add((tensor.data_ptr(), tuple(tensor.shape)))
            state[name] = tensor.detach().contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True).save_pretrained(
        str(folder))


def model_folder(path: Path) -> Path:
    """The folder transformers loads `path` from: a GGUF file's cached dequantised folder, else `path` itself."""
    return dequantised(path, build=build_from_gguf) if path.suffix.lower() == ".gguf" else path
