"""Which outer optimizers suit updates applied one round late (`round-overlap`), and what to tell a user who
picks another.

Overlapped, a cluster goes on from G + its own unapplied updates (clients/overlap.py): exact when the global
moves by the mean of the updates, as FedAvg's does at outer lr 1. A momentum or adaptive outer step moves it by
more (heavy ball: up to lr / (1 - momentum) times the mean), and on one-round-stale updates that is the classic
unstable pair, delay and momentum. The mode-equivalence harness (tests/mode_equivalence.py: a quadratic with a
known optimum, the real strategy and cluster code against an independent reference) measured it: fedavgm at its
defaults (lr 1, momentum 0.9) diverges overlapped (x1.10 per round; it converges at lr 0.1), adam (lr 0.05)
stalls at 5e-2 where blocking reaches 1e-9, and nesterov at DiLoCo's (0.7, 0.9) converges overlapped but
diverges slowly with secure aggregation (its global is two rounds old; it converges at lr 0.35). The code does
what the algorithm says in every case: the harness checks that too. So it is a warning, not a refusal: a
real loss surface is not that quadratic, and lower outer rates are the user's call.
"""

from __future__ import annotations

PLAIN = frozenset({"fedavg", "flwr:FedAvg", "flwr:FedProx", "flwr:FedMedian", "flwr:FedTrimmedAvg", "flwr:Krum",
                   "flwr:MultiKrum", "flwr:Bulyan"})
WITH_STATE = frozenset({"fedavgm", "nesterov", "adam", "flwr:FedAvgM", "flwr:FedAdam", "flwr:FedYogi",
                        "flwr:FedAdagrad"})


def stale_step_warning(*, outer: str, overlap: bool, secure: bool) -> str | None:
    """A one-line warning when `round-overlap` meets an outer optimizer with momentum or adaptive state, else None
    (a plug-in's step is its author's to judge: nothing is said)."""
    if not overlap or outer not in WITH_STATE:
        return None
    late = "two rounds" if secure else "one round"
    return (f"round-overlap with outer-optimizer '{outer}': each update is applied one round late (the global on a "
            f"round's message is {late} old), and momentum or adaptive outer steps on late updates can diverge "
            "(measured on a quadratic: fedavgm at lr 1, momentum 0.9 diverged; adam stalled; nesterov 0.7/0.9 "
            "diverged slowly under secure aggregation); lower outer-lr (fedavgm converged at 0.1, nesterov at 0.35) "
            "or use fedavg, and watch the first rounds")
