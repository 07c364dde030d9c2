"""A distillation teacher: the final classifier of an earlier ``classify`` run, or one trained here and now.

A run folder stores the run config (``config.json``) and the final global adapter (``adapter.safetensors``),
not the base weights (they are the shipped or named model) and not the label names: those are recomputed from
the run's own dataset config exactly as its server did (``train_test_split`` with the run's seed), so the
teacher's output columns are named without trusting anything but the run's config.

The teacher only ever labels texts (no gradient): its logits are computed once per cluster shard, batched, in
eval mode, then the teacher can be dropped; only the student trains and crosses the WAN.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from nebula_fl.config import DataConfig, ModelConfig, PrivacyConfig
from nebula_fl.errors import ConfigError, NebulaError
from nebula_fl.model.batches import TokenizedTexts

TEACHER_KEY = "task.teacher"


@dataclass(kw_only=True, frozen=True)
class Teacher:
    """A classifier ready to label texts with its own tokenizer and sequence length."""

    model: nn.Module
    tokenizer: object
    labels: list[str]
    """Names of its output columns, in order."""
    max_seq_len: int
    source: str
    """Where it came from (a run folder, or 'local:STEPS'), for error messages."""

    def check_labels(self, federation: Sequence[str]) -> None:
        """The teacher's columns must be the federation's labels, same names, same order, or KD is meaningless."""
        if list(self.labels) != list(federation):
            raise ConfigError(
                f"config key '{TEACHER_KEY}': the teacher {self.source} predicts labels {list(self.labels)}, but the "
                f"federation's labels are {list(federation)}; use a teacher trained on the same dataset (or 'local:STEPS')"
            )

    @torch.no_grad()
    def logits(self, texts: Sequence[str], *, batch_size: int = 32) -> torch.Tensor:
        """The teacher's logits for `texts` as a (len(texts), labels) float32 CPU tensor (eval mode, no dropout)."""
        data = TokenizedTexts(self.tokenizer, texts, np.zeros(len(texts), dtype=np.int64), max_len=self.max_seq_len)
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        out = []
        try:
            for start in range(0, len(data), batch_size):
                batch = data.batch(range(start, min(start + batch_size, len(data))), device)
                out.append(self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).float().cpu())
        finally:
            self.model.train(was_training)
        return torch.cat(out) if out else torch.zeros((0, len(self.labels)))


def load_run_teacher(folder: str | Path, *, device: torch.device | str = "cpu") -> Teacher:
    """The final global classifier of a completed nebula-fl ``classify`` run in `folder`."""
    from safetensors.numpy import load_file

    from nebula_fl.data.datasets import train_test_split
    from nebula_fl.model.adapter import load_adapter_arrays
    from nebula_fl.model.loading import build_model, load_tokenizer
    from nebula_fl.model.locate import resolve_model_path
    from nebula_fl.storage.run_folder import ADAPTER, RunFolder

    run = RunFolder(folder)
    where = f"'{run.path}'"
    if not run.path.is_dir():
        raise ConfigError(f"config key '{TEACHER_KEY}' is {str(folder)!r}, which is not a folder here; name a "
                          "completed classify run folder (runs/...) or use 'local:STEPS'")
    try:
        flat = dict(run.read_config()["run_config"])
    except (NebulaError, KeyError, TypeError):
        raise ConfigError(f"config key '{TEACHER_KEY}': {where} is not a nebula-fl run folder (no run_config in its "
                          "config.json); name a completed classify run folder or use 'local:STEPS'") from None
    task = flat.get("task.name", "classify")
    if task != "classify":
        raise ConfigError(f"config key '{TEACHER_KEY}': {where} is a '{task}' run; a teacher must be a 'classify' run")
    if not (run.path / ADAPTER).is_file():
        raise ConfigError(f"config key '{TEACHER_KEY}': {where} holds no {ADAPTER} (the run did not complete); "
                          "resume it to the end, or name a completed run")
    model_cfg = ModelConfig.from_flat(flat)
    seed = int(flat.get("seed", 0))
    try:
        _, test = train_test_split(DataConfig.from_flat(flat), seed=seed)
    except (NebulaError, OSError, ValueError) as err:
        raise ConfigError(f"config key '{TEACHER_KEY}': the run {where} does not store its label names and its "
                          f"dataset '{flat.get('dataset')}' cannot be read here to recompute them ({err}); make the "
                          "dataset available at that path") from None
    labels = list(test.label_names)
    path = resolve_model_path(model_cfg.model)
    model = build_model(model_cfg, num_labels=len(labels), seed=seed, path=path,
                        privacy_mode=PrivacyConfig.from_flat(flat).mode)
    try:
        load_adapter_arrays(model, load_file(str(run.path / ADAPTER)))
    except (ValueError, OSError) as err:
        raise ConfigError(f"config key '{TEACHER_KEY}': the adapter in {where} does not fit the model its config "
                          f"describes ({err}); the folder is damaged or edited") from None
    model.to(device).eval()
    return Teacher(model=model, tokenizer=load_tokenizer(path), labels=labels, max_seq_len=model_cfg.max_seq_len,
                   source=where)


def train_local_teacher(*, model: ModelConfig, path: Path, labels: Sequence[str], texts: Sequence[str],
                        targets: np.ndarray, steps: int, batch_size: int, lr: float, seed: int,
                        device: torch.device | str = "cpu") -> Teacher:
    """A full-depth LoRA classifier fine-tuned on this cluster's labelled texts for `steps` AdamW steps.

    Seeded (initial adapter, head and batch order), and run on a forked RNG, so the caller's random stream is
    untouched and the same shard and seed give the same teacher.
    """
    from nebula_fl.model.loading import build_model, load_tokenizer

    targets = np.asarray(targets, dtype=np.int64)
    if len(texts) == 0:
        raise NebulaError("a local teacher needs labelled texts to train on; this cluster holds none")
    tokenizer = load_tokenizer(path)
    data = TokenizedTexts(tokenizer, texts, targets, max_len=model.max_seq_len)
    with torch.random.fork_rng(devices=[]):
        net = build_model(model, num_labels=len(labels), seed=seed, path=path).to(device)
        params = [p for p in net.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr)
        rng = np.random.default_rng([seed, 20_150_309])  # Hinton et al.'s arXiv date: the teacher's own stream
        order = np.concatenate([rng.permutation(len(data)) for _ in range(-(-steps * batch_size // len(data)) or 1)])
        net.train()
        for step in range(steps):
            rows = order[step * batch_size:(step + 1) * batch_size]
            batch = data.batch(rows, device)
            logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            loss = nn.functional.cross_entropy(logits, batch["labels"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
    net.eval()
    return Teacher(model=net, tokenizer=tokenizer, labels=list(labels), max_seq_len=model.max_seq_len,
                   source=f"'local:{steps}'")
