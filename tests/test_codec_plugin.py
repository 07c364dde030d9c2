"""Codec plugins: examples/codec_plugin installed for real with pip, found through its entry point, used end
to end; broken and duplicate plugins give a CodecError naming them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nebula_fl.compression import CodecError, Compressor, Layout, available_codecs
from nebula_fl.compression.registry import refresh_plugins
from tests.conftest import put_on_path, take_off_path

REPO = Path(__file__).resolve().parents[1]
PLUGIN = REPO / "examples" / "codec_plugin"
LAYOUT = Layout.from_shapes({"l0.lora_A": (8, 96), "l0.lora_B": (96, 8), "head.bias": (5,)})


def _on_path(folder: Path):
    put_on_path(folder)
    refresh_plugins()


def _off_path(folder: Path, *modules: str):
    take_off_path(folder, *modules)
    refresh_plugins()


@pytest.fixture(scope="module")
def sign_plugin(tmp_path_factory):
    """pip-installs a copy of the example (so no build files land in the repo) into a private folder."""
    work = tmp_path_factory.mktemp("plugin")
    source = shutil.copytree(PLUGIN, work / "src", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    target = work / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-build-isolation",
           "--disable-pip-version-check", "--quiet", "--target", str(target), str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (target / "nebula_codec_sign").is_dir()
    _on_path(target)
    yield target
    _off_path(target, "nebula_codec_sign")


def test_sign_plugin_is_found_through_its_entry_point(sign_plugin):
    assert "sign" in available_codecs()
    comp = Compressor("sign", layout=LAYOUT)
    assert type(comp.stages[0]).__module__ == "nebula_codec_sign"
    assert comp.error_feedback and comp.spec == "sign"


def test_sign_plugin_end_to_end_with_error_feedback(sign_plugin):
    rng = np.random.default_rng(0)
    for spec in ("sign", "sign:32", "topk:0.2+sign"):
        comp = Compressor(spec, layout=LAYOUT)
        inputs = np.zeros(LAYOUT.size)
        sent = np.zeros(LAYOUT.size)
        for rnd in range(5):
            x = rng.standard_normal(LAYOUT.size).astype(np.float32)
            blob = comp.encode(x, seed=rnd)
            assert len(blob) == comp.encoded_size()
            y = Compressor.decode(blob, layout=LAYOUT, seed=rnd)
            inputs += x
            sent += y
            np.testing.assert_allclose(sent + comp.residual, inputs, atol=1e-4)
        if spec == "sign":
            assert len(blob) < LAYOUT.size / 8 + LAYOUT.size / 256 * 4 + 200  # ~1 bit an element
            # the first stage's decode is scale * sign(x + residual)
            assert set(np.unique(np.sign(y))) <= {-1.0, 1.0}
        twin = Compressor.from_state_dict(comp.state_dict(), layout=LAYOUT)
        x = rng.standard_normal(LAYOUT.size).astype(np.float32)
        assert twin.encode(x, seed=9) == comp.encode(x, seed=9)


def test_sign_plugin_decoder_rejects_hostile_blobs(sign_plugin):
    comp = Compressor("sign", layout=LAYOUT)
    blob = bytearray(comp.encode(np.ones(LAYOUT.size, np.float32), seed=0))
    scales_at = len(blob) - 4 * -(-LAYOUT.size // 256)
    blob[scales_at:scales_at + 4] = np.float32(np.nan).tobytes()
    with pytest.raises(CodecError, match="sign scales"):
        Compressor.decode(bytes(blob), layout=LAYOUT, seed=0)
    with pytest.raises(CodecError):
        Compressor.decode(bytes(blob[:-3]), layout=LAYOUT, seed=0)
    with pytest.raises(CodecError, match="block size"):
        Compressor("sign:x", layout=LAYOUT)


def _fake_dist(site: Path, name: str, entry_points: str) -> None:
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[nebula_fl.codecs]\n" + entry_points)


def test_broken_and_duplicate_plugins_are_named(tmp_path):
    site = tmp_path / "site"
    _fake_dist(site, "broken_codecs", "broken = no_such_module_xyz:Codec\nnotacodec = json:dumps\n"
                                      "int8 = json:JSONDecoder\n")
    _fake_dist(site, "twin_a", "twin = json:JSONDecoder\n")
    _fake_dist(site, "twin_b", "twin = json:JSONEncoder\n")
    _on_path(site)
    try:
        with pytest.raises(CodecError, match=r"codec plugin 'broken'.*broken_codecs 0.1.*failed to load.*no_such_module"):
            Compressor("broken", layout=LAYOUT)
        with pytest.raises(CodecError, match=r"codec plugin 'notacodec'.*not a subclass"):
            Compressor("notacodec", layout=LAYOUT)
        with pytest.raises(CodecError, match=r"codec plugin 'int8'.*reuses the name of a built-in"):
            Compressor("int8", layout=LAYOUT)
        with pytest.raises(CodecError, match=r"claimed by several plugins.*twin_a.*twin_b|claimed by several.*twin_b.*twin_a"):
            Compressor("twin", layout=LAYOUT)
        with pytest.raises(CodecError, match="reuses the name"):
            available_codecs()
    finally:
        _off_path(site)
    assert Compressor("int8", layout=LAYOUT).spec == "int8"
    assert "broken" not in available_codecs()
