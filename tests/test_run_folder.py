import os
import re
import stat
import threading
import time

import numpy as np
import pytest

from nebula_fl.storage.checkpoint import join_state, split_state
from nebula_fl.storage.run_folder import RunFolder
from tests.test_run_status import evaluator_for


def test_nested_state_round_trips_through_split_and_join():
    rng = np.random.default_rng(0)
    state = {"name": "adam", "t": 3, "m": {"a": rng.standard_normal(4)}, "v": None,
             "rng": rng.bit_generator.state, "list": [np.ones(2), 5]}
    skeleton, arrays = split_state(state)
    back = join_state(skeleton, arrays)
    assert back["name"] == "adam" and back["t"] == 3 and back["v"] is None
    np.testing.assert_array_equal(back["m"]["a"], state["m"]["a"])
    np.testing.assert_array_equal(back["list"][0], np.ones(2))
    assert back["rng"] == state["rng"]


def test_checkpoint_keeps_the_newest_two_and_loads_the_latest(tmp_path):
    folder = RunFolder(tmp_path / "run")
    folder.path.mkdir()
    for r in (1, 2, 3):
        folder.save_checkpoint(round=r, adapter={"w": np.full(3, r, np.float32)}, state={"velocity": {"w": np.ones(3) * r}})
    done, adapter, state = folder.load_checkpoint()
    assert done == 3
    np.testing.assert_array_equal(adapter["w"], [3, 3, 3])
    np.testing.assert_array_equal(state["velocity"]["w"], [3, 3, 3])
    assert sorted(p.name for p in (folder.path / "checkpoint").iterdir()) == ["latest", "round-00002", "round-00003"]


def test_truncate_keeps_each_round_once_up_to_the_checkpoint(tmp_path):
    folder = RunFolder(tmp_path)
    for r in (1, 2, 3, 2):
        folder.append_round({"round": r, "accuracy": r / 10})
    with (folder.path / "metrics.jsonl").open("a") as f:
        f.write('{"round": 4, "accur')  # a line cut short by a crash
    folder.truncate_rounds(2)
    assert [line["round"] for line in folder.rounds()] == [1, 2]


def test_summary_refuses_unknown_status(tmp_path):
    folder = RunFolder(tmp_path)
    folder.update_summary(status="running")
    with pytest.raises(ValueError):
        folder.update_summary(status="done-ish")
    assert folder.read_summary()["status"] == "running"


# -- summary and config are written as checkpoints are ---------------------------------------------------------------
def test_a_summary_or_config_write_that_dies_after_its_temp_file_leaves_the_previous_file(tmp_path, monkeypatch):
    folder = RunFolder(tmp_path)
    folder.write_config({"run_config": {"seed": 1}})
    folder.update_summary(status="running", rounds_completed=1)
    before = {name: (tmp_path / name).read_bytes() for name in ("config.json", "summary.json")}
    temp_files = []

    def crash(fd):  # the temp file is written; the crash comes before it replaces anything
        temp_files.extend(p.name for p in tmp_path.glob(".*.tmp"))
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="Input/output"):
        folder.update_summary(status="completed", rounds_completed=2)
    with pytest.raises(OSError, match="Input/output"):
        folder.write_config({"run_config": {"seed": 2}})
    monkeypatch.undo()
    assert [re.fullmatch(r"\.(summary|config)\.json\.[0-9a-f]{16}\.tmp", name)[1] for name in temp_files] == [
        "summary", "config"]
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert folder.read_summary()["status"] == "running" and not list(tmp_path.glob(".*.tmp"))


def test_summary_and_config_are_fsynced_with_their_folder(tmp_path, monkeypatch):
    folder, synced = RunFolder(tmp_path), []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    folder.write_config({"run_config": {}})
    assert synced == ["file", "folder"]
    folder.update_summary(status="running")
    assert synced == ["file", "folder"] * 2


# -- a round whose record fails while the next runs: the run fails, and its resume has every round once -------------
# The ServerApp's evaluator without a model: accuracy r/10 for round r (tests/test_run_status.py).
_Evaluator = evaluator_for({"w": np.zeros(3, np.float32)})


@pytest.mark.parametrize("breaks", ["save_checkpoint", "append_round"])
def test_a_record_failing_while_the_next_round_runs_fails_the_run_and_a_resume_records_every_round_once(
    tmp_path, monkeypatch, breaks
):
    from nebula_fl.config import OuterConfig, RunConfig
    from nebula_fl.server import app
    from nebula_fl.strategies import make_strategy
    from nebula_fl.strategies.base import RoundFinishFailed
    from tests.test_round_faults import GatedGrid, ScriptedGrid

    # Prepare: an in-process ServerApp run of 4 rounds whose record of round 2 fails once round 3 is being trained
    monkeypatch.setattr(app, "ServerEvaluator", _Evaluator)
    monkeypatch.setattr(app, "plot_metric_vs_bytes", lambda *args, **kwargs: None)  # not what is tested; slow
    monkeypatch.setattr(app, "build_strategy", lambda cfg, initial=None: make_strategy(OuterConfig()))
    flat = {"out-dir": str(tmp_path / "run"), "num-server-rounds": 4, "min-clusters": 1, "eval-overlap": True}
    round_three, raised, broken = threading.Event(), threading.Event(), []
    real = getattr(RunFolder, breaks)

    def record(self, *args, **kwargs):
        line_round = kwargs["round"] if breaks == "save_checkpoint" else args[0]["round"]
        if line_round == 2 and not broken:
            assert round_three.wait(10), "round 3 never started"
            broken.append(line_round)
            raised.set()
            raise OSError(28, "No space left on device")
        return real(self, *args, **kwargs)

    def on_round(n):
        if n == 3:
            round_three.set()
            assert raised.wait(10), "round 2's record never failed"
            time.sleep(0.3)

    monkeypatch.setattr(RunFolder, breaks, record)
    folder = RunFolder(tmp_path / "run")
    # Execute
    with pytest.raises(RoundFinishFailed, match="No space left"):
        app.ServerRun(RunConfig.from_flat(flat)).run(GatedGrid({1: "0"}, on_round=on_round))
    # Assert: failed with the error, naming the round and the step, and nothing recorded after the missing round
    summary = folder.read_summary()
    step = "checkpoint" if breaks == "save_checkpoint" else "record"
    assert summary["status"] == "failed" and f"round 2's {step} failed: OSError: " in summary["error"]
    assert "No space left" in summary["error"]
    assert [line["round"] for line in folder.rounds()] == [1]
    assert folder.load_checkpoint()[0] == (1 if breaks == "save_checkpoint" else 2)
    # Execute: resume, nothing failing now
    app.ServerRun(RunConfig.from_flat({**flat, "resume": True})).run(ScriptedGrid({1: "0"}))
    # Assert: every round's line exactly once, in order, and the run completed
    lines = folder.rounds()
    assert [line["round"] for line in lines] == [1, 2, 3, 4]
    assert [line["accuracy"] for line in lines] == [0.1, 0.2, 0.3, 0.4]
    summary = folder.read_summary()
    assert summary["status"] == "completed" and summary["rounds_completed"] == 4 and summary["error"] is None


def test_a_signal_whose_exception_turns_into_another_error_still_ends_the_run_as_interrupted(tmp_path, monkeypatch):
    """SIGTERM's exception raised inside a lock's bookkeeping surfaces as another error (a RuntimeError "release
    unlocked lock" was seen in a real run): the run is still interrupted (exit 130), never failed."""
    import os
    import signal

    from nebula_fl.config import OuterConfig, RunConfig
    from nebula_fl.server import app
    from nebula_fl.strategies import make_strategy
    from tests.test_round_faults import GatedGrid

    monkeypatch.setattr(app, "ServerEvaluator", _Evaluator)
    monkeypatch.setattr(app, "plot_metric_vs_bytes", lambda *args, **kwargs: None)
    monkeypatch.setattr(app, "build_strategy", lambda cfg, initial=None: make_strategy(OuterConfig()))

    def on_round(n):
        if n == 2:
            try:
                os.kill(os.getpid(), signal.SIGTERM)  # the handler raises here, as in a lock's release
                time.sleep(1)
            except BaseException:
                raise RuntimeError("release unlocked lock") from None

    flat = {"out-dir": str(tmp_path / "run"), "num-server-rounds": 3, "min-clusters": 1}
    with pytest.raises(SystemExit) as stop:
        app.ServerRun(RunConfig.from_flat(flat)).run(GatedGrid({1: "0"}, on_round=on_round))
    summary = RunFolder(tmp_path / "run").read_summary()
    assert stop.value.code == 130 and summary["status"] == "interrupted" and summary["error"] == "stopped by SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is not None and [x["round"] for x in RunFolder(tmp_path / "run").rounds()] == [1]


def test_concurrent_summary_writers_neither_collide_on_a_temp_file_nor_lose_each_others_fields(tmp_path):
    """The ServerApp and the launcher both update summary.json: each write has its own temp file, and each
    read-change-write holds the folder's summary lock."""
    folder, errors = RunFolder(tmp_path), []
    folder.update_summary(status="running")

    def writer(t):
        try:
            for i in range(25):
                RunFolder(tmp_path).update_summary(**{f"w{t}_{i}": i})
        except Exception as err:  # e.g. FileNotFoundError: another writer renamed the shared temp file away
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    summary = folder.read_summary()
    assert all(f"w{t}_{i}" in summary for t in range(6) for i in range(25)) and summary["status"] == "running"
    assert not list(tmp_path.glob(".*.tmp"))
