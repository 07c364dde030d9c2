"""`--parallel fsdp`: FSDP2 inside a cluster, with real gloo ranks spawned here, on tiny models built here.

One spawned process group per world size runs every check (spawning is most of the cost) and rank 0 writes the
figures; the tests below assert on them:
  - gradients after one backward, sharded over 2 and 4 ranks, equal a single-process reference that averages the
    ranks' losses (pytorch#162338: FSDP2 once summed on gloo), for the LoRA classifier and the all-weights MLM;
  - a trainer round under fsdp sends the update a ddp round sends (same seed, data and steps), for the LoRA
    classifier, the MLM and the causal-lm scratch decoder trained whole (tied embeddings, instruction records);
  - a trainer restarted from its fsdp snapshot continues bit-exactly;
  - per-example DP is refused under fsdp, per request and at trainer start; a bad --parallel is refused.
"""

from __future__ import annotations

import copy
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

from nebula_fl.errors import NebulaError
from tests.gloo_ranks import spawn_ranks

LABELS = ["business", "entertainment", "politics", "sports", "tech"]
MLM = {"task.name": "mlm", "task.layers": 2, "task.hidden": 32, "task.heads": 2, "task.intermediate": 64}
# the scratch decoder trained whole (its embeddings tied to the output layer), on instruction records
CAUSAL = {"task.name": "causal-lm", "task.init": "scratch", "task.exchange": "full", "task.layers": 2,
          "task.hidden": 32, "task.heads": 2, "task.intermediate": 64, "max-seq-len": 32}
PER_RANK = 4  # rows per rank in the gradient checks


# -- the spawned ranks --------------------------------------------------------------------------------------------
def _setup(task, model_path: Path):
    import torch

    from nebula_fl.config import RunConfig
    from nebula_fl.tasks import TaskSetup

    cfg = RunConfig().replace({"model": str(model_path), "max-seq-len": 16})
    return TaskSetup(model=cfg.model, labels=LABELS, seed=0, path=model_path, device=torch.device("cpu"))


def _batches(kind: str, world: int, vocab: int):
    """`world` batches of PER_RANK rows, the same on every rank (a seeded generator)."""
    import torch

    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(world):
        ids = torch.randint(5, vocab, (PER_RANK, 16), generator=g)
        mask = torch.ones_like(ids)
        mask[:, 12:] = torch.randint(0, 2, (PER_RANK, 4), generator=g)  # some padding
        if kind == "classify":
            out.append({"input_ids": ids, "attention_mask": mask,
                        "labels": torch.randint(0, len(LABELS), (PER_RANK,), generator=g)})
        else:
            labels = torch.where(torch.rand(ids.shape, generator=g) < 0.3, ids, torch.full_like(ids, -100))
            out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _gradient_error(kind: str, model_path: Path, rank: int, world: int) -> dict:
    """Max relative error of every trainable gradient (sharded, gathered) against the averaged reference."""
    import torch

    from nebula_fl.model.sharding import is_sharded, repeated_blocks, whole, wrap
    from nebula_fl.tasks import make_task

    task = make_task(kind, {k: v for k, v in MLM.items() if k != "task.name"} if kind == "mlm" else {})
    model = task.build_model(_setup(task, model_path))
    reference = copy.deepcopy(model)
    batches = _batches(kind, world, vocab=model.config.vocab_size if kind == "mlm" else 30522)
    reference.eval()
    (sum(task.loss(reference, b) for b in batches) / world).backward()
    model = wrap(model, parallel="fsdp", device=torch.device("cpu"), world=world)
    model.eval()  # no dropout: the reference draws none either
    task.loss(model, batches[rank]).backward()
    expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    errors, frozen_with_grad = {}, 0
    for name, param in model.named_parameters():
        if not param.requires_grad:
            frozen_with_grad += param.grad is not None
            continue
        got = whole(param.grad)
        errors[name] = float((got - expected[name]).abs().max() / expected[name].abs().max().clamp(min=1e-30))
    return {"max": max(errors.values()), "trainable": len(errors), "expected": len(expected),
            "frozen-with-grad": frozen_with_grad, "blocks": len(repeated_blocks(reference)),
            "sharded": is_sharded(model)}


def _mixed_dtype_error(rank: int, world: int) -> dict:
    """A layer list whose blocks train a bf16 base and an fp32 adapter: FSDP2 takes one trainable dtype per group,
    so the adapters are wrapped apart; gradients still equal the averaged reference (bf16 ones to bf16 rounding)."""
    import torch
    from torch import nn

    from nebula_fl.model.sharding import whole, wrap

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Linear(16, 16).to(torch.bfloat16)
            self.adapter = nn.Linear(16, 16, bias=False)

        def forward(self, x):
            return self.base(x.to(torch.bfloat16)).float() + self.adapter(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(16, 2)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    inputs = torch.randn(world, PER_RANK, 16, generator=torch.Generator().manual_seed(1))
    (sum(reference(x).square().mean() for x in inputs) / world).backward()
    model = wrap(model, parallel="fsdp", device=torch.device("cpu"), world=world)
    model(inputs[rank]).square().mean().backward()
    expected = dict(reference.named_parameters())
    errors: dict[str, float] = {}
    for name, param in model.named_parameters():
        got, want = whole(param.grad).float(), expected[name].grad.float()
        kind = str(param.dtype).removeprefix("torch.")
        errors[kind] = max(errors.get(kind, 0.0), float((got - want).abs().max() / want.abs().max()))
    errors["groups"] = sum("FSDP" in type(m).__name__ for m in model.modules())
    return errors


def _trainer(parallel: str, state_dir: Path, model_path: Path, rank: int, world: int, control, *, examples: int = 40,
             targets: str = "classes"):
    """A cluster trainer on `examples` seeded texts of the topic words (tests/test_proximal.py uses it too), each
    labelled with a topic, or for `targets` 'text' an instruction record answered by the topic's name."""
    import torch

    from nebula_fl.clients.trainer import ClusterTrainer, WorkerContext
    from nebula_fl.data.datasets import TextDataset

    rng = np.random.default_rng(3)
    words = ["market", "film", "vote", "goal", "chip", "bank", "actor", "party", "match", "phone", "shares", "stage"]
    texts = [" ".join(rng.choice(words, 14)) for _ in range(examples)]
    labels = rng.integers(0, len(LABELS), examples)
    shard = TextDataset(texts, labels, list(LABELS))
    if targets == "text":
        answers = np.empty(examples, dtype=object)
        answers[:] = [LABELS[i] for i in labels]
        shard = TextDataset([f"Name the topic.\n\n{t}" for t in texts], answers, [])
    return ClusterTrainer(WorkerContext(rank=rank, world=world, cluster_id=0, device=torch.device("cpu"),
                                        model_path=model_path, shard=shard, state_dir=state_dir, control=control,
                                        parallel=parallel))


def _round_config(model_path: Path, rnd: int, **extra):
    from nebula_fl.config import RunConfig

    cfg = RunConfig().replace({"model": str(model_path), "local-steps": 3, "batch-size": 4, "max-seq-len": 16,
                               "lr": 0.01})
    return {**cfg.train.to_flat(), **cfg.model.to_flat(), "labels": LABELS, "federation-id": "fed1", "seed": 0,
            "server-round": rnd, **extra}


def _initial(config: dict, model_path: Path) -> dict:
    from nebula_fl.tasks import make_task

    task = make_task(str(config.get("task.name", "classify")),
                     {k: v for k, v in config.items() if k.startswith("task.") and k != "task.name"})
    return task.exchanged(task.build_model(_setup(task, model_path)))


def _trainer_checks(model_path: Path, out: Path, rank: int, world: int) -> dict:
    import torch.distributed as dist

    from nebula_fl.clients.trainer import RequestError
    from nebula_fl.privacy.policy import Admission

    control = dist.new_group(backend="gloo")
    off = Admission(allowed=True)
    found: dict = {}
    for name, extra in (("classify", {}), ("mlm", MLM), ("causal-lm", CAUSAL)):
        config = _round_config(model_path, 1, **extra)
        start = _initial(config, model_path)
        updates = {}
        for parallel in ("ddp", "fsdp"):
            trainer = _trainer(parallel, out / f"{name}-{parallel}", model_path, rank, world, control,
                               targets="text" if name == "causal-lm" else "classes")
            updates[parallel], metrics = trainer.train_round(config, start, off)
            found[f"{name}-{parallel}-parallel"] = metrics["parallel"]
        found[f"{name}-update-scale"] = max(float(np.abs(v).max()) for v in updates["ddp"].values())
        gaps = np.concatenate([np.abs(updates["ddp"][k] - updates["fsdp"][k]).ravel() for k in updates["ddp"]])
        # the gap in units of float32 spacing at the weight's value (after = start + update)
        ulps = gaps / np.concatenate([np.spacing(np.abs(start[k] + updates["ddp"][k]).astype(np.float32)).ravel()
                                      for k in updates["ddp"]])
        found[f"{name}-ddp-vs-fsdp"] = float(gaps.max())
        found[f"{name}-ddp-vs-fsdp-ulps"] = [float(np.quantile(ulps, q)) for q in (0.5, 0.99, 0.999, 1.0)]
        found[f"{name}-same-keys"] = sorted(updates["ddp"]) == sorted(updates["fsdp"])
    # fsdp snapshots: round 2 trained straight on, and again by a trainer restarted from round 1's snapshot
    config = _round_config(model_path, 1, **MLM)
    start = _initial(config, model_path)
    straight = _trainer("fsdp", out / "resume", model_path, rank, world, control)
    straight.train_round(config, start, off)
    straight.commit()  # kept: snapshotted (rank 0 would charge it first)
    second, _ = straight.train_round({**config, "server-round": 2}, start, off)
    restarted = _trainer("fsdp", out / "resume", model_path, rank, world, control)
    again, _ = restarted.train_round({**config, "server-round": 2}, start, off)
    found["resume-max-diff"] = max(float(np.abs(second[k] - again[k]).max()) for k in second)
    found["resume-moved"] = max(float(np.abs(second[k]).max()) for k in second)
    try:  # the same snapshots, read by a ddp trainer: refused, never misread as whole tensors
        _trainer("ddp", out / "resume", model_path, rank, world, control).train_round(
            {**config, "server-round": 2}, start, off)
        found["resume-as-ddp"] = None
    except RequestError as err:
        found["resume-as-ddp"] = str(err)
    # per-example DP under fsdp: refused, on every rank together
    sample = Admission(allowed=True, mode="sample", noise_multiplier=1.0, sample_rate=0.25, steps=3, max_grad_norm=1.0)
    try:
        _trainer("fsdp", out / "dp", model_path, rank, world, control).train_round(
            _round_config(model_path, 1), _initial(_round_config(model_path, 1), model_path), sample)
        found["dp-refusal"] = None
    except RequestError as err:
        found["dp-refusal"] = str(err)
    return found


def _checks(rank: int, world: int, model_path: Path, state_dir: Path, trainer_checks: bool) -> dict:
    found = {f"{kind}-grad": _gradient_error(kind, model_path, rank, world) for kind in ("classify", "mlm")}
    if trainer_checks:
        found["mixed-dtype"] = _mixed_dtype_error(rank, world)
        found.update(_trainer_checks(model_path, state_dir, rank, world))  # shared, as in a trainer
    return found


def _spawn(world: int, tmp: Path, model_path: Path, *, trainer_checks: bool) -> dict:
    """Rank 0's findings."""
    return spawn_ranks(_checks, world=world, folder=tmp, args=(model_path, tmp / "state", trainer_checks))[0]


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory) -> Path:
    """The tiny BERT with 2 layers: two FSDP groups below the root."""
    from nebula_fl.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-bert-2") / "model", layers=2)


@pytest.fixture(scope="module")
def two_ranks(two_layers, tmp_path_factory):
    return _spawn(2, tmp_path_factory.mktemp("fsdp2"), two_layers, trainer_checks=True)


@pytest.fixture(scope="module")
def one_rank(two_layers, tmp_path_factory):
    """One fsdp worker still shards, over a mesh of one: the path a one-GPU check runs."""
    return _spawn(1, tmp_path_factory.mktemp("fsdp1"), two_layers, trainer_checks=False)


@pytest.fixture(scope="module")
def four_ranks(two_layers, tmp_path_factory):
    return _spawn(4, tmp_path_factory.mktemp("fsdp4"), two_layers, trainer_checks=False)


# -- the tests ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["classify", "mlm"])
@pytest.mark.parametrize("ranks", ["one_rank", "two_ranks", "four_ranks"])
def test_sharded_gradients_equal_the_averaged_full_batch_reference(request, ranks, kind):
    found = request.getfixturevalue(ranks)[f"{kind}-grad"]
    assert found["sharded"]
    assert found["blocks"] == 2  # the encoder's layers were found and sharded one by one
    assert found["trainable"] == found["expected"] > 0 and found["frozen-with-grad"] == 0
    # fp32, one backward: the sums differ only in order (a sum of ranks would be off by a factor of `world`)
    assert found["max"] < 1e-5, found


def test_trainable_dtypes_that_differ_are_sharded_in_groups_of_their_own(two_ranks):
    found = two_ranks["mixed-dtype"]
    assert found["groups"] == 5  # the root, 2 blocks, and each block's fp32 adapter apart from its bf16 base
    assert found["float32"] < 1e-5 and found["bfloat16"] < 2e-2, found  # bf16: 8 bits of mantissa, reduced in bf16


@pytest.mark.parametrize("task", ["classify", "mlm", "causal-lm"])
def test_a_round_under_fsdp_sends_what_ddp_sends(two_ranks, task):
    assert two_ranks[f"{task}-same-keys"]
    assert (two_ranks[f"{task}-ddp-parallel"], two_ranks[f"{task}-fsdp-parallel"]) == ("ddp", "fsdp")
    # 3 AdamW steps (lr 0.01) from the same start. DDP's all-reduce and FSDP's reduce-scatter (and the clipping norm
    # summed over shards) round differently: gradients differ by ~1e-7 of the largest one (the test above). AdamW
    # divides each gradient by its own running size, so a weight whose gradient is 1e-4 of the largest sees that as
    # a 1e-3 relative change of its step: the worst gap is a small fraction of one step (measured 4.6e-5 * lr on
    # the MLM, 0 on the LoRA classifier, whose gradients agree exactly), the typical one a few float32 ulps.
    assert two_ranks[f"{task}-update-scale"] > 1e-3
    assert two_ranks[f"{task}-ddp-vs-fsdp"] < 1e-3 * 0.01, two_ranks
    assert two_ranks[f"{task}-ddp-vs-fsdp-ulps"][0] <= 32, two_ranks  # the median weight


def test_a_restarted_fsdp_trainer_continues_bit_exactly_from_its_snapshot(two_ranks):
    assert two_ranks["resume-moved"] > 0
    assert two_ranks["resume-max-diff"] == 0.0
    assert "saved its state with --parallel fsdp but runs --parallel ddp" in two_ranks["resume-as-ddp"]


def test_per_example_dp_is_refused_under_fsdp_per_request(two_ranks):
    assert two_ranks["dp-refusal"] and "--parallel ddp" in two_ranks["dp-refusal"]


def test_per_example_dp_is_refused_under_fsdp_at_trainer_start(tmp_path, tiny_model):
    from nebula_fl.clients.trainer_service import TrainerOptions, run_trainer
    from nebula_fl.data.datasets import TextDataset
    from nebula_fl.privacy.policy import PrivacyPolicy

    shard = TextDataset(["a b c"] * 4, np.zeros(4, dtype=np.int64), ["x"])
    opts = TrainerOptions(cluster_id=3, socket_path=tmp_path / "s.sock", state_dir=tmp_path / "state",
                          model_path=tiny_model, shard=shard, workers=2, parallel="fsdp",
                          policy=PrivacyPolicy(mode="sample", min_noise_multiplier=1.0))
    with pytest.raises(NebulaError, match=r"cluster 3's privacy policy is 'sample'.*--parallel ddp"):
        run_trainer(opts)
    with pytest.raises(NebulaError, match=r"--parallel has 'zero'; use ddp .* or fsdp"):
        run_trainer(TrainerOptions(**{**opts.__dict__, "parallel": "zero", "policy": PrivacyPolicy()}))
    assert not (tmp_path / "state").exists()  # refused before anything was written


def _args(tmp_path, **given) -> Namespace:
    base = dict(resume=None, rewind=False, clusters=2, preset="smoke", task=None, rounds=None, local_steps=None,
                outer_optimizer=None, partition="iid", seed=None, codec=None, secure_aggregation=None, run_config=None,
                out=str(tmp_path / "run"), workers_per_cluster="2", device=None, port=0, wan=None, secure=None)
    return Namespace(**{**base, **given})


def test_the_launcher_takes_one_parallel_mode_or_one_per_cluster_and_keeps_it_for_resume(tmp_path):
    from nebula_fl.launcher.plan import make_plan
    from nebula_fl.storage.run_folder import RunFolder

    assert make_plan(_args(tmp_path)).launcher_record()["parallel"] == ["ddp", "ddp"]
    assert make_plan(_args(tmp_path, parallel="fsdp")).parallel == ["fsdp", "fsdp"]
    plan = make_plan(_args(tmp_path, parallel="ddp,fsdp"))
    assert plan.launcher_record()["parallel"] == ["ddp", "fsdp"]
    with pytest.raises(NebulaError, match="--parallel has 'zero'; use ddp"):
        make_plan(_args(tmp_path, parallel="ddp,zero"))
    with pytest.raises(NebulaError, match="--parallel lists 3 values for 2 clusters"):
        make_plan(_args(tmp_path, parallel="ddp,fsdp,ddp"))
    with pytest.raises(NebulaError, match="drop --parallel"):
        make_plan(_args(tmp_path, resume=str(tmp_path / "run"), out=None, clusters=None, preset=None,
                        partition=None, workers_per_cluster=None, parallel="fsdp"))
    RunFolder(plan.out).write_config({"run_config": plan.config.to_flat(), "launcher": plan.launcher_record()})
    resumed = make_plan(_args(tmp_path, resume=str(plan.out), out=None, clusters=None, preset=None, partition=None,
                              workers_per_cluster=None))
    assert resumed.resume and resumed.parallel == ["ddp", "fsdp"]  # what Federation passes to each trainer


def test_the_trainer_cli_passes_parallel_on():
    from nebula_fl.cli import parser

    args = parser().parse_args(["trainer", "--socket", "s", "--dataset", "bbcnews", "--parallel", "fsdp"])
    assert args.parallel == "fsdp"
    assert parser().parse_args(["trainer", "--socket", "s", "--dataset", "bbcnews"]).parallel == "ddp"
