"""What secure aggregation costs: nebula-fl plain vs nebula-fl secure vs Flower's own legacy SecAgg+.

In one run, side by side, with the same clusters (default 8) and an adapter of about a million
parameters (the shipped MiniLM with LoRA rank 108 on query,value; codec `none`, so the masked vector is
the whole adapter) and a training cost kept tiny so that the rounds measure the protocol, not the model:
  1. `nebula-fl run` plain and `nebula-fl run --secure-aggregation` (same seed, data, rounds), blocking rounds,
     and the same pair again with `--round-overlap` (same seed, data, rounds, polling):
     `secure_over_plain_overlapped` beside `secure_over_plain`,
  2. Flower 1.42's legacy SecAgg+ (`SecAggPlusWorkflow`, via `secagg_legacy_run.run_legacy`) on real
     processes with the same clusters and the adapter's parameter count, and its plain round.
  3. the shipped demo (`nebula-fl run --preset demo`: its model, data, 2 clusters and local steps) plain and
     with `--secure-aggregation`, same seed: `secure_over_plain_demo`, beside the 8-cluster figure.
Round 1 holds the one-time key setup of a key epoch, so round times are compared on rounds 2..R
(medians); the median over all rounds and the setup seconds are reported too.

The overlapped pair is compared on rounds 2..R as well, for a second reason: round 1 of an overlapped run is
not yet an overlapped round. No cluster has trained ahead (it trains its steps on arrival, as when blocking),
and the secure side holds round 1's masked sum to unmask it with the answers riding on round 2's messages: its
round 1 returns the adapter unchanged (`pending` in its `secagg` report, 0 clusters aggregated; not a skipped
round) besides the key setup. From round 2 on, on both sides, the global moves one round late and the clusters
train through the hops; the secure side's round r applies round r-1's sum with no extra trip. The last round R
unmasks its own sum at once (one explicit unmask trip: the final adapter holds every round), so with --quick's
3 rounds the median of rounds 2..3 is their mean, half of it that flush; `steady_secure_over_plain` (rounds
2..R-1, no flush; null under 3 rounds) is reported beside it, without a goal. The secure side's round 2 also
sends no new adapter down (round 1 left the global unchanged, and the clusters hold it), so the overlapped
pair's bytes ratio (reported, no goal) is below the blocking one's.

That each nebula-fl side ran the way it is labelled is read back from its run folder, and the benchmark stops
(saying why) when it did not: config.json's `round-overlap`; the plain side's clusters trained ahead (in rounds
2..R a cluster's `busy_seconds`, which counts the steps trained between messages, above its on-arrival
`seconds`); the secure side applied a round's sum in a later round (`unmasked_rounds` in its `secagg` report)
or held round 1 (`pending`). The blocking sides must show none of it. Every secure side's per-round
`setup_trips` and `extra_trips` (message trips beyond the plain round's) are in results.json (`trips`) and
printed under the table: the hops each protocol really made.

Every side polls alike: the legacy ServerApp pulls replies at nebula-fl's own interval (read from
nebula-fl's code, not typed here) instead of Flower's fixed 3 s, and every SuperNode's SuperExec gets the
launcher's FLWR_SUPEREXEC_TASK_POLL_INTERVAL; flower-supernode's own polls (3 s when idle, 0.5 s for a
ClientApp's reply) are fixed inside Flower, the same on every side. What each side ran with is read back
from its processes and records and stated in the table's caption and in results.json (`polling`).

    .venv/bin/python benchmarks/secagg.py            # 4 rounds per 8-cluster side, the demo's 5 rounds
    .venv/bin/python benchmarks/secagg.py --quick    # 3 rounds each, fewer examples, no legacy plain: ~10 min
                                                     # before the overlapped pair (two more 3-round runs)

Writes results.json (and each side's run folder and logs) under --out; prints a table with the goals.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import math
import os
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

# harness and secagg_legacy_run: beside this script, first on sys.path
from harness import SERVER_APP_SOURCE, flower_env, fresh_out, metrics_lines, run_federation, write_results
from rich.console import Console
from rich.table import Table
from safetensors import safe_open
from secagg_legacy_run import run_legacy

import nebula_fl.strategies.secure_aggregation as secure_strategy
from nebula_fl.config import PRESETS, default_run_config
from nebula_fl.strategies.base import NebulaStrategy

GOALS = {"secure_over_plain": ("<=", 1.3), "secure_over_plain_overlapped": ("<=", 1.1),
         "legacy_over_nebula": (">", 1.0), "bytes_secure_over_plain": ("<=", 1.1), "secure_over_plain_demo": ("<=", 1.3)}
TASK_POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"
FLOWER_DEFAULT_TASK_POLL = "1.0"  # flwr 1.42's SuperExec when the variable is not set
# Inside flower-supernode, not settable: a pull every 3 s while it has no message, and a poll every 0.5 s
# for its ClientApp's reply (NOTES.md, read from flwr 1.42's source). The same binary on every side.
SUPERNODE_FIXED = {"supernode_idle_pull_s": 3.0, "supernode_reply_poll_s": 0.5}
# the demo preset's own num-server-rounds; --quick runs DEMO_ROUNDS_QUICK
DEMO_ROUNDS = int({**default_run_config(), **PRESETS["demo"]}["num-server-rounds"])
DEMO_ROUNDS_QUICK = 3  # the fewest that leave a median of two rounds after round 1 (key setup)


# -- polling: the same on every side ---------------------------------------------------------------
def nebula_polling() -> dict[str, Any]:
    """nebula-fl's own polling intervals, read from the code that sets them (so the legacy side follows
    whatever nebula-fl does, not a number copied here).

    `server_pull_s`: how often nebula-fl's ServerApp pulls replies: the `poll_interval` its `start` call
    passes (nebula_fl/server/app.py) or else that parameter's default (NebulaStrategy.start). `stage_pull_s`:
    the literal intervals the secure-aggregation stages pass to `exchange`. `superexec_task_poll_s`: what
    the launcher's `child_env` gives every Flower process it starts (SUPEREXEC_POLL_S unless the
    environment already sets FLWR_SUPEREXEC_TASK_POLL_INTERVAL).
    """
    default = inspect.signature(NebulaStrategy.start).parameters["poll_interval"].default
    passed = _keyword_values(SERVER_APP_SOURCE, "poll_interval", call="start")
    if passed is None or any(isinstance(v, str) for v in passed) or len(set(passed)) > 1:
        raise SystemExit(f"cannot read the poll_interval nebula-fl's ServerApp uses from {SERVER_APP_SOURCE} "
                         f"(`.start(` calls pass {passed}); update nebula_polling() in {__file__}")
    stage = _keyword_values(Path(secure_strategy.__file__), "poll_interval", call="exchange") or []
    return {"server_pull_s": float(passed[0]) if passed else float(default),
            "stage_pull_s": sorted({v if isinstance(v, str) else float(v) for v in stage}, key=str),
            "superexec_task_poll_s": flower_env(Path(os.devnull))[TASK_POLL_ENV],
            "source": "NebulaStrategy.start(poll_interval) as nebula_fl/server/app.py calls it; "
                      "nebula_fl/launcher/federation.py child_env (SUPEREXEC_POLL_S)"}


def _keyword_values(path: Path, keyword: str, *, call: str) -> list[float | str] | None:
    """The values of `keyword=` in every call of a function or method named `call` in one source file (a
    value that is not a literal number as its source text): None if there is no such call at all."""
    found: list[float | str] | None = None
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name != call:
            continue
        if found is None:
            found = []
        for kw in node.keywords:
            if kw.arg == keyword:
                try:
                    found.append(float(ast.literal_eval(kw.value)))
                except (ValueError, TypeError):
                    found.append(ast.unparse(kw.value))
    return found


class SuperExecWatch:
    """Reads FLWR_SUPEREXEC_TASK_POLL_INTERVAL from the environment of every `flower-superexec` and every nebula-fl
    ClientApp runner (which takes a SuperNode's SuperExec's place and honours the same variable) this
    benchmark's processes start (a background scan once a second), by the role of the process that
    started it (`supernode` or `superlink`): what each side really ran with, not what it was told."""

    def __init__(self) -> None:
        self.seen: dict[str, set[str]] = {}
        self._checked: set[tuple[int, float]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="superexec-watch", daemon=True)

    def __enter__(self) -> SuperExecWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def report(self) -> dict[str, list[str]]:
        return {role: sorted(values) for role, values in sorted(self.seen.items())}

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self.scan()

    def scan(self) -> None:
        for proc in psutil.Process().children(recursive=True):
            try:
                key, cmd = (proc.pid, proc.create_time()), proc.cmdline()
                runner = "nebula_fl" in cmd and "clientapp" in cmd  # a nebula-fl cluster's SuperExec (clients/runner.py)
                if key in self._checked or not (runner or any(part.endswith("flower-superexec") for part in cmd)):
                    continue
                parent = proc.parent()
                role = "supernode" if runner or (parent and any("flower-supernode" in p for p in parent.cmdline())) \
                    else "superlink"
                value = proc.environ().get(TASK_POLL_ENV, f"unset (Flower's {FLOWER_DEFAULT_TASK_POLL})")
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            self._checked.add(key)
            self.seen.setdefault(role, set()).add(value)


def watched(run, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, list[str]]]:
    """`run(*args, **kwargs)` with its SuperExecs watched: (its result, the intervals they ran with)."""
    with SuperExecWatch() as watch:
        result = run(*args, **kwargs)
    return result, watch.report()


# -- nebula-fl -------------------------------------------------------------------------------------
def nebula_args(args: argparse.Namespace, *, secure: bool, overlap: bool = False) -> list[str]:
    """The 8-cluster setting's `nebula-fl run` arguments; `overlap` adds `--round-overlap`, nothing else changes."""
    run_config = (f"max-examples={args.max_examples} batch-size=2 max-seq-len={args.max_seq_len} "
                  f"lora-r={args.lora_r} eval-initial=false eval-batch-size=256 "
                  f"test-fraction={args.test_fraction}")
    cmd = ["--clusters", str(args.clusters), "--rounds", str(args.rounds), "--local-steps", "1",
           "--seed", str(args.seed), "--port", "0", "--codec", "none", "--partition", "iid", "--run-config", run_config]
    return cmd + (["--secure-aggregation"] if secure else []) + (["--round-overlap"] if overlap else [])


def demo_args(args: argparse.Namespace, *, secure: bool) -> list[str]:
    """The shipped demo as `nebula-fl run --preset demo` runs it, with a fixed seed and port 0; --quick
    runs fewer rounds and leaves out the round-0 evaluation (before round 1: no round's time holds it)."""
    cmd = ["--preset", "demo", "--rounds", str(args.demo_rounds), "--seed", str(args.seed), "--port", "0"]
    if args.quick:
        cmd += ["--run-config", "eval-initial=false"]
    return cmd + (["--secure-aggregation"] if secure else [])


def run_nebula(name: str, cmd: list[str], *, secure: bool, rounds: int, out: Path, console: Console) -> dict:
    folder = out / name
    console.print(f"[bold]{name}[/bold]: nebula-fl run {shlex.join(cmd)}")
    started = time.monotonic()
    _, superexec = watched(run_federation, cmd, folder=folder, log=folder.with_suffix(".log"))
    side = read_side(name, folder, secure=secure)
    if len(side["rounds"]) != rounds:
        raise SystemExit(f"{name} recorded {len(side['rounds'])} of {rounds} rounds; see {folder / 'metrics.jsonl'}")
    console.print(f"  {name} done in {time.monotonic() - started:.0f} s")
    return {**side, "wall_s": time.monotonic() - started, "superexec_task_poll_s": superexec}


def read_side(name: str, folder: Path, *, secure: bool) -> dict:
    """A finished nebula-fl run as this benchmark compares it, from its run folder: per round its seconds, bytes and
    cluster timings, its `secagg` report; config.json's `round-overlap` (as the run recorded it, not as asked)."""
    rounds_out = []
    for line in metrics_lines(folder):
        clusters = {k: {"bytes_up": c.get("bytes_up", 0), "bytes_down": c.get("bytes_down", 0),
                        "seconds": c.get("seconds"), "busy_seconds": c.get("busy_seconds")}  # (absent under secagg)
                    for k, c in line["clusters"].items()}
        rounds_out.append({"round": line["round"], "seconds": line["seconds"], "accuracy": line.get("accuracy"),
                           "clusters_aggregated": line.get("clusters_aggregated"), "skipped": line.get("skipped"),
                           "secagg": line.get("secagg"), "clusters": clusters})
    run_config = json.loads((folder / "config.json").read_text()).get("run_config", {})
    return {"name": name, "secure": secure, "folder": str(folder), "params": adapter_params(folder),
            "round_overlap": run_config.get("round-overlap"),
            "round_seconds": [r["seconds"] for r in rounds_out], "rounds": rounds_out}


def adapter_params(folder: Path) -> int:
    """The number of values in the run's final adapter: what is trained, exchanged and (securely) summed."""
    with safe_open(str(folder / "adapter.safetensors"), framework="numpy") as handle:
        return sum(math.prod(handle.get_slice(key).get_shape()) for key in handle.keys())  # noqa: SIM118 (not iterable)


def cluster_round_bytes(side: dict) -> list[int]:
    """Up + down bytes of every cluster in every round after the first (round 1 has no downlink of a new
    adapter and the secure side's key setup; both are reported apart)."""
    return [c["bytes_up"] + c["bytes_down"] for r in side["rounds"][1:] for c in r["clusters"].values()]


def problems(side: dict, clusters: int) -> list[str]:
    """Rounds that did not aggregate every cluster (an aborted secure round, a skipped round): a measured
    time from such a round is not a time of the protocol, so it is reported."""
    out = []
    for r in side["rounds"]:
        sec = r.get("secagg") or {}
        if sec.get("pending") == r["round"] and not sec.get("aborted") and not r.get("skipped"):
            if sec.get("uploaded", clusters) != clusters:  # overlapped: held, to be unmasked next round
                out.append(f"{side['name']} round {r['round']}: held {sec.get('uploaded')} uploads of {clusters}")
            continue
        if r.get("skipped") or sec.get("aborted") or r.get("clusters_aggregated") != clusters:
            out.append(f"{side['name']} round {r['round']}: aggregated {r.get('clusters_aggregated')}, "
                       f"skipped {r.get('skipped')}, secagg aborted {sec.get('aborted')}")
        elif side["secure"] and sec.get("survivors") != clusters:
            out.append(f"{side['name']} round {r['round']}: {sec.get('survivors')} survivors of {clusters}")
    return out


# -- what each side really ran: overlap and trips, read back from its run folder ----------------------
def applied_rounds(sec: dict) -> list[int]:
    """The rounds whose sums a secure round applied, as its `secagg` report says (`unmasked_rounds`, or the
    single `unmasked_round`)."""
    if sec.get("unmasked_rounds") is not None:
        return [int(q) for q in sec["unmasked_rounds"]]
    return [] if sec.get("unmasked_round") is None else [int(sec["unmasked_round"])]


def overlap_evidence(side: dict) -> dict[str, Any]:
    """What a nebula-fl side's run folder says about round overlap: config.json's `round-overlap`; per round
    2..R how many clusters trained ahead (`busy_seconds`, which counts the steps trained between messages, above
    the on-arrival `seconds`) of those that report both (none do under secure aggregation); the secure rounds
    that applied an earlier round's sum ([round, the round summed]) and those that held their own (`pending`)."""
    ahead = []
    for r in side["rounds"][1:]:
        timed = [c for c in r["clusters"].values()
                 if c.get("busy_seconds") is not None and c.get("seconds") is not None]
        ahead.append({"round": r["round"], "trained_ahead": sum(c["busy_seconds"] > c["seconds"] for c in timed),
                      "timed": len(timed)})
    late, pending = [], []
    for r in side["rounds"]:
        sec = r.get("secagg") or {}
        late += [[r["round"], q] for q in applied_rounds(sec) if q < r["round"]]
        if sec.get("pending") is not None:
            pending.append(r["round"])
    return {"config_round_overlap": side.get("round_overlap"), "trained_ahead": ahead, "late_sums": late,
            "pending_rounds": pending}


def overlap_problems(side: dict, *, overlapped: bool) -> list[str]:
    """Why a side did not run as labelled (`overlapped` or blocking), from overlap_evidence; [] when it did. An
    overlapped side needs config.json's `round-overlap` true and its own proof: the secure side a sum applied
    late or a held round, and wherever clusters report timings (the plain side), some cluster that trained ahead
    in rounds 2..R. A blocking side shows none of it."""
    ev = overlap_evidence(side)
    name, out = side["name"], []
    if ev["config_round_overlap"] != overlapped:
        out.append(f"{name}: its config.json says round-overlap {ev['config_round_overlap']}, expected {overlapped}")
    timed = sum(a["timed"] for a in ev["trained_ahead"])
    ahead = sum(a["trained_ahead"] for a in ev["trained_ahead"])
    if overlapped:
        if side["secure"] and not (ev["late_sums"] or ev["pending_rounds"]):
            out.append(f"{name}: no round held its masked sum or applied an earlier round's (`pending` / "
                       "`unmasked_rounds` in its rounds' `secagg` reports): its rounds were unmasked at once")
        if not side["secure"] and not timed:
            out.append(f"{name}: no cluster reported `seconds` and `busy_seconds` in rounds 2..R: overlap unproven")
        if timed and not ahead:
            out.append(f"{name}: no cluster trained ahead in rounds 2..R (busy_seconds never above seconds)")
    else:
        if ahead:
            out.append(f"{name}: {ahead} cluster-round(s) trained ahead, yet the side is blocking")
        if ev["late_sums"] or ev["pending_rounds"]:
            out.append(f"{name}: held or late sums {ev['pending_rounds']} / {ev['late_sums']}, yet the side is blocking")
    return out


def require_as_labelled(side: dict, *, overlapped: bool) -> None:
    """Stop the benchmark when a side did not run as labelled: a ratio of mislabelled sides measures nothing."""
    if found := overlap_problems(side, overlapped=overlapped):
        raise SystemExit("; ".join(found) + f"; see {side['folder']}")


def trips(side: dict) -> list[dict[str, Any]]:
    """Per round, the message trips a secure side made beyond the plain round's, from its `secagg` report:
    `setup_trips` (key setup, share distribution) and `extra_trips` (view, unmask, recover), and the rounds whose
    sums it applied."""
    out = []
    for r in side["rounds"]:
        sec = r.get("secagg") or {}
        out.append({"round": r["round"], "setup_trips": sec.get("setup_trips", 0),
                    "extra_trips": sec.get("extra_trips", 0), "applied": applied_rounds(sec),
                    "pending": sec.get("pending")})
    return out


# -- analysis --------------------------------------------------------------------------------------
def after_first(seconds: list[float]) -> float:
    return statistics.median(seconds[1:])


def goal(name: str, value: float | None) -> dict[str, Any]:
    op, target = GOALS[name]
    met = value is not None and (value <= target if op == "<=" else value > target)
    return {"value": value, "goal": f"{op} {target}", "met": met}


def stage_seconds(secure: dict) -> dict[str, Any]:
    """The secure side's key setup (round 1 of a key epoch) and unmask seconds, as its rounds record them."""
    sec_rounds = [r.get("secagg") or {} for r in secure["rounds"]]
    setup = [s["setup_s"] for s in sec_rounds if "setup_s" in s]
    unmask = [s["unmask_s"] for s in sec_rounds if "unmask_s" in s]
    return {"setup_s": statistics.median(setup) if setup else None,
            "unmask_s": statistics.median(unmask) if unmask else None,
            "setup_s_each": setup, "unmask_s_each": unmask}


def nebula_side(side: dict) -> dict[str, Any]:
    return {"median_round_s_2_to_R": after_first(side["round_seconds"]),
            "median_round_s_all": statistics.median(side["round_seconds"]),
            "first_round_s": side["round_seconds"][0],
            "bytes_per_cluster_round_2_to_R": statistics.mean(cluster_round_bytes(side)),
            "folder": side["folder"]}


def demo_pair(plain: dict, secure: dict, *, quick: bool) -> dict[str, Any]:
    """The demo's plain and secure runs: their ratio of rounds 2..R medians, and what it is made of."""
    return {
        "secure_over_plain": after_first(secure["round_seconds"]) / after_first(plain["round_seconds"]),
        "bytes_secure_over_plain": (statistics.mean(cluster_round_bytes(secure))
                                    / statistics.mean(cluster_round_bytes(plain))),
        "rounds": len(plain["rounds"]), "clusters": len(plain["rounds"][0]["clusters"]), "params": secure["params"],
        "command": "nebula-fl run --preset demo --rounds R --seed S --port 0 [--secure-aggregation]"
                   + (" --run-config eval-initial=false (--quick)" if quick else ""),
        "sides": {"nebula_plain": nebula_side(plain), "nebula_secure": nebula_side(secure)},
        "round_seconds": {"nebula_plain": plain["round_seconds"], "nebula_secure": secure["round_seconds"]},
        "accuracy": {"nebula_plain": [r["accuracy"] for r in plain["rounds"]],
                     "nebula_secure": [r["accuracy"] for r in secure["rounds"]]},
        "stage_seconds": stage_seconds(secure),
        "trips": trips(secure),
        "wall_s": {"nebula_plain": plain["wall_s"], "nebula_secure": secure["wall_s"]},
    }


def overlapped_pair(plain: dict, secure: dict) -> dict[str, Any]:
    """The overlapped plain and secure runs: their ratio of rounds 2..R medians (`secure_over_plain`), the same
    without the last round's flush (`steady_secure_over_plain`, rounds 2..R-1; None under 3 rounds), bytes,
    each side's overlap evidence and the secure side's trips."""
    steady = (statistics.median(secure["round_seconds"][1:-1]) / statistics.median(plain["round_seconds"][1:-1])
              if len(plain["round_seconds"]) >= 3 and len(secure["round_seconds"]) >= 3 else None)
    return {
        "secure_over_plain": after_first(secure["round_seconds"]) / after_first(plain["round_seconds"]),
        "steady_secure_over_plain": steady,
        "bytes_secure_over_plain": (statistics.mean(cluster_round_bytes(secure))
                                    / statistics.mean(cluster_round_bytes(plain))),
        "rounds": len(plain["rounds"]), "compared_rounds": f"2..{len(plain['rounds'])}",
        "sides": {"nebula_plain_overlapped": nebula_side(plain), "nebula_secure_overlapped": nebula_side(secure)},
        "round_seconds": {"nebula_plain_overlapped": plain["round_seconds"],
                          "nebula_secure_overlapped": secure["round_seconds"]},
        "overlap_evidence": {"nebula_plain_overlapped": overlap_evidence(plain),
                             "nebula_secure_overlapped": overlap_evidence(secure)},
        "stage_seconds": stage_seconds(secure),
        "trips": trips(secure),
        "wall_s": {"nebula_plain_overlapped": plain["wall_s"], "nebula_secure_overlapped": secure["wall_s"]},
    }


def polling_report(nebula: dict[str, Any], sides: dict[str, dict | None]) -> tuple[dict[str, Any], list[str]]:
    """What each side polled at, as read back from its processes and records, and how it differs from
    nebula-fl's own intervals (`nebula`, from nebula_polling): (a `polling` object per side, notes)."""
    out: dict[str, Any] = {}
    notes: list[str] = []
    want_pull, want_task = nebula["server_pull_s"], nebula["superexec_task_poll_s"]
    for key, side in sides.items():
        if side is None:
            continue
        entry: dict[str, Any] = {"server_pull_s": want_pull, **SUPERNODE_FIXED}
        seen = side["superexec_task_poll_s"]
        entry["superexec_task_poll_s"] = seen
        if not key.startswith("legacy"):
            entry["server_pull_from"] = "nebula-fl's code (NebulaStrategy.start poll_interval, as the ServerApp calls it)"
            if side["secure"]:
                entry["stage_pull_s"] = nebula["stage_pull_s"]
                if any(v != want_pull for v in nebula["stage_pull_s"]):
                    notes.append(f"{key}: the secure stages pull at {nebula['stage_pull_s']}, the rounds at {want_pull} s")
        else:
            entry["server_pull_s"] = side["poll_s"]
            entry["server_pull_from"] = "benchmarks/secagg_legacy_app.py CountingGrid (push, then pull every poll-s)"
            entry["pulls"] = side["pulls"]
            entry["measured_pull_interval_s"] = side["pull_interval_s"]
            measured = side["pull_interval_s"]
            if side["poll_s"] != want_pull:
                notes.append(f"{key}: pulled every {side['poll_s']} s, nebula-fl every {want_pull} s")
            elif measured is None or not want_pull <= measured <= want_pull + 0.15:
                notes.append(f"{key}: told to pull every {want_pull} s, measured {measured} s between pulls")
        if seen.get("supernode") != [want_task]:
            notes.append(f"{key}: its SuperNodes' SuperExecs ran with {TASK_POLL_ENV} {seen.get('supernode')}, "
                         f"nebula-fl's launcher sets {want_task}")
        out[key] = entry
    return out, notes


def analyse(plain: dict, secure: dict, legacy: dict | None, legacy_plain: dict | None, *, demo: dict | None,
            polling: dict[str, Any], args, command: str, notes: list[str], overlapped: dict | None = None) -> dict:
    """results.json: the goals' figures, every side's medians (the overlapped pair's beside the blocking pair's),
    each secure side's trips per round, the demo pair and the polling."""
    secure_over_plain = after_first(secure["round_seconds"]) / after_first(plain["round_seconds"])
    overlapped_ratio = overlapped["secure_over_plain"] if overlapped else None
    legacy_over_nebula = (after_first(legacy["round_seconds"]) / after_first(secure["round_seconds"])
                          if legacy else None)
    bytes_ratio = statistics.mean(cluster_round_bytes(secure)) / statistics.mean(cluster_round_bytes(plain))
    demo_ratio = demo["secure_over_plain"] if demo else None
    sides: dict[str, Any] = {"nebula_plain": nebula_side(plain), "nebula_secure": nebula_side(secure)}
    if overlapped:
        sides |= overlapped["sides"]
    for key, side in (("legacy_secure", legacy), ("legacy_plain", legacy_plain)):
        if side:
            sides[key] = {"median_round_s_2_to_R": after_first(side["round_seconds"]),
                          "median_round_s_all": side["median_round_s"],
                          "first_round_s": side["round_seconds"][0],
                          "bytes_up_per_client": side["bytes_up_per_client"],
                          "bytes_down_per_client": side["bytes_down_per_client"],
                          "num_shares": side["num_shares"], "threshold": side["threshold"],
                          "max_abs_error": side["max_abs_error"], "folder": side["workdir"]}
    for key, entry in sides.items():
        entry["polling"] = polling.get("sides", {}).get(key)
    for key, entry in (demo or {}).get("sides", {}).items():
        entry["polling"] = polling.get("sides", {}).get(f"demo_{key}")
    return {
        "secure_over_plain": secure_over_plain,
        "secure_over_plain_overlapped": overlapped_ratio,
        "legacy_over_nebula": legacy_over_nebula,
        "bytes_secure_over_plain": bytes_ratio,
        "secure_over_plain_demo": demo_ratio,
        "clusters": args.clusters,
        "params": secure["params"],
        "stage_seconds": stage_seconds(secure),
        "rounds": args.rounds,
        "goals": {name: goal(name, value) for name, value in (("secure_over_plain", secure_over_plain),
                                                              ("secure_over_plain_overlapped", overlapped_ratio),
                                                              ("legacy_over_nebula", legacy_over_nebula),
                                                              ("bytes_secure_over_plain", bytes_ratio),
                                                              ("secure_over_plain_demo", demo_ratio))},
        "round_seconds": {"nebula_plain": plain["round_seconds"], "nebula_secure": secure["round_seconds"],
                          "legacy_secure": legacy["round_seconds"] if legacy else None,
                          "legacy_plain": legacy_plain["round_seconds"] if legacy_plain else None,
                          **(overlapped["round_seconds"] if overlapped else {})},
        "sides": sides,
        "overlapped": overlapped,
        "trips": {"nebula_secure": trips(secure), "nebula_secure_overlapped": overlapped["trips"] if overlapped else None,
                  "demo_nebula_secure": demo["trips"] if demo else None},
        "demo": demo,
        "polling": polling,
        "settings": {"lora_r": args.lora_r, "max_examples": args.max_examples, "max_seq_len": args.max_seq_len,
                     "test_fraction": args.test_fraction, "seed": args.seed, "quick": args.quick,
                     "local_steps": 1, "batch_size": 2, "codec": "none", "demo_rounds": args.demo_rounds,
                     "overlapped_pair": overlapped is not None},
        "notes": notes,
        "command": command,
    }


def polling_caption(polling: dict[str, Any]) -> str:
    """One sentence for the table: the intervals every side ran with (or that they differed)."""
    per_side = polling["sides"]
    pulls = {v["server_pull_s"] for v in per_side.values()}
    tasks = {tuple(v["superexec_task_poll_s"].get("supernode", [])) for v in per_side.values()}
    measured = [f"{k} measured {v['measured_pull_interval_s']:.3f} s between pulls"
                for k, v in per_side.items() if v.get("measured_pull_interval_s") is not None]
    same = "the same on every side" if polling["equal"] else "[red]NOT the same on every side (see notes)[/red]"
    return (f"Polling, {same}: the ServerApp pulls replies every {'/'.join(map(str, sorted(pulls)))} s"
            + (f" ({'; '.join(measured)})" if measured else "")
            + f"; SuperExec task poll {'/'.join(','.join(t) or '?' for t in sorted(tasks))} s; flower-supernode's "
            f"fixed {SUPERNODE_FIXED['supernode_idle_pull_s']:g} s idle pull and "
            f"{SUPERNODE_FIXED['supernode_reply_poll_s']:g} s reply poll")


def show(res: dict, console: Console) -> None:
    table = Table(title=f"Secure aggregation: {res['clusters']} clusters, {res['params']:,} parameters, "
                        f"{res['rounds']} rounds", caption=polling_caption(res["polling"]))
    for col in ("side", "median round 2..R (s)", "median all (s)", "round 1 (s)", "bytes / cluster / round"):
        table.add_column(col, justify="left" if col == "side" else "right", no_wrap=col == "side")
    for key, side in res["sides"].items():
        if "bytes_per_cluster_round_2_to_R" in side:
            size = f"{side['bytes_per_cluster_round_2_to_R']:,.0f}"
        else:
            size = f"up {side['bytes_up_per_client'] or 0:,} / down {side['bytes_down_per_client'] or 0:,}"
        table.add_row(key, f"{side['median_round_s_2_to_R']:.2f}", f"{side['median_round_s_all']:.2f}",
                      f"{side['first_round_s']:.2f}", size)
    demo = res["demo"]
    if demo:
        for key, side in demo["sides"].items():
            table.add_row(f"demo {key}", f"{side['median_round_s_2_to_R']:.2f}", f"{side['median_round_s_all']:.2f}",
                          f"{side['first_round_s']:.2f}", f"{side['bytes_per_cluster_round_2_to_R']:,.0f}")
    console.print(table)
    if demo:
        console.print(f"demo rows: `nebula-fl run --preset demo`, {demo['clusters']} clusters, {demo['params']:,} "
                      f"parameters, {demo['rounds']} rounds (the demo's own {DEMO_ROUNDS}"
                      + (f"; --quick runs {demo['rounds']} and skips the round-0 evaluation" if res['settings']['quick']
                         else "") + ")")
    ratios = Table(title="Ratios and goals")
    for col in ("ratio", "value", "goal", ""):
        ratios.add_column(col)
    for name, g in res["goals"].items():
        value = "not measured" if g["value"] is None else f"{g['value']:.3f}"
        ratios.add_row(name, value, g["goal"], "[green]met[/green]" if g["met"] else "[red]MISSED[/red]")
    console.print(ratios)
    stage = res["stage_seconds"]
    console.print(f"nebula-fl secure stages: setup {_s(stage['setup_s'])}, unmask (median) {_s(stage['unmask_s'])}")
    over = res.get("overlapped")
    if over:
        stage = over["stage_seconds"]
        steady = over["steady_secure_over_plain"]
        console.print(f"overlapped (--round-overlap), rounds {over['compared_rounds']} compared: secure stages setup "
                      f"{_s(stage['setup_s'])}, unmask (median) {_s(stage['unmask_s'])}; bytes secure / plain "
                      f"{over['bytes_secure_over_plain']:.3f}; secure / plain without the last round's flush "
                      + ("-" if steady is None else f"{steady:.3f}"))
        for key, ev in over["overlap_evidence"].items():
            console.print(f"  {key} ran overlapped: {overlap_line(ev)}")
    for key, per_round in res["trips"].items():
        if per_round:
            console.print(f"{key} trips per round (setup/extra): "
                          + ", ".join(f"{t['round']}: {t['setup_trips']}/{t['extra_trips']}" for t in per_round))
    if demo:
        stage = demo["stage_seconds"]
        console.print(f"demo secure stages: setup {_s(stage['setup_s'])}, unmask (median) {_s(stage['unmask_s'])}; "
                      f"bytes secure / plain {demo['bytes_secure_over_plain']:.3f}")
    for note in res["notes"]:
        console.print(f"[yellow]note:[/yellow] {note}")


def overlap_line(ev: dict[str, Any]) -> str:
    """One line of a side's overlap evidence, for the console."""
    parts = [f"config round-overlap {ev['config_round_overlap']}"]
    if any(a["timed"] for a in ev["trained_ahead"]):
        parts.append("clusters trained ahead " + ", ".join(f"round {a['round']}: {a['trained_ahead']}/{a['timed']}"
                                                           for a in ev["trained_ahead"]))
    if ev["pending_rounds"] or ev["late_sums"]:
        parts.append(f"held rounds {ev['pending_rounds']}, sums applied late "
                     + ", ".join(f"{q} in {r}" for r, q in ev["late_sums"]))
    return "; ".join(parts)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"3 rounds, fewer examples, no legacy plain side, the demo pair in {DEMO_ROUNDS_QUICK} "
                             "rounds without its round-0 evaluation (--no-demo: the 8-cluster sides only)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per 8-cluster side (default 4; --quick 3)")
    parser.add_argument("--clusters", type=int, default=8)
    parser.add_argument("--lora-r", type=int, default=108, help="LoRA rank: 108 gives ~1M adapter parameters")
    parser.add_argument("--max-examples", type=int, default=None, help="dataset cap (default 400; --quick 240)")
    parser.add_argument("--max-seq-len", type=int, default=32)
    parser.add_argument("--test-fraction", type=float, default=0.1, help="server test share (kept small: cheap eval)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-legacy-plain", action="store_true",
                        help="skip Flower's plain legacy round (--quick skips it anyway)")
    parser.add_argument("--legacy-timeout", type=float, default=1800.0, help="seconds for each legacy side")
    parser.add_argument("--demo-rounds", type=int, default=None,
                        help=f"rounds of each demo run (default the demo's {DEMO_ROUNDS}; --quick {DEMO_ROUNDS_QUICK})")
    parser.add_argument("--no-demo", action="store_true", help="skip the demo pair (secure_over_plain_demo)")
    parser.add_argument("--no-overlapped", action="store_true",
                        help="skip the overlapped pair (secure_over_plain_overlapped)")
    parser.add_argument("--out", default="benchmarks/results/secagg")
    args = parser.parse_args()
    args.rounds = args.rounds if args.rounds is not None else (3 if args.quick else 4)
    args.max_examples = args.max_examples if args.max_examples is not None else (240 if args.quick else 400)
    args.no_legacy_plain = args.no_legacy_plain or args.quick  # 80 s on 2 cores that --quick cannot spare
    args.demo_rounds = args.demo_rounds or (DEMO_ROUNDS_QUICK if args.quick else DEMO_ROUNDS)
    if args.rounds < 2:
        parser.error(f"--rounds is {args.rounds}; use 2 or more (round 1 holds the key setup, rounds 2..R are compared)")
    if args.demo_rounds < 2:
        parser.error(f"--demo-rounds is {args.demo_rounds}; use 2 or more (round 1 holds the key setup)")
    if args.clusters < 3:
        parser.error(f"--clusters is {args.clusters}; use 3 or more (SecAgg+ needs 3 shares)")
    command = shlex.join([sys.executable, *sys.argv])
    nebula = nebula_polling()
    out = fresh_out(args.out)
    console = Console()
    started = time.monotonic()
    runs: dict[str, dict] = {}
    for name, sec, ov in (("nebula-plain", False, False), ("nebula-secure", True, False),
                          ("nebula-plain-overlapped", False, True), ("nebula-secure-overlapped", True, True)):
        if ov and args.no_overlapped:
            continue
        runs[name] = run_nebula(name, nebula_args(args, secure=sec, overlap=ov), secure=sec, rounds=args.rounds,
                                out=out, console=console)
        require_as_labelled(runs[name], overlapped=ov)  # before more minutes go into a pair that measures nothing
    plain, secure = runs["nebula-plain"], runs["nebula-secure"]
    notes = [n for side in runs.values() for n in problems(side, args.clusters)]
    if len({side["params"] for side in runs.values()}) > 1:
        notes.append("adapter sizes differ: " + ", ".join(f"{k} {v['params']}" for k, v in runs.items()))
    overlapped = None
    if not args.no_overlapped:
        overlapped = overlapped_pair(runs["nebula-plain-overlapped"], runs["nebula-secure-overlapped"])
        for key, ev in overlapped["overlap_evidence"].items():
            partial = [a for a in ev["trained_ahead"] if a["trained_ahead"] < a["timed"]]
            if partial:
                notes.append(f"{key}: not every cluster trained ahead in round(s) "
                             + ", ".join(f"{a['round']} ({a['trained_ahead']}/{a['timed']})" for a in partial))
    legacy_sides: dict[str, dict | None] = {"legacy-secure": None, "legacy-plain": None}
    for name, sec in (("legacy-secure", True), ("legacy-plain", False)):
        if name == "legacy-plain" and args.no_legacy_plain:
            continue
        console.print(f"[bold]{name}[/bold]: Flower legacy {'SecAgg+' if sec else 'FedAvg'}, {args.clusters} "
                      f"clusters, {secure['params']:,} parameters, {args.rounds} rounds, pulls every "
                      f"{nebula['server_pull_s']} s, SuperExec task poll {nebula['superexec_task_poll_s']} s "
                      f"({time.monotonic() - started:.0f} s so far)")
        t0 = time.monotonic()
        try:
            side, superexec = watched(run_legacy, clusters=args.clusters, params=secure["params"], rounds=args.rounds,
                                      secure=sec, workdir=out / name, timeout_s=args.legacy_timeout,
                                      poll_s=nebula["server_pull_s"], superexec_poll_s=nebula["superexec_task_poll_s"])
        except RuntimeError as err:
            notes.append(f"{name} failed: {err}")
            console.print(f"[red]{name} failed:[/red] {err}")
            continue
        legacy_sides[name] = {**side, "superexec_task_poll_s": superexec}
        console.print(f"  {name} done in {time.monotonic() - t0:.0f} s")
    demo = None
    if not args.no_demo:
        console.print(f"[bold]demo pair[/bold]: {args.demo_rounds} rounds each ({time.monotonic() - started:.0f} s so far)")
        demo_plain = run_nebula("demo-plain", demo_args(args, secure=False), secure=False, rounds=args.demo_rounds,
                                out=out, console=console)
        demo_secure = run_nebula("demo-secure", demo_args(args, secure=True), secure=True, rounds=args.demo_rounds,
                                 out=out, console=console)
        for side in (demo_plain, demo_secure):
            require_as_labelled(side, overlapped=False)
        demo = demo_pair(demo_plain, demo_secure, quick=args.quick)
        notes += problems(demo_plain, demo["clusters"]) + problems(demo_secure, demo["clusters"])
    by_side = {"nebula_plain": plain, "nebula_secure": secure, "legacy_secure": legacy_sides["legacy-secure"],
               "legacy_plain": legacy_sides["legacy-plain"], "nebula_plain_overlapped": runs.get("nebula-plain-overlapped"),
               "nebula_secure_overlapped": runs.get("nebula-secure-overlapped")}
    if demo:
        by_side |= {"demo_nebula_plain": demo_plain, "demo_nebula_secure": demo_secure}
    per_side, polling_notes = polling_report(nebula, by_side)
    polling = {"nebula_fl_code": nebula, "equal": not polling_notes, "sides": per_side}
    res = analyse(plain, secure, legacy_sides["legacy-secure"], legacy_sides["legacy-plain"], demo=demo,
                  polling=polling, args=args, command=command, notes=notes + polling_notes, overlapped=overlapped)
    res["wall_s"] = time.monotonic() - started
    write_results(out, res)
    show(res, console)
    console.print(f"wrote {out / 'results.json'} ({res['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
