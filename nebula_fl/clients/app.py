"""The ClientApp: a thin relay from the SuperNode to the cluster's persistent trainer.

Flower starts a fresh ``flwr-clientapp`` process for every message, so this module imports no torch
and loads no model: it hands the global adapter and the round's config to the trainer named by the
node config key ``trainer`` (its socket path) and returns the trainer's update and metrics.
"""

from __future__ import annotations

import time

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from nebula_fl.clients.protocol import request
from nebula_fl.errors import NebulaError

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    socket_path = context.node_config.get("trainer")
    if not isinstance(socket_path, str) or not socket_path:
        raise NebulaError(
            "this SuperNode has no trainer: start it with --node-config 'trainer=\"/path/to/trainer.sock\"'"
        )
    started = time.monotonic()
    records = msg.content.array_records
    # "down": one blob (the full adapter or its change, compressed); "arrays": the plain adapter
    record = records["down"] if "down" in records else records["arrays"]
    arrays = {key: array.numpy() for key, array in record.items()}
    config = dict(msg.content.config_records["config"])
    reply, update = request(socket_path, {"op": "train", "config": config}, arrays)
    numbers = {k: v for k, v in reply["metrics"].items() if isinstance(v, int | float) and not isinstance(v, bool)}
    notes = {k: v for k, v in reply["metrics"].items() if isinstance(v, str)}  # e.g. why a round was refused
    numbers["client-seconds"] = time.monotonic() - started
    numbers["reply-sent-at"] = time.time()  # wall clock, so the server can time the upload of this reply
    records = {
        "update": ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in update.items()}),
        "metrics": MetricRecord(numbers),
    }
    if notes:
        records["notes"] = ConfigRecord(notes)
    content = RecordDict(records)
    return Message(content, reply_to=msg)
