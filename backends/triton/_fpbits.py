"""Exact float conversions written on integer bits, shared by the Triton kernels.

Why not `.to(tl.bfloat16)`: on the GPU it is cvt.rn (correct), but Triton's interpreter (the CPU test
path) truncates fp32 -> bf16, or with fp_downcast_rounding="rtne" rounds half up without carrying
into the exponent. Doing the bf16 conversions on the bits makes the tested code path the GPU's code
path; the cost (a few integer ops per element) hides under the memory traffic of these kernels.
fp16 uses the native cast: cvt.rn.f16.f32 on the GPU and NumPy's correct astype in the interpreter.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def widen_f32(v):
    """Exact widening of a bf16 / fp16 / fp32 tensor to fp32 (bf16 by shifting its bits)."""
    if v.dtype == tl.bfloat16:
        bits = v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


@triton.jit
def round_f32(v, OUT_DTYPE: tl.constexpr):
    """One round-to-nearest-even of fp32 v into OUT_DTYPE (fp32: unchanged). NaN lanes come out as
    a quiet NaN of OUT_DTYPE with v's sign (bf16: the top half of v's bits with the quiet bit set);
    callers that need canonical NaN bits use round_f32_canonical_nan."""
    if OUT_DTYPE == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        # Add half an ulp of bf16 minus one, plus the bit that decides ties to even; the carry may
        # bump the exponent (and overflow to Inf), exactly as RN does. A NaN's carry could reach the
        # sign or wrap (0x7FFFFFFF -> -0), so NaN lanes keep their top half, made quiet.
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(v != v, (bits >> 16) | 0x40, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif OUT_DTYPE == tl.float16:
        return v.to(tl.float16)
    else:
        return v


@triton.jit
def round_bf16(v, HW_CVT: tl.constexpr):
    """One RN of fp32 v to bf16: the GPU's cvt.rn (HW_CVT), or round_f32's bit version (the interpreter's
    cast truncates)."""
    if HW_CVT:
        return v.to(tl.bfloat16)
    else:
        return round_f32(v, tl.bfloat16)


@triton.jit
def round_f32_canonical_nan(v, OUT_DTYPE: tl.constexpr):
    """round_f32, with every NaN written as OUT_DTYPE's positive quiet NaN (fp32 0x7FC00000,
    bf16 0x7FC0, fp16 0x7E00): NaN bits after GPU arithmetic differ from the CPU's."""
    y = round_f32(v, OUT_DTYPE)
    if OUT_DTYPE == tl.float32:
        bits = y.to(tl.int32, bitcast=True)
        return tl.where(v != v, 0x7FC00000, bits).to(tl.int32).to(tl.float32, bitcast=True)
    elif OUT_DTYPE == tl.bfloat16:
        bits = y.to(tl.int16, bitcast=True)
        return tl.where(v != v, 0x7FC0, bits).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        bits = y.to(tl.int16, bitcast=True)
        return tl.where(v != v, 0x7E00, bits).to(tl.int16).to(tl.float16, bitcast=True)
