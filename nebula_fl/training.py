"""The inner loop a cluster's trainer runs, public for code that must train exactly as a cluster does.

A baseline that claims "nebula-fl's own inner loop" (a centralized run on the pooled data, a stock Flower
ClientApp, a one-process DP ablation) takes these three names from here: the batch order
(`BatchSchedule`: batch k depends only on seed, rank and k), the learning-rate schedule (`scheduled_lr`, and
`warmed_lr` with its warm-up)
and the steps themselves (`train_steps`: AdamW steps on a task's loss, clipped, optionally under bf16
autocast). They are the objects the trainer calls, not copies, so a change to the inner loop reaches every
baseline at once; everything else in `nebula_fl.clients` (the trainer's service, exchange, snapshots) stays
private.

This is a public module of the package rather than a function of `benchmarks/harness.py` because the stock
Flower baseline runs inside Flower's own processes (a fresh `flwr-clientapp` per message) and can import
installed packages only, never a script beside the benchmarks.
"""

from __future__ import annotations

from nebula_fl.clients.inner_loop import BatchSchedule, scheduled_lr, train_steps, warmed_lr

__all__ = ["BatchSchedule", "scheduled_lr", "train_steps", "warmed_lr"]
