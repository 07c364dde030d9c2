"""Every run-config key (privacy.* aside: its own tests) refuses negative, zero-where-meaningless, NaN, ±inf,
wrongly typed and absurd values with one ConfigError line naming the key and the value; the CLI turns a
sample of them into `nebula-fl: error: ...`, exit status 2, and no run folder."""

from __future__ import annotations

import math

import pytest

from nebula_fl.cli import main
from nebula_fl.components import resolve
from nebula_fl.config import RunConfig
from nebula_fl.errors import ConfigError

NAN, INF = math.nan, math.inf
# Bad for every int key / every float key / every bool key, on top of each key's own list below.
INT_BAD = [NAN, INF, -INF, 2.5, 1.0, "3", True, [1], 10**30, -(10**30), 10**5000]
FLOAT_BAD = [NAN, INF, -INF, 10**400, -(10**400), "1", True, [1.0], {"a": 1}]
BOOL_BAD = [1, 0, "true", 1.0, None, NAN]
TEXT_BAD = [5, 1.5, True, None, NAN, ["a"]]
NOT_A_USER = "~nebula-no-such-user-zz/x"

BAD: dict[str, list] = {
    # federation
    "num-server-rounds": [-1, 0, 100_001, *INT_BAD, None],
    "min-clusters": [-1, 0, 10_001, *INT_BAD],
    "wait-for-clusters": [-1, 10_001, *INT_BAD],
    "clusters-per-round": [-1, 10_001, *INT_BAD],
    "round-timeout": [-1.0, 0, 0.0, -0.0, 604_801, 1e300, *FLOAT_BAD, None],
    "connect-timeout": [-5, 0, 604_800.5, *FLOAT_BAD],
    "seed": [-1, 2**32, 2**63 - 1, 2**64, *INT_BAD],
    "out-dir": ["a\x00b", "a\nb", "a\rb", "\udcff", "x" * 4096, "a" * 256, "/tmp/" + "é" * 128, NOT_A_USER,
                *TEXT_BAD],
    "resume": BOOL_BAD,
    "eval-initial": BOOL_BAD,
    "eval-overlap": BOOL_BAD,
    "eval-batch-size": [-1, 0, 65_537, *INT_BAD],
    "server-device": ["", "gpu", "cuda:", "cuda:1000", "cuda:-1", "auto\n", " cpu", *TEXT_BAD],
    # data
    "dataset": ["", "a\x00b", "a\nb", "\u2028", "x" * 4096, "a" * 256, NOT_A_USER, *TEXT_BAD],
    "partition": ["", "shards", "dirichlet:-1", "dirichlet:0", "dirichlet:nan", "dirichlet:inf", "dirichlet:1e7",
                  "dirichlet:", "iid\n", "d" * 65, *TEXT_BAD],
    "test-fraction": [-0.1, 0, 0.0, 1, 1.0, 1.5, *FLOAT_BAD],
    "max-examples": [-1, 10**9 + 1, *INT_BAD],
    # model
    "model": ["", "a\x00b", "a\rb", "x" * 4096, "a" * 256, NOT_A_USER, *TEXT_BAD],
    "max-seq-len": [-1, 0, 7, 131_073, *INT_BAD],
    "lora-r": [-1, 0, 1025, *INT_BAD],
    "lora-alpha": [-1, 0, 65_537, *INT_BAD],
    "lora-dropout": [-0.1, 1, 1.0, *FLOAT_BAD],
    "lora-target-modules": ["", ",", " , ", "query\x00", "x" * 1025, *TEXT_BAD],
    "lora-mode": ["", "product", "frozen_a", "Standard", *TEXT_BAD],
    # train
    "local-steps": [-1, 0, 1_000_001, "Auto", "", *INT_BAD],
    "max-local-steps": [-1, 0, 1_000_001, "auto", *INT_BAD],
    "round-seconds": [-1, 0, 0.0, 86_401, "auto", *FLOAT_BAD],
    "round-overlap": BOOL_BAD,
    "batch-size": [-1, 0, 65_537, *INT_BAD],
    "lr": [-1e-3, 0, 0.0, 10.5, *FLOAT_BAD],
    "weight-decay": [-1e-3, 11, *FLOAT_BAD],
    "max-grad-norm": [-1, 1e7, *FLOAT_BAD],
    "lr-schedule": ["", "linear", "cosine\n", *TEXT_BAD],
    "lr-min-ratio": [-0.1, 1.1, *FLOAT_BAD],
    "lr-warmup-ratio": [-0.1, 0.6, *FLOAT_BAD],
    "prox-mu": [-1e-3, 10_001, *FLOAT_BAD],
    # outer
    "outer-optimizer": ["", "sgd", "FedAvg", *TEXT_BAD],
    "outer-lr": [-1, 0, 11, *FLOAT_BAD],
    "outer-momentum": [-0.1, 1, 1.0, *FLOAT_BAD],
    "outer-beta1": [-0.1, 1.0, *FLOAT_BAD],
    "outer-beta2": [-0.1, 1.0, *FLOAT_BAD],
    "outer-eps": [-1e-6, 0, 2, *FLOAT_BAD],
    # task
    "task.name": ["", "mlm\n", "no-such-task", "x" * 256, *TEXT_BAD],
    # comm
    "comm.codec": ["", "same", "zstd", "topk:nan", "topk:inf", "topk:-1", "lowrank:0", "int8+topk:0.1", "int8\x00",
                   "x" * 257, *TEXT_BAD],
    "comm.codec-down": ["", "zstd", "topk:nan", "randk:inf", *TEXT_BAD],
    "comm.adaptive": BOOL_BAD,
    "comm.target-seconds": [-1, 0, 86_401, *FLOAT_BAD],
    "comm.param-min": [-0.1, 0, 1025, 0.5, *FLOAT_BAD],  # 0.5: above comm.param-max (0.25)
    "comm.param-max": [-0.1, 0, 1025, 0.0005, *FLOAT_BAD],  # 0.0005: below comm.param-min (0.001)
    "comm.link-profiles": ["x", "0mbit:1ms", "20mbit:1e999s", "nanmbit:1ms", "20mbit:100ms\n", "x" * (2**20 + 1),
                           *TEXT_BAD],
    "comm.wan-control": ["a\x00b", "a\nb", "x" * (2**20 + 1), *TEXT_BAD],
    # secure aggregation
    "secagg.enabled": BOOL_BAD,
    "secagg.num-shares": [-1, 1, 2, 10_001, *INT_BAD],
    "secagg.threshold": [-1, 1, 10_001, *INT_BAD],
    "secagg.clip": [-1.0, 1e13, *FLOAT_BAD],
    "secagg.bits": [8, 12, 31, 72, *INT_BAD],
    "secagg.max-weight": [0, -1, 10**9 + 1, *INT_BAD],
    "secagg.timeout": [0, -1, 86_401, *FLOAT_BAD],
}

# The largest (or smallest) value each bound lets through: the bounds are generous, not tight.
EDGES: dict[str, list] = {
    "num-server-rounds": [1, 100_000], "min-clusters": [10_000], "wait-for-clusters": [0, 10_000], "clusters-per-round": [0, 10_000],
    "round-timeout": [1e-3, 604_800], "connect-timeout": [604_800.0], "seed": [0, 2**32 - 1],
    "out-dir": ["", "/tmp/" + "a" * 255, "runs/é x"], "eval-batch-size": [65_536], "dataset": ["a" * 255],
    "partition": ["iid", "dirichlet:1e6", "dirichlet:1e-9"], "test-fraction": [1e-9, 0.999], "max-examples": [10**9],
    "max-seq-len": [8, 131_072, "auto"], "lora-r": [1, 1024], "lora-alpha": [65_536, "auto"], "lora-dropout": [0, 0.999],
    "lora-target-modules": ["query", "attention.self.query,dense"],
    "lora-mode": ["standard", "frozen-a"], "local-steps": [1_000_000], "batch-size": [65_536],
    "lr": [1e-12, 10, "auto"], "lr-warmup-ratio": [0, 0.5, "auto"], "weight-decay": [0, 10], "max-grad-norm": [0, 1e6],
    "lr-min-ratio": [0, 1], "prox-mu": [0, 1e4],
    "outer-lr": ["auto", 10], "outer-momentum": ["auto", 0, 0.999], "outer-beta1": [0], "outer-beta2": [0.9999],
    "outer-eps": [1e-300, 1], "comm.codec": ["none", "topk:0.05+int8", "lowrank:1024"], "comm.codec-down": ["same"],
    "comm.target-seconds": [86_400], "comm.param-min": [0.25], "comm.param-max": [1024],
    "comm.link-profiles": ["20mbit:100ms,2mbit:300ms"], "comm.wan-control": ["/tmp/a.sock,/tmp/b.sock"],
}


def shown(value) -> str | None:
    """What the error must show of the value: the start of its repr (None: nothing reliable to look for)."""
    if value == "" or (isinstance(value, int) and abs(value) > 10**4000):
        return None
    return repr(value)[:20]


def test_every_key_outside_privacy_has_bad_values():
    keys = {k for k in RunConfig.known_keys() if not k.startswith("privacy.")}
    assert set(BAD) == keys
    assert set(EDGES) <= keys


@pytest.mark.parametrize("key", sorted(BAD))
def test_bad_values_are_refused_with_one_line_naming_the_key_and_value(key):
    for value in BAD[key]:
        with pytest.raises(ConfigError) as err:
            resolve(RunConfig().replace({key: value}))
            pytest.fail(f"{key}={value!r} was accepted")
        message = str(err.value)
        assert f"'{key}'" in message or key in message, (value, message)
        assert "\n" not in message and len(message) < 400, (value, message)
        fragment = shown(value)
        assert fragment is None or fragment in message, (value, message)


@pytest.mark.parametrize("key", sorted(EDGES))
def test_edge_values_are_accepted(key):
    for value in EDGES[key]:
        RunConfig().replace({key: value})


def test_defaults_are_valid_and_round_trip():
    cfg = RunConfig()
    assert RunConfig.from_flat(cfg.to_flat()) == cfg


def test_direct_construction_is_checked_too():
    from nebula_fl.config import FederationConfig, TrainConfig

    with pytest.raises(ConfigError, match="'num-server-rounds' must be int"):
        FederationConfig(num_server_rounds="5")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'lr' is nan"):
        TrainConfig(lr=NAN)


@pytest.mark.parametrize(("text", "key"), [
    ("lr=nan", "lr"),
    ("round-timeout=inf", "round-timeout"),
    ("comm.target-seconds=-inf", "comm.target-seconds"),
    ("num-server-rounds=1e999", "num-server-rounds"),
    ("local-steps=-1", "local-steps"),
    ("seed=99999999999999999999999", "seed"),
    ("lr=1" + "0" * 400, "lr"),
    ("lora-r=0", "lora-r"),
    ("outer-eps=0", "outer-eps"),
    ('dataset="a\\u0000b"', "dataset"),
    ('comm.codec="topk:nan"', "comm.codec"),
    ('partition="dirichlet:inf"', "partition"),
])
def test_cli_refuses_bad_values_before_anything_starts(tmp_path, capsys, text, key):
    out = tmp_path / "run"
    status = main(["run", "--out", str(out), "--port", "0", "--run-config", text])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith("nebula-fl: error: "), err
    assert f"'{key}'" in lines[0], err
    assert not out.exists()
