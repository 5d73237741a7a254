"""MXFP8 device functions shared by the Triton kernels: E8M0 scale bytes, scale multipliers and e4m3
element codes, bit-exact to spec.quantize (SEMANTICS.md 1.1, 1.3 "saturate", 1.4).

Everything works on fp32 bit patterns held in int32 lanes, so the tested path (Triton's CPU
interpreter) and the GPU path compute the same bits. One exception, chosen by the caller through
`HW_CVT`: the final fp32 -> e4m3 rounding. On the GPU it is the hardware `cvt.rn.satfinite.e4m3x2.f32`
(round to nearest even, saturating), a couple of instructions per element where a compute-bound
epilogue cannot afford the ~15 integer ops of the bit version. Triton's interpreter gets that
conversion wrong (it truncates and overflows to NaN), so interpreter runs use the bit version
(`encode_e4m3_bits`), which is the definition spelled out; the two agree on every fp32 input
(RN-even, clamp to +-448, NaN -> 0x7F, signed zero kept), and the GPU conformance tests check it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import env_flag, interpret_mode

# fp32 bit patterns (SEMANTICS 1.1 / 1.4).
F32_ABS_MASK = tl.constexpr(0x7FFFFFFF)
F32_INF_BITS = tl.constexpr(0x7F800000)
F32_MANT_MASK = tl.constexpr(0x007FFFFF)
HALF_SUBNORMAL_MANT = tl.constexpr(0x00400000)  # fp32 bits of 2^-127
E4M3_INV_MAX_BITS = tl.constexpr(0x3B124925)  # RN_f32(1/448), the rceil multiplier R
E4M3_MAX = tl.constexpr(448.0)
E4M3_MAX_BITS = tl.constexpr(0x43E00000)  # fp32 bits of 448
E4M3_MIN_NORMAL_BITS = tl.constexpr(0x3C800000)  # fp32 bits of 2^-6
E4M3_NAN_CODE = tl.constexpr(0x7F)


@triton.jit
def abs_bits_ignoring_nan(v):
    """int32 bits of |v| with NaN lanes replaced by +0. For non-negative floats the integer order of
    the bits is the float order, so an integer max over these is the amax of SEMANTICS 1.1 step 1
    (NaN ignored, starting from +0; Inf gives the Inf bits)."""
    bits = v.to(tl.int32, bitcast=True) & F32_ABS_MASK
    return tl.where(bits > F32_INF_BITS, 0, bits)


@triton.jit
def rceil_scale_from_amax_bits(amax_bits):
    """E8M0 byte (int32 lanes, 0..255) of an e4m3 block from its amax bits, "rceil" mode
    (SEMANTICS 1.1 steps 2-3): p = RN_f32(amax * R), then the exponent-bit rule on p's bits.
    The rule in a few integer ops: (bits + 0x7FFFFF) >> 23 is E + (M > 0) (the carry out of the
    mantissa); clamping the bits at 2^127 first covers E = 254 with M > 0 and p = +Inf (E = 255, M = 0;
    the saturate policy's Inf block) -> 254; p <= 2^-127 (bits <= 0x400000, subnormal p) gives 0. A NaN p (only from a NaN
    amax, which amax_bits_ignoring_nan never returns) gives 255."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    r = tl.full(amax_bits.shape, E4M3_INV_MAX_BITS, tl.int32).to(tl.float32, bitcast=True)
    p = (amax * r).to(tl.int32, bitcast=True) & F32_ABS_MASK  # one fp32 multiply, never a division or log2
    e = (tl.minimum(p, 0x7F000000) + F32_MANT_MASK) >> 23  # E >= 254 (incl. Inf) -> 254, no int overflow
    e = tl.where(p <= HALF_SUBNORMAL_MANT, 0, e)
    return tl.where(p > F32_INF_BITS, 255, e)


@triton.jit
def scale_multiplier(e):
    """fp32 s_inv = exact 2^(127 - e) for E8M0 bytes e in int32 lanes (e = 254 -> the subnormal
    2^-127, e = 255 -> NaN), the factor the element codes are computed with (SEMANTICS 1.4)."""
    bits = tl.where(e <= 253, (254 - e) << 23, HALF_SUBNORMAL_MANT)
    bits = tl.where(e == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def scale_value(e):
    """fp32 2^(e - 127) for E8M0 bytes e in int32 lanes (e = 0 -> the subnormal 2^-127, 255 -> NaN):
    the factor a dequantized element carries (SEMANTICS 2)."""
    bits = tl.where(e == 0, HALF_SUBNORMAL_MANT, e << 23)
    bits = tl.where(e == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def encode_e4m3_bits(y):
    """uint8 e4m3 codes of fp32 y on integer bits: RN-even with saturation to +-448 (Inf -> +-448),
    NaN -> 0x7F, the sign of zero kept, subnormal codes produced normally (SEMANTICS 1.4)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80  # arithmetic shift: negative lanes give ...1xxxxxxx
    mag = bits & F32_ABS_MASK
    is_nan = mag > F32_INF_BITS
    mag = tl.minimum(mag, E4M3_MAX_BITS)  # saturate (integer order = float order for |y|)
    # Normal range (|y| >= 2^-6): keep 3 mantissa bits, rounding to nearest even on the bits; a carry
    # bumps the exponent, as RN does. Rebias the exponent from 127 to 7: subtract 120 << 3.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal range: the code is RN_even(|y| * 2^9), an integer 0..8 (8 is the code of 2^-6).
    # |y| * 512 is exact; adding 2^23 rounds it to an integer in fp32 (ties to even), read off the bits.
    scaled = mag.to(tl.float32, bitcast=True) * 512.0 + 8388608.0
    subnormal = scaled.to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(mag < E4M3_MIN_NORMAL_BITS, subnormal, normal) | sign
    code = tl.where(is_nan, E4M3_NAN_CODE, code)
    return code.to(tl.uint8)


@triton.jit
def encode_e4m3(y, HW_CVT: tl.constexpr):
    """uint8 e4m3 codes of fp32 y (same result as encode_e4m3_bits). HW_CVT: use the GPU's
    cvt.rn.satfinite (module docstring); the explicit clamp makes saturation independent of the
    conversion's overflow rule, and NaN lanes (which the clamp may turn into +-448) are fixed after."""
    if HW_CVT:
        clamped = tl.minimum(tl.maximum(y, -E4M3_MAX), E4M3_MAX)
        code = clamped.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        return tl.where(y != y, E4M3_NAN_CODE, code).to(tl.uint8)
    else:
        return encode_e4m3_bits(y)



@triton.jit
def amax_bits_ignoring_nan(v, axis: tl.constexpr):
    """int32 bits of the NaN-ignoring amax of v along `axis` (SEMANTICS 1.1 step 1) with a float max:
    tl.max lowers to maxnum (PTX max.f32, NumPy nanmax in the interpreter), which returns the non-NaN
    operand, and |.| folds into the max instruction -- one instruction per element instead of the
    four of the integer version. A block of only NaN reduces to NaN, which is replaced by +0 here
    (per block, not per element)."""
    amax = tl.max(tl.abs(v), axis=axis)
    return tl.where(amax == amax, amax, 0.0).to(tl.int32, bitcast=True)


@triton.jit
def encode_e4m3_arith(y, HW_CVT: tl.constexpr):
    """encode_e4m3 for values produced by GPU arithmetic in this kernel family (not loaded raw): on the
    GPU every fp32 NaN result of an arithmetic instruction is the canonical positive 0x7FFFFFFF, and
    cvt.rn.satfinite.e4m3x2.f32 saturates finite overflow and Inf to +-448 itself, so the conversion
    alone gives the spec's bytes (a positive NaN can only be 0x7F in e4m3) -- no clamp, no NaN select.
    Callers must only pass y = (arithmetic result) * s_inv."""
    if HW_CVT:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return encode_e4m3_bits(y)


@triton.jit
def decode_e4m3(codes):
    """fp32 value of uint8 e4m3 codes, exact (NaN code -> NaN), on the bits: sign | mag << 20 is the value
    times 2^-120 for normal and subnormal codes alike, and the multiply by 2^120 is exact. Integer ops
    on purpose, also on the GPU: for codes just made by the fp32 -> e4m3 cvt in the same kernel, the
    cast back through Triton's fp8 type gave values that were not the codes' on the H200 (Triton 3.6),
    and the interpreter's fp8 cast is wrong."""
    c = codes.to(tl.int32)
    mag = c & 0x7F
    v = ((mag << 20) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120
    return tl.where(mag == E4M3_NAN_CODE, float("nan"), v)


@triton.jit
def e4m3_value(y):
    """fp32 value of the e4m3 code of fp32 y -- decode_e4m3(encode_e4m3(y)), bit for bit: RN-even with
    saturation to +-448, NaN -> NaN, the sign of zero kept -- in ~9 fp32 / integer ops instead of an
    encode and a decode (~25). Rounding |y| to e4m3's 3 mantissa bits is one add and one subtract of
    c = 2^(E + 20), E = max(exponent of |y|, -6): the sum's ulp is then 2^(E - 3), e4m3's quantum in that
    binade (and 2^-9, the subnormal quantum, below 2^-6), so the fp32 add rounds to the grid, ties to
    even, and a carry to 2^(E + 1) stays exact. Clamping the bits of |y| at 448's first covers
    saturation, Inf and NaN (whose lanes are replaced after) without an overflow of c."""
    bits = y.to(tl.int32, bitcast=True)
    mag = tl.minimum(bits & F32_ABS_MASK, E4M3_MAX_BITS)
    c = (tl.maximum(mag & F32_INF_BITS, E4M3_MIN_NORMAL_BITS) + (20 << 23)).to(tl.float32, bitcast=True)
    r = (mag.to(tl.float32, bitcast=True) + c) - c
    r = (r.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(y != y, float("nan"), r)


@triton.jit
def bf16_unsafe(codes, e, LO: tl.constexpr, HI: tl.constexpr):
    """int32 1 where dequantizing a code exactly to bf16 is not guaranteed: a nonzero code under a scale
    byte outside [LO, HI] (a zero code is +-0 under any finite scale: the all-zero blocks that rceil
    gives byte 0, e.g. the gradient rows of a fully masked query, stay on the fast path). Non-finite
    values are the caller's check."""
    return (((e < LO) | (e > HI)) & ((codes.to(tl.int32) & 0x7F) != 0)).to(tl.int32)


# --------------------------------------------------------------------------------------------------
# one MX block's partial sum on the tensor cores
# --------------------------------------------------------------------------------------------------
@triton.jit
def mx_block_dot(a, b_t, WIDEN_F16: tl.constexpr):
    """fp32 partial sum of one 32-wide MX block: a [M, 32] x b_t [32, N] fp8 codes (scales applied by
    the caller). WIDEN_F16 widens the codes to fp16 first -- exact: every e4m3 and e5m2 value, Inf and
    NaN included, is an fp16 value (the hardware cvt.f16x2.e4m3x2 / e5m2x2) -- so the products (<= 8
    significant bits, exact) are summed by the fp16 MMA's fp32 accumulator. bf16 would do as well
    arithmetically, but Triton's e5m2 -> bf16 conversion on sm90 turned the Inf code into 65536 on the
    H200. Without WIDEN_F16 the fp8 MMA sums the block, and on sm89/sm90 that accumulator keeps fewer
    bits than fp32 (the DeepSeek-V3 report measures ~14 on H800; on the H200 this project's
    random-input bounds, derived for fp32 summation, failed with it). See fp8_mma_widened()."""
    if WIDEN_F16:
        return tl.dot(a.to(tl.float16), b_t.to(tl.float16))
    else:
        return tl.dot(a, b_t)


def fp8_mma_widened(device) -> bool:
    """WIDEN_F16 for mx_block_dot: on CUDA by default (fp32-accurate block sums, at the fp16 tensor-core
    rate); MXMLA_TRITON_FP8_MMA=1 opts into the fp8 MMA (twice the tensor-core rate, narrower
    accumulator: outside the GEMM bound of tests/conformance/test_gemm.py). Off under the interpreter,
    whose fp8 dot is an exact NumPy product."""
    if getattr(device, "type", device) != "cuda" or interpret_mode():
        return False
    return not env_flag("MXMLA_TRITON_FP8_MMA", False)
