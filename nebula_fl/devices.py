"""Which device each worker of a cluster (and the server's evaluation) runs on, and in which precision.

A cluster's device spec is its operator's choice, like its worker count:

  cpu              every worker on the CPU (gloo)
  cuda             worker r on GPU r: one GPU per worker (NCCL refuses two ranks on one GPU)
  cuda:N           one worker, on GPU N
  cuda:0+cuda:1    one entry per worker, in rank order

GPU numbers are those the process sees: ``CUDA_VISIBLE_DEVICES`` renumbers them, as it does for torch. One
cluster's workers share one backend, so its entries are all GPUs or all ``cpu``. Everything here is checked
before a process starts, with one line saying what to change; the syntax check needs no GPU, the count check
takes the number of visible GPUs as an argument (so both are testable on a machine without one).
"""

from __future__ import annotations

import os
import re

from nebula_fl.errors import NebulaError

_ONE = re.compile(r"cpu|cuda(?::(\d{1,3}))?")
PRECISIONS = ("auto", "fp32", "bf16")
PARALLEL = ("ddp", "fsdp")  # how a cluster's workers share the model: nebula_fl/model/sharding.py
DP_REFUSED = ("per-example DP (privacy mode 'sample') runs with --parallel ddp only: Opacus's per-sample "
              "gradients are not wired to FSDP here; run this cluster with --parallel ddp, or use privacy mode "
              "'client'")


def _entries(spec: str, *, where: str) -> list[str]:
    entries = [e.strip() for e in str(spec).split("+")]
    for entry in entries:
        if not _ONE.fullmatch(entry):
            raise NebulaError(f"{where} has device '{entry}'; use cpu, cuda, cuda:N, or one per worker joined by '+' "
                              "(e.g. cuda:0+cuda:1)")
    return entries


def worker_devices(spec: str, *, workers: int, where: str = "--device") -> list[str]:
    """One device per worker ('cpu' or 'cuda:N'), in rank order."""
    entries = _entries(spec, where=where)
    if len(entries) > 1:
        if len(entries) != workers:
            raise NebulaError(f"{where} '{spec}' names {len(entries)} devices for {workers} worker(s); "
                              "give one per worker, or one for all")
        if "cuda" in entries:
            raise NebulaError(f"{where} '{spec}': inside a per-worker list name each GPU as cuda:N")
        kinds = {e.split(":")[0] for e in entries}
        if len(kinds) > 1:
            raise NebulaError(f"{where} '{spec}' mixes cpu and cuda workers in one cluster; its workers share one "
                              "backend (NCCL or gloo): put them all on GPUs or all on cpu")
        gpus = [e for e in entries if e != "cpu"]
        if len(set(gpus)) < len(gpus):
            raise NebulaError(f"{where} '{spec}' puts two workers on one GPU, which NCCL refuses; give each worker "
                              "its own GPU, or use fewer workers")
        return entries
    (entry,) = entries
    if entry == "cpu":
        return ["cpu"] * workers
    if entry == "cuda":
        return [f"cuda:{r}" for r in range(workers)]
    if workers > 1:
        raise NebulaError(f"{where} '{spec}' puts {workers} workers on one GPU, which NCCL refuses; give each worker "
                          f"its own GPU (e.g. {'+'.join(f'cuda:{r}' for r in range(workers))}) or use 1 worker")
    return [entry]


def check_parallel(value: str, *, per_cluster: bool = False) -> str:
    if value not in PARALLEL:
        raise NebulaError(f"--parallel has '{value}'; use ddp (every worker holds the whole model) or fsdp (each "
                          "holds a shard)" + (", one value or one per cluster" if per_cluster else ""))
    return value


def visible_note() -> str:
    """What decides the GPU numbering, for error lines."""
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES unset" if shown is None else f"CUDA_VISIBLE_DEVICES={shown!r}"


def check_visible(devices: list[str], *, visible: int, where: str = "--device") -> None:
    """Every GPU named exists among the `visible` ones."""
    wanted = [int(d.split(":")[1]) for d in devices if d.startswith("cuda")]
    if not wanted:
        return
    if visible == 0:
        raise NebulaError(f"{where} asks for a GPU but no CUDA device is visible ({visible_note()}); use cpu")
    if max(wanted) >= visible:
        need = max(wanted) + 1
        raise NebulaError(f"{where} needs {need} GPU(s) (workers on {', '.join(devices)}) but {visible} is visible "
                          f"({visible_note()}); use fewer workers per GPU cluster, or name GPUs 0..{visible - 1}")


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_precision(precision: str, *, device_kind: str, privacy_mode: str = "off",
                      where: str = "--precision") -> str:
    """'fp32' or 'bf16': `auto` is bf16 autocast on a GPU, fp32 on a CPU (where bf16 is slower, not faster).

    Per-example DP trains in fp32: Opacus computes each example's gradient in the forward's dtype, and a norm
    taken in bf16 (8 bits of mantissa) can clip an example above the bound its privacy accounting assumes.
    """
    if precision not in PRECISIONS:
        raise NebulaError(f"{where} has '{precision}'; use auto (bf16 on GPU, fp32 on CPU), fp32 or bf16")
    if privacy_mode == "sample":
        if precision == "bf16":
            raise NebulaError(f"{where} bf16 cannot train under per-example DP (Opacus would clip in bf16, above "
                              "the accounted bound); use --precision auto or fp32 for this cluster")
        return "fp32"
    if precision == "auto":
        return "bf16" if device_kind == "cuda" else "fp32"
    return precision


def server_device(spec: str, *, visible: int) -> str:
    """The server evaluation's device for key `server-device`: auto is the first visible GPU, else cpu."""
    if spec == "auto":
        return "cuda:0" if visible else "cpu"
    (device,) = worker_devices(spec, workers=1, where="config key 'server-device'")
    check_visible([device], visible=visible, where="config key 'server-device'")
    return device


def autocast(device, precision: str):
    """bf16 autocast on `device` (a torch.device) for 'bf16'; a no-op context for 'fp32'."""
    import torch

    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
