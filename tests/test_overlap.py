"""Overlapped rounds and time-budgeted steps: the pure rules, then real trainers (2 gloo ranks) over their socket."""

import re
import time

import numpy as np
import pytest

from nebula_fl.clients.overlap import (
    Ahead,
    Unapplied,
    ahead_usable,
    global_round_of,
    rebased,
    same_mechanism,
    steps_ahead,
    steps_on_arrival,
)
from nebula_fl.clients.protocol import request
from nebula_fl.config import RunConfig
from nebula_fl.errors import ConfigError
from nebula_fl.model.adapter import adapter_arrays
from nebula_fl.model.loading import build_model
from nebula_fl.privacy.policy import Admission
from tests.conftest import launch_trainer, stop_trainer

LABELS = ["business", "entertainment", "politics", "sports", "tech"]
SAMPLE = Admission(allowed=True, mode="sample", noise_multiplier=1.0, sample_rate=0.1, steps=4, max_grad_norm=1.0)


# -- the rules ----------------------------------------------------------------------------------------------------
def test_rebase_keeps_the_unsent_progress_on_the_new_global_exactly_once():
    new_global = {"a": np.array([1.0, 2.0], np.float32)}
    update = {"a": np.array([0.5, -1.0], np.float32)}
    assert rebased(new_global, update)["a"].tolist() == [1.5, 1.0]
    assert rebased(new_global, update)["a"].dtype == np.float32


def test_the_rebase_carries_every_own_update_the_global_does_not_hold_and_none_it_does():
    """Plain overlap: round n's global holds n-1. Secure overlap: it holds n-2 (round n-1's sum is applied one round
    late), so the cluster carries u_{n-1} and u_n; assuming n-1 there dropped u_{n-1} and sent it twice."""
    g = {"a": np.zeros(2, np.float32)}
    u = {r: {"a": np.array([float(r), 10.0 * r], np.float32)} for r in (1, 2, 3)}
    kept = Unapplied()
    kept.keep(1, u[1])
    assert kept.base(g, global_round=0)["a"].tolist() == [1.0, 10.0]  # round 1's global holds nothing of it
    kept.keep(2, u[2])
    assert kept.base(g, global_round=0)["a"].tolist() == [3.0, 30.0]  # secure overlap: u1 and u2 both unapplied
    kept.keep(3, u[3])
    assert kept.base(g, global_round=1)["a"].tolist() == [5.0, 50.0]  # u1 is in G now: forgotten, never re-added
    assert sorted(kept.updates) == [2, 3]
    assert kept.base(g, global_round=3)["a"].tolist() == [0.0, 0.0]  # all decided: the cluster goes on from G
    kept.keep(4, u[1])
    again = Unapplied()
    again.load_state_dict(kept.state_dict())  # a snapshot keeps them (tensors, as torch.load(weights_only) reads)
    assert again.base(g, global_round=3)["a"].tolist() == [1.0, 10.0]


@pytest.mark.parametrize(("value", "error"), [
    (None, "does not say which rounds"), (True, "must be an integer"), (1.5, "must be an integer"), ("1", "integer"),
    (-1, "0..2 only"), (3, "0..2 only"), (7, "0..2 only"),
])
def test_the_global_round_is_said_by_the_server_and_checked(value, error):
    with pytest.raises(ValueError, match=error):
        global_round_of({} if value is None else {"global-round": value}, server_round=3)
    assert global_round_of({"global-round": 2}, server_round=3) == 2
    assert global_round_of({"global-round": 0.0}, server_round=3) == 0


@pytest.mark.parametrize(("fixed", "ahead", "overlap", "want"), [
    (4, 0, False, 4), (4, 3, True, 1), (4, 4, True, 0), (4, 9, True, 0),  # fixed: what the round still lacks
    (None, 0, False, None), (None, 0, True, None),  # time budget when nothing was trained ahead
    (None, 5, True, 0),  # overlapped and time-budgeted: the message ends the round
])
def test_steps_on_arrival(fixed, ahead, overlap, want):
    assert steps_on_arrival(fixed=fixed, ahead=ahead, overlap=overlap) == want


def test_steps_ahead_fill_a_fixed_round_at_once_and_a_budgeted_one_step_by_step():
    assert steps_ahead(fixed=4, cap=4, ahead=0) == 4
    assert steps_ahead(fixed=4, cap=4, ahead=4) == 0
    assert steps_ahead(fixed=8, cap=3, ahead=1) == 2  # a DP gate's admitted steps cap a fixed round too
    assert steps_ahead(fixed=None, cap=3, ahead=2) == 1
    assert steps_ahead(fixed=None, cap=3, ahead=3) == 0


def test_progress_trained_ahead_goes_only_into_the_next_round_under_the_same_mechanism():
    ahead = Ahead(steps=4, admission=SAMPLE)
    assert ahead_usable(ahead, server_round=3, last_round=2, asked=SAMPLE, cap=4) is None
    assert "round 3" in ahead_usable(ahead, server_round=4, last_round=2, asked=SAMPLE, cap=4)
    stronger = Admission(**{**SAMPLE.__dict__, "noise_multiplier": 2.0})
    assert not same_mechanism(SAMPLE, stronger)
    assert "mechanism" in ahead_usable(ahead, server_round=3, last_round=2, asked=stronger, cap=4)
    fewer = Admission(**{**SAMPLE.__dict__, "steps": 2})
    assert "more than" in ahead_usable(ahead, server_round=3, last_round=2, asked=fewer, cap=4)
    assert ahead_usable(Ahead(), server_round=9, last_round=2, asked=SAMPLE, cap=4) is None  # nothing to set aside
    client = Admission(allowed=True, mode="client", noise_multiplier=1.0)
    assert same_mechanism(client, Admission(allowed=True, mode="client", noise_multiplier=3.0))  # noise at release
    assert not same_mechanism(None, client)


def test_config_takes_auto_steps_and_says_what_is_wrong():
    cfg = RunConfig.from_flat({"local-steps": "auto", "max-local-steps": 7, "round-overlap": True})
    assert cfg.train.local_steps is None and cfg.train.steps_cap == 7
    assert RunConfig.from_flat({"local-steps": 5}).train.steps_cap == 5
    with pytest.raises(ConfigError, match="round-seconds"):
        RunConfig.from_flat({"round-seconds": 0})
    with pytest.raises(ConfigError, match=r"local-steps.*auto"):
        RunConfig.from_flat({"local-steps": 0})


# -- real trainers ------------------------------------------------------------------------------------------------
def start(tmp_path, tiny_model, name, *extra, state="state", workers=2):
    sock = tmp_path / f"{name}.sock"
    args = [*extra, "--socket", str(sock), "--workers", str(workers), "--threads", "1", "--model", str(tiny_model),
            "--state-dir", str(tmp_path / state), "--dataset", "bbcnews", "--num-clusters", "2", "--max-examples",
            "300", "--cluster-id", "1"]
    return launch_trainer(args, sock=sock, log_path=tmp_path / f"{name}.log")[0], sock


@pytest.fixture
def make(tiny_model):
    cfg = RunConfig().replace({"model": str(tiny_model), "local-steps": 4, "batch-size": 4, "max-seq-len": 32,
                               "lr-schedule": "constant"})

    def config(rnd, **extra):
        return {**cfg.train.to_flat(), **cfg.model.to_flat(), "labels": LABELS, "federation-id": "fed1", "seed": 0,
                "server-round": rnd, "global-round": rnd - 1, "num-server-rounds": 5, **extra}

    config.start = adapter_arrays(build_model(cfg.model, num_labels=5, seed=0))
    return config


def plus(a, b, lr=0.5):
    return {k: (a[k] + lr * b[k]).astype(np.float32) for k in a}


def rounds(sock, make, start, count, *, pause=0.0, first=1, **extra):
    """Rounds `first`.. against a one-cluster server (global += 0.5 update: another cluster's zero update averaged
    in), pausing between them (the hop)."""
    global_, updates, metrics = start, [], []
    for rnd in range(first, first + count):
        reply, update = request(sock, {"op": "train", "config": make(rnd, **extra)}, global_)
        updates.append(update)
        metrics.append(reply["metrics"])
        global_ = plus(global_, update)
        time.sleep(pause)
    return global_, updates, metrics


def test_fixed_overlap_is_the_same_whatever_the_timing_and_resumes_exactly(tmp_path, tiny_model, make):
    """Fixed steps: the rebase happens after exactly local-steps whenever the message comes, so a trainer that had
    time to train ahead, one that had none, and one restarted from its snapshot all send the same bytes."""
    on = {"round-overlap": True}
    proc, sock = start(tmp_path, tiny_model, "slow")
    try:
        _, slow, m_slow = rounds(sock, make, make.start, 3, pause=2.5, **on)  # the hop: time to train ahead
    finally:
        stop_trainer(proc)
    proc, sock = start(tmp_path, tiny_model, "fast", state="fast")
    try:
        g2, fast, _ = rounds(sock, make, make.start, 2, **on)  # no pause: the next message waits for the steps
    finally:
        stop_trainer(proc)
    proc, sock = start(tmp_path, tiny_model, "resumed", state="fast")  # a restart between rounds 2 and 3
    try:
        _, resumed, _ = rounds(sock, make, g2, 1, first=3, **on)
    finally:
        stop_trainer(proc)
    proc, sock = start(tmp_path, tiny_model, "blocking", state="blocking")
    try:
        _, blocking, _ = rounds(sock, make, make.start, 2)
    finally:
        stop_trainer(proc)
    for a, b in zip(slow, [*fast, *resumed]):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    for k in blocking[0]:  # round 1 has nothing ahead: as blocking
        np.testing.assert_array_equal(blocking[0][k], slow[0][k])
    # round 2 started from the cluster's own weights (one round stale), not from the new global
    assert any(not np.array_equal(blocking[1][k], slow[1][k]) for k in slow[1])
    assert all(m["steps"] == 4 for m in m_slow)
    # trained ahead during the pause: rounds 2 and 3 had little left to do
    assert "since-send-seconds" not in m_slow[0] and m_slow[1]["since-send-seconds"] >= 2.5
    assert m_slow[1]["seconds"] < m_slow[1]["busy-seconds"]
    assert re.search(r"round 2: .*busy \d+% of", (tmp_path / "slow.log").read_text())


def test_time_budgeted_rounds_train_until_the_message_and_charge_the_steps_taken(tmp_path, tiny_model, make):
    """local-steps "auto": blocking trains for round-seconds; overlapped trains through the hop (up to the cap)
    and sends at once when the message comes; under per-example DP the ledger records the steps actually taken."""
    dp = {"lora-mode": "standard", "privacy.mode": "sample", "privacy.noise-multiplier": 1.0,
          "privacy.max-grad-norm": 1.0, "privacy.accountant": "rdp", "privacy.delta": 1e-5}
    auto = {"local-steps": "auto", "max-local-steps": 400, "round-seconds": 1.0, **dp}
    proc, sock = start(tmp_path, tiny_model, "auto", "--max-epsilon", "100000", workers=1)
    try:
        _, _, blocking = rounds(sock, make, make.start, 2, **auto)
        _, _, overlapped = rounds(sock, make, make.start, 3, first=3, pause=2.0, **auto, **{"round-overlap": True})
    finally:
        stop_trainer(proc)
    assert all(1 <= m["steps"] < 400 for m in blocking + overlapped)
    assert all(m["seconds"] >= 1.0 for m in blocking)  # the budget, then one step to finish
    # rounds 4 and 5: the steps came from the 2 s hop, the message ended the round (nothing left to train)
    assert all(m["seconds"] < 1.0 and m["busy-seconds"] > 1.0 for m in overlapped[1:])
    assert overlapped[-1]["busy-seconds"] / overlapped[-1]["since-send-seconds"] > 0.3
    taken = sum(m["steps"] for m in blocking + overlapped)
    assert overlapped[-1]["dp-steps"] == taken  # the ledger holds the steps taken, not the cap


def test_a_real_trainer_under_secure_overlap_carries_both_updates_its_global_lacks(tmp_path, tiny_model, make):
    """The server's schedule under secure aggregation with round-overlap: round n's global holds rounds <= n - 2
    (`global-round`). The trainer's snapshot after round n holds its anchor, which must be G + u_{n-1} + u_n (the
    old rule, G + u_n, dropped u_{n-1} and sent it again); a message saying the global holds 1..3 leaves u_4 alone."""
    from nebula_fl.clients.snapshots import SnapshotStore

    on = {"round-overlap": True}
    proc, sock = start(tmp_path, tiny_model, "secure", workers=1)
    g = {k: v.copy() for k, v in make.start.items()}
    sent, globals_ = {}, {}
    try:
        for rnd, holds in ((1, 0), (2, 0), (3, 1), (4, 3)):  # round 4: the server says the global holds 1..3
            globals_[rnd] = g
            _, sent[rnd] = request(sock, {"op": "train", "config": make(rnd, **on, **{"global-round": holds})}, g)
            if rnd >= 2:  # the sum of round rnd - 1 is applied one round late (this cluster alone: its update)
                g = plus(g, sent[rnd - 1], lr=1.0)
    finally:
        stop_trainer(proc)
    store = SnapshotStore(tmp_path / "state" / "snapshots" / "fed1")
    for rnd, carried in ((2, (1, 2)), (3, (2, 3)), (4, (4,))):  # the newest 3 kept
        anchor = {k: v.numpy() for k, v in store.load(rnd)["ranks"][0]["anchor"].items()}
        want = {k: globals_[rnd][k] + sum((sent[r][k] for r in carried), np.zeros_like(globals_[rnd][k]))
                for k in anchor}
        for k in anchor:
            np.testing.assert_allclose(anchor[k], want[k], atol=1e-6, err_msg=f"round {rnd}, {k}")


def test_steps_trained_ahead_under_another_mechanism_are_set_aside_not_released(tmp_path, tiny_model, make):
    dp = {"lora-mode": "standard", "privacy.mode": "sample", "privacy.noise-multiplier": 1.0,
          "privacy.max-grad-norm": 1.0, "privacy.accountant": "rdp", "privacy.delta": 1e-5, "round-overlap": True}
    client = {**dp, "privacy.mode": "client", "privacy.max-grad-norm": 0.1, "privacy-sigma": 0.5,
              "privacy-noise-shares": 1, "federation-id": "fedc"}
    proc, sock = start(tmp_path, tiny_model, "mech", workers=1)
    try:
        _, _, first = rounds(sock, make, make.start, 1, pause=2.0, **dp)
        _, _, second = rounds(sock, make, make.start, 1, first=2, **{**dp, "privacy.noise-multiplier": 2.0})
        time.sleep(2.0)  # round 3 is trained ahead, but the server skips this cluster to round 4
        _, _, fourth = rounds(sock, make, make.start, 1, first=4, **{**dp, "privacy.noise-multiplier": 2.0})
        # client-level DP, overlapped: one clipped and noised release per round, what was trained ahead in it
        _, sent, released = rounds(sock, make, make.start, 2, pause=2.0, **client)
    finally:
        stop_trainer(proc)
    log = (tmp_path / "mech.log").read_text()
    assert "set aside (the round's privacy mechanism differs" in log
    assert "set aside (it was trained for round 3, this is round 4)" in log
    assert first[0]["dp-steps"] == 4 and second[0]["dp-steps"] == 8 and second[0]["steps"] == 4
    assert fourth[0]["dp-steps"] == 12  # the set-aside steps were never charged, and never released
    assert [m["dp-steps"] for m in released] == [1, 2] and released[1]["noise-std"] == pytest.approx(0.05)
    assert all(np.linalg.norm(np.concatenate([v.ravel() for v in u.values()])) > 0.1 for u in sent)  # noise added
