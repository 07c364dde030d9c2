"""FFA-LoRA's shared frozen A: every LoRA A factor drawn from the run's seed, identical everywhere, never trained.

With A fixed and shared, each cluster's change to a layer is ``ΔB · A``, so the mean of the clusters'
changes is ``mean(ΔB) · A`` exactly; averaging A and B separately is not (``mean(B)·mean(A) ≠ mean(B·A)``).
Only B and the head cross the WAN (about half the bytes), and DP noise goes into half the dimensions.

A is drawn from a generator keyed by (seed, tensor name) alone, so it does not depend on how much of
torch's global RNG the model's loading consumed (which differs across library versions); the server
sends the fingerprint of its A and a cluster whose A differs refuses the run instead of averaging
updates of different models.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from nebula_fl.model.peft_state import adapter_state

if TYPE_CHECKING:
    from peft import PeftModel

FROZEN_KEYS = "nebula_fl_frozen_keys"  # attribute on the PeftModel: adapter keys that never cross the WAN


def shared_a(seed: int, key: str, shape: tuple[int, int]) -> torch.Tensor:
    """PEFT's default A distribution, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), drawn from (seed, key) only."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=generator, dtype=torch.float32) * 2.0 - 1.0) * bound


def freeze_shared_a(model: PeftModel, *, seed: int) -> None:
    """Set every LoRA A to its shared draw and freeze it; record which adapter keys are now fixed."""
    keys = [k for k in adapter_state(model) if ".lora_A." in k]
    params = {name: p for name, p in model.named_parameters() if ".lora_A." in name}
    for name, param in params.items():
        key = name.replace(".default", "")  # PEFT's parameter name -> its adapter state-dict key
        with torch.no_grad():
            param.copy_(shared_a(seed, key, tuple(param.shape)))
        param.requires_grad_(False)
    if sorted(n.replace(".default", "") for n in params) != sorted(keys):
        raise RuntimeError("the LoRA A parameters do not match PEFT's adapter keys; this is a bug, please report it")
    setattr(model, FROZEN_KEYS, frozenset(keys))


def frozen_keys(model: PeftModel) -> frozenset[str]:
    return getattr(model, FROZEN_KEYS, frozenset())


def fingerprint(model: PeftModel) -> str:
    """SHA-256 over the frozen tensors (name, shape, float32 bytes); '' when nothing is frozen. Full tensors of a
    sharded model: every rank calls it together."""
    from nebula_fl.model.sharding import whole

    keys = sorted(frozen_keys(model))
    if not keys:
        return ""
    state = adapter_state(model)
    digest = hashlib.sha256()
    for key in keys:
        value = np.ascontiguousarray(whole(state[key].detach()).cpu().float().numpy())
        digest.update(f"{key}:{value.shape}".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def lora_mode(*, requested: str, privacy_mode: str) -> str:
    """'auto' is frozen-a under sample DP (half the noise dimensions, exact averages), standard otherwise."""
    if requested != "auto":
        return requested
    return "frozen-a" if privacy_mode == "sample" else "standard"
