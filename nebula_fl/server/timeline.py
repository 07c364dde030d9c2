"""Where a round's time went: the server's phases, each cluster's, and the framework overhead.

A round is push → clusters pick the message up (`wait_s`: the SuperNode's poll, the download, SuperExec's
poll, the runner's poll; `start_s`: the runner fetching the message for nebula-fl's ClientApp) → train → encode → upload (SuperNode's reply poll, the upload, the server's poll) → decode
and aggregate → evaluate → checkpoint. The server times its own phases on its monotonic clock; a
cluster's pickup and upload span two machines and are computed from wall clocks (the ClientApp's
`received-at` and `reply-sent-at` against the server's push and arrival), so across machines they
carry the clock offset between them. Transfer is the seconds the emulated WAN had this cluster's
bytes on the wire (measured by its proxy), absent without one.

overhead = round − the slowest cluster's (compute + transfer) − server evaluation: what neither the
clusters' work, nor the link, nor the evaluation explains — polls, process start-ups, (de)serialization,
aggregation and bookkeeping.

Utilisation, from the cluster's side: between its previous send and this one (`since-send-seconds`) a cluster
trained `busy-seconds` (background training under `round-overlap` included). busy_fraction = busy / since-send
and idle_s = since-send − busy say how much of a cluster's accelerator time the federation wasted on waiting
(for the network, the server, the slowest cluster); the round keeps the worst of each (busy_fraction_min,
idle_s_max), the number to watch when tuning `local-steps = "auto"` and `round-overlap`.
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
        born = _num(metrics.get("task-started-at"))
        if born is not None and pushed_at <= born <= received:  # pickup = waiting for the runner + pulling the message
            out["wait_s"], out["start_s"] = born - pushed_at, received - born
    for key, name in (("client-seconds", "compute_s"), ("seconds", "train_s"), ("encode-seconds", "encode_s")):
        if (value := _num(metrics.get(key))) is not None:
            out[name] = value
    if arrived_at is not None and sent is not None:
        out["upload_s"] = max(0.0, arrived_at - sent)
    if wire_s is not None:
        out["transfer_s"] = float(wire_s)
    out.update(utilisation(busy_s=_num(metrics.get("busy-seconds")),
                           since_send_s=_num(metrics.get("since-send-seconds"))))
    return out


def utilisation(*, busy_s: float | None, since_send_s: float | None) -> dict[str, float]:
    """A cluster's busy_fraction and idle_s between two sends; empty when either is unknown (a cluster's first
    round, a restarted trainer) or the interval is not positive.

    The two come from different clocks in the cluster (its trainer times its steps, its ClientApp its sends),
    so busy may overshoot the interval by a little: the fraction is clamped to [0, 1] and idle to >= 0.
    """
    if busy_s is None or since_send_s is None or not since_send_s > 0:
        return {}
    return {"busy_fraction": min(1.0, max(0.0, busy_s / since_send_s)), "idle_s": max(0.0, since_send_s - busy_s)}


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
    busy = [c["busy_fraction"] for c in clusters.values() if "busy_fraction" in c]
    idle = [c["idle_s"] for c in clusters.values() if "idle_s" in c]
    if busy:
        timeline["busy_fraction_min"] = min(busy)
    if idle:
        timeline["idle_s_max"] = max(idle)
    timeline["clusters"] = {cid: dict(c) for cid, c in clusters.items()}
    return timeline


def utilisation_note(timeline: Mapping[str, Any]) -> str:
    """The round's utilisation for its one console line, the worst cluster's: "busy min 87%, idle max 1.2 s", or
    "busy n/a" when no cluster reported it (every cluster's first round, or clusters that do not measure it)."""
    busy, idle = timeline.get("busy_fraction_min"), timeline.get("idle_s_max")
    if busy is None or idle is None:
        return "busy n/a"
    return f"busy min {100 * busy:.0f}%, idle max {idle:.1f} s"


def _critical(phases: Mapping[str, float]) -> float:
    return phases.get("compute_s", 0.0) + phases.get("transfer_s", 0.0)


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
