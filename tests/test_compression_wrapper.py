"""The compression wrapper around the adapter strategy, against mock replies."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Metadata, MetricRecord, RecordDict
from flwr.app.message.message import make_message

from nebula_fl.comm.adaptive import BandwidthTracker
from nebula_fl.comm.views import view_crc
from nebula_fl.compression import Compressor, Layout
from nebula_fl.config import OuterConfig
from nebula_fl.strategies import make_strategy
from nebula_fl.strategies.adapter_strategy import to_numpy
from nebula_fl.strategies.compression import CompressionWrapper

RNG = np.random.default_rng(0)
GLOBAL = {"b.lora_B": RNG.standard_normal((16, 4)).astype(np.float32),
          "a.lora_A": RNG.standard_normal((4, 16)).astype(np.float32),
          "head.bias": np.zeros(3, np.float32)}
LAYOUT = Layout.from_arrays({k: GLOBAL[k] for k in sorted(GLOBAL)})


class FakeGrid:
    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


def record(arrays):
    return ArrayRecord({k: Array(v) for k, v in arrays.items()})


def wrapper(codec="none", **kw):
    return CompressionWrapper(make_strategy(OuterConfig()), codec_up=codec, codec_down=codec, seed=1, **kw)


def reply(node, *, blob=None, cluster=0, examples=10, error=None, raw=None):
    meta = Metadata(run_id=1, message_id="", src_node_id=node, dst_node_id=0, reply_to_message_id=f"m{node}",
                    group_id="1", created_at=0.0, ttl=100.0, message_type="train")
    if error:
        return make_message(metadata=meta, error=Error(code=1, reason=error))
    payload = raw if raw is not None else np.frombuffer(blob, np.uint8).copy()
    return make_message(metadata=meta, content=RecordDict({
        "update": ArrayRecord({"blob": Array(payload)}),
        "metrics": MetricRecord({"num-examples": examples, "cluster-id": cluster, "train-loss": 1.0}),
    }))


def up_blob(update, codec="none", seed=None, strategy=None):
    return Compressor(codec, layout=LAYOUT).encode(LAYOUT.flatten(update), seed=seed if seed is not None
                                                    else strategy.round_seed)


def decoded_down(message, view=None):
    cfg = message.content.config_records["config"]
    blob = message.content.array_records["down"]["blob"].numpy().tobytes()
    flat = Compressor.decode(blob, layout=LAYOUT, seed=int(cfg["codec-seed"])) if blob else np.zeros(LAYOUT.size, np.float32)
    if cfg["sync"] == "delta":
        assert int(cfg["view-crc"]) == view_crc(LAYOUT.flatten(view))
        flat = LAYOUT.flatten(view) + flat
    assert int(cfg["view-crc-after"]) == view_crc(flat)
    return cfg, LAYOUT.unflatten(flat)


def test_first_contact_is_a_full_copy_then_only_changes_travel():
    s = wrapper("topk:0.25")
    (m,) = s.configure_train(1, record(GLOBAL), ConfigRecord({"local-steps": 2}), FakeGrid([5]))
    assert set(m.content.array_records["down"]) == {"blob"}  # one array per message
    cfg, view = decoded_down(m)
    assert cfg["sync"] == "full" and cfg["local-steps"] == 2
    for k in GLOBAL:
        np.testing.assert_array_equal(view[k], GLOBAL[k])
    delta = {k: np.full_like(v, 0.01) for k, v in GLOBAL.items()}
    arrays, _ = s.aggregate_train(1, [reply(5, blob=up_blob(delta, "topk:0.25", strategy=s), cluster=3)])
    new_global = to_numpy(arrays)
    (m2,) = s.configure_train(2, arrays, ConfigRecord({}), FakeGrid([5]))
    cfg2, view2 = decoded_down(m2, view)
    assert cfg2["sync"] == "delta" and cfg2["view-round"] == 1
    full = len(m.content.array_records["down"]["blob"].numpy())
    assert len(m2.content.array_records["down"]["blob"].numpy()) < full / 2
    # what top-k left out this round stays in (global - view) and is sent later: the view moves toward the global
    before = sum(float(np.abs(new_global[k] - view[k]).sum()) for k in GLOBAL)
    after = sum(float(np.abs(new_global[k] - view2[k]).sum()) for k in GLOBAL)
    assert after < before


def test_uplink_blobs_are_decoded_and_weighted_averaged():
    s = wrapper()
    s.configure_train(1, record(GLOBAL), ConfigRecord({}), FakeGrid([1, 2]))
    u1 = {k: np.ones_like(v) for k, v in GLOBAL.items()}
    u2 = {k: -np.ones_like(v) for k, v in GLOBAL.items()}
    arrays, metrics = s.aggregate_train(1, [reply(1, blob=up_blob(u1, strategy=s), cluster=0, examples=30),
                                            reply(2, blob=up_blob(u2, strategy=s), cluster=1, examples=10)])
    out = to_numpy(arrays)
    for k in GLOBAL:
        np.testing.assert_allclose(out[k], GLOBAL[k] + 0.5, rtol=1e-6)
    assert metrics["clusters"] == 2


@pytest.mark.parametrize("bad", [
    b"",
    b"NBC\x01garbage",
    b"\x00" * 64,
    "truncated",
    "float-array",
    "flipped-header",
])
def test_hostile_blobs_drop_only_that_cluster(bad):
    s = wrapper("topk:0.1+int8")
    s.configure_train(1, record(GLOBAL), ConfigRecord({}), FakeGrid([1, 2]))
    good = up_blob({k: np.ones_like(v) for k, v in GLOBAL.items()}, "topk:0.1+int8", strategy=s)
    if bad == "truncated":
        hostile = reply(2, blob=good[: len(good) // 2], cluster=1)
    elif bad == "float-array":
        hostile = reply(2, raw=np.ones(100, np.float32), cluster=1)
    elif bad == "flipped-header":
        hostile = reply(2, blob=good[:9] + bytes([good[9] ^ 0xFF]) + good[10:], cluster=1)
    else:
        hostile = reply(2, blob=bad, cluster=1)
    arrays, metrics = s.aggregate_train(1, [reply(1, blob=good, cluster=0), hostile])
    assert arrays is not None and metrics["clusters"] == 1
    assert "cannot be decoded" in s.rejected[2]
    expected = Compressor.decode(good, layout=LAYOUT, seed=s.round_seed)
    np.testing.assert_allclose(LAYOUT.flatten(to_numpy(arrays)), LAYOUT.flatten(GLOBAL) + expected, rtol=1e-6)


def test_a_failed_cluster_is_resynced_in_full():
    s = wrapper("topk:0.5")
    s.configure_train(1, record(GLOBAL), ConfigRecord({}), FakeGrid([1, 2]))
    u = {k: np.ones_like(v) for k, v in GLOBAL.items()}
    arrays, _ = s.aggregate_train(1, [reply(1, blob=up_blob(u, "topk:0.5", strategy=s), cluster=0),
                                      reply(2, blob=up_blob(u, "topk:0.5", strategy=s), cluster=1)])
    messages = s.configure_train(2, arrays, ConfigRecord({}), FakeGrid([1, 2]))
    assert {m.content.config_records["config"]["sync"] for m in messages} == {"delta"}
    s.destinations = {"m1": 1, "m2": 2}
    arrays, _ = s.aggregate_train(2, [reply(1, blob=up_blob(u, "topk:0.5", strategy=s), cluster=0),
                                      reply(2, error="resync needed")])
    messages = {m.metadata.dst_node_id: m for m in s.configure_train(3, arrays, ConfigRecord({}), FakeGrid([1, 2]))}
    assert messages[1].content.config_records["config"]["sync"] == "delta"
    assert messages[2].content.config_records["config"]["sync"] == "full"


def test_views_survive_a_checkpoint():
    s = wrapper("topk:0.5")
    s.configure_train(1, record(GLOBAL), ConfigRecord({}), FakeGrid([1]))
    u = {k: np.ones_like(v) for k, v in GLOBAL.items()}
    s.aggregate_train(1, [reply(1, blob=up_blob(u, "topk:0.5", strategy=s), cluster=4)])
    restored = wrapper("topk:0.5")
    restored.load_state_dict(s.state_dict())
    assert set(restored.views) == {"4"} and restored.view_rounds == {"4": 1}
    for k in GLOBAL:
        np.testing.assert_array_equal(restored.views["4"][k], s.views["4"][k])


def test_adaptive_gives_the_slow_link_the_smaller_ratio():
    tracker = BandwidthTracker(configured={"0": 50e6, "1": 0.05e6})
    s = wrapper("topk:0.1+int8", adaptive_target_s=0.03, param_range=(0.001, 0.5), bandwidth=tracker)
    s.configure_train(1, record(GLOBAL), ConfigRecord({}), FakeGrid([1, 2]))
    u = {k: np.ones_like(v) for k, v in GLOBAL.items()}
    arrays, _ = s.aggregate_train(1, [reply(1, blob=up_blob(u, "topk:0.1+int8", strategy=s), cluster=0),
                                      reply(2, blob=up_blob(u, "topk:0.1+int8", strategy=s), cluster=1)])
    messages = {m.metadata.dst_node_id: m for m in s.configure_train(2, arrays, ConfigRecord({}), FakeGrid([1, 2]))}
    fast = Compressor(messages[1].content.config_records["config"]["codec-up"], layout=LAYOUT)
    slow = Compressor(messages[2].content.config_records["config"]["codec-up"], layout=LAYOUT)
    assert slow.param < fast.param
    notes = s.round_notes()
    assert notes["1"]["fits_target"] and notes["1"]["planned_upload_bytes"] == slow.encoded_size()
    assert notes["1"]["planned_upload_s"] <= 0.03 and fast.param == 0.5


def test_adaptive_needs_a_codec_with_a_knob():
    with pytest.raises(ValueError, match="ratio, rank or bits"):
        wrapper("fp16", adaptive_target_s=1.0)


def test_first_contact_sends_the_change_since_the_shared_initial_adapter():
    initial = {k: v.copy() for k, v in GLOBAL.items()}
    s = CompressionWrapper(make_strategy(OuterConfig()), codec_up="topk:0.25", codec_down="topk:0.25", seed=1,
                           initial=initial)
    (m,) = s.configure_train(1, record(GLOBAL), ConfigRecord({}), FakeGrid([5]))
    cfg = m.content.config_records["config"]
    assert cfg["sync"] == "delta" and cfg["view-round"] == 0
    full = len(Compressor("none", layout=LAYOUT).encode(LAYOUT.flatten(GLOBAL), seed=0))
    assert len(m.content.array_records["down"]["blob"].numpy()) == 0 < full  # nothing changed yet: nothing sent
    _, view = decoded_down(m, initial)
    for k in GLOBAL:
        np.testing.assert_array_equal(view[k], GLOBAL[k])
    # a cluster that cannot rebuild the initial adapter (it says so with an error) is then sent everything
    s.directory.learn(5, "0")
    s.destinations = {"m5": 5}
    s.aggregate_train(1, [reply(5, error="resync needed: initial differs")])
    (m2,) = s.configure_train(2, record(GLOBAL), ConfigRecord({}), FakeGrid([5]))
    assert m2.content.config_records["config"]["sync"] == "full"



def test_adaptive_without_a_configured_link_probes_two_sizes_and_then_chooses():
    # No profile: the link is measured, which needs uploads of different sizes. A fresh run once sent the chain's
    # own setting before its cluster was identified and again after: one size, so it measured forever.
    big = {"a.lora_A": RNG.standard_normal((8, 512)).astype(np.float32)}  # headers do not dominate its sizes
    layout = Layout.from_arrays(big)

    def size(spec):
        return Compressor(spec, layout=layout).encoded_size()

    tracker = BandwidthTracker()
    s = wrapper("topk:0.05+int8", adaptive_target_s=0.05, param_range=(0.01, 0.25), bandwidth=tracker)
    (first,) = s.configure_train(1, record(big), ConfigRecord({}), FakeGrid([1]))  # not identified yet
    spec1 = first.content.config_records["config"]["codec-up"]
    assert Compressor(spec1, layout=layout).param == 0.25
    tracker.observe("0", bytes_up=size(spec1), seconds=1.0)  # one upload: latency and bandwidth not apart yet
    spec2 = s._uplink_spec("0", layout)
    assert s.round_notes()["0"]["adaptive"] == "measuring" and size(spec2) * 1.5 < size(spec1)
    tracker.observe("0", bytes_up=size(spec2), seconds=0.5)
    s._uplink_spec("0", layout)  # two sizes: the link is fitted and the setting chosen
    assert s.round_notes()["0"]["adaptive"] == "chosen"
    tracker.observe("1", bytes_up=size(spec2), seconds=0.5)  # only the chain's own size seen: the largest next
    assert Compressor(s._uplink_spec("1", layout), layout=layout).param == 0.25
