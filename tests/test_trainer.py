"""The persistent trainer with real torch.distributed (2 gloo ranks), driven over its socket."""

import subprocess
import sys
import time

import numpy as np
import pytest

from nebula_fl.clients.protocol import request
from nebula_fl.config import RunConfig
from nebula_fl.errors import NebulaError
from nebula_fl.model.adapter import adapter_arrays
from nebula_fl.model.loading import build_model
from tests.conftest import nebula_cmd

LABELS = ["business", "entertainment", "politics", "sports", "tech"]


def start_trainer(tmp_path, tiny_model, name):
    sock = tmp_path / f"{name}.sock"
    log = (tmp_path / f"{name}.log").open("w")
    proc = subprocess.Popen(
        nebula_cmd("trainer", "--socket", str(sock), "--workers", "2", "--threads", "1", "--model", str(tiny_model),
                   "--state-dir", str(tmp_path / "state"), "--dataset", "bbcnews", "--num-clusters", "2",
                   "--max-examples", "300", "--cluster-id", "1"),
        stdout=log, stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            return proc, sock, request(sock, {"op": "hello"})[0]
        except NebulaError:
            assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.3)


def stop(proc):
    proc.terminate()
    assert proc.wait(20) == 0


@pytest.fixture
def round_config(tiny_model):
    cfg = RunConfig().replace({"model": str(tiny_model), "local-steps": 4, "batch-size": 4, "max-seq-len": 32})

    def make(rnd, **extra):
        return {**cfg.train.to_flat(), **cfg.model.to_flat(), "labels": LABELS, "federation-id": "fed1",
                "seed": 0, "server-round": rnd, **extra}

    return cfg, make


def test_ddp_ranks_stay_in_sync_and_snapshots_restore_exactly(tmp_path, tiny_model, round_config):
    cfg, make = round_config
    global_adapter = adapter_arrays(build_model(cfg.model, num_labels=5, seed=0))
    proc, sock, info = start_trainer(tmp_path, tiny_model, "a")
    try:
        assert info["workers"] == 2 and info["num_examples"] > 0
        r1, u1 = request(sock, {"op": "train", "config": make(1)}, global_adapter)
        m = r1["metrics"]
        assert m["rank-divergence"] == 0.0 and m["workers"] == 2 and m["steps"] == 4
        assert m["examples-seen"] == 4 * 4 * 2
        assert set(u1) == set(global_adapter)
        assert all(np.isfinite(v).all() for v in u1.values())
        assert sum(float(np.abs(v).sum()) for v in u1.values()) > 0
        _, u2 = request(sock, {"op": "train", "config": make(2)}, global_adapter)
        # round 2 resent (as after a server resume): restored from the round-1 snapshot, same result
        _, u2_again = request(sock, {"op": "train", "config": make(2)}, global_adapter)
        for k in u2:
            np.testing.assert_array_equal(u2[k], u2_again[k])
        assert any(not np.array_equal(u1[k], u2[k]) for k in u1)  # the batch stream moved on
        _, u3 = request(sock, {"op": "train", "config": make(3)}, global_adapter)
        with pytest.raises(NebulaError, match="not a plain name"):
            request(sock, {"op": "train", "config": make(4, **{"federation-id": "../../escape"})}, global_adapter)
        with pytest.raises(NebulaError, match="labels"):
            request(sock, {"op": "train", "config": make(4, labels=["only", "two"], **{"federation-id": "fed2"})},
                    global_adapter)
    finally:
        stop(proc)
    # a new trainer process (a restarted cluster) continues from the snapshot on disk
    proc, sock, _ = start_trainer(tmp_path, tiny_model, "b")
    try:
        _, u3_restarted = request(sock, {"op": "train", "config": make(3)}, global_adapter)
    finally:
        stop(proc)
    for k in u3:
        np.testing.assert_array_equal(u3[k], u3_restarted[k])


def test_the_clientapp_does_not_import_torch():
    code = "import sys, nebula_fl.clients.app; sys.exit(int('torch' in sys.modules or 'transformers' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
