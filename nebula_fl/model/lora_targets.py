"""Which linear layers get LoRA: the ones `lora-target-modules` names, or, when it is "auto", PEFT's own choice for
the architecture (its table of defaults: BERT query,value; Llama, Mistral, Qwen2 q_proj,v_proj). A name the model
lacks, or an architecture PEFT has no default for, is a one-line error naming the key."""

from __future__ import annotations

from torch import nn

from nebula_fl.config import AUTO, ModelConfig
from nebula_fl.errors import NebulaError


def lora_targets(model: nn.Module, cfg: ModelConfig, *, model_type: str, all_linear: bool = True) -> list[str]:
    """The module names LoRA wraps in `model` (an architecture `model_type`); ["all-linear"] passes through where
    PEFT can tell the output layer from the rest (`all_linear`: a transformers model, not a wrapped one)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    wanted = cfg.target_modules()
    if wanted == [AUTO]:
        if model_type not in DEFAULTS:
            raise NebulaError(f"lora-target-modules is \"auto\", but PEFT has no default for a "
                              f"{model_type or 'model of this kind'}; set it to some of its linear layers (e.g. "
                              "q_proj,v_proj) or 'all-linear'")
        wanted = list(DEFAULTS[model_type])
    if wanted == ["all-linear"] and all_linear:
        return wanted
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in wanted if m not in names]
    if missing:
        raise NebulaError(f"lora-target-modules names {', '.join(missing)}, which this {model_type or 'model'} does "
                          "not have; name some of its linear layers (e.g. q_proj,v_proj for a decoder, "
                          "query,key,value,dense for BERT), 'all-linear' or \"auto\"")
    return wanted
