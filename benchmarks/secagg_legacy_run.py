"""Flower 1.42's own legacy SecAgg+ on real processes: the anchor nebula-fl's secure rounds are compared with.

`run_legacy` starts a `flower-superlink`, one `flower-supernode` per cluster and `flwr run` of the app in
`secagg_legacy/` (legacy FedAvg + `SecAggPlusWorkflow` / `secaggplus_mod`, or the plain `DefaultWorkflow`),
all on loopback with free ports under a private FLWR_HOME, reads the per-round times the ServerApp
records, and stops every process it started, children included.

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
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from nebula_fl.launcher.federation import child_env
from nebula_fl.launcher.plan import free_port, port_free
from nebula_fl.launcher.processes import ProcessSet

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
    workdir.mkdir(parents=True, exist_ok=True)
    home = workdir / ".flwr"
    home.mkdir(exist_ok=True)
    port = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n[superlink.local]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    out_file = workdir / "rounds.json"
    out_file.unlink(missing_ok=True)
    env = child_env(home)
    env["PYTHONPATH"] = f"{APP}{os.pathsep}{env.get('PYTHONPATH', '')}"
    if superexec_poll_s is not None:
        env[TASK_POLL_ENV] = superexec_poll_s
    bindir = Path(sys.executable).parent
    procs = ProcessSet()
    record: dict = {}
    started = time.monotonic()
    try:
        procs.start("superlink", [str(bindir / "flower-superlink"), "--insecure",
                                  "--disable-runtime-dependency-installation", "--port", str(port)],
                    log_path=workdir / "superlink.log", env=env, cwd=workdir)
        _wait(lambda: not port_free(port), procs, 60, "the SuperLink", workdir / "superlink.log")
        for i in range(clusters):
            procs.start(f"supernode-{i}", [str(bindir / "flower-supernode"), "--insecure", "--superlink",
                                           f"127.0.0.1:{port}", "--port", str(free_port()), "--node-config",
                                           f"partition-id={i} num-partitions={clusters}"],
                        log_path=workdir / f"supernode-{i}.log", env=env)
        run_config = (f"num-server-rounds={rounds} num-clusters={clusters} params={params} "
                      f"secure={str(secure).lower()} num-shares={shares} reconstruction-threshold={t} "
                      f"poll-s={float(poll_s or 0.0)} count-bytes={str(count_bytes).lower()} "
                      f'out-file="{out_file}"')
        run = procs.start("flwr-run", [str(bindir / "flwr"), "run", str(APP), "local", "--stream",
                                       "--run-config", run_config],
                          log_path=workdir / "server.log", env=env, cwd=workdir, expect_exit=True)
        finished_at = None
        while True:
            procs.remember_descendants()
            record = _read(out_file)
            if len(record.get("rounds", [])) >= rounds:
                finished_at = finished_at or time.monotonic()
                # up to 10 s for the ServerApp to end the run itself, so that `flwr run` exits cleanly
                if not run.alive() or time.monotonic() - finished_at > 10:
                    break
                time.sleep(0.5)
                continue
            if (dead := procs.first_dead_service()) is not None:
                raise RuntimeError(f"{dead.name} died; see {dead.log_path}")
            if not run.alive():
                time.sleep(1.0)  # its last write may land just after it exits
                record = _read(out_file)
                if len(record.get("rounds", [])) >= rounds:
                    break
                raise RuntimeError(f"flwr run exited after {len(record.get('rounds', []))} of {rounds} rounds; "
                                   f"see {workdir / 'server.log'}")
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"{len(record.get('rounds', []))} of {rounds} rounds within {timeout_s:.0f} s; "
                                   f"see {workdir / 'server.log'} or pass a larger timeout_s")
            time.sleep(0.5)
    finally:
        _stop_everything(procs, home)
    res = _result(record, clusters=clusters, params=params, secure=secure, workdir=workdir)
    res["superexec_poll_s"] = env[TASK_POLL_ENV]
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


def _wait(condition, procs: ProcessSet, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if procs.first_dead_service() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up within {timeout:.0f} s; see {log}")
        time.sleep(0.2)


def _stop_everything(procs: ProcessSet, home: Path) -> None:
    """Stop every process started here and their children; then check that no Flower process of this
    FLWR_HOME is left (other people's Flower processes on the machine are not ours to count or touch)."""
    known = procs.all_pids()
    procs.stop_all()
    deadline = time.monotonic() + 5.0  # orphaned children are reaped by init a moment after their parent dies
    while time.monotonic() < deadline and any(_exists(pid, created) for pid, created in known.items()):
        time.sleep(0.1)
    left = []
    for proc in psutil.process_iter(["pid", "cmdline", "create_time"]):
        try:
            mine = known.get(proc.pid) == proc.info["create_time"]
            flower = any("flower" in part or "flwr" in part for part in proc.info["cmdline"] or [])
            if flower and (mine or proc.environ().get("FLWR_HOME") == str(home)):
                left.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    for proc in left:
        proc.kill()
    psutil.wait_procs(left, timeout=5)
    if left:
        raise RuntimeError(f"{len(left)} Flower process(es) of {home} outlived the stop and were killed: "
                           f"{[p.pid for p in left]}")


def _exists(pid: int, created: float) -> bool:
    """Whether that very process (a zombie included) is still in the process table."""
    try:
        return psutil.Process(pid).create_time() == created
    except psutil.NoSuchProcess:
        return False


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
    table = Table(title=f"Flower legacy {kind}: {res['clusters']} clusters, {res['params']:,} float32 params"
                        + (f", pull every {res['poll_s']} s" if res["poll_s"] else ", Flower's 3 s pulls"))
    for col in ("round", "seconds", "stage seconds", "up / cluster", "down / cluster", "max |error|"):
        table.add_column(col, justify="right")
    for r in res["rounds"]:
        up = f"{statistics.median(r['bytes_up'].values()):,.0f} B" if r["bytes_up"] else "-"
        down = f"{statistics.median(r['bytes_down'].values()):,.0f} B" if r["bytes_down"] else "-"
        err = f"{r['max_abs_error']:.2e}" if r["max_abs_error"] is not None else "-"
        table.add_row(str(r["round"]), f"{r['seconds']:.2f}", " ".join(f"{s['seconds']:.1f}" for s in r["stages"]),
                      up, down, err)
    console = Console(highlight=False)
    console.print(table)
    console.print(f"median round: {res['median_round_s']:.2f} s; logs and rounds.json in {res['workdir']}")
    if res["pulls"] is not None:
        console.print(f"ServerApp pulls: {res['pulls']}, median {res['pull_interval_s']:.3f} s apart; "
                      f"SuperExec task poll {res['superexec_poll_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
