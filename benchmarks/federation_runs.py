"""What every benchmark does around a `nebula-fl run`: a fresh results folder, the run, its records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def fresh_out(path: str) -> Path:
    """The results folder, created; an earlier benchmark's results are never mixed into a new one."""
    out = Path(path).resolve()
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty; pass --out to a new folder")
    out.mkdir(parents=True, exist_ok=True)
    return out


def run_federation(args: list[str], *, folder: Path, log: Path | None = None) -> tuple[dict, list[dict]]:
    """Run `nebula-fl run ARGS --out FOLDER` (output to LOG, or to the console) and return its summary and
    its per-round records; a failed run stops the benchmark with where to look."""
    cmd = [sys.executable, "-m", "nebula_fl", "run", *args, "--out", str(folder)]
    folder.parent.mkdir(parents=True, exist_ok=True)
    if log is None:
        proc = subprocess.run(cmd)
    else:
        with log.open("w") as handle:
            proc = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{folder.name} failed (exit {proc.returncode}); see {log or folder / 'logs'}")
    summary = json.loads((folder / "summary.json").read_text())
    rounds = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return summary, rounds
