"""The ClientApp: a thin relay from the SuperNode to the cluster's persistent trainer.

The cluster's runner (clients/runner.py) serves every message with it, so this module imports no torch and
loads no model: it hands the global adapter and the round's config to the trainer named by the
node config key ``trainer`` (its socket path) and returns the trainer's update and metrics. A
``query`` message asks the trainer who it is (the server maps node ids to clusters with it: node ids
change when a SuperNode restarts, clusters do not); a ``query.secagg`` message carries one stage of
secure aggregation (key setup, unmasking) to the trainer, which alone holds the cluster's keys. With
round-overlap a train message may carry a `secagg` record too (the last round's unmask request): it goes to
the trainer with the round, and the trainer's answer comes back as a `secagg` record beside `update`.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from nebula_fl import compat
from nebula_fl.clients.protocol import request
from nebula_fl.errors import NebulaError

app = ClientApp()


# Set by the runner (clients/runner.py) on the thread that serves a task: when it took the task from the SuperNode,
# so the server can tell the wait for a runner from the ClientApp's own start (pulling the message).
current_task = threading.local()


TRAINER_WAIT_S = 15.0  # a trainer restarting (its launcher restarts it at once) is waited for this long


def _socket(context: Context) -> str:
    socket_path = context.node_config.get("trainer")
    if not isinstance(socket_path, str) or not socket_path:
        raise NebulaError(
            "this SuperNode has no trainer: start it with --node-config 'trainer=\"/path/to/trainer.sock\"'"
        )
    return socket_path


def _records(metrics: dict) -> dict:
    """Numbers as a MetricRecord, strings (e.g. why a round was refused) as a ConfigRecord of notes; and which
    nebula-fl answers (the server refuses another protocol: nebula_fl/compat.py)."""
    numbers = {k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    notes = {k: v for k, v in metrics.items() if isinstance(v, str)}
    records: dict = {"metrics": MetricRecord(numbers), compat.RECORD: ConfigRecord(compat.stamp())}
    if notes:
        records["notes"] = ConfigRecord(notes)
    return records


@app.train()
def train(msg: Message, context: Context) -> Message:
    socket_path = _socket(context)
    received_at = time.time()  # wall clock: the server times the pickup of its message with it
    started = time.monotonic()
    records = msg.content.array_records
    # "down": one blob (the full adapter or its change, compressed); "arrays": the plain adapter
    record = records["down"] if "down" in records else records["arrays"]
    arrays = {key: array.numpy() for key, array in record.items()}
    config = dict(msg.content.config_records["config"])
    asked = {"op": "train", "config": config}
    if "secagg" in msg.content.config_records:  # round-overlap: the last round's unmask request rides here
        asked["secagg"] = dict(msg.content.config_records["secagg"])
    reply, update = request(socket_path, asked, arrays, wait_s=TRAINER_WAIT_S)
    metrics = dict(reply["metrics"])
    if "secagg-epoch" not in config:  # under secure aggregation a cluster reports no timing of its own (see
        # trainer_service.IN_THE_CLEAR): how long it trained can tell how much data it holds
        metrics["client-seconds"] = time.monotonic() - started
        metrics["received-at"] = received_at
        if (taken := getattr(current_task, "started_at", None)) is not None:
            metrics["task-started-at"] = taken
        metrics["reply-sent-at"] = time.time()  # wall clock, so the server can time the upload of this reply
    content = RecordDict({
        "update": ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in update.items()}),
        **_records(metrics),
    })
    if isinstance(reply.get("secagg"), dict):  # ... and its answer rides back beside the update
        content["secagg"] = ConfigRecord(reply["secagg"])
    return Message(content, reply_to=msg)


@app.query()
def identify(msg: Message, context: Context) -> Message:
    """Who this node's cluster is (answered by the trainer at once, even mid-round). Not its size: that is the
    weight secure aggregation keeps from the server."""
    reply, _ = request(_socket(context), {"op": "hello"}, wait_s=TRAINER_WAIT_S)
    metrics = {"cluster-id": int(reply["cluster_id"]), "workers": int(reply["workers"]),
               "privacy-mode": str(reply.get("privacy_mode", "off"))}
    return Message(RecordDict(_records(metrics)), reply_to=msg)


@app.query("secagg")
def secure_aggregation(msg: Message, context: Context) -> Message:
    """One secure-aggregation stage: the request and the trainer's answer are small config records."""
    asked = dict(msg.content.config_records["secagg"])
    reply, _ = request(_socket(context), {"op": "secagg", "request": asked}, wait_s=TRAINER_WAIT_S)
    return Message(RecordDict({"secagg": ConfigRecord(reply["reply"]), compat.RECORD: ConfigRecord(compat.stamp())}),
                   reply_to=msg)
