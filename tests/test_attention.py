"""spec.mla_attention / spec.mla_attention_backward (SEMANTICS.md section 8).

Checks the reference against hand-worked closed forms, a per-row loop reference, finite differences
and the analytic softmax Jacobian; layouts and varlen against each other; MXFP8 inputs against their
exact dequantized values; speed; and one bad input per validation error.
"""
from __future__ import annotations

import math
import re
import time

import ml_dtypes
import numpy as np
import pytest

import spec
from spec import attention as attn
from spec.mxtensor import MXTensor
from tests.util import BF16, F8E4M3, F8E5M2, assert_bytes_equal

D_QK, D_V = 192, 128
F64 = np.float64


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------

def random_qkv(rng, b, s_q, s_kv, h, layout="bshd", dtype=BF16):
    """Seeded q, k, v in `layout` with per-head magnitudes: q, k scaled by 1/4 .. 4 (soft to sharp
    softmax), v by 2^-8 .. 2^8 (attention is linear in v, so any binade must work)."""
    def make(s, d, mags):
        x = rng.standard_normal((b, s, h, d)) * mags[None, None, :, None]
        return to_layout(x, layout).astype(dtype)

    q = make(s_q, D_QK, rng.choice([0.25, 0.5, 1.0, 2.0, 4.0], size=h))
    k = make(s_kv, D_QK, rng.choice([0.25, 1.0, 2.0], size=h))
    v = make(s_kv, D_V, 2.0 ** rng.integers(-8, 9, size=h))
    return q, k, v


def to_layout(x_bshd, layout):
    if layout == "bshd":
        return np.ascontiguousarray(x_bshd)
    if layout == "sbhd":
        return np.ascontiguousarray(np.swapaxes(x_bshd, 0, 1))
    assert x_bshd.shape[0] == 1, "thd from bshd needs B = 1"
    return np.ascontiguousarray(x_bshd[0])


def f64(x):
    return np.asarray(x).astype(F64)


def naive_attention(q, k, v, causal, scale):
    """Per-row float64 loop on bshd arrays: the definition with no vectorisation tricks."""
    b, s_q, h, _ = q.shape
    s_kv = k.shape[1]
    o = np.zeros((b, s_q, h, D_V))
    lse = np.full((b, h, s_q), -np.inf)
    for bi in range(b):
        for hi in range(h):
            for i in range(s_q):
                keys = [j for j in range(s_kv) if not (causal and j > i + (s_kv - s_q))]
                if not keys:
                    continue
                s = np.array([np.dot(q[bi, i, hi], k[bi, j, hi]) * scale for j in keys])
                m = s.max()
                w = np.exp(s - m)
                o[bi, i, hi] = (w[:, None] * v[bi, keys, hi]).sum(axis=0) / w.sum()
                lse[bi, hi, i] = m + math.log(w.sum())
    return o, lse


def assert_bf16_of(actual_bf16, exact, what):
    """actual is exact rounded once to bf16: within half a bf16 ulp, i.e. 2^-8 relative for normals (8
    significant bits) and 2^-134 absolute for subnormals (half the smallest bf16 subnormal); the 1e-12
    slack covers float64 summation-order differences between two float64 paths."""
    a, e = f64(actual_bf16), f64(exact)
    bound = (2.0 ** -8 + 1e-12) * np.abs(e) + 2.0 ** -134
    bad = ~(np.abs(a - e) <= bound)
    assert not bad.any(), f"{what}: {bad.sum()} elements off; first {a[bad][:3]} vs {e[bad][:3]}"


def rel_fro(actual, exact):
    a, e = f64(actual), f64(exact)
    return float(np.linalg.norm(a - e) / np.linalg.norm(e))


def decode_mx(t: MXTensor) -> np.ndarray:
    """Test-side exact dequantize of compact scales, written independently of spec.quantize:
    every fp8 code and every 2^(e-127) (e in 1..254) is exact in float64, and so is their product."""
    codes = np.asarray(t.data).astype(F64)
    e = np.asarray(t.scale).astype(np.int64)
    factor = np.where(e == 255, np.nan, np.ldexp(1.0, e - 127))
    return codes * np.repeat(factor, 32, axis=t.axis)


def random_mx(rng, shape, axis, elem):
    """MXTensor with random finite codes; scale bytes put the largest value near 2 (e4m3: 448 * 2^-8,
    e5m2: 57344 * 2^-15) give or take 2^2, like real activations, and every value stays a bf16 normal."""
    dtype = F8E4M3 if elem == "e4m3" else F8E5M2
    codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
    data = codes.view(dtype)
    finite = np.isfinite(data.astype(np.float32))
    data = np.where(finite, data, dtype(1.5)).astype(dtype)  # replace NaN/Inf codes
    scale_shape = list(shape)
    scale_shape[axis] //= 32
    centre = 127 - (8 if elem == "e4m3" else 15)
    scale = rng.integers(centre - 2, centre + 3, size=scale_shape).astype(np.uint8)
    return MXTensor(data, scale, axis, elem)


# --------------------------------------------------------------------------------------------------
# Closed forms
# --------------------------------------------------------------------------------------------------

def two_token_case(rng):
    """q, k chosen so every score is a small hand-computed number with softmax_scale = 1:
    k0 = e0, k1 = e1 (plus nothing else), q0 = (1, 3, ...), q1 = (-0.5, 0.25, ...); the other q
    features are random but meet zeros in k, so scores are s00 = 1, s01 = 3, s10 = -0.5, s11 = 0.25."""
    q = rng.standard_normal((1, 2, 1, D_QK)).astype(BF16)
    q[0, 0, 0, :2] = [1.0, 3.0]
    q[0, 1, 0, :2] = [-0.5, 0.25]
    k = np.zeros((1, 2, 1, D_QK), dtype=BF16)
    k[0, 0, 0, 0] = 1.0
    k[0, 1, 0, 1] = 1.0
    v = (rng.standard_normal((1, 2, 1, D_V)) * 8).astype(BF16)
    return q, k, v, np.array([[1.0, 3.0], [-0.5, 0.25]])


def test_two_tokens_closed_form():
    rng = np.random.default_rng(1)
    q, k, v, s = two_token_case(rng)
    v64 = f64(v)[0, :, 0]
    o, lse = spec.mla_attention(q, k, v, softmax_scale=1.0)
    # Row i: p_i1 = 1 / (1 + exp(s_i0 - s_i1)), p_i0 = 1 - p_i1; lse_i = s_i1 + log(1 + exp(s_i0 - s_i1)).
    p1 = 1.0 / (1.0 + np.exp(s[:, 0] - s[:, 1]))
    p0 = 1.0 / (1.0 + np.exp(s[:, 1] - s[:, 0]))
    expect_o = p0[:, None] * v64[0] + p1[:, None] * v64[1]
    expect_lse = s[:, 1] + np.log1p(np.exp(s[:, 0] - s[:, 1]))
    assert o.dtype == BF16 and lse.dtype == np.float32 and lse.shape == (1, 1, 2)
    assert_bf16_of(o[0, :, 0], expect_o, "o")
    np.testing.assert_allclose(f64(lse[0, 0]), expect_lse, rtol=2.0 ** -24)  # one fp32 rounding

    # Causal, S_q = S_kv: query 0 sees key 0 only, so o0 = v0 exactly and lse0 = s00 = 1.
    o_c, lse_c = spec.mla_attention(q, k, v, causal=True, softmax_scale=1.0)
    assert_bytes_equal(o_c[0, 0, 0], v[0, 0, 0], "causal o0")
    assert lse_c[0, 0, 0] == np.float32(1.0)
    assert_bytes_equal(o_c[0, 1], o[0, 1], "causal row 1 sees both keys")

    # Backward for 2 keys: dS_i1 = p0 p1 (dP_i1 - dP_i0) = -dS_i0, dv_j = sum_i p_ij do_i,
    # dq_i = dS_i0 k0 + dS_i1 k1, dk_j = sum_i dS_ij q_i (scale 1).
    do = (rng.standard_normal((1, 2, 1, D_V)) * 2).astype(BF16)
    do64, o64 = f64(do)[0, :, 0], f64(o)[0, :, 0]
    dp = do64 @ v64.T
    d = (o64 * do64).sum(axis=1)  # D from the bf16 o, as the op defines it
    p = np.stack([p0, p1], axis=1)
    ds = p * (dp - d[:, None])
    dq, dk, dv = spec.mla_attention_backward(do, q, k, v, o, lse, softmax_scale=1.0)
    assert_bf16_of(dq[0, :, 0], ds @ f64(k)[0, :, 0], "dq")
    assert_bf16_of(dk[0, :, 0], ds.T @ f64(q)[0, :, 0], "dk")
    assert_bf16_of(dv[0, :, 0], p.T @ do64, "dv")
    # With exact o, D_i = sum_j p_ij dP_ij and so dS_i1 = p0 p1 (dP_i1 - dP_i0): the op's D from the
    # rounded o is within bf16 rounding of that.
    ds_exact1 = p0 * p1 * (dp[:, 1] - dp[:, 0])
    np.testing.assert_allclose(ds[:, 1], ds_exact1, atol=2.0 ** -7 * np.abs(do64).sum() * np.abs(v64).max())


def test_default_scale_is_inverse_sqrt_192():
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 1, 9, 9, 2)
    o_default, lse_default = spec.mla_attention(q, k, v)
    o_explicit, lse_explicit = spec.mla_attention(q, k, v, softmax_scale=1.0 / math.sqrt(192))
    assert_bytes_equal(o_default, o_explicit, "o")
    assert_bytes_equal(lse_default, lse_explicit, "lse")
    _, lse_one = spec.mla_attention(q, k, v, softmax_scale=1.0)
    assert not np.array_equal(lse_one, lse_default)


@pytest.mark.parametrize("s_q,s_kv", [(5, 5), (3, 7), (7, 3), (1, 6), (6, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_per_row_loop(s_q, s_kv, causal):
    """Bottom-right causal in both directions (S_q < S_kv and S_q > S_kv) against the per-row loop."""
    rng = np.random.default_rng(10 * s_q + s_kv)
    q, k, v = random_qkv(rng, 2, s_q, s_kv, 3)
    scale = 0.11
    exact_o, exact_lse = naive_attention(f64(q), f64(k), f64(v), causal, scale)
    o, lse = spec.mla_attention(q, k, v, causal=causal, softmax_scale=scale)
    assert_bf16_of(o, exact_o, "o")
    finite = np.isfinite(exact_lse)
    assert np.array_equal(np.isfinite(lse), finite) and np.all(lse[~finite] == -np.inf)
    np.testing.assert_allclose(f64(lse)[finite], exact_lse[finite], rtol=2.0 ** -24, atol=1e-30)
    # float64 core against the loop: summation order only (1e-12 relative).
    o64, lse64 = attn._forward_bhsd(*(attn._to_bhsd(f64(x), "bshd") for x in (q, k, v)), causal, scale)
    np.testing.assert_allclose(attn._from_bhsd(o64, "bshd"), exact_o, rtol=1e-12, atol=1e-300)


def test_causal_bottom_right_mask_pattern():
    """Which keys each query sees, read off the weights: every score is equal, so a row averages the
    keys it sees, and v_j = e_j (one-hot key index) makes o_i the weight vector of row i."""
    rng = np.random.default_rng(3)
    for s_q, s_kv in [(3, 5), (5, 3)]:
        q = np.zeros((1, s_q, 1, D_QK), dtype=BF16)
        q[..., -1] = 1.0
        k = np.zeros((1, s_kv, 1, D_QK), dtype=BF16)
        k[..., -1] = 1.0  # equal scores: each row averages the keys it sees
        v = np.zeros((1, s_kv, 1, D_V), dtype=BF16)
        v[0, :, 0, :s_kv] = np.eye(s_kv)  # one-hot key index in features 0..S_kv-1
        v[0, :, 0, 64:] = rng.standard_normal((s_kv, 64)).astype(BF16)
        o, lse = spec.mla_attention(q, k, v, causal=True)
        for i in range(s_q):
            visible = [j for j in range(s_kv) if j <= i + (s_kv - s_q)]
            weights = f64(o[0, i, 0, :s_kv])
            expect = np.zeros(s_kv)
            expect[visible] = 1.0 / len(visible) if visible else 0.0
            assert_bf16_of(weights, expect, f"row {i} of S_q={s_q}, S_kv={s_kv}")
            # Scores are all scale * 1, so lse = scale + log(#visible).
            want = (1 / math.sqrt(192) + math.log(len(visible))) if visible else -np.inf
            assert lse[0, 0, i] == np.float32(want)


def test_fully_masked_rows_give_zero_and_minus_inf():
    """Causal with S_q > S_kv: rows i < S_q - S_kv see no key. o must be +0 bytes and lse -inf even
    when v holds huge values, and the other rows are unaffected."""
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, 2, 6, 3, 2)
    v[0, 0, 0, :4] = [np.inf, -np.inf, np.nan, 3e38]
    o, lse = spec.mla_attention(q, k, v, causal=True)
    assert_bytes_equal(o[:, :3], np.zeros_like(o[:, :3]), "masked rows")
    assert np.all(lse[:, :, :3] == -np.inf)
    assert np.all(np.isfinite(lse[:, :, 3:])) and np.all(np.isfinite(f64(o[1, 3:])))
    # Backward: no gradient flows from masked rows (their P is 0, not NaN from -inf - -inf).
    do = rng.standard_normal((2, 6, 2, D_V)).astype(BF16)
    q2, k2, v2 = random_qkv(rng, 2, 6, 3, 2)
    o2, lse2 = spec.mla_attention(q2, k2, v2, causal=True)
    dq, dk, dv = spec.mla_attention_backward(do, q2, k2, v2, o2, lse2, causal=True)
    assert_bytes_equal(dq[:, :3], np.zeros_like(dq[:, :3]), "dq of masked rows")
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(f64(g)))


def test_special_values():
    """Equal huge scores (the max shift must prevent exp overflow), a zero query row (uniform weights),
    NaN in one query row (only that row turns NaN), bf16 subnormals in v."""
    rng = np.random.default_rng(5)
    s_kv = 7
    q = (rng.standard_normal((1, 3, 1, D_QK))).astype(BF16)
    k = np.repeat(rng.standard_normal((1, 1, 1, D_QK)), s_kv, axis=1).astype(BF16)  # identical keys
    q[0, 0] = (f64(k[0, 0]) * 64).astype(BF16)  # score ~ 64 * |k|^2 / sqrt(192), e^score overflows
    q[0, 1] = 0.0
    q[0, 2, 0, 5] = np.nan
    tiny = float(ml_dtypes.finfo(BF16).smallest_subnormal)
    v = (rng.standard_normal((1, s_kv, 1, D_V)) * 4).astype(BF16)
    v[0, :, 0, -4:] = (rng.integers(1, 8, size=(s_kv, 4)) * tiny).astype(BF16)
    o, lse = spec.mla_attention(q, k, v)
    mean_v = f64(v)[0, :, 0].mean(axis=0)  # identical scores -> uniform weights
    score = np.dot(f64(q[0, 0, 0]), f64(k[0, 0, 0])) / math.sqrt(192)
    assert score > 710  # exp(score) overflows float64 (max ~ e^709.8) without the shift
    assert_bf16_of(o[0, 0, 0], mean_v, "huge equal scores")
    np.testing.assert_allclose(f64(lse[0, 0, 0]), score + math.log(s_kv), rtol=2.0 ** -24)
    assert_bf16_of(o[0, 1, 0], mean_v, "zero query")
    assert lse[0, 0, 1] == np.float32(math.log(s_kv))
    assert np.all(np.isnan(f64(o[0, 2]))) and np.isnan(lse[0, 0, 2])


# --------------------------------------------------------------------------------------------------
# Layouts and varlen
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_thd_varlen_equals_per_sequence_bshd(causal):
    """Each packed sequence equals the same sequence run alone in bshd (byte-identical: the same
    float64 core runs on the same [1, H, S, D] data). Includes a sequence with no queries, one with
    no keys (its rows are fully masked), and S_q != S_kv."""
    rng = np.random.default_rng(6)
    h = 3
    len_q = [9, 0, 4, 13, 5]
    len_kv = [9, 6, 0, 20, 2]
    cu_q = np.concatenate([[0], np.cumsum(len_q)]).astype(np.int32)
    cu_kv = np.concatenate([[0], np.cumsum(len_kv)]).astype(np.int32)
    q = (rng.standard_normal((cu_q[-1], h, D_QK)) * 2).astype(BF16)
    k = rng.standard_normal((cu_kv[-1], h, D_QK)).astype(BF16)
    v = (rng.standard_normal((cu_kv[-1], h, D_V)) * 0.01).astype(BF16)
    do = rng.standard_normal((cu_q[-1], h, D_V)).astype(BF16)
    kw = dict(causal=causal, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    o, lse = spec.mla_attention(q, k, v, **kw)
    assert o.shape == (cu_q[-1], h, D_V) and lse.shape == (h, cu_q[-1])
    dq, dk, dv = spec.mla_attention_backward(do, q, k, v, o, lse, **kw)
    for b in range(len(len_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_kv[b], cu_kv[b + 1])
        o_b, lse_b = spec.mla_attention(q[None, qs], k[None, ks], v[None, ks], causal=causal)
        assert_bytes_equal(o[qs], o_b[0], f"o of sequence {b}")
        assert_bytes_equal(lse[:, qs], lse_b[0], f"lse of sequence {b}")
        g_b = spec.mla_attention_backward(do[None, qs], q[None, qs], k[None, ks], v[None, ks], o_b, lse_b,
                                          causal=causal)
        for name, g, sl, gb in (("dq", dq, qs, g_b[0]), ("dk", dk, ks, g_b[1]), ("dv", dv, ks, g_b[2])):
            assert_bytes_equal(g[sl], gb[0], f"{name} of sequence {b}")
    # Sequence 2 has queries but no keys.
    assert np.all(lse[:, cu_q[2]:cu_q[3]] == -np.inf)
    assert_bytes_equal(o[cu_q[2]:cu_q[3]], np.zeros((len_q[2], h, D_V), BF16), "no-key rows")


@pytest.mark.parametrize("causal", [False, True])
def test_layouts_agree(causal):
    """bshd, sbhd and thd (equal-length sequences) give the same bytes, forward and backward."""
    rng = np.random.default_rng(7)
    b, s_q, s_kv, h = 2, 11, 14, 3
    q, k, v = random_qkv(rng, b, s_q, s_kv, h)
    do = (rng.standard_normal((b, s_q, h, D_V)) * 0.5).astype(BF16)
    o, lse = spec.mla_attention(q, k, v, causal=causal)
    grads = spec.mla_attention_backward(do, q, k, v, o, lse, causal=causal)

    sb = lambda x: np.ascontiguousarray(np.swapaxes(x, 0, 1))
    o_s, lse_s = spec.mla_attention(sb(q), sb(k), sb(v), causal=causal, layout="sbhd")
    assert_bytes_equal(o_s, sb(o), "sbhd o")
    assert_bytes_equal(lse_s, lse, "sbhd lse")
    grads_s = spec.mla_attention_backward(sb(do), sb(q), sb(k), sb(v), o_s, lse_s, causal=causal, layout="sbhd")
    for g, gs in zip(grads, grads_s):
        assert_bytes_equal(gs, sb(g), "sbhd grad")

    th = lambda x: np.ascontiguousarray(x.reshape(-1, *x.shape[2:]))
    cu_q = np.arange(0, b * s_q + 1, s_q, dtype=np.int32)
    cu_kv = np.arange(0, b * s_kv + 1, s_kv, dtype=np.int32)
    kw = dict(causal=causal, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    o_t, lse_t = spec.mla_attention(th(q), th(k), th(v), **kw)
    assert_bytes_equal(o_t, th(o), "thd o")
    # thd lse is [H, T_q]: the [B, H, S_q] array with batch folded into tokens.
    assert_bytes_equal(lse_t, np.ascontiguousarray(np.transpose(lse, (1, 0, 2)).reshape(h, -1)), "thd lse")
    grads_t = spec.mla_attention_backward(th(do), th(q), th(k), th(v), o_t, lse_t, **kw)
    for g, gt in zip(grads, grads_t):
        assert_bytes_equal(gt, th(g), "thd grad")


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_backward_finite_differences(causal):
    """Float64 core backward against central differences of L = sum(o * do) on a tiny case.

    h = 1e-5: truncation error ~ h^2 |L'''| ~ 1e-10 and cancellation error ~ eps |L| / h ~ 1e-11 for
    |L| ~ 10, so 1e-7 absolute + 1e-6 relative is ample while any formula error (O(|grad|)) fails."""
    rng = np.random.default_rng(8)
    b, s_q, s_kv, h = 1, 3, 4, 2
    scale = 0.2
    q = rng.standard_normal((b, h, s_q, D_QK))
    k = rng.standard_normal((b, h, s_kv, D_QK))
    v = rng.standard_normal((b, h, s_kv, D_V)) * 3
    do = rng.standard_normal((b, h, s_q, D_V))
    o, lse = attn._forward_bhsd(q, k, v, causal, scale)
    grads = attn._backward_bhsd(do, q, k, v, o, lse, causal, scale)

    def loss(qq, kk, vv):
        return float(np.sum(attn._forward_bhsd(qq, kk, vv, causal, scale)[0] * do))

    step = 1e-5
    inputs = [q, k, v]
    for which, grad in enumerate(grads):
        x = inputs[which]
        flat_idx = rng.choice(x.size, size=40, replace=False)  # 40 coordinates per input keeps it fast
        for fi in flat_idx:
            idx = np.unravel_index(fi, x.shape)
            plus = [a.copy() for a in inputs]
            minus = [a.copy() for a in inputs]
            plus[which][idx] += step
            minus[which][idx] -= step
            numeric = (loss(*plus) - loss(*minus)) / (2 * step)
            assert abs(grad[idx] - numeric) <= 1e-7 + 1e-6 * abs(numeric), (which, idx, grad[idx], numeric)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_analytic_jacobian(causal):
    """dS = J^T dP with the softmax Jacobian J = diag(p) - p p^T built explicitly per row, against the
    op's dS = P * (dP - rowsum(o * do)) (they agree for the exact o; 1e-10 relative covers float64
    summation order). The public op, fed bf16 o and fp32 lse, is within 1e-2 relative Frobenius of
    this exact gradient: D = rowsum(o * do) uses the bf16-rounded o (2^-9 relative) and cancels
    against dP, and each gradient is rounded to bf16."""
    rng = np.random.default_rng(9)
    b, s_q, s_kv, h = 2, 5, 6, 2
    scale = 1 / math.sqrt(192)
    q, k, v = random_qkv(rng, b, s_q, s_kv, h)
    do = (rng.standard_normal((b, s_q, h, D_V))).astype(BF16)
    qb, kb, vb, dob = (attn._to_bhsd(f64(x), "bshd") for x in (q, k, v, do))
    s = np.einsum("bhqd,bhkd->bhqk", qb, kb) * scale
    if causal:
        s = np.where(attn._causal_mask(s_q, s_kv), -np.inf, s)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    jac = np.einsum("bhqk,kl->bhqkl", p, np.eye(s_kv)) - np.einsum("bhqk,bhql->bhqkl", p, p)
    dp = np.einsum("bhqe,bhke->bhqk", dob, vb)
    ds = np.einsum("bhqkl,bhqk->bhql", jac, dp)
    exact = (np.einsum("bhqk,bhkd->bhqd", ds, kb) * scale,
             np.einsum("bhqk,bhqd->bhkd", ds, qb) * scale,
             np.einsum("bhqk,bhqe->bhke", p, dob))
    o64, lse64 = attn._forward_bhsd(qb, kb, vb, causal, scale)
    core = attn._backward_bhsd(dob, qb, kb, vb, o64, lse64, causal, scale)
    for g, e in zip(core, exact):
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-10 * np.abs(e).max())

    o, lse = spec.mla_attention(q, k, v, causal=causal)
    public = spec.mla_attention_backward(do, q, k, v, o, lse, causal=causal)
    for g, e, name in zip(public, exact, ("dq", "dk", "dv")):
        assert g.dtype == BF16
        assert rel_fro(g, attn._from_bhsd(e, "bshd")) <= 1e-2, name


# --------------------------------------------------------------------------------------------------
# MXFP8 inputs
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("layout", ["bshd", "sbhd", "thd"])
def test_mxfp8_inputs_equal_dequantized_bf16(elem, layout):
    """MXFP8 q, k (blocked along D) and v (blocked along S) give the same bytes as bf16 inputs holding
    their exactly dequantized values (all bf16-representable: <= 3 mantissa bits, normal range)."""
    rng = np.random.default_rng(11)
    b, s, h = (1, 64, 2) if layout == "thd" else (2, 32, 2)
    shape_q = {"bshd": (b, s, h, D_QK), "sbhd": (s, b, h, D_QK), "thd": (s, h, D_QK)}[layout]
    shape_v = shape_q[:-1] + (D_V,)
    q_mx = random_mx(rng, shape_q, len(shape_q) - 1, elem)
    k_mx = random_mx(rng, shape_q, len(shape_q) - 1, elem)
    v_mx = random_mx(rng, shape_v, attn.SEQ_AXIS[layout], elem)
    plain = []
    for t in (q_mx, k_mx, v_mx):
        x = decode_mx(t)
        xb = x.astype(BF16)
        assert np.array_equal(f64(xb), x), "test data must be exact in bf16"
        plain.append(xb)
    kw = dict(causal=True, layout=layout)
    if layout == "thd":
        cu = np.array([0, 20, 64], dtype=np.int32)
        kw.update(cu_seqlens_q=cu, cu_seqlens_kv=cu)
    o_mx, lse_mx = spec.mla_attention(q_mx, k_mx, v_mx, **kw)
    o_bf, lse_bf = spec.mla_attention(*plain, **kw)
    assert_bytes_equal(o_mx, o_bf, "o")
    assert_bytes_equal(lse_mx, lse_bf, "lse")
    do = rng.standard_normal(shape_v).astype(BF16)
    g_mx = spec.mla_attention_backward(do, q_mx, k_mx, v_mx, o_mx, lse_mx, **kw)
    g_bf = spec.mla_attention_backward(do, *plain, o_bf, lse_bf, **kw)
    for a, e in zip(g_mx, g_bf):
        assert_bytes_equal(a, e, "gradient w.r.t. dequantized values")
    # Mixed MXFP8 / bf16 operands are allowed and mean the same values.
    o_mixed, _ = spec.mla_attention(q_mx, plain[1], v_mx, **kw)
    assert_bytes_equal(o_mixed, o_bf, "mixed operands")


def test_mxfp8_quantized_and_swizzled_inputs():
    """Operands from spec.mxfp8_quantize (compact and swizzled scales) mean their dequantized values;
    a NaN scale byte (255) in v makes that block's feature NaN in every row, and nothing else."""
    rng = np.random.default_rng(12)
    q, k, v = random_qkv(rng, 1, 64, 64, 2)
    q_mx = spec.mxfp8_quantize(q, axis=-1)
    k_mx = spec.mxfp8_quantize(k, axis=-1, scale_layout="swizzled")
    v_mx = spec.mxfp8_quantize(v, axis=1)
    plain = [decode_mx(spec.unswizzle_scales(t)).astype(np.float32) for t in (q_mx, k_mx, v_mx)]
    o_mx, lse_mx = spec.mla_attention(q_mx, k_mx, v_mx)
    o_f32, lse_f32 = spec.mla_attention(*plain)
    assert_bytes_equal(o_mx, o_f32, "o")
    assert_bytes_equal(lse_mx, lse_f32, "lse")

    scale = np.array(v_mx.scale)
    scale[0, 1, 1, 0] = 255  # keys 32..63 of head 1, feature 0
    o_nan, lse_nan = spec.mla_attention(q_mx, k_mx, v_mx.replace(scale=scale))
    nan = np.isnan(f64(o_nan))
    assert nan[0, :, 1, 0].all() and nan.sum() == 64
    assert_bytes_equal(lse_nan, lse_mx, "lse does not depend on v")


# --------------------------------------------------------------------------------------------------
# Speed
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_forward_speed(causal):
    """[1, 512, 8, 192] bf16 forward must take < 5 s on the 2-core CI machine."""
    rng = np.random.default_rng(13)
    q, k, v = random_qkv(rng, 1, 512, 512, 8)
    start = time.perf_counter()
    spec.mla_attention(q, k, v, causal=causal)
    assert time.perf_counter() - start < 5.0


# --------------------------------------------------------------------------------------------------
# Validation: one bad input per error
# --------------------------------------------------------------------------------------------------

def _good(layout="bshd"):
    rng = np.random.default_rng(14)
    if layout == "thd":
        q = rng.standard_normal((40, 2, D_QK)).astype(BF16)
        k = rng.standard_normal((64, 2, D_QK)).astype(BF16)
        v = rng.standard_normal((64, 2, D_V)).astype(BF16)
        cu_q = np.array([0, 10, 40], dtype=np.int32)
        cu_kv = np.array([0, 30, 64], dtype=np.int32)
        return dict(q=q, k=k, v=v, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    q, k, v = random_qkv(rng, 2, 32, 64, 2)
    return dict(q=q, k=k, v=v, layout="bshd")


def _mx(x, axis):
    return spec.mxfp8_quantize(x, axis=axis)


FORWARD_ERRORS = [
    # (name, layout, changes, exception, message start)
    ("layout", "bshd", lambda a: {"layout": "bhsd"}, ValueError, "layout:"),
    ("causal", "bshd", lambda a: {"causal": "yes"}, TypeError, "causal:"),
    ("scale type", "bshd", lambda a: {"softmax_scale": "0.1"}, TypeError, "softmax_scale:"),
    ("scale value", "bshd", lambda a: {"softmax_scale": -0.1}, ValueError, "softmax_scale:"),
    ("scale nan", "bshd", lambda a: {"softmax_scale": float("nan")}, ValueError, "softmax_scale:"),
    ("q not array", "bshd", lambda a: {"q": a["q"].tolist()}, TypeError, "q:"),
    ("q dtype", "bshd", lambda a: {"q": a["q"].astype(np.int32)}, TypeError, "q:"),
    ("q ndim", "bshd", lambda a: {"q": a["q"][0]}, ValueError, "q:"),
    ("q head dim", "bshd", lambda a: {"q": a["q"][..., :128]}, ValueError, "q:"),
    ("k head dim", "bshd", lambda a: {"k": a["k"][..., :160]}, ValueError, "k:"),
    ("v head dim", "bshd", lambda a: {"v": np.concatenate([a["v"], a["v"]], axis=-1)}, ValueError, "v:"),
    ("mixed dtypes", "bshd", lambda a: {"k": a["k"].astype(np.float32)}, TypeError, "q, k, v:"),
    ("heads", "bshd", lambda a: {"k": a["k"][:, :, :1], "v": a["v"][:, :, :1]}, ValueError, "q, k, v:"),
    ("k/v length", "bshd", lambda a: {"v": a["v"][:, :32]}, ValueError, "k and v:"),
    ("batch", "bshd", lambda a: {"k": a["k"][:1], "v": a["v"][:1]}, ValueError, "q and k:"),
    ("q blocked on S", "bshd", lambda a: {"q": _mx(a["q"], 1)}, ValueError, "q:"),
    ("k blocked on S", "bshd", lambda a: {"k": _mx(a["k"], 1)}, ValueError, "k:"),
    ("v blocked on D", "bshd", lambda a: {"v": _mx(a["v"], 3)}, ValueError, "v:"),
    ("mx data dtype", "bshd",
     lambda a: {"q": _mx(a["q"], 3).replace(elem="e5m2")}, TypeError, "q:"),
    ("mx scale dtype", "bshd",
     lambda a: {"v": (lambda t: t.replace(scale=t.scale.astype(np.int8)))(_mx(a["v"], 1))}, TypeError, "v:"),
    ("cu_seqlens for bshd", "bshd", lambda a: {"cu_seqlens_q": np.array([0, 32], np.int32)}, ValueError,
     "cu_seqlens_q:"),
    ("thd without cu_seqlens_q", "thd", lambda a: {"cu_seqlens_q": None}, ValueError, "cu_seqlens_q:"),
    ("thd without cu_seqlens_kv", "thd", lambda a: {"cu_seqlens_kv": None}, ValueError, "cu_seqlens_kv:"),
    ("cu dtype", "thd", lambda a: {"cu_seqlens_q": a["cu_seqlens_q"].astype(np.int64)}, TypeError,
     "cu_seqlens_q:"),
    ("cu shape", "thd", lambda a: {"cu_seqlens_q": a["cu_seqlens_q"][None]}, ValueError, "cu_seqlens_q:"),
    ("cu start", "thd", lambda a: {"cu_seqlens_q": np.array([2, 10, 40], np.int32)}, ValueError,
     "cu_seqlens_q:"),
    ("cu decreasing", "thd", lambda a: {"cu_seqlens_kv": np.array([0, 50, 30, 64], np.int32)}, ValueError,
     "cu_seqlens_kv:"),
    ("cu end", "thd", lambda a: {"cu_seqlens_q": np.array([0, 10, 39], np.int32)}, ValueError,
     "cu_seqlens_q:"),
    ("cu batches differ", "thd", lambda a: {"cu_seqlens_kv": np.array([0, 10, 30, 64], np.int32)}, ValueError,
     "cu_seqlens_kv:"),
    ("thd ndim", "thd", lambda a: {"q": a["q"][None]}, ValueError, "q:"),
]


@pytest.mark.parametrize("case", FORWARD_ERRORS, ids=[c[0] for c in FORWARD_ERRORS])
def test_forward_rejects(case):
    _, layout, change, exc, prefix = case
    args = _good(layout)
    args.update(change(args))
    with pytest.raises(exc, match="^" + re.escape(prefix)):
        spec.validate_mla_attention(**args)
    with pytest.raises(exc, match="^" + re.escape(prefix)):
        spec.mla_attention(**args)


def _good_backward():
    args = _good()
    o, lse = spec.mla_attention(**args)
    do = np.random.default_rng(15).standard_normal(o.shape).astype(BF16)
    return dict(do=do, o=o, lse=lse, **args)


BACKWARD_ERRORS = [
    ("o MXTensor", lambda a: {"o": _mx(a["o"], 3)}, TypeError, "o:"),
    ("o shape", lambda a: {"o": a["o"][:, :16]}, ValueError, "o:"),
    ("o head dim", lambda a: {"o": a["q"]}, ValueError, "o:"),
    ("do dtype", lambda a: {"do": a["do"].astype(np.int16)}, TypeError, "do:"),
    ("lse dtype", lambda a: {"lse": a["lse"].astype(BF16)}, TypeError, "lse:"),
    ("lse shape", lambda a: {"lse": np.ascontiguousarray(np.swapaxes(a["lse"], 1, 2))}, ValueError, "lse:"),
    ("q head dim", lambda a: {"q": a["q"][..., :128]}, ValueError, "q:"),
]


@pytest.mark.parametrize("case", BACKWARD_ERRORS, ids=[c[0] for c in BACKWARD_ERRORS])
def test_backward_rejects(case):
    _, change, exc, prefix = case
    args = _good_backward()
    args.update(change(args))
    with pytest.raises(exc, match="^" + re.escape(prefix)):
        spec.validate_mla_attention_backward(**args)
    with pytest.raises(exc, match="^" + re.escape(prefix)):
        spec.mla_attention_backward(**args)
