"""Bytes the emulated WAN really carried, per cluster and round, read from each cluster's proxy."""

from __future__ import annotations

from logging import WARNING
from typing import Any

from flwr.supercore import log

FIELDS = ("bytes_up", "bytes_down", "requests", "connections", "push_objects", "pull_objects")
# The requests that carry a round's payload (one per object each way), as Flower 1.42 names them.
PATHS = {"push_objects": "/v1/fleet/push-object", "pull_objects": "/v1/fleet/pull-object"}


class WanCounters:
    """Per-round differences of the proxies' cumulative counters; cluster id = position in the list."""

    def __init__(self, control_sockets: list[str]) -> None:
        self.sockets = {str(i): path for i, path in enumerate(control_sockets) if path}
        self.last: dict[str, dict[str, float]] = {cid: dict.fromkeys(FIELDS, 0) for cid in self.sockets}

    @classmethod
    def from_config(cls, text: str) -> WanCounters | None:
        paths = [p.strip() for p in text.split(",") if p.strip()]
        return cls(paths) if paths else None

    def read_round(self) -> dict[str, dict[str, Any]]:
        """Counters since the previous call (the first call counts from the proxy's start)."""
        from nebula_fl.wan.service import query_proxy

        out: dict[str, dict[str, Any]] = {}
        for cid, path in self.sockets.items():
            try:
                stats = query_proxy(path, "stats")
            except Exception as err:  # a proxy gone is worth a warning, never a failed round
                log(WARNING, "cannot read the WAN proxy of cluster %s: %s", cid, err)
                continue
            by_path = stats.get("requests_by_path", {})
            now: dict[str, float] = {k: int(by_path.get(PATHS[k], 0)) if k in PATHS else int(stats.get(k, 0))
                                     for k in FIELDS}
            now["wire_seconds"] = float(stats.get("wire_seconds", 0.0))
            out[cid] = {f"wan_{k}": now[k] - self.last[cid].get(k, 0) for k in (*FIELDS, "wire_seconds")}
            self.last[cid] = now
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"last": self.last}
