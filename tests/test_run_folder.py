import numpy as np
import pytest

from nebula_fl.server.checkpoint import join_state, split_state
from nebula_fl.server.run_folder import RunFolder


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
