"""Secure aggregation as a wrapper: the server unmasks only the sum of a round's surviving clusters.

SecAgg+ (Bell et al. 2020) with the consistency check of Bonawitz et al. 2017, each round its own instance,
its round trips cut to the bone. Once per key epoch (the first round, and again only when a sampled cluster is
not a member or would have fewer than t of its share holders in the round), two setup trips: `keys` (each
cluster's channel key and its mask key of the round, signed with its identity key and the round) and `share`
(the members, their keys and signatures; each cluster checks them against its roster and returns its mask
key's Shamir shares sealed to its neighbours, which this wrapper forwards inside the next train messages).
Every round is then the plain round, in which each cluster uploads its masked (w·x, w) with its self-mask
seed's shares sealed to its neighbours, commitments, a signed receipt and its mask key of the NEXT round
(signed with that round, shares sealed to its neighbours): this wrapper names each member's key of the round
on the train messages and forwards the key shares, so a key masks one round and the keys cost no trip
(`secagg/reveal.py`, rule 0). A sampled cluster whose key of the round this wrapper lacks (it was not in the
round before, or its upload never came) is asked for it in one `next-key` trip, those clusters only. Then one
`unmask` trip: with nobody dropped, the receipts of all are the proof and survivors reveal self-mask shares;
with dropouts, one `view` trip first, in which the survivors sign the survivor set, and the unmask carries
those signatures and the survivors' receipts, survivors then also revealing their round keys with the
dropped. Only when a dropped cluster's neighbour dropped too after uploading is a further trip made
(`recover`: the shares of the key the dropped cluster was to mask that round with, which masks nothing
else). What a cluster reveals, and why a lying server learns nothing more, is `secagg/reveal.py`; this
wrapper is the honest server. A stage that leaves fewer than the threshold aborts the round (the global
adapter stays) and the run goes on; a malformed or lying reply only drops its holder (`secagg/replies.py`).
Bytes and seconds of the extra stages are counted in the round's traffic.

ROUND-OVERLAP (run config `round-overlap`): round r's unmask request rides on round r+1's train message and
its answer on round r+1's reply, so a round nobody dropped out of costs the hops of a plain round (`extra_trips`
0 in the round's `secagg` report, `unmasked_round(s)`: whose sum it applied). On the wire the train message
carries a ConfigRecord `secagg` beside `config` and `down`: exactly the explicit `query.secagg` unmask request
(built by one function, so a holder asked both ways gets its one answer again); the ClientApp passes it to the
trainer with the round, whose stage answers it with the checks of an explicit request
(`SecAggStage.answer_riding`) before the round is checked, refused or trained, and the reply carries a
ConfigRecord `secagg` beside `update` and `metrics`: the explicit reply, or {"refused": why}. A refused round's
reply carries it too (the privacy wrapper hands such replies over: `note_refused`), and the cluster's reply
cache replays the very bytes. The global adapter moves one round late, as on the plain overlapped path: round 1
returns it unchanged (`secagg-pending-round` in its metrics; not a skipped round). The last round
(num-server-rounds, or the one after which the privacy budget stops the run) and every round with dropouts are
unmasked at once, with today's trips: a dropout round's survivors must sign their view first, and riding that
request too would delay the sum by another round. Answers missing from a held round (a holder not sent the next
round, silent, or answering without the record) are asked with one explicit trip, only when those in hand lack
t shares of some seed; a refusal is final. The held round is checkpointed with the strategy (secagg/held.py),
not flushed: a checkpoint is written every round, so flushing would bring the extra trip back every round.

No held round is lost when the run stops. A round every sampled cluster refuses (the privacy wrapper takes the
refusals out: the natural end of a budget-limited run) still unmasks the held round from the answers its refusal
replies carry. A run that stops with a round held (every cluster stopped, the loop's last round reached after a
resume) flushes it after the loop with one explicit unmask trip (`flush`), recorded as one more round. A held sum
that cannot be unmasked is said in the report's `not_applied` (round and reason) and logged as a WARNING; each
round's report names the round still held after it (`held`), which is what its checkpoint holds.

It sits outside compression (which sends the downlink and keeps each cluster's view) and inside
privacy (refusals, the client-level accountant): under client-level DP it asks each cluster for
1/threshold of the noise variance, so any sum that can be unmasked carries the full σ.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from nebula_fl.compression import Compressor
from nebula_fl.compression.randk import RandK
from nebula_fl.config import SecAggConfig
from nebula_fl.secagg import field, graph, shares
from nebula_fl.secagg.evidence import setup_digest, setup_record, upload_fields, view_fields
from nebula_fl.secagg.field import FieldCode, FieldError
from nebula_fl.secagg.held import HeldRound, Upload
from nebula_fl.secagg.identity import verify
from nebula_fl.secagg.masking import remove_masks
from nebula_fl.secagg.masks import pair_order, pair_sign, round_key
from nebula_fl.secagg.replies import (
    ReplyError,
    parse_key_publication,
    parse_keys,
    parse_share_tokens,
    parse_signature,
    read_recover,
    read_unmask,
)
from nebula_fl.secagg.shares import ShareError
from nebula_fl.secagg.wire import digest, unpack_upload
from nebula_fl.strategies.adapter_strategy import CONFIG_KEY, METRICS_KEY, UPDATE_KEY, to_numpy
from nebula_fl.strategies.base import NebulaStrategy, NodeTraffic
from nebula_fl.strategies.compression import BLOB, CompressionWrapper

STAGE_TYPE = "query.secagg"
RECORD = "secagg"


class StageFailed(Exception):
    """A stage left too few clusters: the round aborts with this reason."""


class SecAggWrapper(NebulaStrategy):
    def __init__(self, inner: CompressionWrapper, *, cfg: SecAggConfig, codec: str,
                 client_sigma: float | None = None, client_clip: float = 1.0) -> None:
        super().__init__()
        chain = codec.split("+")
        if len(chain) != 1 or chain[0].split(":")[0] not in ("none", "randk"):
            raise ValueError(f"secure aggregation needs a linear uplink codec ('none' or 'randk:RATIO'), got '{codec}'")
        self.inner, self.cfg, self.codec = inner, cfg, codec
        self.directory = inner.directory
        self.client_sigma, self.client_clip = client_sigma, client_clip
        self.epoch: dict[str, Any] | None = None  # id, members, c_pks, s_pks, threshold, neighbours, tokens, acked
        self.grid: Grid | None = None
        self.round: dict[str, Any] = {}  # this round: set, code, nodes, federation
        self.extra: dict[int, NodeTraffic] = {}  # the extra stages' traffic, added to the round's
        self.report: dict[str, Any] = {}
        self.overlap = False  # round-overlap: a round's unmask request rides on the next round's train message
        self.num_rounds = 0  # the run's last round (num-server-rounds): its uploads are unmasked at once; unknown
        # (0: a config without the key) every round is
        self.held: HeldRound | None = None  # (round-overlap) the last round's uploads, not unmasked yet
        self.asked: dict[int, str] = {}  # node -> cluster whose train message carries the held round's request
        self.answers: dict[str, dict[str, Any]] = {}  # cluster -> its piggybacked unmask answer
        self.refusals: dict[str, str] = {}  # cluster -> why its stage refused the piggybacked request
        self.released: list[int] = []  # the rounds whose sum the last aggregation (or flush) unmasked

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        epoch = None if self.epoch is None else dict(self.epoch)
        held = None if self.held is None else self.held.state_dict()
        return {"inner": self.inner.state_dict(), "epoch": epoch, "held": held}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        epoch = state.get("epoch")
        # an epoch saved before each round had its own mask keys (no "keys") is set up again
        self.epoch = None if epoch is None or "keys" not in epoch else dict(epoch)
        held = state.get("held")
        self.held = None if held is None else HeldRound.from_state_dict(held)

    def needs_identity(self) -> bool:
        """Masks are between clusters: every node must be matched to its cluster before it is sent a round."""
        return True

    def summary(self) -> None:
        log(INFO, "\t├──> secure aggregation: shares %s, threshold %s, %d-bit field",
            self.cfg.num_shares or "all", self.cfg.threshold or "auto", self.cfg.bits)
        self.inner.summary()

    # -- the extra stages ----------------------------------------------------------------------------
    def _stage(self, nodes: dict[int, str], requests: dict[int, dict[str, Any]], *, what: str
               ) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """Send one stage's requests; returns (cluster -> reply, cluster -> why it has none)."""
        assert self.grid is not None
        messages = [Message(content=RecordDict({RECORD: ConfigRecord(req)}), dst_node_id=node,
                            message_type=STAGE_TYPE) for node, req in requests.items()]
        counter = {"key setup": "setup_trips", "share distribution": "setup_trips",
                   "key renewal": "key_trips"}.get(what, "extra_trips")
        self.report[counter] = self.report.get(counter, 0) + 1
        outer = self.destinations
        replies, traffic = self.exchange(self.grid, messages, timeout=self.cfg.timeout, poll_interval=0.2)
        sent_to, self.destinations = self.destinations, outer
        for node, t in traffic.items():
            entry = self.extra.setdefault(node, NodeTraffic())
            entry.bytes_down += t.bytes_down
            entry.bytes_up += t.bytes_up
        got: dict[str, dict[str, Any]] = {}
        failed: dict[str, str] = {}
        for reply in replies:
            cluster = nodes.get(sent_to.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id))
            if cluster is None:
                continue
            if reply.has_error():
                failed[cluster] = reply.error.reason
            elif RECORD not in reply.content.config_records:
                failed[cluster] = f"its {what} reply holds no '{RECORD}' record"
            else:
                got[cluster] = dict(reply.content.config_records[RECORD])
        for node, cluster in nodes.items():
            if cluster not in got and cluster not in failed:
                failed[cluster] = traffic.get(node, NodeTraffic()).error or f"no {what} reply"
        for cluster, why in failed.items():
            log(WARNING, "secure aggregation %s: cluster %s dropped: %s", what, cluster, why)
        return got, failed

    def _setup(self, nodes: dict[int, str], federation: str, server_round: int) -> None:
        """A new key epoch over the round's clusters: signed public keys, then sealed key shares."""
        started = time.monotonic()
        epoch_id = f"r{server_round}-{secrets.token_hex(4)}"
        base = {"federation-id": federation, "epoch": epoch_id}
        got, _ = self._stage(nodes, {n: {**base, "stage": "keys", "round": server_round} for n in nodes},
                             what="key setup")
        keys: dict[str, tuple[str, str, str, str]] = {}
        for cluster, reply in got.items():
            try:
                keys[cluster] = parse_keys(reply)
                if not verify(keys[cluster][2], keys[cluster][3], "keys", federation, epoch_id, cluster,
                              *keys[cluster][:2], server_round):
                    raise ReplyError("its keys are not signed by its identity key")
            except ReplyError as err:
                keys.pop(cluster, None)
                self._bad_reply("key setup", cluster, err)
        members = sorted(keys, key=_order)
        threshold = self.cfg.threshold_for(len(members))
        if len(members) < max(2, threshold):
            raise StageFailed(f"only {len(members)} cluster(s) answered the key setup; secure aggregation needs "
                              f"at least {max(2, threshold)}")
        if len(members) == 2:
            log(WARNING, "secure aggregation over 2 clusters: the server learns only their sum, but each of them can "
                "subtract its own update from the aggregate, and neither may drop out of a round")
        c_pks, s_pks, id_pks, sigs = ([keys[c][i] for c in members] for i in range(4))
        request = {**base, "stage": "share", "members": members, "c-pks": c_pks, "s-pks": s_pks, "id-pks": id_pks,
                   "key-sigs": sigs, "num-shares": self.cfg.num_shares, "threshold": threshold, "round": server_round}
        in_epoch = {n: c for n, c in nodes.items() if c in members}
        shared, failed = self._stage(in_epoch, dict.fromkeys(in_epoch, request), what="share distribution")
        if failed:
            raise StageFailed(f"cluster(s) {sorted(failed)} failed the share distribution; keys are set up again "
                              "next round")
        tokens: dict[str, dict[str, str]] = {c: {} for c in members}  # holder -> "owner/number" -> sealed share
        for sender, reply in shared.items():
            try:
                for holder, token in parse_share_tokens(reply).items():
                    if holder in tokens:
                        tokens[holder][f"{sender}/{server_round}"] = token
            except ReplyError as err:
                self._bad_reply("share distribution", sender, err)
                raise StageFailed(f"cluster {sender}'s share distribution is unusable; keys are set up again next "
                                  "round") from None
        setup = setup_record(members=members, c_pks=c_pks, s_pks=s_pks, id_pks=id_pks, sigs=sigs,
                             num_shares=self.cfg.num_shares, threshold=threshold,
                             first_round=server_round)  # as each cluster keeps it
        self.epoch = {"id": epoch_id, "members": members, "c_pks": c_pks, "s_pks": s_pks,
                      "ids": dict(zip(members, id_pks)), "setup": setup_digest(setup), "threshold": threshold,
                      "neighbours": {c: list(v) for c, v in
                                     graph.neighbours(members, num_shares=self.cfg.num_shares, seed=epoch_id).items()},
                      "tokens": tokens, "first_round": server_round,
                      "keys": {c: [server_round, s_pks[i], ""] for i, c in enumerate(members)}}
        self.report["setup_s"] = time.monotonic() - started
        log(INFO, "secure aggregation: key epoch %s over %d clusters (threshold %d) in %.1f s", epoch_id,
            len(members), threshold, self.report["setup_s"])

    def _bad_reply(self, what: str, cluster: str, err: Exception) -> None:
        """A holder whose reply cannot be used is left out of the stage, and why is logged and recorded."""
        self.report.setdefault("bad_replies", {})[cluster] = f"{what}: {err}"
        log(WARNING, "secure aggregation %s: cluster %s left out: %s", what, cluster, err)

    # -- a round ---------------------------------------------------------------------------------------
    def _code(self, round_size: int) -> FieldCode:
        clip = self.cfg.clip
        if clip == 0:
            # with client-level DP each share carries N(0, (σC)²/t) per coordinate: six of its standard deviations
            # above the clipping norm leave ~2e-9 of coordinates clipped
            assert self.epoch is not None
            noise = 0.0 if self.client_sigma is None else self.client_sigma / np.sqrt(self.epoch["threshold"])
            clip = 1.0 if self.client_sigma is None else self.client_clip * (1 + 6 * noise)
        return FieldCode(bits=self.cfg.bits, clip=float(clip), max_weight=1 if self.client_sigma else self.cfg.max_weight,
                         clusters=round_size)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                        ) -> Iterable[Message]:
        self._begin(grid)
        self.overlap = bool(config.get("round-overlap", False))
        self.num_rounds = int(config.get("num-server-rounds", 0) or 0)
        messages = list(self.inner.configure_train(server_round, arrays, config, grid))
        federation = str(config.get("federation-id", ""))
        nodes: dict[int, str] = {}
        for m in messages:
            cluster = self.directory.get(m.metadata.dst_node_id)
            if cluster is None:
                self.rejected[m.metadata.dst_node_id] = "its cluster is not known yet; it cannot take part in masking"
            else:
                nodes[m.metadata.dst_node_id] = cluster
        sampled = set(nodes.values())
        try:
            if self.epoch is None or not self._covers(sampled):
                self._setup(nodes, federation, server_round)
            self._renew_keys(nodes, federation, server_round)
        except StageFailed as why:
            self._abort(server_round, str(why))
            return []
        assert self.epoch is not None
        round_set = self._maskable(sampled, server_round)
        for node, cluster in nodes.items():
            if cluster not in round_set:
                self.rejected[node] = (f"it cannot be masked in round {server_round}: no mask key of the round from it "
                                       "(its next-key reply did not come), or too few of its share holders sampled")
        if len(round_set) < self.epoch["threshold"]:
            self._abort(server_round, f"{len(round_set)} of the epoch's clusters sampled, fewer than the threshold "
                                      f"{self.epoch['threshold']}")
            return []
        code = self._code(len(round_set))
        self.round = {"set": round_set, "code": code, "nodes": {n: c for n, c in nodes.items() if c in round_set},
                      "federation": federation, "positions": self._positions(), "server_round": server_round}
        self.round["keys"] = {c: self.epoch["keys"][c][:2] for c in round_set}
        riding = self._riding_requests()
        out = []
        for m in messages:
            cluster = nodes.get(m.metadata.dst_node_id)
            if cluster not in round_set:
                continue
            cfg = dict(m.content.config_records[CONFIG_KEY])
            cfg.update({"secagg-epoch": self.epoch["id"], "secagg-round-set": round_set, "secagg-bits": code.bits,
                        "secagg-clip": code.clip, "secagg-max-weight": code.max_weight})
            if self.held is not None:  # the held round is applied one round late: this global does not hold it
                cfg["global-round"] = min(int(cfg.get("global-round", server_round - 1)), self.held.server_round - 1)
            if "privacy-sigma" in cfg:  # each cluster adds 1/t of the variance: every sum we can unmask has σ
                cfg["privacy-noise-shares"] = int(self.epoch["threshold"])
            named = {m: self.epoch["keys"][m] for m in round_set  # each member's key of this round, signed for it
                     if m == cluster or m in self.epoch["neighbours"][cluster]}
            held = self.epoch["tokens"].get(cluster, {})
            cfg.update({"secagg-keys": json.dumps(named, sort_keys=True), "secagg-key-from": list(held),
                        "secagg-key-tokens": list(held.values())})
            records = {name: record for name, record in m.content.items() if name != CONFIG_KEY}
            if cluster in riding:  # the held round's unmask request, answered beside this round's update
                records[RECORD] = ConfigRecord(riding[cluster])
                self.asked[m.metadata.dst_node_id] = cluster
            content = RecordDict({**records, CONFIG_KEY: ConfigRecord(cfg)})
            out.append(Message(content=content, dst_node_id=m.metadata.dst_node_id,
                               message_type=m.metadata.message_type))
        self._forget_delivered()
        return out

    def _covers(self, sampled: set[str]) -> bool:
        """Whether the epoch serves these sampled clusters: all members, each with at least t of its holders
        sampled (else its stage refuses the round); otherwise a new epoch is set up over them."""
        assert self.epoch is not None
        if not sampled <= set(self.epoch["members"]):
            return False
        t = self.epoch["threshold"]
        return all(len(({c} | set(self.epoch["neighbours"][c])) & sampled) >= t for c in sampled)

    def _maskable(self, sampled: set[str], server_round: int) -> list[str]:
        """The round set: sampled members with a mask key of this round, each with at least t of its holders among
        them (a cluster checks this and refuses otherwise), pruned until every one has."""
        assert self.epoch is not None
        out = {c for c in sampled & set(self.epoch["members"]) if self.epoch["keys"][c][0] == server_round}
        t = self.epoch["threshold"]
        while short := {c for c in out if len(({c} | set(self.epoch["neighbours"][c])) & out) < t}:
            out -= short
        return sorted(out, key=_order)

    def _renew_keys(self, nodes: dict[int, str], federation: str, server_round: int) -> None:
        """One `next-key` trip, only for sampled clusters whose mask key of this round this server lacks: they were
        not in the last round (the key rides on the upload before) or their upload never came. The others cost
        nothing. A cluster still without one sits the round out."""
        assert self.epoch is not None
        lacking = {n: c for n, c in nodes.items()
                   if c in self.epoch["members"] and self.epoch["keys"][c][0] != server_round}
        if not lacking:
            return
        request = {"federation-id": federation, "epoch": self.epoch["id"], "stage": "next-key", "round": server_round}
        got, _ = self._stage(lacking, dict.fromkeys(lacking, request), what="key renewal")
        for cluster, reply in got.items():
            try:
                self._take_key(cluster, reply, server_round=server_round, federation=federation)
            except ReplyError as err:
                self._bad_reply("key renewal", cluster, err)

    def _take_key(self, cluster: str, publication: Any, *, server_round: int, federation: str) -> None:
        """A cluster's mask key of `server_round` (signed public half, sealed shares for each of its neighbours),
        from its upload or a next-key reply; ReplyError if anything in it is off."""
        assert self.epoch is not None
        pk, sig = parse_key_publication(publication, server_round=server_round)
        if not verify(self.epoch["ids"][cluster], sig, "mask-key", federation, self.epoch["id"], self.epoch["setup"],
                      cluster, server_round, pk):
            raise ReplyError(f"its mask key of round {server_round} is not signed by its identity key")
        tokens = parse_share_tokens(publication)
        if set(tokens) != set(self.epoch["neighbours"][cluster]):
            raise ReplyError(f"it shared its mask key of round {server_round} with {sorted(tokens)}, not with its "
                             "neighbours")
        self.epoch["keys"][cluster] = [server_round, pk, sig]
        for holder, token in tokens.items():
            self.epoch["tokens"].setdefault(holder, {})[f"{cluster}/{server_round}"] = token

    def _forget_delivered(self) -> None:
        """A key masks one round: once this round's messages carry the shares of its keys to the holders in it, no
        other holder will ever be asked for them (only holders that unmasked the round may give them), and keys of
        earlier rounds are worthless."""
        assert self.epoch is not None
        server_round = self.round["server_round"]
        for held in self.epoch["tokens"].values():
            for name in list(held):
                if int(name.rpartition("/")[2]) <= server_round:
                    del held[name]

    def _abort(self, server_round: int, why: str) -> None:
        self.report["aborted"] = why
        log(WARNING, "round %d: secure aggregation aborted the round: %s", server_round, why)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        self.inner.destinations = self.destinations
        if self.overlap or self.held is not None:
            return self._aggregate_overlapped(server_round, replies)
        if not self.round:  # aborted before anything was sent
            return self.inner.aggregate_sum(server_round, uploaded={}, flat_mean=None, weight=0, count=0)
        uploads, uploaded = self._uploads(replies)
        self.report.update(sampled=len(self.round["set"]), uploaded=len(uploads))
        try:
            flat_mean, weight = self._unmask(self._held(uploads), node_of={c: n for n, c in self.round["nodes"].items()})
            self.report["unmasked_round"] = server_round
            self.released = [server_round]
        except StageFailed as why:
            self._abort(server_round, str(why))
            if uploads:
                self._not_applied(server_round, str(why))
            flat_mean, weight = None, 0.0
        self.inner.destinations = self.destinations
        arrays, metrics = self.inner.aggregate_sum(server_round, uploaded=uploaded, flat_mean=flat_mean,
                                                   weight=weight, count=len(uploads))
        self.rejected.update(self.inner.rejected)
        return arrays, metrics

    # -- round-overlap: the unmask request rides on the next round's train message ---------------------
    def _riding_requests(self) -> dict[str, dict[str, Any]]:
        """(round-overlap) cluster -> the held round's unmask request, to ride on this round's train message.

        Only a held round rides, and a held round had no dropouts: its proof is the upload receipts, so the
        request is exactly the one the explicit trip would send (same function, same bytes), and a holder asked
        both ways (its answer lost) gets its first answer again. A round with dropouts is never held: its
        survivors must sign their view first, and carrying that signature request too would delay the round
        by another round; it is unmasked at once with today's view and unmask trips."""
        if not self.overlap or self.held is None:
            return {}
        return self._unmask_requests(self.held, self._receipts(self.held))

    def note_refused(self, server_round: int, replies: list[Message]) -> None:
        """Replies the privacy wrapper took out of the round (the cluster's gate declined it) still carry the
        held round's unmask answer, if its stage gave one: a refused round is no refusal to unmask the last."""
        self._collect_answers(replies)

    def note_last_round(self, server_round: int) -> None:
        """The run ends after this round (the privacy budget): its uploads are unmasked now, not held."""
        self.num_rounds = min(self.num_rounds, server_round) if self.num_rounds else server_round

    def _begin(self, grid: Grid) -> None:
        """Forget the last round's trip state: a round (configure_train) or a flush starts from nothing."""
        self.grid, self.round, self.extra, self.report = grid, {}, {}, {"extra_trips": 0}
        self.asked, self.answers, self.refusals, self.released = {}, {}, {}, []

    def held_rounds(self) -> list[int]:
        return [] if self.held is None else [self.held.server_round]

    def released_rounds(self) -> list[int]:
        return list(self.released)

    def flush(self, grid: Grid, arrays: ArrayRecord) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Unmask the held round once no round is left to carry its request (the run ended or stopped with it held):
        one explicit unmask trip, since no answer rode for it, then one outer step from `arrays`. Its report says
        `flushed` (the round) and, when the sum could not be unmasked, `not_applied`."""
        self._begin(grid)
        held, self.held = self.held, None
        if held is None:
            return None, None
        core = self.inner.inner  # the outer optimizer: as its configure_train would leave it for this step
        core.current, core.round_clusters = to_numpy(arrays), []  # (no current at all after a resume)
        core.records.clear()  # the flush's record says what this step recorded, not the last round's
        self.report["flushed"] = held.server_round
        sums = self._unmask_now(held, answers=None)
        self.released = [s[0] for s in sums]
        self.report.update(unmasked_round=self.released[-1] if sums else None, unmasked_rounds=list(self.released))
        if not sums:
            return None, MetricRecord({"clusters": 0})
        _, flat, weight, count = sums[0]
        self.inner.rejected = {}
        arrays_out, metrics = self.inner.apply_flat(flat, weight=weight, count=count)
        self.rejected.update(self.inner.rejected)
        return arrays_out, metrics

    def _not_applied(self, server_round: int, why: str) -> None:
        """Round `server_round`'s masked uploads will never be in the global adapter: said in the report (its record
        and summary.json) with the reason."""
        self.report.setdefault("not_applied", []).append({"round": server_round, "reason": why})

    def _collect_answers(self, replies: list[Message]) -> None:
        """Each asked cluster's piggybacked answer (a `secagg` record beside `update` and `metrics`): an answer
        (as the explicit trip's reply) or {"refused": why} when its stage refused the request."""
        for reply in replies:
            cluster = self.asked.get(self.node_of(reply))
            if cluster is None or reply.has_error() or RECORD not in reply.content.config_records:
                continue
            answer = dict(reply.content.config_records[RECORD])
            if "refused" in answer:
                self.refusals[cluster] = str(answer["refused"])
                log(WARNING, "secure aggregation unmasking: cluster %s refused: %s", cluster, answer["refused"])
            else:
                self.answers[cluster] = answer

    def _node_of(self, held: HeldRound) -> dict[str, int]:
        """Where each cluster of a held round can be reached now: its node this round, else its last known one."""
        node_of = {c: n for n, c in self.round.get("nodes", {}).items()}
        node_of.update({c: n for n, c in self.directory.clusters.items()})
        return {c: n for c, n in node_of.items() if c in held.round_set}

    def _unmask_now(self, held: HeldRound, *, answers: dict[str, dict[str, Any]] | None,
                    refused: Iterable[str] = ()) -> list[tuple[int, np.ndarray, float, int]]:
        """[(round, flat mean, Σw, uploads)] of a held round, or [] when it could not be unmasked (said why)."""
        try:
            flat, weight = self._unmask(held, node_of=self._node_of(held), answers=answers, refused=refused)
        except StageFailed as why:
            self._abort(held.server_round, f"round {held.server_round}'s sum is not applied: {why}")
            self._not_applied(held.server_round, str(why))
            return []
        return [(held.server_round, flat, weight, len(held.uploads))]

    def _aggregate_overlapped(self, server_round: int, replies: list[Message]
                              ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Round-overlap: unmask the held round (last round's uploads) from the answers this round's replies
        carry, falling back to an explicit trip for what is missing; hold this round's uploads for the next.

        What each call applies, in round order (`unmasked_round` in the round's `secagg` report):
        - nothing held (round 1, or after a round that could not be held): the global adapter is returned
          unchanged, not None (None is a skipped round, and too many end the run), with `secagg-pending-round`
          in the metrics: the aggregate is pending;
        - the held round's sum: the global moves one round late, as on the plain overlapped path;
        - this round's sum too when it cannot be held: the run's last round (num-server-rounds; one explicit
          unmask trip, so the final global includes every round), a round with dropouts (its view trip), or
          one with fewer uploads than the threshold (it aborts, as today).
        A held round that cannot be unmasked is a skipped round, as an aborted unmasking is today, and is said in
        the report's `not_applied`. A round nobody uploaded in (every sampled cluster refused it, or was silent)
        has nothing to hold or unmask; the held round is still unmasked (a refusal reply carries its answer).
        `extra_trips` in the report: the message trips spent unmasking (view, unmask, recover); 0 in an
        overlapped round nobody dropped out of, 1 for the last round's flush or a missing answer."""
        self._collect_answers(replies)
        uploads, uploaded = self._uploads(replies) if self.round else ({}, {})
        if self.round:
            self.report.update(sampled=len(self.round["set"]), uploaded=len(uploads))
        sums: list[tuple[int, np.ndarray, float, int]] = []
        held, self.held = self.held, None
        if held is not None:
            sums += self._unmask_now(held, answers=self.answers, refused=self.refusals)
        if self.round and uploads:
            this = self._held(uploads)
            if this.dropped or server_round >= self.num_rounds or len(this.survivors) < this.epoch["threshold"]:
                sums += self._unmask_now(this, answers=None)
            else:
                self.held = this
        self.inner.destinations = self.destinations
        self.released = [s[0] for s in sums]
        self.report["unmasked_round"] = sums[-1][0] if sums else None
        self.report["unmasked_rounds"] = list(self.released)
        if self.held is not None:  # what this round's checkpoint holds, still to be applied
            self.report["held"] = self.held.server_round
        if not sums and held is None and self.held is not None:  # nothing to apply yet, and nothing lost
            self.inner.acknowledge_round(server_round, uploaded=uploaded)
            self.report["pending"] = server_round
            return self.inner.current_arrays(), MetricRecord({"clusters": 0, "secagg-pending-round": server_round})
        first = sums[0] if sums else (server_round, None, 0.0, 0)
        results = [self.inner.aggregate_sum(server_round, uploaded=uploaded, flat_mean=first[1], weight=first[2],
                                            count=first[3])]
        results += [self.inner.apply_flat(flat, weight=weight, count=count) for _, flat, weight, count in sums[1:]]
        self.rejected.update(self.inner.rejected)
        applied = [r for r in results if r[0] is not None]
        return applied[-1] if applied else results[-1]

    def _uploads(self, replies: list[Message]) -> tuple[dict[str, Upload], dict[int, str]]:
        """Each survivor's masked vector, sealed shares and commitments, its receipt checked; a malformed upload
        drops its cluster here, before it can touch the sum."""
        assert self.epoch is not None
        code, rnd = self.round["code"], self.round["server_round"]
        count = self._coordinates(self.round["positions"]) + 1
        uploads: dict[str, Upload] = {}
        uploaded: dict[int, str] = {}
        for reply in replies:
            node = self.node_of(reply)
            cluster = self.round["nodes"].get(node)
            if cluster is None or reply.has_error():
                continue
            try:
                metrics = dict(reply.content.metric_records[METRICS_KEY])
                if str(int(metrics["cluster-id"])) != cluster:
                    raise ValueError(f"it says it is cluster {metrics['cluster-id']}, not {cluster}")
                blob = reply.content.array_records[UPDATE_KEY][BLOB].numpy()
                masked, head = unpack_upload(blob)
                vector = field.unpack(masked, bits=code.bits, count=count)
                owed = {n for n in self.epoch["neighbours"][cluster] if n in self.round["set"]}
                if set(head["tokens"]) != owed or set(head["commit"]["pairs"]) != owed:
                    raise ValueError(f"it sealed shares or committed pair keys for {sorted(head['tokens'])}, not for "
                                     f"{sorted(owed)}")
                used = {m: self.round["keys"][m][0] for m in owed | {cluster}}
                if head.get("keys") != used:
                    raise ValueError(f"it masked with keys {head.get('keys')}, not the round's {used}")
                signed = digest(head, masked)
                if not verify(self.epoch["ids"][cluster], head["receipt"], "upload", *upload_fields(
                        federation=self.round["federation"], epoch=self.epoch["id"], setup=self.epoch["setup"],
                        server_round=rnd, round_set=self.round["set"], member=cluster, keys=used, digest=signed)):
                    raise ValueError("its receipt is not its signature of this round's upload")
                self._take_key(cluster, head.get("next-key"), server_round=rnd + 1, federation=self.round["federation"])
            except (KeyError, ValueError, TypeError, FieldError) as err:
                self.rejected[node] = f"masked upload unusable: {err}"
                log(WARNING, "round %d: dropped the masked upload of cluster %s: %s", rnd, cluster, err)
                continue
            uploads[cluster] = Upload(vector=vector, tokens=head["tokens"], commits=head["commit"],
                                      receipt=[signed, head["receipt"], used])
            uploaded[node] = cluster
        return uploads, uploaded

    def _positions(self) -> np.ndarray | None:
        """The coordinates every cluster masks this round: random-k's from the round's seed, or None (all)."""
        layout = self.inner.layout()
        stage = Compressor(self.codec, layout=layout).stages[0]
        return stage.positions(layout.size, self.inner.round_seed) if isinstance(stage, RandK) else None

    def _coordinates(self, positions: np.ndarray | None) -> int:
        return self.inner.layout().size if positions is None else len(positions)

    def _held(self, uploads: dict[str, Upload]) -> HeldRound:
        """This round's uploads with what their unmasking needs, apart from the live round and epoch."""
        assert self.epoch is not None
        return HeldRound(server_round=self.round["server_round"], epoch=self.epoch, round_set=list(self.round["set"]),
                         code=self.round["code"], federation=self.round["federation"],
                         positions=self.round["positions"], uploads=uploads, keys=dict(self.round["keys"]))

    def _unmask_requests(self, held: HeldRound, proof: dict[str, str]) -> dict[str, dict[str, Any]]:
        """Each survivor's unmask request (holder -> request): one function for the explicit trip and the
        piggybacked one, so a holder asked both ways gets the same request, and its stage the same answer."""
        base = {"federation-id": held.federation, "epoch": held.epoch["id"], "round": held.server_round,
                "survivors": held.survivors, "dropped": held.dropped}
        requests = {}
        for holder in held.survivors:
            senders = [s for s in held.survivors if holder in held.uploads[s].tokens]
            requests[holder] = {**base, **proof, "stage": "unmask", "from": senders,
                                "tokens": [held.uploads[s].tokens[holder] for s in senders]}
        return requests

    @staticmethod
    def _receipts(held: HeldRound) -> dict[str, str]:
        """Every upload's receipt: the proof of a round nobody dropped, and in a round with dropouts what shows each
        holder that its surviving neighbours masked with the keys it did."""
        return {"receipts": json.dumps({c: u.receipt for c, u in held.uploads.items()}, sort_keys=True)}

    def _unmask(self, held: HeldRound, *, node_of: dict[str, int], answers: dict[str, dict[str, Any]] | None = None,
                refused: Iterable[str] = ()) -> tuple[np.ndarray, float]:
        """The unmask trip (after the view trip when clusters dropped; rarely a recover trip after it);
        returns (flat mean update, Σw). `answers` (round-overlap): the holders' piggybacked answers, already
        in; the trip then goes only to the survivors that neither answered nor refused, and only if the
        answers in hand cannot rebuild every survivor's self-mask seed (t holders of each suffice)."""
        started = time.monotonic()
        epoch, code, t, server_round = held.epoch, held.code, held.epoch["threshold"], held.server_round
        uploads, survivors, dropped = held.uploads, held.survivors, held.dropped
        if len(survivors) < t:
            raise StageFailed(f"{len(survivors)} masked upload(s), fewer than the threshold {t}")
        base = {"federation-id": held.federation, "epoch": epoch["id"], "round": server_round,
                "survivors": survivors, "dropped": dropped}
        if dropped:  # the survivors sign the survivor set: one more trip, only in a round with dropouts
            proof = {"signatures": json.dumps(self._view_signatures(held, base, node_of), sort_keys=True),
                     **self._receipts(held)}
        else:  # nobody dropped: every upload's receipt is the proof, no extra trip
            proof = self._receipts(held)
        requests = self._unmask_requests(held, proof)
        commits = {c: u.commits for c, u in uploads.items()}

        def read(got: dict[str, dict[str, Any]]):
            return read_unmask(got, survivors=survivors, dropped=dropped, neighbours=epoch["neighbours"], threshold=t,
                               commits=commits)

        got: dict[str, dict[str, Any]] = dict(answers or {})
        ask = [h for h in survivors if h not in got and h not in set(refused) and h in node_of]
        if answers is not None and ask:
            try:
                read(got)
                ask = []  # t holders of every seed answered on the train trip: no trip for the rest
            except ShareError:
                pass
        if answers is None or ask:
            more, _ = self._stage({node_of[h]: h for h in ask}, {node_of[h]: requests[h] for h in ask},
                                  what="unmasking")
            got.update(more)
        self.report["unmask_trip_s"] = time.monotonic() - started  # the message round trips, all clusters
        try:
            unmasked = read(got)
        except ShareError as err:
            raise StageFailed(f"the unmasking fell short: {err}") from None
        for holder, why in unmasked.bad.items():
            self._bad_reply("unmasking", holder, ValueError(why))
        if unmasked.unreadable:
            self.report["unreadable"] = unmasked.unreadable
            log(WARNING, "round %d: shares that holders could not open (tampered or sealed with another key), not "
                "counted: %s", server_round, unmasked.unreadable)
        orphans, missing = [], []
        for gone in dropped:
            for j in survivors:
                if gone not in epoch["neighbours"][j]:
                    continue
                if (j, gone) in unmasked.pair_keys:
                    orphans.append((pair_sign(j, gone), unmasked.pair_keys[(j, gone)]))
                else:
                    missing.append((j, gone))
        if missing:
            orphans += self._recover(held, missing, answered=set(got) - set(unmasked.bad), node_of=node_of)
        seeds = [unmasked.seeds[c] for c in survivors]
        total = np.zeros(self._coordinates(held.positions) + 1, dtype=np.uint64)
        for upload in uploads.values():
            total = field.add(total, upload.vector, code=code)
        plain = remove_masks(total, code=code, self_seeds=seeds, orphan_pairs=orphans)
        weighted, weight = field.decode_sum(plain, code=code)
        if weight <= 0:
            raise StageFailed(f"the unmasked weights sum to {weight}; an upload or a share was wrong")
        mean = weighted / weight
        if held.positions is None:
            flat = mean.astype(np.float32)
        else:
            flat = np.zeros(self.inner.layout().size, dtype=np.float32)
            flat[held.positions] = mean
        self.report.update(unmask_s=time.monotonic() - started, survivors=len(survivors), dropped=dropped)
        return flat, float(weight)

    def _view_signatures(self, held: HeldRound, base: dict[str, Any], node_of: dict[str, int]) -> dict[str, str]:
        """Every survivor's signature of the survivor set (the valid ones: the clusters check them anyway)."""
        survivors = held.survivors
        got, _ = self._stage({node_of[c]: c for c in survivors},
                             {node_of[c]: {**base, "stage": "view"} for c in survivors}, what="survivor agreement")
        fields = view_fields(federation=base["federation-id"], epoch=base["epoch"], setup=held.epoch["setup"],
                             server_round=base["round"],
                             round_set=held.round_set, survivors=survivors)
        signatures = {}
        for cluster, reply in got.items():
            try:
                sig = parse_signature(reply)
                if not verify(held.epoch["ids"][cluster], sig, "view", *fields):
                    raise ReplyError("its signature of the survivor set does not verify")
                signatures[cluster] = sig
            except ReplyError as err:
                self._bad_reply("survivor agreement", cluster, err)
        self.report["signed_view"] = len(signatures)
        return signatures

    def _recover(self, held: HeldRound, missing: list[tuple[str, str]], *, answered: set[str],
                 node_of: dict[str, int]) -> list[tuple[int, bytes]]:
        """Rebuild the mask keys of dropped clusters whose pair keys nobody alive revealed."""
        epoch, server_round = held.epoch, held.server_round
        wanted = sorted({gone for _, gone in missing}, key=_order)
        holders = sorted({h for g in wanted for h in epoch["neighbours"][g] if h in answered}, key=_order)
        request = {"federation-id": held.federation, "epoch": epoch["id"], "stage": "recover",
                   "round": server_round}
        asked = {h: [g for g in wanted if g in epoch["neighbours"][h]] for h in holders}
        got, _ = self._stage({node_of[h]: h for h in holders},
                             {node_of[h]: {**request, "clusters": asked[h]} for h in holders}, what="key recovery")
        try:
            keys, bad = read_recover(got, asked={h: set(v) for h, v in asked.items()}, threshold=epoch["threshold"],
                                     public_keys={g: str(held.keys[g][1]).encode() for g in wanted})
        except ShareError as err:
            raise StageFailed(f"the key recovery fell short: {err}") from None
        for holder, why in bad.items():
            self._bad_reply("key recovery", holder, ValueError(why))
        for gone in wanted:
            log(INFO, "round %d: the mask key cluster %s was to mask it with was rebuilt (it masks no other round)",
                server_round, gone)
        out = []
        for j, gone in missing:
            secret = shares.pair_secret(keys[gone], str(held.keys[j][1]).encode())
            seqs = pair_order(j, gone, int(held.keys[j][0]), int(held.keys[gone][0]))
            out.append((pair_sign(j, gone), round_key(secret, epoch=epoch["id"], server_round=server_round,
                                                      seqs=seqs)))
        self.report["recovered"] = wanted
        return out

    # -- pass-through ----------------------------------------------------------------------------------
    def observe_traffic(self, traffic: dict[int, NodeTraffic]) -> None:
        self.inner.observe_traffic(traffic)
        for node, extra in self.extra.items():  # the extra stages' bytes are this round's too
            entry = traffic.setdefault(node, NodeTraffic())
            entry.bytes_down += extra.bytes_down
            entry.bytes_up += extra.bytes_up

    def round_notes(self) -> dict[str, dict[str, Any]]:
        return self.inner.round_notes()

    def round_summary(self) -> dict[str, Any]:
        return {"secagg": dict(self.report), **self.inner.round_summary()}

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, replies)


def _order(cid: str) -> tuple[int, str]:
    return (int(cid), cid) if cid.isascii() and cid.isdigit() else (1 << 62, cid)
