"""Overlapped rounds: what a cluster trains while the network carries its update, and how that is merged.

Blocking, a cluster sends round r's update and idles until round r+1's message brings the new global
adapter G_r: on an accelerator that wait is most of the round (Flower hops of seconds against steps of
milliseconds). Overlapped, it trains on at once from its own weights, and the merge is a *rebase*:

    on round r+1's message:  u = W − A          (everything trained since the last send, sent once)
                             W ← G_r + u,  A ← W (the progress not yet in any global, kept on the new one)

A is the anchor, the weights right after the last send. G_r already holds this cluster's previous update
(averaged with the others'), so only u, which no global holds yet, is carried over: no step is lost and none
is counted twice. Each update is thus computed from a point one round stale — the server's outer step is
unchanged and applies it one round late, which "eager updates" (Kale et al. 2025) show costs no loss for
DiLoCo-style training. Streaming DiLoCo's mixing (W ← α W + (1 − α) G) would instead discard part of the
overlap's progress that was never sent; the rebase keeps all of it.

With fixed `local-steps` the rebase happens after exactly those steps whatever the timing (a message that
arrives early waits for them), so overlapped runs stay bit-reproducible and `--resume` exact. Time-budgeted
(`local-steps = "auto"`), a cluster trains until the next message arrives, so its step count depends on the
network: not reproducible, by design.

Progress trained ahead is released only with the round it was trained for (the next one); if that round
does not come next for this cluster (it was not sampled, its request changed the privacy mechanism, the
server skipped it), the cluster returns to its last snapshot: under per-example DP every noised gradient that
can influence a release must be charged, and one that never is must not influence any.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nebula_fl.privacy.policy import Admission

Arrays = dict[str, np.ndarray]


@dataclass
class Ahead:
    """What a cluster trained since its last send, not yet sent (never snapshotted: a restart retrains it)."""

    steps: int = 0
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    admission: Admission | None = None  # the mechanism those steps ran under (their release must be the same)


def rebased(new_global: Arrays, update: Arrays) -> Arrays:
    """The cluster's weights after a send: the new global plus the progress it just sent, which no global holds
    yet. float32 throughout, as the exchanged tensors are."""
    return {k: (np.asarray(new_global[k], dtype=np.float32) + update[k]).astype(np.float32) for k in update}


def steps_on_arrival(*, fixed: int | None, ahead: int, overlap: bool) -> int | None:
    """Steps still to train when a round's message arrives: a count, or None for "train for `round-seconds`".

    Fixed steps: what the round still lacks (all of them when blocking). Time-budgeted and overlapped: nothing
    more once anything was trained ahead (the message marks the end of the round's time); else the budget."""
    if fixed is not None:
        return max(0, fixed - ahead)
    if overlap and ahead >= 1:
        return 0
    return None


def steps_ahead(*, fixed: int | None, cap: int, ahead: int) -> int:
    """Steps to train ahead now, between messages: the rest of a fixed round at once (the next message needs
    them all), or one at a time up to the cap when time-budgeted (the next message ends the round)."""
    if fixed is not None:
        return max(0, min(fixed, cap) - ahead)
    return 1 if ahead < cap else 0


def same_mechanism(trained: Admission | None, asked: Admission) -> bool:
    """Whether steps trained under `trained` may be released by a round admitted as `asked`: the same privacy
    mode, σ, clipping norm and sampling rate (Opacus noised them already)."""
    if trained is None:
        return False
    if trained.mode != asked.mode:
        return False
    if asked.mode != "sample":  # no per-step mechanism: client-level noise is added at release
        return True
    return (trained.noise_multiplier == asked.noise_multiplier and trained.max_grad_norm == asked.max_grad_norm
            and trained.sample_rate == asked.sample_rate)


def ahead_usable(ahead: Ahead, *, server_round: int, last_round: int | None, asked: Admission, cap: int) -> str | None:
    """Why the progress trained ahead cannot go into round `server_round`'s update, or None if it can."""
    if ahead.steps == 0:
        return None
    if last_round is None or server_round != last_round + 1:
        return f"it was trained for round {None if last_round is None else last_round + 1}, this is round {server_round}"
    if not same_mechanism(ahead.admission, asked):
        return "the round's privacy mechanism differs from the one it was trained under"
    if ahead.steps > cap or (asked.mode == "sample" and ahead.steps > asked.steps):
        return f"{ahead.steps} steps were trained ahead, more than the {min(cap, asked.steps or cap)} this round admits"
    return None


def busy(*, busy_s: float, since_send_s: float | None) -> dict[str, Any]:
    """The reply's timing of the cluster's whole cycle: training seconds since its previous send, and the wall
    seconds since then (absent on its first round)."""
    out: dict[str, Any] = {"busy-seconds": float(busy_s)}
    if since_send_s is not None:
        out["since-send-seconds"] = float(since_send_s)
    return out
