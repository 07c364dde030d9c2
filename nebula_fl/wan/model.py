"""A first-order wall-time model of one federated round of one cluster over its WAN link.

    wan   = bytes_up x 8 / up_bps + bytes_down x 8 / down_bps                   (serialization)
          + (ceil(requests_up / k) + ceil(requests_down / k)) x (rtt + jitter)   (latency)
    round = wan + compute_s

``k`` is ``max_in_flight``: Flower 1.42 sends each array object as its own HTTP request with at most
2 in flight, so requests cost round trips in waves of k. ``rtt + jitter`` is the mean round trip of the
proxy (each one-way trip adds U(0, jitter)). The terms are added, not overlapped — a bound that is
tight when a round's traffic is few large requests (serialization-bound) or many small ones
(latency-bound); the WAN proxy's measurements calibrate it. Byte counts are what crosses the link,
HTTP headers included (the proxy's ``bytes_up`` / ``bytes_down``), and request counts the HTTP
requests that carry the round's uploads and downloads (the proxy's ``requests_by_path``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nebula_fl.wan.profile import LinkProfile


def _count(name: str, value: Any, *, integer: bool) -> None:
    kinds = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value < 0:
        what = "a whole number" if integer else "a number"
        raise ValueError(f"{name} is {value!r}; pass {what} of 0 or more")


def round_trips(requests: int, max_in_flight: int = 2) -> int:
    """Round trips that ``requests`` take when at most ``max_in_flight`` are outstanding at once."""
    _count("requests", requests, integer=True)
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise ValueError(f"max_in_flight is {max_in_flight!r}; pass a whole number of 1 or more")
    return -(-requests // max_in_flight)


@dataclass(frozen=True)
class RoundTime:
    """One round's modelled wall time, in seconds, split into the model's terms."""

    serialization_up_s: float
    serialization_down_s: float
    latency_s: float
    compute_s: float = 0.0

    @property
    def wan_s(self) -> float:
        return self.serialization_up_s + self.serialization_down_s + self.latency_s

    @property
    def total_s(self) -> float:
        return self.wan_s + self.compute_s

    def to_json(self) -> dict[str, float]:
        return {"serialization_up_s": self.serialization_up_s, "serialization_down_s": self.serialization_down_s,
                "latency_s": self.latency_s, "compute_s": self.compute_s, "wan_s": self.wan_s, "total_s": self.total_s}


def estimate_round(*, profile: LinkProfile, bytes_up: int | float, bytes_down: int | float, requests_up: int,
                   requests_down: int, compute_s: float = 0.0, max_in_flight: int = 2) -> RoundTime:
    """The model's terms for one round (see the module docstring)."""
    if not isinstance(profile, LinkProfile):
        raise ValueError(f"profile is {type(profile).__name__}; pass a LinkProfile, e.g. parse_profile('20mbit:100ms')")
    _count("bytes_up", bytes_up, integer=False)
    _count("bytes_down", bytes_down, integer=False)
    _count("compute_s", compute_s, integer=False)
    trips = round_trips(requests_up, max_in_flight) + round_trips(requests_down, max_in_flight)
    return RoundTime(
        serialization_up_s=profile.transfer_seconds(bytes_up, "up"),
        serialization_down_s=profile.transfer_seconds(bytes_down, "down"),
        latency_s=trips * (profile.rtt_s + profile.jitter_s),
        compute_s=float(compute_s),
    )


def wan_seconds(*, profile: LinkProfile, bytes_up: int | float, bytes_down: int | float, requests_up: int,
                requests_down: int, max_in_flight: int = 2) -> float:
    """Communication time of one round: serialization both ways plus request round trips."""
    return estimate_round(profile=profile, bytes_up=bytes_up, bytes_down=bytes_down, requests_up=requests_up,
                          requests_down=requests_down, max_in_flight=max_in_flight).wan_s


def round_seconds(*, profile: LinkProfile, bytes_up: int | float, bytes_down: int | float, requests_up: int,
                  requests_down: int, compute_s: float, max_in_flight: int = 2) -> float:
    """Wall time of one round: ``wan_seconds`` plus the cluster's compute (training, evaluation)."""
    return estimate_round(profile=profile, bytes_up=bytes_up, bytes_down=bytes_down, requests_up=requests_up,
                          requests_down=requests_down, compute_s=compute_s, max_in_flight=max_in_flight).total_s
