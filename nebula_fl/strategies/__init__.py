"""Message-API strategies that aggregate adapter updates; one outer optimizer per file."""

from __future__ import annotations

from nebula_fl.config import OuterConfig
from nebula_fl.strategies.adam import AdapterAdam
from nebula_fl.strategies.adapter_strategy import AdapterStrategy
from nebula_fl.strategies.fedavg import AdapterFedAvg
from nebula_fl.strategies.fedavgm import AdapterFedAvgM
from nebula_fl.strategies.momentum import MomentumStrategy
from nebula_fl.strategies.nesterov import AdapterNesterov

STRATEGIES: dict[str, type[AdapterStrategy]] = {
    cls.name: cls for cls in (AdapterFedAvg, AdapterFedAvgM, AdapterNesterov, AdapterAdam)
}


def make_strategy(cfg: OuterConfig, *, clusters_per_round: int = 0, seed: int = 0) -> AdapterStrategy:
    """The strategy for an outer-optimizer config; 'auto' values take each optimizer's defaults."""
    cls = STRATEGIES[cfg.outer_optimizer]
    kwargs: dict = {"lr": cfg.outer_lr, "clusters_per_round": clusters_per_round, "seed": seed}
    if issubclass(cls, MomentumStrategy):
        kwargs["momentum"] = cfg.outer_momentum
    if cls is AdapterAdam:
        kwargs.update(beta1=cfg.outer_beta1, beta2=cfg.outer_beta2, eps=cfg.outer_eps)
    return cls(**kwargs)


__all__ = ["STRATEGIES", "AdapterStrategy", "make_strategy"]
