"""Eager torch MXFP8 GEMM (CPU and CUDA): `mxfp8_gemm(a, b, out_dtype="bfloat16")`, semantics in spec/gemm.py.

CPU: the operands are dequantized exactly to float64 and multiplied in float64. Every product is exact
(<= 8 significant bits, magnitudes within 2^+-286) and the float64 sum is exact whenever the products
of one dot product span fewer than 53 - 8 - log2(K) binades (spec/gemm.py): then the result is the
spec's bytes. Outside that (blocks whose scales differ by ~2^30 or more) the float64 sum may round, and
the output can differ from the spec's correctly rounded one when the exact sum lies within ~K float64
ulps of an out_dtype rounding boundary -- the spec resolves those cases exactly, this backend does not.

CUDA: float64 GEMMs are slow on most GPUs, so the product is an fp32 matmul. To keep fp32 in range the
operands are pre-scaled per row by a power of two: a[m, :] = 2^(ea_m) * a'[m, :], where ea_m is the
largest finite scale exponent of row m (so |a'| <= element max, no overflow; entries 2^149 below the
row's largest block underflow and are lost). out = RN_out(fp32(a' @ b'^T) * 2^(ea_m + eb_n)), the
rescale exact in float64. This matches the spec bit for bit when every product and partial sum is
exact in fp32 (small integers times powers of two: the byte tests); on random inputs the fp32
accumulation order (cuBLAS-defined) gives rare one-ulp differences in out. TF32 does not matter
here: a dequantized MXFP8 value has <= 4 significant bits, which TF32's 11 hold exactly.

Both: bf16 results go through fp32 rounded to odd, so they are rounded once (a plain float64 -> bf16
cast in torch rounds twice); NaN is written as the positive quiet NaN (spec's rule); an exact zero
sum is +0.0 (the accumulators start at +0).
"""
from __future__ import annotations

import math
from typing import List, Tuple

import torch

from spec.constants import E8M0_BIAS, E8M0_NAN
from spec.mxtensor import MXTensor

from ..registry import register
from ._common import TORCH_DTYPES, torch_tensor_reasons

__all__ = ["mxfp8_gemm", "compact_scales", "dequantize_f64", "round_f64_to", "round_to_odd_f32",
           "matmul_rows_scaled_f32"]


def compact_scales(t: MXTensor) -> torch.Tensor:
    """t's compact scale bytes (unswizzled through the torch swizzle backend when needed)."""
    if t.scale_layout == "compact":
        return t.scale
    from .swizzle import unswizzle_scales

    return unswizzle_scales(t).scale


def _pow2_f64(n: torch.Tensor) -> torch.Tensor:
    """Exact float64 2^n for integer n in [-1022, 1023], built from the exponent bits (no pow())."""
    return ((n.to(torch.int64) + 1023) << 52).view(torch.float64)


def _scale_factor_f64(scale: torch.Tensor) -> torch.Tensor:
    """float64 2^(e-127) of E8M0 bytes (exact), NaN for byte 255."""
    e = scale.to(torch.int64)
    factor = _pow2_f64(e - E8M0_BIAS)
    return torch.where(e == E8M0_NAN, torch.full_like(factor, math.nan), factor)


def dequantize_f64(t: MXTensor) -> torch.Tensor:
    """Exact float64 decode(code) * 2^(e-127) of an MXTensor of torch tensors (any axis and layout)."""
    factor = _scale_factor_f64(compact_scales(t)).repeat_interleave(32, dim=t.axis)
    return t.data.to(torch.float64) * factor  # fp8 -> float64 is exact; <= 4 bits times 2^k: exact


def round_to_odd_f32(x64: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 truncated toward zero with the last bit set when inexact (round to odd).

    Followed by one RN into bf16 this is one correct RN of x64. Beyond fp32 range: fp32 max (odd)."""
    f = x64.to(torch.float32)
    back = f.to(torch.float64)
    inexact = torch.isfinite(x64) & (back != x64)
    away = inexact & (back.abs() > x64.abs())  # RN went away from zero (also +-Inf from overflow)
    bits = f.view(torch.int32)
    bits = torch.where(away, bits - 1, bits)  # sign-magnitude: one step toward zero
    return (bits | inexact.to(torch.int32)).view(torch.float32)


def round_f64_to(x64: torch.Tensor, out_dtype: str) -> torch.Tensor:
    """One RN-even rounding of float64 values into "float32" / "bfloat16", NaN made positive quiet."""
    out = x64.to(torch.float32) if out_dtype == "float32" else round_to_odd_f32(x64).to(torch.bfloat16)
    return out.masked_fill_(torch.isnan(out), math.nan)


def _row_exponents(scale: torch.Tensor) -> torch.Tensor:
    """Per row of compact [R, K/32] scale bytes: the largest finite byte minus the bias (int64)."""
    finite = torch.where(scale == E8M0_NAN, torch.zeros_like(scale), scale)
    return finite.amax(dim=1).to(torch.int64) - E8M0_BIAS if scale.shape[1] else \
        torch.zeros(scale.shape[0], dtype=torch.int64, device=scale.device)


def _scaled_operand_f32(t: MXTensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(a' fp32, row exponents r) with dq(t) = 2^r[:, None] * a' for a 2-D MXTensor blocked on axis 1."""
    scale = compact_scales(t)
    rows = _row_exponents(scale)
    factor = _scale_factor_f64(scale) * _pow2_f64(-rows)[:, None]
    factor = factor.to(torch.float32)  # a power of two <= 1 (or underflowed to 0), NaN kept
    return t.data.to(torch.float32) * factor.repeat_interleave(32, dim=1), rows


def matmul_rows_scaled_f32(a32: torch.Tensor, ra: torch.Tensor, b32: torch.Tensor,
                           rb: torch.Tensor) -> torch.Tensor:
    """float64 2^(ra[m] + rb[n]) * fp32(a32 @ b32^T): the rescale is exact (fp32 values in float64)."""
    s = (a32 @ b32.T).to(torch.float64)
    return s * _pow2_f64(ra[:, None] + rb[None, :])


def gemm_reasons(a, b, out_dtype="bfloat16") -> List[str]:
    reasons = torch_tensor_reasons(a, b)
    if not reasons and any(isinstance(t, MXTensor) and t.scale_layout == "swizzled" for t in (a, b)):
        try:
            from .swizzle import unswizzle_scales  # noqa: F401
        except ImportError:
            reasons.append("swizzled scales need backends.torch.swizzle.unswizzle_scales, not available")
    return reasons


@register("mxfp8_gemm", "torch", check=gemm_reasons)
def mxfp8_gemm(a: MXTensor, b: MXTensor, out_dtype: str = "bfloat16") -> torch.Tensor:
    if a.data.device.type == "cuda":
        a32, ra = _scaled_operand_f32(a)
        b32, rb = _scaled_operand_f32(b)
        s = matmul_rows_scaled_f32(a32, ra, b32, rb)
    else:
        s = dequantize_f64(a) @ dequantize_f64(b).T
    s = s + 0.0  # -0.0 + 0.0 = +0.0: an exact zero sum is +0 (spec)
    return round_f64_to(s, out_dtype).to(TORCH_DTYPES[out_dtype])
