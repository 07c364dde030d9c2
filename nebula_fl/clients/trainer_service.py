"""A cluster's persistent trainer: `workers` torch.distributed ranks, rank 0 serving a Unix socket.

Started once per cluster beside its SuperNode (``nebula-fl trainer ...``); it outlives every
per-message ``flwr-clientapp`` process, so model weights, tokenised data and worker processes are
loaded once per run, never per round. The parent process only supervises: if any rank dies it stops
the others and exits non-zero; on SIGTERM/SIGINT it stops them all and exits.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

from nebula_fl.clients.protocol import listen, pack, unpack
from nebula_fl.data.datasets import TextDataset
from nebula_fl.errors import NebulaError

CONTROL_TIMEOUT = timedelta(days=30)  # ranks >= 1 idle in a broadcast between rounds; rounds can be far apart


@dataclass(kw_only=True)
class TrainerOptions:
    cluster_id: int
    socket_path: Path
    state_dir: Path
    model_path: Path
    shard: TextDataset
    workers: int = 1
    device: str = "cpu"
    threads: int = 1


def _device_for(rank: int, device: str):
    import torch

    if device == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _worker_main(rank: int, opts: TrainerOptions, init_file: str) -> None:
    """Entry point of one rank (a spawned process)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from nebula_fl.clients.trainer import ClusterTrainer, RequestError, WorkerContext

    torch.set_num_threads(opts.threads)
    device = _device_for(rank, opts.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=opts.workers)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    trainer = ClusterTrainer(
        WorkerContext(
            rank=rank, world=opts.workers, cluster_id=opts.cluster_id, device=device,
            model_path=opts.model_path, shard=opts.shard, state_dir=opts.state_dir, control=control,
        )
    )
    if rank == 0:
        _serve(listen(opts.socket_path), trainer, opts)
    else:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=control)
            header, arrays = box[0]
            try:
                trainer.train_round(header, arrays)
            except RequestError:
                pass


def _serve(listener: Listener, trainer, opts: TrainerOptions) -> None:
    import torch.distributed as dist

    from nebula_fl.clients.trainer import RequestError

    while True:
        try:
            conn = listener.accept()
        except Exception as err:  # a client that fails the HMAC handshake, or hangs up mid-way
            print(f"trainer {opts.cluster_id}: refused a connection: {err}", file=sys.stderr, flush=True)
            continue
        with conn:
            try:
                header, arrays = unpack(conn.recv_bytes())
            except (EOFError, OSError, ValueError) as err:
                print(f"trainer {opts.cluster_id}: unreadable request: {err}", file=sys.stderr, flush=True)
                continue
            op = header.get("op")
            if op == "hello":
                conn.send_bytes(pack({"ok": True, **_describe(opts)}))
            elif op == "train":
                config = header.get("config", {})
                dist.broadcast_object_list([(config, arrays)], src=0, group=trainer.ctx.control)
                try:
                    update, metrics = trainer.train_round(config, arrays)
                except RequestError as err:
                    print(f"trainer {opts.cluster_id}: refused round: {err}", file=sys.stderr, flush=True)
                    conn.send_bytes(pack({"ok": False, "error": str(err)}))
                    continue
                if metrics.get("privacy-refused"):  # the cluster declined the round: its budget is spent
                    done = f"declined: {metrics['privacy-reason']}"
                else:
                    done = f"loss {metrics['train-loss']:.4f}, {metrics['seconds']:.1f} s"
                print(f"trainer {opts.cluster_id}: round {config.get('server-round')} {done}", flush=True)
                conn.send_bytes(pack({"ok": True, "metrics": metrics}, update))
            else:
                conn.send_bytes(pack({"ok": False, "error": f"unknown op {op!r}"}))


def _describe(opts: TrainerOptions) -> dict[str, Any]:
    return {
        "cluster_id": opts.cluster_id,
        "num_examples": len(opts.shard),
        "workers": opts.workers,
        "device": opts.device,
        "label_counts": opts.shard.label_counts(),
    }


def run_trainer(opts: TrainerOptions) -> int:
    """Start the ranks and supervise them until a signal or a failure; returns the exit status."""
    import multiprocessing as mp

    if opts.workers < 1:
        raise NebulaError(f"--workers is {opts.workers}; use 1 or more")
    if len(opts.shard) < opts.workers:
        raise NebulaError(f"cluster {opts.cluster_id} has {len(opts.shard)} examples for {opts.workers} workers")
    if opts.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise NebulaError("--device cuda was given but no CUDA device is visible; use --device cpu")
    opts.state_dir.mkdir(parents=True, exist_ok=True)
    init_file = opts.state_dir / f".ddp-init-{os.getpid()}"
    init_file.unlink(missing_ok=True)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_worker_main, args=(rank, opts, str(init_file)), name=f"nebula-trainer-{opts.cluster_id}-{rank}")
        for rank in range(opts.workers)
    ]
    stopping = {"signal": None}

    def _stop(signum, _frame):
        stopping["signal"] = signum

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    for p in procs:
        p.start()
    print(
        f"trainer {opts.cluster_id}: {opts.workers} worker(s) on {opts.device}, {len(opts.shard)} examples, "
        f"socket {opts.socket_path}",
        flush=True,
    )
    status = 0
    try:
        while stopping["signal"] is None:
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed or all(p.exitcode == 0 for p in procs):
                status = 1 if failed else 0
                for p in failed:
                    print(f"trainer {opts.cluster_id}: {p.name} exited with {p.exitcode}", file=sys.stderr, flush=True)
                break
            time.sleep(0.2)
    except Exception:
        traceback.print_exc()
        status = 1
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 5
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for path in (opts.socket_path, Path(f"{opts.socket_path}.key"), init_file):
            Path(path).unlink(missing_ok=True)
    return status
