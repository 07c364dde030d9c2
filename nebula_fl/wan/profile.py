"""A cluster's WAN access link: rate each way, round-trip time and jitter, and its text form.

Text form (``--wan`` style): ``RATE:RTT`` or ``RATE:RTT:JITTER``, where ``RATE`` is one rate for both
directions or ``DOWN/UP``; rates take ``kbit``, ``mbit`` or ``gbit`` (decimal, bits per second),
times ``ms`` or ``s``. ``20mbit:100ms`` is 20 Mbit/s each way and 100 ms round trip (50 ms one way);
``100mbit/20mbit:50ms`` downloads at 100 and uploads at 20 Mbit/s; ``1gbit:2ms:1ms`` adds up to 1 ms
of jitter to each one-way trip. "Up" is SuperNode -> SuperLink (the cluster's upload), "down" the reverse.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from nebula_fl.errors import ConfigError

Direction = Literal["up", "down"]
DIRECTIONS: tuple[Direction, ...] = ("up", "down")

_RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_TIME_UNITS = {"ms": 1e-3, "s": 1.0}
_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$")
_EXAMPLES = "e.g. 20mbit:100ms, 100mbit/20mbit:50ms or 1gbit:2ms:1ms"


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"LinkProfile.{name} must be a finite number, got {value!r}; pass seconds or bits per second")
    return float(value)


@dataclass(frozen=True)
class LinkProfile:
    """One access link between a cluster and the SuperLink, as the WAN proxy emulates it.

    ``down_bps`` / ``up_bps`` are bits per second (SuperLink -> SuperNode / SuperNode -> SuperLink),
    ``rtt_s`` the round-trip propagation delay (half of it each way), and ``jitter_s`` the upper bound
    of an extra one-way delay drawn uniformly per chunk, so a round trip takes rtt to rtt + 2 x jitter.
    """

    down_bps: float
    up_bps: float
    rtt_s: float
    jitter_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("down_bps", "up_bps"):
            value = _number(name, getattr(self, name))
            if value <= 0:
                raise ConfigError(f"LinkProfile.{name} is {value}; a link rate must be positive bits per second")
            object.__setattr__(self, name, value)
        for name in ("rtt_s", "jitter_s"):
            value = _number(name, getattr(self, name))
            if value < 0:
                raise ConfigError(f"LinkProfile.{name} is {value}; a delay must be 0 or more seconds")
            object.__setattr__(self, name, value)

    @property
    def one_way_s(self) -> float:
        """Propagation delay of one direction: half the round trip."""
        return self.rtt_s / 2

    def rate_bps(self, direction: Direction) -> float:
        if direction == "up":
            return self.up_bps
        if direction == "down":
            return self.down_bps
        raise ValueError(f"direction is {direction!r}; use 'up' (SuperNode -> SuperLink) or 'down'")

    def transfer_seconds(self, nbytes: int | float, direction: Direction) -> float:
        """Serialization time of ``nbytes`` in one direction: nbytes x 8 / rate (no latency)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int | float) or not nbytes >= 0:
            raise ValueError(f"nbytes is {nbytes!r}; pass a byte count of 0 or more")
        return nbytes * 8 / self.rate_bps(direction)

    @property
    def spec(self) -> str:
        """The text form, which ``parse_profile`` reads back to this profile."""
        rate = _format_rate(self.down_bps)
        if self.up_bps != self.down_bps:
            rate = f"{rate}/{_format_rate(self.up_bps)}"
        text = f"{rate}:{_format_time(self.rtt_s)}"
        return f"{text}:{_format_time(self.jitter_s)}" if self.jitter_s else text

    def __str__(self) -> str:
        return self.spec

    def to_json(self) -> dict[str, Any]:
        return {"down_bps": self.down_bps, "up_bps": self.up_bps, "rtt_s": self.rtt_s, "jitter_s": self.jitter_s,
                "spec": self.spec}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LinkProfile:
        """The inverse of ``to_json`` (``spec`` is ignored: the numbers are authoritative)."""
        try:
            return cls(down_bps=data["down_bps"], up_bps=data["up_bps"], rtt_s=data["rtt_s"],
                       jitter_s=data.get("jitter_s", 0.0))
        except (KeyError, TypeError) as err:
            raise ConfigError(f"a link profile object needs down_bps, up_bps and rtt_s; got {data!r} ({err})") from None


def _format_rate(bps: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6)):
        if bps >= scale:
            return f"{bps / scale:.12g}{unit}"
    return f"{bps / 1e3:.12g}kbit"


def _format_time(seconds: float) -> str:
    if seconds >= 1 and float(seconds).is_integer():
        return f"{seconds:.0f}s"
    return f"{seconds * 1e3:.12g}ms"


def _quantity(text: str, part: str, units: dict[str, float], what: str, example: str) -> float:
    match = _QUANTITY.match(part)
    if not match or match.group(2) not in units:
        if match and match.group(2) == "" and float(match.group(1)) == 0 and what == "time":
            return 0.0
        names = ", ".join(units)
        raise ConfigError(
            f"WAN profile {text!r}: the {what} {part.strip()!r} needs a number followed by one of {names}, "
            f"e.g. {example} (whole profiles look like {_EXAMPLES.removeprefix('e.g. ')})"
        )
    return float(match.group(1)) * units[match.group(2)]


def parse_profile(text: str) -> LinkProfile:
    """Read ``RATE:RTT[:JITTER]`` with ``RATE`` = ``R`` or ``DOWN/UP`` (see the module docstring)."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"WAN profile {text!r} is empty; write RATE:RTT[:JITTER], {_EXAMPLES}")
    parts = text.strip().lower().split(":")
    if len(parts) not in (2, 3):
        raise ConfigError(
            f"WAN profile {text!r} has {len(parts)} ':'-separated field(s); write RATE:RTT or RATE:RTT:JITTER, "
            f"{_EXAMPLES}"
        )
    rates = parts[0].split("/")
    if len(rates) > 2:
        raise ConfigError(f"WAN profile {text!r}: the rate {parts[0]!r} has more than one '/'; write RATE or DOWN/UP")
    down = _quantity(text, rates[0], _RATE_UNITS, "rate", "20mbit")
    up = _quantity(text, rates[-1], _RATE_UNITS, "rate", "20mbit")
    rtt = _quantity(text, parts[1], _TIME_UNITS, "time", "100ms")
    jitter = _quantity(text, parts[2], _TIME_UNITS, "time", "5ms") if len(parts) == 3 else 0.0
    try:
        return LinkProfile(down_bps=down, up_bps=up, rtt_s=rtt, jitter_s=jitter)
    except ConfigError as err:
        raise ConfigError(f"WAN profile {text!r}: {err}") from None


def parse_profiles(text: str, clusters: int) -> list[LinkProfile]:
    """One profile per cluster from a comma-separated list holding one profile for all, or one each."""
    if isinstance(clusters, bool) or not isinstance(clusters, int) or clusters < 1:
        raise ConfigError(f"parse_profiles needs clusters >= 1, got {clusters!r}")
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"WAN profiles {text!r} are empty; give one profile for all clusters or {clusters}, "
                          f"comma-separated, {_EXAMPLES}")
    items = [item.strip() for item in text.split(",")]
    if any(not item for item in items):
        raise ConfigError(f"WAN profiles {text!r} contain an empty entry; remove the stray comma")
    if len(items) not in (1, clusters):
        raise ConfigError(
            f"WAN profiles {text!r} give {len(items)} profiles for {clusters} clusters; "
            f"give one profile for all clusters or exactly one per cluster, comma-separated"
        )
    profiles = [parse_profile(item) for item in items]
    return profiles * clusters if len(profiles) == 1 else profiles
