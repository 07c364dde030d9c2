"""Encode + decode throughput and compression ratio of every built-in codec chain, on one CPU core.

Throughput = input bytes / (median encode seconds + median decode seconds), error feedback
included (it is part of every biased encode), in steady state: two warm-up rounds first, since a
fresh process pays for first-touch page faults on its first 64 MB buffers. Inputs are standard-normal float32 on a layout of
2-D matrices (4 x 512x512 for 1M elements, 16 x 1024x1024 for 16M), the shape low-rank needs.
Goals: >= 1 GB/s for int8, >= 200 MB/s for top-k (1 MB = 10^6 bytes).

    .venv/bin/python benchmarks/codecs.py                 # ~1 min
    .venv/bin/python benchmarks/codecs.py --sizes 1M --repeats 3 --out /tmp/codecs.json

Writes results.json (default benchmarks/results/codecs/results.json) and prints a table.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # one core, before numpy loads
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from nebula_fl.compression import Compressor, Layout  # noqa: E402

CODECS = ["none", "fp16", "bf16", "int8", "int4", "topk:0.01", "topk:0.05+int8", "randk:0.05", "lowrank:4"]
GOALS = {"int8": 1e9, "topk:0.01": 200e6, "topk:0.05+int8": 200e6}  # bytes / second
SIZES = {"1M": (4, 512), "16M": (16, 1024)}
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "codecs" / "results.json"


def pin_one_core() -> int | None:
    """Run on one CPU (Linux): the figures are per core, not per machine."""
    if hasattr(os, "sched_setaffinity"):
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return cpu
    return None


def layout_for(size: str) -> Layout:
    count, side = SIZES[size]
    return Layout(tuple((f"layer{i}.weight", (side, side)) for i in range(count)))


def measure(spec: str, layout: Layout, x: np.ndarray, *, repeats: int) -> dict:
    comp = Compressor(spec, layout=layout)
    blob = comp.encode(x, seed=0)  # the first round's error, residual still zero
    y = Compressor.decode(blob, layout=layout, seed=0)
    rel_error = float(np.linalg.norm(y - x) / np.linalg.norm(x))
    Compressor.decode(comp.encode(x, seed=0), layout=layout, seed=0)  # second warm-up: fresh pages mapped
    enc, dec = [], []
    for seed in range(1, repeats + 1):
        t0 = time.perf_counter()
        blob = comp.encode(x, seed=seed)
        t1 = time.perf_counter()
        Compressor.decode(blob, layout=layout, seed=seed)
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    encode_s, decode_s = statistics.median(enc), statistics.median(dec)
    header = 8 + int.from_bytes(blob[4:8], "little")
    throughput = x.nbytes / (encode_s + decode_s)
    goal = GOALS.get(spec)
    return {
        "spec": spec,
        "elements": x.size,
        "input_bytes": x.nbytes,
        "blob_bytes": len(blob),
        "header_bytes": header,
        "ratio": x.nbytes / len(blob),
        "encode_ms": encode_s * 1e3,
        "decode_ms": decode_s * 1e3,
        "throughput_MBps": throughput / 1e6,
        "rel_error_round1": rel_error,
        "goal_MBps": None if goal is None else goal / 1e6,
        "goal_met": None if goal is None else throughput >= goal,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1M,16M", help="comma-separated: 1M, 16M")
    parser.add_argument("--codecs", default=",".join(CODECS), help="comma-separated codec specs")
    parser.add_argument("--repeats", type=int, default=7, help="timed encode+decode rounds per codec (median)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; use {sorted(SIZES)}")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    specs = [s.strip() for s in args.codecs.split(",") if s.strip()]
    cpu = pin_one_core()
    console = Console()
    if not console.is_terminal:
        console = Console(width=150)  # a log file gets the whole table, not an 80-column wrap
    results = []
    for size in sizes:
        layout = layout_for(size)
        x = np.random.default_rng(0).standard_normal(layout.size, dtype=np.float32)
        for spec in specs:
            row = measure(spec, layout, x, repeats=args.repeats)
            row["size"] = size
            results.append(row)
            console.print(f"{size:>4} {spec:<16} {row['throughput_MBps']:9.1f} MB/s  ratio {row['ratio']:8.1f}")

    table = Table(title=f"codec throughput, one core (cpu {cpu}), median of {args.repeats}")
    for col in ("size", "codec", "encode ms", "decode ms", "MB/s", "ratio", "blob bytes", "header B",
                "rel. error", "goal"):
        table.add_column(col, justify="left" if col in ("size", "codec", "goal") else "right")
    for r in results:
        goal = "" if r["goal_MBps"] is None else (
            f"≥{r['goal_MBps']:.0f} MB/s " + ("[green]met[/]" if r["goal_met"] else "[red]NOT met[/]"))
        table.add_row(r["size"], r["spec"], f"{r['encode_ms']:.1f}", f"{r['decode_ms']:.1f}",
                      f"{r['throughput_MBps']:.0f}", f"{r['ratio']:.1f}", f"{r['blob_bytes']:,}",
                      str(r["header_bytes"]), f"{r['rel_error_round1']:.4f}", goal)
    console.print(table)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": {"python": platform.python_version(), "numpy": np.__version__, "cpu": platform.processor()
                    or platform.machine(), "pinned_cpu": cpu, "threads": 1},
        "repeats": args.repeats,
        "goals_MBps": {k: v / 1e6 for k, v in GOALS.items()},
        "all_goals_met": all(r["goal_met"] for r in results if r["goal_met"] is not None),
        "results": results,
    }
    args.out.write_text(json.dumps(payload, indent=2))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
