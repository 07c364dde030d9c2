"""Where a round's time went: the server's phases, each cluster's, and the framework overhead.

A round is push → clusters pick the message up (`wait_s`: the SuperNode's poll, the download, SuperExec's
poll; `start_s`: a fresh ClientApp process starting, importing, fetching the message) → train → encode → upload (SuperNode's reply poll, the upload, the server's poll) → decode
and aggregate → evaluate → checkpoint. The server times its own phases on its monotonic clock; a
cluster's pickup and upload span two machines and are computed from wall clocks (the ClientApp's
`received-at` and `reply-sent-at` against the server's push and arrival), so across machines they
carry the clock offset between them. Transfer is the seconds the emulated WAN had this cluster's
bytes on the wire (measured by its proxy), absent without one.

overhead = round − the slowest cluster's (compute + transfer) − server evaluation: what neither the
clusters' work, nor the link, nor the evaluation explains — polls, process start-ups, (de)serialization,
aggregation and bookkeeping.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CLUSTER_PHASES = ("pickup_s", "wait_s", "start_s", "compute_s", "train_s", "encode_s", "upload_s", "transfer_s")


def cluster_phases(*, pushed_at: float | None, arrived_at: float | None, metrics: Mapping[str, Any],
                   wire_s: float | None) -> dict[str, float]:
    """One cluster's phases from its reply's metrics and the server's push/arrival times; what is unknown is left
    out (an error reply has no metrics, a run without an emulated WAN has no transfer)."""
    out: dict[str, float] = {}
    received, sent = _num(metrics.get("received-at")), _num(metrics.get("reply-sent-at"))
    if pushed_at is not None and received is not None:
        out["pickup_s"] = max(0.0, received - pushed_at)
        born = _num(metrics.get("process-started-at"))
        if born is not None and pushed_at <= born <= received:  # pickup = waiting for a process + its start-up
            out["wait_s"], out["start_s"] = born - pushed_at, received - born
    for key, name in (("client-seconds", "compute_s"), ("seconds", "train_s"), ("encode-seconds", "encode_s")):
        if (value := _num(metrics.get(key))) is not None:
            out[name] = value
    if arrived_at is not None and sent is not None:
        out["upload_s"] = max(0.0, arrived_at - sent)
    if wire_s is not None:
        out["transfer_s"] = float(wire_s)
    return out


def round_timeline(*, seconds: float, phases: Mapping[str, float],
                   clusters: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """The round's timeline: the server's phases, each cluster's, the slowest cluster and the overhead."""
    timeline: dict[str, Any] = {"round_s": float(seconds), **{k: float(v) for k, v in phases.items()}}
    timed = {cid: c for cid, c in clusters.items() if "compute_s" in c}
    critical = 0.0
    if timed:
        slowest = max(timed, key=lambda cid: _critical(timed[cid]))
        critical = _critical(timed[slowest])
        timeline.update(slowest_cluster=slowest, slowest_compute_s=timed[slowest]["compute_s"],
                        slowest_transfer_s=timed[slowest].get("transfer_s", 0.0))
    timeline["overhead_s"] = max(0.0, float(seconds) - critical - float(phases.get("evaluate_s", 0.0)))
    timeline["clusters"] = {cid: dict(c) for cid, c in clusters.items()}
    return timeline


def _critical(phases: Mapping[str, float]) -> float:
    return phases.get("compute_s", 0.0) + phases.get("transfer_s", 0.0)


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
