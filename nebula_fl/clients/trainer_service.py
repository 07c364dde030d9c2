"""A cluster's persistent trainer: `workers` torch.distributed ranks, rank 0 serving a Unix socket.

Started once per cluster beside its SuperNode (``nebula-fl trainer ...``), as its own user where the cluster
is deployed as documented (its state folder is that user's alone, the socket the one way in); it holds the
model weights, tokenised data and worker processes for the whole run, never per round. The parent process only supervises: if any rank dies it stops
the others and exits non-zero; on SIGTERM/SIGINT it stops them all and exits; if the parent itself
is killed, the kernel kills the ranks (parent-death signal).

Rank 0 is the cluster's boundary. Connections are handled on threads with I/O timeouts (a stalled
client holds nothing); `hello` is answered at once, even mid-round; `train` requests queue for the
ranks. Before a round reaches them, rank 0 answers a round already released from the reply cache,
refuses to train the past again, and asks the privacy gate (the operator's policy and the
cluster's own ledger) whether, and with which mechanism, the round may run. After training, write-ahead:
it records the release in the ledger (fsynced), then every rank keeps the round in a snapshot, then it
caches the reply and sends it; a failure at any step drops the round on every rank (``ClusterTrainer.commit``),
so no snapshot, restart or later round ever holds training the ledger does not cover. Every frame it sends,
replies and refusals alike, passes ``outgoing.released`` (what may leave the cluster, under secure aggregation
or not).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import AuthenticationError
from pathlib import Path
from typing import Any

# (IN_THE_CLEAR, IN_THE_CLEAR_CLIENT_DP and in_the_clear are importable from here too, as before outgoing.py)
from nebula_fl.clients.outgoing import IN_THE_CLEAR, IN_THE_CLEAR_CLIENT_DP, PLAIN, in_the_clear, released  # noqa: F401
from nebula_fl.clients.protocol import TrainerListener, pack, socket_in_use, unpack
from nebula_fl.clients.reply_cache import FEDERATION_ID, ReplyCache
from nebula_fl.clients.secagg_stage import SecAggRefusal, SecAggStage
from nebula_fl.data.datasets import TextDataset
from nebula_fl.devices import check_visible, resolve_precision, visible_gpus, worker_devices
from nebula_fl.errors import NebulaError
from nebula_fl.privacy.cluster_ledger import LEDGER_FILE, ClusterLedger
from nebula_fl.privacy.policy import POLICY_FILE, PrivacyPolicy, refuse

AHEAD, ROUND = "ahead", "round"  # rank 0's commands to the other ranks
CONTROL_TIMEOUT = timedelta(days=30)  # ranks >= 1 idle in a broadcast between rounds; rounds can be far apart
MAX_FRAME = 1 << 31
LOCK_FILE = "trainer.lock"
SHARD_FILE = "shard.json"  # the shard's size and labels: for the operator, never said on the socket
LOCK_WAIT_S = 30.0  # how long a trainer waits for the one before it on its state folder to stop
# Metrics computed from the private data and not covered by the DP guarantee: never sent under DP.
DATA_DEPENDENT = ("train-loss", "update-norm-before-clip", "clipped", "rank-divergence", "prox-term")
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


def describe(opts: TrainerOptions) -> dict[str, Any]:
    return {"cluster_id": opts.cluster_id, "workers": opts.workers, "device": opts.device, "precision": opts.precision,
            "parallel": opts.parallel, "privacy_mode": opts.policy.mode}


def write_shard_file(opts: TrainerOptions) -> Path:
    """The shard's size and label counts, for the operator (the launcher's start line), in the private state folder."""
    path = opts.state_dir / SHARD_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"cluster_id": opts.cluster_id, "num_examples": len(opts.shard),
                               "label_counts": opts.shard.label_counts()}))
    os.replace(tmp, path)
    return path


def _device_for(rank: int, opts: TrainerOptions):
    import torch

    return torch.device(worker_devices(opts.device, workers=opts.workers)[rank])


def _log(opts: TrainerOptions, text: str, *, error: bool = False) -> None:
    print(f"trainer {opts.cluster_id}: {text}", file=sys.stderr if error else sys.stdout, flush=True)


def _worker_main(rank: int, opts: TrainerOptions, init_file: str, parent: int) -> None:
    """Entry point of one rank (a spawned process)."""
    from nebula_fl.lifetime import die_with_parent

    die_with_parent(signal.SIGKILL, expected_parent=parent)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from nebula_fl.clients.trainer import ClusterTrainer, RequestError, WorkerContext

    torch.set_num_threads(opts.threads)
    device = _device_for(rank, opts)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=opts.workers)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    trainer = ClusterTrainer(
        WorkerContext(
            rank=rank, world=opts.workers, cluster_id=opts.cluster_id, device=device,
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
                trainer.commit()  # kept, or dropped, as rank 0's charge went (write-ahead)
            except RequestError:
                pass


class Answer(Exception):
    """Ends a round's pipeline early with this frame (a refusal, a replayed reply)."""

    def __init__(self, frame: bytes) -> None:
        super().__init__("a round answered early")
        self.frame = frame


@dataclass
class Round:
    """One train request on its way through the cluster's pipeline (``Boundary._train``)."""

    config: dict[str, Any]
    arrays: dict[str, Any]
    federation: str
    number: int
    plan: Any = None  # secure aggregation's plan for the round (clients/secagg_stage.py), when it is masked
    admission: Any = None  # the privacy gate's verdict
    update: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    riding: dict[str, Any] = field(default_factory=dict)  # {"secagg": the last round's unmask answer}, overlapped
    failed: str | None = None  # why the round's charge failed: the ranks drop it instead of keeping it


class Boundary:
    """Rank 0: the only way into the cluster, and the only way anything leaves it."""

    def __init__(self, opts: TrainerOptions, trainer) -> None:
        from nebula_fl.clients.privacy_gate import PrivacyGate

        self.opts, self.trainer = opts, trainer
        ledger = ClusterLedger(path=opts.state_dir / LEDGER_FILE, accountant=opts.policy.accountant)
        self.gate = PrivacyGate(policy=opts.policy, ledger=ledger, num_examples=len(opts.shard))
        self.cache = ReplyCache(root=opts.state_dir / "replies")
        self.secagg = SecAggStage.for_policy(state_dir=opts.state_dir, cluster_id=opts.cluster_id, policy=opts.policy)
        self.jobs: queue.Queue = queue.Queue()

    # -- connections (threads) -------------------------------------------------------------------
    def serve(self, listener: TrainerListener) -> None:
        threading.Thread(target=self._accept_loop, args=(listener,), daemon=True, name="accept").start()
        while True:
            conn, header = self._next_job()
            with conn:
                frame = self._train(header)
                try:
                    conn.send_bytes(frame)
                except OSError as err:
                    _log(self.opts, f"could not send the reply (the ClientApp went away: {err}); it stays cached",
                         error=True)

    def _next_job(self) -> tuple[Any, dict[str, Any]]:
        """The next request; while none is waiting and the last round overlaps, the ranks train the next round's
        steps ahead (clients/overlap.py): a GPU is not left idle through the network's hops."""
        import torch.distributed as dist

        while count := self.trainer.wants_ahead():
            try:
                return self.jobs.get_nowait()
            except queue.Empty:
                pass
            dist.broadcast_object_list([(AHEAD, count)], src=0, group=self.trainer.ctx.control)
            self.trainer.train_ahead(count)
        return self.jobs.get()

    def _accept_loop(self, listener: TrainerListener) -> None:
        while True:
            try:
                raw = listener.accept_raw()
            except OSError as err:
                _log(self.opts, f"accept failed: {err}", error=True)
                time.sleep(0.1)
                continue
            threading.Thread(target=self._handle, args=(listener, raw), daemon=True, name="connection").start()

    def _handle(self, listener: TrainerListener, raw) -> None:
        try:
            conn = listener.handshake(raw)
        except (AuthenticationError, OSError, EOFError) as err:  # a wrong key, or a client that stalls or hangs up
            _log(self.opts, f"refused a connection: {err or type(err).__name__}", error=True)
            raw.close()
            return
        try:
            header, arrays = unpack(conn.recv_bytes(MAX_FRAME))
        except (EOFError, OSError, ValueError) as err:
            _log(self.opts, f"unreadable request: {err or type(err).__name__}", error=True)
            conn.close()
            return
        op = header.get("op")
        if op == "train":
            self.jobs.put((conn, {**header, "arrays": arrays}))  # answered by the ranks' thread, in order
            return
        if op == "hello":
            frame = pack({"ok": True, **self.describe()})
        elif op == "secagg":
            frame = self._secagg(header.get("request"))
        else:
            frame = self._error(f"unknown op {op!r}", plain=True)
        with conn:
            try:  # neither says anything of the data: held to secure aggregation's rule whatever the round
                conn.send_bytes(released(frame, secure=True))
            except OSError:
                pass

    def describe(self) -> dict[str, Any]:
        """`hello`: who answers, on what hardware, under which policy mode: only what IN_THE_CLEAR lets any reply say.
        Whoever reaches the socket (the SuperNode's user, so what the server sees) learns nothing of the data: the
        shard's size and labels are in the state folder (SHARD_FILE), for the operator alone."""
        return describe(self.opts)

    def _secagg(self, request: Any) -> bytes:
        """A secure-aggregation setup or unmasking request (answered on the connection's thread)."""
        if not isinstance(request, dict):
            return self._error("the secure-aggregation request is not an object", plain=True)
        try:
            reply = self.secagg.handle(request)
        except (SecAggRefusal, ValueError, KeyError, TypeError) as err:
            return self._error(f"secure aggregation ({request.get('stage')}): {err}", plain=True)
        if request.get("stage") in ("unmask", "recover"):
            _log(self.opts, f"round {request.get('round')}: {request.get('stage')} answered "
                            f"({len(reply.get('self-from', reply.get('key-from', [])))} share(s))")
        return pack({"ok": True, "reply": reply})

    # -- rounds (the ranks' thread) --------------------------------------------------------------
    def _error(self, text: str, *, plain: bool) -> bytes:
        """An error frame; `plain`: the text is about the request alone and is said as it is. Otherwise (training,
        the ledger, masking: the cluster's own data and state) secure aggregation sends a fixed sentence instead,
        and the text is in the log."""
        _log(self.opts, f"refused round: {text}", error=True)
        return pack({"ok": False, "error": text, **({PLAIN: True} if plain else {})})

    def _secure(self, config: Any) -> bool:
        """Whether what leaves about a round follows secure aggregation's rule: the round is masked, or the
        operator's policy demands masking (then every round does, masked or not)."""
        return self.opts.policy.require_secure_aggregation or (isinstance(config, dict) and "secagg-epoch" in config)

    def _train(self, header: dict[str, Any]) -> bytes:
        """A round's path through the cluster, one named step each; a step that ends it raises `Answer`. Whatever
        the frame, it leaves through `released`."""
        try:
            rnd = self._read(header)
            self._replayed(rnd)
            rnd.riding = self._answer_riding(header)  # round-overlap: the last round's unmask, whatever becomes of this
            self._admit(rnd)
            self._train_on_ranks(rnd)
            self._charge(rnd)
            self._keep(rnd)
            self._mask(rnd)
            frame = self._reply(rnd)
        except Answer as answer:
            frame = answer.frame
        return released(frame, secure=self._secure(header.get("config")))

    def _read(self, header: dict[str, Any]) -> Round:
        """read: a config object, a federation id that can name a folder, a round number."""
        config, arrays = header.get("config"), header.get("arrays", {})
        if not isinstance(config, dict):
            raise Answer(self._error("the request has no config object", plain=True))
        fed, number = config.get("federation-id"), config.get("server-round")
        if not isinstance(fed, str) or not FEDERATION_ID.fullmatch(fed):
            raise Answer(self._error(f"federation id {fed!r} is not a plain name of letters, digits, '-' and '_'",
                                     plain=True))
        if isinstance(number, bool) or not isinstance(number, int) or number < 1:
            raise Answer(self._error(f"server-round {number!r} is not a round number (an integer >= 1)", plain=True))
        return Round(config=config, arrays=arrays, federation=fed, number=number)

    def _replayed(self, rnd: Round) -> None:
        """replay: a round already released is answered with the very reply it was sent; the past is never
        trained again."""
        cached = self.cache.get(rnd.federation, rnd.number)
        if cached:
            _log(self.opts, f"round {rnd.number} of federation {rnd.federation} asked again: the reply it was sent, "
                            "from the cache")
            raise Answer(cached)
        if cached is not None:
            raise Answer(self._error(f"round {rnd.number} of federation {rnd.federation} was released already and its "
                                     "reply is no longer kept; a round is never released twice", plain=True))
        done = self.cache.released(rnd.federation)
        if done and done[-1] > rnd.number:
            raise Answer(self._error(f"round {rnd.number} of federation {rnd.federation} is older than round "
                                     f"{done[-1]}, which this cluster already released; it never trains the past "
                                     "again", plain=True))

    def _admit(self, rnd: Round) -> None:
        """admit: the operator's masking demand, the secure-aggregation checks, then the privacy gate (policy and
        ledger) decide whether, and with which mechanism, the round runs."""
        config = rnd.config
        if why := self.secagg.requirement_refusal(config):  # the operator demands masking: refused as its policy
            self._decline(rnd, refuse(why), "policy", data_free=True)
        if "secagg-epoch" in config:  # a securely aggregated round: checked before anything is trained
            if config.get("local-steps") == "auto":
                # how many steps fit a time budget is a timing of this cluster's own, and under per-example DP (a
                # logical batch of n/8) it grows with n: a masked round never says it
                raise Answer(self._error("local-steps = \"auto\" under secure aggregation: a cluster's step count "
                                         "could tell its data size; use a fixed local-steps", plain=True))
            try:
                rnd.plan = self.secagg.prepare(config)
            except (SecAggRefusal, ValueError, KeyError, TypeError) as err:
                raise Answer(self._error(f"secure aggregation: {err}", plain=True)) from None
        rnd.admission = self.gate.admit(config, world=self.opts.workers,
                                        secure_threshold=None if rnd.plan is None else rnd.plan.threshold)
        if not rnd.admission.allowed:
            self._decline(rnd, rnd.admission, rnd.admission.refusal)

    def _decline(self, rnd: Round, admission, why: str, *, data_free: bool = False) -> None:
        """A refused round's reply. Under secure aggregation (`released`) it follows the round replies' rule and the
        gate's reason (its δ, σ floor and ε figures come from the cluster's size) stays in the log; `data_free`: the
        reason names only the operator's requirement, said as it is."""
        _log(self.opts, f"round {rnd.number} declined ({why}): {admission.reason}")
        metrics = self.gate.refusal(admission, federation=rnd.federation, cluster_id=self.opts.cluster_id)
        raise Answer(pack({"ok": True, "metrics": metrics, **rnd.riding, **({PLAIN: True} if data_free else {})}))

    def _train_on_ranks(self, rnd: Round) -> None:
        """train: every rank, from the global (or, overlapped, its own rebased weights and what it trained ahead)."""
        import torch.distributed as dist

        from nebula_fl.clients.trainer import RequestError

        dist.broadcast_object_list([(ROUND, rnd.config, rnd.arrays, rnd.admission)], src=0,
                                   group=self.trainer.ctx.control)
        try:
            rnd.update, rnd.metrics = self.trainer.train_round(rnd.config, rnd.arrays, rnd.admission)
        except (RequestError, NebulaError) as err:  # e.g. "N examples for W workers": masked, only the fact leaves
            raise Answer(self._error(str(err), plain=False)) from None
        m = rnd.metrics
        cycle = m.get("since-send-seconds")
        busy = f", busy {m['busy-seconds'] / cycle:.0%} of {cycle:.1f} s since the last send" if cycle else ""
        _log(self.opts, f"round {rnd.number}: loss {m['train-loss']:.4f}, {m['steps']} step(s), {m['seconds']:.1f} s"
                        f"{busy}, rank divergence {m['rank-divergence']:g}")

    def _charge(self, rnd: Round) -> None:
        """charge: the release goes into the ledger (fsynced) before the round is kept or anything leaves, with the
        steps actually taken (a time budget may take fewer than the gate admitted). A charge that fails, whatever
        the error, is `rnd.failed`: `_keep` then drops the round on every rank."""
        try:
            if rnd.admission.mode == "sample":
                rnd.admission = dataclasses.replace(rnd.admission, steps=int(rnd.metrics["steps"]))
            self.gate.charge(federation=rnd.federation, server_round=rnd.number, admission=rnd.admission)
        except Exception as err:  # a LedgerError, an OSError, anything: the round's training was not charged
            rnd.failed = (f"round {rnd.number} could not be charged to the privacy ledger ({err}); nothing was "
                          "released and the round is dropped")

    def _keep(self, rnd: Round) -> None:
        """keep: every rank snapshots the charged round, or drops it (`ClusterTrainer.commit`); what it did not
        keep never leaves."""
        from nebula_fl.clients.trainer import RequestError

        try:
            self.trainer.commit(failed=rnd.failed)
        except RequestError as err:
            raise Answer(self._error(str(err), plain=False)) from None

    def _mask(self, rnd: Round) -> None:
        """mask: a securely aggregated round's update leaves only masked, its reply says only what is harmless."""
        if rnd.plan is None:
            return
        try:
            rnd.update = {"blob": self._masked(rnd.plan, rnd.config, rnd.update, rnd.admission)}
        except (SecAggRefusal, NebulaError, ValueError) as err:  # e.g. an update holding NaN: about the data
            raise Answer(self._error(str(err), plain=False)) from None
        rnd.metrics["secagg-keys-held"] = int(self.secagg.holds_keys(rnd.federation, rnd.plan.epoch))

    def _reply(self, rnd: Round) -> bytes:
        """cache and reply: under DP the figures computed from the data stay here, under secure aggregation all
        but what `released` lets out; the frame is cached as it is sent, so a repeated request gets these very
        bytes."""
        metrics = rnd.metrics
        if rnd.admission.mode != "off":  # only the noised update is protected
            metrics = {k: v for k, v in metrics.items() if k not in DATA_DEPENDENT}
        metrics.update(self.gate.metrics(rnd.admission, federation=rnd.federation))
        frame = released(pack({"ok": True, "metrics": metrics, **rnd.riding}, rnd.update),
                         secure=self._secure(rnd.config))
        self.cache.put(rnd.federation, rnd.number, frame)  # a replay gets these bytes: the same unmask answer too
        return frame

    def _answer_riding(self, header: dict[str, Any]) -> dict[str, Any]:
        """{"secagg": answer} when the request carries the last round's unmask request (round-overlap), else {}.

        Answered by the stage (its every check, `SecAggStage.answer_riding`) before this round is checked or
        trained, so a round refused by the policy or the gate still carries it back; a cached round is answered
        from the cache before this runs, with the answer it carried the first time."""
        if header.get("secagg") is None:
            return {}
        answer = self.secagg.answer_riding(header["secagg"])
        request = header["secagg"] if isinstance(header["secagg"], dict) else {}
        _log(self.opts, f"round {request.get('round')}: unmask (riding) "
                        + (f"refused: {answer['refused']}" if "refused" in answer else
                           f"answered ({len(answer.get('self-from', []))} share(s))"))
        return {"secagg": answer}

    def _masked(self, plan, config: dict[str, Any], update: dict[str, Any], admission) -> Any:
        """The encoded update's coordinates (all of them, or random-k's), weighted, masked and packed."""
        from nebula_fl.compression import Compressor
        from nebula_fl.compression.randk import RandK

        seed = int(config["codec-seed"])
        dense = Compressor.decode(update["blob"].tobytes(), layout=self.trainer.layout, seed=seed)
        first = self.trainer.up.stages[0]
        values = dense[first.positions(dense.size, seed)] if isinstance(first, RandK) else dense
        weight = 1 if admission.mode == "client" else min(len(self.opts.shard), plan.code.max_weight)
        return self.secagg.mask(plan, values=values, weight=weight)


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


def run_trainer(opts: TrainerOptions) -> int:
    """Check everything, start the ranks and supervise them until a signal or a failure; returns the exit status."""
    import multiprocessing as mp

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
    if len(opts.shard) < opts.workers:
        raise NebulaError(f"cluster {opts.cluster_id} has {len(opts.shard)} examples for {opts.workers} workers")
    devices = worker_devices(opts.device, workers=opts.workers)
    if devices[0] != "cpu":  # (torch is imported only to count GPUs)
        check_visible(devices, visible=visible_gpus())
    precision = resolve_precision(opts.precision, device_kind=devices[0].split(":")[0], privacy_mode=opts.policy.mode)
    opts.policy.check_for(len(opts.shard))
    # Everything the trainer writes (keys, ledger, snapshots, replies) is its user's alone: the SuperNode's user, and
    # so whatever code might run as it, reaches the cluster through the socket only (ranks inherit the mask).
    os.umask(0o077)
    lock = _lock_state_dir(opts.state_dir, wait_s=opts.lock_wait_s)
    write_shard_file(opts)
    secagg = SecAggStage.for_policy(state_dir=opts.state_dir, cluster_id=opts.cluster_id, policy=opts.policy)
    if socket_in_use(opts.socket_path):
        raise NebulaError(f"another trainer already serves '{opts.socket_path}'; stop it first, or pass another --socket")
    ledger = ClusterLedger(path=opts.state_dir / LEDGER_FILE, accountant=opts.policy.accountant)  # readable, or exit 2
    opts.policy.save(opts.state_dir / POLICY_FILE)
    init_file = opts.state_dir / f".ddp-init-{os.getpid()}"
    init_file.unlink(missing_ok=True)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_worker_main, args=(rank, opts, str(init_file), os.getpid()),
                    name=f"nebula-trainer-{opts.cluster_id}-{rank}")
        for rank in range(opts.workers)
    ]
    stopping = {"signal": None}

    def _stop(signum, _frame):
        stopping["signal"] = signum

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    for p in procs:
        p.start()
    budget = budget_phrase(opts.policy)
    spent = {m: ledger.steps(mode=m) for m in ("sample", "client")}
    print(
        f"trainer {opts.cluster_id}: {opts.workers} worker(s) on {'+'.join(devices)} "
        f"({precision}, parallel {opts.parallel}), {len(opts.shard)} examples, "
        f"socket {opts.socket_path}; privacy policy: {opts.policy.mode}{budget}; ledger {spent['sample']} sample-level "
        f"step(s), {spent['client']} client-level release(s) so far; {secagg.describe()}",
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
        os.close(lock)
    return status
