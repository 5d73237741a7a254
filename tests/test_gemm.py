"""spec.gemm: mxfp8_gemm against closed forms and an independent big-integer oracle, byte for byte.

The oracle (`oracle_matmul`) shares nothing with spec.gemm: it turns every float64 into a Python
integer times a common power of two, sums with Python integers (exact), and rounds the integer to
fp32 / bf16 with its own round-half-even on bits. Other spec tests import it.
"""
from __future__ import annotations

import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spec.gemm import dequantize_f64, exact_matmul_rounded, exact_rowsum_rounded, mxfp8_gemm, validate_mxfp8_gemm
from spec.mxtensor import MXTensor
from spec.quantize import mxfp8_quantize
from tests.util import BF16, F8E4M3, F8E5M2, assert_bytes_equal

# ------------------------------------------------------------------------------------------------
# independent oracle

_FORMATS = {"float32": (24, -126, 127, np.float32), "bfloat16": (8, -126, 127, BF16)}


def _to_int(v: float, e0: int) -> int:
    """v (finite float64, a multiple of 2^e0) as the integer v / 2^e0."""
    num, den = float(v).as_integer_ratio()  # den is a power of two
    shift = -e0 - (den.bit_length() - 1)
    assert shift >= 0, "e0 must divide every value"
    return num << shift


def _low_exponent(values) -> int:
    """The exponent of the smallest power of two dividing every finite value."""
    e = 0
    for v in values:
        if v != 0:
            den = float(v).as_integer_ratio()[1]
            e = min(e, -(den.bit_length() - 1))
    return e


def round_int_scaled(n: int, e: int, out_dtype: str) -> float:
    """RN-even of the exact value n * 2^e into out_dtype, as a Python float (exactly representable)."""
    if n == 0:
        return 0.0
    p, emin, emax, _ = _FORMATS[out_dtype]
    sign, mag = (-1.0 if n < 0 else 1.0), abs(n)
    top = mag.bit_length() - 1 + e  # exponent of the leading bit
    low = max(top, emin) - (p - 1)  # exponent of the last kept bit (subnormals: fixed at emin-p+1)
    shift = low - e
    if shift > 0:
        q, r = divmod(mag, 1 << shift)
        half = 1 << (shift - 1)
        if r > half or (r == half and q & 1):
            q += 1
    else:
        q = mag << -shift
    if q and q.bit_length() - 1 + low > emax:
        return sign * math.inf
    return sign * math.ldexp(float(q), low)


def oracle_matmul(a64: np.ndarray, b64: np.ndarray, out_dtype: str) -> np.ndarray:
    """RN_out(exact sum_k a[m,k] * b[n,k]) for finite float64 a [M, K], b [N, K]; exact zero -> +0."""
    ea, eb = _low_exponent(a64.ravel()), _low_exponent(b64.ravel())
    ai = [[_to_int(v, ea) for v in row] for row in a64]
    bi = [[_to_int(v, eb) for v in row] for row in b64]
    out = np.empty((a64.shape[0], b64.shape[0]), dtype=_FORMATS[out_dtype][3])
    for m, ra in enumerate(ai):
        for n, rb in enumerate(bi):
            out[m, n] = round_int_scaled(sum(x * y for x, y in zip(ra, rb)), ea + eb, out_dtype)
    return out


# ------------------------------------------------------------------------------------------------
# building MXTensors with chosen codes and scales


def mx(values, scale_bytes, elem="e4m3", axis=1) -> MXTensor:
    """An MXTensor whose codes are `values` (exactly representable in elem) and scales the given bytes."""
    dtype = F8E4M3 if elem == "e4m3" else F8E5M2
    codes = np.asarray(values, dtype=np.float64).astype(dtype)
    assert np.array_equal(codes.astype(np.float64), np.asarray(values, dtype=np.float64), equal_nan=True)
    return MXTensor(codes, np.asarray(scale_bytes, dtype=np.uint8), axis, elem)


def small_int_operand(rng, rows, k, lo=-4, hi=5, exps=(-2, 3), elem="e4m3") -> MXTensor:
    """Codes: small integers; scales: 2^exp per block with exp in [exps) -- every product and partial
    sum is an exact small binary fraction."""
    codes = rng.integers(lo, hi, size=(rows, k)).astype(np.float64)
    scales = 127 + rng.integers(exps[0], exps[1], size=(rows, k // 32))
    return mx(codes, scales, elem)


# ------------------------------------------------------------------------------------------------
# closed forms


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_exact_arithmetic_closed_form(out_dtype):
    rng = np.random.default_rng(1)
    a = small_int_operand(rng, 16, 256)
    b = small_int_operand(rng, 24, 256)
    exact = dequantize_f64(a) @ dequantize_f64(b).T  # |sum| < 2^18 on a 2^-4 grid: float64 is exact
    assert np.abs(exact).max() < 2 ** 18
    got = mxfp8_gemm(a, b, out_dtype)
    if out_dtype == "float32":  # 22 bits: fp32 holds every sum
        assert_bytes_equal(got, exact.astype(np.float32), "fp32 closed form")
    else:
        assert_bytes_equal(got, oracle_matmul(dequantize_f64(a), dequantize_f64(b), out_dtype), "bf16")


def test_single_product_reads_codes_and_scales():
    # a = 1.5 * 2^(130-127) = 12 in column 0, b = -3 * 2^(120-127) = -3/128 in column 0:
    # out = 12 * -3/128 = -0.28125. The second block of each is zero (scale bytes arbitrary).
    a = mx([[1.5] + [0] * 63], [[130, 7]])
    b = mx([[-3.0] + [0] * 63], [[120, 250]])
    assert mxfp8_gemm(a, b, "float32")[0, 0] == np.float32(-0.28125)
    assert mxfp8_gemm(a, b).dtype == BF16  # default out_dtype
    assert mxfp8_gemm(a, b)[0, 0] == BF16(-0.28125)


def test_bf16_ties_round_to_even_once():
    # sum 257 is the bf16 tie between 256 and 258 -> 256; 259 -> 260; 257 + 2^-6 -> 258.
    b = mx([[1.0] * 64], [[127, 127]])
    a = mx([[256.0] + [1.0] + [0] * 30 + [0.0] * 32,
            [256.0] + [3.0] + [0] * 30 + [0.0] * 32,
            [256.0] + [1.0] + [0] * 30 + [1.0] + [0] * 31], [[127, 127], [127, 127], [127, 121]])
    assert_bytes_equal(mxfp8_gemm(a, b, "bfloat16")[:, 0], np.array([256, 260, 258], dtype=BF16), "ties")


def test_fallback_beyond_float64_exactness():
    # 2^100 + 2^76 is the fp32 tie between 2^100 and 2^100 + 2^77; a third block adds +-2^-100, 200
    # binades below: float64 loses it and lands on the tie, the exact sum is just above / below it.
    b = mx([[1.0] + [0] * 31 + [1.0] + [0] * 31 + [1.0] + [0] * 31], [[127, 127, 127]])
    vals = [[1.0] + [0] * 31 + [1.0] + [0] * 31 + [s] + [0] * 31 for s in (1.0, -1.0)]
    a = mx(vals, [[227, 203, 27], [227, 203, 27]])
    got = mxfp8_gemm(a, b, "float32")[:, 0]
    assert_bytes_equal(got, np.array([2.0 ** 100 + 2.0 ** 77, 2.0 ** 100], dtype=np.float32), "fallback")
    assert_bytes_equal(mxfp8_gemm(a, b, "bfloat16")[:, 0], np.array([2.0 ** 100] * 2, dtype=BF16), "bf16")


def test_zero_signs_underflow_overflow():
    z = [0.0] * 32
    # exact zero: +0 even from -0 codes and from cancellation
    a = mx([[-0.0] * 32, [1.0, -1.0] + z[2:]], [[127], [127]])
    b = mx([[1.0] * 32], [[127]])
    assert_bytes_equal(mxfp8_gemm(a, b, "float32")[:, 0], np.zeros(2, np.float32), "+0")
    # -2^-9 * 2^-127 * 2^-9 * 2^-127 = -2^-272 underflows to -0 in both formats
    a = mx([[-2.0 ** -9] + z[1:]], [[0]])
    b = mx([[2.0 ** -9] + z[1:]], [[0]])
    assert_bytes_equal(mxfp8_gemm(a, b, "float32"), np.array([[-0.0]], np.float32), "-0 fp32")
    assert_bytes_equal(mxfp8_gemm(a, b, "bfloat16"), np.array([[-0.0]], BF16), "-0 bf16")
    # 448 * 2^127 squared = 2^270 * 3.06: Inf (RN overflow), sign kept
    a = mx([[448.0] + z[1:]], [[254]])
    b = mx([[-448.0] + z[1:]], [[254]])
    assert mxfp8_gemm(a, b, "float32")[0, 0] == -np.inf
    assert mxfp8_gemm(a, b, "bfloat16")[0, 0] == -np.inf


def test_nonfinite_propagation_and_canonical_nan():
    z = [0.0] * 31
    # row 0: scale byte 255 (NaN block); row 1: e5m2 +Inf code; row 2: finite
    a = mx([[1.0] + z, [np.inf] + z, [2.0] + z], [[255], [127], [127]], elem="e5m2")
    b = mx([[1.0] + z, [0.0] + z, [-1.0] + z], [[127], [127], [127]])
    got = mxfp8_gemm(a, b, "float32")
    nan = np.float32(np.nan)
    expect = np.array([[nan, nan, nan], [np.inf, nan, -np.inf], [2.0, 0.0, -2.0]], dtype=np.float32)
    assert_bytes_equal(got, expect, "non-finite")  # NaN bytes are 0x7FC00000
    assert_bytes_equal(mxfp8_gemm(a, b, "bfloat16"), expect.astype(BF16), "bf16 NaN is 0x7FC0")
    # +Inf and -Inf products in one sum -> NaN
    a = mx([[np.inf, np.inf] + z[1:]], [[127]], elem="e5m2")
    b = mx([[1.0, -1.0] + z[1:]], [[127]])
    assert np.isnan(mxfp8_gemm(a, b, "float32")[0, 0])


def test_swizzled_scales_equal_compact():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((40, 96)).astype(np.float32)
    y = rng.standard_normal((8, 96)).astype(np.float32)
    try:
        xs = mxfp8_quantize(x, scale_layout="swizzled")
    except NotImplementedError:
        pytest.skip("spec.swizzle not written yet")
    ref = mxfp8_gemm(mxfp8_quantize(x), mxfp8_quantize(y), "float32")
    assert_bytes_equal(mxfp8_gemm(xs, mxfp8_quantize(y, scale_layout="swizzled"), "float32"), ref, "swizzled")


# ------------------------------------------------------------------------------------------------
# random inputs against the oracle


def _spread_operand(rng, rows, k, spread, elem):
    x = rng.standard_normal((rows, k))
    x *= np.repeat(2.0 ** rng.integers(-spread, spread + 1, size=(rows, k // 32)), 32, axis=1)
    return mxfp8_quantize(x.astype(np.float32), elem=elem)


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_random_multi_binade_against_oracle(out_dtype):
    rng = np.random.default_rng(3)
    a = _spread_operand(rng, 6, 128, 40, "e4m3")
    b = _spread_operand(rng, 7, 128, 40, "e5m2")
    assert_bytes_equal(mxfp8_gemm(a, b, out_dtype),
                       oracle_matmul(dequantize_f64(a), dequantize_f64(b), out_dtype), out_dtype)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.integers(0, 100),
       st.sampled_from(["e4m3", "e5m2"]), st.sampled_from(["float32", "bfloat16"]), st.integers(0, 2 ** 32 - 1))
def test_property_equals_oracle(m, n, kb, spread, elem, out_dtype, seed):
    rng = np.random.default_rng(seed)
    a = _spread_operand(rng, m, 32 * kb, spread, elem)
    b = _spread_operand(rng, n, 32 * kb, spread, "e4m3")
    assert_bytes_equal(mxfp8_gemm(a, b, out_dtype),
                       oracle_matmul(dequantize_f64(a), dequantize_f64(b), out_dtype), "property")


def test_exact_helpers_wide_operands_against_oracle():
    # fp32 x bf16 products (32 bits) and fp32 squares (48 bits), as mla_q and rmsnorm use them
    rng = np.random.default_rng(4)
    a = (rng.standard_normal((5, 64)) * 2.0 ** rng.integers(-30, 30, (5, 64))).astype(np.float32)
    b = rng.standard_normal((6, 64)).astype(BF16)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    for out in ("float32", "bfloat16"):
        assert_bytes_equal(exact_matmul_rounded(a64, b64, out, 24, 8), oracle_matmul(a64, b64, out), out)
        sq = a64 ** 2
        assert_bytes_equal(exact_rowsum_rounded(sq, out, 48),
                           np.diagonal(oracle_matmul(a64, a64, out)).copy(), "rowsum " + out)


def test_deepseek_sized_exact_inputs():
    # K = 1536 (q_lora_rank), N = 16 heads * 192: small-integer codes, scales 2^-2..2^2. Every sum is
    # an integer multiple of 2^-8 below 2^22, so float64 gives the closed form.
    rng = np.random.default_rng(5)
    a = small_int_operand(rng, 32, 1536)
    b = small_int_operand(rng, 16 * 192, 1536)
    start = time.perf_counter()
    got = mxfp8_gemm(a, b, "float32")
    elapsed = time.perf_counter() - start
    assert_bytes_equal(got, (dequantize_f64(a) @ dequantize_f64(b).T).astype(np.float32), "deepseek")
    assert elapsed < 10, elapsed


# ------------------------------------------------------------------------------------------------
# bad inputs: one per error, the message names the argument


def _ok():
    a = mx(np.ones((2, 64)), np.full((2, 2), 127))
    b = mx(np.ones((3, 64)), np.full((3, 2), 127))
    return a, b


def test_error_a_not_mxtensor():
    a, b = _ok()
    with pytest.raises(TypeError, match=r"^a: expected an MXTensor"):
        mxfp8_gemm(np.ones((2, 64), np.float32), b)


def test_error_b_blocked_on_wrong_axis():
    a, _ = _ok()
    b = mx(np.ones((32, 64)), np.full((1, 64), 127), axis=0)
    with pytest.raises(ValueError, match=r"^b: expected an MXTensor blocked along K \(axis 1\), got axis 0"):
        mxfp8_gemm(a, b)


def test_error_k_mismatch():
    a, _ = _ok()
    b = mx(np.ones((3, 96)), np.full((3, 3), 127))
    with pytest.raises(ValueError, match=r"^a and b: expected equal K"):
        mxfp8_gemm(a, b)


def test_error_out_dtype():
    a, b = _ok()
    with pytest.raises(ValueError, match=r"^out_dtype: expected one of"):
        mxfp8_gemm(a, b, "float16")


def test_error_data_dtype_disagrees_with_elem():
    a, b = _ok()
    bad = a.replace(elem="e5m2")  # e4m3 codes labelled e5m2
    with pytest.raises(TypeError, match=r"^a: expected data dtype float8_e5m2"):
        mxfp8_gemm(bad, b)


def test_error_three_dimensional():
    a, b = _ok()
    a3 = MXTensor(np.ones((2, 2, 64)).astype(F8E4M3), np.full((2, 2, 2), 127, np.uint8), 2)
    with pytest.raises(ValueError, match=r"^a: expected 2 dimensions"):
        validate_mxfp8_gemm(a3, b)
