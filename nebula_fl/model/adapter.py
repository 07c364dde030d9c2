"""The adapter as a dict of NumPy arrays: what crosses the WAN, and nothing of the base model.

PEFT's own ``get_peft_model_state_dict`` / ``set_peft_model_state_dict`` decide which tensors belong
to the adapter (the LoRA factors and the modules-to-save head); this module only converts and checks, and
leaves out what `lora-mode="frozen-a"` fixed from the run's seed (LoRA A): it is never exchanged. A model sharded
by FSDP (``model/sharding.py``) is read and written as full tensors: every rank calls these together.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from nebula_fl.comm.validation import check_arrays
from nebula_fl.model.frozen_a import frozen_keys
from nebula_fl.model.peft_state import adapter_state, set_adapter_state
from nebula_fl.model.sharding import shard_like, whole

if TYPE_CHECKING:
    from peft import PeftModel

Arrays = dict[str, np.ndarray]


def adapter_arrays(model: PeftModel) -> Arrays:
    """Copies of the exchanged adapter tensors as float32 NumPy arrays, keyed as PEFT names them."""
    fixed = frozen_keys(model)
    return {k: whole(v.detach()).cpu().float().numpy().copy() for k, v in adapter_state(model).items()
            if k not in fixed}


def adapter_parameters(model: PeftModel) -> dict[str, torch.nn.Parameter]:
    """The trainable parameters behind the exchanged adapter tensors, keyed as ``adapter_arrays`` keys them.

    PEFT renames parameters in its state dict (drops the adapter name, folds ``modules_to_save``); its tensors
    share the parameters' storage, so each key is matched to the parameter it is a view of, whatever PEFT's
    naming. Sharded by FSDP, both are DTensors and their local shards share storage. A key with no trainable
    parameter behind it is left out (the caller checks)."""
    by_storage = {_storage(p): p for p in model.parameters() if p.requires_grad}
    fixed = frozen_keys(model)
    found = {k: by_storage.get(_storage(v)) for k, v in adapter_state(model).items() if k not in fixed}
    return {k: p for k, p in found.items() if p is not None}


def _storage(tensor: torch.Tensor) -> tuple:
    """Where a tensor's (local) data lives and how it is laid out: equal for a parameter and its detached views. An
    empty local shard (more ranks than rows) may match another of its shape: harmless, it holds nothing."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.data_ptr(), tuple(local.shape), tuple(local.stride()), tuple(tensor.shape)


def load_adapter_arrays(model: PeftModel, arrays: Mapping[str, np.ndarray]) -> None:
    """Set the model's adapter to `arrays`, which must match its keys and shapes exactly."""
    check_arrays(expected=adapter_shapes(model), arrays=arrays, what="adapter")
    device = next(model.parameters()).device
    now = adapter_state(model)
    state = {k: shard_like(now[k], torch.as_tensor(np.asarray(v), dtype=torch.float32, device=device))
             for k, v in arrays.items()}
    set_adapter_state(model, state)


def adapter_shapes(model: PeftModel) -> dict[str, tuple[int, ...]]:
    fixed = frozen_keys(model)
    return {k: tuple(v.shape) for k, v in adapter_state(model).items() if k not in fixed}
