"""A cluster's round, as rank 0 runs it: the one place a cluster's data can leave, read top to bottom in `Release.run`.

Each stage is the twin of what the server (``server/app.py``: compression inside secure aggregation inside privacy)
does with it, and a reply is undone from the outside in:

* read, replay, riding: the request is parsed once (``round_request.py``); a round already released is answered
  with the very bytes it was sent (``ReplyCache``), the past is never trained again; the last round's unmask request
  riding on this one is answered (``SecAggWrapper``'s overlapped unmask).
* admit: the operator's masking demand, secure aggregation's checks (``SecAggWrapper`` unmasks only sums) and the
  privacy gate (policy and ledger) decide whether, and with which mechanism, the round runs (``PrivacyWrapper``
  reads a refusal and stops sampling the cluster).
* train: every rank trains and returns the raw delta (``ClusterTrainer.train_round``).
* privatize: client-level DP clips and noises the delta here, on rank 0 (``PrivacyWrapper``'s accountant, at the
  server's σ).
* encode: the uplink codec, error-feedback residual kept (``CompressionWrapper`` decodes it); it hands over the
  values the server will sum, so masking needs no decode.
* charge, persist: write-ahead, the release goes into the ledger (fsynced), then every rank keeps the round in a
  snapshot (``ClusterTrainer.commit``); a failure at either, or at encoding, drops the round on every rank, so no
  snapshot, restart or later round ever holds training the ledger does not cover.
* mask: a securely aggregated round's values leave only masked (``SecAggWrapper`` unmasks the sum). It comes after
  persist, as before: the stage records a round as masked, durably and once, so masking before the charge would
  make a round whose charge failed one the server could never ask again.
* reply: figures computed from the data stay here under DP; the frame is cached as sent. Every frame, replies and
  refusals alike, leaves through ``outgoing.released`` (under secure aggregation's rule or not).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nebula_fl.clients.exchange import privatize_update
from nebula_fl.clients.outgoing import PLAIN, released
from nebula_fl.clients.protocol import pack
from nebula_fl.clients.reply_cache import ReplyCache
from nebula_fl.clients.round_request import BadRequest, RoundRequest
from nebula_fl.clients.secagg_stage import SecAggRefusal
from nebula_fl.clients.trainer_options import TrainerOptions, log
from nebula_fl.errors import NebulaError
from nebula_fl.privacy.cluster_ledger import LEDGER_FILE, ClusterLedger
from nebula_fl.privacy.policy import refuse

ROUND = "round"  # rank 0's command to the other ranks: train this round
# Metrics computed from the private data and not covered by the DP guarantee: never sent under DP.
DATA_DEPENDENT = ("train-loss", "update-norm-before-clip", "clipped", "rank-divergence", "prox-term")
LINEAR_CODECS = ("none", "randk")  # the uplink chains whose values sum as the server unmasks them


class Answer(Exception):
    """Ends a round's pipeline early with this frame (a refusal, a replayed reply)."""

    def __init__(self, frame: bytes) -> None:
        super().__init__("a round answered early")
        self.frame = frame


@dataclass
class Round:
    """One train request on its way through `Release.run`: the request, and what each stage made of it."""

    request: RoundRequest
    plan: Any = None  # secure aggregation's plan for the round (clients/secagg_stage.py), when it is masked
    admission: Any = None  # the privacy gate's verdict
    update: dict[str, Any] = field(default_factory=dict)
    selected: np.ndarray | None = None  # the encoded update's values as the server sums them (what masking takes)
    metrics: dict[str, Any] = field(default_factory=dict)
    riding: dict[str, Any] = field(default_factory=dict)  # {"secagg": the last round's unmask answer}, overlapped
    failed: str | None = None  # why the round may not be kept (encoding or its charge failed): every rank drops it


class Release:
    """Rank 0's round pipeline: the only way anything computed from the cluster's data leaves it."""

    def __init__(self, *, opts: TrainerOptions, trainer: Any, secagg: Any) -> None:
        from nebula_fl.clients.privacy_gate import PrivacyGate

        self.opts, self.trainer, self.secagg = opts, trainer, secagg
        ledger = ClusterLedger(path=opts.state_dir / LEDGER_FILE, accountant=opts.policy.accountant)
        self.gate = PrivacyGate(policy=opts.policy, ledger=ledger, num_examples=len(opts.shard))
        self.cache = ReplyCache(root=opts.state_dir / "replies")

    def run(self, header: dict[str, Any]) -> bytes:
        """A round's path through the cluster, one named stage each; a stage that ends it raises `Answer`."""
        try:
            rnd = self._read(header)
            self._replayed(rnd)
            self._answer_riding(rnd)  # round-overlap: the last round's unmask, whatever becomes of this round
            self._admit(rnd)
            self._train(rnd)
            self._privatize(rnd)
            self._encode(rnd)
            self._charge(rnd)
            self._persist(rnd)
            self._mask(rnd)
            frame = self._reply(rnd)
        except Answer as answer:
            frame = answer.frame
        return released(frame, secure=self.secure(header.get("config")))

    def secure(self, config: Any) -> bool:
        """Whether what leaves about a round follows secure aggregation's rule: the round is masked, or the
        operator's policy demands masking (then every round does, masked or not)."""
        return self.opts.policy.require_secure_aggregation or (isinstance(config, dict) and "secagg-epoch" in config)

    def error(self, text: str, *, plain: bool) -> bytes:
        """An error frame; `plain`: the text is about the request alone and is said as it is. Otherwise (training,
        the ledger, masking: the cluster's own data and state) secure aggregation sends a fixed sentence instead,
        and the text is in the log."""
        log(self.opts, f"refused round: {text}", error=True)
        return pack({"ok": False, "error": text, **({PLAIN: True} if plain else {})})

    # -- the stages, in order --------------------------------------------------------------------
    def _read(self, header: dict[str, Any]) -> Round:
        """read: the request, parsed once (`RoundRequest`: a config object, a plain federation id, a round number)."""
        try:
            return Round(request=RoundRequest.parse(header))
        except BadRequest as err:
            raise Answer(self.error(str(err), plain=True)) from None

    def _replayed(self, rnd: Round) -> None:
        """replay: a round already released is answered with the very reply it was sent; the past is never
        trained again."""
        req = rnd.request
        cached = self.cache.get(req.federation, req.number)
        if cached:
            log(self.opts, f"round {req.number} of federation {req.federation} asked again: the reply it was sent, "
                           "from the cache")
            raise Answer(cached)
        if cached is not None:
            raise Answer(self.error(f"round {req.number} of federation {req.federation} was released already and its "
                                    "reply is no longer kept; a round is never released twice", plain=True))
        done = self.cache.released(req.federation)
        if done and done[-1] > req.number:
            raise Answer(self.error(f"round {req.number} of federation {req.federation} is older than round "
                                    f"{done[-1]}, which this cluster already released; it never trains the past "
                                    "again", plain=True))

    def _answer_riding(self, rnd: Round) -> None:
        """riding: `rnd.riding` is {"secagg": answer} when the request carries the last round's unmask request
        (round-overlap), else {}.

        Answered by the stage (its every check, `SecAggStage.answer_riding`) before this round is checked or
        trained, so a round refused by the policy or the gate still carries it back; a cached round is answered
        from the cache before this runs, with the answer it carried the first time."""
        riding = rnd.request.riding
        if riding is None:
            return
        answer = self.secagg.answer_riding(riding)
        said = riding if isinstance(riding, dict) else {}
        log(self.opts, f"round {said.get('round')}: unmask (riding) "
                       + (f"refused: {answer['refused']}" if "refused" in answer else
                          f"answered ({len(answer.get('self-from', []))} share(s))"))
        rnd.riding = {"secagg": answer}

    def _admit(self, rnd: Round) -> None:
        """admit: the operator's masking demand, the secure-aggregation checks, then the privacy gate (policy and
        ledger) decide whether, and with which mechanism, the round runs."""
        config = rnd.request.config
        if why := self.secagg.requirement_refusal(config):  # the operator demands masking: refused as its policy
            self._decline(rnd, refuse(why), "policy", data_free=True)
        if rnd.request.masked:  # a securely aggregated round: checked before anything is trained
            if config.get("local-steps") == "auto":
                # how many steps fit a time budget is a timing of this cluster's own, and under per-example DP (a
                # logical batch of n/8) it grows with n: a masked round never says it
                raise Answer(self.error("local-steps = \"auto\" under secure aggregation: a cluster's step count "
                                        "could tell its data size; use a fixed local-steps", plain=True))
            codec = rnd.request.codec_up or ""
            if len(codec.split("+")) != 1 or codec.split(":")[0] not in LINEAR_CODECS:
                # what is masked is the codec's values as the server sums them: only a linear chain's sum decodes
                raise Answer(self.error(f"secure aggregation needs a linear uplink codec ('none' or 'randk:RATIO'), "
                                        f"got {codec!r}", plain=True))
            try:
                rnd.plan = self.secagg.prepare(config)
            except (SecAggRefusal, ValueError, KeyError, TypeError) as err:
                raise Answer(self.error(f"secure aggregation: {err}", plain=True)) from None
        rnd.admission = self.gate.admit(config, world=self.opts.workers,
                                        secure_threshold=None if rnd.plan is None else rnd.plan.threshold)
        if not rnd.admission.allowed:
            self._decline(rnd, rnd.admission, rnd.admission.refusal)

    def _decline(self, rnd: Round, admission, why: str, *, data_free: bool = False) -> None:
        """A refused round's reply. Under secure aggregation (`released`) it follows the round replies' rule and the
        gate's reason (its δ, σ floor and ε figures come from the cluster's size) stays in the log; `data_free`: the
        reason names only the operator's requirement, said as it is."""
        log(self.opts, f"round {rnd.request.number} declined ({why}): {admission.reason}")
        metrics = self.gate.refusal(admission, federation=rnd.request.federation, cluster_id=self.opts.cluster_id)
        raise Answer(pack({"ok": True, "metrics": metrics, **rnd.riding, **({PLAIN: True} if data_free else {})}))

    def _train(self, rnd: Round) -> None:
        """train: every rank, from the global (or, overlapped, its own rebased weights and what it trained ahead);
        the ranks return the raw delta."""
        import torch.distributed as dist

        from nebula_fl.clients.trainer import RequestError

        req = rnd.request
        dist.broadcast_object_list([(ROUND, req.config, req.arrays, rnd.admission)], src=0,
                                   group=self.trainer.ctx.control)
        try:
            rnd.update, rnd.metrics = self.trainer.train_round(req.config, req.arrays, rnd.admission)
        except (RequestError, NebulaError) as err:  # e.g. "N examples for W workers": masked, only the fact leaves
            raise Answer(self.error(str(err), plain=False)) from None
        m = rnd.metrics
        cycle = m.get("since-send-seconds")
        busy = f", busy {m['busy-seconds'] / cycle:.0%} of {cycle:.1f} s since the last send" if cycle else ""
        log(self.opts, f"round {req.number}: loss {m['train-loss']:.4f}, {m['steps']} step(s), {m['seconds']:.1f} s"
                       f"{busy}, rank divergence {m['rank-divergence']:g}")

    def _privatize(self, rnd: Round) -> None:
        """privatize: client-level DP clips the delta to C and adds the admitted noise, fresh OS randomness each
        release (`exchange.privatize_update`)."""
        if rnd.admission.mode == "client":
            rnd.update, figures = privatize_update(rnd.update, rnd.admission)
            rnd.metrics.update(figures)

    def _encode(self, rnd: Round) -> None:
        """encode: the round's uplink codec, when it names one; a failure is `rnd.failed` (nothing is charged, and
        `_persist` drops the round on every rank)."""
        started = time.monotonic()
        if rnd.request.codec_up is not None:
            try:
                selection = self.trainer.encode_up(rnd.update, config=rnd.request.config)
            except (NebulaError, ValueError) as err:
                rnd.failed = str(err)
                return
            rnd.update = {"blob": np.frombuffer(selection.blob, dtype=np.uint8).copy()}
            rnd.selected = selection.values
        rnd.metrics["encode-seconds"] = float(time.monotonic() - started)
        rnd.metrics.update(self.trainer.uplink_metrics(rnd.update))

    def _charge(self, rnd: Round) -> None:
        """charge: the release goes into the ledger (fsynced) before the round is kept or anything leaves, with the
        steps actually taken (a time budget may take fewer than the gate admitted). A charge that fails, whatever
        the error, is `rnd.failed`: `_persist` then drops the round on every rank."""
        if rnd.failed:
            return
        req = rnd.request
        try:
            if rnd.admission.mode == "sample":
                rnd.admission = dataclasses.replace(rnd.admission, steps=int(rnd.metrics["steps"]))
            self.gate.charge(federation=req.federation, server_round=req.number, admission=rnd.admission)
        except Exception as err:  # a LedgerError, an OSError, anything: the round's training was not charged
            rnd.failed = (f"round {req.number} could not be charged to the privacy ledger ({err}); nothing was "
                          "released and the round is dropped")

    def _persist(self, rnd: Round) -> None:
        """persist: every rank snapshots the charged round, or drops it (`ClusterTrainer.commit`); what it did not
        keep never leaves."""
        from nebula_fl.clients.trainer import RequestError

        try:
            self.trainer.commit(failed=rnd.failed)
        except RequestError as err:
            raise Answer(self.error(str(err), plain=False)) from None

    def _mask(self, rnd: Round) -> None:
        """mask: a securely aggregated round's update leaves only masked: the encoded values (all of them, or
        random-k's), weighted; its reply says only what is harmless."""
        if rnd.plan is None:
            return
        weight = 1 if rnd.admission.mode == "client" else min(len(self.opts.shard), rnd.plan.code.max_weight)
        try:
            rnd.update = {"blob": self.secagg.mask(rnd.plan, values=rnd.selected, weight=weight)}
        except (SecAggRefusal, NebulaError, ValueError) as err:  # e.g. an update holding NaN: about the data
            raise Answer(self.error(str(err), plain=False)) from None
        rnd.metrics["secagg-keys-held"] = int(self.secagg.holds_keys(rnd.request.federation, rnd.plan.epoch))

    def _reply(self, rnd: Round) -> bytes:
        """reply: under DP the figures computed from the data stay here, under secure aggregation all but what
        `released` lets out; the frame is cached as it is sent, so a repeated request gets these very bytes."""
        metrics = rnd.metrics
        if rnd.admission.mode != "off":  # only the noised update is protected
            metrics = {k: v for k, v in metrics.items() if k not in DATA_DEPENDENT}
        req = rnd.request
        metrics.update(self.gate.metrics(rnd.admission, federation=req.federation))
        frame = released(pack({"ok": True, "metrics": metrics, **rnd.riding}, rnd.update), secure=self.secure(req.config))
        self.cache.put(req.federation, req.number, frame)  # a replay gets these bytes: the same unmask answer too
        return frame
