"""Which nebula-fl a cluster runs, and whether this server can work with it.

Every host of a federation runs its own install of nebula-fl. What a round's messages and replies carry, and what
their keys mean, is nebula-fl's: two installs that disagree on it must not mix silently (a key read with another
meaning, an update decoded with another layout). `PROTOCOL` changes whenever a message, reply or trainer request
changes shape or meaning; a cluster names its version and protocol in every reply (the ``nebula`` record), and the
server refuses a reply of another protocol, or one that names none, with a line naming both installs. Releases
that keep the protocol mix (the app bundle still names one version: ``clients/bundle_check.py``).
"""

from __future__ import annotations

from typing import Any

from nebula_fl import __version__

PROTOCOL = 1
RECORD = "nebula"  # the ConfigRecord of every reply that names the cluster's install
UPGRADE = "install the same nebula-fl on the server and every cluster (docs: Across machines, Upgrading a federation)"


def stamp() -> dict[str, Any]:
    """What a cluster says of its install in every reply."""
    return {"version": __version__, "protocol": PROTOCOL}


def refusal(said: dict[str, Any] | None, *, who: str) -> str | None:
    """Why this server cannot take a reply whose ``nebula`` record is `said` (None when it can): one line."""
    said = said or {}
    version, protocol = said.get("version"), said.get("protocol")
    if isinstance(protocol, int) and not isinstance(protocol, bool) and protocol == PROTOCOL:
        return None
    theirs = (f"nebula-fl {version} (protocol {protocol})" if isinstance(version, str) and protocol is not None
              else "a nebula-fl that names no protocol version (older than 0.1.0's protocol 1, or not nebula-fl)")
    return f"{who} runs {theirs}; this server runs nebula-fl {__version__} (protocol {PROTOCOL}): {UPGRADE}"
