"""What a cluster's trainer is started with, what `hello` says of it, and its one log line format."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nebula_fl.data.datasets import TextDataset
from nebula_fl.privacy.policy import PrivacyPolicy

LOCK_WAIT_S = 30.0  # how long a trainer waits for the one before it on its state folder to stop


@dataclass(kw_only=True)
class TrainerOptions:
    cluster_id: int
    socket_path: Path
    state_dir: Path
    model_path: Path
    shard: TextDataset
    workers: int = 1
    device: str = "cpu"  # a device spec (nebula_fl/devices.py): cpu, cuda, cuda:N or one per worker joined by '+'
    precision: str = "auto"  # auto (bf16 autocast on a GPU, fp32 on a CPU), fp32 or bf16
    threads: int = 1
    policy: PrivacyPolicy = field(default_factory=PrivacyPolicy)
    slowdown: float = 1.0  # emulate a slower site: each step takes this many times as long (asleep, no CPU)
    lock_wait_s: float = LOCK_WAIT_S  # how long to wait for the trainer before this one on the state folder
    parallel: str = "ddp"  # "ddp" or "fsdp": how the workers share the model (model/sharding.py)
    socket_group: int | None = None  # a group whose members may connect (the SuperNode's user); None: this user only
    rank_host: Path | None = None  # a rank host's socket (rank_host.py) to fork the ranks; None: its own fork server
    # A cluster across machines: `nnodes` trainers, one per machine, each with `workers` ranks, meet at the c10d
    # TCP store on `rendezvous` (HOST:PORT of node 0, whose rank 0 serves the SuperNode's socket).
    nnodes: int = 1
    node_rank: int = 0
    rendezvous: str | None = None

    @property
    def world(self) -> int:
        """Ranks in the cluster, every node's."""
        return self.nnodes * self.workers

    @property
    def first_rank(self) -> int:
        """The global rank of this node's first worker."""
        return self.node_rank * self.workers


def describe(opts: TrainerOptions) -> dict[str, Any]:
    """`hello`: who answers, on what hardware, under which policy mode: only what IN_THE_CLEAR lets any reply say.
    Whoever reaches the socket (the SuperNode's user, so what the server sees) learns nothing of the data: the
    shard's size and labels are in the state folder (SHARD_FILE), for the operator alone."""
    return {"cluster_id": opts.cluster_id, "workers": opts.world, "nodes": opts.nnodes, "device": opts.device,
            "precision": opts.precision, "parallel": opts.parallel, "privacy_mode": opts.policy.mode}


def log(opts: TrainerOptions, text: str, *, error: bool = False) -> None:
    print(f"trainer {opts.cluster_id}: {text}", file=sys.stderr if error else sys.stdout, flush=True)
