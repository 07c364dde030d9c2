"""The rank host (`nebula_fl/clients/rank_host.py`): trainers that fork their ranks from it train exactly as with
their own fork server, log where they would, are told when a rank dies and take their ranks with them when they
die; a host that is gone, or a client without its key, changes nothing but the imports paid."""

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing import reduction
from multiprocessing.connection import Client

import numpy as np
import psutil
import pytest

from nebula_fl.clients.protocol import key_path, request
from nebula_fl.config import RunConfig
from nebula_fl.lifetime import preexec_die_with_parent
from nebula_fl.model.adapter import adapter_arrays
from nebula_fl.model.loading import build_model
from tests.conftest import launch_trainer, shared_rank_host, still_running, stop_trainer

LABELS = ["business", "entertainment", "politics", "sports", "tech"]


def trainer(tmp_path, tiny_model, name, *extra, rank_host=False):
    sock = tmp_path / f"{name}.sock"
    args = ["--socket", str(sock), "--workers", "2", "--threads", "1", "--model", str(tiny_model), "--state-dir",
            str(tmp_path / f"{name}-state"), "--dataset", "bbcnews", "--num-clusters", "2", "--max-examples", "300",
            "--cluster-id", "1", *extra]
    proc, _ = launch_trainer(args, sock=sock, log_path=tmp_path / f"{name}.log", rank_host=rank_host)
    return proc, sock


def descendants(pid: int) -> set[int]:
    return {p.pid for p in psutil.Process(pid).children(recursive=True)}


def ranks_logging_to(host: int, log) -> list[psutil.Process]:
    """The host's ranks that write to a trainer's log: a hosted rank's stdout is its trainer's."""
    found = []
    for proc in psutil.Process(host).children(recursive=True):
        try:
            if any(f.path == str(log) for f in proc.open_files()):
                found.append(proc)
        except psutil.Error:
            pass
    return found


def test_hosted_ranks_train_as_a_trainers_own_are_supervised_and_die_with_it_and_a_gone_host_changes_nothing(tmp_path, tiny_model):
    cfg = RunConfig().replace({"model": str(tiny_model), "local-steps": 3, "batch-size": 4, "max-seq-len": 32})
    config = {**cfg.train.to_flat(), **cfg.model.to_flat(), "labels": LABELS, "federation-id": "f", "seed": 0,
              "server-round": 1}
    start = adapter_arrays(build_model(cfg.model, num_labels=5, seed=0))
    sock = tmp_path / "host.sock"
    host = subprocess.Popen([sys.executable, "-m", "nebula_fl.clients.rank_host", "--socket", str(sock)],
                            stdout=(tmp_path / "host.log").open("w"), stderr=subprocess.STDOUT,
                            preexec_fn=preexec_die_with_parent(signal.SIGTERM))
    stale = tmp_path / "gone.sock"  # a socket file nobody listens on, and a key: what a host that died leaves
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(stale))
    listener.close()
    key_path(stale).write_bytes(b"k" * 32)
    hosted = own = killed = None
    try:
        hosted, hosted_sock = trainer(tmp_path, tiny_model, "hosted", "--rank-host", str(sock))
        own, own_sock = trainer(tmp_path, tiny_model, "own", "--rank-host", str(stale))
        # where the ranks are: under the host, not the hosted trainer; the trainer whose host is gone said so and
        # forked its ranks from its own fork server
        assert not descendants(hosted.pid) and len(descendants(own.pid)) >= 3  # fork server, 2 ranks (+ tracker)
        assert len(descendants(host.pid)) >= 3
        assert f"the rank host at '{stale}' cannot be reached (ConnectionRefusedError)" in (tmp_path / "own.log").read_text()
        # the same round from the same start: the same bytes, and the round's line in the trainer's own log
        _, a = request(hosted_sock, {"op": "train", "config": config}, start)
        _, b = request(own_sock, {"op": "train", "config": config}, start)
        assert set(a) == set(b) == set(start)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        assert "round 1: loss" in (tmp_path / "hosted.log").read_text()
        assert "round 1: loss" not in (tmp_path / "host.log").read_text()
        # a rank that dies is reported by the host: its trainer stops the other and exits non-zero
        ranks = ranks_logging_to(host.pid, tmp_path / "hosted.log")
        assert len(ranks) == 2
        ranks[-1].kill()
        assert hosted.wait(30) == 1
        assert "exited with -9" in (tmp_path / "hosted.log").read_text()
        alive = still_running(ranks, timeout=15)
        assert not alive
        # a trainer killed outright takes its hosted ranks with it; the host and the other trainer go on
        killed, _ = trainer(tmp_path, tiny_model, "killed", "--rank-host", str(sock))
        ranks = ranks_logging_to(host.pid, tmp_path / "killed.log")
        assert len(ranks) == 2
        killed.kill()
        killed.wait()
        alive = still_running(ranks, timeout=15)
        assert not alive and host.poll() is None
        assert request(own_sock, {"op": "hello"})[0]["ok"]
    finally:
        for proc in (hosted, own, killed):
            if proc is not None and proc.poll() is None:
                try:
                    stop_trainer(proc)
                except (AssertionError, subprocess.TimeoutExpired):
                    proc.kill()  # its ranks die with it
        helpers = psutil.Process(host.pid).children()  # its fork server and resource tracker
        tree = [psutil.Process(pid) for pid in descendants(host.pid)]
        host.terminate()
        assert host.wait(30) == 0
        # the host reaped its own helpers before it exited: not even a zombie is left for init to reap (a container's
        # init may never do it)
        assert not [(p.pid, p.status()) for p in helpers if p.is_running()]
        alive = still_running(tree, timeout=15)
        assert not alive, [(p.pid, p.name()) for p in alive]


def test_a_client_without_the_hosts_key_is_refused_and_the_host_serves_on():
    sock = shared_rank_host()
    deadline = time.monotonic() + 30
    while not sock.exists():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    with pytest.raises(multiprocessing.AuthenticationError):
        Client(str(sock), family="AF_UNIX", authkey=b"not the key" * 3)
    with Client(str(sock), family="AF_UNIX", authkey=key_path(sock).read_bytes()) as conn:
        conn.send(("no such request", "x", ()))
        with pytest.raises(EOFError):  # a request it cannot make sense of closes that connection only
            conn.recv()
    # a rank that fails at once (no rank arguments), its trainer gone the moment it started: the host serves on,
    # and the next trainer is told its rank's exit status
    for hang_up in (True, False):
        with Client(str(sock), family="AF_UNIX", authkey=key_path(sock).read_bytes()) as conn, \
                open(os.devnull, "w") as devnull:
            conn.send(("start", "broken", (dict(os.environ), os.getcwd(), 0o077)))
            for _ in range(2):
                reduction.send_handle(conn, devnull.fileno(), 0)
            assert conn.recv()[:2] == ("started", 0)
            if not hang_up:
                assert conn.recv() == ("exited", 0, 1)
