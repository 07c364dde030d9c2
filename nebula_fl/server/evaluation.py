"""Server-side evaluation of the global adapter on the held-out test split, every round.

The ServerApp process lives for the whole run, so the base model and the tokenised test split are
loaded once here; each round only swaps the adapter in.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, MetricRecord

from nebula_fl.config import RunConfig
from nebula_fl.data.datasets import train_test_split
from nebula_fl.model.adapter import adapter_arrays, load_adapter_arrays
from nebula_fl.model.batches import TokenizedTexts
from nebula_fl.model.evaluation import evaluate
from nebula_fl.model.frozen_a import fingerprint
from nebula_fl.model.loading import build_model, load_tokenizer
from nebula_fl.model.locate import resolve_model_path


class ServerEvaluator:
    def __init__(self, cfg: RunConfig) -> None:
        seed = cfg.federation.seed
        _, test = train_test_split(cfg.data, seed=seed)
        self.labels = test.label_names
        path = resolve_model_path(cfg.model.model)
        self.model = build_model(cfg.model, num_labels=len(self.labels), seed=seed, path=path,
                                 privacy_mode=cfg.privacy.mode)
        self.data = TokenizedTexts(load_tokenizer(path), test.texts, test.labels, max_len=cfg.model.max_seq_len)
        self.batch_size = cfg.federation.eval_batch_size
        self.num_test = len(test)

    def initial_adapter(self) -> dict[str, np.ndarray]:
        """The seeded initial adapter (LoRA A random, B zero; head random) every cluster starts from."""
        return adapter_arrays(self.model)

    def frozen_fingerprint(self) -> str:
        """What every cluster's frozen LoRA A must hash to ('' unless `lora-mode="frozen-a"`)."""
        return fingerprint(self.model)

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        load_adapter_arrays(self.model, {k: a.numpy() for k, a in arrays.items()})
        return MetricRecord(evaluate(self.model, self.data, batch_size=self.batch_size, num_classes=len(self.labels)))
