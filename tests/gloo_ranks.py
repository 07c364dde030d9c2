"""Ranks of a real gloo process group, started as a cluster's trainer starts its workers (forked by a fork server that
imported torch and the trainer once), each running a module-level `checks(rank, world, *args) -> dict` and handing
its findings back as JSON (the ranks share no memory with the test)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nebula_fl.clients.rank_host import RANK_PRELOAD

Checks = Callable[..., dict[str, Any]]
PRELOAD = [*RANK_PRELOAD, "tests.gloo_ranks"]  # what a trainer's ranks preload, and these ranks' own module


def _rank_main(rank: int, world: int, folder: str, checks: Checks, args: tuple) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world)
    try:
        found = checks(rank, world, *args)
        (Path(folder) / f"found-{rank}.json").write_text(json.dumps(found))
        dist.barrier()  # every rank done with its collectives before any tears the group down (gloo aborts else)
    finally:
        dist.destroy_process_group()


def spawn_ranks(checks: Checks, *, world: int, folder: Path, args: tuple = ()) -> list[dict[str, Any]]:
    """Each rank's findings, in rank order; a rank that raises fails the spawn (torch re-raises it here)."""
    import multiprocessing

    import torch.multiprocessing as mp

    folder.mkdir(parents=True, exist_ok=True)
    multiprocessing.set_forkserver_preload(PRELOAD)  # (read once: when this test process starts its fork server)
    mp.start_processes(_rank_main, args=(world, str(folder), checks, args), nprocs=world, start_method="forkserver")
    return [json.loads((folder / f"found-{rank}.json").read_text()) for rank in range(world)]
