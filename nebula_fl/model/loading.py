"""Find, check and load the base model; wrap it with a PEFT LoRA adapter."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nebula_fl.config import ModelConfig
from nebula_fl.errors import NebulaError
from nebula_fl.model.classifier import SequenceClassifier
from nebula_fl.model.frozen_a import freeze_shared_a, lora_mode
from nebula_fl.model.locate import resolve_model_path
from nebula_fl.model.lora_targets import lora_targets

if TYPE_CHECKING:
    from peft import PeftModel

HEAD = "head"


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    from nebula_fl.model.gguf_cache import model_folder

    return AutoTokenizer.from_pretrained(str(model_folder(path)), local_files_only=True)


def model_positions(config) -> int | None:
    """How many positions a transformers model config allows (None: it does not say, e.g. no absolute limit)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_positions(config, *, max_seq_len: int, path: Path | str) -> None:
    """`max-seq-len` within the model's own position limit: past it, the model would index embeddings it lacks."""
    limit = model_positions(config)
    if limit is not None and max_seq_len > limit:
        raise NebulaError(f"max-seq-len is {max_seq_len:,}, but the model in '{path}' has {limit:,} positions; use "
                          f"8 to {limit:,}")


def build_classifier(path: Path, *, num_labels: int, seed: int) -> SequenceClassifier:
    """The base encoder with a fresh (seeded) classification head, every weight trainable."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    try:
        encoder = AutoModel.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise NebulaError(f"could not load the model in '{path}': {str(err).splitlines()[0]}") from None
    return SequenceClassifier(encoder, hidden_size=encoder.config.hidden_size, num_labels=num_labels)


def build_model(cfg: ModelConfig, *, num_labels: int, seed: int, path: Path | None = None,
                privacy_mode: str = "off") -> PeftModel:
    """The classifier wrapped by LoRA; only the adapter and the head train.

    The same (cfg, num_labels, seed) gives the same initial adapter everywhere, but only the server's
    initial adapter matters: clusters overwrite theirs with the global one every round. Under
    `lora-mode="frozen-a"` (the default under `privacy_mode="sample"`) LoRA A comes from the seed alone and
    is frozen (see ``frozen_a``).
    """
    path = path or resolve_model_path(cfg.model)
    model = build_classifier(path, num_labels=num_labels, seed=seed)
    if cfg.max_seq_len is not None:
        check_positions(model.encoder.config, max_seq_len=cfg.max_seq_len, path=path)
    targets = lora_targets(model.encoder, cfg, model_type=getattr(model.encoder.config, "model_type", ""),
                           all_linear=False)
    from peft import LoraConfig, get_peft_model  # (first use here: see peft_state.py)

    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        modules_to_save=[HEAD],
    )
    peft = get_peft_model(model, lora)
    if lora_mode(requested=cfg.lora_mode, privacy_mode=privacy_mode) == "frozen-a":
        freeze_shared_a(peft, seed=seed)
    return peft
