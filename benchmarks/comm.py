"""WAN bytes and wall time to a target accuracy, measured side by side: stock Flower vs nebula-fl.

Every configuration runs on this machine with real Flower processes, on the same data, seed, local
steps, rounds, batch size, evaluation schedule (the server evaluates every round, round 0 included:
nebula-fl runs get `eval-initial=true`) and reply-poll interval (0.2 s: the stock ServerApp's Grid is
wrapped to poll like nebula-fl's loop, see stock_flower/stock_flower_app.py), each cluster behind its
own emulated link (nebula_fl/wan: a shaping proxy that counts the bytes really carried):

  1. `flower-full`  stock Flower `FedAvg` exchanging the full MiniLM (full fine-tuning at 2e-4),
  2. `flower-lora`  stock Flower `FedAvg` exchanging the PEFT LoRA adapter + head through the stock
                    ArrayRecord path (nebula-fl's LoRA config, learning rate and cosine schedule),
  3. `nebula-none`  nebula-fl, uncompressed (`--codec none`),
  4. `nebula-CHAIN` nebula-fl with each compressed chain of `--codecs`,
  5. `nebula-adaptive` nebula-fl with adaptive compression,
all nebula-fl runs with `--outer-optimizer fedavg`, so the algorithm is stock FedAvg's.

Everything runs at `--wan` (20 Mbit/s, 100 ms RTT): WAN bytes and time to target. The best chain
(fewest WAN bytes to target among the chains of `--codecs` within 1 accuracy point of uncompressed)
then runs again at `--slow-wan` (2 Mbit/s, 300 ms) and unthrottled, stock Flower full unthrottled,
stock LoRA at `--slow-wan`, and, without `--quick`, uncompressed at both. Time to target is the
ServerApp's clock from its start to the end of the evaluation that first reaches the target (startup,
round 0 evaluation and every round included), WAN bytes to target the proxies' counts from their
start to that moment (both ways, all clusters, HTTP headers and polling included). The WAN share of a
round is (its time under the link − the same round unthrottled) / its time under the link, median
over rounds matched by number.

One figure is modelled, and says so: stock Flower's full model at 2 Mbit/s (90.9 MB each way per
round per cluster, an hour and more per run) is its unthrottled elapsed time plus, per round, the
slowest cluster's `nebula_fl.wan.model.wan_seconds` for the bytes and requests it really carried at
20 Mbit/s. The same model, applied at 20 Mbit/s, is checked against the measured 20 Mbit/s run; that
error is printed beside the modelled figure, and the time ratio uses stock × (1 − |error|), the figure
least favourable to nebula-fl. `--measure-stock-full-slow` measures it instead (slow).

The target accuracy is fixed before the run (a default per mode, or `--target`), so that no
configuration reaches it in its first round (where nebula-fl's downlink is nearly empty, since every
cluster rebuilds the seeded initial adapter, while stock Flower ships the whole model down) and the
configurations reach it by their last. The defaults come from calibration runs of every configuration
(seed 0, unthrottled except adaptive at 20 Mbit/s; accuracy by round 1, 2, 3, ...):
  --quick: 3 rounds x 5 local steps on 1,000 examples (200 test examples: steps of 0.005):
      nebula none .730 .815 .875 | topk:0.25+int4 .690 .800 .860 | flower-full .735 .820 .935 |
      flower-lora .730 .745 .920 | adaptive .495 .705 .750.  Target 0.78: 9 test examples above the
      best round 1, at least 4 below every fixed configuration's round-2-or-3 hit. Adaptive stays at
      its starting chain (topk:0.05+int4) while it measures its link, which takes longer than 3 rounds
      here, and is expected to miss it (a warning, not an invalid run).
  full: 5 rounds x 10 local steps on all 2,225 examples (444 test examples: steps of 0.0023):
      nebula none .874 .960 .955 | int4 .878 .962 .957 .971 .971 | topk:0.25+int4 .923 .930 .948 .953
      .953 | flower-full .890 .957 .950 .890 .982 | flower-lora .874 .959 .973 .966 .973 | adaptive .829
      .937 .953 .930 .937.  Target 0.94: 7 test examples above the best round 1 (topk's .923), at least
      3 below the best accuracy of every configuration.
(Stock LoRA's round 1 equals nebula-fl uncompressed's to the last digit: the same algorithm, data and
draws; they part from round 2, where a stateless stock ClientApp restarts AdamW and nebula-fl does not.)
A run where some configuration reaches the target in round 1 is marked invalid in results.json
(`valid: false`, `first_round_at_target` 1) with a loud warning; a configuration that never reaches
it is warned about and has no time or bytes to target (a ratio that needs it is missed). Missed goals
are reported as missed, never hidden.

    .venv/bin/python benchmarks/comm.py --quick    # every comparison, small data: <= 20 min on 2 idle cores
    .venv/bin/python benchmarks/comm.py            # all of BBC News, 5 rounds

Writes results.json, accuracy_vs_wan_bytes.png and time_to_target.png; keeps every run's folder.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import StockFederation, fresh_out, metrics_lines, run_federation, write_results  # beside this script
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from nebula_fl.components import settle
from nebula_fl.config import DataConfig, FederationConfig, RunConfig
from nebula_fl.wan.model import wan_seconds
from nebula_fl.wan.profile import LinkProfile, parse_profile

DEFAULTS = settle(RunConfig())  # nebula-fl's defaults as the classify task reads "auto"

HERE = Path(__file__).resolve().parent
STOCK_APP = HERE / "stock_flower"
LINKS = ("unthrottled", "wan", "slow")  # no link, --wan (20 Mbit/s), --slow-wan (2 Mbit/s)
FULL, LORA, NONE, ADAPTIVE = "flower-full", "flower-lora", "nebula-none", "nebula-adaptive"
GOALS: dict[str, tuple[str, float]] = {
    "bytes_ratio_vs_flower": (">=", 3000.0),
    "bytes_ratio_vs_flower_lora": (">=", 10.0),
    "time_ratio_vs_flower_2mbit": (">=", 20.0),
    "wan_share_20mbit": ("<=", 0.05),
    "accuracy_gap_vs_uncompressed": ("<=", 1.0),
}
MAX_GAP_POINTS = GOALS["accuracy_gap_vs_uncompressed"][1]


@dataclass(frozen=True, kw_only=True)
class Mode:
    """What one benchmark mode trains: the same for every configuration."""

    rounds: int
    local_steps: int
    max_examples: int  # 0 = all of BBC News
    target: float  # the default target accuracy, calibrated for this mode (see the module docstring)

    def __post_init__(self) -> None:
        if self.rounds < 2:
            raise ValueError(f"rounds is {self.rounds}; a target above round 1 needs at least 2 rounds")
        if self.local_steps < 1 or self.max_examples < 0:
            raise ValueError("local_steps must be 1 or more and max_examples 0 (all) or more")
        if not 0 < self.target < 1:
            raise ValueError(f"target is {self.target}; pass an accuracy in (0, 1)")


QUICK = Mode(rounds=3, local_steps=5, max_examples=1000, target=0.78)
FULL_MODE = Mode(rounds=5, local_steps=10, max_examples=0, target=0.94)


# -- analysis: pure functions of run records (tests/test_comm_benchmark.py) -------------------------
#
# A run record: {"config", "system", "link", "rounds": [{"round", "accuracy", "elapsed_s", "seconds",
# "wan_bytes_cum", "clusters": [{"bytes_up", "bytes_down", "push_objects", "pull_objects"}, ...]}, ...]}
# with round 0 first (the initial evaluation), elapsed_s from the ServerApp's start.

def reach(rounds: list[dict], target: float) -> dict | None:
    """The first round whose evaluation reaches `target`, or None."""
    return next((r for r in rounds if r["accuracy"] is not None and r["accuracy"] >= target), None)


def first_round_at_target(runs: list[dict], target: float) -> int | None:
    """The earliest round at which any run reached `target` (None: none did)."""
    hits = [hit["round"] for run in runs if (hit := reach(run["rounds"], target)) is not None]
    return min(hits) if hits else None


def final_accuracy(run: dict) -> float:
    return run["rounds"][-1]["accuracy"]


def wan_share(linked: dict, unthrottled: dict) -> float | None:
    """Median over rounds 1.. (matched by number) of (time under the link − time unthrottled) / time under the link."""
    free = {r["round"]: r["seconds"] for r in unthrottled["rounds"] if r["round"] >= 1 and r.get("seconds")}
    shares = [(r["seconds"] - free[r["round"]]) / r["seconds"]
              for r in linked["rounds"] if r["round"] in free and r.get("seconds")]
    return statistics.median(shares) if shares else None


def wire_share(linked: dict) -> float | None:
    """Median over rounds 1.. of the slowest-wired cluster's seconds on the wire (its proxy's clock: bytes in flight
    either way) / the round's time: the link's share timed directly, free of run-to-run compute noise."""
    shares = [r["wire_s"] / r["seconds"] for r in linked["rounds"]
              if r["round"] >= 1 and r.get("seconds") and r.get("wire_s") is not None]
    return statistics.median(shares) if shares else None


def round_wan_seconds(round_: dict, profile: LinkProfile) -> float:
    """The slowest cluster's modelled WAN time in one round (each cluster has its own link, in parallel).

    Requests are the object pushes / pulls the proxy counted, plus one each way for the message itself
    in a training round; round 0 (registration, the app bundle, polling) carries its bytes only.
    """
    extra = 1 if round_["round"] >= 1 else 0
    return max((wan_seconds(profile=profile, bytes_up=c["bytes_up"], bytes_down=c["bytes_down"],
                            requests_up=c["push_objects"] + extra, requests_down=c["pull_objects"] + extra)
                for c in round_["clusters"]), default=0.0)


def modelled_elapsed(*, unthrottled: dict, linked: dict, profile: LinkProfile, upto: int) -> float:
    """Modelled ServerApp time at the end of round `upto` under `profile`: the unthrottled run's elapsed
    time then, plus each round's (0..upto) modelled WAN time for the bytes the linked run carried."""
    free = {r["round"]: r for r in unthrottled["rounds"]}
    carried = {r["round"]: r for r in linked["rounds"]}
    missing = [k for k in range(upto + 1) if k not in carried or (k == upto and k not in free)]
    if missing:
        raise ValueError(f"rounds {missing} are missing from the runs the model needs")
    return free[upto]["elapsed_s"] + sum(round_wan_seconds(carried[k], profile) for k in range(upto + 1))


def model_error(*, modelled: float, measured: float) -> float:
    """Signed relative error of a modelled time: (modelled − measured) / measured."""
    if not measured > 0:
        raise ValueError(f"measured time is {measured!r}; it must be > 0")
    return (modelled - measured) / measured


def least_favourable(stock_modelled: float, error: float) -> float:
    """The modelled stock time shrunk by the model's measured error, whatever its sign: the figure that
    favours nebula-fl least."""
    return stock_modelled * (1.0 - abs(error))


def pick_best(finals: dict[str, float], bytes_to_target: dict[str, int | None], *, chains: list[str],
              uncompressed: str, max_gap_points: float = MAX_GAP_POINTS) -> str:
    """The chain with the fewest WAN bytes to target among those within `max_gap_points` of uncompressed
    (final accuracy); if none qualifies, the fewest bytes among those that reached the target; if none
    did, the most accurate."""
    if not chains:
        raise ValueError("no compressed chain to pick from; pass --codecs")
    reached = [c for c in chains if bytes_to_target.get(c) is not None]
    close = [c for c in reached if 100.0 * (finals[uncompressed] - finals[c]) <= max_gap_points + 1e-9]
    pool = close or reached
    if not pool:
        return max(chains, key=lambda c: finals[c])
    return min(pool, key=lambda c: (bytes_to_target[c], -finals[c]))


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or not denominator > 0:
        return None
    return numerator / denominator


def judge(figures: dict[str, float | None]) -> dict[str, dict[str, Any]]:
    """Each goal with its measured value and whether it is met (a figure that could not be computed is not)."""
    out = {}
    for key, (op, bound) in GOALS.items():
        value = figures.get(key)
        met = value is not None and (value >= bound if op == ">=" else value <= bound)
        out[key] = {"goal": f"{op} {bound:g}", "value": value, "met": met}
    return out


def time_to_target(run: dict | None, target: float) -> float | None:
    hit = reach(run["rounds"], target) if run else None
    return None if hit is None else hit["elapsed_s"]


def bytes_to_target(run: dict | None, target: float) -> int | None:
    hit = reach(run["rounds"], target) if run else None
    return None if hit is None else hit["wan_bytes_cum"]


def analyse(runs: dict[str, dict[str, dict]], *, target: float, chains: list[str], profiles: dict[str, LinkProfile],
            best: str | None = None) -> dict[str, Any]:
    """Per configuration and link: final accuracy, round, WAN bytes and time to target, WAN share; then the
    figures the goals are judged on. `runs[config][link]` is a run record; `best` defaults to pick_best's."""
    wan_runs = {name: links["wan"] for name, links in runs.items() if "wan" in links}
    finals = {name: final_accuracy(run) for name, run in wan_runs.items()}
    to_bytes = {name: bytes_to_target(run, target) for name, run in wan_runs.items()}
    best = best or pick_best(finals, to_bytes, chains=chains, uncompressed=NONE)
    configs: dict[str, dict[str, Any]] = {}
    for name, links in runs.items():
        wan_run = links.get("wan")
        hit = reach(wan_run["rounds"], target) if wan_run else None
        entry: dict[str, Any] = {
            "system": (wan_run or next(iter(links.values())))["system"],
            "final_accuracy": finals.get(name),
            "round_reached": None if hit is None else hit["round"],
            "wan_bytes_to_target": to_bytes.get(name),
            "time_to_target": {},
            "wan_share": {},
        }
        for link in LINKS:
            seconds = time_to_target(links.get(link), target)
            if seconds is not None:
                entry["time_to_target"][link] = {"seconds": seconds, "how": "measured"}
            if link != "unthrottled" and link in links and "unthrottled" in links:
                entry["wan_share"][link] = wan_share(links[link], links["unthrottled"])
            if link != "unthrottled" and link in links and (share := wire_share(links[link])) is not None:
                entry.setdefault("wire_share", {})[link] = share
        if wan_run is not None:
            per = [c["bytes_up"] + c["bytes_down"] for r in wan_run["rounds"] if r["round"] >= 1 for c in r["clusters"]]
            entry["wan_bytes_per_round_per_cluster"] = statistics.mean(per) if per else None
        configs[name] = entry
    stock = configs.get(FULL)
    if stock and hit_round(runs[FULL].get("wan"), target) is not None and "unthrottled" in runs[FULL]:
        upto = hit_round(runs[FULL]["wan"], target)
        measured = stock["time_to_target"]["wan"]["seconds"]
        try:
            at_wan = modelled_elapsed(unthrottled=runs[FULL]["unthrottled"], linked=runs[FULL]["wan"],
                                      profile=profiles["wan"], upto=upto)
            at_slow = modelled_elapsed(unthrottled=runs[FULL]["unthrottled"], linked=runs[FULL]["wan"],
                                       profile=profiles["slow"], upto=upto)
        except ValueError:
            at_wan = at_slow = None
        if at_wan is not None and at_slow is not None:
            error = model_error(modelled=at_wan, measured=measured)
            stock["model"] = {"modelled_wan_seconds": at_wan, "measured_wan_seconds": measured, "error": error}
            if "slow" not in stock["time_to_target"]:
                stock["time_to_target"]["slow"] = {"seconds": at_slow, "how": "modelled", "error": error,
                                                   "least_favourable_seconds": least_favourable(at_slow, error)}
    figures = _figures(configs, best=best, target=target)
    return {"target_accuracy": target, "best": best, "configs": configs, "figures": figures,
            "first_round_at_target": first_round_at_target([r for links in runs.values() for r in links.values()],
                                                           target)}


def hit_round(run: dict | None, target: float) -> int | None:
    hit = reach(run["rounds"], target) if run else None
    return None if hit is None else hit["round"]


def _seconds(entry: dict | None, link: str, *, conservative: bool = False) -> float | None:
    t = (entry or {}).get("time_to_target", {}).get(link)
    if t is None:
        return None
    return t.get("least_favourable_seconds", t["seconds"]) if conservative else t["seconds"]


def _figures(configs: dict[str, dict], *, best: str, target: float) -> dict[str, Any]:
    top, stock, lora, none = configs.get(best), configs.get(FULL), configs.get(LORA), configs.get(NONE)
    bytes_of = lambda e: (e or {}).get("wan_bytes_to_target")  # noqa: E731
    stock_slow = (stock or {}).get("time_to_target", {}).get("slow")
    gap = None
    if top and none and top["final_accuracy"] is not None and none["final_accuracy"] is not None:
        gap = 100.0 * (none["final_accuracy"] - top["final_accuracy"])
    return {
        "bytes_ratio_vs_flower": ratio(bytes_of(stock), bytes_of(top)),
        "bytes_ratio_vs_flower_lora": ratio(bytes_of(lora), bytes_of(top)),
        "time_ratio_vs_flower_2mbit": ratio(_seconds(stock, "slow", conservative=True), _seconds(top, "slow")),
        "time_ratio_vs_flower_2mbit_measured": bool(stock_slow) and stock_slow["how"] == "measured",
        "time_ratio_vs_flower_20mbit": ratio(_seconds(stock, "wan"), _seconds(top, "wan")),
        "time_ratio_vs_flower_lora_20mbit": ratio(_seconds(lora, "wan"), _seconds(top, "wan")),
        "time_ratio_vs_flower_lora_2mbit": ratio(_seconds(lora, "slow"), _seconds(top, "slow")),
        "wan_share_20mbit": (top or {}).get("wan_share", {}).get("wan"),
        "wan_share_2mbit": (top or {}).get("wan_share", {}).get("slow"),
        "wire_share_20mbit": (top or {}).get("wire_share", {}).get("wan"),
        "wire_share_2mbit": (top or {}).get("wire_share", {}).get("slow"),
        "accuracy_gap_vs_uncompressed": gap,
        "stock_model_error_20mbit": (stock or {}).get("model", {}).get("error"),
    }


# -- run records from what each run leaves in its folder ---------------------------------------------
def records_from_lines(lines: list[dict]) -> list[dict]:
    """Per-round records from metrics.jsonl lines (nebula-fl's or the stock app's: the same fields; accuracy None
    for a task without one, e.g. causal-lm: benchmarks/causal.py counts bytes with this too)."""
    rounds = []
    for line in lines:
        clusters = [
            {"bytes_up": c.get("wan_bytes_up", 0), "bytes_down": c.get("wan_bytes_down", 0),
             "push_objects": c.get("wan_push_objects", 0), "pull_objects": c.get("wan_pull_objects", 0)}
            for _, c in sorted((line.get("clusters") or {}).items()) if "wan_bytes_up" in c
        ]
        rounds.append({"round": line["round"], "accuracy": line.get("accuracy"), "elapsed_s": line["elapsed_seconds"],
                       "seconds": line["seconds"], "wan_bytes_cum": line.get("cumulative_wan_bytes"),
                       "clusters": clusters, "wire_s": max((c["wan_wire_seconds"] for c in (line.get("clusters") or {})
                                                            .values() if "wan_wire_seconds" in c), default=None)})
    return rounds


# -- running the configurations ------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Job:
    """One run of the plan: a configuration on a link."""

    config: str
    link: str  # one of LINKS

    def folder_name(self) -> str:
        return f"{self.config.replace(':', '-')}@{self.link}"


class Bench:
    """Runs jobs one at a time (2 cores: never two federations at once) and keeps their records."""

    def __init__(self, *, args: argparse.Namespace, mode: Mode, chains: list[str], out: Path, console: Console) -> None:
        self.args, self.mode, self.chains, self.out, self.console = args, mode, chains, out, console
        self.specs = {"unthrottled": None, "wan": args.wan, "slow": args.slow_wan}
        self.runs: dict[str, dict[str, dict]] = {}

    def nebula_codecs(self) -> dict[str, tuple[str, str]]:
        """Configuration -> (codec, extra run config) of every nebula-fl configuration."""
        out = {NONE: ("none", "")}
        out.update({f"nebula-{c}": (c, "") for c in self.chains})
        out[ADAPTIVE] = (self.args.adaptive_codec,
                         f"comm.adaptive=true comm.target-seconds={self.args.adaptive_target_s} "
                         "comm.param-min=0.01 comm.param-max=0.25")
        return out

    def run(self, job: Job) -> dict:
        folder = self.out / job.folder_name()
        started = time.monotonic()
        if job.config in (FULL, LORA):
            rounds = run_stock(mode="full" if job.config == FULL else "lora", settings=self.mode, args=self.args,
                               link=self.specs[job.link], folder=folder)
            system = "flower"
        else:
            codec, extra = self.nebula_codecs()[job.config]
            rounds = run_nebula(codec=codec, extra=extra, settings=self.mode, args=self.args,
                                link=self.specs[job.link], folder=folder)
            system = "nebula-fl"
        record = {"config": job.config, "system": system, "link": job.link, "link_spec": self.specs[job.link],
                  "folder": str(folder), "command_seconds": time.monotonic() - started, "rounds": rounds}
        self.runs.setdefault(job.config, {})[job.link] = record
        return record


def nebula_command(*, codec: str, extra: str, settings: Mode, args: argparse.Namespace, link: str | None) -> list[str]:
    """`nebula-fl run` arguments of one configuration (every run evaluates round 0 and every round)."""
    cmd = ["--clusters", str(args.clusters), "--rounds", str(settings.rounds), "--local-steps", str(settings.local_steps),
           "--seed", str(args.seed), "--port", "0", "--outer-optimizer", "fedavg", "--codec", codec,
           "--run-config", f"max-examples={settings.max_examples} eval-initial=true {extra}".strip()]
    return cmd + (["--wan", link] if link else [])


def run_nebula(*, codec: str, extra: str, settings: Mode, args: argparse.Namespace, link: str | None,
               folder: Path) -> list[dict]:
    summary, lines = run_federation(nebula_command(codec=codec, extra=extra, settings=settings, args=args, link=link),
                                    folder=folder, log=folder.parent / f"{folder.name}.log")  # names hold dots
    initial = summary.get("initial_evaluation") or {}
    round0 = {"round": 0, "accuracy": initial.get("accuracy"), "elapsed_s": None, "seconds": None,
              "wan_bytes_cum": None, "clusters": []}
    return [round0, *records_from_lines(lines)]


def stock_run_config(*, mode: str, settings: Mode, args: argparse.Namespace, folder: Path, controls: list[Path]) -> str:
    """The stock app's run config: nebula-fl's own defaults for everything both sides share."""
    shared: dict[str, Any] = {  # not nebula-fl's round scheduling (stock Flower rounds block, on fixed steps), nor
        # FedProx's term (the stock baseline is FedAvg)
        key: value for section in (DEFAULTS.train, DEFAULTS.model) for key, value in section.to_flat().items()
        if key not in ("round-overlap", "max-local-steps", "round-seconds", "prox-mu")
    }
    shared.update({
        "mode": mode, "num-server-rounds": settings.rounds, "num-clusters": args.clusters,
        "local-steps": settings.local_steps, "seed": args.seed, "max-examples": settings.max_examples,
        "partition": DataConfig().partition, "eval-batch-size": FederationConfig().eval_batch_size,
        "threads": max(1, (os.cpu_count() or 1) // args.clusters),  # nebula-fl: the cores shared by every worker
        "out-dir": str(folder), "wan-control": ",".join(str(c) for c in controls),
    })
    return " ".join(f"{k}={_flower_value(v)}" for k, v in shared.items())


def _flower_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))


def run_stock(*, mode: str, settings: Mode, args: argparse.Namespace, link: str | None, folder: Path) -> list[dict]:
    """Stock Flower: a SuperLink, per cluster a proxy (under a link) and a SuperNode, `flwr run` of the stock app."""
    try:
        with StockFederation(app=STOCK_APP, folder=folder, clusters=args.clusters, link=link) as fed:
            fed.run(stock_run_config(mode=mode, settings=settings, args=args, folder=folder, controls=fed.controls))
            fed.wait(timeout_s=6 * 3600)
    except (RuntimeError, TimeoutError) as err:
        raise SystemExit(str(err)) from None
    if not (folder / "done.json").exists():
        raise SystemExit(f"the stock Flower run did not finish; see {folder / 'server.log'}")
    return records_from_lines(metrics_lines(folder))


def machine(*, clusters: int) -> dict[str, Any]:
    """Where the times were measured: cores, CPU model, torch threads per cluster and in the ServerApp."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    cores = os.cpu_count() or 1
    return {"cores": cores, "cpu_model": model or platform.processor(), "platform": platform.platform(),
            "torch_threads_per_cluster": max(1, cores // clusters), "torch_threads_serverapp": torch.get_num_threads()}


# -- output ----------------------------------------------------------------------------------------
LINK_TITLES = {"unthrottled": "unthrottled", "wan": "20 Mbit/s", "slow": "2 Mbit/s"}


def _time_cell(entry: dict, link: str) -> str:
    t = entry["time_to_target"].get(link)
    if t is None:
        return "-"
    if t["how"] == "modelled":
        return f"{t['seconds']:.0f} s, modelled ±{100 * abs(t['error']):.0f}%"
    return f"{t['seconds']:.1f} s, measured"


def config_table(analysis: dict, *, titles: dict[str, str], rounds: int) -> Table:
    table = Table(title=f"time and WAN bytes to accuracy {analysis['target_accuracy']:.4f} (best chain: "
                        f"{analysis['best']})")
    for col in ("configuration", "final acc", "round reached", "WAN bytes to target", "WAN B / round / cluster",
                "time to target: unthrottled", f"at {titles['wan']}", f"at {titles['slow']}",
                f"WAN share at {titles['wan']}"):
        table.add_column(col, justify="right", no_wrap=col == "configuration" or "target:" in col or col.startswith("at "))
    for name, e in analysis["configs"].items():
        share = e["wan_share"].get("wan")
        table.add_row(
            name, "-" if e["final_accuracy"] is None else f"{e['final_accuracy']:.4f}",
            f"not in {rounds}" if e["round_reached"] is None else str(e["round_reached"]),
            "-" if e["wan_bytes_to_target"] is None else f"{e['wan_bytes_to_target']:,}",
            "-" if e.get("wan_bytes_per_round_per_cluster") is None else f"{e['wan_bytes_per_round_per_cluster']:,.0f}",
            _time_cell(e, "unthrottled"), _time_cell(e, "wan"), _time_cell(e, "slow"),
            "-" if share is None else f"{100 * share:.1f}%",
        )
    return table


def goals_table(results: dict) -> Table:
    table = Table(title="figures vs goals (ratios: stock Flower / nebula-fl's best chain)")
    for col in ("figure", "measured", "goal", "met"):
        table.add_column(col, justify="right")
    for key, g in results["goals"].items():
        value = g["value"]
        shown = "-" if value is None else (f"{value:,.3f}" if "share" not in key else f"{100 * value:.1f}%")
        if key == "time_ratio_vs_flower_2mbit" and value is not None and not results["figures"][
                "time_ratio_vs_flower_2mbit_measured"]:
            err = results["stock_model_error_20mbit"]
            shown += f" (stock modelled, × (1 − {abs(err):.3f}))"
        table.add_row(key, shown, g["goal"].replace(">=", "≥").replace("<=", "≤"), "yes" if g["met"] else "[bold red]NO[/]")
    for key in ("time_ratio_vs_flower_20mbit", "time_ratio_vs_flower_lora_20mbit", "time_ratio_vs_flower_lora_2mbit",
                "wan_share_2mbit", "wire_share_20mbit", "wire_share_2mbit", "stock_model_error_20mbit"):
        value = results["figures"].get(key)
        shown = "-" if value is None else (f"{100 * value:.1f}%" if "share" in key or "error" in key else f"{value:,.3f}")
        table.add_row(key, shown, "-", "-")
    table.add_row("first_round_at_target", str(results["first_round_at_target"]), "≥ 2",
                  "yes" if results["valid"] else "[bold red]NO[/]")
    return table


def plots(runs: dict[str, dict[str, dict]], analysis: dict, out: Path, *, titles: dict[str, str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for name, links in runs.items():
        if "wan" not in links:
            continue
        rounds = [r for r in links["wan"]["rounds"] if r["round"] >= 1 and r["wan_bytes_cum"]]
        ax.plot([r["wan_bytes_cum"] for r in rounds], [r["accuracy"] for r in rounds], marker="o", label=name)
    ax.axhline(analysis["target_accuracy"], color="grey", linestyle="--", label="target")
    ax.set_xscale("log")
    ax.set_xlabel(f"cumulative WAN bytes, proxy-counted, both ways, all clusters (at {titles['wan']})")
    ax.set_ylabel("test accuracy (rounds 1..)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_wan_bytes.png")
    plt.close(fig)

    names = [n for n, e in analysis["configs"].items() if e["time_to_target"]]
    fig, ax = plt.subplots(figsize=(9, 5), dpi=120)
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        for i, link in enumerate(LINKS):
            t = analysis["configs"][name]["time_to_target"].get(link)
            if t is None:
                continue
            modelled = t["how"] == "modelled"
            bar = ax.bar(i + (j - (len(names) - 1) / 2) * width, t["seconds"], width, color=f"C{j}",
                         hatch="//" if modelled else None, edgecolor="black" if modelled else None,
                         label=name if i == min(k for k, lk in enumerate(LINKS)
                                                if lk in analysis["configs"][name]["time_to_target"]) else None)
            label = f"{t['seconds']:.0f}\nmodelled\n±{100 * abs(t['error']):.0f}%" if modelled else f"{t['seconds']:.0f}"
            ax.bar_label(bar, labels=[label], fontsize=6, padding=12 if modelled else 2)
            if modelled:
                ax.errorbar(bar[0].get_x() + width / 2, t["seconds"], yerr=abs(t["error"]) * t["seconds"], color="black",
                            capsize=3)
    ax.set_xticks(range(len(LINKS)), [titles[link] for link in LINKS])
    ax.set_yscale("log")
    ax.set_ylim(top=4 * max(t["seconds"] for n in names for t in analysis["configs"][n]["time_to_target"].values()))
    ax.set_ylabel(f"time to accuracy {analysis['target_accuracy']:.3f} (s, from the ServerApp's start)")
    ax.set_title("measured unless hatched (hatched: modelled from measured bytes, error measured at 20 Mbit/s)",
                 fontsize=9)
    ax.grid(alpha=0.3, axis="y", which="both")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "time_to_target.png")
    plt.close(fig)


def _describe(record: dict, target: float) -> str:
    accs = " ".join("-" if r["accuracy"] is None else f"{r['accuracy']:.3f}" for r in record["rounds"])
    hit = reach(record["rounds"], target)
    tail = "target not reached" if hit is None else (
        f"target at round {hit['round']}, {hit['elapsed_s'] or 0:.1f} s"
        + (f", {hit['wan_bytes_cum']:,} WAN B" if hit["wan_bytes_cum"] else ""))
    return f"{record['config']} @ {record['link']}: accuracy by round {accs}; {tail} ({record['command_seconds']:.0f} s)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK.rounds} rounds x {QUICK.local_steps} steps on {QUICK.max_examples} examples, "
                             "one chain: every comparison in <= 20 min on 2 idle cores")
    parser.add_argument("--target", type=float, default=None,
                        help=f"target accuracy, fixed before the run (default {QUICK.target} with --quick, "
                             f"{FULL_MODE.target} without)")
    parser.add_argument("--wan", default="20mbit:100ms", help="the link every configuration runs at")
    parser.add_argument("--slow-wan", default="2mbit:300ms", help="the slow link the best chain also runs at")
    parser.add_argument("--clusters", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--codecs", default="topk:0.25+int4,int4",
                        help="candidate chains (--quick keeps the first); the best has the fewest WAN bytes to target "
                             "among those within 1 point of uncompressed")
    parser.add_argument("--adaptive-codec", default="topk:0.05+int4", help="the chain adaptive compression tunes")
    parser.add_argument("--adaptive-target-s", type=float, default=0.05,
                        help="adaptive: serialization budget of an upload, seconds")
    parser.add_argument("--stock-lora-slow", action=argparse.BooleanOptionalAction, default=None,
                        help="also measure stock Flower LoRA at --slow-wan (default: on, off with --quick)")
    parser.add_argument("--measure-stock-full-slow", action="store_true",
                        help="also run stock Flower's full model at --slow-wan (over an hour) instead of modelling it")
    parser.add_argument("--out", default="benchmarks/results/comm")
    args = parser.parse_args()
    mode = QUICK if args.quick else FULL_MODE
    target = mode.target if args.target is None else args.target
    if not 0 < target < 1:
        parser.error(f"--target is {target}; pass an accuracy in (0, 1)")
    profiles = {"wan": parse_profile(args.wan), "slow": parse_profile(args.slow_wan)}
    titles = {"unthrottled": "unthrottled", "wan": args.wan, "slow": args.slow_wan}
    chains = [c.strip() for c in args.codecs.split(",") if c.strip()]
    if not chains:
        parser.error("--codecs names no chain; pass e.g. topk:0.25+int4")
    chains = chains[:1] if args.quick else chains
    chain_names = [f"nebula-{c}" for c in chains]
    console = Console(highlight=False, width=170)
    out = fresh_out(args.out)
    bench = Bench(args=args, mode=mode, chains=chains, out=out, console=console)
    first = [Job(config=c, link="wan") for c in (FULL, LORA, NONE, *chain_names, ADAPTIVE)]
    stock_lora_slow = not args.quick if args.stock_lora_slow is None else args.stock_lora_slow
    later = 3 + int(stock_lora_slow) + (0 if args.quick else 2) + int(args.measure_stock_full_slow)
    console.print(f"target accuracy {target:.4f} (fixed before the run); {mode.rounds} rounds x {mode.local_steps} local "
                  f"steps, {mode.max_examples or 'all'} examples, {args.clusters} clusters, seed {args.seed}; "
                  f"links {args.wan} and {args.slow_wan}; {len(first) + later} runs, one at a time")
    started = time.monotonic()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} runs"),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("runs", total=len(first) + later)

        def do(job: Job) -> None:
            progress.update(task, description=f"{job.config} @ {titles[job.link]}")
            record = bench.run(job)
            (out / "runs.json").write_text(json.dumps(bench.runs, indent=1) + "\n")  # what ran so far, if a later run fails
            progress.console.print(_describe(record, target))
            progress.advance(task)

        for job in first:
            do(job)
        runs = bench.runs
        finals = {n: final_accuracy(links["wan"]) for n, links in runs.items()}
        best = pick_best(finals, {n: bytes_to_target(links["wan"], target) for n, links in runs.items()},
                         chains=chain_names, uncompressed=NONE)
        progress.console.print(f"best chain: {best}")
        again = [Job(config=best, link="slow"), Job(config=best, link="unthrottled"), Job(config=FULL, link="unthrottled")]
        if stock_lora_slow:
            again.append(Job(config=LORA, link="slow"))
        if not args.quick:
            again += [Job(config=NONE, link="slow"), Job(config=NONE, link="unthrottled")]
        if args.measure_stock_full_slow:
            again.append(Job(config=FULL, link="slow"))
        for job in again:
            do(job)
    analysis = analyse(bench.runs, target=target, chains=chain_names, profiles=profiles, best=best)
    figures = analysis["figures"]
    first_round = analysis["first_round_at_target"]
    unreached = [n for n, e in analysis["configs"].items() if e["round_reached"] is None]
    problems, warnings = [], []
    if first_round is None:
        problems.append(f"no configuration reached the target {target}: lower --target")
    elif first_round < 2:
        problems.append(f"a configuration reached the target {target} in round {first_round}, where nebula-fl's "
                        "downlink is nearly empty: raise --target")
    if unreached:
        warnings.append(f"{', '.join(unreached)} did not reach the target {target} in {mode.rounds} rounds "
                        "(no time or bytes to target for them; a ratio that needs one is missed)")
    goals = judge(figures)
    results = {
        "benchmark": "comm", "quick": args.quick, "target_accuracy": target,
        "first_round_at_target": first_round, "valid": not problems, "invalid_reasons": problems,
        "unreached": unreached, "warnings": warnings,
        "bytes_ratio_vs_flower": figures["bytes_ratio_vs_flower"],
        "bytes_ratio_vs_flower_lora": figures["bytes_ratio_vs_flower_lora"],
        "time_ratio_vs_flower_2mbit": figures["time_ratio_vs_flower_2mbit"],
        "nebula_2mbit_measured": True,
        "wan_share_20mbit": figures["wan_share_20mbit"],
        "accuracy_gap_vs_uncompressed": figures["accuracy_gap_vs_uncompressed"],
        "stock_model_error_20mbit": figures["stock_model_error_20mbit"],
        "goals": goals, "goals_met": all(g["met"] for g in goals.values()) and not problems,
        "benchmark_seconds": time.monotonic() - started, "machine": machine(clusters=args.clusters),
        "settings": {"rounds": mode.rounds, "local_steps": mode.local_steps, "max_examples": mode.max_examples,
                     "clusters": args.clusters, "seed": args.seed, "wan": args.wan, "slow_wan": args.slow_wan,
                     "chains": chains, "adaptive_codec": args.adaptive_codec, "stock_lora_slow": stock_lora_slow,
                     "adaptive_target_s": args.adaptive_target_s, "outer_optimizer": "fedavg", "poll_s": 0.2},
        "best": analysis["best"], "figures": figures, "configs": analysis["configs"], "runs": bench.runs,
    }
    write_results(out, results)
    plots(bench.runs, analysis, out, titles=titles)
    console.print(config_table(analysis, titles=titles, rounds=mode.rounds))
    console.print(goals_table(results))
    for warning in warnings:
        console.print(f"[bold yellow]WARNING: {warning}[/]")
    for problem in problems:
        console.print(f"[bold red]WARNING: THIS RUN IS INVALID: {problem}[/]")
    console.print(f"goals met: {'yes' if results['goals_met'] else 'NO'}; "
                  f"{results['benchmark_seconds'] / 60:.1f} min; results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
