"""Compression as a wrapper: packs and compresses both directions around any adapter strategy.

Downlink: the server keeps, per cluster, the global adapter *as that cluster has it* (its view) and
sends the compressed difference between the current global adapter and that view; both sides add
the same decoded difference, so the views stay bit-identical and whatever compression dropped is
sent in a later round (error feedback for free). A cluster seen for the first time, or whose view is
in doubt (it failed a round), gets a full float32 copy. Each message carries the view's round and a
CRC so a cluster never applies a difference to the wrong base.

Uplink: the cluster's trainer encodes its update (with its own error-feedback residual) into one
byte blob; this wrapper decodes it back into per-tensor arrays before the inner strategy sees it.
A blob that fails to decode drops that cluster from the round; it never reaches the aggregate.

Both directions travel as a single uint8 array per message: one HTTP request instead of one per
tensor. With adaptive compression the uplink setting is chosen per cluster and round from its link.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.app.message.message import make_message
from flwr.serverapp import Grid
from flwr.supercore import log

from nebula_fl.comm import adaptive
from nebula_fl.comm.views import codec_seed, view_crc
from nebula_fl.compression import CodecError, Compressor, Layout
from nebula_fl.strategies.adapter_strategy import (
    CONFIG_KEY,
    METRICS_KEY,
    UPDATE_KEY,
    AdapterStrategy,
    Arrays,
    to_numpy,
    to_record,
)
from nebula_fl.strategies.base import NebulaStrategy, NodeTraffic

DOWN_KEY = "down"  # server -> cluster: one uint8 blob, the full adapter or the change since the cluster's view
BLOB = "blob"


def blob_array(blob: bytes) -> Array:
    return Array(np.frombuffer(blob, dtype=np.uint8).copy())


class CompressionWrapper(NebulaStrategy):
    def __init__(
        self,
        inner: AdapterStrategy,
        *,
        codec_up: str,
        codec_down: str,
        seed: int = 0,
        initial: Arrays | None = None,
        adaptive_target_s: float | None = None,
        param_range: tuple[float, float] = (0.001, 0.25),
        bandwidth: adaptive.BandwidthTracker | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.directory = inner.directory
        self.codec_up, self.codec_down, self.seed = codec_up, codec_down, seed
        # The seeded initial adapter, which every cluster can rebuild on its own: a cluster the server has
        # no view of is sent the change since it (round 0), not a float32 copy of everything.
        self.initial = initial
        self.adaptive_target_s = adaptive_target_s
        self.param_range = param_range
        self.bandwidth = bandwidth or adaptive.BandwidthTracker()
        if adaptive_target_s is not None:
            if adaptive.knob_of(codec_up) is None:
                raise ValueError(f"adaptive compression needs a codec with a ratio, rank or bits; '{codec_up}' has none")
            if not adaptive.candidates(codec_up, low=param_range[0], high=param_range[1]):
                raise ValueError(f"no setting of '{codec_up}' lies in comm.param-min..max {param_range}")
        self.views: dict[str, Arrays] = {}  # cluster id -> the global adapter as that cluster has it
        self.view_rounds: dict[str, int] = {}
        self.force_full: set[str] = set()  # clusters that could not rebuild the initial adapter bit for bit
        self.pending: dict[int, tuple[Arrays, int]] = {}  # node -> (its view once it acknowledges, round)
        self.sent_from: dict[int, str] = {}  # node -> "view", "initial" or "full": the base of its last message
        self.choices: dict[str, dict[str, Any]] = {}  # cluster -> this round's adaptive decision
        self.round_seed = 0

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "views": self.views, "view_rounds": self.view_rounds,
                "force_full": sorted(self.force_full), "bandwidth": self.bandwidth.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.views = {str(k): {n: np.asarray(a, np.float32) for n, a in v.items()} for k, v in state["views"].items()}
        self.view_rounds = {str(k): int(v) for k, v in state["view_rounds"].items()}
        self.force_full = set(state.get("force_full", []))
        self.bandwidth.load_state_dict(state.get("bandwidth", {}))

    def needs_identity(self) -> bool:
        """A node must be matched to its cluster before it is sent the change since that cluster's view."""
        return bool(self.views) or super().needs_identity()

    def summary(self) -> None:
        log(INFO, "\t├──> compression: up '%s', down '%s'%s", self.codec_up, self.codec_down,
            f", adaptive to {self.adaptive_target_s} s" if self.adaptive_target_s else "")
        self.inner.summary()

    # -- downlink --------------------------------------------------------------------------------
    def _uplink_spec(self, cluster: str | None, layout: Layout) -> str:
        if self.adaptive_target_s is None:
            return self.codec_up
        options = adaptive.candidates(self.codec_up, low=self.param_range[0], high=self.param_range[1])
        base = Compressor(self.codec_up, layout=layout)
        if cluster is None:  # not identified yet (its first round): the largest setting, the best first round
            return base.with_param(max(options)).spec
        bps = self.bandwidth.get(cluster)
        if bps is None:
            # Not measurable yet: uploads of different sizes tell the link's latency from its bandwidth, so the
            # next one is whichever of the largest setting and the chain's own differs more from the last seen.
            seen = self.bandwidth.observations.get(cluster, [])
            param = max(options)
            if seen:
                last = seen[-1][0]
                sizes = {p: base.with_param(p).encoded_size() for p in (max(options), base.param)}
                param = max(sizes, key=lambda p: abs(sizes[p] - last))
            spec = base.with_param(param)
            self.choices[cluster] = {"codec_param": param, "planned_upload_bytes": spec.encoded_size(),
                                     "adaptive": "measuring"}
            return spec.spec
        choice = adaptive.choose(sizes=lambda p: _encoded_size(self.codec_up, p, layout.to_json()), options=options,
                                 up_bps=bps, target_s=self.adaptive_target_s)
        self.choices[cluster] = {"codec_param": choice.param, "planned_upload_bytes": choice.bytes,
                                 "planned_upload_s": choice.seconds, "fits_target": choice.fits,
                                 "bandwidth_bps": choice.bandwidth_bps, "adaptive": "chosen"}
        return base.with_param(choice.param).spec

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        plain = list(self.inner.configure_train(server_round, arrays, config, grid))
        current = to_numpy(arrays)
        layout = Layout.from_arrays({k: current[k] for k in sorted(current)})
        flat = layout.flatten(current)
        self.round_seed = codec_seed(self.seed, server_round)
        self.pending, self.choices = {}, {}
        out = []
        for message in plain:
            node = message.metadata.dst_node_id
            cluster = self.directory.get(node)
            cfg = dict(message.content.config_records[CONFIG_KEY])
            cfg.update({"codec-seed": self.round_seed, "codec-up": self._uplink_spec(cluster, layout)})
            if cluster in self.views:
                base, base_round, self.sent_from[node] = layout.flatten(self.views[cluster]), self.view_rounds[cluster], "view"
            elif self.initial is not None and cluster not in self.force_full:
                base, base_round, self.sent_from[node] = layout.flatten(self.initial), 0, "initial"
            else:
                base, base_round, self.sent_from[node] = None, -1, "full"
            if base is not None:
                change = flat - base
                if np.any(change):
                    blob = Compressor(self.codec_down, layout=layout).encode(change, seed=self.round_seed)
                    view = base + Compressor.decode(blob, layout=layout, seed=self.round_seed)
                else:  # nothing changed (round 1 from the initial adapter): an empty blob says so
                    blob, view = b"", base
                cfg.update({"sync": "delta", "codec-down": self.codec_down, "view-round": base_round,
                            "view-crc": view_crc(base)})
            else:
                blob = Compressor("none", layout=layout).encode(flat, seed=self.round_seed)
                view = flat
                cfg.update({"sync": "full", "codec-down": "none"})
            cfg["view-crc-after"] = view_crc(view)
            self.pending[node] = (layout.unflatten(view), server_round)
            content = RecordDict({DOWN_KEY: ArrayRecord({BLOB: blob_array(blob)}), CONFIG_KEY: ConfigRecord(cfg)})
            out.append(Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN))
        return out

    # -- uplink ----------------------------------------------------------------------------------
    def _decode_reply(self, reply: Message, layout: Layout) -> Message | None:
        node = self.node_of(reply)
        if reply.has_error():
            # Its view is in doubt (it may have applied this round's change): next time it is sent the
            # change since the initial adapter, or everything if that base is what it could not match.
            cluster = self.directory.get(node)
            if cluster is not None:
                self.views.pop(cluster, None)
                if self.sent_from.get(node) == "initial":
                    self.force_full.add(cluster)
            return reply
        content = reply.content
        try:
            metrics = dict(content.metric_records[METRICS_KEY])
            cluster = str(int(metrics["cluster-id"]))
            blob = content.array_records[UPDATE_KEY][BLOB].numpy()
            if blob.dtype != np.uint8 or blob.ndim != 1:
                raise CodecError(f"the update blob must be 1-D uint8, got {blob.dtype} {blob.shape}")
            update = layout.unflatten(Compressor.decode(blob.tobytes(), layout=layout, seed=self.round_seed))
        except (CodecError, KeyError, TypeError, ValueError) as err:
            self.rejected[node] = f"update cannot be decoded: {err}"
            log(WARNING, "dropped the reply of node %d: update cannot be decoded: %s", node, err)
            return None
        self.acknowledge(node, cluster)
        return make_message(
            metadata=reply.metadata,
            content=RecordDict({UPDATE_KEY: to_record(update), METRICS_KEY: MetricRecord(metrics)}),
        )

    def acknowledge(self, node: int, cluster: str) -> None:
        """`node` answered this round from the view it was sent: that view is now the cluster's."""
        self.directory.learn(node, cluster)
        self.force_full.discard(cluster)
        if node in self.pending:
            self.views[cluster], self.view_rounds[cluster] = self.pending[node]

    def _forget_silent(self, answered: set[int], server_round: int) -> None:
        for node in set(self.pending) - answered:
            # no reply (timed out, or its SuperNode was replaced): the cluster may or may not have applied
            # this round's change, so its view is in doubt; the next round sends the change since the
            # seeded initial adapter, which it always holds
            cluster = self.directory.get(node)
            if cluster is not None and self.views.pop(cluster, None) is not None:
                log(INFO, "cluster %s did not answer round %d: its next change is sent from the initial adapter",
                    cluster, server_round)

    def layout(self) -> Layout:
        assert self.inner.current is not None, "configure_train must run before aggregation"
        return Layout.from_arrays({k: self.inner.current[k] for k in sorted(self.inner.current)})

    def aggregate_sum(self, server_round: int, *, uploaded: dict[int, str], flat_mean: np.ndarray | None,
                      weight: float, count: int) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """A securely aggregated round: the uploaders' views advance, the unmasked mean (flat, the layout's
        order; None when the round could not be unmasked) goes to the outer optimizer."""
        self.acknowledge_round(server_round, uploaded=uploaded)
        if flat_mean is None:
            return None, MetricRecord({"clusters": 0})
        return self.apply_flat(flat_mean, weight=weight, count=count)

    def acknowledge_round(self, server_round: int, *, uploaded: dict[int, str]) -> None:
        """The uploaders of this round hold the view they were sent; the silent ones' views are in doubt."""
        for node, cluster in uploaded.items():
            self.acknowledge(node, cluster)
        self._forget_silent(set(uploaded), server_round)

    def apply_flat(self, flat_mean: np.ndarray, *, weight: float, count: int
                   ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """One outer step from an unmasked mean (secure aggregation, e.g. a round unmasked one round late)."""
        return self.inner.apply_mean(self.layout().unflatten(flat_mean), weight=weight, count=count)

    def current_arrays(self) -> ArrayRecord:
        """The global adapter as it stands (a round whose sum is not unmasked yet leaves it so)."""
        assert self.inner.current is not None, "configure_train must run before aggregation"
        return to_record(self.inner.current)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        assert self.inner.current is not None
        layout = Layout.from_arrays({k: self.inner.current[k] for k in sorted(self.inner.current)})
        replies = list(replies)
        decoded = [m for m in (self._decode_reply(r, layout) for r in replies) if m is not None]
        self._forget_silent({self.node_of(r) for r in replies}, server_round)
        self.inner.destinations = self.destinations
        self.inner.rejected = {}
        arrays, metrics = self.inner.aggregate_train(server_round, decoded)
        self.rejected.update(self.inner.rejected)
        return arrays, metrics

    def observe_traffic(self, traffic: dict[int, NodeTraffic]) -> None:
        """Feed last round's measured uploads to the bandwidth tracker (clusters without a configured link)."""
        for node, t in traffic.items():
            cluster = self.directory.get(node)
            if cluster is None or t.error or t.elapsed_s is None:
                continue
            seconds = adaptive.upload_seconds_estimate(
                elapsed_s=t.elapsed_s, client_s=float(t.metrics.get("client-seconds", 0.0)),
                bytes_up=t.bytes_up, bytes_down=t.bytes_down,
                sent_at=t.metrics.get("reply-sent-at"), arrived_at=t.arrived_at,
            )
            self.bandwidth.observe(cluster, bytes_up=t.bytes_up, seconds=seconds)

    def round_notes(self) -> dict[str, dict[str, Any]]:
        notes = {cid: dict(n) for cid, n in self.inner.round_notes().items()}
        for cluster, choice in self.choices.items():
            notes.setdefault(cluster, {}).update(choice)
        return notes

    def round_summary(self) -> dict[str, Any]:
        return self.inner.round_summary()

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, replies)


@lru_cache(maxsize=512)
def _encoded_size(spec: str, param: float, layout_json: str) -> int:
    """Exact blob size of `spec` at `param` for a layout (the same for any data of that size)."""
    return Compressor(spec, layout=Layout.from_json(layout_json)).with_param(param).encoded_size()
