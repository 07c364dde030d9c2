"""A cluster's trainer under torchrun: its place from torchrun's environment, the node given `--socket` renumbered
to node 0 whatever order torchrun's rendezvous chose, and, end to end, two torchrun agents meeting at a c10d
rendezvous train what one trainer with two ranks trains (the same bytes), and a lost worker ends both agents."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from nebula_fl.clients.protocol import request
from nebula_fl.clients.torchrun import TorchrunWorker, node_zero, renumbered, torchrun_worker
from nebula_fl.errors import NebulaError
from nebula_fl.launcher.plan import free_port
from tests.conftest import launch_trainer, still_running, stop_trainer
from tests.test_multinode import LABELS, common, rounds

ENV = {"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2",
       "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_RESTART_COUNT": "2"}


def test_a_worker_reads_its_place_from_torchruns_environment_and_none_without_it():
    assert torchrun_worker({}) is None
    assert torchrun_worker({k: v for k, v in ENV.items() if k != "TORCHELASTIC_RUN_ID"}) is None
    w = torchrun_worker(ENV)
    assert (w.rank, w.local_rank, w.world, w.local_world, w.group_rank, w.nnodes, w.restart, w.master) == (
        3, 1, 6, 2, 1, 3, 2, "10.0.0.1:29400")
    with pytest.raises(NebulaError, match="without GROUP_RANK, MASTER_PORT"):
        torchrun_worker({k: v for k, v in ENV.items() if k not in ("GROUP_RANK", "MASTER_PORT")})
    with pytest.raises(NebulaError, match="must be integers"):
        torchrun_worker({**ENV, "RANK": "three"})
    with pytest.raises(NebulaError, match="same --nproc-per-node"):
        torchrun_worker({**ENV, "WORLD_SIZE": "5"})
    with pytest.raises(NebulaError, match="not one node's block"):
        torchrun_worker({**ENV, "RANK": "4"})


@pytest.mark.parametrize("nnodes,local_world", [(1, 1), (1, 4), (2, 1), (3, 2), (4, 3)])
def test_the_node_given_the_socket_becomes_node_zero_and_every_node_keeps_one_block_of_ranks(nnodes, local_world):
    for serving in range(nnodes):
        said = [rank // local_world == serving for rank in range(nnodes * local_world)]
        assert node_zero(said, local_world=local_world) == serving
        placed = {}
        for rank in range(nnodes * local_world):
            w = TorchrunWorker(rank=rank, local_rank=rank % local_world, world=nnodes * local_world,
                               local_world=local_world, group_rank=rank // local_world, restart=0, master="h:1")
            placed[rank] = renumbered(w, node0=serving)
        assert sorted(r for _, r in placed.values()) == list(range(nnodes * local_world))  # a permutation
        for rank, (node, new) in placed.items():
            assert new // local_world == node and new % local_world == rank % local_world  # one block, local order
            assert (node == 0) == (rank // local_world == serving)


def test_a_cluster_under_torchrun_needs_exactly_one_node_given_the_socket():
    with pytest.raises(NebulaError, match="but none was"):
        node_zero([False] * 4, local_world=2)
    with pytest.raises(NebulaError, match=r"but nodes 0, 1 \(torchrun's numbering\) were"):
        node_zero([True, False, False, True], local_world=2)


def test_flags_torchrun_sets_are_refused_under_it(tmp_path, monkeypatch, capsys):
    from nebula_fl.cli import main

    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    code = main(["trainer", "--dataset", "bbcnews", "--socket", str(tmp_path / "s"), "--workers", "2", "--nnodes", "3"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("nebula-fl: error: --workers, --nnodes given to a trainer under torchrun")
    assert len(err.splitlines()) == 1


def torchrun(tmp_path, tiny_model, name: str, endpoint: str, *extra: str) -> subprocess.Popen:
    """One machine's torchrun agent with one worker, meeting the others at a c10d rendezvous (elastic: its node
    numbers come from the rendezvous, not from the command), never restarting a failed worker."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "cluster-1", "--max-restarts", "0",
           "-m", "nebula_fl", "trainer", *common(tmp_path, tiny_model, name, "ddp"), *extra]
    return subprocess.Popen(cmd, stdout=(tmp_path / f"{name}.log").open("w"), stderr=subprocess.STDOUT)


@pytest.mark.e2e
def test_two_torchrun_nodes_train_what_one_trainer_of_two_ranks_trains_and_a_lost_worker_ends_both(
        tmp_path, tiny_model):
    from nebula_fl.config import RunConfig
    from nebula_fl.model.adapter import adapter_arrays
    from nebula_fl.model.loading import build_model

    cfg = RunConfig().replace({"model": str(tiny_model), "local-steps": 3, "batch-size": 4, "max-seq-len": 32})
    config = {**cfg.train.to_flat(), **cfg.model.to_flat(), "labels": LABELS, "federation-id": "f", "seed": 0}
    start = adapter_arrays(build_model(cfg.model, num_labels=5, seed=0))
    one_sock, run_sock = tmp_path / "one.sock", tmp_path / "torchrun.sock"
    endpoint = f"127.0.0.1:{free_port()}"
    agents, one = [], None
    try:
        one, _ = launch_trainer(["--socket", str(one_sock), "--workers", "2",
                                 *common(tmp_path, tiny_model, "one", "ddp")], sock=one_sock, log_path=tmp_path / "one.log")
        # the machine without the SuperNode starts first, so c10d's rendezvous (ordering nodes by address and process
        # id) usually numbers it 0: the node given --socket is renumbered to the cluster's node 0 either way
        agents.append(torchrun(tmp_path, tiny_model, "other", endpoint))
        agents.append(torchrun(tmp_path, tiny_model, "beside", endpoint, "--socket", str(run_sock)))
        deadline = time.monotonic() + 120
        while True:
            try:
                hello = request(run_sock, {"op": "hello"})[0]
                break
            except NebulaError:
                for agent in agents:
                    assert agent.poll() is None, (tmp_path / "other.log").read_text() + (tmp_path / "beside.log").read_text()
                assert time.monotonic() < deadline, "the torchrun cluster did not answer within 120 s"
                time.sleep(0.3)
        assert hello["workers"] == 2 and hello["nodes"] == 2
        beside, other = (tmp_path / "beside.log").read_text(), (tmp_path / "other.log").read_text()
        assert "node 0 of 2 (ranks 0-0 of 2" in beside and "under torchrun (its node" in beside, beside
        assert "node 1 of 2 (ranks 1-1 of 2" in other and "no socket (node 0 serves the cluster)" in other, other

        a, _ = rounds(one_sock, config, start, 2)
        b, _ = rounds(run_sock, config, start, 2)
        assert set(a) == set(b) == set(start)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)

        # the other machine's worker dies: its agent fails (no restarts left), node 0's worker fails at its next
        # collective, and its agent exits non-zero too: never a cluster left waiting
        worker = next(p for p in psutil.Process(agents[0].pid).children(recursive=True)
                      if "nebula_fl" in " ".join(p.cmdline()))
        workers = [*psutil.Process(agents[1].pid).children(recursive=True), worker]
        worker.send_signal(signal.SIGKILL)
        began = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 (the cluster's reply is an error or a closed connection)
            request(run_sock, {"op": "train", "config": {**config, "server-round": 3}}, start)
        assert agents[0].wait(60) != 0 and agents[1].wait(60) != 0
        assert time.monotonic() - began < 60
        assert not still_running(workers, timeout=10)
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
                agent.wait(30)
        if one is not None and one.poll() is None:
            stop_trainer(one)
