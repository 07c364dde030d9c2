"""Per-example DP-SGD (Opacus) for the causal-lm task, checked against plain autograd on a 1-layer scratch decoder.

A DP step without noise or clipping is a plain step; with a small clipping bound it is the mean of per-example
gradients each clipped on its own (one backward pass per record here, no Opacus); an empty Poisson batch is a pure
noise step; and the trainer runs causal-lm under `privacy.mode = "sample"` from the round config it is sent.
"""

import math

import numpy as np
import pytest
import torch

from nebula_fl.config import ModelConfig, RunConfig
from nebula_fl.errors import NebulaError
from nebula_fl.privacy.sample_dp import Batches, make_private, train_private_steps
from nebula_fl.tasks.base import TaskSetup
from nebula_fl.tasks.causal_lm import CausalLMTask
from tests.conftest import dp_steps_one_at_a_time

SIZES = {"task.init": "scratch", "task.layers": 1, "task.hidden": 32, "task.heads": 2, "task.intermediate": 64}
PROMPTS = ["what is the topic of: shares fell on the stock market", "the match ended in a draw after extra time",
           "what is the topic of: the minister resigned today", "a new phone was launched with a larger screen",
           "what is the topic of: the film won an award", "profits rose sharply this year",
           "what is the topic of: the striker scored twice", "the election is next week"]
ANSWERS = np.array(["business", "", "politics", "", "entertainment", "business results", "sport", ""], dtype=object)


def parts(tiny_model, exchange="adapter"):
    task = CausalLMTask(options={**SIZES, "task.exchange": exchange})
    setup = TaskSetup(model=ModelConfig(model=str(tiny_model), max_seq_len=32, lora_target_modules="q_proj,v_proj"),
                      labels=[], seed=0, path=tiny_model, privacy_mode="sample")
    model = task.build_model(setup)
    model.train()
    records = task.examples(setup=setup, tokenizer=task.tokenizer(setup), texts=PROMPTS, labels=ANSWERS, train=True)
    return task, model, records


def trainable(model) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}


def dp_step(task, model, records, *, optimizer, clip, noise=0.0, physical=None):
    training = make_private(model=model, optimizer=optimizer, data=task.private_examples(records),
                            batch_size=len(records), noise_multiplier=noise, max_grad_norm=clip, distributed=False,
                            poisson_sampling=False, physical_batch_size=physical)
    losses = train_private_steps(training, Batches(training.loader), steps=1, device=torch.device("cpu"))
    assert len(losses) == 1 and np.isfinite(losses[0])
    return losses[0]


@pytest.mark.parametrize("physical", [None, 3])
def test_without_noise_or_clipping_a_dp_step_is_a_plain_adamw_step(tiny_model, physical):
    """Also in length-sorted chunks of 3 records, accumulated into one step (and the LoRA update is not corrupted
    under Opacus + PEFT: opacus#820)."""
    task, model, records = parts(tiny_model)
    before = trainable(model)
    plain_model = parts(tiny_model)[1]
    params = [p for p in plain_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    loss = task.record_loss(plain_model, records.batch(np.arange(len(records))))
    loss.backward()
    optimizer.step()
    plain = trainable(plain_model)

    dp_loss = dp_step(task, model, records, clip=1e9, physical=physical,
                      optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    dp = trainable(model)
    assert set(dp) == set(plain) and all(".lora_B." in k for k in dp)  # frozen-a under sample DP: B alone trains
    assert dp_loss == pytest.approx(float(loss), rel=1e-5)
    for k in plain:
        torch.testing.assert_close(dp[k], plain[k], rtol=1e-4, atol=1e-6, msg=k)
        assert not torch.equal(dp[k], before[k]) and torch.isfinite(dp[k]).all()


@pytest.mark.parametrize("exchange", ["adapter", "full"])
def test_a_clipped_step_is_the_mean_of_each_records_gradient_clipped_on_its_own(tiny_model, exchange):
    """SGD with lr 1: the update is minus the mean of g_i min(1, C / |g_i|), each g_i from its own backward pass.
    'full' trains the embeddings (tied to the output layer) and the RMSNorms too: Opacus 1.6 gets them right."""
    task, model, records = parts(tiny_model, exchange)
    clip = 1e-3
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    clipped = {k: torch.zeros_like(p) for k, p in params.items()}
    norms = []
    for i in range(len(records)):
        model.zero_grad()
        task.record_loss(model, records.batch([i])).backward()
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params.values()))
        norms.append(norm)
        for k, p in params.items():
            clipped[k] += p.grad * min(1.0, clip / (norm + 1e-6))
    model.zero_grad()
    assert min(norms) > 10 * clip  # every record is clipped
    expected = {k: p.detach() - clipped[k] / len(records) for k, p in params.items()}

    dp_step(task, model, records, clip=clip, physical=3, optimizer=torch.optim.SGD(list(params.values()), lr=1.0))
    for k, p in params.items():
        torch.testing.assert_close(p.detach(), expected[k], rtol=1e-4, atol=1e-8, msg=k)


def test_noisy_poisson_steps_move_the_adapter_and_an_empty_batch_is_a_pure_noise_step(tiny_model):
    """Expected batch 1 of 8 records: some Poisson batches are empty. Such a step still adds N(0, (sigma C)^2) to
    every weight (scaled by lr / expected batch), reports a NaN loss, and training carries on, finite."""
    task, model, records = parts(tiny_model)
    lr, sigma, clip = 0.1, 1.0, 1.0
    params = [p for p in model.parameters() if p.requires_grad]
    training = make_private(model=model, optimizer=torch.optim.SGD(params, lr=lr), data=task.private_examples(records),
                            batch_size=1, noise_multiplier=sigma, max_grad_norm=clip, distributed=False,
                            physical_batch_size=1)
    start = trainable(model)
    losses, empty_moves = dp_steps_one_at_a_time(training, params)
    assert empty_moves and any(np.isfinite(losses))
    move = torch.cat(empty_moves)
    assert float(move.std()) == pytest.approx(lr * sigma * clip, rel=0.2)  # expected batch 1: no division
    assert abs(float(move.mean())) < 0.2 * lr * sigma * clip
    assert all(not torch.equal(p, start[k]) for k, p in trainable(model).items())


def test_what_opacus_cannot_train_is_refused_in_one_line(tiny_model):
    task, _, records = parts(tiny_model)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    with pytest.raises(NebulaError, match=r"^per-example DP \(privacy.mode = 'sample'\) cannot train this model: "
                                          r"Opacus computes no per-example gradients for BatchNorm[^\n]*$"):
        make_private(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     data=task.private_examples(records), batch_size=2, noise_multiplier=1.0, max_grad_norm=1.0,
                     distributed=False)


def test_the_config_admits_causal_lm_under_sample_dp(tiny_model):
    from nebula_fl.components import load
    from nebula_fl.errors import ConfigError

    flat = {**RunConfig().to_flat(), "privacy.mode": "sample", "privacy.noise-multiplier": 1.0}
    assert load({**flat, "task.name": "causal-lm", **SIZES}).privacy.mode == "sample"
    with pytest.raises(ConfigError, match=r"privacy\.mode' is 'sample' with task 'mlm'"):
        load({**flat, "task.name": "mlm"})


# -- the trainer: one gloo rank in this process --------------------------------------------------------------
@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()


def trainer(tmp_path, tiny_model, control, parallel="ddp"):
    from nebula_fl.clients.trainer import ClusterTrainer, WorkerContext
    from nebula_fl.data.datasets import TextDataset

    shard = TextDataset(PROMPTS * 4, np.concatenate([ANSWERS] * 4), [])
    return ClusterTrainer(WorkerContext(rank=0, world=1, cluster_id=0, device=torch.device("cpu"), model_path=tiny_model,
                                        shard=shard, state_dir=tmp_path / parallel, control=control, parallel=parallel))


def test_the_trainer_runs_causal_lm_under_sample_dp_and_refuses_fsdp(tmp_path, tiny_model, one_rank):
    from nebula_fl.clients.trainer import RequestError
    from nebula_fl.privacy.policy import Admission

    task, model, _ = parts(tiny_model)
    cfg = RunConfig().replace({"model": str(tiny_model), "local-steps": 3, "batch-size": 4, "max-seq-len": 32,
                               "lr": 1e-2, "lora-target-modules": "q_proj,v_proj"})
    config = {**cfg.train.to_flat(), **cfg.model.to_flat(), "labels": [], "federation-id": "fed1", "seed": 0,
              "server-round": 1, "num-server-rounds": 2, "task.name": "causal-lm", **SIZES,
              "privacy.mode": "sample", "privacy.batch-size": 8, "privacy.noise-multiplier": 0.5,
              "frozen-fingerprint": task.fingerprint(model)}
    start = task.exchanged(model)
    # 32 records in logical batches of 8: q = 1/4
    admission = Admission(allowed=True, mode="sample", noise_multiplier=0.5, sample_rate=0.25, steps=3,
                          max_grad_norm=1.0)
    update, metrics = trainer(tmp_path, tiny_model, one_rank).train_round(config, start, admission)
    assert metrics["steps"] == 3 and set(update) == set(start) and all(".lora_B." in k for k in update)
    assert all(np.isfinite(v).all() for v in update.values())
    assert sum(float(np.abs(v).sum()) for v in update.values()) > 0
    with pytest.raises(RequestError, match=r"^cluster 0: per-example DP .* runs with --parallel ddp only"):
        trainer(tmp_path, tiny_model, one_rank, parallel="fsdp").train_round(config, start, admission)


def test_the_trainer_refuses_a_task_whose_rows_are_not_its_records_under_sample_dp(tmp_path, tiny_model, one_rank,
                                                                                    monkeypatch):
    """Opacus samples rows and the accounting counts records: a task that makes fewer rows than records (packing,
    dropping) is refused in the cluster's reply, naming it and the counts, before any step."""
    from nebula_fl.clients.trainer import RequestError
    from nebula_fl.privacy.policy import Admission
    from nebula_fl.tasks.causal_lm import CausalLMTask

    task, model, _ = parts(tiny_model)
    cfg = RunConfig().replace({"model": str(tiny_model), "local-steps": 1, "batch-size": 4, "max-seq-len": 32,
                               "lora-target-modules": "q_proj,v_proj"})
    config = {**cfg.train.to_flat(), **cfg.model.to_flat(), "labels": [], "federation-id": "fed1", "seed": 0,
              "server-round": 1, "num-server-rounds": 1, "task.name": "causal-lm", **SIZES,
              "privacy.mode": "sample", "privacy.batch-size": 8, "privacy.noise-multiplier": 0.5,
              "frozen-fingerprint": task.fingerprint(model)}
    admission = Admission(allowed=True, mode="sample", noise_multiplier=0.5, sample_rate=0.25, steps=1,
                          max_grad_norm=1.0)
    examples = CausalLMTask.examples

    def one_short(self, *, texts, labels, **kwargs):  # a task that leaves one record out of its rows
        return examples(self, texts=texts[:-1], labels=labels[:-1], **kwargs)

    monkeypatch.setattr(CausalLMTask, "examples", one_short)
    with pytest.raises(RequestError, match=r"^task 'causal-lm' made 31 rows of this cluster's 32 records under "
                                           r"per-example DP; its examples\(\) must return one row per record"):
        trainer(tmp_path, tiny_model, one_rank).train_round(config, task.exchanged(model), admission)
