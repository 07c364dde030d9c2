"""A cluster's persistent trainer: `workers` torch.distributed ranks (``rank.py``), rank 0 serving a Unix socket.

Started once per cluster beside its SuperNode (``nebula-fl trainer ...``), as its own user where the cluster
is deployed as documented (its state folder is that user's alone, the socket the one way in); it holds the
model weights, tokenised data and worker processes for the whole run, never per round.

This process only checks and supervises, and never imports torch: if any rank dies it stops the others and exits
non-zero; on SIGTERM/SIGINT it stops them all and exits; if it is killed, even by SIGKILL, each rank kills itself
(``lifetime.die_with_process``), and the fork server the ranks come from then exits too.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# (IN_THE_CLEAR, IN_THE_CLEAR_CLIENT_DP and in_the_clear are importable from here too, as before outgoing.py)
from nebula_fl.clients.outgoing import IN_THE_CLEAR, IN_THE_CLEAR_CLIENT_DP, in_the_clear  # noqa: F401
from nebula_fl.clients.protocol import socket_in_use
from nebula_fl.clients.rank_host import RANK_PRELOAD, HostedRank, RankHostClient
from nebula_fl.clients.secagg_stage import SecAggStage
from nebula_fl.clients.trainer_options import LOCK_WAIT_S, TrainerOptions, log
from nebula_fl.devices import check_visible, resolve_precision, visible_gpus, worker_devices
from nebula_fl.errors import NebulaError
from nebula_fl.lifetime import reap_multiprocessing_helpers
from nebula_fl.privacy.cluster_ledger import LEDGER_FILE, ClusterLedger
from nebula_fl.privacy.policy import POLICY_FILE, PrivacyPolicy

LOCK_FILE = "trainer.lock"
SHARD_FILE = "shard.json"  # the shard's size and labels: for the operator, never said on the socket


def write_shard_file(opts: TrainerOptions) -> Path:
    """The shard's size and label counts, for the operator (the launcher's start line), in the private state folder."""
    path = opts.state_dir / SHARD_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"cluster_id": opts.cluster_id, "num_examples": len(opts.shard),
                               "label_counts": opts.shard.label_counts()}))
    os.replace(tmp, path)
    return path


def _rank(*args: Any) -> None:
    """A rank's entry, named here so that this process never imports torch (the fork server already has)."""
    from nebula_fl.clients.rank import rank_main

    rank_main(*args)


def _lock_state_dir(state_dir: Path, *, wait_s: float = LOCK_WAIT_S, poll_s: float = 0.2) -> int:
    """Hold the state folder for this trainer's life: two trainers on one ledger would corrupt it.

    A trainer that holds it may be the previous run's, still shutting down (a `--resume` right after a stop):
    it is waited for up to `wait_s`, with one line saying so; one still holding it then is another trainer.
    """
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    if state_dir.stat().st_uid == os.geteuid():
        state_dir.chmod(0o700)  # an older or hand-made folder too: the state is the trainer's user's alone
    path = state_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            if time.monotonic() >= deadline:
                os.close(fd)
                raise NebulaError(
                    f"state folder '{state_dir}' is in use by another trainer (pid {holder}); stop it, or give this "
                    "one its own --state-dir"
                ) from None
            if not said:
                print(f"state folder '{state_dir}' is held by trainer pid {holder}; waiting up to {wait_s:.0f} s "
                      "for it to stop", flush=True)
                said = True
            time.sleep(poll_s)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def budget_phrase(policy: PrivacyPolicy) -> str:
    """The start line's word on the budget: the lifetime cap, or, with no policy, that there is none."""
    if policy.budget is None:
        return ("; no budget: it runs whatever differential privacy a server asks, with no ε cap of its own (to set "
                "one, give a policy: --privacy-mode with its flags, or --privacy-policy FILE)")
    return f"; lifetime budget ε ≤ {policy.budget:g}" + (
        " (default: the policy sets no max_epsilon)" if policy.budget_is_default else "")


def check(opts: TrainerOptions) -> tuple[list[str], str]:
    """Every refusal the operator's flags can earn, before anything starts: the workers' devices and precision."""
    if opts.workers < 1:
        raise NebulaError(f"--workers is {opts.workers}; use 1 or more")
    if not 1.0 <= opts.slowdown <= 1000.0:
        raise NebulaError(f"--slowdown is {opts.slowdown:g}; use 1 (none) to 1000")
    if not 0.0 <= opts.lock_wait_s <= 3600.0:
        raise NebulaError(f"--lock-wait is {opts.lock_wait_s:g}; use 0 to 3600 seconds")
    from nebula_fl.devices import DP_REFUSED, check_parallel

    check_parallel(opts.parallel)
    if opts.parallel == "fsdp" and opts.policy.mode == "sample":
        raise NebulaError(f"cluster {opts.cluster_id}'s privacy policy is 'sample', but {DP_REFUSED}")
    _check_nodes(opts)
    if len(opts.shard) < opts.world:
        raise NebulaError(f"cluster {opts.cluster_id} has {len(opts.shard)} examples for {opts.world} workers")
    devices = worker_devices(opts.device, workers=opts.workers)
    if devices[0] != "cpu":  # (torch is imported only to count GPUs)
        check_visible(devices, visible=visible_gpus())
    precision = resolve_precision(opts.precision, device_kind=devices[0].split(":")[0], privacy_mode=opts.policy.mode)
    opts.policy.check_for(len(opts.shard))
    return devices, precision


def _check_nodes(opts: TrainerOptions) -> None:
    """A cluster across machines: a node count, this node's place, and where they meet."""
    if not 1 <= opts.nnodes <= 1024:
        raise NebulaError(f"--nnodes is {opts.nnodes}; use 1 (this machine only) to 1024")
    if not 0 <= opts.node_rank < opts.nnodes:
        raise NebulaError(f"--node-rank is {opts.node_rank}; with --nnodes {opts.nnodes} use 0 to {opts.nnodes - 1}")
    if opts.nnodes > 1:
        host, sep, port = (opts.rendezvous or "").rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise NebulaError(f"--nnodes {opts.nnodes} needs --rendezvous HOST:PORT, node 0's address and a free port "
                              f"on it (every node gives the same), not {opts.rendezvous!r}")
    elif opts.rendezvous is not None:
        raise NebulaError("--rendezvous is for a cluster across machines; pass --nnodes N too, or drop it")


def _supervise(procs: list, stopping: dict[str, Any], *, cluster_id: int) -> int:
    """Wait until a signal, a rank's failure (1) or every rank's clean exit (0)."""
    try:
        while stopping["signal"] is None:
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed or all(p.exitcode == 0 for p in procs):
                for p in failed:
                    print(f"trainer {cluster_id}: {p.name} exited with {p.exitcode}", file=sys.stderr, flush=True)
                return 1 if failed else 0
            time.sleep(0.2)
    except Exception:
        traceback.print_exc()
        return 1
    return 0


def _stop_ranks(procs: list, *, grace_s: float = 5.0) -> None:
    """Terminate the ranks, and kill any still alive after `grace_s`: no rank outlives its trainer."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _rank_processes(opts: TrainerOptions, init_file: Path) -> list:
    """The ranks, not yet started: from the rank host the launcher gave (``rank_host.py``: its imports shared by
    every cluster it runs), else, or if that host cannot be reached, from this trainer's own fork server."""
    import multiprocessing as mp

    ranks = range(opts.first_rank, opts.first_rank + opts.workers)  # this node's, in the cluster's numbering
    names = [f"nebula-trainer-{opts.cluster_id}-{rank}" for rank in ranks]
    args = [(rank, opts, str(init_file), os.getpid()) for rank in ranks]
    if opts.rank_host is not None:
        try:
            host = RankHostClient(opts.rank_host)
        except (OSError, EOFError, mp.AuthenticationError) as err:
            log(opts, f"the rank host at '{opts.rank_host}' cannot be reached ({type(err).__name__}); the ranks start "
                "from this trainer's own fork server", error=True)
        else:
            return [HostedRank(host, name=name, args=a) for name, a in zip(names, args, strict=True)]
    ctx = mp.get_context("forkserver")  # torch, transformers and peft imported once, not once per rank and restart
    ctx.set_forkserver_preload(list(RANK_PRELOAD))
    return [ctx.Process(target=_rank, args=a, name=name) for name, a in zip(names, args, strict=True)]


def prepare_node(opts: TrainerOptions, *, devices: list[str], precision: str,
                 launcher: str | None = None) -> tuple[int, str]:
    """This machine's part before its ranks start: the state folder held (its lock's fd, kept for the trainer's
    life), the shard file; on node 0 the cluster's identity, ledger and policy checked. Returns (lock, start line)."""
    lock = _lock_state_dir(opts.state_dir, wait_s=opts.lock_wait_s)
    write_shard_file(opts)
    # the cluster's identity and roster are node 0's, whose rank 0 alone masks and answers (Boundary)
    secagg = (SecAggStage.for_policy(state_dir=opts.state_dir, cluster_id=opts.cluster_id, policy=opts.policy)
              if opts.node_rank == 0 else None)
    if opts.node_rank == 0 and socket_in_use(opts.socket_path):
        os.close(lock)
        raise NebulaError(f"another trainer already serves '{opts.socket_path}'; stop it first, or pass another --socket")
    ledger = ClusterLedger(path=opts.state_dir / LEDGER_FILE, accountant=opts.policy.accountant)  # readable, or exit 2
    opts.policy.save(opts.state_dir / POLICY_FILE)
    spent = {m: ledger.steps(mode=m) for m in ("sample", "client")}
    line = (
        f"trainer {opts.cluster_id}: {opts.workers} worker(s) on {'+'.join(devices)} "
        f"({precision}, parallel {opts.parallel}), {len(opts.shard)} examples, " + (
            f"node {opts.node_rank} of {opts.nnodes} (ranks {opts.first_rank}-{opts.first_rank + opts.workers - 1} "
            f"of {opts.world}, rendezvous {opts.rendezvous}), " if opts.nnodes > 1 else "")
        + (f"{launcher}, " if launcher else "")
        + (f"socket {opts.socket_path}" if opts.node_rank == 0 else "no socket (node 0 serves the cluster)")
        + f"; privacy policy: {opts.policy.mode}{budget_phrase(opts.policy)}; ledger {spent['sample']} sample-level "
        f"step(s), {spent['client']} client-level release(s) so far; "
        + (secagg.describe() if secagg else "secure aggregation: node 0's")
    )
    return lock, line


def run_trainer(opts: TrainerOptions) -> int:
    """Check everything, start the ranks and supervise them until a signal or a failure; returns the exit status."""
    devices, precision = check(opts)
    # Everything the trainer writes (keys, ledger, snapshots, replies) is its user's alone: the SuperNode's user, and
    # so whatever code might run as it, reaches the cluster through the socket only (ranks inherit the mask).
    os.umask(0o077)
    lock, line = prepare_node(opts, devices=devices, precision=precision)
    init_file = opts.state_dir / f".ddp-init-{os.getpid()}"
    init_file.unlink(missing_ok=True)
    procs = _rank_processes(opts, init_file)
    stopping: dict[str, Any] = {"signal": None}

    def _stop(signum, _frame):
        stopping["signal"] = signum

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    for p in procs:
        p.start()
    print(line, flush=True)
    try:
        status = _supervise(procs, stopping, cluster_id=opts.cluster_id)
    finally:
        _stop_ranks(procs)
        reap_multiprocessing_helpers()
        for path in (opts.socket_path, Path(f"{opts.socket_path}.key"), init_file):
            Path(path).unlink(missing_ok=True)
        os.close(lock)
    return status
