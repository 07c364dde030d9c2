"""An in-process federation for secure-aggregation protocol tests: the real server wrapper stack and the
real cluster stages, joined by a Grid that delivers Flower messages in memory (the transport is the only
stand-in). Each cluster's update is a fixed vector it encodes with the round's codec, as its trainer would."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.message.message import make_message

from nebula_fl.clients.secagg_stage import SecAggRefusal, SecAggStage
from nebula_fl.compression import Compressor, Layout
from nebula_fl.compression.randk import RandK
from nebula_fl.config import SecAggConfig
from nebula_fl.secagg.identity import Identity
from nebula_fl.strategies.compression import CompressionWrapper
from nebula_fl.strategies.fedavg import AdapterFedAvg
from nebula_fl.strategies.secure_aggregation import SecAggWrapper
from tests.conftest import as_installed


@dataclass
class FakeCluster:
    cid: int
    stage: SecAggStage
    update: dict[str, np.ndarray]
    weight: int
    drop_before_upload: set[int] = field(default_factory=set)  # rounds it never answers the train message
    drop_after_upload: set[int] = field(default_factory=set)  # rounds it uploads, then goes silent
    silent_stages: set[str] = field(default_factory=set)  # setup / unmask stages it never answers
    log: list[str] = field(default_factory=list)
    tamper: Any = None  # a function (cluster, request) -> request, to corrupt what it is sent
    tamper_reply: Any = None  # a function (cluster, request, reply) -> reply, to corrupt what it answers
    refuse_rounds: set[int] = field(default_factory=set)  # rounds its privacy gate declines (a refusal reply)
    riding: list[dict[str, Any]] = field(default_factory=list)  # the unmask requests that rode on its train messages
    lose_riding: set[int] = field(default_factory=set)  # held rounds whose riding request its reply leaves unanswered

    def answer(self, msg: Message, layout: Layout) -> Message | None:
        kind = msg.metadata.message_type
        rnd_cfg = dict(msg.content.config_records["config"]) if "config" in msg.content.config_records else {}
        rnd = rnd_cfg.get("server-round")
        if kind == "query":
            return Message(RecordDict({"metrics": MetricRecord({"cluster-id": self.cid})}), reply_to=msg)
        if kind == "train":
            if rnd in self.drop_before_upload:
                return None
            answer = self._answer_riding(msg)  # as the trainer: before the round is checked, refused or trained
            reply = self._train(msg, rnd_cfg, layout)
            if answer is not None and not reply.has_error():
                reply.content["secagg"] = ConfigRecord(answer)
            return reply
        request = dict(msg.content.config_records["secagg"])
        if request.get("stage") in ("unmask", "recover") and request.get("round") in self.drop_after_upload:
            return None
        if request.get("stage") in self.silent_stages:
            return None
        if self.tamper is not None:
            request = self.tamper(self, request)
        try:
            reply = self.stage.handle(request)
        except SecAggRefusal as err:
            self.log.append(str(err))
            return _error(msg, str(err))
        if self.tamper_reply is not None:
            reply = self.tamper_reply(self, request, dict(reply))
        return Message(RecordDict({"secagg": ConfigRecord(reply)}), reply_to=msg)

    def _answer_riding(self, msg: Message) -> dict[str, Any] | None:
        """The answer to the unmask request riding on a train message (round-overlap), by the stage's own
        `answer_riding`; None (no answer in the reply) when it goes silent after uploading that round."""
        if "secagg" not in msg.content.config_records:
            return None
        request = dict(msg.content.config_records["secagg"])
        self.riding.append(request)
        if request.get("round") in self.drop_after_upload | self.lose_riding or "unmask" in self.silent_stages:
            return None
        if self.tamper is not None:
            request = self.tamper(self, request)
        answer = self.stage.answer_riding(request)
        if "refused" in answer:
            self.log.append(answer["refused"])
        elif self.tamper_reply is not None:
            answer = self.tamper_reply(self, request, dict(answer))
        return answer

    def _train(self, msg: Message, cfg: dict[str, Any], layout: Layout) -> Message:
        if cfg.get("server-round") in self.refuse_rounds:  # declined as its privacy gate would: said, not an error
            metrics = {"cluster-id": self.cid, "privacy-refused": 1}
            return Message(RecordDict({"update": ArrayRecord({}), "metrics": MetricRecord(metrics),
                                       "notes": ConfigRecord({"privacy-refusal": "policy",
                                                              "privacy-reason": "declined in the test"})}),
                           reply_to=msg)
        try:
            plan = self.stage.prepare(cfg)
        except SecAggRefusal as err:
            self.log.append(str(err))
            return _error(msg, str(err))
        seed = int(cfg["codec-seed"])
        flat = layout.flatten(self.update)
        comp = Compressor(str(cfg["codec-up"]), layout=layout)
        dense = Compressor.decode(comp.encode(flat, seed=seed), layout=layout, seed=seed)
        first = comp.stages[0]
        values = dense[first.positions(dense.size, seed)] if isinstance(first, RandK) else dense
        blob = self.stage.mask(plan, values=values, weight=self.weight)
        content = RecordDict({
            "update": ArrayRecord({"blob": Array(blob)}),
            "metrics": MetricRecord({"cluster-id": self.cid, "secagg-keys-held":
                                     int(self.stage.holds_keys(plan.federation, plan.epoch))}),
        })
        return Message(content, reply_to=msg)


def _error(msg: Message, reason: str) -> Message:
    from flwr.app import Error

    return Message(Error(code=0, reason=reason), reply_to=msg)


class FakeGrid:
    """push/pull/get_node_ids over in-memory clusters (node id = 100 + cluster id)."""

    def __init__(self, clusters: list[FakeCluster], layout: Layout) -> None:
        self.clusters = {100 + c.cid: c for c in clusters}
        self.layout = layout
        self.replies: dict[str, Message] = {}
        self.ids = itertools.count(1)
        self.sent: list[Message] = []

    def get_node_ids(self):
        return list(self.clusters)

    def push_messages(self, messages):
        out = []
        for m in messages:
            mid = f"m{next(self.ids)}"
            m.metadata.__dict__["_message_id"] = mid
            stamped = make_message(metadata=m.metadata, content=m.content)
            self.sent.append(stamped)
            reply = as_installed(self.clusters[m.metadata.dst_node_id].answer(stamped, self.layout))
            if reply is not None:
                reply.metadata.__dict__["_src_node_id"] = m.metadata.dst_node_id
                reply.metadata.__dict__["_reply_to_message_id"] = mid
                self.replies[mid] = reply
            out.append(mid)
        return out

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]


def make_federation(tmp: Path, *, n: int, shapes: dict[str, tuple[int, ...]], codec: str = "none",
                    cfg: SecAggConfig | None = None, seed: int = 0, weights: list[int] | None = None,
                    privacy: Any = False):
    """(wrapper, clusters, grid, layout, initial); `privacy` (True or a PrivacyConfig): the wrapper is the privacy
    wrapper around secure aggregation, as in a run (refusals, the client-level accountant)."""
    rng = np.random.default_rng(seed)
    layout = Layout.from_shapes(shapes)
    initial = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    roster = {str(i): Identity.load_or_create(tmp / f"c{i}" / "secagg").public for i in range(n)}  # operators' lines
    clusters = [FakeCluster(cid=i, stage=SecAggStage(state_dir=tmp / f"c{i}", cluster_id=i, roster=roster),
                            update={k: rng.normal(0, 0.01, s).astype(np.float32) for k, s in shapes.items()},
                            weight=(weights or [10 * (i + 1) for i in range(n)])[i])
                for i in range(n)]
    inner = AdapterFedAvg(lr=1.0)
    compressed = CompressionWrapper(inner, codec_up=codec, codec_down="none", seed=seed, initial=initial)
    wrapper = SecAggWrapper(compressed, cfg=cfg or SecAggConfig(enabled=True), codec=codec)
    outer = wrapper
    if privacy:
        from nebula_fl.config import PrivacyConfig
        from nebula_fl.strategies.privacy import PrivacyWrapper

        outer = PrivacyWrapper(wrapper, cfg=PrivacyConfig() if privacy is True else privacy, num_rounds=10, clusters=n)
    outer.set_min_updates(1)
    return outer, clusters, FakeGrid(clusters, layout), layout, initial


def run_round(wrapper, grid: FakeGrid, rnd: int, arrays: dict[str, np.ndarray], **config: Any):
    """configure, deliver, aggregate one round as the loop does; returns (new arrays or None, metrics).
    `config`: more keys of the round's config record (e.g. round_overlap=True, num_server_rounds=3)."""
    from nebula_fl.strategies.adapter_strategy import to_record

    wrapper.identify(grid, timeout=5, poll_interval=0.01)
    config = ConfigRecord({"federation-id": "fed1", "server-round": rnd,
                           **{k.replace("_", "-"): v for k, v in config.items()}})
    messages = wrapper.configure_train(rnd, to_record(arrays), config, grid)
    replies, traffic = wrapper.exchange(grid, messages, timeout=2, poll_interval=0.01)
    wrapper.inner.destinations = wrapper.destinations
    result = wrapper.aggregate_train(rnd, replies)
    wrapper.observe_traffic(traffic)
    return result, traffic
