"""PEFT's view of an adapter's tensors, with peft imported on first use.

Importing peft costs about 4 s of CPU (it loads much of transformers); the launcher, the CLI, the SuperNode's
ClientApp and the trainer's supervisor never touch a model, so nothing they import may import peft.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from peft import PeftModel


def adapter_state(model: PeftModel) -> dict[str, torch.Tensor]:
    """PEFT's adapter state dict: the tensors it saves for an adapter, keyed as it names them."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def set_adapter_state(model: PeftModel, state: dict[str, torch.Tensor]) -> None:
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, state)
