"""Overlapped rounds and time-budgeted steps, side by side: blocking vs `round-overlap` vs `local-steps=auto`.

Every side is a real federation (`nebula-fl run`: SuperLink, SuperNodes, trainers, `flwr run`), run one
after another (never two at once: the times are the point), on the same data, seed, model, rounds and
evaluation schedule (the server evaluates every round, no round-0 evaluation; `eval-overlap` on, its
default), with equal inner steps per cluster wherever the mode fixes them. Four configurations:

  1. demo       the demo config (the preset's local steps): `blocking` (fixed steps), `overlapped` (the same
                fixed steps, `--round-overlap`) and `overlapped-auto` (`--round-overlap --local-steps auto`:
                a cluster trains until the next message arrives, at most `--max-local-steps`), unthrottled
                and at `--wan` (20 Mbit/s, 100 ms RTT);
  2. hop-bound  the demo at `--hop-local-steps` (2) local steps, where the Flower hops outweigh the compute
                (a GPU cluster, played by this box's CPU): `blocking` vs `overlapped-auto`, at `--wan`; and
                `blocking-more-steps`, the baseline a user would pick to use the idle time without overlapping:
                blocking at the median steps per round (rounds >= 2, over clusters; rounded) the
                overlapped-auto side took, so both train about as much per round and the figure asks what
                overlapping adds over simply training more (the overlapped-auto side runs first, so the
                count is known; round 1 is left out as its steps come from the 2-step calibrated budget, not
                from the idle time). `--hop-more-steps N` fixes it instead: at the preset's steps (the demo's)
                the side's command is the demo's `blocking` at `--wan` exactly, and that run is reused, not run
                twice (`reused_from` in results.json). Same data, seed, rounds, evaluation, polling and link;
  3. hetero     `--workers-per-cluster 2,1 --slowdown-per-cluster 1,4`: cluster 1 steps 4x slower, asleep (a site
                with a quarter of the compute that takes no CPU from cluster 0 on this box), cluster 0 2 workers
                (the per-step times measured are in results.json): `fixed` steps vs
                time-budgeted `budgeted` (blocking, `local-steps=auto` for `round-seconds`) and
                `budgeted-overlapped` (`--round-overlap --local-steps auto`), unthrottled;
  4. secagg     3 clusters at the demo's fixed steps, unthrottled: `blocking` (plain, not overlapped: what a
                user gets without either feature), `plain` and `secure` (`--secure-aggregation`), both
                overlapped; accuracy is compared at equal rounds (no target: the sum of an overlapped secure
                round is applied a round late, which a short run shows as accuracy).

Any side whose command is exactly an earlier run's (the same arguments and run config) reuses that run.

The time budget (`round-seconds`: what a blocking auto round trains for, and an overlapped cluster's first
round) is calibrated, unless `--round-seconds` is given, from the configuration's reference run (its
blocking fixed-steps side, which runs first): the median over rounds >= 2 (round 1 warms up) of its slowest
cluster's training seconds, so a budgeted round takes as long as a fixed one and the faster clusters train through
what was their idle wait.

Time to target is the ServerApp's clock (`aggregated_seconds` in metrics.jsonl) from its start to the moment
the first global adapter at or above the target was aggregated; the end of its evaluation (`elapsed_seconds`)
is kept beside it. On one box the server's evaluation shares the cores with the clusters, so it runs slower
while overlapped clusters train: measuring an adapter is not reaching it. The target is chosen once per
comparison from its reference run, unless `--target NAME=ACC` fixes it: the reference's final accuracy (what a
user gets without the feature) when it is above every compared side's round-1 accuracy, else the lowest accuracy
it reaches in a round >= 2 above them (so no side reaches the target in its first round). The comparisons: demo,
hop-bound and hetero (each from its blocking fixed-steps reference, over its sides; hop-bound's leaves its
more-steps side out) and `hop-bound-more-steps` (from `blocking-more-steps`, over it and `overlapped-auto`). It
is stated in the table and in results.json with how it was chosen; a side that never reaches it has no time to
target, and a ratio that needs it is null (and its goal missed), never guessed.
A cluster's busy fraction is read from the round's `timeline.clusters[cid].busy_fraction` (and `idle_s`),
else from its reply's `busy-seconds` / `since-send-seconds`, else it is null.

Figures (results.json, judged in `goals`):
  time_to_target_ratio             demo at --wan: overlapped / blocking time to target (equal steps)   <= 0.8
  time_to_target_ratio_hop_bound   hop-bound at --wan: overlapped-auto / blocking                      <= 0.5
  accuracy_gap_points              demo at --wan: final accuracy, blocking - overlapped, in points     <= 0.5
  busy_fraction                    demo at --wan: median over clusters and rounds >= 2, {blocking,
                                   overlapped}; the goal is on overlapped                               >= 0.9
  hetero_time_ratio                hetero: budgeted / fixed time to target                              <= 0.7
  secure_over_plain_overlapped     secagg: secure / plain median round seconds over rounds 2..N
                                   (round 1 holds the key setup)                                        <= 1.1
  secure_overlapped_accuracy_gap_points
                                   secagg: final accuracy, blocking - secure (overlapped), in points,
                                   at equal rounds                                                      <= 0.5
beside them, without goals: the overlapped-auto and unthrottled demo ratios, hetero's budgeted-overlapped,
  time_to_target_ratio_hop_bound_vs_more_steps
                                   hop-bound at --wan: overlapped-auto / blocking-more-steps time to
                                   the hop-bound-more-steps target (`hop_bound_vs_more_steps`: the steps
                                   and final accuracies of the three hop-bound sides, which run was reused)
  plain_overlapped_accuracy_gap_points
                                   secagg: final accuracy, blocking - plain (overlapped), in points
  secure_overlapped_over_blocking  secagg: secure (overlapped) / blocking median round seconds, rounds 2..N
and `secagg_final_accuracy` ({blocking, plain, secure}).

    .venv/bin/python benchmarks/overlap.py --quick   # the 10 runs the figures need, 4 rounds, 800 examples
    .venv/bin/python benchmarks/overlap.py           # all 15 runs, the demo's 5 rounds on all of BBC News
    .venv/bin/python benchmarks/overlap.py --preset smoke --rounds 2 --model tiny   # a check of the script

The quick plan, in order: demo blocking (the reference) and overlapped at --wan; hop-bound blocking (the
reference), overlapped-auto and blocking-more-steps (9 runs when its median is the preset's steps: then the
demo's blocking is reused); hetero fixed (the reference) and budgeted; secagg blocking (the reference), plain
and secure. The full mode adds the demo's overlapped-auto at --wan, the three demo sides unthrottled and
hetero's budgeted-overlapped.

`--quick` is meant to fit 20-25 minutes on 2 idle cores: the 8 runs it had before took 19 min 16 s there; the
two it adds (a 4-round blocking hop-bound run at a few steps, a 3-round 3-cluster blocking run) are estimated at
3-4 minutes more, not measured yet. Writes results.json, overlap_timeline.png (per configuration: accuracy
against the wall clock, a line per target; per cluster and round: busy vs idle seconds) and runs.json (every
run's per-round records, written as the runs finish); keeps every run's folder and log.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from harness import fresh_out, run_federation, write_results  # beside this script, first on sys.path
from rich.console import Console
from rich.table import Table

from nebula_fl.components import settle
from nebula_fl.config import PRESETS, RunConfig

CONFIGS = ("demo", "hop-bound", "hetero", "secagg")
LINKS = ("unthrottled", "wan")
MORE_STEPS = "blocking-more-steps"  # hop-bound's blocking side at the steps a user would pick to fill the idle time
HOP_MORE = "hop-bound-more-steps"  # its comparison's target: from that side, over it and overlapped-auto
TARGETS = ("demo", "hop-bound", HOP_MORE, "hetero")  # what --target may fix (secagg compares at equal rounds)
GOALS: dict[str, tuple[str, float]] = {
    "time_to_target_ratio": ("<=", 0.8),
    "time_to_target_ratio_hop_bound": ("<=", 0.5),
    "accuracy_gap_points": ("<=", 0.5),
    "busy_fraction": (">=", 0.9),  # judged on the overlapped side
    "hetero_time_ratio": ("<=", 0.7),
    "secure_over_plain_overlapped": ("<=", 1.1),
    "secure_overlapped_accuracy_gap_points": ("<=", 0.5),
}
UNJUDGED = ("time_to_target_ratio_hop_bound_vs_more_steps", "time_to_target_ratio_auto",
            "time_to_target_ratio_unthrottled", "hetero_time_ratio_overlapped", "plain_overlapped_accuracy_gap_points",
            "secure_overlapped_over_blocking")  # figures beside the goals, without one
QUICK_ROUNDS, QUICK_SECAGG_ROUNDS, QUICK_MAX_EXAMPLES = 4, 3, 800


@dataclass(frozen=True, kw_only=True)
class Side:
    """One run of the plan."""

    config: str  # one of CONFIGS
    name: str
    link: str = "unthrottled"  # one of LINKS
    overlap: bool = False  # round-overlap
    auto: bool = False  # local-steps=auto (time-budgeted)
    local_steps: int  # the fixed steps (also what an auto side's budget was calibrated against); 0 with steps_from
    rounds: int
    clusters: int = 2
    workers: str | None = None  # --workers-per-cluster
    threads: str | None = None  # --threads-per-cluster
    slowdown: str | None = None  # --slowdown-per-cluster
    secure: bool = False
    reference: bool = False  # the configuration's blocking fixed-steps run: target and round-seconds come from it
    steps_from: str | None = None  # the run (key) whose median steps per round >= 2 set local_steps, when it has run

    @property
    def key(self) -> str:
        return f"{self.config}/{self.name}@{self.link}"


def plan_sides(*, quick: bool, configs: tuple[str, ...], local_steps: int, hop_local_steps: int, rounds: int,
               secagg_rounds: int, hetero_workers: str, hetero_threads: str | None, secagg_clusters: int,
               hetero_slowdown: str | None = "1,4", hop_more_steps: int | None = None) -> list[Side]:
    """Every run, in the order they go: each configuration's reference first (later sides need its figures), and
    hop-bound's more-steps side after its overlapped-auto side, whose median steps it takes unless `hop_more_steps`
    fixes them."""
    demo = dict(config="demo", local_steps=local_steps, rounds=rounds)
    sides: list[Side] = []
    if "demo" in configs:
        for link in ("wan",) if quick else ("wan", "unthrottled"):
            sides.append(Side(**demo, name="blocking", link=link, reference=link == "wan"))
            sides.append(Side(**demo, name="overlapped", link=link, overlap=True))
            if not quick:
                sides.append(Side(**demo, name="overlapped-auto", link=link, overlap=True, auto=True))
    if "hop-bound" in configs:
        hop = dict(config="hop-bound", local_steps=hop_local_steps, rounds=rounds, link="wan")
        auto = Side(**hop, name="overlapped-auto", overlap=True, auto=True)
        sides += [Side(**hop, name="blocking", reference=True), auto,
                  replace(auto, name=MORE_STEPS, overlap=False, auto=False, local_steps=hop_more_steps or 0,
                          steps_from=None if hop_more_steps else auto.key)]
    if "hetero" in configs:
        het = dict(config="hetero", local_steps=local_steps, rounds=rounds, workers=hetero_workers, threads=hetero_threads,
                   slowdown=hetero_slowdown)
        sides += [Side(**het, name="fixed", reference=True), Side(**het, name="budgeted", auto=True)]
        if not quick:
            sides.append(Side(**het, name="budgeted-overlapped", overlap=True, auto=True))
    if "secagg" in configs:
        sec = dict(config="secagg", local_steps=local_steps, rounds=secagg_rounds, clusters=secagg_clusters)
        sides += [Side(**sec, name="blocking", reference=True), Side(**sec, name="plain", overlap=True),
                  Side(**sec, name="secure", overlap=True, secure=True)]
    return sides


# -- analysis: pure functions of run records (tests/test_overlap_benchmark.py) -------------------------
#
# A run record: {"side": {...Side fields}, "key", "rounds": [{"round", "accuracy", "elapsed_s", "seconds",
# "ready_s", "clusters": {cid: {"steps", "train_s", "busy_fraction", "busy_s", "idle_s", "busy_from"}}}, ...]},
# rounds 1.. in order, elapsed_s from the ServerApp's start to the end of that round's evaluation, ready_s to the
# moment its global adapter was aggregated (`aggregated_seconds`; elapsed_s where a record lacks it).

def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def busy_of(reply: dict[str, Any], timeline: dict[str, Any]) -> dict[str, Any]:
    """A cluster's busy fraction, busy and idle seconds in one round: from the round's timeline entry for it
    (`busy_fraction`, `idle_s`, `busy_s`), else from its reply's metrics (`busy_seconds` / `since_send_seconds`
    as the record spells them), else unknown (None)."""
    fraction, idle, busy = (_num(timeline.get(k)) for k in ("busy_fraction", "idle_s", "busy_s"))
    reply_busy, since = _num(reply.get("busy_seconds")), _num(reply.get("since_send_seconds"))
    if fraction is not None:
        busy = busy if busy is not None else reply_busy
        if busy is None and idle is not None and since is not None:
            busy = max(0.0, since - idle)
        if busy is None and idle is not None and fraction < 1:
            busy = idle * fraction / (1 - fraction)
        if idle is None and busy is not None and fraction > 0:
            idle = busy * (1 - fraction) / fraction
        return {"busy_fraction": fraction, "busy_s": busy, "idle_s": idle, "busy_from": "timeline"}
    if reply_busy is not None and since is not None and since > 0:
        return {"busy_fraction": min(1.0, reply_busy / since), "busy_s": reply_busy,
                "idle_s": max(0.0, since - reply_busy), "busy_from": "reply"}
    return {"busy_fraction": None, "busy_s": None, "idle_s": None, "busy_from": None}


def records_from_lines(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-round records from metrics.jsonl lines."""
    rounds = []
    for line in lines:
        timed = (line.get("timeline") or {}).get("clusters") or {}
        clusters = {}
        for cid, reply in sorted((line.get("clusters") or {}).items()):
            phases = timed.get(cid) or {}
            clusters[cid] = {"steps": reply.get("steps"), "train_s": _num(phases.get("train_s", reply.get("seconds"))),
                             **busy_of(reply, phases)}
        rounds.append({"round": line["round"], "accuracy": line.get("accuracy"), "elapsed_s": line.get("elapsed_seconds"),
                       "ready_s": line.get("aggregated_seconds", line.get("elapsed_seconds")),
                       "seconds": line.get("seconds"), "clusters": clusters})
    return rounds


def reach(rounds: list[dict], target: float) -> dict | None:
    """The first round whose evaluation reaches `target`, or None."""
    return next((r for r in rounds if r["accuracy"] is not None and r["accuracy"] >= target), None)


def time_to_target(rounds: list[dict], target: float | None, *, at: str = "ready_s") -> float | None:
    """When the first global adapter at or above `target` existed (`at` = "ready_s", its aggregation: the primary
    figure), or was measured (`at` = "elapsed_s", the end of its evaluation). On one box the server's evaluation
    shares the cores with the clusters, so with overlapped clusters it runs slower: measuring the adapter is not
    reaching it."""
    hit = reach(rounds, target) if target is not None else None
    return None if hit is None else hit.get(at, hit["elapsed_s"])


def round_one_accuracy(rounds: list[dict]) -> float | None:
    return next((r["accuracy"] for r in rounds if r["round"] == 1), None)


def choose_target(reference: list[dict], sides: list[list[dict]]) -> float | None:
    """The reference (blocking, fixed-steps) run's final accuracy — what a user gets without the feature; how much
    sooner does the other side get it — when it is above every side's round-1 accuracy (`sides` includes the
    reference's own rounds); else the lowest accuracy the reference reaches in a round >= 2 above them; None when
    there is none."""
    firsts = [a for rounds in sides if (a := round_one_accuracy(rounds)) is not None]
    floor = max(firsts, default=float("-inf"))
    final = final_accuracy(reference)
    if final is not None and final > floor:
        return final
    above = [r["accuracy"] for r in reference if r["round"] >= 2 and r["accuracy"] is not None and r["accuracy"] > floor]
    return min(above) if above else None


def target_groups(sides: list[Side]) -> dict[str, tuple[str | None, list[str]]]:
    """Per comparison with a target: the run (key) it is chosen from and the runs whose round 1 it must be above.
    One per configuration but secagg (it compares accuracy at equal rounds), from its reference over its sides but
    hop-bound's more-steps side (its round 1 at more steps must not move the existing hop-bound target); and
    `hop-bound-more-steps`, from that side over it and overlapped-auto (what a user gets blocking at those steps)."""
    groups: dict[str, tuple[str | None, list[str]]] = {}
    for config in dict.fromkeys(s.config for s in sides if s.config != "secagg"):
        mine = [s for s in sides if s.config == config]
        groups[config] = (next((s.key for s in mine if s.reference), None),
                          [s.key for s in mine if s.name != MORE_STEPS])
        more = next((s for s in mine if s.name == MORE_STEPS), None)
        if more is not None:
            auto = [s.key for s in mine if s.auto and s.overlap and s.link == more.link]
            groups[HOP_MORE] = (more.key, [more.key, *auto])
    return groups


def pick_targets(sides: list[Side], runs: dict[str, dict], fixed: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Per comparison with a target (`target_groups`): its value (None: none could be chosen), how it was chosen,
    its reference run and the runs that reach it in round 1 (they should be none)."""
    targets: dict[str, dict[str, Any]] = {}
    for name, (ref, keys) in target_groups(sides).items():
        members = {k: runs[k] for k in keys if k in runs}
        if name in fixed:
            value, how = fixed[name], "fixed by --target"
        elif ref in runs:
            value = choose_target(runs[ref]["rounds"], [r["rounds"] for r in members.values()])
            how = (f"{ref}'s final accuracy, else the lowest it reaches in a round >= 2 above every compared "
                   f"side's round 1; compared: {', '.join(members)}"
                   if value is not None else f"none: {ref} never rose above every compared side's round-1 accuracy")
        else:
            value, how = None, f"none: {ref} did not run"
        targets[name] = {"value": value, "how": how, "reference": ref,
                         "reached_in_round_1": early_hits(members, value) if value is not None else []}
    return targets


def target_name(key: str, side: dict[str, Any], targets: dict[str, dict[str, Any]]) -> str:
    """The target a run's row is read against: the one chosen from it, else its configuration's."""
    return next((name for name, t in targets.items() if t.get("reference") == key), side["config"])


def early_hits(runs: dict[str, dict], target: float) -> list[str]:
    """The runs that reach `target` in round 1 (a target no side may reach by its first round)."""
    return [key for key, run in runs.items() if (hit := reach(run["rounds"], target)) is not None and hit["round"] <= 1]


def median_busy(rounds: list[dict]) -> float | None:
    """Median busy fraction over clusters and rounds >= 2 (None: no cluster reported one)."""
    values = [c["busy_fraction"] for r in rounds if r["round"] >= 2 for c in r["clusters"].values()
              if c.get("busy_fraction") is not None]
    return statistics.median(values) if values else None


def median_round_s(rounds: list[dict], *, first: int = 2) -> float | None:
    values = [r["seconds"] for r in rounds if r["round"] >= first and r.get("seconds") is not None]
    return statistics.median(values) if values else None


def median_steps(rounds: list[dict], *, first: int = 1) -> float | None:
    values = [c["steps"] for r in rounds if r["round"] >= first for c in r["clusters"].values()
              if _num(c.get("steps")) is not None]
    return statistics.median(values) if values else None


def more_steps_of(rounds: list[dict]) -> int | None:
    """The fixed steps of hop-bound's more-steps side: the median steps per round its overlapped-auto side took,
    over clusters and rounds >= 2 (round 1 trains for the budget calibrated at 2 steps, not through the idle time;
    all rounds when there is only one), rounded half up, at least 1; None when no cluster said its steps."""
    median = median_steps(rounds, first=2) if any(r["round"] >= 2 for r in rounds) else median_steps(rounds)
    return None if median is None else max(1, math.floor(median + 0.5))


def slowest_train_s(rounds: list[dict]) -> float | None:
    """Median over rounds of the slowest cluster's training seconds: the calibrated `round-seconds`, so a budgeted
    round takes as long as a fixed one did, and the faster clusters train through what was their idle wait instead
    of finishing early. Rounds >= 2 when there are any (round 1 holds the first steps' warm-up)."""
    timed = [r for r in rounds if r["round"] >= 2] or rounds
    per_round = [max(times) for r in timed
                 if (times := [c["train_s"] for c in r["clusters"].values() if c.get("train_s")])]
    return statistics.median(per_round) if per_round else None


def seconds_per_step(rounds: list[dict]) -> dict[str, float]:
    """Per cluster: median training seconds per step (how unequal the clusters really were)."""
    per: dict[str, list[float]] = {}
    for r in rounds:
        for cid, c in r["clusters"].items():
            if c.get("train_s") and _num(c.get("steps")):
                per.setdefault(cid, []).append(c["train_s"] / c["steps"])
    return {cid: statistics.median(v) for cid, v in sorted(per.items())}


def final_accuracy(rounds: list[dict]) -> float | None:
    return rounds[-1]["accuracy"] if rounds else None


def target_ratio(runs: dict[str, dict], numerator: str, denominator: str, target: float | None,
                 name: str | None = None) -> tuple[float | None, str | None]:
    """Time to target of `numerator` / `denominator` (run keys), or None and why (`name`: the target's, default
    the denominator's configuration)."""
    missing = [key for key in (numerator, denominator) if key not in runs]
    if missing:
        return None, f"{missing[0]} did not run"
    if target is None:
        return None, f"no target for {name or denominator.split('/')[0]} (see targets)"
    times = {}
    for key in (numerator, denominator):
        times[key] = time_to_target(runs[key]["rounds"], target)
        if times[key] is None:
            return None, f"{key} never reached accuracy {target:.4f} in {len(runs[key]['rounds'])} rounds"
    if not times[denominator] > 0:
        return None, f"{denominator} reached the target at {times[denominator]} s"
    return times[numerator] / times[denominator], None


def figures(runs: dict[str, dict], targets: dict[str, float | None], *, wan: str = "wan") -> tuple[dict, dict]:
    """The figures (None where they cannot be computed) and, for each None, why."""
    out: dict[str, Any] = {}
    why: dict[str, str] = {}

    def put(name: str, value_reason: tuple[float | None, str | None]) -> None:
        out[name], reason = value_reason
        if reason:
            why[name] = reason

    demo = targets.get("demo")
    put("time_to_target_ratio", target_ratio(runs, f"demo/overlapped@{wan}", f"demo/blocking@{wan}", demo))
    put("time_to_target_ratio_auto", target_ratio(runs, f"demo/overlapped-auto@{wan}", f"demo/blocking@{wan}", demo))
    put("time_to_target_ratio_unthrottled",
        target_ratio(runs, "demo/overlapped@unthrottled", "demo/blocking@unthrottled", demo))
    hop = {name: f"hop-bound/{name}@{wan}" for name in ("blocking", "overlapped-auto", MORE_STEPS)}
    put("time_to_target_ratio_hop_bound", target_ratio(runs, hop["overlapped-auto"], hop["blocking"],
                                                        targets.get("hop-bound")))
    put("time_to_target_ratio_hop_bound_vs_more_steps",
        target_ratio(runs, hop["overlapped-auto"], hop[MORE_STEPS], targets.get(HOP_MORE), HOP_MORE))
    more = runs.get(hop[MORE_STEPS])
    out["hop_bound_vs_more_steps"] = {
        "blocking_more_steps_local_steps": more["side"].get("local_steps") if more else None,
        "steps_from": more["side"].get("steps_from") if more else None,
        "reused_from": more.get("reused_from") if more else None,
        "overlapped_auto_median_steps": median_steps(runs[hop["overlapped-auto"]]["rounds"], first=2)
        if hop["overlapped-auto"] in runs else None,
        "final_accuracy": {name.replace("-", "_"): final_accuracy(runs[key]["rounds"]) if key in runs else None
                           for name, key in hop.items()},
        "time_to_target_s": {name.replace("-", "_"): time_to_target(runs[key]["rounds"], targets.get(HOP_MORE))
                             if key in runs else None for name, key in hop.items() if name != "blocking"},
    }
    blocking, overlapped = runs.get(f"demo/blocking@{wan}"), runs.get(f"demo/overlapped@{wan}")
    finals = [final_accuracy(r["rounds"]) if r else None for r in (blocking, overlapped)]
    if None in finals:
        put("accuracy_gap_points", (None, f"demo/blocking@{wan} or demo/overlapped@{wan} did not run or has no "
                                          "accuracy"))
    else:
        put("accuracy_gap_points", (100.0 * (finals[0] - finals[1]), None))
    out["busy_fraction"] = {name: median_busy(runs[key]["rounds"]) if key in runs else None
                            for name, key in (("blocking", f"demo/blocking@{wan}"),
                                              ("overlapped", f"demo/overlapped@{wan}"),
                                              ("overlapped_auto", f"demo/overlapped-auto@{wan}"))}
    if out["busy_fraction"]["overlapped"] is None:
        why["busy_fraction"] = (f"demo/overlapped@{wan} did not run" if f"demo/overlapped@{wan}" not in runs else
                                "no cluster reported busy time (no timeline busy_fraction, no busy-seconds reply metric)")
    hetero = targets.get("hetero")
    put("hetero_time_ratio", target_ratio(runs, "hetero/budgeted@unthrottled", "hetero/fixed@unthrottled", hetero))
    put("hetero_time_ratio_overlapped",
        target_ratio(runs, "hetero/budgeted-overlapped@unthrottled", "hetero/fixed@unthrottled", hetero))
    sec = {name: runs.get(f"secagg/{name}@unthrottled") for name in ("blocking", "plain", "secure")}
    medians = {name: median_round_s(r["rounds"]) if r else None for name, r in sec.items()}
    for figure, num, den in (("secure_over_plain_overlapped", "secure", "plain"),
                             ("secure_overlapped_over_blocking", "secure", "blocking")):
        if medians[num] is None or medians[den] is None or not medians[den] > 0:
            put(figure, (None, f"secagg: {den} or {num} did not run or has no round 2"))
        else:
            put(figure, (medians[num] / medians[den], None))
    out["secagg_final_accuracy"] = {name: final_accuracy(r["rounds"]) if r else None for name, r in sec.items()}
    for figure, name in (("secure_overlapped_accuracy_gap_points", "secure"),
                         ("plain_overlapped_accuracy_gap_points", "plain")):
        put(figure, accuracy_gap(sec["blocking"], sec[name], "secagg/blocking@unthrottled",
                                 f"secagg/{name}@unthrottled"))
    return out, why


def accuracy_gap(blocking: dict | None, other: dict | None, blocking_key: str,
                 other_key: str) -> tuple[float | None, str | None]:
    """Final accuracy of `blocking` minus `other`'s, in points, at equal rounds; or None and why."""
    for key, run in ((blocking_key, blocking), (other_key, other)):
        if run is None:
            return None, f"{key} did not run"
        if final_accuracy(run["rounds"]) is None:
            return None, f"{key} has no final accuracy"
    if len(blocking["rounds"]) != len(other["rounds"]):
        return None, (f"unequal rounds: {blocking_key} {len(blocking['rounds'])}, "
                      f"{other_key} {len(other['rounds'])}")
    return 100.0 * (final_accuracy(blocking["rounds"]) - final_accuracy(other["rounds"])), None


def judge(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each goal with its value and whether it is met (a figure that could not be computed is not)."""
    out = {}
    for key, (op, bound) in GOALS.items():
        value = values.get(key)
        if key == "busy_fraction":
            value = (value or {}).get("overlapped")
        met = value is not None and (value >= bound if op == ">=" else value <= bound)
        out[key] = {"goal": f"{op} {bound:g}" + (" (overlapped)" if key == "busy_fraction" else ""),
                    "value": value, "met": met}
    return out


def run_summary(run: dict, target: float | None) -> dict[str, Any]:
    """One run's row: final accuracy, where and when it reached the target, median round, steps, busy."""
    rounds = run["rounds"]
    hit = reach(rounds, target) if target is not None else None
    return {"final_accuracy": final_accuracy(rounds), "round_reached": None if hit is None else hit["round"],
            "time_to_target_s": None if hit is None else hit.get("ready_s", hit["elapsed_s"]),
            "time_to_target_eval_s": None if hit is None else hit["elapsed_s"],
            "elapsed_s": rounds[-1]["elapsed_s"] if rounds else None, "median_round_s_2_to_R": median_round_s(rounds),
            "median_steps": median_steps(rounds), "busy_fraction": median_busy(rounds)}


# -- output ------------------------------------------------------------------------------------------
def _f(value: Any, spec: str = ".3f", unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def runs_table(results: dict[str, Any]) -> Table:
    table = Table(title="every run (time to target: the ServerApp's clock to when that round's adapter was "
                        "aggregated)")
    for col in ("configuration", "side", "link", "target", "final acc", "reached in round", "time to target",
                "median round 2..R", "steps / round", "busy (rounds >= 2)", "box CPU busy", "command"):
        table.add_column(col, justify="left" if col in ("configuration", "side", "link") else "right")
    for row in results["runs"].values():
        side = row["side"]
        target = results["targets"].get(row.get("target", side["config"]), {}).get("value")
        reached = row["round_reached"]
        name = side["name"] + (" (ref)" if side["reference"] else "")
        name += f" ({side['local_steps']} steps)" if side["name"] == MORE_STEPS else ""
        name += f" (= {row['reused_from']})" if row.get("reused_from") else ""
        table.add_row(side["config"], name,
                      side["link"] if side["link"] == "unthrottled" else results["settings"]["wan"],
                      _f(target, ".4f"), _f(row["final_accuracy"], ".4f"),
                      f"not in {row['rounds']}" if reached is None and target is not None else _f(reached, "d"),
                      _f(row["time_to_target_s"], ".1f", " s"), _f(row["median_round_s_2_to_R"], ".1f", " s"),
                      _f(row["median_steps"], "g"), _f(row["busy_fraction"], ".2f"),
                      _f(row.get("box_cpu_busy"), ".0%"), _f(row["command_seconds"], ".0f", " s"))
    return table


def goals_table(results: dict[str, Any]) -> Table:
    table = Table(title="figures vs goals")
    for col in ("figure", "measured", "goal", "met", "note"):
        table.add_column(col, justify="left" if col in ("figure", "note") else "right")
    why = results["why_null"]
    hop = results.get("hop_bound_vs_more_steps") or {}
    finals = hop.get("final_accuracy") or {}
    secagg = results.get("secagg_final_accuracy") or {}
    context = {  # beside a figure: what it is read against
        "time_to_target_ratio_hop_bound_vs_more_steps":
            f"blocking at {_f(hop.get('blocking_more_steps_local_steps'), 'd')} steps"
            + (f" (= {hop['reused_from']})" if hop.get("reused_from") else "")
            + f"; final accuracy overlapped-auto {_f(finals.get('overlapped_auto'), '.4f')}, blocking-more-steps "
              f"{_f(finals.get('blocking_more_steps'), '.4f')}, blocking {_f(finals.get('blocking'), '.4f')}",
    }
    context["secure_overlapped_accuracy_gap_points"] = context["plain_overlapped_accuracy_gap_points"] = (
        "final accuracy " + ", ".join(f"{name} {_f(value, '.4f')}" for name, value in secagg.items()))

    def note(key: str) -> str:
        return "; ".join(x for x in (why.get(key), context.get(key)) if x)

    for key, g in results["goals"].items():
        table.add_row(key, _f(g["value"]), g["goal"].replace(">=", "≥").replace("<=", "≤"),
                      "yes" if g["met"] else "[bold red]NO[/]", note(key))
    busy = results["busy_fraction"]
    table.add_row("busy_fraction (blocking)", _f(busy["blocking"]), "-", "-", "")
    table.add_row("busy_fraction (overlapped-auto)", _f(busy["overlapped_auto"]), "-", "-", "")
    for key in UNJUDGED:
        table.add_row(key, _f(results.get(key)), "-", "-", note(key))
    return table


def targets_lines(results: dict[str, Any]) -> list[str]:
    return [f"{config}: target {_f(t['value'], '.4f')} ({t['how']})" for config, t in results["targets"].items()]


def plot(runs: dict[str, dict], results: dict[str, Any], path: Path, *, wan: str) -> None:
    """Row 1, per configuration and link: accuracy against the ServerApp's clock, a line per side, its targets.
    Row 2, per demo run at the link (`wan`: its spec, for the titles): busy vs idle per cluster and round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[str]] = {}
    for key, run in runs.items():
        groups.setdefault(f"{run['side']['config']} @ {run['side']['link']}", []).append(key)
    busy_keys = [k for k in ("demo/blocking@wan", "demo/overlapped@wan", "demo/overlapped-auto@wan") if k in runs]
    cols = max(len(groups), len(busy_keys), 1)
    fig, axes = plt.subplots(2, cols, figsize=(5 * cols, 8), dpi=110, squeeze=False)
    for ax, (title, keys) in zip(axes[0], groups.items()):
        config = runs[keys[0]]["side"]["config"]
        for key in keys:
            pts = [r for r in runs[key]["rounds"] if r["accuracy"] is not None and r["elapsed_s"] is not None]
            # when each round's adapter existed, as time to target counts it (its evaluation ends later)
            side = runs[key]["side"]
            ax.plot([r.get("ready_s") or r["elapsed_s"] for r in pts], [r["accuracy"] for r in pts], marker="o",
                    label=side["name"] + (f" ({side['local_steps']} steps)" if side["name"] == MORE_STEPS else ""))
        mine = [(name, t["value"]) for name, t in results["targets"].items() if t.get("value") is not None
                and (t["reference"] in keys if t.get("reference") else name == config)]
        for i, (name, target) in enumerate(mine):
            ax.axhline(target, color="grey", linestyle=("--", ":")[i % 2],
                       label=f"target {target:.3f}" + (f" ({name})" if len(mine) > 1 else ""))
        ax.set_title(title.replace("@ wan", f"@ {wan}"), fontsize=9)
        ax.set_xlabel("seconds from the ServerApp's start to the round's aggregate")
        ax.set_ylabel("server accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[0][len(groups):]:
        ax.axis("off")
    for ax, key in zip(axes[1], busy_keys):
        rounds = runs[key]["rounds"]
        cids = sorted({cid for r in rounds for cid in r["clusters"]})
        cells = [(r["round"], i, c) for r in rounds for i, cid in enumerate(cids)
                 if (c := r["clusters"].get(cid, {})).get("busy_fraction") is not None]  # a first round has none
        seconds = bool(cells) and all(c.get("busy_s") is not None and c.get("idle_s") is not None for _, _, c in cells)
        width = 0.8 / max(1, len(cids))
        labelled: set[int] = set()
        for rnd, i, c in cells:
            busy, idle = (c["busy_s"], c["idle_s"]) if seconds else (c["busy_fraction"], 1 - c["busy_fraction"])
            x = rnd + (i - (len(cids) - 1) / 2) * width
            first = i not in labelled
            labelled.add(i)
            ax.bar(x, busy, width, color=f"C{i}", label=f"cluster {cids[i]} busy" if first else None)
            ax.bar(x, idle, width, bottom=busy, color=f"C{i}", alpha=0.25,
                   label=f"cluster {cids[i]} idle" if first else None)
        ax.set_xticks([r["round"] for r in rounds])
        ax.set_title(f"{key.replace('@wan', '@' + wan)}: busy vs idle", fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel("seconds since the last send" if seconds else "fraction of the time since the last send")
        if cells:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no busy / idle time reported", ha="center", va="center", transform=ax.transAxes)
    for ax in axes[1][len(busy_keys):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# -- running -----------------------------------------------------------------------------------------
def side_command(side: Side, *, preset: str, seed: int, wan: str, run_config: str) -> list[str]:
    """`nebula-fl run` arguments of one side."""
    cmd = ["--preset", preset, "--clusters", str(side.clusters), "--rounds", str(side.rounds),
           "--local-steps", "auto" if side.auto else str(side.local_steps), "--seed", str(seed), "--port", "0"]
    if side.overlap:
        cmd.append("--round-overlap")
    if side.link == "wan":
        cmd += ["--wan", wan]
    if side.workers:
        cmd += ["--workers-per-cluster", side.workers]
    if side.threads:
        cmd += ["--threads-per-cluster", side.threads]
    if side.slowdown:
        cmd += ["--slowdown-per-cluster", side.slowdown]
    if side.secure:
        cmd.append("--secure-aggregation")
    return [*cmd, "--run-config", run_config]


def same_run(cmd: list[str], runs: dict[str, dict]) -> str | None:
    """The run already made with exactly this command (arguments and run config), if any: a side that would
    repeat it reuses it (hop-bound's more-steps side at the preset's steps is the demo's blocking side at --wan)."""
    return next((key for key, run in runs.items() if run["command"] == shlex.join(cmd)), None)


def machine() -> dict[str, Any]:
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.lower().startswith("model name")), "")
    except OSError:
        pass
    return {"cores": os.cpu_count(), "cpu": model or platform.processor(), "python": platform.python_version()}


def _targets_arg(items: list[str] | None, parser: argparse.ArgumentParser) -> dict[str, float]:
    out = {}
    for item in items or []:
        config, sep, value = item.partition("=")
        try:
            acc = float(value)
        except ValueError:
            acc = -1.0
        if not sep or config not in TARGETS or not 0 < acc < 1:
            parser.error(f"--target '{item}' is not NAME=ACC with NAME one of {', '.join(TARGETS)} and ACC in (0, 1)")
        out[config] = acc
    return out


def cpu_times() -> list[int] | None:
    """The whole box's CPU time counters (/proc/stat's first line), or None where there is none."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None


def cpu_busy(before: list[int] | None, after: list[int] | None) -> float | None:
    """The share of the box's CPU time that was busy between two readings (idle and iowait are not): on one box
    the clusters, the server and Flower share the cores, and a run that already keeps them busy has no idle
    time for overlapping to fill."""
    if before is None or after is None or len(before) < 5 or len(after) != len(before):
        return None
    spent = [b - a for a, b in zip(before, after)]
    total = sum(spent[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return None if total <= 0 else 1.0 - (spent[3] + spent[4]) / total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"only the runs the figures need (10; 9 when one is reused), {QUICK_ROUNDS} rounds "
                             f"({QUICK_SECAGG_ROUNDS} for secagg) on {QUICK_MAX_EXAMPLES} examples: meant for 20-25 "
                             "min on 2 idle cores")
    parser.add_argument("--preset", default="demo", choices=sorted(PRESETS), help="the preset every run starts from")
    parser.add_argument("--model", default=None, help="the preset's model unless given; 'tiny' builds a tiny BERT here")
    parser.add_argument("--rounds", type=int, default=None, help=f"rounds per run (default the preset's; --quick {QUICK_ROUNDS})")
    parser.add_argument("--secagg-rounds", type=int, default=None,
                        help=f"rounds of the secagg pair (default --rounds; --quick {QUICK_SECAGG_ROUNDS})")
    parser.add_argument("--max-examples", type=int, default=None,
                        help=f"dataset cap (default the preset's; --quick {QUICK_MAX_EXAMPLES})")
    parser.add_argument("--local-steps", type=int, default=None, help="the fixed local steps (default the preset's)")
    parser.add_argument("--hop-local-steps", type=int, default=2, help="the hop-bound configuration's local steps")
    parser.add_argument("--hop-more-steps", type=int, default=None,
                        help="the local steps of hop-bound's blocking-more-steps side (default: the median steps "
                        "per round >= 2 its overlapped-auto side took; the preset's reuses the demo's blocking run "
                        "at --wan)")
    parser.add_argument("--max-local-steps", type=int, default=100, help="the most steps an auto round may train")
    parser.add_argument("--round-seconds", type=float, default=None,
                        help="the time budget of auto sides (default: calibrated from each configuration's reference)")
    parser.add_argument("--wan", default="20mbit:100ms", help="the emulated link of the linked runs")
    parser.add_argument("--hetero-workers", default="2,1", help="hetero: --workers-per-cluster")
    parser.add_argument("--hetero-threads", default=None, help="hetero: --threads-per-cluster (default: the cores "
                        "shared evenly)")
    parser.add_argument("--hetero-slowdown", default="1,4",
                        help="hetero: --slowdown-per-cluster (default 1,4: cluster 1 as a site with a quarter of the "
                        "compute; the extra time asleep, so it takes no CPU from cluster 0 on this one box)")
    parser.add_argument("--secagg-clusters", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"a subset of {','.join(CONFIGS)}")
    parser.add_argument("--target", action="append", metavar="NAME=ACC",
                        help=f"fix a comparison's target accuracy ({', '.join(TARGETS)}) instead of choosing it "
                        "from its reference run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/overlap")
    args = parser.parse_args()
    fixed_targets = _targets_arg(args.target, parser)
    configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    if not configs or any(c not in CONFIGS for c in configs):
        parser.error(f"--configs '{args.configs}': use some of {', '.join(CONFIGS)}")
    preset = settle(RunConfig().replace(dict(PRESETS[args.preset])))
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else preset.federation.num_server_rounds)
    secagg_rounds = args.secagg_rounds or (QUICK_SECAGG_ROUNDS if args.quick else rounds)
    local_steps = args.local_steps or preset.train.local_steps or 10
    max_examples = args.max_examples if args.max_examples is not None else (
        QUICK_MAX_EXAMPLES if args.quick else preset.data.max_examples)
    if rounds < 2 or secagg_rounds < 2:
        parser.error("rounds must be 2 or more (the target is above round 1; secagg compares rounds 2..N)")
    more = args.hop_more_steps
    if min(local_steps, args.hop_local_steps, args.max_local_steps, 1 if more is None else more) < 1 \
            or args.secagg_clusters < 3:
        parser.error("step counts must be 1 or more and --secagg-clusters 3 or more (SecAgg+ needs 3 shares)")
    if args.round_seconds is not None and not args.round_seconds > 0:
        parser.error("--round-seconds must be > 0")
    console = Console(highlight=False, width=200)
    out = fresh_out(args.out)
    model = args.model
    if model == "tiny":
        from nebula_fl.model.tiny import build_tiny_model

        model = str(build_tiny_model(out / "tiny-model"))
    sides = plan_sides(quick=args.quick, configs=configs, local_steps=local_steps, hop_local_steps=args.hop_local_steps,
                       rounds=rounds, secagg_rounds=secagg_rounds, hetero_workers=args.hetero_workers,
                       hetero_threads=args.hetero_threads, secagg_clusters=args.secagg_clusters,
                       hetero_slowdown=args.hetero_slowdown, hop_more_steps=args.hop_more_steps)
    console.print(f"{len(sides)} runs, one at a time: preset {args.preset}, model {args.model or 'the preset’s'}, "
                  f"{rounds} rounds ({secagg_rounds} secagg), {local_steps} local steps ({args.hop_local_steps} "
                  f"hop-bound; its more-steps side {args.hop_more_steps or 'at its overlapped-auto median'}), "
                  f"{max_examples or 'all'} examples, seed {args.seed}, link {args.wan}")
    started = time.monotonic()
    runs: dict[str, dict] = {}
    budgets: dict[str, float | None] = {}
    notes: list[str] = []
    for n, side in enumerate(sides, start=1):
        budget = (args.round_seconds or budgets.get(side.config)) if side.auto else None
        if side.auto and budget is None:
            notes.append(f"{side.key}: skipped, no round-seconds (its reference did not run or timed no training)")
            console.print(f"[red]{side.key} skipped:[/red] {notes[-1]}")
            continue
        if side.steps_from is not None:
            steps = more_steps_of(runs[side.steps_from]["rounds"]) if side.steps_from in runs else None
            if steps is None:
                notes.append(f"{side.key}: skipped, no steps from {side.steps_from} (it did not run or said none)")
                console.print(f"[red]{side.key} skipped:[/red] {notes[-1]}")
                continue
            side = replace(side, local_steps=steps)
        extra = [f"max-examples={max_examples}", "eval-initial=false", f"max-local-steps={args.max_local_steps}"]
        extra += [f"round-seconds={max(budget, 0.01):.3f}"] if budget else []
        extra += [f'model="{model}"'] if model else []
        cmd = side_command(side, preset=args.preset, seed=args.seed, wan=args.wan, run_config=" ".join(extra))
        folder = out / side.key.replace("/", "-")
        same = same_run(cmd, runs)
        console.print(f"[bold]{n}/{len(sides)} {side.key}[/bold]" + (f", round-seconds {budget:.2f}" if side.auto else "")
                      + (f", {side.local_steps} steps (from {side.steps_from})" if side.steps_from else "")
                      + (f": the same command as {same}, reused" if same else "")
                      + f" ({time.monotonic() - started:.0f} s so far)")
        if same is not None:  # one run, two sides: its records (and times) are that run's
            run = {**runs[same], "key": side.key, "side": asdict(side), "reused_from": same}
            notes.append(f"{side.key}: not run, its command is {same}'s exactly: that run is reused")
        else:
            launched, cpu_before = time.monotonic(), cpu_times()
            try:
                _, lines = run_federation(cmd, folder=folder, log=folder.parent / f"{folder.name}.log")
            except SystemExit as err:  # a failed run stops only itself: its figures are null, the reason a note
                notes.append(f"{side.key}: {err}")
                console.print(f"[red]{side.key} failed:[/red] {err}")
                continue
            run = {"key": side.key, "side": asdict(side), "round_seconds": budget, "reused_from": None,
                   "command": shlex.join(cmd), "folder": str(folder), "command_seconds": time.monotonic() - launched,
                   "box_cpu_busy": cpu_busy(cpu_before, cpu_times()), "rounds": records_from_lines(lines)}
        runs[side.key] = run
        if side.reference:
            budgets[side.config] = args.round_seconds or slowest_train_s(run["rounds"])
        (out / "runs.json").write_text(json.dumps(runs, indent=1) + "\n")
        accs = " ".join(_f(r["accuracy"]) for r in run["rounds"])
        busy = run["box_cpu_busy"]
        console.print(f"  accuracy by round {accs}; {run['command_seconds']:.0f} s"
                      + ("" if busy is None else f"; the box's cores {busy:.0%} busy"))

    targets = pick_targets(sides, runs, fixed_targets)
    notes += [f"{config}: {', '.join(t['reached_in_round_1'])} reach the target {t['value']:.4f} in round 1: its "
              "ratios say little" for config, t in targets.items() if t["reached_in_round_1"]]
    target_of = {c: t["value"] for c, t in targets.items()}
    values, why = figures(runs, target_of)
    per_run = {}
    for key, run in runs.items():
        name = target_name(key, run["side"], targets)
        per_run[key] = {"side": run["side"], "rounds": len(run["rounds"]), "round_seconds": run["round_seconds"],
                        "command_seconds": run["command_seconds"], "folder": run["folder"],
                        "reused_from": run.get("reused_from"), "box_cpu_busy": run.get("box_cpu_busy"),
                        "target": name, **run_summary(run, target_of.get(name))}
    hetero_ref = runs.get("hetero/fixed@unthrottled")
    results = {
        "benchmark": "overlap", "machine": machine(), "command": shlex.join([sys.executable, *sys.argv]),
        "settings": {"preset": args.preset, "model": args.model, "quick": args.quick, "rounds": rounds,
                     "secagg_rounds": secagg_rounds, "local_steps": local_steps, "hop_local_steps": args.hop_local_steps,
                     "hop_more_steps": args.hop_more_steps or "the median steps per round >= 2 of "
                                                              "hop-bound/overlapped-auto",
                     "max_local_steps": args.max_local_steps, "max_examples": max_examples, "wan": args.wan,
                     "hetero_workers": args.hetero_workers, "hetero_threads": args.hetero_threads,
                     "hetero_slowdown": args.hetero_slowdown,
                     "secagg_clusters": args.secagg_clusters, "seed": args.seed, "eval_initial": False},
        "round_seconds": budgets, "targets": targets, **values, "why_null": why,
        "goals": judge(values),
        "hetero_seconds_per_step": seconds_per_step(hetero_ref["rounds"]) if hetero_ref else None,
        "reused": {key: run["reused_from"] for key, run in runs.items() if run.get("reused_from")},
        "runs": per_run, "notes": notes, "benchmark_seconds": time.monotonic() - started,
    }
    write_results(out, results)
    plot(runs, results, out / "overlap_timeline.png", wan=args.wan)
    console.print(runs_table(results))
    for line in targets_lines(results):
        console.print(line)
    console.print(goals_table(results))
    for note in notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    console.print(f"results: {out / 'results.json'}, plot: {out / 'overlap_timeline.png'} "
                  f"({results['benchmark_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
