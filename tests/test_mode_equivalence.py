"""Every round mode computes what it says (issue 31, item 6), and the harness that shows it catches the faults it
must: a double count, a lost step, a lost round (tests/mode_equivalence.py runs the real stack; see its docstring).
Each mode's run is made once per module and shared by the tests that read it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nebula_fl.strategies.staleness import stale_step_warning
from tests.mode_equivalence import (
    BLOCKING,
    BY_NAME,
    CLIP,
    DEVIATION_TOL,
    FAULTS,
    MODES,
    MOMENTUM,
    ROUNDS,
    SECURE_ROUNDS,
    Mode,
    Problem,
    Row,
    compare,
    make_problem,
    reference,
    secagg_tolerance,
    table,
)


@pytest.fixture(scope="module")
def problem() -> Problem:
    return make_problem()


@pytest.fixture(scope="module")
def runs(problem, tmp_path_factory):
    """mode name -> its Row, made on first use (blocking first: the others are compared with it)."""
    made: dict[str, Row] = {}

    def get(name: str) -> Row:
        if name not in made:
            blocking = None if name == BLOCKING.name else get(BLOCKING.name).run
            made[name] = compare(BY_NAME[name], problem, tmp_path_factory.mktemp("run"), blocking=blocking)
        return made[name]

    return get


def faulty(problem, tmp_path, monkeypatch, name: str, fault: str, rounds: int) -> Row:
    """`name`'s run with `fault` switched on by monkeypatch, against the fault-free reference."""
    for target, attribute, value in FAULTS[fault]():
        monkeypatch.setattr(target, attribute, value)
    return compare(dataclasses.replace(BY_NAME[name], rounds=rounds), problem, tmp_path)


@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
def test_every_mode_follows_its_reference_to_1e_6_per_round(runs, mode):
    row = runs(mode.name)
    assert row.deviation <= DEVIATION_TOL, f"{mode.name}: {row.deviation:.2e} from the reference"
    assert row.final_deviation <= DEVIATION_TOL
    assert not row.run.flushed, "the last round is flushed in it, not in a record of its own"
    if mode.blocking_lag is not None:  # the same algorithm as blocking's: the same trajectory
        assert row.from_blocking is not None and row.from_blocking <= DEVIATION_TOL, row.from_blocking


@pytest.mark.parametrize("mode", [m for m in MODES if m.converge_tol is not None],
                         ids=[m.name for m in MODES if m.converge_tol is not None])
def test_every_mode_converges_to_its_optimum(runs, mode):
    row = runs(mode.name)
    assert row.distance <= mode.converge_tol, f"{mode.name}: {row.distance:.2e} from its optimum"


@pytest.mark.parametrize("mode", [m for m in MODES if m.finding], ids=[m.name for m in MODES if m.finding])
def test_where_the_algorithm_itself_does_not_converge_the_run_follows_it_and_the_server_says_so(runs, mode):
    """The findings: the real run follows its reference (the per-round test above), and the reference, 400 rounds
    on, is nowhere near the optimum. Momentum with late updates is warned about at the start of a run
    (strategies/staleness.py); the stale downlink view is not (closing note of issue 31: left open)."""
    row = runs(mode.name)
    assert row.long_run is not None and row.long_run > 1e-3, f"{mode.name}: {row.long_run:.2e}: it converges now"
    if mode.finding == MOMENTUM:
        assert stale_step_warning(outer=mode.outer, overlap=mode.overlap, secure=mode.secure) is not None
    assert stale_step_warning(outer=mode.outer, overlap=False, secure=mode.secure) is None  # blocking: nothing said


@pytest.mark.parametrize(("outer", "lr", "secure"), [("fedavgm", 0.1, False), ("nesterov", 0.35, True)])
def test_the_outer_rates_the_warning_advises_converge_overlapped(problem, outer, lr, secure):
    """The rates the warning names: the algorithm (the reference, which the real run follows) reaches the optimum."""
    mode = Mode(f"{outer} + overlap, lr {lr}", outer=outer, outer_lr=lr, overlap=True, secure=secure, rounds=400)
    assert np.abs(reference(mode, problem)[-1] - mode.optimum(problem)).max() <= 1e-3
    assert "fedavgm converged at 0.1, nesterov at 0.35" in stale_step_warning(outer=outer, overlap=True, secure=secure)


def test_secure_aggregation_quantizes_within_the_tolerance_and_never_clips(runs, problem):
    """64-bit fields: one rounding step of w x per upload and round, 2e-8 over the run, well below 1e-6; no
    coordinate reaches the field's clip (it would bias the sum)."""
    assert secagg_tolerance(problem) < DEVIATION_TOL / 10
    for name in ("secure aggregation", "secure + overlap"):
        for cluster in runs(name).run.clusters:
            assert 0 < cluster.peak < cluster.field_clip


def test_secure_overlap_reports_the_global_one_round_late_and_ends_with_every_round(runs):
    row, blocking = runs("secure + overlap"), runs(BLOCKING.name)
    assert np.array_equal(row.run.globals[0], make_problem().start), "round 1's sum is pending: the global stays"
    assert np.abs(row.run.final - blocking.run.globals[SECURE_ROUNDS - 1]).max() <= DEVIATION_TOL


def test_fednova_normalises_unequal_step_counts(runs, problem):
    row = runs("local-steps auto (FedNova)")
    p = np.asarray(problem.weights, np.float64) / sum(problem.weights)
    assert all(m.get("steps-normalized") == 1 for m in row.run.metrics)
    assert row.run.metrics[-1]["tau-eff"] == pytest.approx(float(np.dot(p, problem.speeds)))
    optimum = problem.optimum()
    nova = np.abs(problem.fixed_point(problem.speeds, normalised=True) - optimum).max()
    plain = np.abs(problem.fixed_point(problem.speeds, normalised=False) - optimum).max()
    assert nova < plain  # closer to the weighted mean; exact only to first order in eta h (Problem's docstring)


def test_flower_fedavg_is_native_fedavg(runs):
    assert np.abs(runs("flwr:FedAvg").run.final - runs(BLOCKING.name).run.final).max() <= DEVIATION_TOL


def test_client_dp_clips_nothing_and_weighs_clusters_equally(runs, problem):
    row = runs("client DP, sigma 1e-12")
    assert max(n for c in row.run.clusters for n in c.norms) < CLIP / 2
    assert row.run.metrics[-1]["num-examples"] == problem.clusters  # weight 1 each
    assert np.abs(row.run.final - problem.optimum()).max() > 1e-2  # not the example-weighted mean


@pytest.mark.parametrize("name", ["topk:0.3 up (EF), down none", "topk:0.3 up (EF) + down"])
def test_error_feedback_loses_no_update(runs, problem, name):
    """FedAvg (lr 1) adds each round's mean of the decoded uploads; error feedback keeps what topk dropped, so the
    global moved by exactly the sum of the updates put in, less the residuals still held."""
    row = runs(name)
    p = np.asarray(problem.weights, np.float64) / sum(problem.weights)
    put_in = sum(pi * sum(c.sent) for pi, c in zip(p, row.run.clusters, strict=True))
    held = sum(pi * c.exchange.up.residual.astype(np.float64) for pi, c in zip(p, row.run.clusters, strict=True))
    assert np.abs(held).max() > 1e-3  # topk did drop something
    assert np.abs((row.run.final - problem.start) - (put_in - held)).max() <= 1e-5


def test_the_table_names_every_mode(runs):
    text = table([runs(BLOCKING.name)])
    assert "blocking" in text and "dev ref/round" in text


# -- the faults ------------------------------------------------------------------------------------------------------
def test_a_double_count_is_caught_and_diverges(problem, tmp_path, monkeypatch):
    """Secure + overlap with the cluster taking the global to hold every earlier round (k = n - 1, the old rule):
    it drops its own u_{n-1} from its weights and relearns it; where a round's local progress exceeds 2/3 of the
    way to the cluster's optimum, the error grows (e_{n+1} = (1 - a) e_n + a (e_{n-1} - e_{n-2}))."""
    row = faulty(problem, tmp_path, monkeypatch, "secure + overlap", "double count", ROUNDS)
    d = row.distances
    assert row.deviation > 0.1
    assert max(d[4:8]) < max(d[8:12]) < max(d[12:16]) and d[-1] > 2 * d[0]


@pytest.mark.parametrize(("name", "rounds"), [("round-overlap", ROUNDS), ("secure + overlap", SECURE_ROUNDS)])
def test_a_lost_step_is_caught(problem, tmp_path, monkeypatch, name, rounds):
    """A rebase that drops the kept updates (W <- G): the progress trained since the last send is lost."""
    row = faulty(problem, tmp_path, monkeypatch, name, "lost step", rounds)
    assert row.deviation > 0.1


def test_a_lost_round_is_caught(problem, tmp_path, monkeypatch):
    """Secure + overlap with no flush: the held last round never reaches the global adapter."""
    row = faulty(problem, tmp_path, monkeypatch, "secure + overlap", "lost round", 6)
    assert row.final_deviation > 1e-3 and not row.run.flushed
    want = reference(dataclasses.replace(BY_NAME["secure + overlap"], rounds=6), problem)
    assert np.abs(row.run.final - want[-2]).max() > 1e-3  # not even the round before: round 6's own sum is missing


def test_the_loop_flushes_a_round_still_held_when_it_ends(problem, tmp_path, monkeypatch):
    """With the last round held like any other (its in-round flush off), the loop's flush after it applies it: the
    record of round 6 lacks it, the flush's record (round 7, trained False) holds every round."""
    row = faulty(problem, tmp_path, monkeypatch, "secure + overlap", "last-round flush off", 6)
    assert row.run.flushed == [7]
    assert row.deviation > 1e-3
    assert row.final_deviation <= DEVIATION_TOL
