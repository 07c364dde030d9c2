"""FedProx's proximal term on a cluster: local training pulled toward the global weights the round brought.

FedProx (Li et al. 2020) has each client minimise F_k(w) + (mu / 2) ||w − w_g||², w_g the global weights of the
round, so that clusters with skewed data drift less from the global model (`prox-mu`; 0 = plain local training).
The term's gradient, mu (w − w_g), depends on no example, so it is added to each exchanged parameter's gradient
just before the inner optimizer steps (a step pre-hook on it), rather than to the task's loss:

- after DDP's all-reduce and FSDP's reduce-scatter: every rank adds the same term (its weights and anchor are the
  same), and under FSDP each rank adds it to its own shard (DTensor arithmetic, no communication);
- after gradient clipping (`max-grad-norm`): clipping bounds what the data says, and the pull is not data;
- after Opacus's per-example clipping and noise (`privacy.mode = "sample"`): a term in the loss would be lost
  there, since Opacus replaces each gradient with the noised sum of the clipped per-example ones. Added after, it
  is post-processing of the private gradient and of w_g (which the server sent), so it costs no privacy.

Unclipped and without DP a step is exactly one on the FedProx objective; clipped or noised, only the data's
part is. The `train-loss` a round reports is the task's alone.

The anchor w_g is the global weights received with the round's message. With `round-overlap` a cluster starts a
round from its own rebased weights (clients/overlap.py), and trains ahead before the next message arrives; the
anchor stays the last global received, the federation's latest consensus, so the progress carried over (already
sent, not yet in any global) is drift like any other. Nothing here outlives a round, so nothing is snapshotted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn


def proximal_penalty(weights: Sequence[torch.Tensor], anchor: Sequence[torch.Tensor], *, mu: float) -> torch.Tensor:
    """(mu / 2) Σ ||w − a||² over matching tensors, in float64 (a scalar; differentiable in `weights`)."""
    if len(weights) != len(anchor):
        raise ValueError(f"{len(weights)} weights but {len(anchor)} anchors; they must match one to one")
    total = torch.zeros((), dtype=torch.float64)
    for w, a in zip(weights, anchor, strict=True):
        total = total + (w.double() - a.double()).square().sum()
    return 0.5 * mu * total


def proximal_gradient(weight: torch.Tensor, anchor: torch.Tensor, *, mu: float) -> torch.Tensor:
    """The penalty's gradient in one weight: mu (w − a)."""
    return mu * (weight.detach() - anchor)


def prox_metrics(term: ProximalTerm | None, *, after: Mapping[str, np.ndarray],
                 received: Mapping[str, np.ndarray]) -> dict[str, float]:
    """The reply's word on a round's term: mu, and the term's value at the round's end, (mu / 2) ||w - w_g||^2
    (`after`: the exchanged tensors trained; `received`: the global they were pulled toward). None: no term."""
    if term is None:
        return {}
    return {"prox-mu": term.mu,
            "prox-term": float(proximal_penalty([torch.from_numpy(after[k]) for k in after],
                                                [torch.from_numpy(np.asarray(received[k])) for k in after],
                                                mu=term.mu))}


class ProximalTerm:
    """One round's term: the exchanged parameters, their anchors laid out as the parameters are (this rank's
    shard under FSDP, the parameter's dtype and device), and mu.

    `params` and `anchor` are keyed alike (the exchanged tensors' names); a key missing on either side is a
    ValueError, since a parameter left out would train unanchored without anyone noticing.
    """

    def __init__(self, *, params: Mapping[str, nn.Parameter], anchor: Mapping[str, np.ndarray], mu: float) -> None:
        from nebula_fl.model.sharding import shard_like

        if not (np.isfinite(mu) and mu > 0):
            raise ValueError(f"the proximal weight mu must be finite and > 0 (0 means no term), got {mu!r}")
        if set(params) != set(anchor):
            missing = sorted(set(anchor) ^ set(params))
            raise ValueError(f"the exchanged tensors and the trainable parameters differ on {missing[:3]}; "
                             "every exchanged tensor needs its parameter (Task.exchanged_parameters)")
        names = sorted(params)
        for k in names:
            if tuple(np.shape(anchor[k])) != tuple(params[k].shape):
                raise ValueError(f"anchor '{k}' has shape {tuple(np.shape(anchor[k]))}, its parameter "
                                 f"{tuple(params[k].shape)}")
        self.mu = float(mu)
        self.params = [params[k] for k in names]
        with torch.no_grad():  # a copy (never a view of the received arrays), cut to this rank's shard
            self.anchor = [shard_like(p, torch.tensor(np.asarray(anchor[k]), dtype=p.dtype, device=p.device))
                           for k, p in zip(names, self.params, strict=True)]

    @torch.no_grad()
    def add_to_gradients(self) -> None:
        """grad += mu (w − w_g) for every parameter (a parameter without a gradient gets the term alone)."""
        for p, a in zip(self.params, self.anchor, strict=True):
            pull = proximal_gradient(p, a, mu=self.mu)
            if p.grad is None:
                p.grad = pull
            else:
                p.grad.add_(pull)


def attach(optimizer: torch.optim.Optimizer, current: Callable[[], ProximalTerm | None]):
    """Before every step of `optimizer`, add the term `current()` returns (None: nothing). Under Opacus the hook
    goes on the optimizer its DPOptimizer wraps, which steps only after clipping, noise (and, across ranks,
    the all-reduce) are done. Returns the hook's handle."""
    inner = getattr(optimizer, "original_optimizer", optimizer)

    def hook(_optimizer, _args, _kwargs) -> None:
        term = current()
        if term is not None:
            term.add_to_gradients()

    return inner.register_step_pre_hook(hook)
