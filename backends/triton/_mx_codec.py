"""Element-format generic MXFP8 device functions (e4m3 and e5m2, every scale mode of SEMANTICS 1.1-1.4),
shared by the quantize, mla_kv and rmsnorm kernels: E8M0 scale bytes, exact scale multipliers, fp8 codes,
the tile loads, block amaxes and code stores of a quantize pass, and the per-format constexpr
constants they take (`elem_meta`). Bit-exact to spec.quantize; the e4m3-only
forms the GEMM and fused kernels use are in _mxfp8.py.
"""
from __future__ import annotations

import functools
import struct
from typing import Dict

import torch
import triton
import triton.language as tl

from spec.constants import ELEM_FORMATS

from ._common import device_capability, env_flag, interpret_mode

F32_ABS_MASK = tl.constexpr(0x7FFFFFFF)
F32_INF_BITS = tl.constexpr(0x7F800000)
F32_MANT_MASK = tl.constexpr(0x007FFFFF)
F32_QNAN_BITS = tl.constexpr(0x7FC00000)
HALF_SUBNORMAL_MANT = tl.constexpr(0x00400000)  # fp32 bits of 2^-127
NAN_CODE = tl.constexpr(0x7F)


def _f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


@functools.lru_cache(maxsize=None)
def elem_meta(elem: str) -> Dict[str, int]:
    """Constexpr constants of one element format (all integers: fp32 constants travel as bits). Kept per
    format (callers unpack it, never change it): every quantize launch asks."""
    fmt = ELEM_FORMATS[elem]
    ebias = (1 << (7 - fmt.mbits)) // 2 - 1  # e4m3: 7, e5m2: 15
    shift = 23 - fmt.mbits
    # Subnormal codes are RN(|y| / 2^(1 - ebias - mbits)): adding 2^(1 - ebias - mbits + 23) rounds |y|
    # to that grid in one fp32 add (ties to even), and the integer difference of the bits is the code.
    sub_magic = 2.0 ** (1 - ebias - fmt.mbits + 23)
    return dict(
        IS_E5M2=elem == "e5m2",
        INV_MAX_BITS=fmt.inv_max_bits,
        MAX_BITS=_f32_bits(fmt.max),
        EMAX=fmt.emax,
        MBITS=fmt.mbits,
        CODE_SHIFT=shift,
        ROUND_HALF=(1 << (shift - 1)) - 1,
        EXP_REBIAS=(127 - ebias) << fmt.mbits,
        MIN_NORMAL_BITS=_f32_bits(2.0 ** (1 - ebias)),
        SUB_MAGIC_BITS=_f32_bits(sub_magic),
    )


def use_hw_cvt(device: torch.device) -> bool:
    """HW_CVT for encode and the decoders: the hardware fp8 / bf16 cvt on sm90+ CUDA, unless
    MXMLA_TRITON_SOFT_FP8=1 asks for the bit versions (the interpreter always gets those)."""
    if interpret_mode() or device.type != "cuda" or env_flag("MXMLA_TRITON_SOFT_FP8", False):
        return False
    return device_capability(device) >= (9, 0)


@triton.jit
def scale_byte(amax, nonfinite, INV_MAX_BITS: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr,
               SCALE_MODE: tl.constexpr, NAN_BLOCK: tl.constexpr):
    """E8M0 byte (int32 lanes) of blocks with NaN-free amax >= 0 (SEMANTICS 1.1-1.3)."""
    amax_bits = amax.to(tl.int32, bitcast=True)
    if SCALE_MODE == 0:  # rceil: p = RN_f32(amax * R), then the exponent-bit rule on p
        r = tl.full(amax.shape, INV_MAX_BITS, tl.int32).to(tl.float32, bitcast=True)
        p = (amax * r).to(tl.int32, bitcast=True)
        biased = (p >> 23) & 0xFF
        mant = p & F32_MANT_MASK
        e = biased + (mant > 0).to(tl.int32)
        e = tl.where(biased >= 254, 254, e)  # p >= 2^127 or p = +Inf (amax = Inf): 254
        e = tl.where((biased == 0) & (mant <= HALF_SUBNORMAL_MANT), 0, e)  # p <= 2^-127
    else:
        bits = amax_bits
        if SCALE_MODE == 3:  # even: round amax's mantissa to MBITS first; a carry bumps the exponent
            bits = (bits + (1 << (22 - MBITS))) & (-(1 << (23 - MBITS)))
        e = ((bits >> 23) & 0x1FF) - EMAX
        if SCALE_MODE == 2:  # ceil
            e = e + ((bits & F32_MANT_MASK) != 0).to(tl.int32)
        e = tl.maximum(e, 0)
        e = tl.where(amax_bits == F32_INF_BITS, 254, e)  # an Inf block saturates (1.2, 1.3)
    if NAN_BLOCK:
        e = tl.where(nonfinite, 255, e)
    return e


@triton.jit
def scale_multiplier(e, NAN_BLOCK: tl.constexpr):
    """fp32 s_inv = exact 2^(127 - e): e = 254 -> the subnormal 2^-127, e = 255 -> NaN (SEMANTICS 1.4)."""
    bits = tl.where(e <= 253, (254 - e) << 23, HALF_SUBNORMAL_MANT)
    if NAN_BLOCK:
        bits = tl.where(e == 255, F32_QNAN_BITS, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def encode_bits(y, MAX_BITS: tl.constexpr, CODE_SHIFT: tl.constexpr, ROUND_HALF: tl.constexpr,
                EXP_REBIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr):
    """fp8 codes (int32 lanes) of fp32 y on integer bits: RN-even with saturation to +-max (Inf -> max),
    NaN -> 0x7F, signed zeros and subnormal codes kept (SEMANTICS 1.4)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80  # arithmetic shift: the sign lands in bit 7
    mag = bits & F32_ABS_MASK
    is_nan = mag > F32_INF_BITS
    mag = tl.minimum(mag, MAX_BITS)  # saturate: integer order of |y| bits is the float order
    # normal codes: drop 23 - mbits mantissa bits rounding to nearest even (a carry bumps the exponent,
    # as RN does), then rebias the exponent from 127 to the format's bias
    normal = ((mag + ROUND_HALF + ((mag >> CODE_SHIFT) & 1)) >> CODE_SHIFT) - EXP_REBIAS
    # subnormal codes: one fp32 add of 2^k rounds |y| to the subnormal grid (ties to even)
    magic = tl.full(y.shape, SUB_MAGIC_BITS, tl.int32).to(tl.float32, bitcast=True)
    sub = (mag.to(tl.float32, bitcast=True) + magic).to(tl.int32, bitcast=True) - SUB_MAGIC_BITS
    code = tl.where(mag < MIN_NORMAL_BITS, sub, normal) | sign
    return tl.where(is_nan, NAN_CODE, code)


@triton.jit
def encode(y, IS_E5M2: tl.constexpr, MAX_BITS: tl.constexpr, CODE_SHIFT: tl.constexpr,
           ROUND_HALF: tl.constexpr, EXP_REBIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr,
           SUB_MAGIC_BITS: tl.constexpr, HW_CVT: tl.constexpr):
    """uint8 fp8 codes of fp32 y: the hardware cvt (HW_CVT, sm90+; its NaN lanes rewritten to 0x7F), else
    encode_bits on the integer bits. Both RN-even with saturation."""
    if HW_CVT:
        lim = tl.full(y.shape, MAX_BITS, tl.int32).to(tl.float32, bitcast=True)
        clamped = tl.minimum(tl.maximum(y, -lim), lim)  # maxnum/minnum: NaN lanes become +-max here
        if IS_E5M2:
            code = clamped.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        else:
            code = clamped.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        return tl.where(y != y, NAN_CODE, code).to(tl.uint8)
    else:
        code = encode_bits(y, MAX_BITS, CODE_SHIFT, ROUND_HALF, EXP_REBIAS, MIN_NORMAL_BITS, SUB_MAGIC_BITS)
        return code.to(tl.uint8)


# --------------------------------------------------------------------------------------------------
# loading, block amaxes and the store of one quantized tile (the quantize and mla_kv kernels)
# --------------------------------------------------------------------------------------------------
@triton.jit
def load_f32(ptrs, mask, X_KIND: tl.constexpr, MASKED: tl.constexpr):
    """Load and widen to fp32 exactly. bf16 arrives as int16 bits: bits << 16 is its fp32 value
    (Triton's interpreter flushes bf16 subnormals in its cast; on the GPU this is the same shift)."""
    if MASKED:
        v = tl.load(ptrs, mask=mask, other=0)
    else:
        v = tl.load(ptrs)
    if X_KIND == 0:
        return (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


@triton.jit
def block_amax(x3, AXIS: tl.constexpr):
    """amax of each block of x3 along AXIS as SEMANTICS 1.1 step 1 defines it: NaN ignored, starting
    from +0. NaN lanes are replaced by 0 before the max, so nothing depends on how max treats NaN
    operands (NumPy's fmax, used by the interpreter, returns NaN for signaling NaNs)."""
    return tl.max(tl.where(x3 != x3, 0.0, tl.abs(x3)), axis=AXIS)


@triton.jit
def max_nan(a, b):
    """max that propagates NaN (PTX max.NaN.f32): a block's result is NaN iff it holds a NaN."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def amax_nan(x3, AXIS: tl.constexpr, INTERPRET: tl.constexpr):
    """Per-block max |x| that is NaN iff the block holds a NaN (and Inf iff it holds an Inf but no
    NaN). One max.NaN per element on the GPU; the interpreter runs a custom-combine reduction one
    pair at a time in Python, so there it is built from two vectorised reductions instead."""
    if INTERPRET:
        amax = tl.max(tl.abs(x3), axis=AXIS)
        has_nan = tl.max((x3 != x3).to(tl.int32), axis=AXIS) > 0
        return tl.where(has_nan, float("nan"), amax)
    else:
        return tl.reduce(tl.abs(x3), AXIS, max_nan)


@triton.jit
def emit_codes(x3, amax, nonfinite, offs, mask, code_ptr, s_ptr, s_off, s_mask, AXIS: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, FINITE: tl.constexpr, MASKED: tl.constexpr,
          SCALE_MODE: tl.constexpr, NAN_BLOCK: tl.constexpr, HW_CVT: tl.constexpr, IS_E5M2: tl.constexpr,
          INV_MAX_BITS: tl.constexpr, MAX_BITS: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr,
          CODE_SHIFT: tl.constexpr, ROUND_HALF: tl.constexpr, EXP_REBIAS: tl.constexpr,
          MIN_NORMAL_BITS: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr):
    """Scale bytes, codes and stores of one direction. x3: the tile viewed with blocks along AXIS;
    amax / nonfinite: per block. FINITE: the tile holds no NaN / Inf (module docstring)."""
    if FINITE and SCALE_MODE == 0:
        # rceil on a finite amax, shortened: biased + (mant > 0) is (bits + 0x7FFFFF) >> 23, and
        # p <= 2^-127 gives 0. p stays below 2^126 (amax <= fp32 max), so e <= 253: no clamp at 254,
        # and s_inv = 2^(127 - e) is always the normal number with biased exponent 254 - e.
        r = tl.full(amax.shape, INV_MAX_BITS, tl.int32).to(tl.float32, bitcast=True)
        p = (amax * r).to(tl.int32, bitcast=True)
        e = tl.where(p <= HALF_SUBNORMAL_MANT, 0, (p + F32_MANT_MASK) >> 23)
        s_inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    else:
        e = scale_byte(amax, nonfinite, INV_MAX_BITS, EMAX, MBITS, SCALE_MODE, NAN_BLOCK)
        s_inv = scale_multiplier(e, NAN_BLOCK)
    y = tl.reshape(x3 * tl.expand_dims(s_inv, AXIS), [BM, BN])
    if HW_CVT and FINITE:
        # finite y: cvt.rn.satfinite rounds to nearest even and saturates finite overflow to +-max,
        # which is exactly clamp-then-round; no NaN can occur
        if IS_E5M2:
            codes = y.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        else:
            codes = y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        codes = encode(y, IS_E5M2, MAX_BITS, CODE_SHIFT, ROUND_HALF, EXP_REBIAS, MIN_NORMAL_BITS,
                        SUB_MAGIC_BITS, HW_CVT)
    if MASKED:
        tl.store(code_ptr + offs, codes, mask=mask)
        tl.store(s_ptr + s_off, e.to(tl.uint8), mask=s_mask)
    else:
        tl.store(code_ptr + offs, codes)
        tl.store(s_ptr + s_off, e.to(tl.uint8))
