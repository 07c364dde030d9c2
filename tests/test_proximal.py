"""FedProx's proximal term (`prox-mu`): the maths by hand, one optimizer step against a plain one (with and without
Opacus), the trainer under DDP, FSDP, round-overlap and per-example DP, and a strategy's client options."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from nebula_fl.clients.proximal import ProximalTerm, attach, proximal_gradient, proximal_penalty
from nebula_fl.config import ModelConfig, OuterConfig, RunConfig
from nebula_fl.errors import ConfigError
from nebula_fl.model.adapter import adapter_arrays, adapter_parameters
from nebula_fl.model.batches import TokenizedTexts
from nebula_fl.model.loading import build_model, load_tokenizer
from tests.gloo_ranks import spawn_ranks
from tests.test_sharding import _trainer as sharded_trainer

LABELS = ["business", "entertainment", "politics", "sports", "tech"]
TEXTS = ["the match ended in a draw", "shares fell on the stock market", "the minister resigned today",
         "a new phone was launched", "the film won an award", "profits rose sharply this year",
         "the striker scored twice", "the election is next week"]
TARGETS = np.array([3, 0, 2, 4, 1, 0, 3, 2])


# -- the maths -------------------------------------------------------------------------------------------------
def test_the_penalty_and_its_gradient_match_a_hand_computed_value():
    w = [torch.tensor([[1.0, 2.0]]), torch.tensor([3.0])]
    a = [torch.tensor([[0.0, 0.0]]), torch.tensor([1.0])]
    # (0.5 / 2) * ((1 - 0)^2 + (2 - 0)^2 + (3 - 1)^2) = 0.25 * 9
    assert float(proximal_penalty(w, a, mu=0.5)) == pytest.approx(2.25, abs=1e-12)
    leaves = [t.clone().requires_grad_(True) for t in w]
    proximal_penalty(leaves, a, mu=0.5).backward()
    for leaf, wi, ai in zip(leaves, w, a, strict=True):
        torch.testing.assert_close(leaf.grad.float(), proximal_gradient(wi, ai, mu=0.5))  # mu (w - a)
    torch.testing.assert_close(proximal_gradient(w[0], a[0], mu=0.5), torch.tensor([[0.5, 1.0]]))
    with pytest.raises(ValueError, match="match one to one"):
        proximal_penalty(w, a[:1], mu=1.0)


def test_the_term_adds_mu_times_the_distance_to_every_gradient_and_refuses_what_does_not_match():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    q = torch.nn.Parameter(torch.tensor([[4.0]]))
    p.grad = torch.tensor([0.5, 0.5])  # q has no gradient (unused in the loss): it gets the term alone
    term = ProximalTerm(params={"p": p, "q": q}, anchor={"p": np.array([0.0, 0.0], np.float32),
                                                          "q": np.array([[1.0]], np.float32)}, mu=2.0)
    term.add_to_gradients()
    torch.testing.assert_close(p.grad, torch.tensor([0.5 + 2.0, 0.5 - 4.0]))
    torch.testing.assert_close(q.grad, torch.tensor([[6.0]]))
    with pytest.raises(ValueError, match=r"differ on \['q'\]"):
        ProximalTerm(params={"p": p, "q": q}, anchor={"p": np.zeros(2, np.float32)}, mu=1.0)
    with pytest.raises(ValueError, match="shape"):
        ProximalTerm(params={"p": p}, anchor={"p": np.zeros(3, np.float32)}, mu=1.0)
    for mu in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="mu"):
            ProximalTerm(params={"p": p}, anchor={"p": np.zeros(2, np.float32)}, mu=mu)


def test_prox_mu_is_a_bounded_train_key_off_by_default():
    assert RunConfig().train.prox_mu == 0.0
    assert RunConfig().replace({"prox-mu": 0.01}).to_flat()["prox-mu"] == 0.01
    with pytest.raises(ConfigError, match=r"'prox-mu' is -0\.1"):
        RunConfig().replace({"prox-mu": -0.1})


# -- one optimizer step, with and without Opacus ---------------------------------------------------------------
@pytest.fixture
def tiny(tiny_model):
    cfg = ModelConfig(model=str(tiny_model), max_seq_len=16)
    data = TokenizedTexts(load_tokenizer(tiny_model), TEXTS, TARGETS, max_len=16)

    def fresh():
        model = build_model(cfg, num_labels=5, seed=0)
        for module in model.modules():  # the same forward pass every time: no dropout draws
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        return model

    return fresh, data


def _sgd_step(model, data, *, mu: float, anchor, private: bool, noise: float = 0.0, clip: float = 1e9, lr=0.5):
    from nebula_fl.clients.inner_loop import BatchSchedule, train_steps
    from nebula_fl.privacy.sample_dp import Batches, make_private, train_private_steps
    from nebula_fl.tasks.classify import ClassifyTask

    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    term = ProximalTerm(params=adapter_parameters(model), anchor=anchor, mu=mu) if mu > 0 else None
    torch.manual_seed(7)  # Opacus's noise comes from torch's global RNG: the same noise with and without the term
    if private:
        training = make_private(model=model, optimizer=optimizer, data=data, batch_size=len(data),
                                noise_multiplier=noise, max_grad_norm=clip, distributed=False, poisson_sampling=False)
        attach(training.optimizer, lambda: term)
        train_private_steps(training, Batches(training.loader), steps=1, device=torch.device("cpu"))
    else:
        attach(optimizer, lambda: term)
        train_steps(model, optimizer, data, BatchSchedule(len(data), batch_size=len(data), seed=0, rank=0), steps=1,
                    max_grad_norm=0.0, device=torch.device("cpu"), loss_fn=ClassifyTask().loss)
    return adapter_arrays(model)


@pytest.mark.parametrize("private,noise,clip", [(False, 0.0, 1e9), (True, 0.0, 1e9), (True, 1.0, 0.01)])
def test_one_step_with_the_term_is_the_plain_step_plus_lr_mu_times_the_pull(tiny, private, noise, clip):
    """SGD: w1 = w0 - lr (g + mu (w0 - a)). The term is data-independent, so under Opacus it comes after the
    per-example clipping and noise, unclipped and unnoised: with the same noise draws the two steps differ by
    exactly lr mu (w0 - a) (a term in the loss would be dropped by Opacus: no difference at all)."""
    fresh, data = tiny
    start = adapter_arrays(fresh())
    anchor = {k: (v + np.random.default_rng(1).standard_normal(v.shape).astype(np.float32) * 0.1) for k, v in start.items()}
    lr, mu = 0.5, 0.3
    plain = _sgd_step(fresh(), data, mu=0.0, anchor=anchor, private=private, noise=noise, clip=clip, lr=lr)
    prox = _sgd_step(fresh(), data, mu=mu, anchor=anchor, private=private, noise=noise, clip=clip, lr=lr)
    assert any(not np.allclose(plain[k], start[k]) for k in start)  # the data step moved the adapter
    for k in start:
        np.testing.assert_allclose(prox[k] - plain[k], -lr * mu * (start[k] - anchor[k]), rtol=1e-4, atol=1e-6,
                                   err_msg=k)


def test_every_exchanged_adapter_tensor_is_matched_to_its_trainable_parameter(tiny_model):
    for mode in ("standard", "frozen-a"):
        model = build_model(ModelConfig(model=str(tiny_model), lora_mode=mode), num_labels=5, seed=0)
        params, arrays = adapter_parameters(model), adapter_arrays(model)
        assert set(params) == set(arrays) and len(arrays) > 2, mode  # frozen A: neither exchanged nor matched
        assert len({id(p) for p in params.values()}) == len(params)
        for k, p in params.items():
            assert p.requires_grad
            np.testing.assert_array_equal(p.detach().numpy(), arrays[k])


# -- the trainer, two gloo ranks --------------------------------------------------------------------------------
def _trainer(parallel: str, state_dir: Path, model_path: Path, rank: int, world: int, control):
    return sharded_trainer(parallel, state_dir, model_path, rank, world, control, examples=64)


def _config(model_path: Path, rnd: int = 1, **extra) -> dict:
    cfg = RunConfig().replace({"model": str(model_path), "local-steps": 6, "batch-size": 4, "max-seq-len": 16,
                               "lr": 0.01, "lr-schedule": "constant"})
    return {**cfg.train.to_flat(), **cfg.model.to_flat(), "labels": LABELS, "federation-id": "fed1", "seed": 0,
            "server-round": rnd, "global-round": rnd - 1, "num-server-rounds": 5, **extra}


def _norm(arrays: dict) -> float:
    return float(np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in arrays.values())))


def _checks(rank: int, world: int, model_path: Path, out: Path) -> dict:
    import torch.distributed as dist

    from nebula_fl.privacy.policy import Admission

    control = dist.new_group(backend="gloo")
    off = Admission(allowed=True)
    start = adapter_arrays(build_model(ModelConfig(model=str(model_path), max_seq_len=16), num_labels=5, seed=0))
    found: dict = {}
    updates = {}
    for name, parallel, mu in (("ddp-0", "ddp", 0.0), ("ddp-1", "ddp", 1.0), ("ddp-huge", "ddp", 1e4),
                               ("fsdp-1", "fsdp", 1.0)):
        trainer = _trainer(parallel, out / name, model_path, rank, world, control)
        updates[name], metrics = trainer.train_round(_config(model_path, **{"prox-mu": mu}), start, off)
        found[f"{name}-norm"] = _norm(updates[name])
        found[f"{name}-max"] = max(float(np.abs(v).max()) for v in updates[name].values())
        found[f"{name}-divergence"] = metrics["rank-divergence"]
        found[f"{name}-metrics"] = {k: v for k, v in metrics.items() if k.startswith("prox-")}
        if name == "ddp-1":  # what the task saw: the round's global weights, on the worker's device
            seen = trainer.task.global_weights
            found["task-keys"] = sorted(seen) == sorted(start)
            found["task-equal"] = all(np.array_equal(seen[k].cpu().numpy(), start[k]) for k in start)
            found["task-device"] = sorted({str(seen[k].device) for k in start})
            found["update-term"] = 0.5 * mu * _norm(updates[name]) ** 2  # the update is after - global here
    found["ddp-vs-fsdp"] = max(float(np.abs(updates["ddp-1"][k] - updates["fsdp-1"][k]).max()) for k in start)
    # round-overlap: after the send the cluster trains on from its rebased weights, anchored to the global it got
    trainer = _trainer("ddp", out / "overlap", model_path, rank, world, control)
    config = _config(model_path, **{"prox-mu": 1.0, "round-overlap": True})
    trainer.train_round(config, start, off)
    ahead = trainer.wants_ahead()
    trainer.train_ahead(ahead)
    anchor = {k: trainer.proximal.anchor[i].numpy() for i, k in enumerate(sorted(start))}
    found["overlap-ahead"] = ahead
    found["overlap-anchor-is-global"] = all(np.array_equal(anchor[k], start[k]) for k in start)
    found["overlap-start-is-not"] = any(not np.array_equal(trainer.anchor[k], start[k]) for k in start)
    moved = {k: v + 0.01 for k, v in start.items()}  # round 2's message brings a new global
    _, metrics = trainer.train_round({**config, "server-round": 2, "global-round": 1}, moved, off)
    anchor = {k: trainer.proximal.anchor[i].numpy() for i, k in enumerate(sorted(start))}
    found["overlap-new-anchor"] = all(np.array_equal(anchor[k], moved[k]) for k in start)
    # per-example DP: the term is added after Opacus's noise; a huge mu keeps the update near the global
    sample = Admission(allowed=True, mode="sample", noise_multiplier=0.5, sample_rate=0.25, steps=6, max_grad_norm=1.0)
    for name, mu in (("dp-0", 0.0), ("dp-huge", 1e4)):
        trainer = _trainer("ddp", out / name, model_path, rank, world, control)
        dp_config = _config(model_path, **{"prox-mu": mu, "privacy.mode": "sample", "privacy.batch-size": 16,
                                           "privacy.noise-multiplier": 0.5, "lora-mode": "standard"})
        update, metrics = trainer.train_round(dp_config, start, sample)
        found[f"{name}-norm"] = _norm(update)
        found[f"{name}-max"] = max(float(np.abs(v).max()) for v in update.values())
        found["dp-lr"] = trainer.base_lr
        found[f"{name}-divergence"] = metrics["rank-divergence"]
    return found


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from nebula_fl.model.tiny import build_tiny_model

    tmp = tmp_path_factory.mktemp("prox")
    model_path = build_tiny_model(tmp / "model", layers=2)
    return spawn_ranks(_checks, world=2, folder=tmp, args=(model_path, tmp / "state"))[0]



def test_under_ddp_and_fsdp_the_term_pulls_the_update_toward_the_global_weights(two_ranks):
    found, lr = two_ranks, 0.01
    # the same seed and data: mu = 1 shortens the update; the ranks stay bit-identical (DDP and FSDP)
    assert found["ddp-1-norm"] < 0.5 * found["ddp-0-norm"], found
    assert found["ddp-0-divergence"] == found["ddp-1-divergence"] == found["fsdp-1-divergence"] == 0.0
    # FSDP adds the term shard by shard: the LoRA classifier's update is DDP's exactly (its gradients agree
    # exactly, tests/test_sharding.py)
    assert found["ddp-vs-fsdp"] == 0.0 and found["fsdp-1-norm"] > 0
    # a huge mu pins every weight: AdamW's step is about lr whatever the gradient's scale, so the floor is within
    # one step of the global weights (6 steps of plain training move some weight by several)
    assert found["ddp-0-max"] > 3 * lr and found["ddp-huge-max"] < lr, found
    # the reply says mu and the term's value at the round's end, (mu / 2) ||after - global||^2
    assert found["ddp-0-metrics"] == {}
    assert found["ddp-1-metrics"]["prox-mu"] == 1.0
    assert found["ddp-1-metrics"]["prox-term"] == pytest.approx(found["update-term"], rel=1e-6)


def test_the_task_sees_the_rounds_global_weights(two_ranks):
    assert two_ranks["task-keys"] and two_ranks["task-equal"] and two_ranks["task-device"] == ["cpu"]


def test_overlapped_clusters_are_anchored_to_the_last_global_received(two_ranks):
    assert two_ranks["overlap-ahead"] == 6  # trained the next round's steps ahead, from its own rebased weights
    assert two_ranks["overlap-start-is-not"] and two_ranks["overlap-anchor-is-global"]
    assert two_ranks["overlap-new-anchor"]  # the next message moves the anchor to the global it brings


def test_under_per_example_dp_the_term_still_applies(two_ranks):
    """Opacus replaces each gradient with the noised sum of per-example ones: a loss term would vanish there. The
    first AdamW step moves every weight by exactly lr, so a run still within lr of the global weights after 6
    steps was pulled back by the term (the exact step is checked above, against Opacus without the term)."""
    found = two_ranks
    assert found["dp-0-max"] > found["dp-lr"] and found["dp-huge-max"] < found["dp-lr"], found
    assert found["dp-0-divergence"] == found["dp-huge-divergence"] == 0.0


def test_a_task_whose_exchanged_tensors_have_no_parameters_is_refused_for_prox_mu(tiny_model):
    from nebula_fl.clients.trainer import ClusterTrainer, RequestError
    from nebula_fl.tasks.classify import ClassifyTask

    class Opaque(ClassifyTask):  # a plug-in that overrides what it exchanges but not which parameters hold it
        name = "opaque"

        def exchanged_parameters(self, model):
            return {}

    trainer = ClusterTrainer.__new__(ClusterTrainer)
    trainer.ctx = type("Ctx", (), {"cluster_id": 4})()
    trainer.task, trainer.model_core = Opaque(), build_model(ModelConfig(model=str(tiny_model)), num_labels=5, seed=0)
    with pytest.raises(RequestError, match=r"cluster 4 cannot apply prox-mu = 0.1 to task 'opaque'.*"
                                           r"Task.exchanged_parameters"):
        trainer._proximal_term(adapter_arrays(trainer.model_core), mu=0.1)


# -- a strategy's client options ----------------------------------------------------------------------------------
def _strategy_class(options):
    from nebula_fl.strategies.fedavg import AdapterFedAvg

    class WithOptions(AdapterFedAvg):
        name = "with-options"

        def client_config(self):
            return options

    return WithOptions


def test_client_config_reaches_every_clusters_round_config_through_the_wrappers(monkeypatch):
    from flwr.app import ConfigRecord

    from nebula_fl.server.app import build_strategy
    from nebula_fl.strategies import BUILTIN_STRATEGIES
    from nebula_fl.strategies.adapter_strategy import to_record
    from tests.test_strategy import FakeGrid

    monkeypatch.setitem(BUILTIN_STRATEGIES, "with-options", _strategy_class({"prox-mu": 0.1, "lr": 0.002}))
    cfg = RunConfig().replace({"outer-optimizer": "with-options"})
    initial = {"a.lora_A": np.ones((2, 3), np.float32), "head.bias": np.zeros(2, np.float32)}
    strategy = build_strategy(cfg, initial=initial)  # privacy around compression around the plug-in
    run_config = ConfigRecord({**cfg.train.to_flat(), **cfg.privacy.to_flat()})
    messages = list(strategy.configure_train(1, to_record(initial), run_config, FakeGrid([1, 2])))
    assert sorted(m.metadata.dst_node_id for m in messages) == [1, 2]
    for m in messages:
        sent = m.content.config_records["config"]
        assert sent["prox-mu"] == 0.1 and sent["lr"] == 0.002  # over the run's 0.0 and 5e-3
        assert sent["batch-size"] == cfg.train.batch_size and sent["server-round"] == 1
    assert run_config["prox-mu"] == 0.0  # the run's own config is left as it was


@pytest.mark.parametrize("options,message", [
    ({"privacy.noise-multiplier": 1e-6}, r"strategy 'with-options' client_config\(\) sets 'privacy.noise-multiplier'"
                                         r": a strategy may not change privacy settings"),
    ({"privacy.mode": "off"}, "may not change privacy settings"),
    ({"privacy-sigma": 0.0}, "may not change privacy settings"),  # what the server's privacy wrapper sets
    ({"local-steps": 1}, r"sets 'local-steps', which is not a client-side training option; use only prox-mu"),
    ({"batch-size": 1}, "not a client-side training option"),
    ({"codec-up": "none"}, "not a client-side training option"),
    ({"prox-mu": -1.0}, r"strategy 'with-options' client_config\(\): config key 'prox-mu' is -1.0"),
    ({"prox-mu": "big"}, "'prox-mu' must be float"),
    ([("prox-mu", 1.0)], "returned list, not a dict"),
])
def test_client_config_is_refused_when_it_is_not_a_client_training_option(monkeypatch, options, message):
    from nebula_fl.strategies import BUILTIN_STRATEGIES, make_strategy

    monkeypatch.setitem(BUILTIN_STRATEGIES, "with-options", _strategy_class(options))
    with pytest.raises(ConfigError, match=message) as err:
        make_strategy(OuterConfig(outer_optimizer="with-options"))
    assert "\n" not in str(err.value)


def test_every_client_option_is_a_training_key_the_trainer_reads():
    from nebula_fl.config import TrainConfig
    from nebula_fl.strategies.adapter_strategy import CLIENT_OPTIONS

    assert set(CLIENT_OPTIONS) <= set(TrainConfig.flat_keys()) and "prox-mu" in CLIENT_OPTIONS
    assert not any(k.startswith("privacy") for k in CLIENT_OPTIONS)
