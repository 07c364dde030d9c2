"""What crosses the WAN for one cluster: the global arrays it receives and the update it sends.

The server sends the global exchanged tensors (a task's adapter, or every weight) as plain arrays, or,
compressed, as one blob holding either a full copy or the change since a round both sides know (the
cluster's *view*: what it decoded last time, checked by CRC). The uplink encodes the update with the
round's codec chain, keeping the chain's error-feedback residual across rounds. Client-level DP (clip
and noise the update, with fresh OS randomness for every release) is here too: rank 0's round pipeline
(``release.py``) runs it before encoding.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

import numpy as np
import torch

from nebula_fl.comm.views import view_crc
from nebula_fl.compression import CodecError, Compressor, Layout
from nebula_fl.compression.compressor import Selection
from nebula_fl.errors import NebulaError
from nebula_fl.privacy.policy import Admission

Arrays = dict[str, np.ndarray]


class ExchangeError(NebulaError):
    """The downlink cannot be decoded or does not match this cluster's view, or the uplink codec is unusable."""


class Exchange:
    """One cluster's side of the exchange: its view of the global arrays and its uplink codec with residual."""

    def __init__(self, *, initial: Arrays, cluster_id: int) -> None:
        self.layout = Layout.from_arrays({k: initial[k] for k in sorted(initial)})
        # the seeded initial arrays, the base of the first change the server sends (view round 0)
        self.initial_flat = self.layout.flatten(initial)
        self.cluster_id = cluster_id
        self.reset()

    def reset(self) -> None:
        self.view: np.ndarray | None = None  # the global arrays as this cluster has them (compressed downlink)
        self.view_round = -1
        self.up: Compressor | None = None  # uplink codec chain, with this cluster's error-feedback residual

    def receive(self, config: dict[str, Any], payload: Arrays) -> tuple[Arrays, np.ndarray | None]:
        """The global arrays this round starts from, and the new view (None for an uncompressed downlink)."""
        sync = config.get("sync")
        if sync is None:
            return payload, None
        blob = np.asarray(payload.get("blob", np.zeros(0, np.uint8)))
        if blob.dtype != np.uint8 or blob.ndim != 1:
            raise ExchangeError(f"the downlink blob must be 1-D uint8, got {blob.dtype} {blob.shape}")
        seed = int(config["codec-seed"])
        try:
            if sync == "delta" and blob.size == 0:  # no change since the base
                decoded = np.zeros(self.layout.size, np.float32)
            else:
                decoded = Compressor.decode(blob.tobytes(), layout=self.layout, seed=seed)
        except CodecError as err:
            raise ExchangeError(f"cannot decode the downlink: {err}") from None
        if sync == "full":
            view = decoded
        elif sync == "delta":
            base_round = int(config["view-round"])
            base = self.initial_flat if base_round == 0 else self.view
            if base is None or (base_round != 0 and self.view_round != base_round) or view_crc(base) != int(config["view-crc"]):
                raise ExchangeError(
                    f"resync needed: cluster {self.cluster_id} holds the view of round {self.view_round}, "
                    f"the server sent a change from round {base_round}"
                )
            view = (base + decoded).astype(np.float32)
        else:
            raise ExchangeError(f"unknown sync mode {sync!r}")
        if view_crc(view) != int(config["view-crc-after"]):
            raise ExchangeError("resync needed: the decoded global arrays differ from the server's")
        return self.layout.unflatten(view), view

    def keep_view(self, view: np.ndarray | None, server_round: int) -> None:
        if view is not None:
            self.view, self.view_round = view, server_round

    def encode_up(self, update: Arrays, config: dict[str, Any]) -> Selection:
        """The update in the round's uplink codec chain (re-tuned, residual kept, when only its ratio/rank/bits
        changed): its blob, and the values the server decodes from it (what secure aggregation masks)."""
        spec = str(config["codec-up"])
        if self.up is None or self.up.describe()["spec"] != spec:
            try:
                self.up = retune(self.up, spec, self.layout)
            except CodecError as err:
                raise ExchangeError(f"cannot use uplink codec '{spec}': {err}") from None
        seed = int(config["codec-seed"])
        if "randk" not in spec:
            # random-k must share the round's seed across clusters (the same indices everywhere); every
            # other codec draws its rounding noise per cluster, so the noise averages out on the server
            seed = (seed + 7_919 * (self.cluster_id + 1)) % (2**31 - 1)
        return self.up.select(self.layout.flatten(update), seed=seed)

    def uplink_metrics(self, sent: Arrays) -> dict[str, Any]:
        """What the reply says of the uplink: its codec (the last one used) and the bytes sent in it."""
        if self.up is None:
            return {}
        return {"codec-up": self.up.describe()["spec"], "update-bytes": int(sent["blob"].size) if "blob" in sent else 0}

    def state_dict(self) -> dict[str, Any]:
        return {
            "view": None if self.view is None else torch.from_numpy(self.view.copy()),
            "view_round": self.view_round,
            "up_spec": None if self.up is None else self.up.describe()["spec"],
            "up_state": None if self.up is None else to_torch(self.up.state_dict()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.view = None if state.get("view") is None else state["view"].numpy().copy()
        self.view_round = int(state.get("view_round", -1))
        self.up = None
        if state.get("up_spec"):
            self.up = Compressor(state["up_spec"], layout=self.layout)
            self.up.load_state_dict(to_numpy(state["up_state"]))


def privatize_update(update: Arrays, admission: Admission) -> tuple[Arrays, dict[str, Any]]:
    """Client-level DP: clip the update to C and add N(0, (σ C)² / shares) per entry: σ is the noise multiplier of
    what the server can see (this update alone, or under secure aggregation the sum of `shares` or more)."""
    from nebula_fl.privacy.client_dp import add_gaussian, clip_update

    clip = admission.max_grad_norm
    clipped, norm = clip_update(update, max_norm=clip)
    std = admission.noise_multiplier * clip / math.sqrt(admission.noise_shares)
    rng = np.random.default_rng(secrets.randbits(128))  # fresh OS randomness for every release
    noisy = add_gaussian(clipped, std=std, rng=rng)
    return noisy, {"update-norm-before-clip": norm, "clipped": int(norm > clip), "noise-std": std}


def retune(current: Compressor | None, spec: str, layout: Layout) -> Compressor:
    """The uplink compressor for `spec`: the current one re-tuned (keeping its error-feedback residual)
    when only its ratio/rank/bits changed, else a new one (another chain starts with no residual)."""
    fresh = Compressor(spec, layout=layout)
    if current is not None and fresh.param is not None:
        try:
            retuned = current.with_param(fresh.param)
        except CodecError:
            return fresh
        if retuned.spec == fresh.spec:
            return retuned
    return fresh


def to_torch(state: Any) -> Any:
    """Codec state (NumPy arrays in nested dicts) as tensors, which torch.load(weights_only=True) accepts."""
    if isinstance(state, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(state).copy())
    if isinstance(state, dict):
        return {k: to_torch(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return [to_torch(v) for v in state]
    return state


def to_numpy(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.numpy().copy()
    if isinstance(state, dict):
        return {k: to_numpy(v) for k, v in state.items()}
    if isinstance(state, list):
        return [to_numpy(v) for v in state]
    return state
