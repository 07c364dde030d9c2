"""One rank of a cluster's trainer: a torch.distributed process holding the model and its part of the shard.

Rank 0 is the cluster's boundary (`Boundary`): its socket (``trainer_socket.py``) is the only way in, and a
round's pipeline (``release.py``: admit, train, privatize, encode, charge, persist, mask, reply) the only way
anything computed from the data leaves. `hello` and secure aggregation's setup and unmasking are answered at
once, even mid-round; `train` requests queue for the ranks, which train ahead between them when the last round
overlaps. The other ranks follow rank 0's commands.
"""

from __future__ import annotations

import os
import queue
import signal
from datetime import timedelta
from typing import Any

from nebula_fl.clients.protocol import TrainerListener, pack
from nebula_fl.clients.release import Release
from nebula_fl.clients.secagg_stage import SecAggRefusal, SecAggStage
from nebula_fl.clients.trainer_options import TrainerOptions, describe, log
from nebula_fl.clients.trainer_socket import TrainerSocket
from nebula_fl.devices import worker_devices

AHEAD = "ahead"  # rank 0's command to the other ranks between rounds (ROUND, release.py: a round to train)
CONTROL_TIMEOUT = timedelta(days=30)  # ranks >= 1 idle in a broadcast between rounds; rounds can be far apart


def _device_for(rank: int, opts: TrainerOptions):
    """This rank's device, by its place on its own node."""
    import torch

    return torch.device(worker_devices(opts.device, workers=opts.workers)[rank - opts.first_rank])


def _init_method(opts: TrainerOptions, init_file: str) -> str:
    """One node: a file in the state folder. Several: the c10d TCP store on node 0 (torch.distributed's own
    rendezvous, as torchrun's static one)."""
    return f"file://{init_file}" if opts.nnodes == 1 else f"tcp://{opts.rendezvous}"


def gloo_interface(opts: TrainerOptions) -> None:
    """Gloo's interface, unless the operator set one: loopback on one node, else the one that reaches node 0."""
    if opts.nnodes == 1:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        return
    host, _, port = opts.rendezvous.rpartition(":")
    if "GLOO_SOCKET_IFNAME" not in os.environ and (name := interface_towards(host, int(port))):
        os.environ["GLOO_SOCKET_IFNAME"] = name


def interface_towards(host: str, port: int) -> str | None:
    """The network interface this machine reaches `host` through (a UDP socket's route: nothing is sent)."""
    import socket

    import psutil

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            local = probe.getsockname()[0]
    except OSError:
        return None
    return next((name for name, addrs in psutil.net_if_addrs().items() for a in addrs if a.address == local), None)


def rank_main(rank: int, opts: TrainerOptions, init_file: str, supervisor: int, *, store: Any = None) -> None:
    """Entry point of one rank, forked by the supervisor's fork server (``trainer_service.run_trainer``), or a
    worker torchrun started (``torchrun.py``: `store` is where torchrun's workers meet, `supervisor` its agent)."""
    from nebula_fl.lifetime import die_with_process

    die_with_process(supervisor, signal.SIGKILL)  # even by SIGKILL: no rank outlives its trainer
    gloo_interface(opts)
    init_method = _init_method(opts, init_file) if store is None else None
    import torch
    import torch.distributed as dist

    from nebula_fl.clients.trainer import ClusterTrainer, RequestError, WorkerContext

    torch.set_num_threads(opts.threads)
    device = _device_for(rank, opts)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # A rank that dies ends the others' collectives at once (its connections close), on any node; a node cut off
    # without a word ends them after torch.distributed's default timeout (30 min for gloo): never a hang.
    dist.init_process_group(backend, init_method=init_method, store=store, rank=rank, world_size=opts.world)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    trainer = ClusterTrainer(
        WorkerContext(
            rank=rank, world=opts.world, cluster_id=opts.cluster_id, device=device,
            model_path=opts.model_path, shard=opts.shard, state_dir=opts.state_dir, control=control,
            slowdown=opts.slowdown, precision=opts.precision, parallel=opts.parallel,
        )
    )
    if rank == 0:
        Boundary(opts, trainer).serve(TrainerListener(opts.socket_path, group=opts.socket_group))
    else:
        while True:  # rank 0's commands: a round to train, or steps to train ahead between rounds
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=control)
            if box[0][0] == AHEAD:
                trainer.train_ahead(box[0][1])
                continue
            _, config, arrays, admission = box[0]
            try:
                trainer.train_round(config, arrays, admission)
                trainer.commit()  # kept, or dropped, as rank 0's encoding and charge went (write-ahead)
            except RequestError:
                pass


class Boundary:
    """Rank 0: the socket (the only way in), the round pipeline (the only way out), and the answers given at once
    (`hello`; secure aggregation's setup and unmasking, on the connection's thread)."""

    def __init__(self, opts: TrainerOptions, trainer) -> None:
        self.opts, self.trainer = opts, trainer
        secagg = SecAggStage.for_policy(state_dir=opts.state_dir, cluster_id=opts.cluster_id, policy=opts.policy)
        self.release = Release(opts=opts, trainer=trainer, secagg=secagg)
        self.socket = TrainerSocket(opts=opts, answer_now=self._answer_now)

    def serve(self, listener: TrainerListener) -> None:
        self.socket.start(listener)
        while True:
            conn, header = self._next_job()
            self.socket.reply(conn, self.release.run(header))

    def _next_job(self) -> tuple[Any, dict[str, Any]]:
        """The next request; while none is waiting and the last round overlaps, the ranks train the next round's
        steps ahead (clients/overlap.py): a GPU is not left idle through the network's hops."""
        import torch.distributed as dist

        while count := self.trainer.wants_ahead():
            try:
                return self.socket.jobs.get_nowait()
            except queue.Empty:
                pass
            dist.broadcast_object_list([(AHEAD, count)], src=0, group=self.trainer.ctx.control)
            self.trainer.train_ahead(count)
        return self.socket.jobs.get()

    def _answer_now(self, op: Any, header: dict[str, Any]) -> bytes:
        """Any op but `train`: `hello` says only what IN_THE_CLEAR lets any reply say (`describe`)."""
        if op == "hello":
            return pack({"ok": True, **describe(self.opts)})
        if op == "secagg":
            return self._secagg(header.get("request"))
        return self.release.error(f"unknown op {op!r}", plain=True)

    def _secagg(self, request: Any) -> bytes:
        """A secure-aggregation setup or unmasking request."""
        if not isinstance(request, dict):
            return self.release.error("the secure-aggregation request is not an object", plain=True)
        try:
            reply = self.release.secagg.handle(request)
        except (SecAggRefusal, ValueError, KeyError, TypeError) as err:
            return self.release.error(f"secure aggregation ({request.get('stage')}): {err}", plain=True)
        if request.get("stage") in ("unmask", "recover"):
            log(self.opts, f"round {request.get('round')}: {request.get('stage')} answered "
                           f"({len(reply.get('self-from', reply.get('key-from', [])))} share(s))")
        return pack({"ok": True, "reply": reply})
