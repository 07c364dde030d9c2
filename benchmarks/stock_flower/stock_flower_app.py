"""The baseline nebula-fl is measured against: stock Flower FedAvg exchanging the full model.

What a Flower user writes from the tutorials: `flwr.serverapp.strategy.FedAvg` with the whole model
as the ArrayRecord, and a ClientApp that loads the model and its data shard for every message
(Flower starts a fresh ClientApp process per message) and fine-tunes every weight. The data split,
model, inner loop and evaluation are nebula-fl's own, so the comparison isolates the system design:
what crosses the WAN, how often, and what each round costs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from nebula_fl.clients.inner_loop import BatchSchedule, train_steps
from nebula_fl.config import DataConfig
from nebula_fl.data.datasets import cluster_shard, train_test_split
from nebula_fl.model.batches import TokenizedTexts
from nebula_fl.model.evaluation import evaluate
from nebula_fl.model.loading import build_classifier, load_tokenizer
from nebula_fl.model.locate import resolve_model_path

server = ServerApp()
client = ClientApp()


def _data_config(cfg) -> DataConfig:
    return DataConfig(partition=str(cfg["partition"]), max_examples=int(cfg["max-examples"]))


@server.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    started = time.time()
    torch.set_num_threads(int(cfg["threads"]))
    _, test = train_test_split(_data_config(cfg), seed=int(cfg["seed"]))
    path = resolve_model_path(str(cfg["model"]))
    model = build_classifier(path, num_labels=len(test.label_names), seed=int(cfg["seed"]))
    data = TokenizedTexts(load_tokenizer(path), test.texts, test.labels, max_len=int(cfg["max-seq-len"]))
    out = Path(str(cfg["out-dir"]))
    out.mkdir(parents=True, exist_ok=True)
    log = out / "metrics.jsonl"

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        metrics = evaluate(model, data, batch_size=64, num_classes=len(test.label_names))
        with log.open("a") as handle:
            now = time.time()
            handle.write(json.dumps({"round": server_round, **metrics, "elapsed_seconds": now - started, "time": now}) + "\n")
        return MetricRecord(metrics)

    clusters = int(cfg["num-clusters"])
    strategy = FedAvg(fraction_evaluate=0.0, min_train_nodes=clusters, min_available_nodes=clusters)
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=int(cfg["num-server-rounds"]),
        train_config=ConfigRecord({"lr": float(cfg["lr"]), "local-steps": int(cfg["local-steps"])}),
        evaluate_fn=evaluate_fn,
    )
    (out / "done.json").write_text(json.dumps({"wall_seconds": time.time() - started}))


@client.train()
def train(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    torch.set_num_threads(int(cfg["threads"]))
    cid = int(context.node_config["partition-id"])
    shard = cluster_shard(_data_config(cfg), seed=int(cfg["seed"]), cluster_id=cid,
                          num_clusters=int(context.node_config["num-partitions"]))
    path = resolve_model_path(str(cfg["model"]))
    model = build_classifier(path, num_labels=len(shard.label_names), seed=int(cfg["seed"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    data = TokenizedTexts(load_tokenizer(path), shard.texts, shard.labels, max_len=int(cfg["max-seq-len"]))
    rnd = int(msg.content["config"]["server-round"])
    schedule = BatchSchedule(len(data), batch_size=int(cfg["batch-size"]), seed=int(cfg["seed"]), rank=0)
    schedule.step = (rnd - 1) * int(cfg["local-steps"])  # continue the batch stream across rounds
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(msg.content["config"]["lr"]))
    losses = train_steps(model, optimizer, data, schedule, steps=int(msg.content["config"]["local-steps"]),
                         max_grad_norm=1.0, device=torch.device("cpu"))
    content = RecordDict({
        "arrays": ArrayRecord(model.state_dict()),
        "metrics": MetricRecord({"num-examples": len(shard), "train-loss": float(sum(losses) / len(losses))}),
    })
    return Message(content=content, reply_to=msg)
