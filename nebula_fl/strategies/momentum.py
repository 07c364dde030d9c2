"""What the momentum optimizers share: a validated momentum and one velocity buffer, checkpointed."""

from __future__ import annotations

from typing import Any, ClassVar

from nebula_fl.strategies.adapter_strategy import AdapterStrategy, Arrays


class MomentumStrategy(AdapterStrategy):
    default_momentum: ClassVar[float] = 0.9

    def __init__(self, *, momentum: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.momentum = self.default_momentum if momentum is None else float(momentum)
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        self.velocity: Arrays | None = None

    def outer_state(self) -> dict[str, Any]:
        return {"velocity": self.velocity}

    def load_outer_state(self, state: dict[str, Any]) -> None:
        self.velocity = state.get("velocity")
