"""Byte accounting equals what Flower's own object-push path actually sends."""

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import push_objects

from nebula_fl.comm.accounting import payload_bytes


def _message(arrays):
    content = RecordDict({
        "arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
        "config": ConfigRecord({"server-round": 3, "labels": ["a", "b"]}),
        "metrics": MetricRecord({"num-examples": 12}),
    })
    return Message(content=content, dst_node_id=7, message_type=MessageType.TRAIN)


def _bytes_flower_pushes(message) -> int:
    sent = []
    objects = get_all_nested_objects(message)
    push_objects(objects, push_object_fn=lambda oid, body: sent.append(len(body)))
    return sum(sent)


def test_payload_bytes_equals_the_bytes_flower_pushes():
    rng = np.random.default_rng(0)
    arrays = {f"layer.{i}.lora_A": rng.standard_normal((8, 384)).astype(np.float32) for i in range(4)}
    msg = _message(arrays)
    assert payload_bytes(msg) == _bytes_flower_pushes(msg)


def test_payload_bytes_scale_with_the_tensors_not_their_count_times_four():
    small = _message({"a": np.zeros((10,), np.float32) + 1})
    big = _message({"a": np.arange(100_000, dtype=np.float32)})
    assert payload_bytes(big) - payload_bytes(small) >= 4 * (100_000 - 10)
    # npy framing and object headers: more than the raw float bytes, but not by much
    assert payload_bytes(big) < 4 * 100_000 + 2_000


def test_identical_arrays_cross_once():
    x = np.arange(50_000, dtype=np.float32)
    one = payload_bytes(_message({"a": x}))
    two = payload_bytes(_message({"a": x, "b": x.copy()}))
    assert two - one < 1_000  # the second copy costs a key and a reference, not 200 kB
