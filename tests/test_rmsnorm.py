"""spec.rmsnorm: rmsnorm_mxfp8 -- closed forms, the documented fp32 order rebuilt independently, float64
bounds, quantized bytes against quantize of its own fp32 y, non-finite rows, errors."""
from __future__ import annotations

import time
from fractions import Fraction as F

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spec.quantize import mxfp8_quantize
from spec.rmsnorm import rmsnorm_mxfp8
from tests.test_gemm import _low_exponent, _to_int, round_int_scaled
from tests.util import BF16, assert_bytes_equal, random_magnitudes

f32 = np.float32
U = 2.0 ** -24  # fp32 unit roundoff


def documented_rstd(x32: np.ndarray, eps: float) -> np.ndarray:
    """The spec's steps 2-5 rebuilt without spec code: sum of squares with Python integers (exact),
    rounded to fp32 by tests.test_gemm's integer rounding, then the fp32 steps."""
    out = []
    for row in x32.astype(np.float64):
        sq = row * row  # exact in float64
        e0 = _low_exponent(sq)
        total = sum(_to_int(v, e0) for v in sq)
        ss = f32(round_int_scaled(total, e0, "float32"))
        ms = f32(ss * (f32(1.0) / f32(x32.shape[1])))
        v = f32(ms + f32(eps))
        out.append(f32(1.0 / np.sqrt(np.float64(v))))
    return np.array(out, dtype=f32)


def rebuilt_y(x, gamma, rstd, zero_centered=False):
    g = np.asarray(gamma).astype(f32)
    if zero_centered:
        g = g + f32(1)
    return (np.asarray(x).astype(f32) * rstd[:, None]) * g[None, :]


def assert_quantized_from(y_row, y_col, y32, elem="e4m3"):
    for got, axis in ((y_row, 1), (y_col, 0)):
        want = mxfp8_quantize(y32, axis=axis, elem=elem)
        assert got.axis == axis and got.elem == elem and got.scale_layout == "compact"
        assert_bytes_equal(got.data, want.data, f"axis {axis} data")
        assert_bytes_equal(got.scale, want.scale, f"axis {axis} scale")


# ------------------------------------------------------------------------------------------------
# closed forms


def test_closed_form_constant_rows():
    # row of 2s: mean 4, rstd 1/2; row of +-3: mean 9, rstd = RN32(1/3); eps = 0 keeps v exact.
    x = np.zeros((32, 64), f32)
    x[0] = 2.0
    x[1] = np.where(np.arange(64) % 2, 3.0, -3.0)
    x[2:] = 1.0
    gamma = np.full(64, 4.0, f32)
    y_row, y_col, rstd = rmsnorm_mxfp8(x, gamma, eps=0.0)
    assert rstd.dtype == np.float32 and rstd.shape == (32,)
    assert_bytes_equal(rstd[:3], np.array([0.5, 1 / 3, 1.0], f32), "rstd")
    # y row 0 = 2 * 0.5 * 4 = 4; row 1 = +-3 * RN32(1/3) * 4 = +-4 (3 * RN32(1/3) rounds to 1)
    assert np.all(rebuilt_y(x, gamma, rstd)[:2] == np.array([[4.0] * 64, [-4.0, 4.0] * 32]))
    assert_quantized_from(y_row, y_col, rebuilt_y(x, gamma, rstd))


def test_eps_and_mean_steps():
    # D = 96 (1/96 inexact in fp32): ss = 96 * 4 = 384, ms = RN32(384 * RN32(1/96)), v = RN32(ms + eps)
    x = np.full((32, 96), 2.0, f32)
    _, _, rstd = rmsnorm_mxfp8(x, np.ones(96, f32), eps=0.25)
    ms = f32(f32(384.0) * (f32(1) / f32(96)))
    v = f32(ms + f32(0.25))
    assert_bytes_equal(rstd, np.full(32, 1.0 / np.sqrt(np.float64(v)), f32), "rstd")


def test_exact_sum_of_squares_not_a_float_sum():
    # squares: one 2^40 and 95 of 2^10. fp32's ulp at 2^40 is 2^17, so a sequential fp32 sum drops
    # every 2^10, while the exact sum 2^40 + 95 * 2^10 (0.74 ulp above 2^40) rounds up to 2^40 + 2^17.
    x = np.zeros((32, 96), f32)
    x[:, 0] = 2.0 ** 20
    x[:, 1:] = 2.0 ** 5
    _, _, rstd = rmsnorm_mxfp8(x, np.ones(96, f32), eps=0.0)
    sequential = f32(2.0 ** 40)
    for _ in range(95):
        sequential = f32(sequential + f32(2.0 ** 10))
    assert sequential == f32(2.0 ** 40)
    ss = f32(2.0 ** 40 + 2.0 ** 17)
    want = f32(1.0 / np.sqrt(np.float64(f32(ss * (f32(1) / f32(96))))))
    assert_bytes_equal(rstd, np.full(32, want, f32), "rstd from the exact sum")


@pytest.mark.parametrize("xdtype", [np.float32, BF16, np.float16])
def test_rstd_follows_documented_order(xdtype):
    rng = np.random.default_rng(30)
    x = random_magnitudes(rng, (32, 64), np.float32)
    x = np.clip(x, -6e4, 6e4).astype(xdtype) if xdtype is np.float16 else x.astype(xdtype)
    _, _, rstd = rmsnorm_mxfp8(x, np.ones(64, f32), eps=1e-6)
    assert_bytes_equal(rstd, documented_rstd(x.astype(f32), 1e-6), "rstd")


def test_rsqrt_evaluation_is_correctly_rounded_sample():
    # The spec evaluates RN32(1/sqrt(v)) as float64 1/sqrt(v) rounded to fp32; an exhaustive run over
    # every fp32 significand (v in [1, 4), 2^24 values, ~7 s) found no misrounding. Here 2000 random
    # ones, checked with rationals: the midpoints m- < r < m+ around r satisfy m+^2 v > 1 > m-^2 v.
    rng = np.random.default_rng(31)
    bits = rng.integers(0x3F800000, 0x40800000, size=2000).astype(np.uint32)
    v = bits.view(np.float32).astype(np.float64)
    r32 = (1.0 / np.sqrt(v)).astype(np.float32)
    for r, vv in zip(r32[:2000].astype(np.float64), v[:2000]):  # exact rational check on a subset
        up = float(np.nextafter(f32(r), f32(np.inf)))
        dn = float(np.nextafter(f32(r), f32(0)))
        m_hi, m_lo = (F(r) + F(up)) / 2, (F(r) + F(dn)) / 2
        assert m_hi * m_hi * F(vv) > 1 > m_lo * m_lo * F(vv)


# ------------------------------------------------------------------------------------------------
# float64 bounds and the quantized bytes


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("xdtype", [np.float32, BF16])
def test_against_float64_and_own_quantization(xdtype, zero_centered):
    rng = np.random.default_rng(32)
    x = random_magnitudes(rng, (64, 256), np.float32).astype(xdtype)
    gamma = rng.standard_normal(256).astype(BF16)
    y_row, y_col, rstd = rmsnorm_mxfp8(x, gamma, eps=1e-5, zero_centered_gamma=zero_centered)
    x64 = x.astype(np.float64)
    rstd64 = 1.0 / np.sqrt((x64 ** 2).mean(axis=1) + 1e-5)
    # rstd: ss, RN32(1/D), ms and v each add <= U relative (eps's own rounding is within v's U), the
    # square root halves those 4U, and the final rounding adds U: <= 3U; stated bound 4U.
    assert np.all(np.abs(rstd / rstd64 - 1) <= 4 * U)
    # y: rstd's 3U, g = RN32(gamma + 1) U, and two products 2U: <= 6U; stated bound 8U.
    g64 = gamma.astype(np.float64) + (1.0 if zero_centered else 0.0)
    y64 = x64 * rstd64[:, None] * g64
    y = rebuilt_y(x, gamma, rstd, zero_centered)
    assert np.all(np.abs(y - y64) <= 8 * U * np.abs(y64))
    assert_quantized_from(y_row, y_col, y)


def test_zero_centered_gamma_equals_shifted_gamma():
    rng = np.random.default_rng(33)
    x = rng.standard_normal((32, 128)).astype(BF16)
    gamma = (rng.standard_normal(128) * 0.1).astype(f32)
    a = rmsnorm_mxfp8(x, gamma, zero_centered_gamma=True)
    b = rmsnorm_mxfp8(x, gamma + f32(1), zero_centered_gamma=False)
    for u, v in zip(a[:2], b[:2]):
        assert_bytes_equal(u.data, v.data, "data")
        assert_bytes_equal(u.scale, v.scale, "scale")
    assert_bytes_equal(a[2], b[2], "rstd")


def test_e5m2():
    rng = np.random.default_rng(34)
    x = rng.standard_normal((32, 64)).astype(f32)
    gamma = rng.standard_normal(64).astype(f32)
    y_row, y_col, rstd = rmsnorm_mxfp8(x, gamma, elem="e5m2")
    assert str(y_row.data.dtype) == "float8_e5m2"
    assert_quantized_from(y_row, y_col, rebuilt_y(x, gamma, rstd), "e5m2")


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([32, 64]), st.sampled_from([32, 96, 160]), st.sampled_from([0.0, 1e-6, 1e-5, 0.5]),
       st.booleans(), st.integers(0, 2 ** 32 - 1))
def test_property_documented_order(tokens, d, eps, zero_centered, seed):
    rng = np.random.default_rng(seed)
    x = random_magnitudes(rng, (tokens, d), np.float32)
    gamma = rng.standard_normal(d).astype(f32)
    y_row, y_col, rstd = rmsnorm_mxfp8(x, gamma, eps, zero_centered)
    assert_bytes_equal(rstd, documented_rstd(x, eps), "rstd")
    assert_quantized_from(y_row, y_col, rebuilt_y(x, gamma, rstd, zero_centered))


def test_nonfinite_rows():
    x = np.ones((32, 64), f32)
    x[0, 3] = np.nan
    x[1, 5] = np.inf
    x[2] = 0.0
    x[3] = 3e30  # ss = 64 * 9e60 overflows fp32
    with np.errstate(all="ignore"):
        y_row, y_col, rstd = rmsnorm_mxfp8(x, np.ones(64, f32), eps=0.0)
    assert np.isnan(rstd[0]) and rstd[1] == 0 and rstd[2] == np.inf and rstd[3] == 0
    assert rstd[:1].view(np.uint32)[0] == 0x7FC00000  # canonical NaN
    codes = y_row.data.view(np.uint8)
    assert np.all(codes[0] == 0x7F)  # NaN everywhere
    assert codes[1, 5] == 0x7F and np.all(np.delete(codes[1], 5) == 0)  # Inf * 0 = NaN, 1 * 0 = +0
    assert np.all(codes[2] == 0x7F)  # 0 * Inf
    assert np.all(codes[3] == 0)
    with np.errstate(all="ignore"):
        assert_quantized_from(y_row, y_col, rebuilt_y(x, np.ones(64, f32), rstd))


def test_deepseek_sized():
    # q_a_layernorm: D = 1536 (q_lora_rank), 128 tokens
    rng = np.random.default_rng(35)
    x = rng.standard_normal((128, 1536)).astype(BF16)
    gamma = rng.standard_normal(1536).astype(BF16)
    start = time.perf_counter()
    y_row, y_col, rstd = rmsnorm_mxfp8(x, gamma)
    assert time.perf_counter() - start < 5
    assert y_row.scale.shape == (128, 48) and y_col.scale.shape == (4, 1536)
    assert_quantized_from(y_row, y_col, rebuilt_y(x, gamma, rstd))


# ------------------------------------------------------------------------------------------------
# bad inputs


def _ok():
    return np.ones((32, 64), f32), np.ones(64, f32)


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(x=np.ones((32, 64), np.int32)), TypeError, r"^x: expected dtype in"),
    (dict(x=np.ones((32, 64, 1), f32)), ValueError, r"^x: expected 2 dimensions"),
    (dict(x=np.ones((32, 48), f32), gamma=np.ones(48, f32)), ValueError,
     r"^x: dim 1 \(D, blocked rowwise\) has length 48"),
    (dict(x=np.ones((40, 64), f32)), ValueError, r"^x: dim 0 \(T, blocked columnwise\) has length 40"),
    (dict(gamma=np.ones(32, f32)), ValueError, r"^gamma: expected size 64 at dim 0 \(D of x\)"),
    (dict(gamma=np.ones((1, 64), f32)), ValueError, r"^gamma: expected 1 dimensions"),
    (dict(gamma=np.ones(64, np.float64)), TypeError, r"^gamma: expected dtype in"),
    (dict(eps=-1e-6), ValueError, r"^eps: expected a finite number >= 0"),
    (dict(eps=float("nan")), ValueError, r"^eps: expected a finite number >= 0"),
    (dict(eps="1e-6"), TypeError, r"^eps: expected a real number"),
    (dict(zero_centered_gamma=1), TypeError, r"^zero_centered_gamma: expected a bool"),
    (dict(elem="e3m4"), ValueError, r"^elem: expected one of"),
], ids=["x-dtype", "x-ndim", "x-D", "x-T", "gamma-size", "gamma-ndim", "gamma-dtype", "eps-negative",
        "eps-nan", "eps-type", "zero-centered-type", "elem"])
def test_errors(kwargs, exc, pattern):
    x, gamma = _ok()
    args = dict(x=x, gamma=gamma, eps=1e-6, zero_centered_gamma=False, elem="e4m3")
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        rmsnorm_mxfp8(**args)
