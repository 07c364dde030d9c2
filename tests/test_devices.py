"""Devices and precision: per-cluster and per-worker device specs, refusals before anything starts, snapshots
written on a GPU restoring on a CPU, and bf16 autocast that leaves what is exchanged in fp32.

This machine has no GPU: the GPU paths are checked here where they can be (parsing, counting against a given
number of visible GPUs, map_location, the RNG record); benchmarks/gpu.py runs them on a GPU machine."""

from __future__ import annotations

from argparse import Namespace

import numpy as np
import pytest
import torch

from nebula_fl.cli import main
from nebula_fl.clients.snapshots import SnapshotStore
from nebula_fl.clients.trainer import rng_state, set_rng_state
from nebula_fl.config import ConfigError, FederationConfig
from nebula_fl.devices import check_visible, resolve_precision, server_device, worker_devices
from nebula_fl.errors import NebulaError
from nebula_fl.launcher.plan import make_plan


@pytest.mark.parametrize("spec, workers, expected", [
    ("cpu", 3, ["cpu", "cpu", "cpu"]),
    ("cuda", 2, ["cuda:0", "cuda:1"]),
    ("cuda:3", 1, ["cuda:3"]),
    ("cuda:2+cuda:0", 2, ["cuda:2", "cuda:0"]),
    ("cpu+cpu", 2, ["cpu", "cpu"]),
])
def test_a_spec_gives_one_device_per_worker_in_rank_order(spec, workers, expected):
    assert worker_devices(spec, workers=workers) == expected


@pytest.mark.parametrize("spec, workers, fragment", [
    ("gpu", 1, "use cpu, cuda, cuda:N"),
    ("cuda:0+", 2, "device ''"),
    ("cuda:0", 2, "puts 2 workers on one GPU, which NCCL refuses; give each worker its own GPU (e.g. cuda:0+cuda:1)"),
    ("cuda:0+cuda:0", 2, "puts two workers on one GPU"),
    ("cuda:0+cpu", 2, "mixes cpu and cuda workers"),
    ("cuda:0+cuda:1", 3, "names 2 devices for 3 worker"),
    ("cuda+cuda", 2, "name each GPU as cuda:N"),
])
def test_bad_specs_are_one_line_saying_what_to_change(spec, workers, fragment):
    with pytest.raises(NebulaError, match=None) as caught:
        worker_devices(spec, workers=workers)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


def test_more_workers_than_visible_gpus_is_refused_naming_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(NebulaError, match=r"needs 2 GPU\(s\).*1 is visible \(CUDA_VISIBLE_DEVICES='3'\)"):
        check_visible(worker_devices("cuda", workers=2), visible=1)
    with pytest.raises(NebulaError, match="no CUDA device is visible"):
        check_visible(["cuda:0"], visible=0)
    check_visible(["cuda:0", "cuda:1"], visible=2)
    check_visible(["cpu"], visible=0)


def test_precision_auto_is_bf16_on_gpu_fp32_on_cpu_and_fp32_under_per_example_dp():
    assert resolve_precision("auto", device_kind="cuda") == "bf16"
    assert resolve_precision("auto", device_kind="cpu") == "fp32"
    assert resolve_precision("bf16", device_kind="cpu") == "bf16"
    assert resolve_precision("auto", device_kind="cuda", privacy_mode="sample") == "fp32"
    assert resolve_precision("bf16", device_kind="cuda", privacy_mode="client") == "bf16"
    with pytest.raises(NebulaError, match="bf16 cannot train under per-example DP"):
        resolve_precision("bf16", device_kind="cuda", privacy_mode="sample")
    with pytest.raises(NebulaError, match="use auto"):
        resolve_precision("fp16", device_kind="cuda")


def test_server_device_auto_takes_a_gpu_when_the_host_has_one():
    assert server_device("auto", visible=0) == "cpu"
    assert server_device("auto", visible=2) == "cuda:0"
    assert server_device("cuda:1", visible=2) == "cuda:1"
    assert server_device("cpu", visible=2) == "cpu"
    with pytest.raises(NebulaError, match="server-device"):
        server_device("cuda:2", visible=2)
    with pytest.raises(ConfigError, match="server-device"):
        FederationConfig(server_device="gpu0")


def _args(tmp_path, **given) -> Namespace:
    base = dict(resume=None, rewind=False, clusters=2, preset="smoke", task=None, rounds=None, local_steps=None,
                outer_optimizer=None, partition="iid", seed=None, codec=None, secure_aggregation=None, run_config=None,
                out=str(tmp_path / "run"), workers_per_cluster=None, device=None, port=0, wan=None, secure=None)
    return Namespace(**{**base, **given})


def test_the_launcher_refuses_gpus_it_cannot_give_before_starting_anything(tmp_path, capsys):
    """The H200 failure: 2 workers on one GPU crash-looped in NCCL and hung the run; now one line, exit 2."""
    status = main(["run", "--preset", "smoke", "--out", str(tmp_path / "run"), "--port", "0", "--device", "cuda",
                   "--workers-per-cluster", "2"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.count("\n") == 0 and "--device (cluster 0)" in err
    assert not (tmp_path / "run").exists()
    with pytest.raises(NebulaError, match=r"--device \(cluster 1\) '.*' puts 2 workers on one GPU"):
        make_plan(_args(tmp_path, device="cpu,cuda:0", workers_per_cluster="1,2"))


def test_precision_is_per_cluster_kept_for_resume_and_checked(tmp_path):
    plan = make_plan(_args(tmp_path, precision="fp32,bf16"))
    assert plan.launcher_record()["precisions"] == ["fp32", "bf16"]
    assert make_plan(_args(tmp_path)).precisions is None
    with pytest.raises(NebulaError, match="--precision has 'half'"):
        make_plan(_args(tmp_path, precision="half"))
    with pytest.raises(NebulaError, match=r"--precision \(cluster 0\) bf16 cannot train under per-example DP"):
        make_plan(_args(tmp_path, precision="bf16", run_config="privacy.mode='sample' privacy.noise-multiplier=1.0"))


def test_the_trainer_refuses_a_device_it_cannot_use_at_start(tmp_path, capsys):
    common = ["trainer", "--socket", str(tmp_path / "t.sock"), "--state-dir", str(tmp_path / "state"),
              "--dataset", "bbcnews", "--num-clusters", "2", "--max-examples", "64"]
    assert main([*common, "--workers", "2", "--device", "cuda:0"]) == 2
    assert "puts 2 workers on one GPU" in capsys.readouterr().err
    assert main([*common, "--device", "cuda"]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err
    assert main([*common, "--precision", "bf16", "--privacy-mode", "sample", "--min-noise-multiplier", "1"]) == 2
    assert "bf16 cannot train under per-example DP" in capsys.readouterr().err
    assert not (tmp_path / "state" / "trainer.lock").exists()


def _save_tagged_as_gpu(obj, path) -> None:
    """What torch.save writes for tensors on cuda:0, produced without a GPU: every storage's location tag says
    'cuda:0' (torch.load without map_location then needs a GPU, as a GPU-written snapshot does)."""
    from torch import serialization

    original = serialization.location_tag
    serialization.location_tag = lambda storage: "cuda:0"
    try:
        torch.save(obj, path)
    finally:
        serialization.location_tag = original


def test_a_snapshot_written_on_a_gpu_restores_on_a_cpu(tmp_path):
    store = SnapshotStore(tmp_path)
    state = {"round": 3, "optimizer": {"state": {0: {"exp_avg": torch.arange(4.0)}}, "param_groups": []},
             **rng_state(torch.device("cpu"))}
    state["device"] = "cuda"
    store.folder.mkdir(parents=True, exist_ok=True)
    _save_tagged_as_gpu({"world": 1, "ranks": [state]}, store.folder / "round-00003.pt")
    with pytest.raises(RuntimeError, match="CUDA"):  # the simulation is real: the file asks for a GPU
        torch.load(store.folder / "round-00003.pt", weights_only=True)
    loaded = store.load(3)
    assert torch.equal(loaded["ranks"][0]["optimizer"]["state"][0]["exp_avg"], torch.arange(4.0))
    assert loaded["ranks"][0]["optimizer"]["state"][0]["exp_avg"].device.type == "cpu"
    # its CPU RNG stream restores; the run says it goes on not bit-exactly (another kind of device)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    saved = rng_state(torch.device("cpu"))
    saved["device"] = "cuda"
    torch.rand(5)
    assert set_rng_state(saved, torch.device("cpu")) is False
    assert torch.equal(torch.rand(3), expected)
    assert set_rng_state(rng_state(torch.device("cpu")), torch.device("cpu")) is True


def test_bf16_autocast_trains_in_bf16_and_exchanges_fp32(tiny_model):
    from nebula_fl.clients.inner_loop import BatchSchedule, train_steps
    from nebula_fl.config import ModelConfig
    from nebula_fl.model.adapter import adapter_arrays
    from nebula_fl.tasks import TaskSetup, make_task

    task = make_task("classify", {})
    setup = TaskSetup(model=ModelConfig(model=str(tiny_model), max_seq_len=16), labels=["a", "b", "c"], seed=0,
                      path=tiny_model, privacy_mode="off")
    texts = [f"text number {i} about {w}" for i, w in enumerate(["sport", "money", "films"] * 4)]
    labels = np.array([0, 1, 2] * 4)
    out = {}
    for precision in ("fp32", "bf16"):
        model = task.build_model(setup)
        data = task.examples(setup=setup, tokenizer=task.tokenizer(setup), texts=texts, labels=labels, train=True)
        before = adapter_arrays(model)
        seen: list[torch.dtype] = []
        model.register_forward_hook(lambda _m, _i, output, seen=seen: seen.append(output.dtype))
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        losses = train_steps(model, optimizer, data, BatchSchedule(len(data), batch_size=4, seed=0, rank=0), steps=3,
                             max_grad_norm=1.0, device=torch.device("cpu"), loss_fn=task.loss, precision=precision)
        assert all(np.isfinite(losses))
        assert set(seen) == {torch.bfloat16 if precision == "bf16" else torch.float32}
        assert all(p.dtype == torch.float32 for p in model.parameters())
        out[precision] = {k: v - before[k] for k, v in adapter_arrays(model).items()}  # what would be sent
    assert all(v.dtype == np.float32 for v in out["bf16"].values())
    fp32 = np.concatenate([v.ravel() for v in out["fp32"].values()])
    bf16 = np.concatenate([v.ravel() for v in out["bf16"].values()])
    relative = float(np.linalg.norm(bf16 - fp32) / np.linalg.norm(fp32))
    assert 0 < relative < 0.05, relative


def test_a_resumed_run_may_move_to_other_hardware_but_keeps_its_config(tmp_path):
    from nebula_fl.storage.run_folder import RunFolder

    plan = make_plan(_args(tmp_path, precision="bf16", workers_per_cluster="2,1"))
    RunFolder(plan.out).write_config({"run_config": plan.config.to_flat(), "launcher": plan.launcher_record()})

    def resume(**given):
        return make_plan(Namespace(resume=str(plan.out), rounds=None, port=0, **given))

    assert resume().precisions == ["bf16", "bf16"] and resume().devices == ["cpu", "cpu"]
    moved = resume(device="cpu+cpu,cpu", precision="fp32,auto")
    assert moved.devices == ["cpu+cpu", "cpu"] and moved.precisions == ["fp32", "auto"]
    with pytest.raises(NebulaError, match="drop --workers-per-cluster"):  # its snapshots hold 2 and 1 ranks
        resume(workers_per_cluster="1")
    with pytest.raises(NebulaError, match=r"--device \(cluster 0\) 'cuda:0' puts 2 workers on one GPU"):
        resume(device="cuda:0")
