"""Overlapped rounds: what a cluster trains while the network carries its update, and how that is merged.

Blocking, a cluster sends round r's update and idles until round r+1's message brings the new global
adapter: on an accelerator that wait is most of the round (Flower hops of seconds against steps of
milliseconds). Overlapped, it trains on at once from its own weights, and the merge is a *rebase*:

    on round n's message (global G, which holds every round <= k, "global-round" = k):
        u_n = W - A                                   everything trained since the last send, sent once
        W <- G + sum of this cluster's u_r, k < r <= n   A <- W

A is the anchor, the weights right after the last send. The message says which rounds G holds: a round
<= k was decided (its sum applied, or dropped for good as a blocking round's would be), a later one was not.
The cluster keeps its own updates of the undecided rounds (`Unapplied`) and carries them on G, so no step is
lost and none is counted twice, whatever the server's schedule:

    blocking                      k = n - 1, nothing trained ahead: W <- G (the rule with nothing carried)
    overlapped                    k = n - 1: W <- G + u_n; each update is one round stale
    overlapped, secure aggregation  k = n - 2 (round n-1's sum is unmasked from answers riding on round n's
                                  message, applied one round late): W <- G + u_{n-1} + u_n; each update is
                                  one round stale, and G two rounds old

The server's outer step is unchanged and applies each update late. With FedAvg (outer lr 1) that is exact: the
global moves by the mean of the updates, so the clusters' mean anchor is the new global and overlapped training
follows blocking's trajectory (one round late under secure aggregation; tests/mode_equivalence.py). A momentum or
adaptive outer step moves the global by more than the mean, and momentum on late updates can diverge: the
server warns (strategies/staleness.py, with the rates measured to converge). Streaming DiLoCo's mixing (W <- a W + (1 - a) G) would instead
discard part of the overlap's progress that was never sent; the rebase keeps all of it. The round number is
never inferred: a cluster that assumed k = n - 1 under secure aggregation dropped its own u_{n-1} from its
weights, relearned it, and sent it twice (the error followed e_{n+1} = e_{n-1} - e_{n-2}: divergence).

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


def rebased(new_global: Arrays, *updates: Arrays) -> Arrays:
    """The cluster's weights after a send: the new global plus the progress it sent that the global does not hold
    yet, added in round order. float32 throughout, as the exchanged tensors are."""
    out = {k: np.asarray(v, dtype=np.float32).copy() for k, v in new_global.items()}
    for update in updates:
        for k in out:
            out[k] = (out[k] + update[k]).astype(np.float32)
    return out


@dataclass
class Unapplied:
    """This cluster's own sent updates that no global it received holds yet, by round.

    `base(G, global_round=k)` is where the cluster goes on after a send: G plus each kept update of a round > k;
    updates of rounds <= k are dropped (G holds them, or they were dropped for good). Kept only while rounds
    overlap: a blocking cluster trains from G, and so does one whose kept updates are all decided."""

    updates: dict[int, Arrays] = field(default_factory=dict)

    def keep(self, server_round: int, update: Arrays) -> None:
        self.updates[int(server_round)] = {k: np.asarray(v, dtype=np.float32).copy() for k, v in update.items()}

    def decided(self, global_round: int) -> None:
        """Forget every update of a round <= `global_round`: the global holds it or never will."""
        for r in [r for r in self.updates if r <= global_round]:
            del self.updates[r]

    def base(self, new_global: Arrays, *, global_round: int) -> Arrays:
        """G plus every kept update the global does not hold (after forgetting those it does)."""
        self.decided(global_round)
        return rebased(new_global, *(self.updates[r] for r in sorted(self.updates)))

    def clear(self) -> None:
        self.updates.clear()

    def state_dict(self) -> dict[str, Any]:
        """Tensors, as a snapshot holds them (torch.load(weights_only=True) reads them back)."""
        import torch

        return {"unapplied": {str(r): {k: torch.from_numpy(v.copy()) for k, v in u.items()}
                              for r, u in self.updates.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("unapplied") or {}
        self.updates = {int(r): {k: np.asarray(v, dtype=np.float32).copy() for k, v in u.items()}
                        for r, u in saved.items()}


def global_round_of(config: dict[str, Any], *, server_round: int) -> int:
    """The last round the message's global holds ("global-round"): said by the server, never inferred; it must
    be an integer in [0, server_round - 1]. A ValueError says what is wrong and how to fix it."""
    value = config.get("global-round")
    if value is None:
        raise ValueError(f"round {server_round}'s message does not say which rounds its global adapter holds "
                         "('global-round'); the server is older than this cluster: upgrade it")
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise ValueError(f"round {server_round}'s 'global-round' is {value!r}; it must be an integer")
    if not 0 <= int(value) < server_round:
        raise ValueError(f"round {server_round}'s 'global-round' is {int(value)}; a global can hold rounds "
                         f"0..{server_round - 1} only")
    return int(value)


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
