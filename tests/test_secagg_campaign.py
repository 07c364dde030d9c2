"""The adversary campaign's fast tier (tests/secagg_campaign.py): a lying server searching schedules against real
cluster stages, its knowledge rebuilt from the real bytes and judged by the closure checker.

Control (`rotate_keys=False`, one mask key an epoch): the search finds real recoveries. Protocol (a mask key bound to
one round): a few hundred random schedules, an exhaustive sweep at n,t = 3,2 / 4,3 / 5,3, a sparse graph, two epochs
and a colluder determine nothing below the threshold; the issue-30 schedule and its stale-key variant end in
refusals or in a rebuilt key that masks nothing. The long campaign: tests/secagg_campaign_report.py."""

from __future__ import annotations

import itertools

import pytest

from tests.secagg_campaign import (
    MEDIUM_MENU,
    SMALL_MENU,
    Move,
    Setting,
    Tally,
    control_moves,
    control_schedule,
    issue30_moves,
    issue30_schedule,
    play,
    refusals,
    search_random,
    sweep,
    sweep_size,
    target_helpers,
)

STALE = "a mask key masks only the round it was made for"
RELABELLED = "is not signed by its identity key for that round"


def clean(tally: Tally) -> None:
    """Nothing below the threshold determined, no stage error other than a refusal, every rebuilt secret checked."""
    print(f"{tally.setting.label}: {tally.schedules} schedules searched, {tally.messages} messages "
          f"({tally.accepted} answered), {tally.seeds_rebuilt} self seeds and {tally.keys_rebuilt} mask keys rebuilt, "
          f"{tally.leaking} leaking, {tally.seconds:.1f} s")
    assert tally.leaking == 0, tally.findings[0]
    assert tally.errors == [] and tally.anomalies == [], (tally.errors, tally.anomalies)


# -- control: the search can fail ---------------------------------------------------------------------------------
def test_the_control_leaks_and_the_search_finds_it():
    # Prepare
    setting = Setting(3, 2, rotate=False)
    # Execute
    _, verdict = play(setting, control_schedule(setting))
    tally = sweep(setting, [SMALL_MENU] * 2, thorough=False)
    print(f"{setting.label}: {tally.schedules} schedules swept, {tally.leaking} leaking, {tally.real} with a real "
          f"recovery")
    # Assert: a's key, rebuilt in round 1, is the one it masks round 2 with: its round-2 update, computed for real
    assert verdict.keys == ["e1:1/1"] and verdict.derived >= 2  # a's pair masks of both rounds
    assert verdict.report.singles == ("x[1@r102]",)
    assert [r.what for r in verdict.real] == ["x[1@r102]"]
    assert tally.real >= 1 and tally.findings[0]["recoveries"][0]["real"]


def test_a_control_with_a_colluder_leaks_too():
    setting = Setting(4, 3, colluders=("3",), rotate=False)
    _, verdict = play(setting, control_schedule(setting))
    assert verdict.leaks and verdict.real, verdict.report


# -- the fixed regressions ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "t"), [(3, 2), (4, 3), (5, 3)])
def test_issue30_rebuilds_only_keys_that_mask_nothing(n, t):
    """Protocol: each helper a's key of the round it was absent from is rebuilt (t holders certified it dropped and
    give it at the end), but a never masked with it; a's key of round 1 stays hidden, and so does j's update."""
    setting = Setting(n, t)
    run, verdict = play(setting, issue30_schedule(setting))
    helpers = target_helpers(setting, "e1")
    assert verdict.keys == [f"e1:{a}/{rnd}" for rnd, a in enumerate(helpers, start=2)]
    for rnd, a in enumerate(helpers, start=2):
        assert a not in run.memory.uploads[("e1", rnd)]
    assert verdict.derived == (n - 1) * (t - 1)  # the survivors' pair masks with a, derived from its rebuilt key
    assert not verdict.leaks and verdict.report.singles == (), verdict.report


@pytest.mark.parametrize(("n", "t"), [(3, 2), (4, 3), (5, 3)])
@pytest.mark.parametrize(("stale", "refusal"), [("stale", STALE), ("relabel", RELABELLED)])
def test_issue30_with_a_stale_key_is_refused(n, t, stale, refusal):
    """The first driver's finding: the others named a's key of round 1 for round 2. Numbered 1, it is refused as a key
    of another round; named as round 2's, its signature (bound to round 1) does not verify. Nobody masks round 2."""
    setting = Setting(n, t)
    run, verdict = play(setting, issue30_schedule(setting, stale=stale))
    a = target_helpers(setting, "e1")[0]
    trains = [line for line in refusals(run) if line.startswith("train e1/r2")]
    assert len(trains) == n - 1 and all(refusal in line and f"cluster {a}" in line for line in trains), trains
    assert ("e1", 2) not in run.memory.uploads
    assert not verdict.leaks and verdict.keys == [], verdict.report


@pytest.mark.parametrize(("n", "t"), [(3, 2), (4, 3)])
def test_the_control_refuses_a_stale_number_and_finds_nothing_in_issue30(n, t):
    """The control's layout: its key shares carry the epoch's first round, so a recover in round 2 asks for a/2, which
    no holder holds (an empty answer, no refusal): issue 30's backward path is closed in the control too, and its
    leak runs forward (test_the_control_leaks_and_the_search_finds_it)."""
    setting = Setting(n, t, rotate=False)
    run, verdict = play(setting, issue30_schedule(setting))
    recovers = [r for r in run.memory.reveals if r[0] == "recover"]
    assert recovers and all(reply["key-shares"] == [] for *_, reply in recovers)
    assert verdict.keys == [] and not verdict.leaks
    run, _ = play(setting, issue30_schedule(setting, stale="stale"))
    assert any(STALE in line for line in refusals(run))


# -- the protocol: searched ------------------------------------------------------------------------------------------
RANDOM = [(Setting(3, 2), 60), (Setting(4, 3), 40), (Setting(5, 3), 30), (Setting(5, 2, num_shares=3), 30),
          (Setting(3, 2, epochs=2), 30)]


@pytest.mark.parametrize(("setting", "count"), RANDOM, ids=[s.label for s, _ in RANDOM])
def test_random_schedules_determine_nothing(setting, count):
    tally = search_random(setting, schedules=count, seed=0, thorough=False)
    clean(tally)
    assert tally.schedules == count and tally.accepted > tally.messages // 3
    assert tally.keys_rebuilt > 0 and tally.seeds_rebuilt > 0  # the server got somewhere: recovers were answered


SWEEPS = [(Setting(3, 2), SMALL_MENU),
          (Setting(4, 3), SMALL_MENU[:4]),
          (Setting(5, 3), SMALL_MENU[1:4])]


@pytest.mark.parametrize(("setting", "menu"), SWEEPS, ids=[s.label for s, _ in SWEEPS])
def test_the_exhaustive_sweep_determines_nothing(setting, menu):
    menus = [menu] * 3
    # the sweep holds issue 30, its stale-key variant and the control's schedule
    for chosen in (issue30_moves(setting), issue30_moves(setting, stale="stale")):
        assert tuple(chosen) in set(itertools.product(*menus)), chosen
    if control_moves()[0] in menu:  # and the control's finding
        assert (*control_moves(), Move("honest")) in set(itertools.product(*menus))
    tally = sweep(setting, menus, thorough=False)
    assert tally.schedules == sweep_size(menus)
    clean(tally)


def test_a_colluder_within_the_bound_gets_nothing_below_it():
    """n=4, t=3, one colluder (t > (holders + c) / 2 = 2.5): the server reads its state, opens what is sealed to it
    and signs any view in its name; still no single honest update (the bound: t - c = 2 honest clusters)."""
    setting = Setting(4, 3, colluders=("3",))
    tally = search_random(setting, schedules=20, seed=1, thorough=False)
    sweep(setting, [SMALL_MENU[1:4]] * 3, tally=tally, thorough=False)
    for stale in (None, "stale"):
        _, verdict = play(setting, issue30_schedule(setting, stale=stale))
        assert not verdict.leaks, verdict.report
    clean(tally)


def test_the_benchmark_menu_is_a_superset():
    assert set(SMALL_MENU) <= set(MEDIUM_MENU) and len(set(MEDIUM_MENU)) == len(MEDIUM_MENU) == 14
