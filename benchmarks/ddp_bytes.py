"""What data-parallel training really hands to its all-reduce, measured on K real ranks running DDP.

`measure(model, batches, loss_fn, ...)` spawns K processes (torch.multiprocessing, `file://` rendezvous), wraps
the same model in `DistributedDataParallel` on each and runs a few real AdamW steps on their own batches. Two
counts come back, per step and rank:

- the hook payload: a DDP communication hook (`register_comm_hook`) adds up the bytes of every gradient bucket
  DDP hands to all-reduce, then does the stock all-reduce (`default_hooks.allreduce_hook`), so training is
  unchanged. A ring all-reduce of N bytes makes each rank send 2(K-1)/K x N and receive as much.
- the loopback bytes (gloo only): what crossed the `lo` interface while the steps ran, read from
  /proc/net/dev before and after, less the same reading over an idle window of the same length. It counts
  every process's loopback traffic on the machine (other programs included) and TCP/IP headers, so each
  repetition is a sample and the median is reported. NCCL (one GPU per rank) moves intra-node data through
  shared memory / NVLink, not `lo`: there only the hook payload counts.

The counts do not depend on where the model computes: a bucket holds the float32 gradients of the trainable
parameters, on CPU or GPU, with or without autocast.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


def loopback_counters(text: str, interface: str = "lo") -> tuple[int, int]:
    """(received, transmitted) bytes of `interface` in the text of /proc/net/dev."""
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if sep and name.strip() == interface:
            fields = rest.split()
            if len(fields) < 9:
                raise ValueError(f"/proc/net/dev: the {interface!r} line has {len(fields)} fields, expected 16")
            return int(fields[0]), int(fields[8])
    raise ValueError(f"/proc/net/dev lists no interface {interface!r}")


def read_loopback() -> int:
    """Bytes that crossed `lo` so far: each packet there is both sent and received, so (rx + tx) / 2."""
    rx, tx = loopback_counters(Path("/proc/net/dev").read_text())
    return (rx + tx) // 2


def ring_factor(world: int) -> float:
    """Bytes one rank sends per byte of all-reduce payload in a ring all-reduce (and receives as many)."""
    return 2 * (world - 1) / world


@dataclass
class HookCount:
    """The comm hook's state: bytes and buckets handed to all-reduce since the last reset."""

    group: dist.ProcessGroup | None = None
    bytes: int = 0
    buckets: int = 0


def counting_allreduce(state, bucket):  # no annotations: DDP rejects the string ones `annotations` makes
    """DDP comm hook: count the bucket's bytes (a `dist.GradBucket`), then the stock all-reduce (mean over ranks);
    returns its future. `state` is a `HookCount`."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    buffer = bucket.buffer()
    state.bytes += buffer.numel() * buffer.element_size()
    state.buckets += 1
    return default_hooks.allreduce_hook(state.group, bucket)


def _worker(rank: int, world: int, backend: str, init_file: str, model: torch.nn.Module, batches: list,
            loss_fn, steps: int, repeats: int, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(max(1, (os.cpu_count() or world) // world))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            ddp = DistributedDataParallel(model.to(device), device_ids=[rank])
        else:
            device = torch.device("cpu")
            ddp = DistributedDataParallel(model)
        count = HookCount()
        ddp.register_comm_hook(count, counting_allreduce)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
        mine = [{k: v.to(device) for k, v in b.items()} for b in batches[rank]]
        ddp.train()

        def step(i: int) -> None:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(ddp, mine[i % len(mine)]).backward()
            optimizer.step()

        step(0)  # DDP rebuilds its buckets after the first iteration: measure from the second on
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        count.bytes = count.buckets = 0
        active, idle, seconds = [], [], []
        for r in range(repeats):
            dist.barrier()
            before, t0 = read_loopback(), time.monotonic()
            for i in range(steps):
                step(1 + r * steps + i)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            during, t1 = read_loopback(), time.monotonic()
            time.sleep(t1 - t0)  # every rank idles as long: what the rest of the machine sends meanwhile
            active.append(during - before)
            idle.append(read_loopback() - during)
            seconds.append(t1 - t0)
            dist.barrier()
        grad_bytes = sum(p.numel() * p.element_size() for p in ddp.module.parameters() if p.requires_grad)
        if rank == 0:
            Path(out_dir, "result.json").write_text(json.dumps({
                "hook_bytes": count.bytes, "hook_buckets": count.buckets, "steps": steps * repeats,
                "active": active, "idle": idle, "seconds": seconds, "grad_bytes": grad_bytes}))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def spawnable(module: str, name: str):
    """Function `name` of the benchmark script `module`, importable by that name in spawned ranks: they unpickle it
    with the parent's sys.path, so the benchmarks folder is on it while they run (however the script was loaded)."""
    import importlib

    here = str(Path(__file__).resolve().parent)
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        yield getattr(importlib.import_module(module), name)
    finally:
        if added:
            sys.path.remove(here)


def measure(model: torch.nn.Module, batches: list[list[dict]], loss_fn, *, backend: str = "gloo",
            steps: int = 3, repeats: int = 5) -> dict:
    """Run DDP on len(batches) ranks (rank r uses batches[r], steps + 1 of them or fewer, cycled) and return the
    counts per step and rank: `hook_payload_bytes` (what one rank's buckets hand to all-reduce),
    `hook_wire_bytes` (that times the ring factor, sent + received), `loopback_bytes` (median over `repeats`
    windows of `steps` steps, sent + received; None with NCCL) and the samples behind it."""
    import torch.multiprocessing as mp

    world = len(batches)
    if world < 2:
        raise ValueError(f"measure: {world} rank(s); an all-reduce needs at least 2 (one batch list per rank)")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"measure: backend {backend!r}; use gloo or nccl")
    with spawnable("ddp_bytes", "_worker") as worker, tempfile.TemporaryDirectory(prefix="ddp-bytes-") as tmp:
        mp.spawn(worker, args=(world, backend, os.path.join(tmp, "rendezvous"), model.cpu(), batches, loss_fn,
                                steps, repeats, tmp), nprocs=world, join=True)
        raw = json.loads(Path(tmp, "result.json").read_text())
    n = raw["steps"]
    payload = raw["hook_bytes"] / n
    samples = [(a - i) * 2 / world / steps for a, i in zip(raw["active"], raw["idle"], strict=True)]
    return {
        "ranks": world, "backend": backend, "steps_measured": n, "hook_payload_bytes": payload,
        "hook_buckets_per_step": raw["hook_buckets"] / n, "grad_bytes": raw["grad_bytes"],
        "hook_wire_bytes": 2 * ring_factor(world) * payload,
        "loopback_bytes": None if backend == "nccl" else statistics.median(samples),
        "loopback_samples": None if backend == "nccl" else samples,
        "loopback_idle_bytes": None if backend == "nccl" else raw["idle"],
        "window_seconds": raw["seconds"],
    }
