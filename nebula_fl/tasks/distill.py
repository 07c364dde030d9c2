"""Knowledge distillation into a shallower student: only the student's LoRA adapter and head cross the WAN.

The student is the base model (MiniLM) cut to its first ``task.student-layers`` encoder layers, with LoRA and a
fresh head built exactly as the classify task builds them. Each cluster labels its own shard with a teacher once,
at setup (batched, eval mode, no gradient), and keeps only the logits: training batches carry
``teacher_logits`` and the loss is ``kd_loss`` (soft targets at temperature T, mixed with the hard labels by
alpha). The teacher never crosses the WAN and never trains in the federation; it is either

* a completed ``classify`` run folder of nebula-fl (its final global adapter on the base model it names), or
* ``local:STEPS``: a full-depth LoRA classifier each cluster fine-tunes on its own labelled shard first, so the
  task runs without an earlier run. (The trainer hands each DDP worker its own part of the shard, so with
  several workers per cluster each worker's local teacher learns from its part only; a run-folder teacher is
  the same on every worker.)

With ``task.alpha = 0`` the loss is plain cross-entropy and no teacher is built at all: the same student trained
the same way without distillation, the control a KD result needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from nebula_fl.config import Section, check_int, check_path, check_real, require, show
from nebula_fl.errors import ConfigError
from nebula_fl.model.batches import TokenizedTexts
from nebula_fl.model.evaluation import evaluate
from nebula_fl.model.loading import build_model
from nebula_fl.model.peft_state import adapter_state
from nebula_fl.model.teacher import Teacher, load_run_teacher, train_local_teacher
from nebula_fl.tasks.base import Examples, Task, TaskSetup
from nebula_fl.tasks.kd import kd_loss

LOCAL = "local:"
MAX_TEACHER_STEPS = 1_000_000


def local_steps(teacher: str) -> int | None:
    """STEPS of 'local:STEPS', or None for a run folder."""
    return int(teacher[len(LOCAL):]) if teacher.startswith(LOCAL) else None


@dataclass(kw_only=True, frozen=True)
class DistillOptions(Section):
    """The teacher, the student's depth and the KD loss's mix (``task.*`` keys)."""

    PREFIX: ClassVar[str] = "task"

    teacher: str = "local:100"
    """A completed classify run folder (runs/...), or 'local:STEPS': each cluster first fine-tunes a full-depth
    LoRA classifier on its labelled shard for STEPS (1 to 1,000,000) AdamW steps."""
    temperature: float = 2.0
    """Softmax temperature of both sides of the KL term; > 0, at most 100."""
    alpha: float = 0.5
    """Weight of the distillation term (1 - alpha: the hard-label cross-entropy); in [0, 1]; 0 trains without a
    teacher."""
    student_layers: int = 2
    """Encoder layers the student keeps (the first ones of the base model); 1 to the base model's depth."""
    teacher_lr: float = 5e-3
    """AdamW learning rate of a 'local:STEPS' teacher; > 0, at most 10."""
    teacher_batch_size: int = 16
    """Examples per step of a 'local:STEPS' teacher; 1 to 65,536."""

    def __post_init__(self) -> None:
        fix = "name a completed classify run folder, or use 'local:STEPS' (e.g. local:100)"
        check_path("task.teacher", self.teacher, fix=fix)
        require(bool(self.teacher.strip()), "task.teacher", "is '' (empty)", fix)
        if self.teacher.startswith(LOCAL):
            digits = self.teacher[len(LOCAL):]
            require(digits.isdigit() and 1 <= int(digits) <= MAX_TEACHER_STEPS, "task.teacher",
                     f"is {show(self.teacher)}", f"use 'local:STEPS' with STEPS from 1 to {MAX_TEACHER_STEPS}")
        check_real("task.temperature", self.temperature, low=0, high=100, low_open=True,
              fix="use a temperature > 0 (at most 100; Hinton et al. use 2 to 20)")
        check_real("task.alpha", self.alpha, low=0, high=1, fix="use a weight in [0, 1] (0: no distillation)")
        check_int("task.student-layers", self.student_layers, low=1, high=48, fix="use 1 to 48 layers")
        check_real("task.teacher-lr", self.teacher_lr, low=0, high=10, low_open=True, fix="use a rate > 0, at most 10")
        check_int("task.teacher-batch-size", self.teacher_batch_size, low=1, high=65_536, fix="use 1 to 65536")


class DistilledTexts:
    """A shard's student batches, each with the teacher's logits for its rows (``teacher_logits``)."""

    def __init__(self, texts: TokenizedTexts, teacher_logits: torch.Tensor) -> None:
        if teacher_logits.shape[0] != len(texts):
            raise ValueError(f"{teacher_logits.shape[0]} rows of teacher logits for {len(texts)} texts")
        self.texts = texts
        self.teacher_logits = teacher_logits.float().cpu()

    @property
    def labels(self) -> np.ndarray:
        return self.texts.labels

    def __len__(self) -> int:
        return len(self.texts)

    def batch(self, indices: Sequence[int] | np.ndarray, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        rows = np.asarray(indices, dtype=np.int64).reshape(-1)
        out = self.texts.batch(rows, device)
        out["teacher_logits"] = self.teacher_logits[torch.from_numpy(rows)].to(device)
        return out


def truncate_encoder(model: nn.Module, *, layers: int) -> None:
    """Keep the first `layers` transformer blocks of a PEFT-wrapped BERT-style classifier, in place."""
    from nebula_fl.model.frozen_a import FROZEN_KEYS, frozen_keys

    encoder = getattr(model.get_base_model(), "encoder", None)  # type: ignore[operator]
    blocks = getattr(getattr(encoder, "encoder", None), "layer", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ConfigError("config key 'task.student-layers' needs a BERT-style base model (encoder.layer blocks); "
                          "use 'minilm' or another BERT folder")
    require(layers <= len(blocks), "task.student-layers", f"is {layers}, but the base model has {len(blocks)} "
             "layers", f"use 1 to {len(blocks)}")
    encoder.encoder.layer = nn.ModuleList(list(blocks)[:layers])  # type: ignore[union-attr]
    encoder.config.num_hidden_layers = layers  # type: ignore[union-attr]
    fixed = frozen_keys(model)  # frozen LoRA A of the dropped blocks no longer exist
    if fixed:
        kept = set(adapter_state(model))
        setattr(model, FROZEN_KEYS, frozenset(k for k in fixed if k in kept))


class DistillTask(Task):
    name = "distill"
    exchange = "adapter"
    metrics = ("accuracy", "macro_f1", "loss")
    metric = "accuracy"
    privacy_modes = ("off", "client")
    Options = DistillOptions
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        # Every code path in seconds: a 3-step local teacher, a 1-layer student, 300 texts.
        "smoke": {
            "task.teacher": "local:3", "task.student-layers": 1, "max-examples": 300, "local-steps": 3,
            "batch-size": 8, "max-seq-len": 64, "num-server-rounds": 2, "eval-initial": False,
        },
        # BBC News: each cluster's 6-layer teacher fine-tuned for 100 steps, distilled into a 2-layer student.
        "demo": {"task.teacher": "local:100", "task.student-layers": 2, "max-seq-len": 128},
    }

    def __init__(self, *, options=None) -> None:
        super().__init__(options=options)
        self.opts: DistillOptions = self.options  # type: ignore[assignment]

    def build_model(self, setup: TaskSetup) -> nn.Module:
        """The student: the classify task's model (same seed, LoRA, head), cut to its first N layers."""
        if not setup.labels:
            raise ValueError("the distill task needs labelled data: the federation knows no labels")
        model = build_model(setup.model, num_labels=len(setup.labels), seed=setup.seed, path=setup.path,
                            privacy_mode=setup.privacy_mode)
        truncate_encoder(model, layers=self.opts.student_layers)
        return model.to(setup.device)

    def teacher(self, *, setup: TaskSetup, texts: Sequence[str], labels: np.ndarray) -> Teacher:
        """This cluster's teacher: the run folder's classifier, or one fine-tuned on (texts, labels) here."""
        steps = local_steps(self.opts.teacher)
        if steps is None:
            teacher = load_run_teacher(self.opts.teacher, device=setup.device)
        else:
            teacher = train_local_teacher(model=setup.model, path=setup.path, labels=setup.labels, texts=texts,
                                          targets=labels, steps=steps, batch_size=self.opts.teacher_batch_size,
                                          lr=self.opts.teacher_lr, seed=setup.seed, device=setup.device)
        teacher.check_labels(setup.labels)
        return teacher

    def examples(self, *, setup: TaskSetup, tokenizer, texts: Sequence[str], labels: np.ndarray,
                 train: bool) -> Examples:
        data = TokenizedTexts(tokenizer, texts, labels, max_len=self.seq_len(setup))
        if not train or self.opts.alpha == 0.0:  # evaluation, or plain cross-entropy: no teacher needed
            return data
        teacher = self.teacher(setup=setup, texts=texts, labels=np.asarray(labels))
        logits = teacher.logits(texts)
        del teacher  # only its logits are kept: the teacher's memory goes back before training starts
        return DistilledTexts(data, logits)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        teacher = batch.get("teacher_logits")
        if teacher is None and self.opts.alpha > 0:
            raise ValueError("a distill training batch has no 'teacher_logits'; build it with examples(train=True)")
        return kd_loss(logits, teacher, batch.get("labels"), temperature=self.opts.temperature, alpha=self.opts.alpha)

    def evaluate(self, model: nn.Module, data: Examples, *, batch_size: int) -> dict[str, float]:
        return evaluate(model, data, batch_size=batch_size)  # type: ignore[arg-type]
