"""spec.mla_q: the fused MLA Q up-projection + RoPE + MXFP8 quantize and its backward.

- closed forms on exact-arithmetic inputs (one nonzero per row of x, powers of two, cos/sin in {0, +-1}:
  every intermediate is exact and e4m3-representable, so the quantized output is known exactly);
- byte equality with the unfused composition GEMM -> bf16 -> spec.rope -> spec.quantize (the GEMM from
  spec.mxfp8_gemm for MXFP8 operands, from tests.test_gemm's big-integer oracle for bf16 ones);
- backward against the unfused composition, an exact transposition (adjoint) check, and a float64 bound;
- one bad-input test per validation error.
"""
from __future__ import annotations

import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spec.gemm import exact_matmul_rounded, mxfp8_gemm
from spec.mla_q import (
    mla_q_uproj_rope_quant,
    mla_q_uproj_rope_quant_backward,
    validate_mla_q_uproj_rope_quant_backward,
)
from spec.mxtensor import MXTensor
from spec.quantize import mxfp8_dequantize, mxfp8_quantize
from spec.rope import rope, rope_backward
from tests.test_gemm import oracle_matmul
from tests.util import BF16, F8E4M3, assert_bytes_equal

D, NOPE, ROPE, HALF = 192, 128, 64, 32


def assert_mx_equal(got: MXTensor, want: MXTensor, what: str) -> None:
    assert (got.axis, got.elem, got.scale_layout) == (want.axis, want.elem, want.scale_layout), what
    assert_bytes_equal(got.data, want.data, what + " data")
    assert_bytes_equal(got.scale, want.scale, what + " scale")


def mx_rowwise(values: np.ndarray, scale_exp: np.ndarray) -> MXTensor:
    """MXTensor blocked along axis 1 with codes `values` and per-row scale 2^scale_exp."""
    codes = values.astype(F8E4M3)
    assert np.array_equal(codes.astype(np.float64), values)
    scale = np.repeat((127 + scale_exp)[:, None], values.shape[1] // 32, axis=1).astype(np.uint8)
    return MXTensor(codes, scale, 1, "e4m3")


# ------------------------------------------------------------------------------------------------
# exact-arithmetic inputs and their closed form


def exact_case(rng, tokens=64, k=256, heads=2):
    """x: one nonzero per row (1 or 2) at column sel[t]; w: entries in {0, +-1, +-2} times 2^hexp[h]
    (hexp per head); cos/sin in {0, +-1} with independently drawn halves. The projection q[t, n] =
    x[t, sel[t]] * w[n, sel[t]] is a power of two or 0; RoPE sums two of them: <= 3 significant bits."""
    sel = rng.integers(0, k, size=tokens)
    xs = rng.choice([1.0, 2.0], size=tokens)
    x = np.zeros((tokens, k))
    x[np.arange(tokens), sel] = xs
    hexp = rng.integers(-3, 3, size=heads)
    w = rng.choice([0.0, 1.0, -1.0, 2.0, -2.0], size=(heads * D, k)) * np.repeat(2.0 ** hexp, D)[:, None]
    cos = rng.choice([0.0, 1.0, -1.0], size=(tokens, ROPE))
    sin = rng.choice([0.0, 1.0, -1.0], size=(tokens, ROPE))
    return x, w, cos, sin, xs, sel, hexp


def closed_form_q(x, w, cos, sin):
    """float64 q [T, H, 192] after mla RoPE, written out from SEMANTICS 4 (exact for exact_case)."""
    tokens, heads = x.shape[0], w.shape[0] // D
    q = (x @ w.T).reshape(tokens, heads, D)
    r = q[..., NOPE:]
    even, odd = r[..., 0::2], r[..., 1::2]  # x[2k], x[2k+1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = q.copy()
    out[..., NOPE:NOPE + HALF] = even * c[..., :HALF] - odd * s[..., :HALF]
    out[..., NOPE + HALF:] = odd * c[..., HALF:] + even * s[..., HALF:]
    return out


def rceil_byte(amax: float) -> int:
    """Smallest e with amax <= 448 * 2^(e-127) (the bf16-exact form of SEMANTICS 1.1); 0 for amax 0."""
    if amax == 0:
        return 0
    e = 127 + math.ceil(math.log2(amax / 448.0)) - 1
    while amax > 448.0 * 2.0 ** (e - 127):
        e += 1
    return e


def check_against_closed_form(q_row, q_col, want):
    tokens, heads, _ = want.shape
    row_amax = np.abs(want).reshape(tokens, heads, D // 32, 32).max(axis=-1)
    col_amax = np.abs(want).reshape(tokens // 32, 32, heads, D).max(axis=1)
    assert_bytes_equal(q_row.scale, np.vectorize(rceil_byte)(row_amax).astype(np.uint8), "row scales")
    assert_bytes_equal(q_col.scale, np.vectorize(rceil_byte)(col_amax).astype(np.uint8), "col scales")
    # every value is representable: dequantizing gives it back exactly
    assert_bytes_equal(mxfp8_dequantize(q_row), want.astype(np.float32), "row values")
    assert_bytes_equal(mxfp8_dequantize(q_col), want.astype(np.float32), "col values")


@pytest.mark.parametrize("tables", ["float32", "bfloat16"])
def test_bf16_projection_closed_form(tables):
    rng = np.random.default_rng(10)
    x, w, cos, sin, *_ = exact_case(rng)
    want = closed_form_q(x, w, cos, sin)
    assert np.abs(want).max() > 0 and (want[..., NOPE:] != 0).any()
    q_row, q_col = mla_q_uproj_rope_quant(x.astype(BF16), w.astype(BF16), cos.astype(tables), sin.astype(tables))
    assert q_row.shape == q_col.shape == (64, 2, D)
    assert (q_row.axis, q_col.axis) == (2, 0)
    assert q_row.scale.shape == (64, 2, 6) and q_col.scale.shape == (2, 2, D)
    assert str(q_row.data.dtype) == "float8_e4m3fn" and q_row.scale_layout == "compact"
    check_against_closed_form(q_row, q_col, want)


def test_mxfp8_projection_closed_form():
    rng = np.random.default_rng(11)
    x, w, cos, sin, xs, sel, hexp = exact_case(rng)
    # x codes 1 or 2 at scale 2^0; w codes in {0, +-1, +-2} with the head's scale 2^hexp
    x_mx = mx_rowwise(x, np.zeros(x.shape[0], dtype=np.int64))
    w_mx = mx_rowwise(w / np.repeat(2.0 ** hexp, D)[:, None], np.repeat(hexp, D))
    q_row, q_col = mla_q_uproj_rope_quant(x_mx, w_mx, cos.astype(np.float32), sin.astype(np.float32))
    check_against_closed_form(q_row, q_col, closed_form_q(x, w, cos, sin))


def test_rope_uses_each_half_of_the_tables():
    # one token, one pair: x[128] = 1 (even), x[129] = 0. With c = 0 and s = 1 on the left half only,
    # out[128] = 1*c[0] - 0 = 0 and out[160] = 0*c[32] + 1*s[32]: a swapped-halves kernel would differ.
    x = np.zeros((32, 32))
    x[:, 0] = 1.0
    w = np.zeros((D, 32))
    w[NOPE, 0] = 1.0
    cos = np.zeros((32, ROPE), np.float32)
    sin = np.zeros((32, ROPE), np.float32)
    cos[:, 0], sin[:, 0] = 0.0, 1.0  # left half: c[0] = 0, s[0] = 1
    cos[:, HALF], sin[:, HALF] = 1.0, 0.5  # right half: c[32] = 1, s[32] = 0.5
    q_row, _ = mla_q_uproj_rope_quant(x.astype(BF16), w.astype(BF16), cos, sin)
    q = mxfp8_dequantize(q_row)[0, 0]
    assert q[NOPE] == 0.0 and q[NOPE + HALF] == 0.5
    assert np.count_nonzero(q) == 1


# ------------------------------------------------------------------------------------------------
# fused == unfused composition, byte for byte


def tables(rng, tokens, dtype=np.float32):
    angle = rng.uniform(-4, 4, size=(tokens, ROPE))
    angle[:, HALF:] *= 1.37  # halves differ: a kernel reading the wrong half is caught
    return np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)


def composed_forward(x, w, cos, sin, gemm="oracle"):
    tokens, heads = x.shape[0], w.shape[0] // D
    if isinstance(x, MXTensor):
        acc = mxfp8_gemm(x, w, "float32")
    elif gemm == "oracle":
        acc = oracle_matmul(x.astype(np.float64), w.astype(np.float64), "float32")
    else:
        acc = exact_matmul_rounded(x.astype(np.float64), w.astype(np.float64), "float32", 8, 8)
    q = acc.astype(BF16).reshape(tokens, heads, D)
    q32 = rope(q, cos, sin, style="mla", layout="thd", positions=np.arange(tokens), out_dtype="float32")
    assert q32.dtype == np.float32
    return mxfp8_quantize(q32, axis=-1), mxfp8_quantize(q32, axis=0)


def random_operands(rng, tokens, k, heads, mx: bool, spread: int = 4):
    x = rng.standard_normal((tokens, k)) * 2.0 ** rng.integers(-spread, spread + 1, size=(tokens, 1))
    w = rng.standard_normal((heads * D, k)) * 2.0 ** rng.integers(-spread, spread + 1, size=(1, k)) / 16
    x, w = x.astype(BF16), w.astype(BF16)
    return (mxfp8_quantize(x), mxfp8_quantize(w)) if mx else (x, w)


@pytest.mark.parametrize("mx", [False, True], ids=["bf16", "mxfp8"])
def test_fused_equals_composition_oracle_gemm(mx):
    rng = np.random.default_rng(12)
    x, w = random_operands(rng, 32, 64, 2, mx)
    cos, sin = tables(rng, 32)
    got = mla_q_uproj_rope_quant(x, w, cos, sin)
    want = composed_forward(x, w, cos, sin, "oracle")
    assert_mx_equal(got[0], want[0], "q_row")
    assert_mx_equal(got[1], want[1], "q_col")


@settings(max_examples=12, deadline=None)
@given(st.sampled_from([32, 64]), st.sampled_from([32, 96]), st.integers(1, 3), st.booleans(),
       st.sampled_from([np.float32, BF16]), st.integers(0, 12), st.integers(0, 2 ** 32 - 1))
def test_property_fused_equals_composition(tokens, k, heads, mx, table_dtype, spread, seed):
    rng = np.random.default_rng(seed)
    x, w = random_operands(rng, tokens, k, heads, mx, spread)
    cos, sin = tables(rng, tokens, table_dtype)
    got = mla_q_uproj_rope_quant(x, w, cos, sin)
    want = composed_forward(x, w, cos, sin, "exact")
    assert_mx_equal(got[0], want[0], "q_row")
    assert_mx_equal(got[1], want[1], "q_col")


def test_deepseek_sized_scaled():
    # K = q_lora_rank 1536, 8 of the 128 heads, 64 tokens
    rng = np.random.default_rng(13)
    x, w = random_operands(rng, 64, 1536, 8, mx=False, spread=2)
    cos, sin = tables(rng, 64, BF16)
    start = time.perf_counter()
    got = mla_q_uproj_rope_quant(x, w, cos, sin)
    elapsed = time.perf_counter() - start
    want = composed_forward(x, w, cos, sin, "exact")
    assert_mx_equal(got[0], want[0], "q_row")
    assert_mx_equal(got[1], want[1], "q_col")
    assert got[0].scale.shape == (64, 8, 6) and got[1].scale.shape == (2, 8, D)
    assert elapsed < 10, elapsed


# ------------------------------------------------------------------------------------------------
# backward


def _transposed(t: MXTensor) -> MXTensor:
    return MXTensor(t.data.T, t.scale.T, 1 - t.axis, t.elem, "compact")


def test_backward_bf16_equals_composition():
    rng = np.random.default_rng(20)
    x, w = random_operands(rng, 32, 32, 1, mx=False)
    cos, sin = tables(rng, 32)
    dq = rng.standard_normal((32, 1, D)).astype(BF16)
    dx, dw = mla_q_uproj_rope_quant_backward(dq, x, w, cos, sin)
    g = rope_backward(dq, cos, sin, style="mla", layout="thd", positions=np.arange(32))  # bf16 out
    assert g.dtype == BF16
    g64 = g.reshape(32, D).astype(np.float64)
    assert dx.dtype == BF16 and dw.dtype == BF16 and dx.shape == (32, 32) and dw.shape == (D, 32)
    assert_bytes_equal(dx, oracle_matmul(g64, w.astype(np.float64).T, "bfloat16"), "dx")
    assert_bytes_equal(dw, oracle_matmul(g64.T, x.astype(np.float64).T, "bfloat16"), "dw")


def test_backward_mxfp8_forward_operands_use_dequantized_values():
    rng = np.random.default_rng(21)
    x, w = random_operands(rng, 32, 64, 1, mx=True)
    cos, sin = tables(rng, 32)
    dq = rng.standard_normal((32, 1, D)).astype(BF16)
    dx, dw = mla_q_uproj_rope_quant_backward(dq, x, w, cos, sin)
    g = rope_backward(dq, cos, sin, style="mla", layout="thd", positions=np.arange(32)).reshape(32, D)
    g64 = g.astype(np.float64)
    w64 = mxfp8_dequantize(w).astype(np.float64)  # exact here (moderate scales)
    x64 = mxfp8_dequantize(x).astype(np.float64)
    assert_bytes_equal(dx, oracle_matmul(g64, w64.T, "bfloat16"), "dx")
    assert_bytes_equal(dw, oracle_matmul(g64.T, x64.T, "bfloat16"), "dw")


@pytest.mark.parametrize("given_mx", [False, True], ids=["quantized_here", "given_columnwise"])
def test_backward_quantize_grad_equals_composition(given_mx):
    rng = np.random.default_rng(22)
    x, w = random_operands(rng, 64, 64, 2, mx=False)
    cos, sin = tables(rng, 64)
    dq = rng.standard_normal((64, 2, D)).astype(BF16)
    x_t, w_n = mxfp8_quantize(x, axis=0), mxfp8_quantize(w, axis=0)  # blocked along T and N
    args = (x_t, w_n) if given_mx else (x, w)
    dx, dw = mla_q_uproj_rope_quant_backward(dq, *args, cos, sin, quantize_grad=True)
    g32 = rope_backward(dq, cos, sin, style="mla", layout="thd", positions=np.arange(64), out_dtype="float32")
    g32 = g32.reshape(64, 2 * D)
    g_row, g_col = mxfp8_quantize(g32, axis=1), mxfp8_quantize(g32, axis=0)
    assert_bytes_equal(dx, mxfp8_gemm(g_row, _transposed(w_n), "bfloat16"), "dx")
    assert_bytes_equal(dw, mxfp8_gemm(_transposed(g_col), _transposed(x_t), "bfloat16"), "dw")
    # g is quantized from fp32, not from bf16: the two differ on these inputs
    g_bf16_row = mxfp8_quantize(g32.astype(BF16), axis=1)
    assert not np.array_equal(g_row.data.view(np.uint8), g_bf16_row.data.view(np.uint8))


def test_backward_is_the_exact_transpose():
    # Exact inputs: the map x -> rope(x @ w^T) is then computed without rounding, so for any dq
    # <dq, F(x')> = <dx, x'> and <dq, F_w(w')> = <dw, w'> hold exactly (all values small binary numbers).
    rng = np.random.default_rng(23)
    tokens, k, heads = 32, 64, 2
    x, w, cos, sin, *_ = exact_case(rng, tokens, k, heads)
    dq = rng.choice([0.0, 1.0, -1.0], size=(tokens, heads, D), p=[0.9, 0.05, 0.05])
    dx, dw = mla_q_uproj_rope_quant_backward(dq.astype(BF16), x.astype(BF16), w.astype(BF16),
                                             cos.astype(np.float32), sin.astype(np.float32))
    g = np.zeros((tokens, heads, D))  # closed-form transpose of the mla rotation (SEMANTICS 4)
    g[..., :NOPE] = dq[..., :NOPE]
    gl, gr = dq[..., NOPE:NOPE + HALF], dq[..., NOPE + HALF:]
    c, s = cos[:, None, :], sin[:, None, :]
    g[..., NOPE::2] = gl * c[..., :HALF] + gr * s[..., HALF:]
    g[..., NOPE + 1::2] = -gl * s[..., :HALF] + gr * c[..., HALF:]
    g = g.reshape(tokens, heads * D)
    assert np.array_equal(dx.astype(np.float64), g @ w)  # exact: small integers times 2^hexp
    assert np.array_equal(dw.astype(np.float64), g.T @ x)
    for _ in range(3):  # adjoint identities with random exact directions
        x_dir = rng.integers(-2, 3, size=x.shape).astype(np.float64)
        w_dir = rng.integers(-2, 3, size=w.shape).astype(np.float64)
        assert np.sum(dq * closed_form_q(x_dir, w, cos, sin)) == np.sum(dx.astype(np.float64) * x_dir)
        assert np.sum(dq * closed_form_q(x, w_dir, cos, sin)) == np.sum(dw.astype(np.float64) * w_dir)


def test_backward_bf16_within_float64_bound():
    # Reference: float64 rotation transpose and products. dx = RN_bf16(sum g w) with g = RN_bf16(g32),
    # g32 within 2^-23 relative of the float64 rotation: |dx - ref| <= 2^-8 * (|g_ref| @ |w|) + 2^-8 |ref|
    # (bf16 unit roundoff 2^-9, each of the two roundings, with a 2x margin).
    rng = np.random.default_rng(24)
    x, w = random_operands(rng, 64, 128, 2, mx=False)
    cos, sin = tables(rng, 64)
    dq = rng.standard_normal((64, 2, D)).astype(BF16)
    dx, dw = mla_q_uproj_rope_quant_backward(dq, x, w, cos, sin)
    d = dq.astype(np.float64)
    c, s = cos.astype(np.float64)[:, None, :], sin.astype(np.float64)[:, None, :]
    g = d.copy()
    gl, gr = d[..., NOPE:NOPE + HALF], d[..., NOPE + HALF:]
    g[..., NOPE::2] = gl * c[..., :HALF] + gr * s[..., HALF:]
    g[..., NOPE + 1::2] = -gl * s[..., :HALF] + gr * c[..., HALF:]
    g = g.reshape(64, 2 * D)
    w64, x64 = w.astype(np.float64), x.astype(np.float64)
    for got, ref, mag in ((dx, g @ w64, np.abs(g) @ np.abs(w64)), (dw, g.T @ x64, np.abs(g.T) @ np.abs(x64))):
        err = np.abs(got.astype(np.float64) - ref)
        assert (err <= 2.0 ** -8 * (mag + np.abs(ref))).all()


# ------------------------------------------------------------------------------------------------
# bad inputs: one test per error, the message names the argument


def _args(tokens=32, k=64, heads=1):
    x = np.ones((tokens, k), BF16)
    w = np.ones((heads * D, k), BF16)
    cos = np.ones((tokens, ROPE), np.float32)
    return x, w, cos, cos.copy()


def test_error_x_dtype():
    x, w, cos, sin = _args()
    with pytest.raises(TypeError, match=r"^x: expected dtype in \('bfloat16',\), got float32"):
        mla_q_uproj_rope_quant(x.astype(np.float32), w, cos, sin)


def test_error_w_k_mismatch():
    x, w, cos, sin = _args()
    with pytest.raises(ValueError, match=r"^w: expected K = 64"):
        mla_q_uproj_rope_quant(x, w[:, :32], cos, sin)


def test_error_n_not_multiple_of_head_dim():
    x, w, cos, sin = _args()
    with pytest.raises(ValueError, match=r"^w: dim 0 \(N = H \* 192; head dim 192 .* has length 160"):
        mla_q_uproj_rope_quant(x, w[:160], cos, sin)


def test_error_tokens_not_multiple_of_32():
    x, w, cos, sin = _args(tokens=48)
    with pytest.raises(ValueError, match=r"^x: dim 0 \(T, blocked columnwise\) has length 48"):
        mla_q_uproj_rope_quant(x, w, cos, sin)


def test_error_cos_shape():
    x, w, cos, sin = _args()
    with pytest.raises(ValueError, match=r"^cos: expected shape \(32, 64\)"):
        mla_q_uproj_rope_quant(x, w, cos[:, :32], sin)


def test_error_sin_dtype():
    x, w, cos, sin = _args()
    with pytest.raises(TypeError, match=r"^sin: expected the dtype of cos \(float32\), got bfloat16"):
        mla_q_uproj_rope_quant(x, w, cos, sin.astype(BF16))


def test_error_table_dtype():
    x, w, cos, sin = _args()
    with pytest.raises(TypeError, match=r"^cos: expected dtype in"):
        mla_q_uproj_rope_quant(x, w, cos.astype(np.float16), sin)


def test_error_mixed_operand_kinds():
    x, w, cos, sin = _args()
    with pytest.raises(TypeError, match=r"^w: expected an MXTensor like x"):
        mla_q_uproj_rope_quant(mxfp8_quantize(x), w, cos, sin)


def test_error_mxtensor_axis():
    x, w, cos, sin = _args()
    with pytest.raises(ValueError, match=r"^x: expected an MXTensor blocked along K \(axis 1\), got axis 0"):
        mla_q_uproj_rope_quant(mxfp8_quantize(x, axis=0), mxfp8_quantize(w), cos, sin)


def test_error_backward_mxtensor_axis():
    x, w, cos, sin = _args()
    dq = np.ones((32, 1, D), BF16)
    with pytest.raises(ValueError, match=r"^w: expected an MXTensor blocked along N \(axis 0\), got axis 1"):
        mla_q_uproj_rope_quant_backward(dq, mxfp8_quantize(x, axis=0), mxfp8_quantize(w), cos, sin, True)


def test_error_backward_dq_shape():
    x, w, cos, sin = _args()
    with pytest.raises(ValueError, match=r"^dq: expected shape \(32, 1, 192\)"):
        mla_q_uproj_rope_quant_backward(np.ones((32, 2, D), BF16), x, w, cos, sin)


def test_error_backward_dq_dtype():
    x, w, cos, sin = _args()
    with pytest.raises(TypeError, match=r"^dq: expected dtype in \('bfloat16',\)"):
        mla_q_uproj_rope_quant_backward(np.ones((32, 1, D), np.float32), x, w, cos, sin)


def test_error_backward_quantize_grad_type():
    x, w, cos, sin = _args()
    with pytest.raises(TypeError, match=r"^quantize_grad: expected a bool"):
        validate_mla_q_uproj_rope_quant_backward(np.ones((32, 1, D), BF16), x, w, cos, sin, "yes")
