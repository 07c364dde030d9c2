"""Flower 1.42's own legacy SecAgg+ on real processes: the anchor nebula-fl's secure rounds are compared with.

`run_legacy` starts a `flower-superlink`, one `flower-supernode` per cluster and `flwr run` of the app in
`secagg_legacy/` (legacy FedAvg + `SecAggPlusWorkflow` / `secaggplus_mod`, or the plain `DefaultWorkflow`),
all on loopback with free ports under a private FLWR_HOME (`harness.StockFederation`), reads the per-round
times the ServerApp records, and stops every process it started, children included.

    .venv/bin/python benchmarks/secagg_legacy_run.py --clusters 3 --params 100000 --rounds 2 --secure
    .venv/bin/python benchmarks/secagg_legacy_run.py --clusters 3 --params 100000 --rounds 2 --plain

Flower's fixed sleeps are part of what is measured: the ServerApp's grid pulls replies every 3 s (each
SecAgg+ round is four exchanges, a plain round one; `--poll-s` pulls that often instead, and the record
says how many pulls each stage made and the median time between two), an idle SuperNode asks for
messages every 3 s, its SuperExec looks for a ClientApp to start every FLWR_SUPEREXEC_TASK_POLL_INTERVAL
seconds (nebula-fl's launcher value unless set; `--superexec-poll-s`), and it polls for the ClientApp's
reply every 0.5 s. Every message starts a new `flwr-clientapp` process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from harness import StockFederation, table  # beside this script, first on sys.path
from rich.console import Console

APP = Path(__file__).resolve().parent / "secagg_legacy"
TASK_POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"


def resolve_shares(clusters: int, num_shares: int | None, threshold: int | None) -> tuple[int, int]:
    """The SecAgg+ graph degree (default: every cluster) and reconstruction threshold (default: a majority)."""
    if clusters < 2:
        raise ValueError(f"clusters is {clusters}; SecAgg+ needs at least 2 clusters")
    shares = clusters if num_shares is None else num_shares
    if not (shares == clusters or 3 <= shares <= clusters):
        raise ValueError(f"num_shares is {shares}; give 3..{clusters}, or None for every cluster")
    if shares < clusters and shares % 2 == 0:  # Flower would send clients `shares` but build a ring of shares + 1
        raise ValueError(f"num_shares is {shares}; below the {clusters} clusters SecAgg+ needs an odd number")
    t = shares // 2 + 1 if threshold is None else threshold
    if not 2 <= t <= max(2, shares - 1):
        raise ValueError(f"threshold is {t}; give 2..{max(2, shares - 1)} (Flower needs it below num_shares {shares})")
    return shares, t


def run_legacy(*, clusters: int, params: int, rounds: int, secure: bool, workdir: Path, num_shares: int | None = None,
               threshold: int | None = None, timeout_s: float = 900, poll_s: float | None = None,
               superexec_poll_s: str | None = None, count_bytes: bool = True) -> dict:
    """Run `rounds` rounds of Flower's legacy SecAgg+ (or, with `secure=False`, its plain FedAvg round) on
    real processes and return the measured round times and per-cluster bytes.

    `poll_s` None keeps Flower's own `send_and_receive` (a pull every 3 s); a number pulls that often.
    `superexec_poll_s` sets FLWR_SUPEREXEC_TASK_POLL_INTERVAL for every Flower process started here (None:
    what nebula-fl's launcher gives its own, `child_env`).
    Raises RuntimeError when a process dies, a round aggregates fewer than `clusters` updates, or
    `timeout_s` passes; the logs are in `workdir`.
    """
    shares, t = resolve_shares(clusters, num_shares, threshold)
    if params < 1 or rounds < 1:
        raise ValueError(f"params is {params} and rounds is {rounds}; both must be at least 1")
    if timeout_s <= 0 or (poll_s is not None and poll_s <= 0):
        raise ValueError(f"timeout_s is {timeout_s} and poll_s is {poll_s}; both must be positive (poll_s or None)")
    workdir = Path(workdir).resolve()
    out_file = workdir / "rounds.json"
    out_file.unlink(missing_ok=True)
    env = {TASK_POLL_ENV: superexec_poll_s} if superexec_poll_s is not None else None
    run_config = (f"num-server-rounds={rounds} num-clusters={clusters} params={params} "
                  f"secure={str(secure).lower()} num-shares={shares} reconstruction-threshold={t} "
                  f"poll-s={float(poll_s or 0.0)} count-bytes={str(count_bytes).lower()} "
                  f'out-file="{out_file}"')

    def done() -> int:
        return len(_read(out_file).get("rounds", []))

    with StockFederation(app=APP, folder=workdir, clusters=clusters, env=env) as fed:
        fed.run(run_config)
        try:
            finished = fed.wait(until=lambda: done() >= rounds, timeout_s=timeout_s)
        except TimeoutError:
            raise RuntimeError(f"{done()} of {rounds} rounds within {timeout_s:.0f} s; "
                               f"see {workdir / 'server.log'} or pass a larger timeout_s") from None
        if finished:
            try:  # up to 10 s for the ServerApp to end the run itself, so that `flwr run` exits cleanly
                fed.wait(timeout_s=10)
            except TimeoutError:
                pass
        else:
            time.sleep(1.0)  # its last write may land just after it exits
            if done() < rounds:
                raise RuntimeError(f"flwr run exited after {done()} of {rounds} rounds; see {workdir / 'server.log'}")
    res = _result(_read(out_file), clusters=clusters, params=params, secure=secure, workdir=workdir)
    res["superexec_poll_s"] = fed.env[TASK_POLL_ENV]
    return res


def _result(record: dict, *, clusters: int, params: int, secure: bool, workdir: Path) -> dict:
    rounds = record["rounds"]
    for r in rounds:
        if r["aggregated"] != clusters:
            raise RuntimeError(f"round {r['round']} aggregated {r['aggregated']} of {clusters} clusters "
                               f"({r['failures']} failures); see {workdir / 'server.log'}")
    seconds = [r["seconds"] for r in rounds]
    ups = [b for r in rounds if r["bytes_up"] for b in r["bytes_up"].values()]
    downs = [b for r in rounds if r["bytes_down"] for b in r["bytes_down"].values()]
    errors = [r["max_abs_error"] for r in rounds if r["max_abs_error"] is not None]
    gaps = [s["pull_interval_s"] for r in rounds for s in r["stages"] if s.get("pull_interval_s") is not None]
    pulls = [s["pulls"] for r in rounds for s in r["stages"] if s.get("pulls") is not None]
    return {
        "round_seconds": seconds,
        "median_round_s": statistics.median(seconds),
        "bytes_up_per_client": int(statistics.median(ups)) if ups else None,
        "bytes_down_per_client": int(statistics.median(downs)) if downs else None,
        "clusters": clusters, "params": params, "secure": secure,
        "num_shares": record["num_shares"], "threshold": record["reconstruction_threshold"],
        "poll_s": record["poll_s"] or None,
        "pulls": sum(pulls) if pulls else None,  # the ServerApp's own pulls (None with Flower's send_and_receive)
        "pull_interval_s": statistics.median(gaps) if gaps else None,  # median over stages of their median gap
        "stage_seconds": [[s["seconds"] for s in r["stages"]] for r in rounds],
        "max_abs_error": max(errors) if errors else None,
        "rounds": rounds, "workdir": str(workdir),
    }


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clusters", type=int, default=8)
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--secure", dest="secure", action="store_true", default=True, help="SecAgg+ (default)")
    mode.add_argument("--plain", dest="secure", action="store_false", help="the plain DefaultWorkflow round")
    parser.add_argument("--num-shares", type=int, default=None, help="SecAgg+ graph degree (default: every cluster)")
    parser.add_argument("--threshold", type=int, default=None, help="reconstruction threshold (default: a majority)")
    parser.add_argument("--poll-s", type=float, default=None, help="pull replies this often, not every 3 s")
    parser.add_argument("--superexec-poll-s", default=None,
                        help="FLWR_SUPEREXEC_TASK_POLL_INTERVAL (default: nebula-fl's launcher value)")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--workdir", default=None, help="logs and records (default: a new folder in /tmp)")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="secagg-legacy-"))
    res = run_legacy(clusters=args.clusters, params=args.params, rounds=args.rounds, secure=args.secure,
                     workdir=workdir, num_shares=args.num_shares, threshold=args.threshold,
                     timeout_s=args.timeout, poll_s=args.poll_s, superexec_poll_s=args.superexec_poll_s)
    kind = f"SecAgg+ (shares {res['num_shares']}, threshold {res['threshold']})" if res["secure"] else "plain"
    shown = table(f"Flower legacy {kind}: {res['clusters']} clusters, {res['params']:,} float32 params"
                  + (f", pull every {res['poll_s']} s" if res["poll_s"] else ", Flower's 3 s pulls"),
                  ("round", "seconds", "stage seconds", "up / cluster", "down / cluster", "max |error|"))
    for r in res["rounds"]:
        up = f"{statistics.median(r['bytes_up'].values()):,.0f} B" if r["bytes_up"] else "-"
        down = f"{statistics.median(r['bytes_down'].values()):,.0f} B" if r["bytes_down"] else "-"
        err = f"{r['max_abs_error']:.2e}" if r["max_abs_error"] is not None else "-"
        shown.add_row(str(r["round"]), f"{r['seconds']:.2f}", " ".join(f"{s['seconds']:.1f}" for s in r["stages"]),
                      up, down, err)
    console = Console(highlight=False)
    console.print(shown)
    console.print(f"median round: {res['median_round_s']:.2f} s; logs and rounds.json in {res['workdir']}")
    if res["pulls"] is not None:
        console.print(f"ServerApp pulls: {res['pulls']}, median {res['pull_interval_s']:.3f} s apart; "
                      f"SuperExec task poll {res['superexec_poll_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
