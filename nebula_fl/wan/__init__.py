"""An emulated WAN between each cluster and the SuperLink: link profiles, the proxy, its process, a time model.

``profile.py`` reads ``20mbit:100ms``-style link profiles; ``proxy.py`` is the asyncio TCP proxy that
imposes them and counts what crosses; ``service.py`` runs one as a process (``python -m nebula_fl.wan``)
with a Unix control socket that ``control.query_proxy`` talks to; ``model.py`` predicts a round's wall
time from bytes, requests and the profile. Nothing here imports torch or Flower.
"""

from nebula_fl.wan.control import ControlError, query_proxy
from nebula_fl.wan.model import RoundTime, estimate_round, round_seconds, round_trips, wan_seconds
from nebula_fl.wan.profile import LinkProfile, parse_profile, parse_profiles
from nebula_fl.wan.proxy import WanProxy

__all__ = [
    "ControlError",
    "LinkProfile",
    "RoundTime",
    "WanProxy",
    "estimate_round",
    "parse_profile",
    "parse_profiles",
    "query_proxy",
    "round_seconds",
    "round_trips",
    "wan_seconds",
]
