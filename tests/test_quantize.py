"""spec.quantize: byte tables derived by hand from SEMANTICS 1-2, properties, errors, speed.

Expected bytes below are literals worked out from the rules (not produced by spec). Notation used in
the derivations: R(e4m3) = 0x3B124925 = 2^-9 * 1.1428572 (slightly above 1/448), R(e5m2) = 0x37924925
= 2^-16 * the same mantissa; a repeated block of 2^k therefore has p = 2^(k-9) * 1.14.. (e4m3) so the
rceil byte is 119 + k and the code is 2^8 = 0x78; for e5m2 the byte is 112 + k and the code 2^15 = 0x78.
"""
from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from spec.constants import ELEM_FORMATS
from spec.mxtensor import MXTensor
from spec.quantize import (
    encode,
    mxfp8_dequantize,
    mxfp8_quantize,
    scale_bytes,
    validate_mxfp8_dequantize,
    validate_mxfp8_quantize,
)
from tests.util import BF16, F8E4M3, F8E5M2, assert_bytes_equal, random_magnitudes, special_values_f32

f32 = np.float32
INF, NAN = float("inf"), float("nan")
F32_MAX = float(np.finfo(np.float32).max)  # (2 - 2^-23) * 2^127
BF16_MAX = float(ml_dtypes.finfo(BF16).max)  # (2 - 2^-7) * 2^127
F16_MAX = 65504.0  # (2 - 2^-10) * 2^15


def nxt(v):
    return float(np.nextafter(f32(v), f32(np.inf)))


def prv(v):
    return float(np.nextafter(f32(v), f32(-np.inf)))


A = 448.0 * 2.0 ** -127  # 1.75 * 2^-119 (normal): p = RN(A * R) is exactly 2^-127 -> byte 0

# ---------------------------------------------------------------------------------------------
# Byte tables. "alone": v at index 0, the other 31 values 1.0 -> (scale, code of v, code of 1.0).
# "rep": all 32 values v -> (scale, code).

ALONE = {
    ("e4m3", "rceil"): [
        (448.0, 0x7F, 0x7E, 0x38),  # p = RN(1 + 0.75*2^-24) = 1.0 -> 127; 448 = 0x7E; 1.0 = 0x38
        (-448.0, 0x7F, 0xFE, 0x38),
        (449.0, 0x80, 0x76, 0x30),  # p > 1 -> 128; 449/2 = 224.5 -> 224 = 0x76; 0.5 = 0x30
        (480.0, 0x80, 0x77, 0x30),  # 240 = 0x77
        (-480.0, 0x80, 0xF7, 0x30),
        (nxt(448.0), 0x80, 0x76, 0x30),  # p = RN(1 + 0.95*2^-23) = 1 + 2^-23 -> 128
        (prv(448.0), 0x7F, 0x7E, 0x38),  # p = RN(1 - 0.39*2^-24) = 1.0 -> 127
        (57344.0, 0x86, 0x7E, 0x04),  # p = 2^7 -> 134; 57344/128 = 448; 1/128 = 4 * 2^-9
        (61440.0, 0x87, 0x77, 0x02),  # p = 2^7 * 1.07 -> 135; 240; 2^-8 = 2 * 2^-9
        (F16_MAX, 0x87, 0x78, 0x02),  # 65504/256 = 255.875 -> 256
        (F32_MAX, 0xF7, 0x78, 0x00),  # p = 2^119 * 1.14 -> 247; (2-2^-23)*2^7 -> 256; 2^-120 -> 0
        (BF16_MAX, 0xF7, 0x78, 0x00),  # 255 -> 256
        (INF, 0xFE, 0x7E, 0x00),  # SEMANTICS 1.4 table; 1.0 * 2^-127 -> 0
        (-INF, 0xFE, 0xFE, 0x00),
        (NAN, 0x77, 0x7F, 0x78),  # NaN ignored: amax 1.0 -> 119, 1.0 * 2^8 = 0x78
    ],
    ("e4m3", "floor"): [
        (448.0, 0x7F, 0x7E, 0x38),  # Ea = 135 -> 127
        (-448.0, 0x7F, 0xFE, 0x38),
        (449.0, 0x7F, 0x7E, 0x38),  # 449 -> 448
        (480.0, 0x7F, 0x7E, 0x38),  # 480 saturates to 448
        (-480.0, 0x7F, 0xFE, 0x38),
        (nxt(448.0), 0x7F, 0x7E, 0x38),
        (prv(448.0), 0x7F, 0x7E, 0x38),
        (57344.0, 0x86, 0x7E, 0x04),  # Ea = 142 -> 134
        (61440.0, 0x86, 0x7E, 0x04),  # 480 saturates
        (F16_MAX, 0x86, 0x7E, 0x04),  # 511.75 saturates
        (F32_MAX, 0xF6, 0x7E, 0x00),  # Ea = 254 -> 246; 511.99997 saturates
        (BF16_MAX, 0xF6, 0x7E, 0x00),
        (INF, 0xFE, 0x7E, 0x00),
        (-INF, 0xFE, 0xFE, 0x00),
        (NAN, 0x77, 0x7F, 0x78),
    ],
    ("e5m2", "rceil"): [
        (57344.0, 0x7F, 0x7B, 0x3C),  # p = 1.0 -> 127; 57344 = 0x7B; 1.0 = 0x3C
        (-57344.0, 0x7F, 0xFB, 0x3C),
        (61440.0, 0x80, 0x78, 0x38),  # 30720 ties 28672|32768 -> even 32768 = 0x78; 0.5 = 0x38
        (-61440.0, 0x80, 0xF8, 0x38),
        (448.0, 0x78, 0x7B, 0x58),  # p = 2^-7 -> 120; 448*128 = 57344; 2^7 = 0x58
        (-448.0, 0x78, 0xFB, 0x58),
        (449.0, 0x79, 0x77, 0x54),  # 449*64 = 28736 -> 28672 = 0x77; 2^6 = 0x54
        (480.0, 0x79, 0x78, 0x54),  # 30720 -> 32768
        (-480.0, 0x79, 0xF8, 0x54),
        (F16_MAX, 0x80, 0x78, 0x38),  # p = 1.1423 -> 128; 32752 -> 32768
        (F32_MAX, 0xF0, 0x78, 0x00),  # p = 2^112 * 1.14 -> 240; 32767.998 -> 32768
        (BF16_MAX, 0xF0, 0x78, 0x00),  # 32640 -> 32768
        (INF, 0xFE, 0x7B, 0x00),
        (-INF, 0xFE, 0xFB, 0x00),
        (NAN, 0x70, 0x7F, 0x78),  # amax 1.0 -> 112, 1.0 * 2^15 = 0x78
    ],
    ("e5m2", "floor"): [
        (57344.0, 0x7F, 0x7B, 0x3C),  # Ea = 142 -> 127
        (-57344.0, 0x7F, 0xFB, 0x3C),
        (61440.0, 0x7F, 0x7B, 0x3C),  # saturates
        (-61440.0, 0x7F, 0xFB, 0x3C),
        (448.0, 0x78, 0x7B, 0x58),  # Ea = 135 -> 120
        (-448.0, 0x78, 0xFB, 0x58),
        (449.0, 0x78, 0x7B, 0x58),  # 57472 saturates
        (480.0, 0x78, 0x7B, 0x58),  # 61440 saturates
        (-480.0, 0x78, 0xFB, 0x58),
        (F16_MAX, 0x7F, 0x7B, 0x3C),
        (F32_MAX, 0xEF, 0x7B, 0x00),  # Ea = 254 -> 239; 65535.996 saturates
        (BF16_MAX, 0xEF, 0x7B, 0x00),
        (INF, 0xFE, 0x7B, 0x00),
        (-INF, 0xFE, 0xFB, 0x00),
        (NAN, 0x70, 0x7F, 0x78),
    ],
}

REP = {
    ("e4m3", "rceil"): [
        (0.0, 0x00, 0x00),
        (-0.0, 0x00, 0x80),
        (NAN, 0x00, 0x7F),  # all-NaN block: amax 0
        (1.0, 0x77, 0x78),
        (-1.0, 0x77, 0xF8),
        (2.0 ** -6, 0x71, 0x78),
        (2.0 ** -9, 0x6E, 0x78),
        (2.0 ** -14, 0x69, 0x78),
        (2.0 ** -16, 0x67, 0x78),
        (2.0 ** -118, 0x01, 0x78),  # p = 1.14 * 2^-127: mantissa 0x492492 > 0x400000 -> 1
        (2.0 ** -119, 0x00, 0x78),  # p < 2^-127 -> 0; 2^-119 * 2^127 = 256
        (2.0 ** -120, 0x00, 0x70),  # 128
        (2.0 ** -126, 0x00, 0x40),  # smallest normal fp32/bf16: 2 = 0x40
        (2.0 ** -127, 0x00, 0x38),  # fp32 subnormal: 1.0
        (2.0 ** -133, 0x00, 0x08),  # smallest bf16 subnormal: 2^-6 = 0x08
        (2.0 ** -149, 0x00, 0x00),  # smallest fp32 subnormal: 2^-22 -> 0
        (A, 0x00, 0x7E),  # p = 2^-127 exactly -> 0 (log2 rule would agree here)
        (nxt(A), 0x00, 0x7E),  # p rounds to 2^-127 -> 0, where ceil(log2(amax/448)) + 127 = 1
        (nxt(nxt(A)), 0x01, 0x76),  # p rounds to 2^-127 + 2^-149 -> 1; 224.00006 -> 224
    ],
    ("e4m3", "floor"): [
        (0.0, 0x00, 0x00),
        (-0.0, 0x00, 0x80),
        (NAN, 0x00, 0x7F),
        (1.0, 0x77, 0x78),
        (-1.0, 0x77, 0xF8),
        (2.0 ** -6, 0x71, 0x78),
        (2.0 ** -9, 0x6E, 0x78),
        (2.0 ** -14, 0x69, 0x78),
        (2.0 ** -16, 0x67, 0x78),
        (2.0 ** -118, 0x01, 0x78),  # Ea = 9 -> 1
        (2.0 ** -119, 0x00, 0x78),
        (2.0 ** -120, 0x00, 0x70),
        (2.0 ** -126, 0x00, 0x40),
        (2.0 ** -127, 0x00, 0x38),
        (2.0 ** -133, 0x00, 0x08),
        (2.0 ** -149, 0x00, 0x00),
        (A, 0x00, 0x7E),  # Ea = 8 -> 0; 448
    ],
    ("e5m2", "rceil"): [
        (0.0, 0x00, 0x00),
        (-0.0, 0x00, 0x80),
        (NAN, 0x00, 0x7F),
        (1.0, 0x70, 0x78),
        (-1.0, 0x70, 0xF8),
        (2.0 ** -6, 0x6A, 0x78),
        (2.0 ** -16, 0x60, 0x78),
        (2.0 ** -111, 0x01, 0x78),
        (2.0 ** -112, 0x00, 0x78),
        (2.0 ** -113, 0x00, 0x74),  # 2^14 = 0x74
        (2.0 ** -126, 0x00, 0x40),
        (2.0 ** -127, 0x00, 0x3C),
        (2.0 ** -133, 0x00, 0x24),  # 2^-6 = 0x24
        (2.0 ** -149, 0x00, 0x00),
    ],
    ("e5m2", "floor"): [
        (0.0, 0x00, 0x00),
        (-0.0, 0x00, 0x80),
        (NAN, 0x00, 0x7F),
        (1.0, 0x70, 0x78),
        (-1.0, 0x70, 0xF8),
        (2.0 ** -6, 0x6A, 0x78),
        (2.0 ** -16, 0x60, 0x78),
        (2.0 ** -111, 0x01, 0x78),
        (2.0 ** -112, 0x00, 0x78),
        (2.0 ** -113, 0x00, 0x74),
        (2.0 ** -126, 0x00, 0x40),
        (2.0 ** -127, 0x00, 0x3C),
        (2.0 ** -133, 0x00, 0x24),
        (2.0 ** -149, 0x00, 0x00),
    ],
}

# One ulp either side of powers of two 2^k (repeated blocks): (k, byte of 2^k).
# rceil: every one of prv/2^k/nxt has the byte of 2^k and code 0x78 (256 or 2^15 after rounding).
# floor: prv(2^k) is in the binade below -> byte - 1 and the element saturates (0x7E / 0x7B).
POW2_K = (-10, 0, 8, 9, 15)
POW2_BYTE = {  # 119 + k (e4m3), 112 + k (e5m2)
    "e4m3": {-10: 0x6D, 0: 0x77, 8: 0x7F, 9: 0x80, 15: 0x86},
    "e5m2": {-10: 0x66, 0: 0x70, 8: 0x78, 9: 0x79, 15: 0x7F},
}
MAX_CODE = {"e4m3": 0x7E, "e5m2": 0x7B}

for _elem in ("e4m3", "e5m2"):
    for _k in POW2_K:
        _b = POW2_BYTE[_elem][_k]
        _v = 2.0 ** _k
        REP[(_elem, "rceil")] += [(_v, _b, 0x78), (prv(_v), _b, 0x78), (nxt(_v), _b, 0x78)]
        REP[(_elem, "floor")] += [(_v, _b, 0x78), (prv(_v), _b - 1, MAX_CODE[_elem]), (nxt(_v), _b, 0x78)]


def _alone_cases():
    for (elem, mode), rows in ALONE.items():
        for row in rows:
            for nonfinite in ("saturate", "nan_block"):
                yield pytest.param(elem, mode, nonfinite, *row, id=f"{elem}-{mode}-{nonfinite}-{row[0]!r}")


def _rep_cases():
    for (elem, mode), rows in REP.items():
        for row in rows:
            for nonfinite in ("saturate", "nan_block"):
                yield pytest.param(elem, mode, nonfinite, *row, id=f"{elem}-{mode}-{nonfinite}-{row[0]!r}")


def _check_block(block, elem, mode, nonfinite, scale, codes):
    """Quantize the block rowwise ([1, 32], axis -1) and columnwise ([32, 1], axis 0) and compare bytes."""
    elem_dtype = F8E4M3 if elem == "e4m3" else F8E5M2
    codes = np.asarray(codes, dtype=np.uint8)
    for x, axis in ((block.reshape(1, 32), -1), (block.reshape(32, 1), 0)):
        t = mxfp8_quantize(x, axis=axis, elem=elem, scale_mode=mode, nonfinite=nonfinite)
        assert_bytes_equal(t.scale.reshape(-1), np.array([scale], np.uint8), f"scale axis={axis}")
        assert t.data.dtype == elem_dtype
        assert_bytes_equal(t.data.reshape(-1).view(np.uint8), codes, f"codes axis={axis}")


@pytest.mark.parametrize("elem,mode,nonfinite,v,scale,code_v,code_one", list(_alone_cases()))
def test_table_alone(elem, mode, nonfinite, v, scale, code_v, code_one):
    block = np.ones(32, np.float32)
    block[0] = v
    codes = [code_v] + [code_one] * 31
    if nonfinite == "nan_block" and not np.isfinite(v):
        scale, codes = 0xFF, [0x7F] * 32  # SEMANTICS 1.3: byte 255, every code NaN
    _check_block(block, elem, mode, nonfinite, scale, codes)


@pytest.mark.parametrize("elem,mode,nonfinite,v,scale,code", list(_rep_cases()))
def test_table_repeated(elem, mode, nonfinite, v, scale, code):
    block = np.full(32, v, np.float32)
    if nonfinite == "nan_block" and not np.isfinite(v):
        scale, code = 0xFF, 0x7F
    _check_block(block, elem, mode, nonfinite, scale, [code] * 32)


@pytest.mark.parametrize("nonfinite,scale,codes", [
    ("saturate", 0xFE, [0x7F, 0x7E, 0xFE] + [0x00] * 29),  # amax = Inf (NaN ignored)
    ("nan_block", 0xFF, [0x7F] * 32),
])
def test_nan_and_inf_in_one_block(nonfinite, scale, codes):
    block = np.ones(32, np.float32)
    block[:3] = [NAN, INF, -INF]
    _check_block(block, "e4m3", "rceil", nonfinite, scale, codes)


@pytest.mark.parametrize("mode", ["rceil", "floor", "ceil", "even"])
def test_inf_block_gets_254_in_every_mode(mode):
    block = np.full(32, 2.0, np.float32)
    block[5] = -INF
    t = mxfp8_quantize(block.reshape(1, 32), scale_mode=mode)
    assert t.scale.tobytes() == b"\xfe"


@pytest.mark.parametrize("elem,mode,v,scale,code", [
    # ceil: Ea - emax + (Ma != 0)
    ("e4m3", "ceil", 1.0, 0x77, 0x78),
    ("e4m3", "ceil", 1.5, 0x78, 0x74),  # 127 - 8 + 1 = 120; 1.5 * 2^7 = 192 = 0x74
    ("e4m3", "ceil", 448.0, 0x80, 0x76),  # one above rceil's 127: 224
    ("e4m3", "ceil", 2.0 ** -126, 0x00, 0x40),
    ("e5m2", "ceil", 1.5, 0x71, 0x76),  # 113; 1.5 * 2^14 = 24576 = 0x76
    # even: round amax's mantissa to mbits (may carry), then floor
    ("e4m3", "even", 1.9375, 0x78, 0x78),  # 1.1111b carries -> 120; 248 ties -> 256
    ("e4m3", "even", 1.96875, 0x78, 0x78),  # carries; 252 -> 256
    ("e4m3", "even", 1.90625, 0x77, 0x7E),  # 1.11101b no carry -> 119; 488 saturates
    ("e4m3", "even", 1.875, 0x77, 0x7E),  # exact in e4m3 -> 119; 480 saturates
    ("e5m2", "even", 1.875, 0x71, 0x78),  # 1.111b carries at 2 bits -> 113; 30720 ties -> 32768
    ("e5m2", "even", 1.75, 0x70, 0x7B),  # 112; 57344
])
def test_ceil_and_even_spot_checks(elem, mode, v, scale, code):
    _check_block(np.full(32, v, np.float32), elem, mode, "saturate", scale, [code] * 32)


@pytest.mark.parametrize("mode", ["rceil", "floor", "ceil", "even"])
@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_scale_bytes_nonfinite_amax(elem, mode):
    out = scale_bytes(np.array([NAN, INF, 0.0], np.float32), elem, mode)
    assert out.tobytes() == b"\xff\xfe\x00"


@pytest.mark.parametrize("elem,y,code", [
    # RN ties to even inside the format, at scale 127 (s_inv = 1)
    ("e4m3", 1.0625, 0x38),  # tie 1.0 | 1.125 -> 1.0
    ("e4m3", 1.1875, 0x3A),  # tie 1.125 | 1.25 -> 1.25
    ("e4m3", 2.0 ** -10, 0x00),  # tie 0 | 2^-9 -> 0
    ("e4m3", -(2.0 ** -10), 0x80),  # -> -0
    ("e4m3", 3 * 2.0 ** -10, 0x02),  # tie 2^-9 | 2^-8 -> 2^-8 (subnormal code 2)
    ("e4m3", 5 * 2.0 ** -10, 0x02),  # tie 2*2^-9 | 3*2^-9 -> 2*2^-9
    ("e4m3", 464.0, 0x7E),  # tie 448 | 480 saturates to 448
    ("e4m3", -1e30, 0xFE),
    ("e4m3", INF, 0x7E),
    ("e4m3", -NAN, 0x7F),
    ("e5m2", 1.125, 0x3C),  # tie 1.0 | 1.25 -> 1.0
    ("e5m2", 1.375, 0x3E),  # tie 1.25 | 1.5 -> 1.5
    ("e5m2", 2.0 ** -17, 0x00),  # tie 0 | 2^-16 -> 0
    ("e5m2", 3 * 2.0 ** -17, 0x02),
    ("e5m2", 61440.0, 0x7B),
    ("e5m2", -INF, 0xFB),
    ("e5m2", NAN, 0x7F),
])
def test_encode_rounding(elem, y, code):
    assert encode(np.array([y], np.float32), elem).tobytes() == bytes([code])


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_rceil_matches_log2_formula_on_every_bf16(elem):
    # SEMANTICS 1.1: for every positive finite bf16 amax the bit rule equals
    # clamp(ceil(log2(amax/max)) + 127, 0, 254). float64 log2 is safe here: amax/max is either an exact
    # power of two (amax = 7 * 2^n, exact division) or at least 2^-9 relative away from one.
    bits = np.arange(1, 0x7F80, dtype=np.uint16)
    amax = bits.view(BF16).astype(np.float32)
    expected = np.clip(np.ceil(np.log2(amax.astype(np.float64) / ELEM_FORMATS[elem].max)) + 127, 0, 254)
    assert_bytes_equal(scale_bytes(amax, elem, "rceil"), expected.astype(np.uint8), "rceil vs log2")


# ---------------------------------------------------------------------------------------------
# shapes, axes, input dtypes


def test_blocks_along_any_axis_match_last_axis():
    rng = np.random.default_rng(7)
    x = random_magnitudes(rng, (3, 64, 5, 96))
    x[0, 0, 0, :4] = [NAN, INF, -0.0, 2.0 ** -140]
    for axis in (1, 3, -1, -3):
        t = mxfp8_quantize(x, axis=axis)
        ref = mxfp8_quantize(np.ascontiguousarray(np.moveaxis(x, axis, -1)), axis=-1)
        assert t.axis == axis % 4 and t.data.shape == x.shape
        assert_bytes_equal(np.moveaxis(t.data, axis, -1), ref.data, f"data axis={axis}")
        assert_bytes_equal(np.moveaxis(t.scale, axis, -1), ref.scale, f"scale axis={axis}")


def test_tuple_axis_each_from_original_values():
    rng = np.random.default_rng(8)
    x = random_magnitudes(rng, (96, 64))
    x[3, 5] = NAN
    row, col = mxfp8_quantize(x, axis=(-1, 0), elem="e5m2", scale_mode="floor")
    r1 = mxfp8_quantize(x, axis=-1, elem="e5m2", scale_mode="floor")
    c1 = mxfp8_quantize(x, axis=0, elem="e5m2", scale_mode="floor")
    assert (row.axis, col.axis) == (1, 0)
    assert_bytes_equal(row.data, r1.data, "row data")
    assert_bytes_equal(row.scale, r1.scale, "row scale")
    assert_bytes_equal(col.data, c1.data, "col data")
    assert_bytes_equal(col.scale, c1.scale, "col scale")
    assert row.scale.shape == (96, 2) and col.scale.shape == (3, 64)
    one = mxfp8_quantize(x, axis=(0,))
    assert isinstance(one, tuple) and len(one) == 1


@pytest.mark.parametrize("dtype", [BF16, np.float16])
def test_narrow_inputs_widen_exactly(dtype):
    rng = np.random.default_rng(9)
    with np.errstate(over="ignore"):  # fp16 rows beyond 65504 become Inf: more special values
        x = random_magnitudes(rng, (64, 64), dtype=dtype)
    x[0, :3] = [np.inf, np.nan, -0.0]
    for mode in ("rceil", "even"):
        a = mxfp8_quantize(x, axis=(1, 0), scale_mode=mode)
        b = mxfp8_quantize(x.astype(np.float32), axis=(1, 0), scale_mode=mode)
        for ta, tb in zip(a, b):
            assert_bytes_equal(ta.data, tb.data)
            assert_bytes_equal(ta.scale, tb.scale)


def test_swizzled_layout_output():
    rng = np.random.default_rng(10)
    x = random_magnitudes(rng, (160, 96))
    c = mxfp8_quantize(x)
    s = mxfp8_quantize(x, scale_layout="swizzled")
    assert s.scale_layout == "swizzled" and s.scale.shape == (256, 4)
    assert_bytes_equal(s.data, c.data)
    # S[i, j] lands at the SEMANTICS 3.3 offset
    i, j = np.meshgrid(np.arange(160), np.arange(3), indexing="ij")
    off = ((i // 128) * 1 + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4
    assert_bytes_equal(s.scale.reshape(-1)[off], c.scale)


def test_special_values_all_policies_consistent():
    # every special value in a block of normal data: codes of finite neighbours don't change when a
    # NaN is added under saturate (NaN ignored), and the block turns fully NaN under nan_block
    vals = special_values_f32()
    x = np.tile(np.linspace(-3, 3, 32, dtype=np.float32), (vals.size, 1))
    x[:, 7] = vals
    sat = mxfp8_quantize(x)
    nb = mxfp8_quantize(x, nonfinite="nan_block")
    bad = ~np.isfinite(vals)
    assert (nb.scale[bad, 0] == 0xFF).all()
    assert (nb.data[bad].view(np.uint8) == 0x7F).all()
    assert_bytes_equal(nb.data[~bad], sat.data[~bad])
    assert_bytes_equal(nb.scale[~bad], sat.scale[~bad])
    nan_rows = np.isnan(vals)
    x2 = x[nan_rows].copy()
    x2[:, 7] = 0.0
    assert_bytes_equal(sat.scale[nan_rows], mxfp8_quantize(x2).scale)


# ---------------------------------------------------------------------------------------------
# dequantize


def _mx(codes, scale, elem="e4m3"):
    data = np.array(codes, np.uint8).reshape(1, 32).view(F8E4M3 if elem == "e4m3" else F8E5M2)
    return MXTensor(data, np.array([[scale]], np.uint8), 1, elem)


@pytest.mark.parametrize("elem,code,scale,bits", [
    ("e4m3", 0x38, 127, 0x3F800000),  # 1.0
    ("e4m3", 0x38, 0, 0x00400000),  # scale 0 means 2^-127, not zero
    ("e4m3", 0x01, 0, 0x00002000),  # 2^-9 * 2^-127 = 2^-136, exact subnormal
    ("e4m3", 0x80, 127, 0x80000000),  # -0.0
    ("e4m3", 0x7E, 254, 0x7F800000),  # 448 * 2^127 exceeds fp32 -> Inf (module docstring)
    ("e4m3", 0xFE, 135, 0xC7E00000),  # -448 * 2^8 = -1.75 * 2^16
    ("e5m2", 0x7B, 127, 0x47600000),  # 57344
    ("e5m2", 0x01, 0, 0x00000040),  # 2^-16 * 2^-127 = 2^-143 = 2^6 * 2^-149
])
def test_dequantize_fp32_table(elem, code, scale, bits):
    out = mxfp8_dequantize(_mx([code] * 32, scale, elem))
    assert out.dtype == np.float32
    assert_bytes_equal(out.view(np.uint32), np.full((1, 32), bits, np.uint32))


@pytest.mark.parametrize("code,bits", [
    (0x04, 0x0000),  # 2^-7 * 2^-127 = 2^-134: half the smallest bf16 subnormal, ties to 0
    (0x05, 0x0001),  # 0.625 * 2^-133 -> 2^-133
    (0x03, 0x0000),  # 0.375 * 2^-133 -> 0
    (0x0C, 0x0002),  # 1.5 * 2^-133 ties -> 2 * 2^-133
    (0x38, 0x0040),  # 2^-127
    (0xB8, 0x8040),
])
def test_dequantize_bf16_rounds_once(code, bits):
    out = mxfp8_dequantize(_mx([code] * 32, 0), out_dtype="bfloat16")
    assert out.dtype == BF16
    assert_bytes_equal(out.view(np.uint16), np.full((1, 32), bits, np.uint16))


def test_dequantize_nan_scale_and_nan_code():
    out = mxfp8_dequantize(_mx([0x38] * 32, 255))
    assert np.isnan(out).all()
    out = mxfp8_dequantize(_mx([0x7F] + [0x38] * 31, 127))
    assert np.isnan(out[0, 0]) and (out[0, 1:] == 1.0).all()


def test_dequantize_swizzled_equals_compact():
    rng = np.random.default_rng(11)
    x = random_magnitudes(rng, (64, 3, 64))
    for axis in (0, 2):
        c = mxfp8_quantize(x, axis=axis)
        s = mxfp8_quantize(x, axis=axis, scale_layout="swizzled")
        for od in ("float32", "bfloat16"):
            assert_bytes_equal(mxfp8_dequantize(s, od), mxfp8_dequantize(c, od))


# ---------------------------------------------------------------------------------------------
# properties

_f32_finite = st.floats(width=32, allow_nan=False, allow_infinity=False)
_blocks = hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.just(32)), elements=_f32_finite)
_exponent_shift = st.integers(-60, 60)


def _scaled(x, shift):
    # hypothesis floats cluster near a few magnitudes; shifting by 2^k spreads blocks over binades
    with np.errstate(over="ignore", under="ignore"):
        y = (x.astype(np.float64) * 2.0 ** shift).astype(np.float32)
    return np.where(np.isfinite(y), y, np.float32(0))


@settings(max_examples=80, deadline=None)
@given(_blocks, _exponent_shift, st.sampled_from(["e4m3", "e5m2"]))
def test_rceil_never_saturates_finite(x, shift, elem):
    # With the rceil byte, every scaled value stays below the midpoint between max and the next
    # binade step (464 for e4m3, 61440 for e5m2), so clipping never changes a rounding result.
    x = _scaled(x, shift)
    t = mxfp8_quantize(x, elem=elem)
    e = t.scale.astype(np.int64)
    y = x.astype(np.float64) * np.exp2(127.0 - e)  # exact in float64 (e in 0..254)
    limit = {"e4m3": 464.0, "e5m2": 61440.0}[elem]
    assert (np.abs(y) < limit).all()
    assert (t.scale < 0xFE).all()


@settings(max_examples=80, deadline=None)
@given(_blocks, _exponent_shift, st.sampled_from(["e4m3", "e5m2"]),
       st.sampled_from([np.float32, BF16, np.float16]))
# a block near fp32's max: its code rounds up to 2.0 under the largest scale, 2^128 past fp32's range
@example(np.full((1, 32), 3.2964854e38, np.float32), 0, "e4m3", np.float32)
def test_roundtrip_within_half_ulp(x, shift, elem, dtype):
    # Bound: |dq(q(x)) - x| <= (half an element ulp at y's binade + 2^-150) * 2^(e-127), y = x*2^(127-e).
    # An element ulp is 2^(max(floor(log2|y|), emin) - mbits): half of it is 2^-4 of y's binade for
    # e4m3 (3 mantissa bits), 2^-3 for e5m2 (2 bits), and the fixed subnormal half-step below emin.
    # The 2^-150 term covers y itself rounding into fp32's subnormal range (blocks with huge amax).
    with np.errstate(over="ignore"):
        x = _scaled(x, shift).astype(dtype)
    x = np.where(np.isfinite(x.astype(np.float32)), x, dtype(0)).astype(dtype)
    t = mxfp8_quantize(x, elem=elem)
    fmt = ELEM_FORMATS[elem]
    emin = {"e4m3": -6, "e5m2": -14}[elem]  # smallest normal exponent (1 - bias)
    x64 = x.astype(np.float32).astype(np.float64)
    e = np.repeat(t.scale.astype(np.int64), 32, axis=1)
    y = np.abs(x64) * np.exp2(127.0 - e)
    with np.errstate(divide="ignore"):
        binade = np.maximum(np.floor(np.log2(np.where(y > 0, y, 1.0))), emin)
    bound = (np.exp2(binade - fmt.mbits - 1) + 2.0 ** -150) * np.exp2(e - 127.0)
    # the bound holds for the exact dequantized value code * 2^(e-127); the fp32 dequantize is that value
    # rounded once, so past fp32's range (a block rounding up under the top scale) it is +-Inf
    exact = t.data.astype(np.float64) * np.exp2(e - 127.0)
    assert (np.abs(exact - x64) <= bound).all()
    dq = mxfp8_dequantize(t)
    with np.errstate(over="ignore"):
        assert_bytes_equal(dq, exact.astype(np.float32), "dequantized = exact value rounded to fp32")


# ---------------------------------------------------------------------------------------------
# bad inputs: one per error, message names the argument

X = np.zeros((4, 64), np.float32)


@pytest.mark.parametrize("kwargs,exc,name", [
    (dict(x=np.zeros((4, 64), np.int64)), TypeError, "x"),
    (dict(x=[[0.0] * 32]), TypeError, "x"),
    (dict(x=np.zeros((4, 33), np.float32)), ValueError, "x"),
    (dict(x=X, axis=2), ValueError, "axis"),
    (dict(x=X, axis=1.0), TypeError, "axis"),
    (dict(x=X, axis=()), ValueError, "axis"),
    (dict(x=X, axis=(1, -1)), ValueError, "axis"),
    (dict(x=X, elem="e3m2"), ValueError, "elem"),
    (dict(x=X, scale_mode="nearest"), ValueError, "scale_mode"),
    (dict(x=X, nonfinite="ignore"), ValueError, "nonfinite"),
    (dict(x=X, scale_layout="tiled"), ValueError, "scale_layout"),
])
def test_quantize_bad_inputs(kwargs, exc, name):
    for fn in (mxfp8_quantize, validate_mxfp8_quantize):
        with pytest.raises(exc, match=f"^{name}:"):
            fn(**kwargs)


def test_blocked_axis_error_names_axis_and_length():
    with pytest.raises(ValueError, match=r"^x: blocked axis 0 .* has length 48, expected a multiple of 32"):
        mxfp8_quantize(np.zeros((48, 64), np.float32), axis=(-1, 0))


def test_dequantize_bad_inputs():
    t = mxfp8_quantize(X)
    cases = [
        ((X,), {}, TypeError, "t"),
        ((t.replace(data=t.data.view(np.uint8)),), {}, TypeError, "t"),
        ((t.replace(data=t.data.view(F8E5M2)),), {}, TypeError, "t"),
        ((t,), dict(out_dtype="float16"), ValueError, "out_dtype"),
    ]
    for args, kw, exc, name in cases:
        for fn in (mxfp8_dequantize, validate_mxfp8_dequantize):
            with pytest.raises(exc, match=f"^{name}:"):
                fn(*args, **kw)


# ---------------------------------------------------------------------------------------------
# speed (a stated requirement: fp32 [4096, 7168] rowwise + columnwise in < 2 s on the 2-core CI box)


def test_speed_4096x7168_rowwise_and_columnwise():
    # Measured as this process's CPU time, best of three: the spec runs single-threaded NumPy, and on
    # the shared 2-core box wall time mostly measures the neighbours' load. On an idle machine the two
    # agree (about 0.6 s here).
    x = np.random.default_rng(0).standard_normal((4096, 7168)).astype(np.float32)
    best_cpu = best_wall = float("inf")
    for _ in range(3):
        c0, w0 = time.process_time(), time.perf_counter()
        mxfp8_quantize(x, axis=-1)
        mxfp8_quantize(x, axis=0)
        best_cpu = min(best_cpu, time.process_time() - c0)
        best_wall = min(best_wall, time.perf_counter() - w0)
    assert best_cpu < 2.0, f"rowwise + columnwise took {best_cpu:.2f} s CPU ({best_wall:.2f} s wall)"
