"""spec.rope: closed forms, table halves, transpose property, positions (varlen, start, explicit, CP),
layouts, pass-through bytes, NaN policy and one test per argument error."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import spec
from spec.constants import ROPE_STYLES
from spec.rope import rope, rope_backward, rotation_indices, validate_rope, validate_rope_backward
from tests.util import BF16, as_bytes, assert_bytes_equal, random_magnitudes

U = 2.0 ** -24  # fp32 unit roundoff
PROPS = settings(max_examples=25, deadline=None)


def f32(*v):
    return np.array(v, dtype=np.float32)


# --------------------------------------------------------------------------------------------------
# Closed forms: one head, D = 6 (2 pass-through + rope_dim 4), tables whose halves differ
# --------------------------------------------------------------------------------------------------
X = f32(1, 2, 3, 4, 5, 6).reshape(1, 1, 6)  # rope slice r = [3, 4, 5, 6]
COS = f32(0.5, 0.25, 2, 4).reshape(1, 4)
SIN = f32(1, 3, 5, 7).reshape(1, 4)

# Worked by hand from SEMANTICS.md section 4 with r = [3, 4, 5, 6], c = [.5, .25, 2, 4], s = [1, 3, 5, 7]
# (h = 2); every product and sum is exact in fp32.
HAND_FORWARD = {
    # out[k] = r[2k]c[k] - r[2k+1]s[k]; out[h+k] = r[2k+1]c[h+k] + r[2k]s[h+k]
    "mla": [3 * .5 - 4 * 1, 5 * .25 - 6 * 3, 4 * 2 + 3 * 5, 6 * 4 + 5 * 7],  # -2.5, -16.75, 23, 59
    # out[k] = r[k]c[k] - r[h+k]s[k]; out[h+k] = r[h+k]c[h+k] + r[k]s[h+k]
    "neox": [3 * .5 - 5 * 1, 4 * .25 - 6 * 3, 5 * 2 + 3 * 5, 6 * 4 + 4 * 7],  # -3.5, -17, 25, 52
    # out[2k] = r[2k]c[2k] - r[2k+1]s[2k]; out[2k+1] = r[2k+1]c[2k+1] + r[2k]s[2k+1]
    "interleaved": [3 * .5 - 4 * 1, 4 * .25 + 3 * 3, 5 * 2 - 6 * 5, 6 * 4 + 5 * 7],  # -2.5, 10, -20, 59
}
HAND_BACKWARD = {
    # g = [3, 4, 5, 6]: gL = [3, 4], gR = [5, 6]
    # dx[2k] = gL[k]c[k] + gR[k]s[h+k]; dx[2k+1] = gR[k]c[h+k] - gL[k]s[k]
    "mla": [3 * .5 + 5 * 5, 5 * 2 - 3 * 1, 4 * .25 + 6 * 7, 6 * 4 - 4 * 3],  # 26.5, 7, 43, 12
    # dx[k] = g[k]c[k] + g[h+k]s[h+k]; dx[h+k] = g[h+k]c[h+k] - g[k]s[k]
    "neox": [3 * .5 + 5 * 5, 4 * .25 + 6 * 7, 5 * 2 - 3 * 1, 6 * 4 - 4 * 3],  # 26.5, 43, 7, 12
    # dx[2k] = g[2k]c[2k] + g[2k+1]s[2k+1]; dx[2k+1] = g[2k+1]c[2k+1] - g[2k]s[2k]
    "interleaved": [3 * .5 + 4 * 3, 4 * .25 - 3 * 1, 5 * 2 + 6 * 7, 6 * 4 - 5 * 5],  # 13.5, -2, 52, -1
}


@pytest.mark.parametrize("style", ROPE_STYLES)
def test_closed_form_forward(style):
    out = rope(X, COS, SIN, style=style)
    assert_bytes_equal(out, f32(1, 2, *HAND_FORWARD[style]).reshape(1, 1, 6), style)


@pytest.mark.parametrize("style", ROPE_STYLES)
def test_closed_form_backward(style):
    out = rope_backward(X, COS, SIN, style=style)
    assert_bytes_equal(out, f32(1, 2, *HAND_BACKWARD[style]).reshape(1, 1, 6), style)


@pytest.mark.parametrize("style", ROPE_STYLES)
def test_products_rounded_separately_no_fma(style):
    # a*c = (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24: the 2^-24 is a tie at ulp(1)/2 and rounds to even,
    # RN(a*c) = 1 + 2^-11 = RN(b*s). Separate roundings give exactly 0; an FMA would keep 2^-24.
    a, b = 1 + 2.0 ** -12, 1 + 2.0 ** -11
    first, second, _ = rotation_indices(style, 2)
    r = np.zeros(2, np.float32)
    r[first[0]], r[second[0]] = a, b
    x = r.reshape(1, 1, 2)
    out = rope(x, f32(a, 1).reshape(1, 2), f32(1, 1).reshape(1, 2), style=style)
    assert as_bytes(out[0, 0, 0]).tobytes() == f32(0.0).tobytes()


def test_mla_halves_read_their_own_table_halves():
    # Left half cos=1, sin=0; right half cos=0, sin=1. Correct: out[k] = x[2k], out[h+k] = x[2k].
    # A kernel using c[k], s[k] for both halves would give out[h+k] = x[2k+1].
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 3, 8)).astype(np.float32)
    cos = np.tile(f32(1, 1, 1, 1, 0, 0, 0, 0), (5, 1))
    sin = np.tile(f32(0, 0, 0, 0, 1, 1, 1, 1), (5, 1))
    out = rope(x, cos, sin, style="mla", positions=np.arange(5))
    even = x[..., 0::2]
    assert_bytes_equal(out, np.concatenate([even, even], axis=-1), "mla halves")


def test_mla_asymmetric_tables_match_elementwise_formula():
    rng = np.random.default_rng(2)
    T, H, R = 6, 2, 8
    h = R // 2
    x = rng.standard_normal((T, H, R)).astype(np.float32)
    cos = rng.standard_normal((T, R)).astype(np.float32)  # halves differ
    sin = rng.standard_normal((T, R)).astype(np.float32)
    out = rope(x, cos, sin, style="mla", positions=np.arange(T))
    want = np.empty_like(x)
    c, s = cos[:, None, :], sin[:, None, :]
    for k in range(h):  # per feature (not per token): the definition, element by element
        want[..., k] = (x[..., 2 * k] * c[..., k]) - (x[..., 2 * k + 1] * s[..., k])
        want[..., h + k] = (x[..., 2 * k + 1] * c[..., h + k]) + (x[..., 2 * k] * s[..., h + k])
    assert_bytes_equal(out, want, "mla asymmetric")


# --------------------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------------------
def _dyadic(rng, shape, lo, hi, step):
    """Integers in [lo, hi] times `step` (a power of two): products and sums stay exact in fp32."""
    return (rng.integers(lo, hi + 1, size=shape) * step).astype(np.float32)


shapes = st.tuples(st.integers(1, 9), st.integers(1, 3), st.integers(1, 4), st.integers(0, 3))


@PROPS
@given(seed=st.integers(0, 2**32 - 1), style=st.sampled_from(ROPE_STYLES), shape=shapes)
def test_backward_is_exact_transpose_on_exact_data(seed, style, shape):
    # Data: |x|, |g| <= 64 integers, tables multiples of 2^-6 in [-1, 1]. Every fp32 product has <= 14
    # significant bits and every sum <= 15, so rope and rope_backward are exact; the float64 inner
    # products of fp32 values are exact too (48-bit products, a few thousand terms of magnitude
    # <= 2^13 on a 2^-12 grid fit 53 bits). So the two inner products are equal; 1e-12 is slack.
    T, H, half, keep = shape
    R = 2 * half
    rng = np.random.default_rng(seed)
    x = _dyadic(rng, (T, H, keep + R), -64, 64, 1.0)
    g = _dyadic(rng, (T, H, keep + R), -64, 64, 1.0)
    cos = _dyadic(rng, (T + 3, R), -64, 64, 2.0 ** -6)
    sin = _dyadic(rng, (T + 3, R), -64, 64, 2.0 ** -6)
    kw = dict(style=style, start_positions=np.array([2], np.int32))
    fwd = rope(x, cos, sin, **kw).astype(np.float64)
    bwd = rope_backward(g, cos, sin, **kw).astype(np.float64)
    lhs = np.dot(g.astype(np.float64).ravel(), fwd.ravel())
    rhs = np.dot(bwd.ravel(), x.astype(np.float64).ravel())
    assert abs(lhs - rhs) <= 1e-12 * max(abs(lhs), abs(rhs), 1e-300)


@PROPS
@given(seed=st.integers(0, 2**32 - 1), style=st.sampled_from(ROPE_STYLES), shape=shapes)
def test_backward_is_transpose_within_rounding_on_random_data(seed, style, shape):
    # Random fp32 data: each output is RN(RN(p) + RN(q)) = (p(1+e1) + q(1+e2))(1+e3), |e| <= u = 2^-24,
    # so |out - (p+q)| <= (2u + u^2)(|p| + |q|). Summed against g, forward and backward each differ
    # from the exact <g, R x> by at most (2u+u^2) M with M = sum |g_i| (|p_i| + |q_i|) (the same M
    # for both, R and R^T having the same entries). float64 inner products of n terms add at most
    # n * 2^-53 * (1 + 3u) M each. No subnormals or overflow at these magnitudes (2^-30..2^30).
    T, H, half, keep = shape
    R = 2 * half
    rng = np.random.default_rng(seed)
    x = random_magnitudes(rng, (T, H, keep + R))
    g = random_magnitudes(rng, (T, H, keep + R))
    cos = rng.standard_normal((T, R)).astype(np.float32)
    sin = rng.standard_normal((T, R)).astype(np.float32)
    kw = dict(style=style, positions=np.arange(T))
    fwd = rope(x, cos, sin, **kw)[..., keep:].astype(np.float64)
    bwd = rope_backward(g, cos, sin, **kw)[..., keep:].astype(np.float64)
    xr, gr = x[..., keep:].astype(np.float64), g[..., keep:].astype(np.float64)
    first, second, _ = rotation_indices(style, R)
    c, s = cos.astype(np.float64)[:, None, :], sin.astype(np.float64)[:, None, :]
    M = np.sum(np.abs(gr) * (np.abs(xr[..., first] * c) + np.abs(xr[..., second] * s)))
    n = gr.size
    bound = 2 * (2 * U + U * U) * M + 2 * n * 2.0 ** -53 * (1 + 3 * U) * M
    lhs, rhs = np.dot(gr.ravel(), fwd.ravel()), np.dot(bwd.ravel(), xr.ravel())
    assert abs(lhs - rhs) <= bound


def _deinterleave(a):
    return np.concatenate([a[..., 0::2], a[..., 1::2]], axis=-1)


@PROPS
@given(seed=st.integers(0, 2**32 - 1), half=st.integers(1, 8), symmetric=st.booleans())
def test_mla_is_neox_after_deinterleave(seed, half, symmetric):
    # Section 4's formulas make mla = neox(deinterleave(x)) for ANY tables (both read the right half
    # at c[h+k], s[h+k]), so this holds with symmetric and asymmetric tables alike.
    rng = np.random.default_rng(seed)
    T, R = 7, 2 * half
    x = rng.standard_normal((T, 2, R)).astype(np.float32)
    f = rng.standard_normal((T, R if not symmetric else half)).astype(np.float32)
    fs = rng.standard_normal(f.shape).astype(np.float32)
    cos, sin = (np.concatenate([f, f], -1), np.concatenate([fs, fs], -1)) if symmetric else (f, fs)
    kw = dict(positions=np.arange(T))
    assert_bytes_equal(rope(x, cos, sin, style="mla", **kw), rope(_deinterleave(x), cos, sin, style="neox", **kw))


@PROPS
@given(seed=st.integers(0, 2**32 - 1), half=st.integers(1, 8))
def test_mla_symmetric_tables_hide_a_half_swap_asymmetric_do_not(seed, half):
    # The shortcut "interleaved GPT-J rotation with c[k], s[k] repeated per pair, then gather halves"
    # equals mla exactly when the tables are cat([f, f]); with halves that differ it must not.
    rng = np.random.default_rng(seed)
    T, R = 5, 2 * half
    x = (rng.standard_normal((T, 3, R)) + 4).astype(np.float32)  # away from 0: differences show
    f, fs = (rng.standard_normal((T, half)).astype(np.float32) for _ in range(2))
    kw = dict(positions=np.arange(T))

    def shortcut(c, s):
        out = rope(x, np.repeat(c[:, :half], 2, -1), np.repeat(s[:, :half], 2, -1), style="interleaved", **kw)
        return _deinterleave(out)

    cos, sin = np.concatenate([f, f], -1), np.concatenate([fs, fs], -1)
    assert_bytes_equal(rope(x, cos, sin, style="mla", **kw), shortcut(cos, sin), "symmetric")
    cos_asym = np.concatenate([f, f + 1], -1)
    assert not np.array_equal(as_bytes(rope(x, cos_asym, sin, style="mla", **kw)), as_bytes(shortcut(cos_asym, sin)))


def _to_layout(a_bshd, layout):
    """[B, S, H, D] -> the layout (thd packs B equal-length sequences)."""
    B, S = a_bshd.shape[:2]
    if layout == "bshd":
        return a_bshd
    if layout == "sbhd":
        return np.ascontiguousarray(a_bshd.transpose(1, 0, 2, 3))
    return a_bshd.reshape(B * S, *a_bshd.shape[2:])


@PROPS
@given(seed=st.integers(0, 2**32 - 1), style=st.sampled_from(ROPE_STYLES), B=st.integers(1, 3),
       half_S=st.integers(1, 4), cp=st.sampled_from([(1, 0), (2, 0), (2, 1), (3, 2)]),
       backward=st.booleans(), out_dtype=st.sampled_from([None, "float32", "bfloat16"]))
def test_layouts_agree(seed, style, B, half_S, cp, backward, out_dtype):
    rng = np.random.default_rng(seed)
    S, H, D, R = 2 * half_S, 2, 10, 6
    x = random_magnitudes(rng, (B, S, H, D), BF16)
    cos = rng.standard_normal((64, R)).astype(BF16)
    sin = rng.standard_normal((64, R)).astype(BF16)
    start = rng.integers(0, 10, size=B).astype(np.int32)
    op = rope_backward if backward else rope
    kw = dict(style=style, start_positions=start, cp_size=cp[0], cp_rank=cp[1], out_dtype=out_dtype)
    ref = op(x, cos, sin, layout="bshd", **kw)
    for layout in ("sbhd", "thd"):
        extra = {"cu_seqlens": np.arange(0, B * S + 1, S, dtype=np.int32)} if layout == "thd" else {}
        out = op(_to_layout(x, layout), cos, sin, layout=layout, **kw, **extra)
        assert_bytes_equal(out, _to_layout(ref, layout), layout)


# --------------------------------------------------------------------------------------------------
# Positions, read back through a probe: x = 1, sin = 0, cos[p, :] = p makes every rotated output
# feature equal its token's position (every style: out = 1 * c + (+-)1 * 0).
# --------------------------------------------------------------------------------------------------
def _probe_positions(layout, x_shape, style="mla", **kw):
    n_rows, R = 256, 4
    cos = np.repeat(np.arange(n_rows, dtype=np.float32)[:, None], R, axis=1)
    sin = np.zeros_like(cos)
    out = rope(np.ones(x_shape, np.float32), cos, sin, style=style, layout=layout, **kw)
    vals = out[..., -R:]
    assert np.all(vals == vals[..., :1, :1])  # every head and rotated feature agrees
    return vals[..., 0, 0].astype(np.int64)


def test_positions_default_thd_single_sequence():
    assert _probe_positions("thd", (5, 2, 6)).tolist() == [0, 1, 2, 3, 4]


def test_positions_varlen_with_empty_sequence_and_start_positions():
    cu = np.array([0, 3, 3, 7], np.int32)
    assert _probe_positions("thd", (7, 1, 4), cu_seqlens=cu).tolist() == [0, 1, 2, 0, 1, 2, 3]
    start = np.array([10, 50, 100], np.int64)
    got = _probe_positions("thd", (7, 1, 4), cu_seqlens=cu, start_positions=start)
    assert got.tolist() == [10, 11, 12, 100, 101, 102, 103]


def test_positions_sbhd_bshd_with_start_positions():
    start = np.array([0, 7], np.int32)
    want_bs = [[0, 1, 2], [7, 8, 9]]
    assert _probe_positions("bshd", (2, 3, 1, 4), start_positions=start).tolist() == want_bs
    assert _probe_positions("sbhd", (3, 2, 1, 4), start_positions=start).tolist() == np.array(want_bs).T.tolist()


def test_positions_explicit():
    p = np.array([5, 0, 200, 3], np.int64)
    assert _probe_positions("thd", (4, 2, 4), positions=p).tolist() == p.tolist()
    p_s = np.array([9, 4, 1], np.int32)  # [S], shared by every batch entry
    assert _probe_positions("bshd", (2, 3, 1, 4), positions=p_s).tolist() == [[9, 4, 1]] * 2
    assert _probe_positions("sbhd", (3, 2, 1, 4), positions=p_s).tolist() == [[9, 9], [4, 4], [1, 1]]
    p_bs = np.array([[1, 2, 3], [40, 50, 60]], np.int32)  # [B, S] batch first in both layouts
    assert _probe_positions("bshd", (2, 3, 1, 4), positions=p_bs).tolist() == p_bs.tolist()
    assert _probe_positions("sbhd", (3, 2, 1, 4), positions=p_bs).tolist() == p_bs.T.tolist()


def test_positions_context_parallel_by_hand():
    # cp_size = 2: each sequence is cut into 4 chunks; rank 0 holds chunks 0 and 3, rank 1 chunks 1, 2.
    # Local lengths 4 and 6 -> global lengths 8 (chunks of 2) and 12 (chunks of 3).
    cu = np.array([0, 4, 10], np.int32)
    r0 = _probe_positions("thd", (10, 1, 4), cu_seqlens=cu, cp_size=2, cp_rank=0)
    r1 = _probe_positions("thd", (10, 1, 4), cu_seqlens=cu, cp_size=2, cp_rank=1)
    assert r0.tolist() == [0, 1, 6, 7] + [0, 1, 2, 9, 10, 11]
    assert r1.tolist() == [2, 3, 4, 5] + [3, 4, 5, 6, 7, 8]
    start = np.array([10, 100], np.int32)  # start_positions add to the global position
    r1s = _probe_positions("thd", (10, 1, 4), cu_seqlens=cu, cp_size=2, cp_rank=1, start_positions=start)
    assert r1s.tolist() == [12, 13, 14, 15] + [103, 104, 105, 106, 107, 108]
    # cp_size = 3, local S = 4 (chunk 2, 6 chunks): rank 1 holds chunks 1 and 4.
    assert _probe_positions("bshd", (1, 4, 1, 4), cp_size=3, cp_rank=1).tolist() == [[2, 3, 8, 9]]
    assert _probe_positions("sbhd", (4, 1, 1, 4), cp_size=3, cp_rank=1).tolist() == [[2], [3], [8], [9]]


@PROPS
@given(seed=st.integers(0, 2**32 - 1), cp_size=st.integers(1, 4), style=st.sampled_from(ROPE_STYLES))
def test_context_parallel_ranks_reassemble_the_global_result(seed, cp_size, style):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, size=3) * 2 * cp_size  # global lengths, multiples of 2*cp_size
    H, D, R = 2, 8, 6
    x_global = random_magnitudes(rng, (int(lengths.sum()), H, D))
    cos, sin = (rng.standard_normal((64, R)).astype(np.float32) for _ in range(2))
    cu_global = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    want = rope(x_global, cos, sin, style=style, cu_seqlens=cu_global)
    got = np.empty_like(want)
    for rank in range(cp_size):
        rows = []
        for b, L in enumerate(lengths):
            chunk = L // (2 * cp_size)
            for c in (rank, 2 * cp_size - 1 - rank):
                rows.append(np.arange(cu_global[b] + c * chunk, cu_global[b] + (c + 1) * chunk))
        rows = np.concatenate(rows).astype(np.int64)
        cu_local = np.concatenate([[0], np.cumsum(lengths // cp_size)]).astype(np.int32)
        got[rows] = rope(x_global[rows], cos, sin, style=style, cu_seqlens=cu_local, cp_size=cp_size, cp_rank=rank)
    assert_bytes_equal(got, want, "cp reassembled")


# --------------------------------------------------------------------------------------------------
# Pass-through bytes, dtypes, NaN policy
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", [rope, rope_backward])
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
def test_pass_through_bytes_untouched(op, dtype):
    rng = np.random.default_rng(3)
    x = np.empty((6, 2, 12), dtype)
    # Arbitrary bit patterns, NaNs with payloads included, in the pass-through features.
    x.view(np.uint8)[...] = rng.integers(0, 256, size=x.view(np.uint8).shape, dtype=np.uint8)
    cos, sin = (rng.standard_normal((6, 4)).astype(np.float32) for _ in range(2))
    out = op(x, cos, sin, positions=np.arange(6))
    assert out.dtype == x.dtype
    assert_bytes_equal(out[..., :8], x[..., :8], "pass-through")


def test_out_dtype_rounds_once_from_fp32():
    rng = np.random.default_rng(4)
    x = random_magnitudes(rng, (9, 3, 10))
    cos, sin = (rng.standard_normal((9, 4)).astype(BF16) for _ in range(2))
    full = rope(x, cos, sin, positions=np.arange(9), out_dtype="float32")
    for name, dt in (("bfloat16", BF16), ("float16", np.float16)):
        out = rope(x, cos, sin, positions=np.arange(9), out_dtype=name)
        assert out.dtype == dt
        with np.errstate(over="ignore"):  # fp16 overflows to inf at these magnitudes, as the op does
            want = full.astype(dt)
        assert_bytes_equal(out, want, name)
    # A bf16 input widened to fp32 output: pass-through features exact.
    xb = x.astype(BF16)
    assert_bytes_equal(rope(xb, cos, sin, positions=np.arange(9), out_dtype="float32")[..., :6],
                       xb[..., :6].astype(np.float32))


@pytest.mark.parametrize("out_dtype,bits", [("float32", "0000c07f"), ("bfloat16", "c07f"), ("float16", "007e")])
def test_nan_results_are_canonical(out_dtype, bits):
    # inf*0 makes a NaN whose sign differs between x86 (negative) and CUDA; the spec writes +qNaN.
    x = np.array([[[np.inf, 1.0, -np.nan, 2.0]]], np.float32)
    cos = f32(0, 0, 1, 1).reshape(1, 4)
    sin = f32(0, 0, 0, 1).reshape(1, 4)
    # out = [inf*0 - 1*0, 1*0 + inf*0, -nan*1 - 2*0, 2*1 + -nan*1]: all NaN
    out = rope(x, cos, sin, style="interleaved", out_dtype=out_dtype)
    assert np.isnan(out.astype(np.float32)).all()
    assert {as_bytes(out[0, 0, i]).tobytes().hex() for i in range(4)} == {bits}


def test_special_values_follow_ieee():
    # Inf times a non-zero table value stays inf; an fp32 overflow of the sum gives inf; subnormal
    # products are kept (no flush to zero); -0 sign rules: RN(-0 - +0) = -0.
    big = np.float32(3e38)
    tiny = np.float32(2.0 ** -140)
    x = np.array([[[big, -big, tiny, tiny, -0.0, 0.0]]], np.float32)
    cos = f32(1, 0.5, 1, 1, 1, 1).reshape(1, 6)
    sin = f32(1, 0.5, 0, 0, 0, 0).reshape(1, 6)
    out = rope(x, cos, sin, style="interleaved")
    assert out[0, 0, 0] == np.inf  # 3e38 - (-3e38) overflows
    assert out[0, 0, 2] == tiny and out[0, 0, 3] == tiny
    assert as_bytes(out[0, 0, 4]).tobytes() == f32(-0.0).tobytes()


def test_deepseek_shape_matches_per_row_gathered_tables():
    # The fused MLA Q op passes cos/sin already gathered per token row with positions = arange(T).
    rng = np.random.default_rng(5)
    T, H, D, R = 256, 8, 192, 64
    x = random_magnitudes(rng, (T, H, D), BF16)
    cos_tab, sin_tab = (rng.standard_normal((4096, R)).astype(np.float32) for _ in range(2))
    cu = np.array([0, 100, 101, 256], np.int32)
    start = np.array([7, 3000, 0], np.int32)
    out = rope(x, cos_tab, sin_tab, cu_seqlens=cu, start_positions=start, out_dtype="float32")
    pos = np.concatenate([np.arange(100) + 7, [3000], np.arange(155)])
    gathered = rope(x, cos_tab[pos], sin_tab[pos], positions=np.arange(T), out_dtype="float32")
    assert_bytes_equal(out, gathered)


def test_spec_exports():
    assert spec.rope is rope and spec.VALIDATORS["rope"] is validate_rope
    assert spec.VALIDATORS["rope_backward"] is validate_rope_backward


# --------------------------------------------------------------------------------------------------
# One bad input per error; the message starts with the argument's name
# --------------------------------------------------------------------------------------------------
def _base():
    return dict(x=np.zeros((6, 2, 8), np.float32), cos=np.zeros((16, 4), np.float32),
                sin=np.zeros((16, 4), np.float32))


def _cu(*v):
    return np.array(v, np.int32)


BAD = [
    # (id, overrides, exception, argument name in the message)
    ("style", dict(style="gptj"), ValueError, "style"),
    ("layout", dict(layout="hsd"), ValueError, "layout"),
    ("x-dtype", dict(x=np.zeros((6, 2, 8), np.int64)), TypeError, "x"),
    ("x-ndim", dict(x=np.zeros((6, 8), np.float32)), ValueError, "x"),
    ("x-ndim-4d-layout", dict(layout="bshd"), ValueError, "x"),
    ("x-not-array", dict(x=[[[0.0] * 8]]), TypeError, "x"),
    ("out_dtype", dict(out_dtype="float64"), ValueError, "out_dtype"),
    ("cos-dtype", dict(cos=np.zeros((16, 4), np.float16), sin=np.zeros((16, 4), np.float16)), TypeError, "cos"),
    ("sin-dtype", dict(sin=np.zeros((16, 4), BF16)), TypeError, "sin"),
    ("cos-sin-shape", dict(sin=np.zeros((16, 6), np.float32)), ValueError, "cos and sin"),
    ("cos-ndim", dict(cos=np.zeros((16, 4, 1), np.float32)), ValueError, "cos"),
    ("rope_dim-odd", dict(cos=np.zeros((16, 3), np.float32), sin=np.zeros((16, 3), np.float32)), ValueError, "cos"),
    ("rope_dim-gt-D", dict(cos=np.zeros((16, 10), np.float32), sin=np.zeros((16, 10), np.float32)), ValueError, "cos"),
    ("cp_size-zero", dict(cp_size=0), ValueError, "cp_size"),
    ("cp_size-type", dict(cp_size=2.0), TypeError, "cp_size"),
    ("cp_rank-range", dict(cp_size=2, cp_rank=2), ValueError, "cp_rank"),
    ("cp_rank-negative", dict(cp_rank=-1), ValueError, "cp_rank"),
    ("cu_seqlens-dtype", dict(cu_seqlens=np.array([0, 6], np.int64)), TypeError, "cu_seqlens"),
    ("cu_seqlens-ndim", dict(cu_seqlens=np.array([[0, 6]], np.int32)), ValueError, "cu_seqlens"),
    ("cu_seqlens-short", dict(cu_seqlens=_cu(6)), ValueError, "cu_seqlens"),
    ("cu_seqlens-start", dict(cu_seqlens=_cu(1, 6)), ValueError, "cu_seqlens"),
    ("cu_seqlens-monotonic", dict(cu_seqlens=_cu(0, 4, 2, 6)), ValueError, "cu_seqlens"),
    ("cu_seqlens-end", dict(cu_seqlens=_cu(0, 2, 5)), ValueError, "cu_seqlens"),
    ("cu_seqlens-layout", dict(x=np.zeros((2, 3, 2, 8), np.float32), layout="bshd", cu_seqlens=_cu(0, 3, 6)),
     ValueError, "cu_seqlens"),
    ("cp-odd-local-length", dict(cu_seqlens=_cu(0, 3, 6), cp_size=2), ValueError, "cu_seqlens"),
    ("cp-odd-S", dict(x=np.zeros((3, 2, 2, 8), np.float32), layout="sbhd", cp_size=2), ValueError, "x"),
    ("cp-odd-T-no-cu", dict(x=np.zeros((5, 2, 8), np.float32), cp_size=2), ValueError, "x"),
    ("positions-dtype", dict(positions=np.zeros(6, np.float32)), TypeError, "positions"),
    ("positions-shape-thd", dict(positions=np.zeros(5, np.int32)), ValueError, "positions"),
    ("positions-shape-bshd", dict(x=np.zeros((2, 3, 2, 8), np.float32), layout="bshd",
                                  positions=np.zeros((3, 2), np.int32)), ValueError, "positions"),
    ("positions-too-large", dict(positions=np.array([0, 1, 2, 3, 4, 16], np.int32)), ValueError, "positions"),
    ("positions-negative", dict(positions=np.array([0, 1, 2, 3, 4, -1], np.int64)), ValueError, "positions"),
    ("positions-with-start", dict(positions=np.arange(6), start_positions=np.zeros(1, np.int32)), ValueError, "positions"),
    ("positions-with-cp", dict(positions=np.arange(6), cp_size=2), ValueError, "positions"),
    ("start_positions-dtype", dict(start_positions=np.zeros(1, np.float32)), TypeError, "start_positions"),
    ("start_positions-shape", dict(cu_seqlens=_cu(0, 2, 6), start_positions=np.zeros(3, np.int32)),
     ValueError, "start_positions"),
    ("start_positions-negative", dict(start_positions=np.array([-1], np.int32)), ValueError, "start_positions"),
    ("derived-position-out-of-table", dict(start_positions=np.array([11], np.int32)), ValueError, "cos"),
    ("cp-position-out-of-table", dict(cos=np.zeros((5, 4), np.float32), sin=np.zeros((5, 4), np.float32),
                                      cp_size=2, cp_rank=0), ValueError, "cos"),
]


@pytest.mark.parametrize("overrides,exc,name", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
@pytest.mark.parametrize("which", ["rope", "validate_rope", "rope_backward"])
def test_bad_argument(which, overrides, exc, name):
    kw = _base()
    kw.update(overrides)
    x = kw.pop("x")
    fn = {"rope": rope, "validate_rope": validate_rope, "rope_backward": rope_backward}[which]
    arg = "grad" if which == "rope_backward" and name == "x" else name
    with pytest.raises(exc, match=rf"^{arg}:"):
        fn(x, **kw)


def test_validator_reads_torch_tensors_the_same_way():
    torch = pytest.importorskip("torch")
    from backends.convert import to_torch

    kw = _base()
    args = to_torch([kw["x"], kw["cos"], kw["sin"]])
    validate_rope(*args, cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.int32), start_positions=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected non-decreasing"):
        validate_rope(*args, cu_seqlens=torch.tensor([0, 4, 2, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^positions: value 16 out of range"):
        validate_rope(*args, positions=torch.tensor([0, 1, 2, 3, 4, 16]))
    with pytest.raises(TypeError, match=r"^x: expected dtype"):
        validate_rope(args[0].double(), *args[1:])
