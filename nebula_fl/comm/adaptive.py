"""Adaptive compression: per cluster and round, the largest ratio/bits/rank whose upload fits a time budget.

The choice is a pure function of the link (bandwidth, RTT) and of the codec's exact encoded size at
each candidate setting (data-independent for every built-in codec, so it is measured once by
encoding a vector of the right length). The bandwidth comes from a configured link profile when one
is given, else from what the last round measured (``BandwidthTracker``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KNOBS = {"topk": "ratio", "randk": "ratio", "lowrank": "rank", "int8": "bits", "int4": "bits"}


def knob_of(spec: str) -> str | None:
    """What adaptive compression turns for a chain: its first stage's ratio, rank, or a quantizer's bits."""
    first = spec.split("+")[0].split(":")[0]
    return KNOBS.get(first)


def candidates(spec: str, *, low: float, high: float) -> list[float]:
    """The settings adaptive compression chooses among, smallest first."""
    knob = knob_of(spec)
    if knob == "ratio":
        top = min(high, 1.0)
        if low >= top:
            return [top]
        n = 24
        return [low * (top / low) ** (i / (n - 1)) for i in range(n)]
    if knob == "rank":
        return [float(r) for r in range(max(1, math.ceil(low)), math.floor(high) + 1)]
    if knob == "bits":
        return [float(b) for b in (4, 8) if low <= b <= high]
    return []


@dataclass(frozen=True)
class Choice:
    param: float
    bytes: int
    seconds: float  # serialization time of the upload at the estimated bandwidth
    fits: bool
    bandwidth_bps: float


def choose(*, sizes: Callable[[float], int], options: list[float], up_bps: float, target_s: float) -> Choice:
    """The largest option whose upload serializes within `target_s` at `up_bps`.

    Only the serialization time is budgeted: the per-request latency of the link is the same whatever
    the codec sends, so no setting can buy it back. When none fits, the smallest option is taken and
    the choice says it does not fit.
    """
    if not options:
        raise ValueError("no candidate setting to choose from")
    if not up_bps > 0:
        raise ValueError(f"bandwidth must be > 0, got {up_bps}")
    best = None
    for option in sorted(options):
        nbytes = sizes(option)
        seconds = nbytes * 8 / up_bps
        if seconds <= target_s:
            best = Choice(option, nbytes, seconds, True, up_bps)
    if best is not None:
        return best
    smallest = min(options)
    nbytes = sizes(smallest)
    return Choice(smallest, nbytes, nbytes * 8 / up_bps, False, up_bps)


def upload_seconds_estimate(
    *, elapsed_s: float, client_s: float, bytes_up: int, bytes_down: int,
    sent_at: float | None = None, arrived_at: float | None = None,
) -> float:
    """How long a cluster's reply took to upload, as far as the server can tell.

    With both wall clocks (the ClientApp stamps the reply as it hands it to its SuperNode, the server
    notes when it arrived) the answer is their difference: exact on one machine, good to the clock
    sync (NTP: milliseconds) across machines. If that is unavailable or implausible, the fallback is
    the push-to-reply time minus the cluster's own time, shared between the directions by bytes: it
    also holds the download and Flower's polling delays, so it overestimates the upload.
    """
    if sent_at is not None and arrived_at is not None and 0.0 < arrived_at - sent_at < elapsed_s:
        return arrived_at - sent_at
    comm = max(elapsed_s - client_s, 1e-3)
    total = bytes_up + bytes_down
    return comm * (bytes_up / total) if total else comm


def fit_link(observations: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares (fixed seconds, seconds per byte) of upload time = fixed + bytes / bandwidth.

    A single upload cannot tell latency from bandwidth (a small update over a fast link looks slow:
    its time is round trips, not bytes), so this needs uploads of different sizes; None until then.
    A slope at or below zero means bytes cost nothing measurable: the link is fast for this traffic.
    """
    sizes = {b for b, _ in observations}
    if len(observations) < 2 or max(sizes) < 1.5 * max(1, min(sizes)):
        return None
    n = len(observations)
    mx = sum(b for b, _ in observations) / n
    my = sum(t for _, t in observations) / n
    sxx = sum((b - mx) ** 2 for b, _ in observations)
    slope = sum((b - mx) * (t - my) for b, t in observations) / sxx
    return max(0.0, my - slope * mx), slope


TIMING_NOISE_S = 0.25  # the server sees a reply within one poll (0.2 s) of its arrival, plus scheduling jitter


class BandwidthTracker:
    """Each cluster's upload bandwidth: configured, or fitted from the last rounds' uploads.

    A fitted slope counts only if the uploads it rests on differ in serialization time by more than
    the timing noise (`noise_s`): on a fast link a 6 kB and a 20 kB upload both take round trips, not
    bytes, and a slope from them is noise, so the link reads as unlimited for uploads of that size.
    """

    def __init__(self, *, configured: dict[str, float] | None = None, window: int = 8,
                 noise_s: float = TIMING_NOISE_S) -> None:
        if window < 2:
            raise ValueError(f"window must be 2 or more uploads, got {window}")
        self.configured = dict(configured or {})
        self.window = window
        self.noise_s = noise_s
        self.observations: dict[str, list[tuple[int, float]]] = {}

    def observe(self, cluster: str, *, bytes_up: int, seconds: float) -> None:
        if bytes_up <= 0 or seconds <= 0:
            return
        seen = self.observations.setdefault(cluster, [])
        seen.append((int(bytes_up), float(seconds)))
        del seen[: -self.window]

    def seen(self, cluster: str) -> int:
        return len(self.observations.get(cluster, []))

    def get(self, cluster: str) -> float | None:
        """Bits per second: configured for this cluster, else for all ('*'), else fitted; None if unknown.

        An unmeasurably small cost per byte reads as infinitely fast (float('inf')).
        """
        if cluster in self.configured or "*" in self.configured:
            return self.configured.get(cluster, self.configured.get("*"))
        seen = self.observations.get(cluster, [])
        fit = fit_link(seen)
        if fit is None:
            return None
        _, per_byte = fit
        spread = max(b for b, _ in seen) - min(b for b, _ in seen)
        if per_byte * spread < self.noise_s:
            return float("inf")
        return 8.0 / per_byte

    def state_dict(self) -> dict[str, Any]:
        return {"observations": {k: [list(o) for o in v] for k, v in self.observations.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.observations = {str(k): [(int(b), float(t)) for b, t in v]
                             for k, v in state.get("observations", {}).items()}
