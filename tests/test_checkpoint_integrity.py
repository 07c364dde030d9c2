"""Checkpoints that cannot lie: every kind of damage is a CheckpointError naming the file and the way on,
never another exception and never a wrong state; the previous checkpoint survives until the next is whole;
`nebula-fl run --resume` on a damaged run exits 2 with one line and touches nothing; --rewind recovers."""

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError
from safetensors.numpy import save_file

from nebula_fl.errors import NebulaError
from nebula_fl.storage.checkpoint import MANIFEST, CheckpointError, sha256
from nebula_fl.storage.run_folder import RunFolder
from tests.conftest import nebula_cmd

FILES = ("adapter.safetensors", "state.safetensors", "state.json", MANIFEST)


def _state(r: int) -> dict:
    rng = np.random.default_rng(r)
    return {"strategy": {"name": "fedavgm", "t": r, "velocity": {"a": rng.standard_normal((4, 3)).astype(np.float32)},
                         "views": [rng.standard_normal(5), None], "rng": rng.bit_generator.state},
            "federation_id": "abc123", "wall_seconds": 1.5 * r, "initial_evaluation": {"accuracy": 0.2}}


def _adapter(r: int) -> dict[str, np.ndarray]:
    return {"lora_A": np.full((8, 4), r, np.float32), "lora_B": np.arange(12, dtype=np.float32).reshape(3, 4) * r,
            "head.weight": np.full(5, -r, np.float64)}


def make_run(path: Path, rounds: int = 3) -> RunFolder:
    folder = RunFolder(path)
    folder.path.mkdir(parents=True, exist_ok=True)
    for r in range(1, rounds + 1):
        folder.save_checkpoint(round=r, adapter=_adapter(r), state=_state(r))
    return folder


def ckpt(folder: RunFolder, r: int) -> Path:
    return folder.path / "checkpoint" / f"round-{r:05d}"


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(path.rglob("*"))}


def error_of(folder: RunFolder) -> str:
    with pytest.raises(CheckpointError) as info:
        folder.load_checkpoint()
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, NebulaError)
    return message


# -- what a checkpoint holds --------------------------------------------------------------------------------------
def test_a_checkpoint_round_trips_and_its_manifest_seals_every_file(tmp_path):
    folder = make_run(tmp_path / "run", rounds=2)
    done, adapter, state = folder.load_checkpoint()
    assert done == 2
    for key, value in _adapter(2).items():
        np.testing.assert_array_equal(adapter[key], value)
        assert adapter[key].dtype == value.dtype and adapter[key].flags.writeable
    np.testing.assert_array_equal(state["strategy"]["velocity"]["a"], _state(2)["strategy"]["velocity"]["a"])
    assert state["strategy"]["views"][1] is None and state["strategy"]["rng"] == _state(2)["strategy"]["rng"]
    manifest = json.loads((ckpt(folder, 2) / MANIFEST).read_text())
    assert manifest["round"] == 2 and set(manifest["files"]) == set(FILES) - {MANIFEST}
    for name, entry in manifest["files"].items():
        data = (ckpt(folder, 2) / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    latest = (folder.path / "checkpoint" / "latest").read_text()
    assert latest == f"round-00002 sha256={sha256((ckpt(folder, 2) / MANIFEST).read_bytes())}\n"


def test_an_empty_folder_has_no_checkpoint(tmp_path):
    assert RunFolder(tmp_path).load_checkpoint() is None
    assert not RunFolder(tmp_path).has_checkpoint()


def test_a_checkpoint_written_before_manifests_still_loads(tmp_path):
    """What older runs (and test_e2e's hand-made run) hold: no manifest, a bare name in `latest`."""
    folder = RunFolder(tmp_path)
    old = tmp_path / "checkpoint" / "round-00002"
    old.mkdir(parents=True)
    (old / "state.json").write_text('{"round": 2, "state": {"x": {"__array__": "x"}}}')
    save_file({"x": np.ones(2, np.float32)}, str(old / "state.safetensors"))
    save_file({"w": np.zeros(3, np.float32)}, str(old / "adapter.safetensors"))
    (tmp_path / "checkpoint" / "latest").write_text("round-00002")
    done, adapter, state = folder.load_checkpoint()
    assert done == 2 and adapter["w"].shape == (3,) and state["x"].tolist() == [1.0, 1.0]
    (old / "adapter.safetensors").write_bytes((old / "adapter.safetensors").read_bytes()[:-3])
    assert "adapter.safetensors is not a readable safetensors file" in error_of(folder)


# -- keep two, and never lose the previous one -------------------------------------------------------------------
def test_the_newest_two_checkpoints_are_kept(tmp_path):
    folder = make_run(tmp_path / "run", rounds=5)
    names = sorted(p.name for p in (folder.path / "checkpoint").iterdir())
    assert names == ["latest", "round-00004", "round-00005"]
    assert folder.load_checkpoint()[0] == 5
    # the same round saved again (a round repeated after a resume) replaces it and keeps the one before
    folder.save_checkpoint(round=5, adapter=_adapter(50), state=_state(5))
    assert sorted(p.name for p in (folder.path / "checkpoint").iterdir()) == ["latest", "round-00004", "round-00005"]
    np.testing.assert_array_equal(folder.load_checkpoint()[1]["lora_A"], _adapter(50)["lora_A"])


def test_a_save_that_fails_midway_leaves_the_previous_checkpoints_and_latest_alone(tmp_path):
    folder = make_run(tmp_path / "run", rounds=2)
    before = snapshot(folder.path / "checkpoint")
    with pytest.raises(SafetensorError):  # an object array cannot be written as safetensors: the save fails
        folder.save_checkpoint(round=3, adapter=_adapter(3), state={"bad": np.array([object()], dtype=object)})
    assert folder.load_checkpoint()[0] == 2
    assert {k: v for k, v in snapshot(folder.path / "checkpoint").items() if not k.startswith(".")} == before
    folder.save_checkpoint(round=3, adapter=_adapter(3), state=_state(3))  # and the leftovers go with the next save
    assert sorted(p.name for p in (folder.path / "checkpoint").iterdir()) == ["latest", "round-00002", "round-00003"]


def test_folders_a_crash_left_beside_latest_go_with_the_next_save(tmp_path):
    folder = make_run(tmp_path / "run", rounds=3)
    root = folder.path / "checkpoint"
    shutil.copytree(root / "round-00002", root / "round-00001")  # a crash before the pruning of round 1
    shutil.copytree(root / "round-00003", root / "round-00004")  # a crash after the rename, before `latest` moved
    assert folder.load_checkpoint()[0] == 3  # `latest` decides, not the newest folder
    with pytest.raises(SafetensorError):  # they go before the next save writes: a second crash cannot pile up a fourth
        folder.save_checkpoint(round=4, adapter=_adapter(4), state={"bad": np.array([object()], dtype=object)})
    assert folder.checkpoint_names() == ["round-00002", "round-00003"] and folder.load_checkpoint()[0] == 3
    folder.save_checkpoint(round=4, adapter=_adapter(4), state=_state(4))
    assert folder.checkpoint_names() == ["round-00003", "round-00004"]
    np.testing.assert_array_equal(folder.load_checkpoint()[1]["lora_A"], _adapter(4)["lora_A"])


SAVER = textwrap.dedent("""
    import sys
    import numpy as np
    from nebula_fl.storage.run_folder import RunFolder
    folder = RunFolder(sys.argv[1])
    r = folder.load_checkpoint()[0] if folder.load_checkpoint() else 0
    print("ready", flush=True)
    while True:
        r += 1
        folder.save_checkpoint(round=r, adapter={"w": np.full(200_000, r, np.float32)},
                               state={"m": np.full(100_000, r, np.float64), "round": r})
""")


def test_a_saver_killed_at_random_moments_always_leaves_an_intact_checkpoint(tmp_path):
    rng = np.random.default_rng(0)
    folder = RunFolder(tmp_path / "run")
    folder.path.mkdir()
    last = 0
    for _ in range(8):
        saver = subprocess.Popen([sys.executable, "-c", SAVER, str(folder.path)], stdout=subprocess.PIPE, text=True)
        assert saver.stdout.readline().strip() == "ready"
        time.sleep(float(rng.uniform(0.05, 0.6)))
        saver.send_signal(signal.SIGKILL)
        saver.wait()
        done, adapter, state = folder.load_checkpoint()  # never a CheckpointError: a kill is not damage
        assert done >= last and state["round"] == done
        assert np.all(adapter["w"] == done) and np.all(state["m"] == done)
        names = folder.checkpoint_names()  # a kill before the pruning leaves a third one, pruned next time
        assert f"round-{done:05d}" in names and len(names) <= 3
        last = done
    assert last >= 2


# -- every kind of damage -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FILES)
def test_a_missing_file_is_named(tmp_path, name):
    folder = make_run(tmp_path / "run")
    (ckpt(folder, 3) / name).unlink()
    message = error_of(folder)
    assert f"round-00003 is damaged: {name} is missing" in message
    assert "the previous checkpoint round-00002 is intact" in message
    assert f"nebula-fl run --resume {folder.path} --rewind" in message


@pytest.mark.parametrize("name", FILES)
def test_a_truncated_file_is_named(tmp_path, name):
    folder = make_run(tmp_path / "run")
    path = ckpt(folder, 3) / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    message = error_of(folder)
    expected = f"{name} is truncated" if name != MANIFEST else f"{MANIFEST} is not valid JSON"
    assert expected in message and "round-00002 is intact" in message


@pytest.mark.parametrize("name", FILES[:3])
def test_a_changed_byte_is_a_checksum_mismatch(tmp_path, name):
    folder = make_run(tmp_path / "run")
    path = ckpt(folder, 3) / name
    data = bytearray(path.read_bytes())
    data[len(data) - 2] ^= 0x01  # inside the tensor data / the JSON: sizes stay the same
    path.write_bytes(bytes(data))
    assert f"{name} does not match its SHA-256 in manifest.json" in error_of(folder)


def _reseal(folder: RunFolder, r: int) -> None:
    """Rewrite the manifest and `latest` to match the files as they are now (a consistent forgery)."""
    manifest_path = ckpt(folder, r) / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    for name in manifest["files"]:
        data = (ckpt(folder, r) / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": sha256(data)}
    manifest_path.write_text(json.dumps(manifest))
    (folder.path / "checkpoint" / "latest").write_text(f"round-{r:05d} sha256={sha256(manifest_path.read_bytes())}\n")


@pytest.mark.parametrize(("name", "content", "expected"), [
    ("state.json", b'{"round": 3, "state": ', "state.json is not valid JSON"),
    ("state.json", b'{"round": 4, "format": 2, "state": {}}', "state.json is for round 4, not 3"),
    ("state.json", b'{"round": 3, "format": 2, "state": {"x": {"__array__": "nope"}}}', "refers to arrays missing"),
    ("state.json", b'[1, 2]', "does not hold a round and a state"),
    ("adapter.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage", "not a readable safetensors file"),
    ("state.safetensors", b"", "state.safetensors is not a readable safetensors file"),
])
def test_content_that_matches_its_manifest_is_still_parsed_and_checked(tmp_path, name, content, expected):
    folder = make_run(tmp_path / "run")
    (ckpt(folder, 3) / name).write_bytes(content)
    _reseal(folder, 3)
    assert expected in error_of(folder)


@pytest.mark.parametrize(("latest", "expected"), [
    ("round-00009 sha256=" + "0" * 64 + "\n", "it points to round-00009, which does not exist"),
    ("round-00002 sha256=" + "0" * 64 + "\n", "it does not match round-00002/manifest.json"),
    ("round-00003", "it lacks the SHA-256 of round-00003/manifest.json"),
    (None, "it is missing"),
    ("../../etc sha256=x", "it does not name a checkpoint"),
    (b"\xff\xfe", "it is not text"),
])
def test_a_damaged_latest_pointer_is_named(tmp_path, latest, expected):
    folder = make_run(tmp_path / "run")
    pointer = folder.path / "checkpoint" / "latest"
    if latest is None:
        pointer.unlink()
    else:
        pointer.write_bytes(latest if isinstance(latest, bytes) else latest.encode())
    message = error_of(folder)
    assert f"the checkpoint pointer {pointer} is damaged: {expected}" in message
    assert "checkpoint round-00003 is intact; resume from it with" in message


def test_with_no_intact_checkpoint_the_message_says_so(tmp_path):
    folder = make_run(tmp_path / "run", rounds=2)
    for r in (1, 2):
        (ckpt(folder, r) / "state.safetensors").write_bytes(b"")
    message = error_of(folder)
    assert "round-00002 is damaged: state.safetensors is truncated" in message
    assert "no earlier checkpoint is intact" in message and "--rewind" in message


# -- Hypothesis: any truncation or byte flip of any file is a CheckpointError, nothing else ------------------------
@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("pristine") / "run", rounds=2).path


DAMAGEABLE = ("checkpoint/latest", *(f"checkpoint/round-00002/{name}" for name in FILES))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.sampled_from(DAMAGEABLE), data=st.data())
def test_any_truncation_or_flip_of_any_file_is_a_checkpoint_error(pristine, target, data):
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        shutil.copytree(pristine, run)
        path = run / target
        original = path.read_bytes()
        if data.draw(st.booleans(), label="truncate"):
            damaged = original[: data.draw(st.integers(0, len(original) - 1), label="length")]
        else:
            flips = data.draw(st.lists(st.tuples(st.integers(0, len(original) - 1), st.integers(1, 255)),
                                       min_size=1, max_size=4, unique_by=lambda f: f[0]), label="flips")
            buffer = bytearray(original)
            for at, mask in flips:
                buffer[at] ^= mask
            damaged = bytes(buffer)
        path.write_bytes(damaged)
        with pytest.raises(CheckpointError) as info:
            RunFolder(run).load_checkpoint()
        message = str(info.value)
        assert "\n" not in message and "--rewind" in message
        if target.endswith((".safetensors", "state.json")):
            assert path.name in message and "round-00001 is intact" in message  # the file, and the way on
        else:
            assert "latest" in message or MANIFEST in message
            assert "round-00001 is intact" in message or "round-00002 is intact" in message


@settings(max_examples=150, deadline=None)
@given(blobs=st.dictionaries(st.sampled_from(DAMAGEABLE), st.binary(max_size=300), min_size=1))
def test_random_bytes_for_any_files_load_or_raise_checkpoint_error_only(pristine, blobs):
    """The fuzz contract of RunFolder.load_checkpoint: the checkpoint, None, or CheckpointError."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        shutil.copytree(pristine, run)
        for target, blob in blobs.items():
            (run / target).write_bytes(blob)
        try:
            RunFolder(run).load_checkpoint()
        except CheckpointError:
            pass


# -- rewind -------------------------------------------------------------------------------------------------------
def test_rewind_moves_the_damaged_newest_aside_and_points_latest_at_the_previous(tmp_path):
    folder = make_run(tmp_path / "run", rounds=3)
    (ckpt(folder, 3) / "adapter.safetensors").write_bytes(b"oops")
    assert folder.rewind_plan() == (2, ["round-00003"])
    assert folder.rewind_checkpoints() == (2, ["damaged-round-00003"])
    assert folder.load_checkpoint()[0] == 2
    assert (folder.path / "checkpoint" / "damaged-round-00003" / "adapter.safetensors").read_bytes() == b"oops"
    folder.save_checkpoint(round=3, adapter=_adapter(3), state=_state(3))  # the run goes on from there
    names = sorted(p.name for p in (folder.path / "checkpoint").iterdir())
    assert names == ["damaged-round-00003", "latest", "round-00002", "round-00003"]
    (ckpt(folder, 3) / "state.json").write_bytes(b"{}")  # damaged again: a second name aside, nothing lost
    assert folder.rewind_checkpoints() == (2, ["damaged-round-00003-2"])


def test_rewind_repairs_a_damaged_pointer_without_moving_an_intact_checkpoint(tmp_path):
    folder = make_run(tmp_path / "run", rounds=3)
    (folder.path / "checkpoint" / "latest").write_text("round-00007")
    assert folder.rewind_checkpoints() == (3, [])
    assert folder.load_checkpoint()[0] == 3


def test_rewind_with_nothing_intact_starts_the_run_over(tmp_path):
    folder = make_run(tmp_path / "run", rounds=2)
    for r in (1, 2):
        (ckpt(folder, r) / MANIFEST).unlink()
    assert folder.rewind_checkpoints() == (None, ["damaged-round-00002", "damaged-round-00001"])
    assert folder.load_checkpoint() is None


# -- the CLI ------------------------------------------------------------------------------------------------------
def _resumable(tmp_path: Path) -> RunFolder:
    folder = make_run(tmp_path / "run", rounds=3)
    flat = {"num-server-rounds": 5, "max-examples": 300}
    (folder.path / "config.json").write_text(json.dumps(
        {"run_config": flat, "launcher": {"clusters": 2, "workers": [1, 1], "devices": ["cpu", "cpu"]}}))
    (folder.path / "summary.json").write_text('{"status": "interrupted"}')
    return folder


def test_resume_of_a_damaged_run_exits_2_with_one_line_and_changes_nothing(tmp_path):
    folder = _resumable(tmp_path)
    adapter = ckpt(folder, 3) / "adapter.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:100])
    before = snapshot(folder.path)
    proc = subprocess.run(nebula_cmd("run", "--resume", str(folder.path), "--port", "0"), capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("nebula-fl: error: "), proc.stderr
    assert "round-00003 is damaged: adapter.safetensors is truncated (100 bytes" in lines[0]
    assert "the previous checkpoint round-00002 is intact" in lines[0]
    assert f"`nebula-fl run --resume {folder.path} --rewind`" in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert snapshot(folder.path) == before


def test_rewind_without_resume_is_refused(tmp_path):
    proc = subprocess.run(nebula_cmd("run", "--rewind", "--out", str(tmp_path / "new"), "--port", "0"),
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "--rewind only goes with --resume DIR" in proc.stderr
    assert not (tmp_path / "new").exists()


def test_a_new_run_refuses_a_folder_holding_a_damaged_checkpoint(tmp_path):
    folder = make_run(tmp_path / "run", rounds=1)
    (ckpt(folder, 1) / MANIFEST).unlink()
    proc = subprocess.run(nebula_cmd("run", "--out", str(folder.path), "--port", "0"), capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "already holds a run" in proc.stderr, proc.stderr
