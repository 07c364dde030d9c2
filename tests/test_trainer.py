"""The persistent trainer with real torch.distributed (2 gloo ranks), driven over its socket."""

import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest

from nebula_fl.clients.protocol import request
from nebula_fl.clients.trainer_service import SHARD_FILE
from nebula_fl.config import RunConfig
from nebula_fl.errors import NebulaError
from nebula_fl.model.adapter import adapter_arrays
from nebula_fl.model.loading import build_model
from tests.conftest import launch_trainer, stop_trainer

LABELS = ["business", "entertainment", "politics", "sports", "tech"]


def start_trainer(tmp_path, tiny_model, name):
    sock = tmp_path / f"{name}.sock"
    args = ["--socket", str(sock), "--workers", "2", "--threads", "1", "--model", str(tiny_model), "--state-dir",
            str(tmp_path / "state"), "--dataset", "bbcnews", "--num-clusters", "2", "--max-examples", "300",
            "--cluster-id", "1"]
    proc, hello = launch_trainer(args, sock=sock, log_path=tmp_path / f"{name}.log")
    return proc, sock, hello


stop = stop_trainer


@pytest.fixture
def round_config(tiny_model):
    cfg = RunConfig().replace({"model": str(tiny_model), "local-steps": 4, "batch-size": 4, "max-seq-len": 32})

    def make(rnd, **extra):
        return {**cfg.train.to_flat(), **cfg.model.to_flat(), "labels": LABELS, "federation-id": "fed1",
                "seed": 0, "server-round": rnd, **extra}

    return cfg, make


def test_ddp_ranks_stay_in_sync_and_snapshots_restore_exactly(tmp_path, tiny_model, round_config):
    cfg, make = round_config
    global_adapter = adapter_arrays(build_model(cfg.model, num_labels=5, seed=0))
    proc, sock, info = start_trainer(tmp_path, tiny_model, "a")
    try:
        assert info["workers"] == 2 and set(info) == {"ok", "cluster_id", "workers", "nodes", "device", "precision",
                                                       "parallel", "privacy_mode"}  # nothing of the data on the socket
        shard = json.loads((tmp_path / "state" / SHARD_FILE).read_text())  # the operator's, in the private folder
        assert shard["num_examples"] > 0 and sum(shard["label_counts"].values()) == shard["num_examples"]
        r1, u1 = request(sock, {"op": "train", "config": make(1)}, global_adapter)
        m = r1["metrics"]
        assert m["rank-divergence"] == 0.0 and m["workers"] == 2 and m["steps"] == 4
        assert m["examples-seen"] == 4 * 4 * 2
        assert set(u1) == set(global_adapter)
        assert all(np.isfinite(v).all() for v in u1.values())
        assert sum(float(np.abs(v).sum()) for v in u1.values()) > 0
        _, u2 = request(sock, {"op": "train", "config": make(2)}, global_adapter)
        # round 2 resent (as after a server resume): restored from the round-1 snapshot, same result
        _, u2_again = request(sock, {"op": "train", "config": make(2)}, global_adapter)
        for k in u2:
            np.testing.assert_array_equal(u2[k], u2_again[k])
        assert any(not np.array_equal(u1[k], u2[k]) for k in u1)  # the batch stream moved on
        _, u3 = request(sock, {"op": "train", "config": make(3)}, global_adapter)
        with pytest.raises(NebulaError, match="not a plain name"):
            request(sock, {"op": "train", "config": make(4, **{"federation-id": "../../escape"})}, global_adapter)
        with pytest.raises(NebulaError, match="labels"):
            request(sock, {"op": "train", "config": make(4, labels=["only", "two"], **{"federation-id": "fed2"})},
                    global_adapter)
        # the state folder (snapshots, replies, ledger, lock) is the trainer's user's alone; the key beside the socket too
        state = [tmp_path / "state", *(tmp_path / "state").rglob("*")]
        assert len(state) > 5 and {p.stat().st_mode & 0o077 for p in state} == {0}
        assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700 and sock.stat().st_mode & 0o077 == 0
    finally:
        stop(proc)
    # a new trainer process (a restarted cluster) continues from the snapshot on disk
    proc, sock, _ = start_trainer(tmp_path, tiny_model, "b")
    try:
        _, u3_restarted = request(sock, {"op": "train", "config": make(3)}, global_adapter)
    finally:
        stop(proc)
    for k in u3:
        np.testing.assert_array_equal(u3[k], u3_restarted[k])


def test_the_clientapp_does_not_import_torch():
    code = "import sys, nebula_fl.clients.app; sys.exit(int('torch' in sys.modules or 'transformers' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_compressed_exchange_keeps_views_and_error_feedback_across_a_restart(tmp_path, tiny_model, round_config):
    from nebula_fl.comm.views import view_crc
    from nebula_fl.compression import Compressor, Layout

    cfg, make = round_config
    start = adapter_arrays(build_model(cfg.model, num_labels=5, seed=0))
    layout = Layout.from_arrays({k: start[k] for k in sorted(start)})
    flat = layout.flatten(start)
    seed = 11

    def full(rnd):
        blob = Compressor("none", layout=layout).encode(flat, seed=seed)
        extra = {"sync": "full", "codec-seed": seed, "codec-up": "topk:0.1+int8", "view-crc-after": view_crc(flat)}
        return make(rnd, **extra), {"blob": np.frombuffer(blob, np.uint8).copy()}

    def delta(rnd, base, base_round, target):
        blob = Compressor("topk:0.5", layout=layout).encode(target - base, seed=seed)
        after = base + Compressor.decode(blob, layout=layout, seed=seed)
        extra = {"sync": "delta", "codec-seed": seed, "codec-up": "topk:0.1+int8", "view-round": base_round,
                 "view-crc": view_crc(base), "view-crc-after": view_crc(after)}
        return make(rnd, **extra), {"blob": np.frombuffer(blob, np.uint8).copy()}, after

    proc, sock, _ = start_trainer(tmp_path, tiny_model, "c")
    try:
        # first contact may be a change from the seeded initial adapter, which the cluster rebuilds itself
        request(sock, {"op": "train", "config": delta(1, flat, 0, flat)[0] | {"federation-id": "other"}},
                delta(1, flat, 0, flat)[1])
        reply, out = request(sock, {"op": "train", "config": full(1)[0]}, full(1)[1])
        assert set(out) == {"blob"} and reply["metrics"]["codec-up"] == "topk:0.1+int8"
        update = Compressor.decode(out["blob"].tobytes(), layout=layout, seed=seed)
        assert np.isfinite(update).all() and 0 < np.count_nonzero(update) <= int(np.ceil(0.1 * layout.size))
        target = flat + 0.01
        config2, payload2, view2 = delta(2, flat, 1, target)
        request(sock, {"op": "train", "config": config2}, payload2)
        config3, payload3, _ = delta(3, view2, 2, target + 0.01)
        wrong = dict(config3, **{"view-round": 1})
        with pytest.raises(NebulaError, match="resync needed"):
            request(sock, {"op": "train", "config": wrong}, payload3)
        _, first = request(sock, {"op": "train", "config": config3}, payload3)
    finally:
        stop(proc)
    proc, sock, _ = start_trainer(tmp_path, tiny_model, "d")
    try:
        _, again = request(sock, {"op": "train", "config": config3}, payload3)
    finally:
        stop(proc)
    # the restarted cluster restored its view and its error-feedback residual: the same bytes go up
    assert again["blob"].tobytes() == first["blob"].tobytes()


def test_sample_level_dp_accounts_across_rounds_restarts_and_enforces_the_budget(tmp_path, tiny_model, round_config):
    cfg, make = round_config
    start = adapter_arrays(build_model(cfg.model, num_labels=5, seed=0))
    # standard LoRA, as the server built it (lora-mode "auto" would be frozen-a under sample DP)
    dp = {"lora-mode": "standard", "privacy.mode": "sample", "privacy.noise-multiplier": 1.0, "privacy.max-grad-norm": 1.0,
          "privacy.accountant": "rdp", "privacy.delta": 1e-5, "privacy.target-epsilon": "auto",
          "privacy.max-epsilon": "auto", "num-server-rounds": 3}
    proc, sock, _ = start_trainer(tmp_path, tiny_model, "dp")
    try:
        r1, u1 = request(sock, {"op": "train", "config": make(1, **dp)}, start)
        r2, _ = request(sock, {"op": "train", "config": make(2, **dp)}, start)
    finally:
        stop(proc)
    m1, m2 = r1["metrics"], r2["metrics"]
    assert m1["dp-steps"] == 4 and m2["dp-steps"] == 8  # cumulative over the run, not per round
    assert 0 < m1["epsilon"] < m2["epsilon"]
    assert m1["noise-multiplier"] == 1.0 and 0 < m1["sample-rate"] < 1 and m1["delta"] == 1e-5
    assert "rank-divergence" not in m1 and "train-loss" not in m1  # data-dependent figures stay in the cluster
    log = (tmp_path / "dp.log").read_text()
    assert re.search(r"round 1: loss .*, rank divergence 0$", log, re.M), log  # DPDDP kept the ranks identical
    assert all(np.isfinite(v).all() for v in u1.values()) and sum(float(np.abs(v).sum()) for v in u1.values()) > 0
    # a restarted cluster resumes its ledger: round 2 again gives the same epsilon as before
    proc, sock, _ = start_trainer(tmp_path, tiny_model, "dp2")
    try:
        again, _ = request(sock, {"op": "train", "config": make(2, **dp)}, start)
        assert again["metrics"]["epsilon"] == pytest.approx(m2["epsilon"], rel=1e-9)
        # with a budget between two and three rounds' worth, round 3 is refused, and it says why
        budget = dict(dp, **{"privacy.max-epsilon": (m2["epsilon"] * 1.05)})
        refused, update = request(sock, {"op": "train", "config": make(3, **budget)}, start)
        # client-level DP: the update that leaves is clipped to C and carries N(0, (sigma C)^2) per entry
        client = dict(dp, **{"privacy.mode": "client", "privacy.max-grad-norm": 0.1, "privacy-sigma": 0.5,
                             "privacy-noise-shares": 1, "federation-id": "fedc"})
        noised, sent = request(sock, {"op": "train", "config": make(1, **client)}, start)
    finally:
        stop(proc)
    m = noised["metrics"]
    assert m["noise-std"] == pytest.approx(0.05) and "update-norm-before-clip" not in m and "clipped" not in m
    n = sum(v.size for v in sent.values())
    energy = sum(float((v.astype(np.float64) ** 2).sum()) for v in sent.values())
    # the noise's squared norm is 0.05² χ²_n: mean 0.05² n, standard deviation 0.05² √(2n); allow 5 of them
    assert abs(energy - (0.1**2 + 0.05**2 * n)) <= 5 * 0.05**2 * math.sqrt(2 * n) + 0.1**2
    assert refused["metrics"]["privacy-refused"] == 1 and update == {}
    assert "would be exceeded" in refused["metrics"]["privacy-reason"]
    assert refused["metrics"]["epsilon"] == pytest.approx(m2["epsilon"], rel=1e-9)  # nothing was spent


def test_frozen_a_sends_only_b_and_refuses_a_server_with_another_a(tmp_path, tiny_model, round_config):
    from nebula_fl.model.frozen_a import fingerprint

    cfg, make = round_config
    frozen = cfg.replace({"lora-mode": "frozen-a"})
    server = build_model(frozen.model, num_labels=5, seed=0)
    start, mine = adapter_arrays(server), fingerprint(server)
    other = fingerprint(build_model(frozen.model, num_labels=5, seed=1))
    base = {**make(1), **frozen.model.to_flat(), "frozen-fingerprint": mine}
    dp = {"privacy.mode": "sample", "privacy.noise-multiplier": 1.0, "privacy.max-grad-norm": 1.0,
          "privacy.accountant": "rdp", "privacy.delta": 1e-5, "privacy.target-epsilon": "auto",
          "privacy.max-epsilon": "auto", "num-server-rounds": 2, "federation-id": "fdp", "privacy.batch-size": 12}
    proc, sock, _ = start_trainer(tmp_path, tiny_model, "frozen")
    try:
        reply, update = request(sock, {"op": "train", "config": base}, start)
        assert reply["metrics"]["rank-divergence"] == 0.0
        assert set(update) == set(start) and not any(".lora_A." in k for k in update)
        assert any(float(np.abs(v).sum()) > 0 for k, v in update.items() if ".lora_B." in k)  # B trains
        # Opacus trains B and the head with A frozen (its per-example gradients skip frozen tensors), here in
        # logical batches of 12 expected examples (privacy.batch-size) that 2 workers compute in chunks of 4
        dp_reply, private = request(sock, {"op": "train", "config": {**base, **dp}}, start)
        assert set(private) == set(start) and all(np.isfinite(v).all() for v in private.values())
        m, n = dp_reply["metrics"], json.loads((tmp_path / "state" / SHARD_FILE).read_text())["num_examples"]
        assert m["sample-rate"] == pytest.approx(1 / math.ceil(n / 12)) and m["dp-steps"] == 4
        assert m["examples-seen"] == 4 * 12
        with pytest.raises(NebulaError, match=r"frozen LoRA A .* differs from the server's"):
            request(sock, {"op": "train", "config": {**base, "frozen-fingerprint": other, "federation-id": "f2"}}, start)
        with pytest.raises(NebulaError, match="frozen LoRA A"):  # a standard server, a frozen cluster
            request(sock, {"op": "train", "config": {**base, "frozen-fingerprint": "", "federation-id": "f3"}}, start)
    finally:
        stop(proc)
