"""A cluster across machines: two trainers, `--nnodes 2 --node-rank 0|1`, one rank each, meeting at node 0's c10d
TCP store, train what one trainer with two ranks trains (the same bytes, under DDP and FSDP), and a node that dies
ends the other's ranks at once instead of leaving them waiting. (Two processes on one machine, over TCP; the
figures compare a round's time on two nodes with the same cluster on one.)"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import numpy as np
import pytest

from nebula_fl.clients.protocol import request
from nebula_fl.config import RunConfig
from nebula_fl.launcher.plan import free_port
from nebula_fl.model.adapter import adapter_arrays
from nebula_fl.model.loading import build_model
from tests.conftest import launch_trainer, nebula_cmd, shared_rank_host, stop_trainer

LABELS = ["business", "entertainment", "politics", "sports", "tech"]


def common(tmp_path, tiny_model, name: str, parallel: str) -> list[str]:
    return ["--threads", "1", "--model", str(tiny_model), "--state-dir", str(tmp_path / f"{name}-state"),
            "--dataset", "bbcnews", "--num-clusters", "2", "--max-examples", "300", "--cluster-id", "1",
            "--parallel", parallel]


def rounds(sock, config, start, n: int) -> tuple[dict, list[float]]:
    """`n` rounds from `start`, each from the last's update; (the last update, each round's seconds)."""
    arrays, times = start, []
    for r in range(1, n + 1):
        began = time.monotonic()
        _, update = request(sock, {"op": "train", "config": {**config, "server-round": r}}, arrays)
        times.append(time.monotonic() - began)
        arrays = {k: arrays[k] + update[k] for k in arrays}
    return update, times


@pytest.mark.e2e
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_nodes_of_one_rank_train_what_one_node_of_two_trains_and_a_lost_node_ends_the_cluster(
        tmp_path, tiny_model, parallel):
    cfg = RunConfig().replace({"model": str(tiny_model), "local-steps": 3, "batch-size": 4, "max-seq-len": 32})
    config = {**cfg.train.to_flat(), **cfg.model.to_flat(), "labels": LABELS, "federation-id": "f", "seed": 0}
    start = adapter_arrays(build_model(cfg.model, num_labels=5, seed=0))
    one_sock, two_sock = tmp_path / "one.sock", tmp_path / "two.sock"
    rendezvous = f"127.0.0.1:{free_port()}"
    procs = []
    try:
        one, hello = launch_trainer(["--socket", str(one_sock), "--workers", "2",
                                     *common(tmp_path, tiny_model, "one", parallel)],
                                    sock=one_sock, log_path=tmp_path / "one.log")
        procs.append(one)
        assert hello["workers"] == 2 and hello["nodes"] == 1
        # node 1 first: node 0's rank 0 answers only once every rank has met
        node1 = subprocess.Popen(nebula_cmd("trainer", "--workers", "1", "--nnodes", "2", "--node-rank", "1",
                                            "--rendezvous", rendezvous, "--rank-host", str(shared_rank_host()),
                                            *common(tmp_path, tiny_model, "node1", parallel)),
                                 stdout=(tmp_path / "node1.log").open("w"), stderr=subprocess.STDOUT)
        procs.append(node1)
        node0, hello = launch_trainer(["--socket", str(two_sock), "--workers", "1", "--nnodes", "2", "--node-rank",
                                       "0", "--rendezvous", rendezvous, *common(tmp_path, tiny_model, "node0", parallel)],
                                      sock=two_sock, log_path=tmp_path / "node0.log")
        procs.append(node0)
        assert hello["workers"] == 2 and hello["nodes"] == 2
        assert "node 1 of 2 (ranks 1-1 of 2" in (tmp_path / "node1.log").read_text()

        a, one_times = rounds(one_sock, config, start, 3)
        b, two_times = rounds(two_sock, config, start, 3)
        assert set(a) == set(b) == set(start)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        figures = {"parallel": parallel, "one_node_round_s": sorted(one_times)[1], "two_nodes_round_s":
                   sorted(two_times)[1]}
        (tmp_path / "multinode-figures.json").write_text(json.dumps(figures))
        print("multinode figures (median of 3 rounds):", figures)

        # node 1 dies: node 0's ranks learn it at their next collective and the trainer exits non-zero, at once
        node1.send_signal(signal.SIGKILL)
        node1.wait(10)
        began = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 (the cluster's reply is an error or a closed connection)
            request(two_sock, {"op": "train", "config": {**config, "server-round": 4}}, start)
        assert node0.wait(60) != 0
        assert time.monotonic() - began < 60
    finally:
        for proc in procs:
            if proc.poll() is None:
                stop_trainer(proc)
