"""A cluster's trainer launched by torchrun: each worker torchrun starts is one rank, torchrun's agent its supervisor.

`torchrun --nnodes ... --nproc-per-node W [--rdzv-backend c10d --rdzv-endpoint HOST:PORT] -m nebula_fl trainer
--socket S ...` on the SuperNode's machine, the same command without `--socket` on every other: torchrun's
rendezvous (static with `--node-rank`, or c10d's elastic one) decides who meets whom, restarts every worker when
one fails (`--max-restarts`), and this module only renumbers the nodes so that the one beside the SuperNode (the
one given `--socket`) is node 0, whose rank 0 serves the socket and alone masks and answers. c10d's elastic
rendezvous orders nodes by address and process id, not by the operator's wish: the renumbering makes any order
work, and a count of serving nodes other than one is refused on every node with the same line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta

from nebula_fl.clients import trainer_service as service
from nebula_fl.clients.trainer_options import TrainerOptions
from nebula_fl.errors import NebulaError

TORCHRUN_FLAGS = ("--workers", "--nnodes", "--node-rank", "--rendezvous", "--rank-host")
MEET_TIMEOUT = timedelta(minutes=10)  # every worker of a rendezvous says whether it serves; they start together


@dataclass(frozen=True, kw_only=True)
class TorchrunWorker:
    """What torchrun tells one worker: its place in the world torchrun's rendezvous made, and this start's number."""

    rank: int
    local_rank: int
    world: int
    local_world: int
    group_rank: int
    restart: int
    master: str  # HOST:PORT of the store torchrun's rendezvous agreed on

    def __post_init__(self) -> None:
        if self.world < 1 or self.local_world < 1 or self.world % self.local_world:
            raise NebulaError(f"torchrun gave WORLD_SIZE={self.world} and LOCAL_WORLD_SIZE={self.local_world}: every "
                              "node must run the same --nproc-per-node")
        if not (0 <= self.local_rank < self.local_world and 0 <= self.rank < self.world
                and self.rank == self.group_rank * self.local_world + self.local_rank):
            raise NebulaError(f"torchrun gave RANK={self.rank}, LOCAL_RANK={self.local_rank}, GROUP_RANK="
                              f"{self.group_rank} for {self.local_world} worker(s) per node: not one node's block")

    @property
    def nnodes(self) -> int:
        return self.world // self.local_world


def torchrun_worker(environ: Mapping[str, str] = os.environ) -> TorchrunWorker | None:
    """This process's place when torchrun started it (its agent sets TORCHELASTIC_RUN_ID), else None."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    missing = [n for n in names if not environ.get(n)]
    if missing:
        raise NebulaError(f"started by torchrun (TORCHELASTIC_RUN_ID is set) without {', '.join(missing)}: start the "
                          "trainer with torchrun itself, or unset TORCHELASTIC_RUN_ID")
    try:
        rank, local, world, local_world, group, port = (int(environ[n]) for n in (*names[:5], "MASTER_PORT"))
    except ValueError:
        raise NebulaError("torchrun's RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK and MASTER_PORT must "
                          "be integers") from None
    return TorchrunWorker(rank=rank, local_rank=local, world=world, local_world=local_world, group_rank=group,
                          restart=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
                          master=f"{environ['MASTER_ADDR']}:{port}")


def node_zero(serves: list[bool], *, local_world: int) -> int:
    """The torchrun node (group rank) that serves the SuperNode's socket, from every rank's word (rank order)."""
    nodes = sorted({rank // local_world for rank, says in enumerate(serves) if says})
    if len(nodes) != 1:
        said = f"nodes {', '.join(map(str, nodes))} (torchrun's numbering) were" if nodes else "none was"
        raise NebulaError(f"exactly one node of a cluster under torchrun is given --socket (the one beside the "
                          f"SuperNode), but {said}: give --socket on that machine's command only")
    return nodes[0]


def renumbered(worker: TorchrunWorker, *, node0: int) -> tuple[int, int]:
    """(this worker's node, its rank) in the cluster's numbering: torchrun's nodes turned so that `node0` is first,
    each node's ranks still one block in local order (a node's data part and devices follow its local rank)."""
    node = (worker.group_rank - node0) % worker.nnodes
    return node, node * worker.local_world + worker.local_rank


def run_torchrun_worker(opts: TrainerOptions, worker: TorchrunWorker, *, serves: bool) -> int:
    """Meet the other workers at torchrun's store, take this worker's place in the cluster and run it as a rank
    (``rank.rank_main``); torchrun's agent is its supervisor (it dies with it; a failure ends every worker)."""
    import torch.distributed as dist  # (the trainer's own supervisor never imports torch; a torchrun worker is a rank)

    store, rank, world = next(dist.rendezvous("env://", timeout=MEET_TIMEOUT))
    assert (rank, world) == (worker.rank, worker.world), (rank, world)
    ours = dist.PrefixStore(f"nebula/{worker.restart}", store)
    ours.set(f"serves/{worker.rank}", b"1" if serves else b"0")
    said = [ours.get(f"serves/{r}") == b"1" for r in range(worker.world)]
    node, rank = renumbered(worker, node0=node_zero(said, local_world=worker.local_world))
    opts = replace(opts, workers=worker.local_world, nnodes=worker.nnodes, node_rank=node,
                   rendezvous=worker.master if worker.nnodes > 1 else None)
    devices, precision = service.check(opts)
    os.umask(0o077)  # as the trainer's own ranks: the state folder is this user's alone
    lock = None
    if worker.local_rank == 0:  # one per machine: the state folder, the shard file, node 0's checks, the start line
        lock, line = service.prepare_node(opts, devices=devices, precision=precision,
                                          launcher=f"under torchrun (its node {worker.group_rank}, start {worker.restart})")
        print(line, flush=True)
    from nebula_fl.clients.rank import rank_main  # (imports the trainer's torch-side modules)

    try:
        rank_main(rank, opts, "", os.getppid(), store=dist.PrefixStore("pg", ours))
    finally:
        if lock is not None:
            os.close(lock)
    return 0
