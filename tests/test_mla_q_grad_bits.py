"""The bf16-bit quantize-dequantize of the fused MXFP8 backward (mla_q_grad_gluon._bits_magic and
_qdq_bits), modelled instruction by instruction in NumPy and compared byte for byte with the spec's
MXFP8 quantize (rceil, e4m3) and dequantize of each 32-value block, read as bf16.

The kernel's five instructions on a packed pair, per 16-bit lane:
    m = (bits & 0x7F80) + 0x240         # 1.5 * 2^(exponent of v + 4)
    m = max_s16(m, magic)               # the block's least e4m3 binade, 0x7B00 (all codes 0) or NaN
    out = RN_bf16(RN_bf16(v + M) - M)
The GPU runs the instructions themselves in tests/conformance/test_mla_q_fused_backward.py."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from spec.quantize import mxfp8_dequantize, mxfp8_quantize, scale_bytes

BF16 = ml_dtypes.bfloat16
LO, HI, HI_BITS = 10, 246, 242  # backends.triton.gemm.BF16_SAFE_SCALE_BYTES["e4m3"]; the bit path's cap


def _bits_of(v: np.ndarray) -> np.ndarray:
    return v.astype(BF16).view(np.uint16).astype(np.int64)


def _rn_bf16(s: np.ndarray) -> np.ndarray:
    """One round-to-nearest-even of float64 values to bf16 (the sums here are exact in float64 or
    far from a tie)."""
    mant, ex = np.frexp(s)
    step = np.ldexp(1.0, ex - 8)
    q = np.where(s == 0, 0.0, np.round(s / step) * step)
    return q.astype(np.float32).astype(BF16)  # q is a bf16 value: both casts exact


def model_magic(amax: np.ndarray) -> np.ndarray:
    """_bits_magic: int16 bits per block."""
    e = scale_bytes(amax.astype(np.float32), "e4m3", "rceil").astype(np.int64)
    s_inv = ((254 - e) << 23).astype(np.uint32).view(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        tiny_code = amax.astype(np.float32) * s_inv > np.float32(2.0 ** -10)
    unsafe = (e > min(HI, HI_BITS)) | ((e < LO) & tiny_code)
    magic = np.where(e < LO, 0x7B00, ((e - 6) << 7) + 0x240)
    return np.where(unsafe, 0x7FC0, magic).astype(np.int16)


def model_qdq_bits(v: np.ndarray) -> np.ndarray:
    """_qdq_half_bits on bf16 blocks v [R, 32]: bf16 out."""
    vb = v.astype(BF16)
    with np.errstate(invalid="ignore"):
        amax = np.nanmax(np.abs(vb.astype(np.float32)), axis=1)  # the kernel's float max skips NaN
    amax = np.where(np.isnan(amax), 0, amax)
    magic = model_magic(amax).astype(np.int64)[:, None]
    m = (_bits_of(vb) & 0x7F80) + 0x240
    m = np.where(m >= 0x8000, m - 0x10000, m)  # as int16
    m = np.maximum(m, np.where(magic >= 0x8000, magic - 0x10000, magic)) & 0xFFFF
    big = m.astype(np.uint16).view(BF16).astype(np.float64)
    with np.errstate(invalid="ignore"):
        r = _rn_bf16(vb.astype(np.float64) + big)
        return _rn_bf16(r.astype(np.float64) - big)


def spec_qdq(v: np.ndarray):
    """(bf16 of the spec's dequantized quantization, scale bytes) of bf16 blocks v [R, 32]."""
    t = mxfp8_quantize(v.astype(BF16).astype(np.float32), axis=-1, elem="e4m3", scale_mode="rceil",
                       nonfinite="saturate")
    return mxfp8_dequantize(t, "float32").astype(BF16), np.asarray(t.scale).reshape(-1).astype(np.int64)


def _compare(v):
    got = model_qdq_bits(v)
    want, e = spec_qdq(v)
    safe = (e >= LO) & (e <= HI_BITS)
    g = got.view(np.uint16)[safe]
    w = want.view(np.uint16)[safe]
    # a zero's sign never reaches the MMA's sum (products with +-0 add nothing): compare values there
    same = (g == w) | ((got.astype(np.float32)[safe] == 0) & (want.astype(np.float32)[safe] == 0))
    assert same.all(), f"{(~same).sum()} of {same.size} values differ, first at {np.argwhere(~same)[0]}"
    return got, want, e


def _pinned_blocks(e: int) -> np.ndarray:
    """Every bf16 magnitude up to 448 * 2^(e - 127), both signs, 31 a block beside a pinning element
    448 * 2^(e - 127) (so every block's scale byte is e)."""
    top = np.array([448.0 * 2.0 ** (e - 127)], np.float64).astype(BF16).view(np.uint16)[0]
    mags = np.arange(0, int(top) + 1, dtype=np.uint16).view(BF16).astype(np.float32)
    vals = np.concatenate([mags, -mags])
    pad = (-len(vals)) % 31
    vals = np.concatenate([vals, np.zeros(pad, np.float32)]).reshape(-1, 31)
    pin = np.full((vals.shape[0], 1), top, np.uint16).view(BF16).astype(np.float32)
    return np.concatenate([vals, pin], axis=1)


@pytest.mark.parametrize("e", [LO, 11, 40, 100, 120, 127, 134, 160, 200, 241, HI_BITS])
def test_every_bf16_value_under_each_scale_byte(e):
    _, _, got_e = _compare(_pinned_blocks(e))
    assert (got_e == e).all()


def test_seeded_blocks_at_several_magnitudes_and_special_values():
    rng = np.random.default_rng(2026)
    rows = []
    for mag in (2.0 ** -100, 2.0 ** -20, 1e-3, 1.0, 3e4, 2.0 ** 90):
        x = rng.standard_normal((256, 32)) * mag * np.exp(rng.standard_normal((256, 1)) * 2)
        x[rng.random(x.shape) < 0.05] = 0.0
        x[rng.random(x.shape) < 0.05] *= 2.0 ** -12  # far under the block's max: e4m3 subnormals and zeros
        rows.append(x)
    special = np.zeros((6, 32))
    special[0, :] = np.ldexp(1.0, -133) * np.arange(32)  # bf16 subnormals
    special[1, :] = np.ldexp(1.0 + 2.0 ** -7, np.arange(32) - 16)  # one ulp above powers of two
    special[2, :] = np.ldexp(1.0 - 2.0 ** -8, np.arange(32) - 16)  # one ulp below
    special[3, ::2], special[3, 1::2] = 448.0, -0.0
    special[4, :] = np.float32(np.finfo(np.float32).max)  # saturating block: unsafe scale byte
    rows.append(special)
    v = np.concatenate(rows).astype(np.float32)
    _compare(v)


def test_guard_cases_give_nan_rows_or_zeros():
    v = np.zeros((5, 32), np.float32)
    v[0, 3] = np.nan  # NaN stays NaN; the block's other values still quantize
    v[0, 4:] = 1.5
    v[1, 5] = np.inf  # Inf: unsafe block, NaN row
    v[2, :] = 2.0 ** -130  # values under the least safe scale: nonzero codes -> unsafe -> NaN
    v[3, :] = 2.0 ** -133 * 3  # one far smaller... still nonzero codes under a scale below LO: NaN
    v[4, :] = 2.0 ** 120  # scale byte 240 <= 242: the fast path
    got = model_qdq_bits(v).astype(np.float32)
    want, e = spec_qdq(v)
    assert np.isnan(got[0, 3]) and (got[0, 4:] == want.astype(np.float32)[0, 4:]).all()
    assert np.isnan(got[1]).all() and np.isnan(got[2]).all() and np.isnan(got[3]).all()
    assert (got[4] == want.astype(np.float32)[4]).all() and e[4] <= HI_BITS


def test_scale_bytes_past_the_cap_are_unsafe():
    v = np.full((2, 32), 448.0 * 2.0 ** (243 - 127), np.float32)
    v[1] *= 2.0 ** 3  # scale byte 246: still inside BF16_SAFE_SCALE_BYTES, above the bit path's cap
    got = model_qdq_bits(v).astype(np.float32)
    assert np.isnan(got).all()


def test_all_zero_and_tiny_zero_code_blocks_give_zeros():
    v = np.zeros((2, 32), np.float32)
    v[1, ::3] = -0.0
    got = model_qdq_bits(v).astype(np.float32)
    assert (got == 0).all()
