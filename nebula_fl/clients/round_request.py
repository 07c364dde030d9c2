"""A train request, parsed once: the stages of a cluster's round (``release.py``) read these fields, never the header.

What is checked here is about the request alone (so a refusal is said as it is, under secure aggregation too): a
config object, a federation id that can name a folder (it names this cluster's snapshot and reply folders), a
round number. The ranks read their training keys from `config` themselves, each refusal of theirs agreed on by
every rank (``ClusterTrainer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nebula_fl.clients.reply_cache import FEDERATION_ID
from nebula_fl.errors import NebulaError


class BadRequest(NebulaError):
    """A train request that is not one; its one line names only what the server sent."""


@dataclass(frozen=True, kw_only=True)
class RoundRequest:
    config: dict[str, Any]  # the server's flat round config, as it came
    arrays: dict[str, Any]  # the global arrays (or the downlink blob)
    federation: str  # a plain name of letters, digits, '-' and '_'
    number: int  # the server round, >= 1
    masked: bool  # securely aggregated: the config names a secure-aggregation epoch
    codec_up: str | None  # the uplink codec the server asks for; None: the raw update goes up
    riding: Any  # the last round's unmask request riding on this one (round-overlap), else None

    @classmethod
    def parse(cls, header: dict[str, Any]) -> RoundRequest:
        config = header.get("config")
        if not isinstance(config, dict):
            raise BadRequest("the request has no config object")
        federation, number = config.get("federation-id"), config.get("server-round")
        if not isinstance(federation, str) or not FEDERATION_ID.fullmatch(federation):
            raise BadRequest(f"federation id {federation!r} is not a plain name of letters, digits, '-' and '_'")
        if isinstance(number, bool) or not isinstance(number, int) or number < 1:
            raise BadRequest(f"server-round {number!r} is not a round number (an integer >= 1)")
        return cls(config=config, arrays=header.get("arrays", {}), federation=federation, number=number,
                   masked="secagg-epoch" in config,
                   codec_up=None if "codec-up" not in config else str(config["codec-up"]),
                   riding=header.get("secagg"))
