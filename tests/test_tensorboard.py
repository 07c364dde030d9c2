"""TensorBoardLog: round lines read back by TensorBoard's own reader, tag by tag and step by step."""

from __future__ import annotations

import copy
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nebula_fl.errors import NebulaError
from nebula_fl.server.tensorboard import TensorBoardLog

# Two lines of a real run (`nebula-fl run --preset smoke --clusters 2 --rounds 2`, tiny model), plus the
# optional parts a run may add: a timeline, client-level DP's privacy object, a secagg report, WAN counters.
ROUND_1 = {
    "round": 1, "accuracy": 0.2833333333333333, "macro_f1": 0.22642089093701995, "loss": 1.5704569498697916,
    "train_loss": 1.3589680820703507, "clusters_aggregated": 2, "update_norm": 2.7937212321905927,
    "bytes_up": 12531, "bytes_down": 3433, "cumulative_bytes_up": 12531, "cumulative_bytes_down": 3433,
    "cumulative_bytes": 15964, "wan_bytes_up": 14000, "wan_bytes_down": 5000, "wan_requests": 12,
    "cumulative_wan_bytes": 19000, "seconds": 3.1308043140015798, "elapsed_seconds": 3.382455918999767,
    "clusters": {
        "1": {"node_id": 2111663661369505225, "bytes_up": 6265, "bytes_down": 1716, "num_examples": 96,
              "train_loss": 1.1863746643066406, "seconds": 0.0686726189996989, "rank_divergence": 0.0,
              "reply_sent_at": 1796311855.7955093, "device": "cpu", "codec_up": "none"},
        "0": {"node_id": 13228702101170915483, "bytes_up": 6266, "bytes_down": 1717, "num_examples": 144,
              "train_loss": 1.4740303605794907, "seconds": 0.06779108000046108, "rank_divergence": 0.0,
              "reply_sent_at": 1796311855.977167, "device": "cpu", "codec_up": "none"},
    },
    "rejected": {}, "skipped": None,
    "privacy": {"mode": "client", "epsilon": 1.25, "delta": 1e-05, "noise_multiplier": 0.9, "sample_rate": 1.0,
                "rounds": 1, "accountant": "prv"},
    "secagg": {"setup_s": 0.4, "sampled": 2, "uploaded": 2, "survivors": 2, "dropped": []},
    "timeline": {"configure_s": 0.1, "push_s": 0.01, "exchange_s": 5.2, "aggregate_s": 0.2, "evaluate_s": 3.1,
                 "checkpoint_s": 0.05, "overhead_s": 4.0,
                 "clusters": {"0": {"pickup_s": 2.1, "compute_s": 1.0, "upload_s": 0.7},
                              "1": {"pickup_s": 1.9, "compute_s": 1.2, "upload_s": 0.5}}},
}
ROUND_2 = copy.deepcopy(ROUND_1)
ROUND_2.update(round=2, accuracy=0.38333333333333336, loss=1.5526643117268881, bytes_down=13129,
               cumulative_bytes=41624, seconds=5.087214219998714)
ROUND_2["clusters"]["0"]["bytes_down"] = 6565
ROUND_2["privacy"]["epsilon"] = 1.75
ROUND_2["timeline"]["clusters"]["1"]["pickup_s"] = 3.5

# Written by hand from the lines above: every tag a numeric, non-id field must produce, and nothing else.
EXPECTED_TAGS = {
    "eval/accuracy", "eval/macro_f1", "eval/loss", "train/loss", "train/update_norm", "train/clusters_aggregated",
    "bytes/up", "bytes/down", "bytes/cumulative_up", "bytes/cumulative_down", "bytes/cumulative",
    "bytes/wan_up", "bytes/wan_down", "bytes/wan_requests", "bytes/wan_cumulative",
    "time/round_seconds", "time/elapsed_seconds",
    *(f"cluster_{c}/{k}" for c in "01" for k in ("bytes_up", "bytes_down", "num_examples", "train_loss", "seconds",
                                                 "rank_divergence")),
    "privacy/epsilon", "privacy/delta", "privacy/noise_multiplier", "privacy/sample_rate", "privacy/rounds",
    "secagg/setup_s", "secagg/sampled", "secagg/uploaded", "secagg/survivors",
    "timeline/configure_s", "timeline/push_s", "timeline/exchange_s", "timeline/aggregate_s", "timeline/evaluate_s",
    "timeline/checkpoint_s", "timeline/overhead_s",
    *(f"timeline/cluster_{c}/{k}" for c in "01" for k in ("pickup_s", "compute_s", "upload_s")),
}


def read_back(folder: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} as TensorBoard itself reads the folder's event files."""
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {event.step: event.value for event in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_round_lines_become_grouped_scalars_per_round(tmp_path: Path) -> None:
    log = TensorBoardLog(folder=tmp_path / "tensorboard")
    log.write(ROUND_1)
    log.write(ROUND_2)
    log.close()
    got = read_back(tmp_path / "tensorboard")

    assert set(got) == EXPECTED_TAGS
    assert all(set(steps) == {1, 2} for steps in got.values())
    # Event files store float32: compare to ~7 significant digits.
    expected = {
        "eval/accuracy": {1: 0.2833333333333333, 2: 0.38333333333333336},
        "eval/loss": {1: 1.5704569498697916, 2: 1.5526643117268881},
        "train/loss": {1: 1.3589680820703507, 2: 1.3589680820703507},
        "bytes/up": {1: 12531, 2: 12531},
        "bytes/down": {1: 3433, 2: 13129},
        "bytes/cumulative": {1: 15964, 2: 41624},
        "bytes/wan_cumulative": {1: 19000, 2: 19000},
        "time/round_seconds": {1: 3.1308043140015798, 2: 5.087214219998714},
        "cluster_0/bytes_down": {1: 1717, 2: 6565},
        "cluster_1/bytes_down": {1: 1716, 2: 1716},
        "cluster_0/train_loss": {1: 1.4740303605794907, 2: 1.4740303605794907},
        "privacy/epsilon": {1: 1.25, 2: 1.75},
        "secagg/survivors": {1: 2, 2: 2},
        "timeline/exchange_s": {1: 5.2, 2: 5.2},
        "timeline/cluster_1/pickup_s": {1: 1.9, 2: 3.5},
        "timeline/cluster_0/upload_s": {1: 0.7, 2: 0.7},
    }
    for tag, steps in expected.items():
        assert got[tag] == {step: pytest.approx(value, rel=1e-6) for step, value in steps.items()}, tag


def test_a_line_without_optional_parts_writes_what_it_has(tmp_path: Path) -> None:
    # A skipped round: no evaluation, no train loss, one cluster that never answered, no privacy/timeline/WAN.
    skipped = {
        "round": 3, "accuracy": None, "macro_f1": None, "loss": None, "train_loss": None, "clusters_aggregated": None,
        "update_norm": None, "bytes_up": 0, "bytes_down": 3433, "cumulative_bytes_up": 25062,
        "cumulative_bytes_down": 19995, "cumulative_bytes": 45057, "seconds": 12.5, "elapsed_seconds": 21.0,
        "clusters": {"0": {"node_id": 13228702101170915483, "bytes_up": 0, "bytes_down": 1717},
                     "node-99": {"node_id": 99, "bytes_up": 0, "bytes_down": 1716, "stopped": True}},
        "rejected": {"0": "timed out"}, "skipped": "1 usable update, min-clusters is 2",
    }
    log = TensorBoardLog(folder=tmp_path)
    log.write(skipped)
    log.close()
    got = read_back(tmp_path)

    assert set(got) == {"bytes/up", "bytes/down", "bytes/cumulative_up", "bytes/cumulative_down", "bytes/cumulative",
                        "time/round_seconds", "time/elapsed_seconds", "cluster_0/bytes_up", "cluster_0/bytes_down",
                        "cluster_node-99/bytes_up", "cluster_node-99/bytes_down"}
    assert got["bytes/cumulative"] == {3: 45057.0}
    assert got["cluster_node-99/bytes_down"] == {3: 1716.0}


def test_a_run_that_dies_without_close_keeps_every_round_it_wrote(tmp_path: Path) -> None:
    # A real process writes two rounds and dies at once (no close, no atexit), as a killed server would.
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from nebula_fl.server.tensorboard import TensorBoardLog\n"
        "from tests.test_tensorboard import ROUND_1, ROUND_2\n"
        "log = TensorBoardLog(folder=Path(sys.argv[1]))\n"
        "log.write(ROUND_1)\n"
        "log.write(ROUND_2)\n"
        "os._exit(3)\n"
    )
    died = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=Path(__file__).parent.parent, check=False)
    assert died.returncode == 3
    got = read_back(tmp_path)
    assert set(got) == EXPECTED_TAGS
    assert all(set(steps) == {1, 2} for steps in got.values())


def test_closing_twice_is_harmless(tmp_path: Path) -> None:
    log = TensorBoardLog(folder=tmp_path)
    log.write(ROUND_1)
    log.close()
    log.close()
    assert read_back(tmp_path)["privacy/epsilon"] == {1: 1.25}


def test_a_resumed_run_adds_rounds_to_the_same_folder(tmp_path: Path) -> None:
    first = TensorBoardLog(folder=tmp_path)
    first.write(ROUND_1)
    first.close()
    time.sleep(1.1)  # event file names carry whole seconds; a later session sorts after the first
    second = TensorBoardLog(folder=tmp_path)
    second.write(ROUND_2)
    second.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    assert read_back(tmp_path)["bytes/down"] == {1: 3433.0, 2: 13129.0}


def test_bad_input_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(NebulaError, match="is a file"):
        TensorBoardLog(folder=tmp_path / "file")
    log = TensorBoardLog(folder=tmp_path / "tb")
    for line in ({"accuracy": 0.5}, {"round": True}, {"round": -1}, {"round": 1.0}):
        with pytest.raises(ValueError, match="non-negative integer 'round'"):
            log.write(line)
    log.close()
    with pytest.raises(RuntimeError, match="closed"):
        log.write(ROUND_1)


def test_utilisation_is_a_curve_per_cluster_and_for_the_round() -> None:
    from nebula_fl.server.tensorboard import scalars

    line = {"round": 3, "clusters": {"0": {"busy_seconds": 3.0, "since_send_seconds": 4.0}},
            "timeline": {"round_s": 5.0, "busy_fraction_min": 0.75, "idle_s_max": 1.0,
                         "clusters": {"0": {"busy_fraction": 0.75, "idle_s": 1.0}, "1": {}}}}
    assert dict(scalars(line)) == {
        "cluster_0/busy_seconds": 3.0, "cluster_0/since_send_seconds": 4.0,
        "timeline/round_s": 5.0, "timeline/busy_fraction_min": 0.75, "timeline/idle_s_max": 1.0,
        "timeline/cluster_0/busy_fraction": 0.75, "timeline/cluster_0/idle_s": 1.0,
    }
