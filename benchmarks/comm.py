"""WAN bytes and wall time to a target accuracy: stock Flower vs nebula-fl, on one emulated link.

In one run, on the same data, seed, local steps and emulated link (default 20 Mbit/s, 100 ms RTT,
2 clusters):
  1. stock Flower (`flwr.serverapp.strategy.FedAvg`) exchanging the full MiniLM,
  2. nebula-fl LoRA, uncompressed (packed float32),
  3. nebula-fl LoRA with the best codec chain, and with adaptive compression.
Every configuration runs twice: under the emulated WAN (bytes counted by the proxy, time measured)
and unthrottled (its compute-only round times). A first-order model (`nebula_fl.wan.model`) then
predicts the time to target from 1 Mbit/s to 1 Gbit/s from each configuration's measured bytes,
requests, RTT and compute; it must reproduce the measured 20 Mbit/s point within 10%.

    .venv/bin/python benchmarks/comm.py            # ~30 min on 2 cores
    .venv/bin/python benchmarks/comm.py --quick    # a few minutes: less data, fewer rounds

Writes results.json, accuracy_vs_wan_bytes.png and time_to_target_vs_bandwidth.png; prints tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from federation_runs import fresh_out, run_federation  # beside this script, first on sys.path
from rich.console import Console
from rich.table import Table

from nebula_fl.launcher.federation import child_env
from nebula_fl.launcher.plan import free_port, port_free
from nebula_fl.launcher.processes import ProcessSet
from nebula_fl.wan.model import wan_seconds
from nebula_fl.wan.profile import LinkProfile, parse_profile
from nebula_fl.wan.service import query_proxy

HERE = Path(__file__).resolve().parent
STOCK_APP = HERE / "stock_flower"
PUSH, PULL = "/v1/fleet/push-object", "/v1/fleet/pull-object"
BANDWIDTHS_MBIT = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
GOALS = {"bytes_ratio_vs_flower": 3000.0, "time_ratio_vs_flower_2mbit": 20.0, "wan_share_20mbit": 0.05,
         "accuracy_gap_vs_uncompressed": 1.0, "model_error_20mbit": 0.10}


# -- running the configurations --------------------------------------------------------------------
def run_nebula(name: str, *, codec: str, extra: str, args, wan: str | None, out: Path, console: Console) -> dict:
    folder = out / f"{name}{'-wan' if wan else '-nowan'}"
    cmd = ["--clusters", str(args.clusters), "--rounds", str(args.rounds), "--local-steps", str(args.local_steps),
           "--seed", str(args.seed), "--port", "0", "--codec", codec,
           "--run-config", f"max-examples={args.max_examples} eval-initial=false {extra}".strip()]
    if wan:
        cmd += ["--wan", wan]
    console.print(f"[bold]{name}[/bold] ({'WAN ' + wan if wan else 'unthrottled'}): nebula-fl run --codec {codec} {extra}")
    _, lines = run_federation(cmd, folder=folder, log=folder.with_suffix(".log"))
    rounds = []
    for line in lines:
        clusters = [
            {"bytes_up": c.get("wan_bytes_up", 0), "bytes_down": c.get("wan_bytes_down", 0),
             "push_objects": c.get("wan_push_objects", 0), "pull_objects": c.get("wan_pull_objects", 0),
             "payload_up": c.get("bytes_up", 0), "payload_down": c.get("bytes_down", 0),
             "codec_param": c.get("codec_param")}
            for c in line["clusters"].values()
        ]
        rounds.append({"round": line["round"], "accuracy": line["accuracy"], "elapsed_s": line["elapsed_seconds"],
                       "seconds": line["seconds"], "wan_bytes_cum": line.get("cumulative_wan_bytes", 0),
                       "payload_bytes_cum": line["cumulative_bytes"], "clusters": clusters})
    return {"name": name, "kind": "nebula-fl", "codec": codec, "extra": extra, "rounds": rounds, "folder": str(folder)}


def run_stock(args, *, wan: str | None, out: Path, console: Console) -> dict:
    """Stock Flower: a SuperLink, per cluster a proxy and a SuperNode, `flwr run` of the stock app."""
    name = "stock-flower"
    folder = out / f"{name}{'-wan' if wan else '-nowan'}"
    folder.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]{name}[/bold] ({'WAN ' + wan if wan else 'unthrottled'}): FedAvg, full model")
    home = folder / ".flwr"
    home.mkdir(exist_ok=True)
    port = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n[superlink.local]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    env = child_env(home)
    env["PYTHONPATH"] = f"{STOCK_APP}{os.pathsep}{env.get('PYTHONPATH', '')}"
    procs = ProcessSet()
    sockets = Path(tempfile.mkdtemp(prefix="nebula-bench-"))
    samples: list[tuple[float, list[dict]]] = []
    try:
        bindir = Path(sys.executable).parent
        procs.start("superlink", [str(bindir / "flower-superlink"), "--insecure",
                                  "--disable-runtime-dependency-installation", "--port", str(port)],
                    log_path=folder / "superlink.log", env=env, cwd=folder)
        _wait(lambda: not port_free(port), 60, "the SuperLink")
        controls = []
        for i in range(args.clusters):
            target = port
            if wan:
                listen, control = free_port(), sockets / f"wan-{i}.sock"
                procs.start(f"wan-{i}", [sys.executable, "-m", "nebula_fl.wan", "--listen-port", str(listen),
                                         "--target", f"127.0.0.1:{port}", "--profile", wan, "--control", str(control)],
                            log_path=folder / f"wan-{i}.log", env=env)
                _wait(lambda control=control: _answers(control), 60, "a WAN proxy")
                controls.append(control)
                target = listen
            procs.start(f"supernode-{i}", [str(bindir / "flower-supernode"), "--insecure", "--superlink",
                                           f"127.0.0.1:{target}", "--port", str(free_port()), "--node-config",
                                           f"partition-id={i} num-partitions={args.clusters}"],
                        log_path=folder / f"supernode-{i}.log", env=env)
        run_config = (f"num-server-rounds={args.stock_rounds} num-clusters={args.clusters} local-steps={args.local_steps} "
                      f"seed={args.seed} max-examples={args.max_examples} threads={max(1, (os.cpu_count() or 1) // args.clusters)} "
                      f'out-dir="{folder}"')
        run = procs.start("flwr-run", [str(bindir / "flwr"), "run", str(STOCK_APP), "local", "--stream",
                                       "--run-config", run_config],
                          log_path=folder / "server.log", env=env, cwd=folder, expect_exit=True)
        deadline = time.monotonic() + 4 * 3600
        while run.alive() and time.monotonic() < deadline:
            procs.remember_descendants()
            if controls:
                samples.append((time.time(), [query_proxy(c, "stats") for c in controls]))
            if (dead := procs.first_dead_service()) is not None:
                raise SystemExit(f"{dead.name} died; see {dead.log_path}")
            time.sleep(0.2)
        if not (folder / "done.json").exists():
            raise SystemExit(f"the stock Flower run did not finish; see {folder / 'server.log'}")
    finally:
        procs.stop_all()
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    start = lines[0]["time"] - lines[0]["elapsed_seconds"]
    rounds, previous_end, previous = [], None, None
    for line in lines:
        if line["round"] == 0:
            previous_end = line["time"]
            previous = _at(samples, line["time"])
            continue
        now = _at(samples, line["time"])
        clusters = []
        for i in range(args.clusters):
            a = previous[i] if previous else {}
            b = now[i] if now else {}
            clusters.append({
                "bytes_up": b.get("bytes_up", 0) - a.get("bytes_up", 0),
                "bytes_down": b.get("bytes_down", 0) - a.get("bytes_down", 0),
                "push_objects": _path(b, PUSH) - _path(a, PUSH),
                "pull_objects": _path(b, PULL) - _path(a, PULL),
            })
        total = sum(s.get("bytes_up", 0) + s.get("bytes_down", 0) for s in (now or []))
        rounds.append({"round": line["round"], "accuracy": line["accuracy"], "elapsed_s": line["time"] - start,
                       "seconds": line["time"] - (previous_end or start), "wan_bytes_cum": total,
                       "clusters": clusters})
        previous_end, previous = line["time"], now
    return {"name": name, "kind": "stock", "codec": "full model, float32", "rounds": rounds, "folder": str(folder)}


def _answers(control: Path) -> bool:
    try:
        query_proxy(control, "stats")
        return True
    except Exception:
        return False


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not come up within {timeout:.0f} s")
        time.sleep(0.2)


def _at(samples: list[tuple[float, list[dict]]], moment: float) -> list[dict] | None:
    """The first proxy sample taken at or after `moment` (counters are cumulative)."""
    for taken, stats in samples:
        if taken >= moment:
            return stats
    return samples[-1][1] if samples else None


def _path(stats: dict, path: str) -> int:
    return int(stats.get("requests_by_path", {}).get(path, 0))


# -- analysis --------------------------------------------------------------------------------------
def reach(rounds: list[dict], target: float) -> dict | None:
    return next((r for r in rounds if r["accuracy"] >= target), None)


def compute_times(nowan: dict | list[dict]) -> list[float]:
    """Round times without the WAN: one run's, or the per-round median of several runs that do the same
    compute (every LoRA configuration trains and evaluates alike; the codecs cost milliseconds)."""
    runs = nowan if isinstance(nowan, list) else [nowan]
    rounds = min(len(r["rounds"]) for r in runs)
    return [statistics.median(r["rounds"][i]["seconds"] for r in runs) for i in range(rounds)]


def round_wan_s(r: dict, profile: LinkProfile) -> float:
    """The slowest cluster's WAN time in a round (each cluster has its own link; they run in parallel)."""
    return max(
        wan_seconds(profile=profile, bytes_up=c["bytes_up"], bytes_down=c["bytes_down"],
                    requests_up=c["push_objects"] + 1, requests_down=c["pull_objects"] + 1)
        for c in r["clusters"]
    )


def modelled_time_to_target(wan_run: dict, nowan: dict | list[dict], upto: int, profile: LinkProfile) -> float:
    compute = compute_times(nowan)
    first = wan_run["rounds"][0]
    startup = first["elapsed_s"] - first["seconds"]
    total = startup
    for r in wan_run["rounds"][:upto]:
        i = r["round"] - 1
        c = compute[i] if i < len(compute) else statistics.median(compute[1:] or compute)
        total += c + round_wan_s(r, profile)
    return total


def analyse(runs: dict[str, dict[str, dict]], link: str) -> dict:
    profile = parse_profile(link)
    finals = {name: pair["wan"]["rounds"][-1]["accuracy"] for name, pair in runs.items()}
    target = 0.95 * max(finals.values())
    out: dict[str, Any] = {"target_accuracy": target, "link": link, "configs": {}}
    lora_nowan = [pair["nowan"] for name, pair in runs.items() if name != "stock-flower"]
    for name, pair in runs.items():
        wan_run = pair["wan"]
        nowan = pair["nowan"] if name == "stock-flower" else lora_nowan
        hit = reach(wan_run["rounds"], target)
        entry: dict[str, Any] = {"final_accuracy": finals[name], "codec": wan_run["codec"],
                                 "rounds_run": len(wan_run["rounds"]), "reached_target": hit is not None}
        if hit is not None:
            upto = hit["round"]
            measured = hit["elapsed_s"]
            modelled = modelled_time_to_target(wan_run, nowan, upto, profile)
            used = wan_run["rounds"][:upto]
            wan_total = sum(round_wan_s(r, profile) for r in used)
            entry.update({
                "rounds_to_target": upto,
                "wan_bytes_to_target": hit["wan_bytes_cum"],
                "time_to_target_s": measured,
                "modelled_time_to_target_s": modelled,
                "model_error": abs(modelled - measured) / measured,
                "wan_share": wan_total / max(1e-9, sum(r["seconds"] for r in used)),
                "time_to_target_by_mbit": {
                    str(m): modelled_time_to_target(
                        wan_run, nowan, upto,
                        LinkProfile(down_bps=m * 1e6, up_bps=m * 1e6, rtt_s=profile.rtt_s, jitter_s=profile.jitter_s))
                    for m in BANDWIDTHS_MBIT
                },
                "round_seconds": [r["seconds"] for r in wan_run["rounds"]],
                "compute_seconds": compute_times(nowan),
                "wan_bytes_per_round_per_cluster": statistics.mean(
                    c["bytes_up"] + c["bytes_down"] for r in wan_run["rounds"] for c in r["clusters"]),
            })
            if "payload_bytes_cum" in hit:
                entry["payload_bytes_to_target"] = hit["payload_bytes_cum"]
        out["configs"][name] = entry
    return out


def pick_best(analysis: dict, candidates: list[str]) -> str:
    """The chain with the fewest WAN bytes to target among those within the accuracy goal of uncompressed."""
    cfg = analysis["configs"]
    base = cfg["lora-uncompressed"]["final_accuracy"]
    ok = [c for c in candidates if cfg[c].get("reached_target")
          and 100 * (base - cfg[c]["final_accuracy"]) <= GOALS["accuracy_gap_vs_uncompressed"]]
    pool = ok or [c for c in candidates if cfg[c].get("reached_target")] or candidates
    return min(pool, key=lambda c: cfg[c].get("wan_bytes_to_target", float("inf")))


def ratios(analysis: dict, best: str) -> dict:
    cfg = analysis["configs"]
    stock, lora, top = cfg.get("stock-flower", {}), cfg.get("lora-uncompressed", {}), cfg.get(best, {})
    r: dict[str, Any] = {}
    if stock.get("reached_target") and top.get("reached_target"):
        r["bytes_ratio_vs_flower"] = stock["wan_bytes_to_target"] / top["wan_bytes_to_target"]
        r["time_ratio_vs_flower_2mbit"] = stock["time_to_target_by_mbit"]["2"] / top["time_to_target_by_mbit"]["2"]
    if top.get("reached_target"):
        r["wan_share_20mbit"] = top["wan_share"]
        r["model_error_20mbit"] = max(c["model_error"] for c in cfg.values() if c.get("reached_target"))
    if lora and top:
        r["accuracy_gap_vs_uncompressed"] = 100.0 * (lora["final_accuracy"] - top["final_accuracy"])
    return r


def plots(runs: dict[str, dict[str, dict]], analysis: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name, pair in runs.items():
        rounds = pair["wan"]["rounds"]
        ax.plot([max(r["wan_bytes_cum"], 1) for r in rounds], [r["accuracy"] for r in rounds], marker="o", label=name)
    ax.axhline(analysis["target_accuracy"], color="grey", linestyle="--", label="target")
    ax.set_xscale("log")
    ax.set_xlabel(f"cumulative WAN bytes, proxy-counted, both ways, all clusters ({analysis['link']})")
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_wan_bytes.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name, entry in analysis["configs"].items():
        if entry.get("reached_target"):
            xs = [int(m) for m in entry["time_to_target_by_mbit"]]
            ax.plot(xs, list(entry["time_to_target_by_mbit"].values()), marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link bandwidth each way (Mbit/s), same RTT")
    ax.set_ylabel("modelled wall time to target accuracy (s)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "time_to_target_vs_bandwidth.png")
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="600 examples, fewer rounds: a few minutes")
    parser.add_argument("--wan", default="20mbit:100ms", help="the emulated link of every cluster")
    parser.add_argument("--clusters", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--codecs", default="int4,topk:0.25+int4",
                        help="candidate chains; the best is the one with the fewest WAN bytes to target among those "
                             "within 1 point of uncompressed")
    parser.add_argument("--adaptive-codec", default="topk:0.05+int4", help="the chain adaptive compression tunes")
    parser.add_argument("--adaptive-target-s", type=float, default=0.05,
                        help="adaptive: serialization budget of an upload, seconds")
    parser.add_argument("--out", default="benchmarks/results/comm")
    args = parser.parse_args()
    args.rounds = 2 if args.quick else 3
    args.stock_rounds = 2 if args.quick else 3
    args.local_steps = 10 if args.quick else 20
    args.max_examples = 600 if args.quick else 0
    console = Console(highlight=False, width=150)
    out = fresh_out(args.out)
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    nebula = {"lora-uncompressed": ("none", "")}
    nebula.update({f"lora-{c}": (c, "") for c in codecs})
    nebula["lora-adaptive"] = (args.adaptive_codec, f"comm.adaptive=true comm.target-seconds={args.adaptive_target_s} "
                                                    "comm.param-min=0.01 comm.param-max=0.25")
    runs: dict[str, dict[str, dict]] = {"stock-flower": {}}
    started = time.monotonic()
    for wan in (args.wan, None):
        runs["stock-flower"]["wan" if wan else "nowan"] = run_stock(args, wan=wan, out=out, console=console)
        for name, (codec, extra) in nebula.items():
            runs.setdefault(name, {})["wan" if wan else "nowan"] = run_nebula(
                name, codec=codec, extra=extra, args=args, wan=wan, out=out, console=console)
    analysis = analyse(runs, args.wan)
    best = pick_best(analysis, [f"lora-{c}" for c in codecs] + ["lora-adaptive"])
    figures = ratios(analysis, best)
    results = {
        "benchmark": "comm", "quick": args.quick, "clusters": args.clusters, "seed": args.seed, "link": args.wan,
        "rounds": args.rounds, "stock_rounds": args.stock_rounds, "local_steps": args.local_steps,
        "max_examples": args.max_examples, "best": best, "analysis": analysis, "ratios": figures,
        "goals": GOALS, "goals_met": {
            k: (figures[k] >= v if k in ("bytes_ratio_vs_flower", "time_ratio_vs_flower_2mbit") else figures[k] <= v)
            for k, v in GOALS.items() if k in figures
        },
        "runs": runs, "benchmark_seconds": time.monotonic() - started,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plots(runs, analysis, out)

    table = Table(title=f"time and WAN bytes to {analysis['target_accuracy']:.3f} accuracy over {args.wan}, "
                        f"{args.clusters} clusters, {args.local_steps} local steps")
    for col in ("configuration", "final acc", "rounds to target", "WAN bytes to target", "time to target (s)",
                "modelled (s)", "at 2 Mbit/s (s)", "at 1 Gbit/s (s)", "WAN share"):
        table.add_column(col, justify="right")
    for name, e in analysis["configs"].items():
        if not e.get("reached_target"):
            table.add_row(name, f"{e['final_accuracy']:.4f}", "not reached", "-", "-", "-", "-", "-", "-")
            continue
        table.add_row(name, f"{e['final_accuracy']:.4f}", str(e["rounds_to_target"]), f"{e['wan_bytes_to_target']:,}",
                      f"{e['time_to_target_s']:.1f}", f"{e['modelled_time_to_target_s']:.1f}",
                      f"{e['time_to_target_by_mbit']['2']:.1f}", f"{e['time_to_target_by_mbit']['1000']:.1f}",
                      f"{100 * e['wan_share']:.1f}%")
    console.print(table)
    summary = Table(title="ratios (goal)")
    for col in ("figure", "value", "goal", "met"):
        summary.add_column(col, justify="right")
    for k, v in figures.items():
        summary.add_row(k, f"{v:,.3f}", str(GOALS.get(k, "-")), str(results["goals_met"].get(k, "-")))
    console.print(summary)
    console.print(f"best configuration: {best}")
    console.print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
