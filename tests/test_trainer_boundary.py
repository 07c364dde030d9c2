"""The cluster's trainer is its boundary: tried on a real trainer process with what a curious server could send."""

import json
import os
import signal
import socket
import subprocess
import time

import numpy as np
import psutil
import pytest
from opacus.accountants import RDPAccountant

from nebula_fl.clients.protocol import request
from nebula_fl.config import RunConfig
from nebula_fl.errors import NebulaError
from nebula_fl.model.adapter import adapter_arrays
from nebula_fl.model.loading import build_model
from tests.conftest import launch_trainer, nebula_cmd, still_running, stop_trainer

LABELS = ["business", "entertainment", "politics", "sports", "tech"]


def trainer_args(tmp_path, tiny_model, *extra, sock="t.sock", state="state"):
    return ["--socket", str(tmp_path / sock), "--workers", "1", "--threads", "1", "--model", str(tiny_model),
            "--state-dir", str(tmp_path / state), "--dataset", "bbcnews", "--num-clusters", "2", "--max-examples",
            "300", "--cluster-id", "0", *extra]


def trainer_cmd(tmp_path, tiny_model, *extra):
    return nebula_cmd("trainer", *trainer_args(tmp_path, tiny_model, *extra))


def start(tmp_path, tiny_model, *extra, name="t", rank_host=True):
    sock = tmp_path / "t.sock"
    proc, _ = launch_trainer(trainer_args(tmp_path, tiny_model, *extra), sock=sock, log_path=tmp_path / f"{name}.log",
                             rank_host=rank_host)
    return proc, sock


stop = stop_trainer


def client_epsilon(releases, sigma=1.0, delta=1e-5):
    """Independent reference: Opacus's RDP accountant, one q = 1 Gaussian release per round."""
    accountant = RDPAccountant()
    for _ in range(releases):
        accountant.step(noise_multiplier=sigma, sample_rate=1.0)
    return accountant.get_epsilon(delta=delta)


@pytest.fixture
def make(tiny_model):
    cfg = RunConfig().replace({"model": str(tiny_model), "local-steps": 2, "batch-size": 4, "max-seq-len": 32})

    def _make(federation, rnd, **extra):
        return {**cfg.train.to_flat(), **cfg.model.to_flat(), **cfg.privacy.to_flat(), "labels": LABELS,
                "federation-id": federation, "seed": 0, "server-round": rnd, "num-server-rounds": 5, **extra}

    adapter = adapter_arrays(build_model(cfg.model, num_labels=5, seed=0))
    return _make, adapter


def client_dp(sigma):
    return {"privacy.mode": "client", "privacy.noise-multiplier": sigma, "privacy.max-grad-norm": 0.1,
            "privacy-sigma": sigma, "privacy-noise-shares": 1}


def test_the_server_can_neither_weaken_the_policy_nor_replay_a_release(tmp_path, tiny_model, make):
    make_config, adapter = make
    budget = (client_epsilon(3) + client_epsilon(4)) / 2  # room for three releases, not four
    policy = ["--privacy-mode", "client", "--min-noise-multiplier", "1.0", "--max-epsilon", str(budget),
              "--accountant", "rdp"]
    proc, sock = start(tmp_path, tiny_model, *policy)
    try:
        off, out = request(sock, {"op": "train", "config": make_config("f1", 1)}, adapter)
        assert off["metrics"]["privacy-refused"] == 1 and out == {}
        assert off["metrics"]["privacy-refusal"] == "policy" and "requires 'client'" in off["metrics"]["privacy-reason"]
        weak, _ = request(sock, {"op": "train", "config": make_config("f1", 1, **client_dp(0.5))}, adapter)
        assert weak["metrics"]["privacy-refused"] == 1 and "below this cluster's floor" in weak["metrics"]["privacy-reason"]

        first, u1 = request(sock, {"op": "train", "config": make_config("f1", 1, **client_dp(1.0))}, adapter)
        assert first["metrics"]["epsilon"] == pytest.approx(client_epsilon(1), rel=1e-6)
        # only the noised update is private: the loss and the update's norm before clipping never leave
        assert not {"train-loss", "update-norm-before-clip", "clipped"} & set(first["metrics"])
        # the same round again, with another adapter: the very reply it had, not a second noised release
        shifted = {k: v + 1.0 for k, v in adapter.items()}
        again, u1_again = request(sock, {"op": "train", "config": make_config("f1", 1, **client_dp(1.0))}, shifted)
        assert again == first and all(np.array_equal(u1[k], u1_again[k]) for k in u1)
        # a new federation id is a new release, with fresh noise, charged to the same lifetime ledger
        second, u2 = request(sock, {"op": "train", "config": make_config("f2", 1, **client_dp(1.0))}, adapter)
        assert second["metrics"]["epsilon"] == pytest.approx(client_epsilon(2), rel=1e-6)
        assert second["metrics"]["epsilon-federation"] == pytest.approx(client_epsilon(1), rel=1e-6)
        noise = np.concatenate([(u1[k] - u2[k]).ravel() for k in u1])
        assert np.std(noise) > 0.1  # σ C = 0.1 per release: the two noise vectors differ
        request(sock, {"op": "train", "config": make_config("f1", 3, **client_dp(1.0))}, adapter)
        with pytest.raises(NebulaError, match="older than round 3"):
            request(sock, {"op": "train", "config": make_config("f1", 2, **client_dp(1.0))}, adapter)
    finally:
        stop(proc)
    # a restarted trainer keeps its lifetime ledger: a fourth release would pass the budget
    proc, sock = start(tmp_path, tiny_model, *policy, name="t2")
    try:
        over, out = request(sock, {"op": "train", "config": make_config("f3", 1, **client_dp(1.0))}, adapter)
        assert over["metrics"]["privacy-refusal"] == "budget" and out == {}
        assert "would be exceeded" in over["metrics"]["privacy-reason"]
        assert over["metrics"]["epsilon"] == pytest.approx(client_epsilon(3), rel=1e-6)
        replay, _ = request(sock, {"op": "train", "config": make_config("f1", 1, **client_dp(1.0))}, adapter)
        assert replay == first  # the cache outlives the process too
    finally:
        stop(proc)
    # the cluster audits itself from its own folder
    report = subprocess.run(nebula_cmd("privacy-report", str(tmp_path / "state")), capture_output=True, text=True,
                            timeout=120)
    assert report.returncode == 0, report.stderr
    audit = json.loads((tmp_path / "state" / "privacy.json").read_text())
    assert (tmp_path / "state" / "privacy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    client = audit["modes"]["client"]
    assert client["releases"] == 3 and client["federations"] == ["f1", "f2"]
    assert client["epsilon"] == pytest.approx(client_epsilon(3), rel=1e-6) and client["within_budget"] is True


def test_a_stalled_client_holds_nothing_and_a_live_trainer_is_never_taken_over(tmp_path, tiny_model, make):
    make_config, adapter = make
    proc, sock = start(tmp_path, tiny_model, rank_host=False)  # its ranks are its own fork server's children
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        stalled.connect(str(sock))  # connects, then says nothing
        started = time.monotonic()
        reply, _ = request(sock, {"op": "hello"})
        _, update = request(sock, {"op": "train", "config": make_config("f", 1)}, adapter)
        assert reply["cluster_id"] == 0 and update and time.monotonic() - started < 30
        for extra, fragment in ((("--state-dir", str(tmp_path / "other-state")), "already serves"),
                                (("--socket", str(tmp_path / "other.sock"), "--lock-wait", "1"), "is in use")):
            second = subprocess.run(trainer_cmd(tmp_path, tiny_model, *extra), capture_output=True, text=True,
                                    timeout=120)
            lines = [x for x in second.stderr.splitlines() if x.strip()]
            assert second.returncode == 2 and len(lines) == 1 and fragment in lines[0], second.stderr
        assert request(sock, {"op": "hello"})[0]["cluster_id"] == 0  # the first one still serves
        ranks = psutil.Process(proc.pid).children(recursive=True)
        assert ranks
    finally:
        stalled.close()
    os.kill(proc.pid, signal.SIGKILL)  # the supervisor dies without cleaning up: its ranks go with it
    proc.wait()
    alive = still_running(ranks, timeout=10)
    assert not alive, [(p.pid, p.name()) for p in alive]


@pytest.mark.parametrize("flags, fragment", [
    (("--privacy-mode", "sample", "--min-noise-multiplier", "0"), "min_noise_multiplier"),
    (("--privacy-mode", "sample", "--min-noise-multiplier", "1", "--delta", "0.5"), "not below 1/n"),
    (("--privacy-mode", "sample"), "exactly one of"),
    (("--privacy-mode", "sample", "--target-epsilon", "8"), "set planned_rounds and planned_local_steps"),
    (("--require-secure-aggregation",), "secagg_peers"),
])
def test_a_policy_that_protects_nothing_stops_the_trainer_at_start(tmp_path, tiny_model, flags, fragment):
    proc = subprocess.run(trainer_cmd(tmp_path, tiny_model, *flags), capture_output=True, text=True, timeout=120)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and fragment in lines[0], proc.stderr


def test_a_cluster_with_no_policy_says_it_runs_any_dp_the_server_asks_uncapped(tmp_path, tiny_model, make):
    from nebula_fl.reports.cluster_report import build_cluster_report

    make_config, adapter = make
    proc, sock = start(tmp_path, tiny_model)  # the CLI's default policy: off
    try:
        start_line = (tmp_path / "t.log").read_text()
        assert ("privacy policy: off; no budget: it runs whatever differential privacy a server asks, with no ε cap "
                "of its own") in start_line
        reply, _ = request(sock, {"op": "train", "config": make_config("f", 1, **client_dp(0.3))}, adapter)
        assert reply["metrics"]["privacy-no-budget"] == 1 and "max-epsilon" not in reply["metrics"]
        assert reply["metrics"]["epsilon"] > 10  # σ = 0.3 once: what a policy's default budget would have refused
    finally:
        stop(proc)
    rows = build_cluster_report(tmp_path / "state")["modes"]["client"]["rows"]
    assert [row["no_budget"] for row in rows] == [True]
