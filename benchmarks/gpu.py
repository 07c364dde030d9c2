"""A GPU check anyone can run: six short federations on CUDA through nebula-fl's own CLI, in <= 5 minutes.

Each case is `python -m nebula_fl run ... --port 0 --out <out>/<case>/run` (the `nebula-fl` entry point, started
as the tests start it: this interpreter, the environment as it is plus PYTHONUNBUFFERED=1, a fresh run folder),
with its own timeout (past it the launcher gets a Ctrl-C, then what is left is killed), in this order:

  demo-cuda       --preset demo --device cuda --rounds 3                     the demo, blocking, on the GPU
  two-workers     --preset smoke --device cuda --workers-per-cluster 2       with 1 GPU: refused at start with one
                                                                             line (pass), or completes (pass); a
                                                                             hang or a crash fails
  mixed           --preset demo --device cuda,cpu --rounds 2                 one cluster on the GPU, one on CPU
  fsdp            --preset smoke --parallel fsdp --workers-per-cluster 2 --device cuda:0+cuda:1 (>= 2 GPUs visible)
                  --preset smoke --parallel fsdp --workers-per-cluster 1 --device cuda          (else)
  mlm             --task mlm --preset demo --device cuda --rounds 3          pre-training, every weight exchanged
  bf16            --preset demo --device cuda --precision bf16 --rounds 3    the demo under bf16 autocast

For each case it records: ok, the exit status, wall seconds, the rounds' seconds (metrics.jsonl `seconds`), each
cluster's busy fraction per round (the round's `timeline.clusters[cid].busy_fraction`, see
nebula_fl/server/timeline.py), the run's status and rounds completed (summary.json), and the refusal line (the
last `nebula-fl: error:` line) when it refused. A case is ok when it exits 0 with summary.json `completed`;
`two-workers` is also ok when it is refused cleanly (a non-zero exit with a `nebula-fl: error:` line, before its
timeout). Writes <out>/results.json and prints a table; exits 1 if any case is not ok.

    source .device/setup.sh && python benchmarks/gpu.py          # on a machine with a GPU (see shared/device)
    python benchmarks/gpu.py --dry-run                           # anywhere: the commands it would run

Without a visible CUDA device it refuses with one line and exit 1 (unless --dry-run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NO_GPU = "benchmarks/gpu.py needs a CUDA device; none is visible here"
REFUSAL = "nebula-fl: error:"
BUDGET_S = 300.0


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]
    timeout_s: float
    refusal_ok: bool = False  # a clean refusal at start passes too
    what: str = ""


def cases(gpus: int) -> list[Case]:
    """The six cases in order; the FSDP one spans two GPUs where two are visible."""
    fsdp = (("--parallel", "fsdp", "--workers-per-cluster", "2", "--device", "cuda:0+cuda:1") if gpus >= 2 else
            ("--parallel", "fsdp", "--workers-per-cluster", "1", "--device", "cuda"))
    return [
        Case("demo-cuda", ("--preset", "demo", "--device", "cuda", "--rounds", "3"), 150, what="the demo, blocking"),
        Case("two-workers", ("--preset", "smoke", "--device", "cuda", "--workers-per-cluster", "2"), 90,
             refusal_ok=True, what="2 DDP workers on the GPU(s)"),
        Case("mixed", ("--preset", "demo", "--device", "cuda,cpu", "--rounds", "2"), 150,
             what="one cluster on cuda, one on cpu"),
        Case("fsdp", ("--preset", "smoke", *fsdp), 120,
             what=f"an FSDP cluster on {'2 GPUs' if gpus >= 2 else '1 GPU'}"),
        Case("mlm", ("--task", "mlm", "--preset", "demo", "--device", "cuda", "--rounds", "3"), 150,
             what="MLM pre-training"),
        Case("bf16", ("--preset", "demo", "--device", "cuda", "--precision", "bf16", "--rounds", "3"), 150,
             what="the demo under bf16 autocast"),
    ]


def command(case: Case, folder: Path) -> list[str]:
    return [sys.executable, "-m", "nebula_fl", "run", *case.args, "--port", "0", "--out", str(folder)]


def refusal_line(text: str) -> str | None:
    """The last `nebula-fl: error:` line of a run's output, or None."""
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith(REFUSAL)]
    return lines[-1] if lines else None


def read_run(folder: Path) -> dict[str, Any]:
    """Status, rounds completed, round seconds and busy fractions ({round: {cluster: fraction}}) of a run folder;
    whatever is missing stays None or empty."""
    out: dict[str, Any] = {"status": None, "rounds_completed": None, "round_s": [], "busy_fraction": {}}
    try:
        summary = json.loads((folder / "summary.json").read_text())
        out["status"], out["rounds_completed"] = summary.get("status"), summary.get("rounds_completed")
    except (OSError, ValueError):
        pass
    try:
        lines = (folder / "metrics.jsonl").read_text().splitlines()
    except OSError:
        lines = []
    for text in lines:
        try:
            line = json.loads(text)
        except ValueError:
            break  # a line cut short by a crash ends the usable history
        out["round_s"].append(line.get("seconds"))
        timed = (line.get("timeline") or {}).get("clusters") or {}
        out["busy_fraction"][str(line.get("round"))] = {cid: c.get("busy_fraction") for cid, c in sorted(timed.items())}
    return out


def judge(case: Case, *, exit_code: int | None, timed_out: bool, status: str | None, refusal: str | None) -> bool:
    if timed_out:
        return False
    if exit_code == 0 and status == "completed":
        return True
    return case.refusal_ok and exit_code not in (None, 0) and refusal is not None


def run_case(case: Case, out: Path, timeout_s: float) -> dict[str, Any]:
    folder, log = out / case.name / "run", out / case.name / "output.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    timed_out = False
    with log.open("w") as handle:
        proc = subprocess.Popen(command(case, folder), stdout=handle, stderr=subprocess.STDOUT, env=env)
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            code = stop_run(proc)
    wall = time.monotonic() - t0
    run = read_run(folder)
    refusal = refusal_line(log.read_text(errors="replace"))
    ok = judge(case, exit_code=code, timed_out=timed_out, status=run["status"], refusal=refusal)
    return {"case": case.name, "what": case.what, "command": command(case, folder), "ok": ok, "exit": code,
            "timed_out": timed_out, "timeout_s": timeout_s, "wall_s": round(wall, 2), **run,
            "refusal": refusal if code not in (None, 0) else None, "log": str(log)}


def stop_run(proc: subprocess.Popen) -> int | None:
    """Stop a run past its timeout as a user would: Ctrl-C (SIGINT) to the launcher, which stops what it started;
    30 s later SIGKILL it and whatever of its descendants (SuperLink, SuperNodes, trainers) is still alive."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    for child in descendants:
        try:
            child.kill()
        except psutil.Error:
            pass
    return code


def table(results: list[dict[str, Any]]):
    from rich.table import Table

    t = Table(title="nebula-fl on CUDA: six cases")
    for col in ("case", "ok", "exit", "wall s", "rounds", "round s", "busy fraction (min per round)", "refusal"):
        t.add_column(col, justify="left" if col in ("case", "refusal") else "right", overflow="fold")
    for r in results:
        busy = [min((v for v in per.values() if v is not None), default=None) for per in r["busy_fraction"].values()]
        t.add_row(r["case"], "yes" if r["ok"] else "NO", "-" if r["exit"] is None else str(r["exit"]),
                  f"{r['wall_s']:.1f}" + (" (timeout)" if r["timed_out"] else ""),
                  f"{r['rounds_completed'] if r['rounds_completed'] is not None else '-'} ({r['status'] or '-'})",
                  " ".join(f"{s:.1f}" for s in r["round_s"] if isinstance(s, int | float)) or "-",
                  " ".join("-" if b is None else f"{b:.2f}" for b in busy) or "-", r["refusal"] or "")
    return t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/gpu", help="results folder (must be new or empty)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands it would run, run nothing")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help=f"seconds for all cases (default {BUDGET_S:.0f}); a case gets at most what is left")
    parser.add_argument("--only", help="comma-separated case names to run (default: all six, in order)")
    args = parser.parse_args(argv)
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    todo = cases(gpus)
    if args.only:
        wanted = {x.strip() for x in args.only.split(",") if x.strip()}
        unknown = wanted - {c.name for c in todo}
        if unknown:
            raise SystemExit(f"--only: unknown case(s) {', '.join(sorted(unknown))}; pick from "
                             f"{', '.join(c.name for c in todo)}")
        todo = [c for c in todo if c.name in wanted]
    out = Path(args.out).resolve()
    if args.dry_run:
        print(f"{len(todo)} cases ({gpus} GPU(s) visible here), each in a fresh run folder under {out}:")
        for case in todo:
            print(f"{case.name} (timeout {case.timeout_s:.0f} s): {' '.join(command(case, out / case.name / 'run'))}")
        return 0
    if gpus == 0:
        raise SystemExit(NO_GPU)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import fresh_out, write_results
    from rich.console import Console

    out = fresh_out(str(out))
    console = Console(highlight=False, width=160)
    console.print(f"{gpus} GPU(s): {', '.join(torch.cuda.get_device_name(i) for i in range(gpus))}; "
                  f"budget {args.budget:.0f} s")
    started = time.monotonic()
    results = []
    for case in todo:
        left = args.budget - (time.monotonic() - started)
        if left < 10:
            results.append({"case": case.name, "what": case.what, "command": command(case, out / case.name / "run"),
                            "ok": False, "exit": None, "timed_out": False, "timeout_s": 0, "wall_s": 0.0,
                            "status": "skipped: the budget was spent", "rounds_completed": None, "round_s": [],
                            "busy_fraction": {}, "refusal": None, "log": None})
            console.print(f"{case.name}: skipped, the budget of {args.budget:.0f} s was spent")
            continue
        console.print(f"{case.name}: {case.what} ...")
        result = run_case(case, out, min(case.timeout_s, left))
        results.append(result)
        console.print(f"{case.name}: {'ok' if result['ok'] else 'NOT ok'}, exit {result['exit']}, "
                      f"{result['wall_s']:.1f} s" + (f", refused: {result['refusal']}" if result["refusal"] else ""))
    record = {"benchmark": "gpu", "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
              "torch": torch.__version__, "budget_s": args.budget, "wall_s": round(time.monotonic() - started, 2),
              "ok": all(r["ok"] for r in results), "cases": results}
    write_results(out, record)
    console.print(table(results))
    console.print(f"results: {out / 'results.json'}; {record['wall_s']:.0f} s in all; "
                  + ("every case ok" if record["ok"] else
                     f"NOT ok: {', '.join(r['case'] for r in results if not r['ok'])}"))
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
