"""Server-side evaluation of the global model on the held-out test split, every round.

The ServerApp process lives for the whole run, so the task's model and the tokenised test split are
loaded once here; each round only swaps the exchanged tensors in. What is measured is the task's
(``Task.evaluate``): accuracy and macro-F1 for classification, perplexity for masked-LM pre-training.
It runs on key `server-device`: by default the ServerApp host's first GPU when it has one (2.5-3 s a round on
an H200 host's CPU was most of a round's non-hop time), else the CPU. The initial tensors are built seeded on
the CPU and then moved, so every side starts from the same bits whatever its device.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord

from nebula_fl.config import RunConfig
from nebula_fl.data.datasets import train_test_split
from nebula_fl.devices import server_device, visible_gpus
from nebula_fl.model.locate import resolve_model_path
from nebula_fl.tasks import TaskSetup, make_task


class ServerEvaluator:
    def __init__(self, cfg: RunConfig) -> None:
        seed = cfg.federation.seed
        self.task = make_task(cfg.task.name, cfg.task_options)
        self.train, test = train_test_split(cfg.data, seed=seed, targets=self.task.targets)
        self.labels = test.label_names
        self.device = torch.device(server_device(cfg.federation.server_device, visible=visible_gpus()))
        setup = TaskSetup(model=cfg.model, labels=list(self.labels), seed=seed, path=resolve_model_path(cfg.model.model),
                          privacy_mode=cfg.privacy.mode, device=self.device)
        self.setup = setup
        self.model = self.task.build_model(setup).to(self.device)
        self.tokenizer = self.task.tokenizer(setup)
        self.data = self.task.examples(setup=setup, tokenizer=self.tokenizer, texts=test.texts, labels=test.labels,
                                       train=False)
        self.batch_size = cfg.federation.eval_batch_size
        self.num_test = len(test)

    def records(self) -> dict[str, dict] | None:
        """What `max-seq-len` made of the records, for a task whose examples count it (causal-lm's
        ``RecordsReport``): the held-out split's, and the training split's built as the clusters build theirs from
        the federation's dataset (a cluster with data of its own logs its own). None for other tasks."""
        held_out = getattr(self.data, "report", None)
        if held_out is None:
            return None
        train = self.task.examples(setup=self.setup, tokenizer=self.tokenizer, texts=self.train.texts,
                                   labels=self.train.labels, train=True)
        return {name: {**report.to_dict(), "said": report.describe()}
                for name, report in (("train", train.report), ("held_out", held_out))}

    def initial_adapter(self) -> dict[str, np.ndarray]:
        """The seeded initial exchanged tensors (for LoRA: A random, B zero; head random) every cluster starts from."""
        return self.task.exchanged(self.model)

    def frozen_fingerprint(self) -> str:
        """What every cluster's frozen, never-sent tensors must hash to ('' if none)."""
        return self.task.fingerprint(self.model)

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        self.task.load_exchanged(self.model, {k: a.numpy() for k, a in arrays.items()})
        return MetricRecord(self.task.check_result(self.task.evaluate(self.model, self.data, batch_size=self.batch_size)))

    def save_peft(self, arrays: dict[str, np.ndarray], folder: Path) -> bool:
        """The model with `arrays` set, saved by PEFT (`adapter_config.json`, `adapter_model.safetensors`, every
        LoRA factor: the frozen, never-sent A too) so that `PeftModel.from_pretrained` and any serving stack that
        loads PEFT adapters take it; False for a task whose model is not a PeftModel (a plug-in's wrapper)."""
        if not hasattr(self.model, "peft_config") or not hasattr(self.model, "save_pretrained"):
            return False
        self.task.load_exchanged(self.model, arrays)
        self.model.save_pretrained(str(folder), safe_serialization=True)
        return True

    def whole_model(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every tensor of the model (its state dict, frozen weights and buffers too) with the exchanged ones set to
        `arrays`: what a full-exchange run ends with, loadable without knowing which weights crossed the WAN."""
        self.task.load_exchanged(self.model, arrays)
        return {k: v.detach().cpu().float().numpy().copy() if v.is_floating_point() else v.detach().cpu().numpy().copy()
                for k, v in self.model.state_dict().items()}
