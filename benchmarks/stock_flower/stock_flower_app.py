"""The baselines nebula-fl is measured against: stock Flower FedAvg on the full model, or on a PEFT LoRA adapter.

What a Flower user writes from the tutorials: `flwr.serverapp.strategy.FedAvg` with the model state as
the ArrayRecord, and a ClientApp that builds the model and loads its data shard for every message
(Flower starts a fresh ClientApp process per message), trains, and returns the state as an ArrayRecord.

- `mode = "full"`: the whole classifier (90.9 MB float32) goes each way; every weight trains with AdamW
  at `full-lr` (2e-4, the best full fine-tuning rate here), constant.
- `mode = "lora"`: PEFT's adapter state (`get_peft_model_state_dict`: LoRA factors and head, 26 arrays)
  goes each way through the same stock ArrayRecord path; the LoRA config (`lora-*`), AdamW rate,
  cosine schedule over the run's inner steps, batch size and gradient clipping are nebula-fl's keys
  with nebula-fl's defaults (`nebula_fl.config.ModelConfig` / `TrainConfig`), so FedAvg here is the
  very algorithm nebula-fl runs with `--outer-optimizer fedavg` and `--codec none`. One thing differs
  by construction: a stock ClientApp is stateless, so AdamW's moments start afresh every round
  (nebula-fl's persistent trainer keeps them).
- `task = "causal-lm"` (with `mode = "lora"`): the same, for nebula-fl's causal-lm task (benchmarks/causal.py):
  the decoder, its PEFT adapter, the instruction records, the loss and the evaluation are the task's own
  (`nebula_fl.tasks`, default `task.*` options), so the adapter that crosses the WAN is exactly the one
  nebula-fl exchanges.

Data split, model, inner loop (`train_steps`, `BatchSchedule` continued across rounds) and server-side
evaluation (every round, round 0 included, torch's default threads) are nebula-fl's own, so the
comparison isolates the system design: what crosses the WAN, how often, what each round costs.

The single change to stock Flower's behaviour: the ServerApp's Grid is wrapped (`FastPollGrid`) so
that `send_and_receive` pushes, then pulls every 0.2 s as nebula-fl's loop does; Flower 1.42's HTTP
grid sleeps a fixed 3 s between pulls. (Both sides also run in the same process environment,
nebula-fl's `child_env`, which sets Flower's own SuperExec poll knob to 0.1 s.)

Measurement only, no behaviour: with `wan-control` (the WAN proxies' control sockets, one per cluster
in partition order) the ServerApp reads the proxies' counters after each evaluation with nebula-fl's
own `WanCounters` (through benchmarks/harness.py, which StockFederation puts on the app's PYTHONPATH), so
both sides count alike, and every evaluation appends one line to
`out-dir/metrics.jsonl` (`elapsed_seconds` from the ServerApp's start, `seconds` since the previous
line, per-cluster `wan_*` fields, `cumulative_wan_bytes`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from nebula_fl.config import DataConfig, ModelConfig, TrainConfig
from nebula_fl.data.datasets import cluster_shard, train_test_split
from nebula_fl.model.adapter import adapter_arrays, load_adapter_arrays
from nebula_fl.model.batches import TokenizedTexts
from nebula_fl.model.evaluation import evaluate
from nebula_fl.model.loading import build_classifier, build_model, load_tokenizer
from nebula_fl.model.locate import resolve_model_path
from nebula_fl.tasks import Task, TaskSetup, make_task
from nebula_fl.training import BatchSchedule, train_steps, warmed_lr

POLL_S = 0.2  # nebula-fl's loop polls for replies every 0.2 s (strategies/base.py); Flower's grid every 3 s
MODES = ("full", "lora")
TASKS = ("classify", "causal-lm")

server = ServerApp()
client = ClientApp()


class FastPollGrid(Grid):
    """Flower's Grid, unchanged except that `send_and_receive` pulls every `poll_s` instead of every 3 s."""

    def __init__(self, grid: Grid, *, poll_s: float = POLL_S) -> None:
        if not poll_s > 0:
            raise ValueError(f"poll_s is {poll_s!r}; pass seconds > 0")
        self.inner, self.poll_s = grid, poll_s

    def set_run(self, run) -> None:
        self.inner.set_run(run)

    @property
    def run(self):
        return self.inner.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self.inner.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def get_nodes(self):
        return self.inner.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.inner.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Flower 1.42's `HttpGrid.send_and_receive`, line for line, with `poll_s` for its `time.sleep(3)`."""
        pending = set(self.inner.push_messages(messages))
        end = time.time() + (timeout if timeout is not None else 0.0)
        replies: list[Message] = []
        while timeout is None or time.time() < end:
            got = list(self.inner.pull_messages(pending))
            replies.extend(got)
            pending.difference_update(m.metadata.reply_to_message_id for m in got)
            if not pending:
                break
            time.sleep(self.poll_s)
        return replies


def _mode(cfg) -> str:
    mode = str(cfg["mode"])
    if mode not in MODES:
        raise ValueError(f"run config key 'mode' is {mode!r}; use one of {', '.join(MODES)}")
    return mode


def _lm(cfg) -> tuple[Task, TaskSetup] | None:
    """The causal-lm task and its setup (default `task.*` options), or None for classification."""
    name = str(cfg["task"])
    if name not in TASKS:
        raise ValueError(f"run config key 'task' is {name!r}; use one of {', '.join(TASKS)}")
    if name == "classify":
        return None
    if _mode(cfg) != "lora":
        raise ValueError(f"task {name!r} runs with mode 'lora' only; set mode=\"lora\"")
    setup = TaskSetup(model=ModelConfig.from_flat(cfg), labels=[], seed=int(cfg["seed"]),
                      path=resolve_model_path(str(cfg["model"])))
    return make_task(name), setup


def _build(cfg, *, num_labels: int) -> torch.nn.Module:
    """The model of this mode, seeded alike on server and clients (LoRA: nebula-fl's `build_model`)."""
    seed = int(cfg["seed"])
    path = resolve_model_path(str(cfg["model"]))
    if _mode(cfg) == "lora":
        return build_model(ModelConfig.from_flat(cfg), num_labels=num_labels, seed=seed, path=path)
    return build_classifier(path, num_labels=num_labels, seed=seed)


def _to_record(model: torch.nn.Module, mode: str) -> ArrayRecord:
    if mode == "lora":
        return ArrayRecord({k: torch.from_numpy(v) for k, v in adapter_arrays(model).items()})
    return ArrayRecord(model.state_dict())


def _load_record(model: torch.nn.Module, record: ArrayRecord, mode: str) -> None:
    if mode == "lora":
        load_adapter_arrays(model, {k: a.numpy() for k, a in record.items()})
    else:
        model.load_state_dict(record.to_torch_state_dict())


@server.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    started = time.time()
    mode = _mode(cfg)
    lm = _lm(cfg)
    _, test = train_test_split(DataConfig.from_flat(cfg), seed=int(cfg["seed"]), targets="text" if lm else "classes")
    if lm:
        task, setup = lm
        model = task.build_model(setup)
        data = task.examples(setup=setup, tokenizer=task.tokenizer(setup), texts=test.texts, labels=test.labels,
                             train=False)
    else:
        model = _build(cfg, num_labels=len(test.label_names))
        path = resolve_model_path(str(cfg["model"]))
        data = TokenizedTexts(load_tokenizer(path), test.texts, test.labels, max_len=int(cfg["max-seq-len"]))
    out = Path(str(cfg["out-dir"]))
    out.mkdir(parents=True, exist_ok=True)
    log = out / "metrics.jsonl"
    from harness import WanCounters  # benchmarks/harness.py: StockFederation puts it on PYTHONPATH

    counters = WanCounters.from_config(str(cfg["wan-control"]))
    last = {"time": started, "cumulative_wan_bytes": 0}

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        _load_record(model, arrays, mode)
        if lm:
            metrics = lm[0].evaluate(model, data, batch_size=int(cfg["eval-batch-size"]))
        else:
            metrics = evaluate(model, data, batch_size=int(cfg["eval-batch-size"]), num_classes=len(test.label_names))
        now = time.time()
        line: dict[str, Any] = {"round": server_round, **metrics, "elapsed_seconds": now - started,
                                "seconds": now - last["time"], "time": now}
        if counters is not None:
            clusters = counters.read_round()
            wan = sum(c["wan_bytes_up"] + c["wan_bytes_down"] for c in clusters.values())
            line.update(clusters=clusters, cumulative_wan_bytes=last["cumulative_wan_bytes"] + wan)
            last["cumulative_wan_bytes"] = line["cumulative_wan_bytes"]
        last["time"] = now
        with log.open("a") as handle:
            handle.write(json.dumps(line) + "\n")
        return MetricRecord(metrics)

    clusters = int(cfg["num-clusters"])
    strategy = FedAvg(fraction_evaluate=0.0, min_train_nodes=clusters, min_available_nodes=clusters)
    strategy.start(
        grid=FastPollGrid(grid),
        initial_arrays=_to_record(model, mode),
        num_rounds=int(cfg["num-server-rounds"]),
        evaluate_fn=evaluate_fn,
    )
    (out / "done.json").write_text(json.dumps({"wall_seconds": time.time() - started}))


@client.train()
def train(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    mode = _mode(cfg)
    torch.set_num_threads(int(cfg["threads"]))
    seed, cid = int(cfg["seed"]), int(context.node_config["partition-id"])
    lm = _lm(cfg)
    shard = cluster_shard(DataConfig.from_flat(cfg), seed=seed, cluster_id=cid,
                          num_clusters=int(context.node_config["num-partitions"]), targets="text" if lm else "classes")
    loss_fn: dict[str, Any] = {}
    if lm:
        task, setup = lm
        model = task.build_model(setup)
        data = task.examples(setup=setup, tokenizer=task.tokenizer(setup), texts=shard.texts, labels=shard.labels,
                             train=True)
        loss_fn["loss_fn"] = task.loss
    else:
        model = _build(cfg, num_labels=len(shard.label_names))
        path = resolve_model_path(str(cfg["model"]))
        data = TokenizedTexts(load_tokenizer(path), shard.texts, shard.labels, max_len=int(cfg["max-seq-len"]))
    _load_record(model, msg.content["arrays"], mode)
    rnd = int(msg.content["config"]["server-round"])
    train_cfg = TrainConfig.from_flat(cfg)
    steps = train_cfg.local_steps
    schedule = BatchSchedule(len(data), batch_size=train_cfg.batch_size, seed=seed, rank=0)
    schedule.step = (rnd - 1) * steps  # continue the batch stream across rounds, as nebula-fl's trainer does
    # dropout: round 1 draws exactly what nebula-fl's rank 0 draws (its RNG then runs on across rounds)
    torch.manual_seed(seed * 1_000_003 + cid * 1_009 + (rnd - 1))
    params = [p for p in model.parameters() if p.requires_grad]
    if mode == "lora":
        optimizer = torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
        total, before = max(1, int(cfg["num-server-rounds"]) * steps), (rnd - 1) * steps

        def lr_at(i: int) -> float:
            return warmed_lr(train_cfg.lr, step=before + i, total=total, warmup=train_cfg.lr_warmup_ratio,
                             schedule=train_cfg.lr_schedule, min_ratio=train_cfg.lr_min_ratio)
    else:
        optimizer = torch.optim.AdamW(params, lr=float(cfg["full-lr"]))
        lr_at = None
    losses = train_steps(model, optimizer, data, schedule, steps=steps, max_grad_norm=train_cfg.max_grad_norm,
                         device=torch.device("cpu"), lr_at=lr_at, **loss_fn)
    content = RecordDict({
        "arrays": _to_record(model, mode),
        "metrics": MetricRecord({"num-examples": len(shard), "train-loss": float(sum(losses) / len(losses))}),
    })
    return Message(content=content, reply_to=msg)
