"""Compression codecs: error bounds, unbiasedness, error feedback, linearity, sizes, state, specs, layouts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from nebula_fl.compression import (
    ArraySpec,
    Codec,
    CodecError,
    Compressor,
    Encoded,
    Layout,
    Plan,
    available_codecs,
    parse_spec,
    register_codec,
)
from nebula_fl.compression import indices as index_coding
from nebula_fl.compression.codec import kept
from nebula_fl.compression.registry import unregister_codec

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALL_SPECS = ["none", "fp16", "bf16", "int8", "int4", "int8:64", "topk:0.05", "topk:0.3", "topk:0.05+int8",
             "topk:0.1+fp16", "randk:0.1", "randk:0.05+int4", "lowrank:2", "lowrank:4+int8", "lowrank:2+bf16"]
EF_SPECS = ["topk:0.1", "randk:0.1", "lowrank:2", "topk:0.05+int8", "randk:0.2+fp16", "lowrank:2+int4",
            "topk:0.2+bf16"]


def demo_layout() -> Layout:
    """The demo adapter's shapes, scaled down: LoRA A/B pairs, a head and its bias."""
    return Layout.from_shapes({"l0.q.lora_A": (8, 96), "l0.q.lora_B": (96, 8), "l0.v.lora_A": (8, 96),
                               "l0.v.lora_B": (96, 8), "head.weight": (5, 96), "head.bias": (5,)})


def sample(layout: Layout, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(layout.size) * scale).astype(np.float32)


def layouts() -> st.SearchStrategy[Layout]:
    shape = st.one_of(st.tuples(st.integers(1, 300)), st.tuples(st.integers(1, 20), st.integers(1, 40)))
    return st.lists(shape, min_size=1, max_size=4).map(
        lambda shapes: Layout(tuple((f"t{i}", s) for i, s in enumerate(shapes))))


@st.composite
def layout_and_vector(draw, *, max_abs: float = 1e4):
    layout = draw(layouts())
    x = draw(hnp.arrays(np.float32, layout.size, elements=st.floats(
        -float(np.float32(max_abs)), float(np.float32(max_abs)), width=32, allow_subnormal=False)))
    return layout, x


def roundtrip(spec: str, layout: Layout, x: np.ndarray, seed: int = 7) -> np.ndarray:
    blob = Compressor(spec, layout=layout).encode(x, seed=seed)
    y = Compressor.decode(blob, layout=layout, seed=seed)
    assert y.dtype == np.float32 and y.shape == x.shape and np.isfinite(y).all()
    return y


def block_scales(layout: Layout, x: np.ndarray, *, block: int, levels: int) -> np.ndarray:
    """The scale of every element's block for a quantizer-only chain (blocks stay inside a tensor)."""
    out = np.empty_like(x)
    for start, end in zip(layout.offsets, layout.offsets[1:]):
        for a in range(start, end, block):
            b = min(a + block, end)
            out[a:b] = np.abs(x[a:b]).max() / levels
    return out


# -- error bounds --------------------------------------------------------------------------------

@FAST
@given(layout_and_vector())
def test_none_is_exact(case):
    layout, x = case
    np.testing.assert_array_equal(roundtrip("none", layout, x), x)


@FAST
@given(layout_and_vector(max_abs=6e4))
def test_fp16_relative_bound(case):
    layout, x = case
    err = np.abs(roundtrip("fp16", layout, x).astype(np.float64) - x)
    assert (err <= np.maximum(2.0**-11 * np.abs(x), 2.0**-25)).all()


@FAST
@given(layout_and_vector(max_abs=3e38))
def test_bf16_relative_bound_and_round_to_nearest_even(case):
    layout, x = case
    y = roundtrip("bf16", layout, x)
    err = np.abs(y.astype(np.float64) - x)
    assert (err <= 2.0**-8 * np.abs(x.astype(np.float64))).all()
    assert (y.view(np.uint32) & 0xFFFF == 0).all()  # the lower 16 bits are gone


def test_bf16_ties_go_to_even():
    # 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: to even (1.0); 1 + 3 * 2^-8 rounds up
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], dtype=np.float32)
    y = roundtrip("bf16", Layout.from_shapes({"x": (3,)}), x)
    np.testing.assert_array_equal(y, [1.0, 1 + 2**-6, -1.0])


@FAST
@given(layout_and_vector(), st.sampled_from([("int8", 256, 127), ("int8:64", 64, 127), ("int4", 256, 7),
                                             ("int4:32", 32, 7)]), st.integers(0, 2**32))
@example((Layout.from_shapes({"t0": (234,)}), np.full(234, 19.0, dtype=np.float32)), ("int8", 256, 127), 239)
def test_block_quantizers_stay_within_one_scale(case, codec, seed):
    layout, x = case
    spec, block, levels = codec
    y = roundtrip(spec, layout, x, seed=seed)
    bound = block_scales(layout, x, block=block, levels=levels).astype(np.float64)
    err = np.abs(y.astype(np.float64) - x)
    # One scale, plus float32 rounding: the scale and x * (L / max|x|) each carry a relative error of
    # ~2^-24 (x/s can read L - 127 * 2^-24 where exact arithmetic gives L), and the dithered add rounds
    # by 2^-17: the extra is at most (2^-17 + 3 L 2^-24) s < 2^-15 s. The example above is a block where
    # floor(x/s + u) fell to L - 1: 19 - 126 * fl(19/127) exceeds fl(19/127) by ~4e-6 of it.
    assert (err <= bound * (1 + 2.0**-15) + 2.0**-100).all()


def test_quantizers_handle_zeros_tiny_blocks_and_extremes():
    layout = Layout.from_shapes({"a": (256,), "b": (256,), "c": (10,)})
    x = np.zeros(layout.size, dtype=np.float32)
    x[256:512] = 1e-35  # below 2^-100: sent as zeros
    x[512:] = [3e38, -3e38, 1, -1, 0, 5, 6, 7, 8, 9]
    for spec in ("int8", "int4"):
        y = roundtrip(spec, layout, x)
        assert (y[:512] == 0).all() and np.abs(y[:512] - x[:512]).max() <= 2.0**-100
        assert np.isfinite(y).all() and abs(y[512] - 3e38) <= 3e38 / (127 if spec == "int8" else 7) * 1.001
    x[512] = np.finfo(np.float32).max
    with pytest.raises(CodecError, match="float32 limit"):
        Compressor("int8", layout=layout).encode(x, seed=0)


@FAST
@given(layout_and_vector(), st.sampled_from([0.01, 0.1, 0.3, 0.6, 1.0]))
def test_topk_keeps_exactly_the_k_largest(case, ratio):
    layout, x = case
    n = layout.size
    k = kept(ratio, n)
    y = roundtrip(f"topk:{ratio}", layout, x)
    kept_mask = y != 0
    assert kept_mask.sum() <= k
    np.testing.assert_array_equal(y[kept_mask], x[kept_mask])  # float32 values travel exactly
    kth = np.sort(np.abs(x))[::-1][k - 1]
    assert kept_mask[np.abs(x) > kth].all()  # everything strictly above the k-th magnitude is kept
    assert (np.abs(x[kept_mask]) >= kth).all()


def test_topk_on_large_input_takes_the_fast_path_and_is_still_exact():
    from nebula_fl.compression.topk import top_k_indices

    rng = np.random.default_rng(1)
    mag = np.abs(rng.standard_normal(1 << 19)).astype(np.float32)
    mag[:1000] = 7.0  # ties at the top
    for k in (1, 10, 999, 1000, 1001, 5000, 30000):
        idx = top_k_indices(mag, k)
        assert idx.size == k and (np.diff(idx) > 0).all()
        expected = np.argsort(-mag, kind="stable")[:k]  # lowest index first among ties
        np.testing.assert_array_equal(idx, np.sort(expected))


@FAST
@given(layout_and_vector(), st.sampled_from([0.01, 0.2, 1.0]), st.integers(0, 2**40))
def test_randk_sends_k_exact_values_at_seeded_positions(case, ratio, seed):
    layout, x = case
    y = roundtrip(f"randk:{ratio}", layout, x, seed=seed)
    idx = parse_spec(f"randk:{ratio}")[0].positions(layout.size, seed)
    assert idx.size == kept(ratio, layout.size) and (np.diff(idx) > 0).all() and idx[-1] < layout.size
    np.testing.assert_array_equal(y[idx], x[idx])
    rest = np.ones(layout.size, bool)
    rest[idx] = False
    assert (y[rest] == 0).all()


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_lowrank_is_exact_for_a_matrix_of_that_rank(rank):
    rng = np.random.default_rng(rank)
    layout = Layout.from_shapes({"w": (40, 30), "v": (12, 50), "bias": (7,), "thin": (3, 9)})
    arrays = {"w": rng.standard_normal((40, rank)) @ rng.standard_normal((rank, 30)),
              "v": rng.standard_normal((12, rank)) @ rng.standard_normal((rank, 50)),
              "bias": rng.standard_normal(7), "thin": rng.standard_normal((3, 9))}
    x = layout.flatten(arrays)
    y = layout.unflatten(roundtrip(f"lowrank:{rank}", layout, x))
    for name in ("w", "v"):
        np.testing.assert_allclose(y[name], arrays[name], atol=1e-4 * np.abs(arrays[name]).max())
    np.testing.assert_array_equal(y["bias"], arrays["bias"].astype(np.float32))  # raw: 1-D
    if rank >= 3:
        np.testing.assert_array_equal(y["thin"], arrays["thin"].astype(np.float32))  # raw: min dim <= rank


# -- unbiasedness --------------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "levels"), [("int8:64", 127), ("int4:64", 7)])
def test_stochastic_rounding_is_unbiased(spec, levels):
    rng = np.random.default_rng(3)
    layout = Layout.from_shapes({"x": (256,)})
    x = (rng.standard_normal(256) * np.repeat([1.0, 1e-3, 50.0, 0.2], 64)).astype(np.float32)
    draws = 3000
    total = np.zeros(256)
    comp = Compressor(spec, layout=layout)
    for seed in range(draws):
        total += Compressor.decode(comp.encode(x, seed=seed), layout=layout, seed=seed)
    scale = block_scales(layout, x, block=64, levels=levels).astype(np.float64)
    # each draw is x + e with E[e] = 0 (to 2^-16 scale: 16-bit dither) and Var[e] <= scale^2 / 4,
    # so the mean of `draws` is within 6 standard deviations of x except with probability ~1e-9
    tolerance = 6 * (scale / 2) / math.sqrt(draws) + 2.0**-15 * scale + 1e-6 * np.abs(x)
    assert (np.abs(total / draws - x) <= tolerance).all()
    # and that tolerance is tight enough to catch a biased rounding (floor would be off by ~scale / 2)
    assert np.median(tolerance / scale) < 0.06


def test_different_seeds_give_different_dithers_and_the_same_seed_the_same_blob():
    layout = demo_layout()
    x = sample(layout)
    comp = Compressor("int8", layout=layout)
    assert comp.encode(x, seed=1) == comp.encode(x, seed=1)
    assert comp.encode(x, seed=1) != comp.encode(x, seed=2)


# -- error feedback ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", EF_SPECS)
def test_error_feedback_conserves_the_running_sum(spec):
    layout = demo_layout()
    comp = Compressor(spec, layout=layout)
    assert comp.error_feedback
    inputs = np.zeros(layout.size, np.float64)
    sent = np.zeros(layout.size, np.float64)
    for rnd in range(6):
        x = sample(layout, seed=rnd, scale=0.01 * (rnd + 1))
        blob = comp.encode(x, seed=100 + rnd)
        sent += Compressor.decode(blob, layout=layout, seed=100 + rnd)
        inputs += x
        np.testing.assert_allclose(sent + comp.residual, inputs, atol=2e-6, rtol=1e-5)
    assert np.linalg.norm(comp.residual) > 0


def test_quantizer_only_chains_keep_no_residual():
    for spec in ("none", "fp16", "bf16", "int8", "int4"):
        comp = Compressor(spec, layout=demo_layout())
        assert not comp.error_feedback and comp.residual is None and "residual" not in comp.state_dict()


def test_error_feedback_eventually_transmits_everything():
    layout = demo_layout()
    comp = Compressor("topk:0.05", layout=layout)
    x = sample(layout)
    total = comp.encode(x, seed=0)
    sent = Compressor.decode(total, layout=layout, seed=0)
    for rnd in range(1, 40):  # then zero input: the residual drains
        sent += Compressor.decode(comp.encode(np.zeros_like(x), seed=rnd), layout=layout, seed=rnd)
    np.testing.assert_allclose(sent, x, atol=1e-6)


# -- random-k linearity ------------------------------------------------------------------------

def test_randk_is_linear_for_a_shared_seed():
    layout = demo_layout()
    a, b = sample(layout, 1), sample(layout, 2)
    ca, cb, cab = (Compressor("randk:0.1", layout=layout) for _ in range(3))
    for rnd in range(4):
        seed = 40 + rnd
        da = Compressor.decode(ca.encode(a, seed=seed), layout=layout, seed=seed)
        db = Compressor.decode(cb.encode(b, seed=seed), layout=layout, seed=seed)
        dab = Compressor.decode(cab.encode(a + b, seed=seed), layout=layout, seed=seed)
        if rnd == 0:
            np.testing.assert_array_equal(da + db, dab)  # exactly, in the first round
        else:  # with residuals, equal up to float32 reassociation
            np.testing.assert_allclose(da + db, dab, atol=1e-5)


def test_randk_positions_depend_on_the_seed_only():
    layout = demo_layout()
    codec = parse_spec("randk:0.1")[0]
    first, again, other = (codec.positions(layout.size, s) for s in (5, 5, 6))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    y1 = Compressor.decode(Compressor("randk:0.1", layout=layout).encode(sample(layout, 1), seed=5),
                           layout=layout, seed=5)
    y2 = Compressor.decode(Compressor("randk:0.1", layout=layout).encode(sample(layout, 2), seed=5),
                           layout=layout, seed=5)
    np.testing.assert_array_equal(y1 != 0, y2 != 0)  # other data, same positions
    with pytest.raises(CodecError, match="another seed"):
        Compressor.decode(Compressor("randk:0.1", layout=layout).encode(sample(layout), seed=5),
                          layout=layout, seed=6)



@pytest.mark.parametrize("spec", ["none", "randk:0.1", "topk:0.05", "topk:0.05+int8"])
def test_select_hands_over_what_the_blob_decodes_to_and_encodes_as_encode_does(spec):
    """Secure aggregation masks `select`'s values with no decode: they must be the blob's, coordinate for
    coordinate (all of them, or random-k's), and `select` must leave the very blob and residual `encode` does."""
    layout = demo_layout()
    selecting, encoding = Compressor(spec, layout=layout), Compressor(spec, layout=layout)
    first = parse_spec(spec)[0]
    for rnd in range(3):
        x, seed = sample(layout, rnd), 30 + rnd
        chosen = selecting.select(x, seed=seed)
        assert chosen.blob == encoding.encode(x, seed=seed)
        if spec in ("none", "randk:0.1"):  # the linear chains secure aggregation takes
            dense = Compressor.decode(chosen.blob, layout=layout, seed=seed)
            want = dense[first.positions(layout.size, seed)] if spec.startswith("randk") else dense
            np.testing.assert_array_equal(chosen.values, want)
        if selecting.residual is not None:
            np.testing.assert_array_equal(selecting.residual, encoding.residual)

# -- sizes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ALL_SPECS)
def test_encoded_size_is_exact_and_the_header_small(spec):
    layout = demo_layout()
    comp = Compressor(spec, layout=layout)
    blob = comp.encode(sample(layout), seed=3)
    assert len(blob) == comp.encoded_size() == comp.describe()["encoded_bytes"]
    header = 8 + int.from_bytes(blob[4:8], "little")
    assert header <= 192, header  # prefix + JSON + padding, for any built-in chain


@FAST
@given(st.integers(1, 200_000), st.sampled_from([0.001, 0.01, 0.05, 0.2, 0.5, 1.0]))
def test_topk_size_never_exceeds_uint32_indices_plus_float32_values(n, ratio):
    layout = Layout.from_shapes({"x": (n,)})
    comp = Compressor(f"topk:{ratio}", layout=layout)
    k = kept(ratio, n)
    blob = comp.encode(np.ones(n, np.float32), seed=0)
    size = len(blob)
    header = 8 + int.from_bytes(blob[4:8], "little")
    assert size == comp.encoded_size() and header <= 160
    index_bytes = sum(a.nbytes for a in index_coding.plan(n, k))
    # the ideal with uint32 indices is k * (4 + 4) + header; Elias-Fano / bitmap never does worse,
    # and costs at most 2 + log2(n / k) bits an index (+ 2 bytes of rounding)
    assert size <= 8 * k + header
    assert index_bytes <= min(k * (2 + math.log2(n / k)), n) / 8 + 2
    assert size == header + index_bytes + 4 * k + (-index_bytes % 4)


def test_demo_sized_update_fits_the_wan_budget():
    # ~75k float32 (the demo adapter); 3000x fewer bytes than a 91 MB model is 30.3 kB a message
    layout = Layout.from_shapes({**{f"l{i}.{m}.lora_{ab}": ((8, 384) if ab == "A" else (384, 8))
                                    for i in range(6) for m in ("q", "v") for ab in ("A", "B")},
                                 "head.weight": (5, 384), "head.bias": (5,)})
    comp = Compressor("topk:0.05+int8", layout=layout)
    assert comp.encoded_size() <= 91e6 / 3000
    assert comp.describe()["ratio"] > 30


# -- state -----------------------------------------------------------------------------------------

def _plain(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return isinstance(value, np.ndarray | int | float | str) and not isinstance(value, bool)


@pytest.mark.parametrize("spec", ["topk:0.1+int8", "randk:0.1", "lowrank:2+int8", "lowrank:3", "int4", "fp16"])
def test_restored_compressor_continues_byte_identically(spec):
    layout = demo_layout()
    comp = Compressor(spec, layout=layout)
    for rnd in range(3):
        comp.encode(sample(layout, rnd), seed=rnd)
    state = comp.state_dict()
    assert _plain(state)
    twin = Compressor.from_state_dict(state, layout=layout)
    other = Compressor(spec, layout=layout)
    other.load_state_dict(state)
    for rnd in range(3, 6):
        x = sample(layout, rnd)
        blob = comp.encode(x, seed=rnd)
        assert twin.encode(x, seed=rnd) == blob
        assert other.encode(x, seed=rnd) == blob


def test_state_is_a_snapshot_and_bad_state_is_refused():
    layout = demo_layout()
    comp = Compressor("lowrank:2", layout=layout)
    comp.encode(sample(layout), seed=0)
    state = comp.state_dict()
    state["residual"][:] = 99  # a copy: the compressor is unaffected
    assert np.abs(comp.residual).max() < 99
    good = comp.state_dict()
    cases = [
        ({**good, "spec": "lowrank:3"}, "is for 'lowrank:3'"),
        ({**good, "layout": "00000000"}, "layout"),
        ({**good, "residual": np.zeros(3)}, "residual"),
        ({**good, "residual": np.full(layout.size, np.nan)}, "residual"),
        ({**good, "stages": {}}, "stages"),
        ({**good, "stages": {"0": {"q": {"l0.q.lora_A": np.zeros((96, 5))}}}}, "lowrank state"),
        ({**good, "format": 2}, "format"),
        ("nonsense", "format"),
    ]
    for bad, match in cases:
        with pytest.raises(CodecError, match=match):
            Compressor("lowrank:2", layout=layout).load_state_dict(bad)
    with pytest.raises(CodecError, match="keeps none"):
        Compressor("int8", layout=layout).load_state_dict({**Compressor("int8", layout=layout).state_dict(),
                                                           "residual": np.zeros(layout.size)})


def test_failed_encode_leaves_the_state_untouched():
    layout = demo_layout()
    comp = Compressor("lowrank:2+fp16", layout=layout)
    comp.encode(sample(layout), seed=0)
    before = comp.state_dict()
    with pytest.raises(CodecError, match="fp16"):
        comp.encode(sample(layout, scale=1e6), seed=1)  # beyond the fp16 range
    after = comp.state_dict()
    np.testing.assert_array_equal(before["residual"], after["residual"])
    for name, q in before["stages"]["0"]["q"].items():
        np.testing.assert_array_equal(q, after["stages"]["0"]["q"][name])


# -- adaptive compression ------------------------------------------------------------------------

def test_with_param_turns_the_primary_knob_and_keeps_the_residual():
    layout = demo_layout()
    comp = Compressor("topk:0.05+int8", layout=layout)
    comp.encode(sample(layout), seed=0)
    looser = comp.with_param(0.2)
    assert looser.spec == "topk:0.2+int8" and looser.param == 0.2 and comp.param == 0.05
    np.testing.assert_array_equal(looser.residual, comp.residual)
    assert looser.encoded_size() > comp.encoded_size()
    assert looser.describe() | {"spec": "x"} != {}

    quant = Compressor("int8:64", layout=layout)
    assert quant.param == 8 and quant.with_param(4).spec == "int4:64" and quant.with_param(4).with_param(8).spec == "int8:64"

    low = Compressor("lowrank:3", layout=layout)
    low.encode(sample(layout), seed=0)
    for rank in (1, 5):
        changed = low.with_param(rank)
        assert changed.spec == f"lowrank:{rank}"
        for q in changed.state_dict()["stages"]["0"]["q"].values():
            assert q.shape[1] == rank
        changed.encode(sample(layout, 1), seed=1)

    assert Compressor("randk:0.1", layout=layout).with_param(0.3).param == 0.3
    # adaptive controllers hand every knob over as a float: integral floats are fine for ranks and bits
    assert low.with_param(2.0).spec == "lowrank:2" and quant.with_param(4.0).spec == "int4:64"
    for spec, value in [("fp16", 4), ("none", 1), ("int8", 16), ("topk:0.1", 0), ("topk:0.1", 2.0), ("lowrank:2", 0),
                         ("lowrank:2", 2.5), ("int8", 4.5), ("int8", True)]:
        with pytest.raises(CodecError):
            Compressor(spec, layout=layout).with_param(value)


def test_describe_reports_the_chain():
    layout = demo_layout()
    info = Compressor("topk:0.05+int8:256", layout=layout).describe()
    assert info["spec"] == "topk:0.05+int8" and info["param"] == 0.05
    assert info["stages"] == ["topk:0.05", "int8"] and info["error_feedback"] is True
    assert info["raw_bytes"] == 4 * layout.size and info["residual_norm"] == 0.0
    assert Compressor("fp16", layout=layout).describe()["param"] is None


# -- input checks --------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "int8", "int4", "topk:0.1", "randk:0.1", "lowrank:2"])
def test_encode_refuses_nan_inf_and_wrong_shapes(spec):
    layout = demo_layout()
    comp = Compressor(spec, layout=layout)
    x = sample(layout)
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[17] = bad
        with pytest.raises(CodecError, match="NaN or Inf"):
            comp.encode(y, seed=0)
    for bad_x, match in [(x[:-1], "1-D array"), (x.reshape(1, -1), "1-D array"), (list(x), "1-D array"),
                         (x.astype(np.int32), "float")]:
        with pytest.raises(CodecError, match=match):
            comp.encode(bad_x, seed=0)
    for seed in (-1, 2**64, 1.5, True, "1"):
        with pytest.raises(CodecError, match="seed"):
            comp.encode(x, seed=seed)
    assert comp.encode(x.astype(np.float64), seed=np.uint32(3))  # other float types and numpy ints are fine
    if comp.error_feedback:
        assert np.isfinite(comp.residual).all()


def test_encode_does_not_modify_its_input():
    layout = demo_layout()
    for spec in ALL_SPECS:
        x = sample(layout)
        before = x.copy()
        comp = Compressor(spec, layout=layout)
        comp.encode(x, seed=0)
        comp.encode(x, seed=1)
        np.testing.assert_array_equal(x, before)


# -- specs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "canonical"), [
    ("int8", "int8"), ("int8:256", "int8"), ("int8:64", "int8:64"), ("topk:5e-2", "topk:0.05"),
    (" topk:0.05 + int8 ", "topk:0.05+int8"), ("topk:0.1+none", "topk:0.1+none"), ("lowrank:4+fp16", "lowrank:4+fp16"),
    ("randk:1", "randk:1.0"), ("none", "none"), ("int4:32", "int4:32"),
])
def test_spec_canonical_forms(spec, canonical):
    stages = parse_spec(spec)
    assert "+".join(s.spec for s in stages) == canonical
    assert Compressor(spec, layout=demo_layout()).spec == canonical
    assert "+".join(s.spec for s in parse_spec(canonical)) == canonical


@pytest.mark.parametrize(("spec", "match"), [
    ("", "empty"),
    ("   ", "empty"),
    ("int8+topk:0.1", "write 'topk:0.1\\+int8'"),
    ("topk:0.1+randk:0.1", "two sparsifier"),
    ("int8+int4", "two quantizers"),
    ("none+int8", "two quantizers"),
    ("topk:0.1+int8+fp16", "3 stages"),
    ("topk:0.1++int8", "empty stage"),
    ("+int8", "empty stage"),
    ("zip", "unknown codec 'zip'"),
    ("TOPK:0.1", "not a codec name"),
    ("top k:0.1", "not a codec name"),
    ("topk", "needs the fraction"),
    ("topk:", "no argument"),
    ("topk:0", "in \\(0, 1\\]"),
    ("topk:1.5", "in \\(0, 1\\]"),
    ("topk:nan", "in \\(0, 1\\]"),
    ("topk:abc", "needs a number"),
    ("randk:-0.1", "in \\(0, 1\\]"),
    ("int8:3", "block size"),
    ("int8:abc", "block size"),
    ("int4:1e9", "block size"),
    ("lowrank", "needs a rank"),
    ("lowrank:0", "rank"),
    ("lowrank:2.5", "rank"),
    ("none:1", "takes no argument"),
    ("fp16:8", "takes no argument"),
    ("x" * 300, "limit"),
])
def test_bad_specs_say_how_to_fix(spec, match):
    with pytest.raises(CodecError, match=match) as info:
        parse_spec(spec)
    assert isinstance(info.value, ValueError)
    with pytest.raises(CodecError):
        Compressor(spec, layout=demo_layout())


def test_non_string_spec_and_bad_layout():
    with pytest.raises(CodecError, match="string"):
        parse_spec(8)  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="Layout"):
        Compressor("int8", layout={"x": (3,)})  # type: ignore[arg-type]


# -- registry --------------------------------------------------------------------------------------

class _Negate(Codec):
    """A toy quantizer for the registry tests: float32 values, negated on the wire."""

    name = "negate"
    role = "quantizer"

    def plan(self, segments, *, layout):
        return Plan(arrays=(ArraySpec("v", "f4", sum(segments)),))

    def encode(self, values, *, segments, layout, seed):
        return Encoded(arrays={"v": -values})

    def decode(self, encoded, *, segments, layout, seed):
        return -encoded.arrays["v"]


def test_register_codec_makes_a_class_usable_and_refuses_duplicates():
    register_codec("negate", _Negate)
    try:
        assert "negate" in available_codecs()
        layout = demo_layout()
        x = sample(layout)
        np.testing.assert_array_equal(roundtrip("negate", layout, x), x)
        np.testing.assert_array_equal(roundtrip("topk:1.0+negate", layout, x), x)
        with pytest.raises(CodecError, match="already taken"):
            register_codec("negate", _Negate)
    finally:
        unregister_codec("negate")
    assert "negate" not in available_codecs()
    with pytest.raises(CodecError, match="already taken"):
        register_codec("int8", _Negate)
    with pytest.raises(CodecError, match="not a subclass"):
        register_codec("thing", dict)  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="registered as 'other'"):
        register_codec("other", _Negate)


def test_a_plugin_returning_the_wrong_arrays_is_caught_before_the_wire():
    class Liar(_Negate):
        name = "liar"

        def encode(self, values, *, segments, layout, seed):
            return Encoded(arrays={"v": -values[:-1]})

    register_codec("liar", Liar)
    try:
        with pytest.raises(CodecError, match="its plan says"):
            Compressor("liar", layout=demo_layout()).encode(sample(demo_layout()), seed=0)
    finally:
        unregister_codec("liar")


def test_builtins_are_all_available():
    assert {"none", "fp16", "bf16", "int8", "int4", "topk", "randk", "lowrank"} <= set(available_codecs())


# -- layout ----------------------------------------------------------------------------------------

def test_layout_flatten_unflatten_and_json():
    arrays = {"a.lora_A": np.arange(8 * 384, dtype=np.float32).reshape(8, 384), "head.bias": np.ones(5, np.float64)}
    layout = Layout.from_arrays(arrays)
    assert layout.names == ("a.lora_A", "head.bias") and layout.size == 8 * 384 + 5
    flat = layout.flatten(arrays)
    assert flat.dtype == np.float32 and flat.shape == (layout.size,)
    back = layout.unflatten(flat)
    assert list(back) == list(arrays)
    for name in arrays:
        np.testing.assert_array_equal(back[name], arrays[name])
    assert Layout.from_json(layout.to_json()) == layout
    assert Layout.from_json(layout.to_json()).fingerprint == layout.fingerprint
    reordered = Layout.from_arrays({"head.bias": arrays["head.bias"], "a.lora_A": arrays["a.lora_A"]})
    assert reordered.fingerprint != layout.fingerprint


def test_layout_mismatches_raise_value_error():
    layout = Layout.from_shapes({"w": (2, 3), "b": (3,)})
    for arrays, match in [({"w": np.zeros((2, 3))}, "1 missing"),
                          ({"w": np.zeros((2, 3)), "b": np.zeros(3), "c": np.zeros(1)}, "1 unexpected"),
                          ({"w": np.zeros((3, 2)), "b": np.zeros(3)}, "shape"),
                          ({"w": np.zeros((2, 3)), "b": np.array(["a", "b", "c"])}, "dtype")]:
        with pytest.raises(ValueError, match=match):
            layout.flatten(arrays)
    for flat in (np.zeros(8), np.zeros((9, 1)), np.zeros(9, dtype=np.int64)):
        with pytest.raises(ValueError):
            layout.unflatten(flat)
    for bad in [(("w", (2, -1)),), (("w", (2,)), ("w", (3,))), (("", (2,)),), (("w", (0,)),), (("w", (2.5,)),),
                (("w", (True,)),), ((3, (2,)),)]:
        with pytest.raises(ValueError):
            Layout(bad)  # type: ignore[arg-type]
    for text in ("", "[]", '{"tensors": 3}', '{"tensors": [["w", [2, "x"]]]}', '{"tensors": [["w", 2]]}', "{" * 5000):
        with pytest.raises(ValueError):
            Layout.from_json(text)
