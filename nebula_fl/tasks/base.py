"""The Task interface: what a federation trains, so the trainer and the server's evaluator stay generic.

A task owns everything that depends on the problem: the model it builds, what of it is trained and crosses
the WAN (a PEFT adapter, or every weight), how texts become batches, the loss, and the evaluation metrics.
Everything else (the persistent DDP trainer, snapshots and resume, codecs with error feedback, the outer
optimizer, differential privacy, secure aggregation) is the framework's and the same for every task.

A task is built from its options, the ``task.*`` keys of the run config, parsed by its ``Options``
dataclass (a config ``Section`` with prefix ``task``), so a bad option fails on the server and on every
cluster with the same one-line error.
"""

from __future__ import annotations

import dataclasses
import difflib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import torch
from torch import nn

from nebula_fl.config import PRIVACY_MODES, TASK_DEFAULTS, ModelConfig, Section, check_int, require
from nebula_fl.data.datasets import TARGETS
from nebula_fl.errors import ConfigError, NebulaError

if TYPE_CHECKING:
    from nebula_fl.privacy.sample_dp import PerExample

Arrays = dict[str, np.ndarray]
EXCHANGES = ("adapter", "full")


class Examples(Protocol):
    """A cluster's (or the test split's) examples, tokenised once, cut into batches on demand."""

    def __len__(self) -> int: ...

    def batch(self, indices: Sequence[int] | np.ndarray, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        ...


@dataclass(kw_only=True, frozen=True)
class NoOptions(Section):
    """A task without options of its own."""

    PREFIX: ClassVar[str] = "task"


@dataclass(kw_only=True, frozen=True)
class TaskSetup:
    """What a task needs to build its model and examples; the same on the server and on every cluster."""

    model: ModelConfig
    labels: list[str]
    """The federation's class names in the server's order (empty for a task whose targets are 'values')."""
    seed: int
    path: Path
    """The resolved base model folder (its tokenizer is every task's tokenizer)."""
    privacy_mode: str = "off"
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))


class Task(ABC):
    """Subclass, set ``name``, implement the four abstract methods; see ``tasks/classify.py``."""

    name: ClassVar[str]
    """The task's name: what `task.name` and `--task` say, and its entry point's name for a plug-in."""
    exchange: ClassVar[str] = "adapter"
    """'adapter': the PEFT adapter's state (less what is frozen and shared) crosses the WAN; 'full': every
    trainable weight does (pre-training)."""
    targets: ClassVar[str] = "classes"
    """What the dataset's label column holds for this task: 'classes' (names; ``examples`` gets int64 indices into
    ``setup.labels``, the split and a Dirichlet partition are stratified by class) or 'values' (numbers; a CSV's
    label column read as float32, ``setup.labels`` empty, split and partition stratified by quantile bins)."""
    metrics: ClassVar[tuple[str, ...]] = ("accuracy", "macro_f1", "loss")
    """Exactly the keys of ``evaluate``'s result: ``metric`` and 'loss' among them (checked when the task is
    loaded, and every result against it on the server)."""
    metric: ClassVar[str] = "accuracy"
    """The headline evaluation metric (one of ``metrics``), the y-axis of the run's plot."""
    higher_is_better: ClassVar[bool] = True
    """Whether a larger ``metric`` is a better model (the summary's best_metric picks by it)."""
    privacy_modes: ClassVar[tuple[str, ...]] = ("off", "client")
    """Privacy modes the task supports; 'sample' (per-example DP-SGD) needs a model Opacus can wrap and a per-example
    mean loss (``private_examples``)."""
    Options: ClassVar[type[Section]] = NoOptions
    """The task's own `task.*` keys: a frozen ``nebula_fl.config.Section`` dataclass with PREFIX = "task", each
    field documented and validated in ``__post_init__`` (a key the task does not read is refused)."""
    presets: ClassVar[dict[str, dict[str, Any]]] = {}
    """Run-config keys merged over the generic preset of the same name (``nebula-fl run --task T --preset smoke``)."""
    defaults: ClassVar[dict[str, Any]] = {"lr": 5e-3, "lr-warmup-ratio": 0.0, "max-seq-len": 128}
    """What the run config's task-dependent "auto" keys (``config.TASK_DEFAULTS``) mean for this task; a subclass
    overrides some and inherits the rest (``run_defaults``)."""

    def __init__(self, *, options: Mapping[str, Any] | None = None) -> None:
        """The task with its `task.*` options, keys as the run config spells them (``{"task.mask-prob": 0.2}``):
        a key it does not read is refused, naming the closest it does."""
        given = dict(options or {})
        known = self.Options.flat_keys()
        for key in given:  # a key this task does not read (a missing "task." prefix, a typo) is refused, not ignored
            if key not in known:
                close = [f"task.{key}"] if f"task.{key}" in known else difflib.get_close_matches(str(key), known, n=1)
                hint = f"did you mean '{close[0]}'?" if close else f"task '{self.name}' reads {sorted(known) or 'none'}"
                raise ConfigError(f"unknown option {key!r} for task '{self.name}'; {hint}")
        self.options = self.Options.from_flat(given)
        self.global_weights: Mapping[str, torch.Tensor] = {}  # the round's, from ``begin_round``

    # -- the model -----------------------------------------------------------------------------------
    @abstractmethod
    def build_model(self, setup: TaskSetup) -> nn.Module:
        """The model, seeded by ``setup.seed``: the same setup gives the same initial weights everywhere."""

    @classmethod
    def run_defaults(cls) -> dict[str, Any]:
        """Every key of ``config.TASK_DEFAULTS`` with this task's value (its own ``defaults`` over the base's)."""
        return {**Task.defaults, **cls.defaults}

    def seq_len(self, setup: TaskSetup) -> int:
        """`max-seq-len`, or this task's default where the config leaves it "auto" (a run's config is settled
        before it starts, so this matters to code that builds a task by hand)."""
        value = setup.model.max_seq_len
        return int(self.run_defaults()["max-seq-len"] if value is None else value)

    def tokenizer(self, setup: TaskSetup):
        """The tokenizer of the model at ``setup.path`` (override for a model that brings its own)."""
        from nebula_fl.model.loading import load_tokenizer

        return load_tokenizer(setup.path)

    # -- data, loss, evaluation ----------------------------------------------------------------------
    @abstractmethod
    def examples(self, *, setup: TaskSetup, tokenizer, texts: Sequence[str], labels: np.ndarray,
                 train: bool) -> Examples:
        """Tokenise `texts` into batchable examples: a cluster's training shard (`train`, on the cluster, where
        e.g. a teacher may label it) or the server's test split. `labels` are as ``targets`` says: int64 indices
        into ``setup.labels``, or float32 values."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The mean training loss of one batch. The round's global weights are ``self.global_weights``
        (``begin_round``), for a loss that needs an anchor."""

    def begin_round(self, model: nn.Module, *, global_weights: Mapping[str, torch.Tensor]) -> None:
        """Called on every rank when a round's message arrives, before its local training: `global_weights` are
        the exchanged tensors as the round brought them, keyed as ``exchanged`` keys them (full float32 tensors on
        the worker's device, detached, made on first access: unread, they cost no memory). They anchor a
        proximal or SCAFFOLD-style term in ``loss``; the default keeps them as ``self.global_weights``. The
        model already holds the weights training starts from: the global ones, or under `round-overlap` the
        cluster's own rebased weights, and the steps it trains ahead of the next message keep this anchor.

        Under per-example DP (`privacy.mode = "sample"`) ``loss`` scores each physical chunk of a logical batch,
        and Opacus keeps only the gradients that flow through the model's modules per example: a term on the
        weights themselves is dropped. FedProx needs none of this: `prox-mu` adds its term for any task
        (``clients/proximal.py``)."""
        self.global_weights = global_weights

    def private_examples(self, data: Examples) -> PerExample:
        """`data`, this cluster's training examples, as per-example DP-SGD (`privacy.mode = "sample"`) samples them:
        by index, batched by ``data.batch``, scored by ``loss``. Asked only of a task that lists 'sample' in
        ``privacy_modes``, which is the task's promise that ``loss`` is the mean over the batch's examples of each
        example's own loss (Opacus's per-example gradients are n times the gradient of that mean) and that Opacus
        computes per-example gradients of its trainable modules (checked when training starts). Override to give
        the examples' lengths (chunks of similar lengths pad less) or another batching."""
        from nebula_fl.privacy.sample_dp import indexed

        return indexed(data, loss=self.loss)

    @abstractmethod
    def evaluate(self, model: nn.Module, data: Examples, *, batch_size: int) -> dict[str, float]:
        """Metrics on held-out examples: a float for each name in ``metrics``, no other."""

    def check_result(self, result: Mapping[str, Any]) -> dict[str, float]:
        """`result` of ``evaluate`` as floats, or a ValueError naming the task, what differs and the fix."""
        keys = set(result) if isinstance(result, Mapping) else None
        if keys != set(self.metrics):
            got = sorted(keys) if keys is not None else type(result).__name__
            raise ValueError(f"task '{self.name}': evaluate returned {got}, but the task declares metrics = "
                             f"{list(self.metrics)}; make Task.metrics name exactly the keys evaluate returns")
        out = {}
        for key, value in result.items():
            if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
                raise ValueError(f"task '{self.name}': evaluate's '{key}' is {value!r}, not a number; return floats")
            out[key] = float(value)
        return out

    # -- what crosses the WAN ------------------------------------------------------------------------
    def exchanged(self, model: nn.Module) -> Arrays:
        """Copies of the exchanged tensors as float32 arrays (full tensors of a model sharded by FSDP: every rank
        calls this, and ``load_exchanged`` and ``fingerprint``, together)."""
        from nebula_fl.model.sharding import whole

        if self.exchange == "adapter":
            from nebula_fl.model.adapter import adapter_arrays

            return adapter_arrays(self._peft(model))
        return {k: whole(p.detach()).cpu().float().numpy().copy() for k, p in model.named_parameters()
                if p.requires_grad}

    def exchanged_parameters(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """The trainable parameters behind the exchanged tensors, keyed as ``exchanged`` keys them (the parameters
        themselves: this rank's shards under FSDP). `prox-mu` pulls these toward the round's global weights; a task
        that overrides ``exchanged`` overrides this too, or the trainer refuses `prox-mu` > 0 for it."""
        if self.exchange == "adapter":
            from nebula_fl.model.adapter import adapter_parameters

            return adapter_parameters(self._peft(model))
        return {k: p for k, p in model.named_parameters() if p.requires_grad}

    def load_exchanged(self, model: nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
        """Set the exchanged tensors to `arrays` (exact keys and shapes, checked)."""
        if self.exchange == "adapter":
            from nebula_fl.model.adapter import load_adapter_arrays

            load_adapter_arrays(self._peft(model), arrays)
            return
        from nebula_fl.comm.validation import check_arrays
        from nebula_fl.model.sharding import shard_like

        params = {k: p for k, p in model.named_parameters() if p.requires_grad}
        check_arrays(expected={k: tuple(p.shape) for k, p in params.items()}, arrays=arrays, what="model")
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(shard_like(p, torch.as_tensor(np.asarray(arrays[k]), dtype=p.dtype, device=p.device)))

    def _peft(self, model: nn.Module) -> nn.Module:
        """`model` itself when it is the PEFT model that exchange = "adapter" reads the adapter from, else a
        one-line error saying what to return instead."""
        if not hasattr(model, "peft_config"):
            raise NebulaError(f"task '{self.name}' declares exchange = 'adapter', but its build_model returned a "
                              f"{type(model).__name__}, not the PEFT model: return get_peft_model(...)'s result "
                              "itself (wrap it in nothing), or declare exchange = 'full' for a model that wraps one")
        return model

    def fingerprint(self, model: nn.Module) -> str:
        """A hash of what every side must share but never sends (frozen LoRA A); '' if nothing."""
        if self.exchange != "adapter":
            return ""
        from nebula_fl.model.frozen_a import fingerprint

        return fingerprint(model)

    def describe(self) -> dict[str, Any]:
        """What the run's start line and summary say of the task: its name, exchange, metric and options."""
        return {"task": self.name, "exchange": self.exchange, "metric": self.metric, **self.options.to_flat()}


def check_sizes(*, layers: int, hidden: int, heads: int, intermediate: int) -> None:
    """The ``task.*`` sizes of a transformer a task builds from scratch (mlm's BERT, causal-lm's Llama), checked
    alike: a bad one fails on the server and every cluster with the same one-line error."""
    check_int("task.layers", layers, low=1, high=48, fix="use 1 to 48 layers")
    check_int("task.heads", heads, low=1, high=64, fix="use 1 to 64 heads")
    check_int("task.hidden", hidden, low=8, high=4096, fix="use a hidden size of 8 to 4096")
    require(hidden % heads == 0, "task.hidden", f"is {hidden}, not a multiple of task.heads ({heads})",
             "make task.hidden a multiple of task.heads")
    check_int("task.intermediate", intermediate, low=8, high=16_384, fix="use a width of 8 to 16384")


class GlobalWeights(Mapping[str, torch.Tensor]):
    """A round's received arrays as torch tensors on one device, each copied there when first read (a task that
    never reads them, or reads one layer, does not hold a second copy of a large model on every worker)."""

    def __init__(self, arrays: Mapping[str, np.ndarray], *, device: torch.device) -> None:
        self._arrays, self._device = arrays, device
        self._tensors: dict[str, torch.Tensor] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._tensors:
            tensor = torch.tensor(np.asarray(self._arrays[key]), dtype=torch.float32, device=self._device)
            self._tensors[key] = tensor.requires_grad_(False)
        return self._tensors[key]

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)


def _check_contract(cls: type[Task], where: str) -> None:
    """What the framework reads from a task's class: its declared exchange, targets, metrics and privacy modes."""
    if cls.exchange not in EXCHANGES:
        raise ValueError(f"{where} has exchange = {cls.exchange!r}; use one of {', '.join(EXCHANGES)}")
    if cls.targets not in TARGETS:
        raise ValueError(f"{where} has targets = {cls.targets!r}; use one of {', '.join(TARGETS)}")
    metrics = cls.metrics
    if not (isinstance(metrics, tuple) and metrics and all(isinstance(m, str) and m for m in metrics)):
        raise ValueError(f"{where} has metrics = {metrics!r}; declare a tuple of the names evaluate returns, e.g. "
                         "('rmse', 'loss')")
    if cls.metric not in metrics:
        raise ValueError(f"{where} has metric = {cls.metric!r}, which is not among its metrics {list(metrics)}; "
                         "add it to metrics (and to evaluate's result) or pick one of them")
    if "loss" not in metrics:
        raise ValueError(f"{where} declares metrics {list(metrics)} without 'loss'; the server records the held-out "
                         "loss every round: return it from evaluate and add 'loss' to metrics")
    if not isinstance(cls.higher_is_better, bool):
        raise ValueError(f"{where} has higher_is_better = {cls.higher_is_better!r}; use True or False")
    modes = cls.privacy_modes
    if not (isinstance(modes, tuple) and modes and set(modes) <= set(PRIVACY_MODES)):
        raise ValueError(f"{where} has privacy_modes = {modes!r}; use a tuple of {', '.join(PRIVACY_MODES)}")


def check_task_class(cls: object, *, name: str, where: str) -> type[Task]:
    """A loaded plugin is a usable Task subclass registered under its own name, or a ValueError saying why."""
    import inspect

    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ValueError(f"{where} is {cls!r}, not a subclass of nebula_fl.tasks.Task; fix the plugin")
    if inspect.isabstract(cls):
        raise ValueError(f"{where} does not implement {sorted(cls.__abstractmethods__)}; fix the plugin")
    if getattr(cls, "name", None) != name:
        raise ValueError(f"{where} defines name = {getattr(cls, 'name', None)!r}, but is registered as '{name}'; "
                         "make them equal")
    _check_contract(cls, where)
    unknown = sorted(set(getattr(cls, "defaults", {})) - set(TASK_DEFAULTS))
    if unknown:
        raise ValueError(f"{where} has defaults for {unknown}; a task's defaults may set only "
                         f"{', '.join(TASK_DEFAULTS)} (set other keys in a preset)")
    if not (isinstance(cls.Options, type) and issubclass(cls.Options, Section) and cls.Options.PREFIX == "task"):
        raise ValueError(f"{where}'s Options must be a nebula_fl.config.Section dataclass with PREFIX = 'task'")
    return cls
