"""Eager torch MXFP8 GEMM (CPU and CUDA): `mxfp8_gemm(a, b, out_dtype="bfloat16")`, semantics in spec/gemm.py.

CPU: the operands are dequantized exactly to float64 and multiplied in float64. Every product is exact
(<= 8 significant bits, magnitudes within 2^+-286) and the float64 sum is exact whenever the products
of one dot product span fewer than 53 - 8 - log2(K) binades (spec/gemm.py): then the result is the
spec's bytes. Outside that (blocks whose scales differ by ~2^30 or more) the float64 sum may round, and
the output can differ from the spec's correctly rounded one when the exact sum lies within ~K float64
ulps of an out_dtype rounding boundary -- the spec resolves those cases exactly, this backend does not.

CUDA: float64 GEMMs are slow on most GPUs, so the product is an fp32 matmul. To keep fp32 in range the
dequantized (float64) operands are pre-scaled per row by a power of two: a[m, :] = 2^(ea_m) * a'[m, :]
with max |a'[m, :]| in [0.5, 1) (no overflow; entries 2^149 below their row's largest underflow and
are lost). out = RN_out(fp32(a' @ b'^T) * 2^(ea_m + eb_n)), the rescale exact in float64.
This matches the spec bit for bit when every product and partial sum is exact in fp32 (small
integers times powers of two: the byte tests). On random inputs the fp32 partial sums round
(cuBLAS-defined order): fp32 outputs then often differ from the spec in the last bit or two (about
2% of elements at K = 256 in a CPU emulation of this path), bf16 outputs rarely. TF32 does not matter
here: a dequantized MXFP8 value has <= 4 significant bits (bf16 operands of mla_q: 8), which TF32's 11
hold exactly.

Both: bf16 results go through fp32 rounded to odd, so they are rounded once (a plain float64 -> bf16
cast in torch rounds twice); NaN is written as the positive quiet NaN (spec's rule); an exact zero
sum is +0.0 (the accumulators start at +0).
"""
from __future__ import annotations

import math
from typing import List

import torch

from spec.constants import E8M0_BIAS, E8M0_NAN
from spec.mxtensor import MXTensor

from ..registry import register
from ._common import torch_tensor_reasons

__all__ = ["mxfp8_gemm", "compact_scales", "dequantize_f64", "matmul_rounded", "round_f64_to",
           "round_to_odd_f32"]


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


def _rows_to_f32(v: torch.Tensor):
    """(v' fp32, r int64) with v = 2^r[:, None] * v' for float64 v [R, K]: each row is scaled by a power
    of two so that its largest finite magnitude lies in [0.5, 1) -- fp32 range can then not overflow.
    Exact for entries of <= 24 significant bits within 2^149 of their row's largest (smaller ones
    become fp32 subnormals or zero)."""
    amax = torch.where(torch.isfinite(v), v.abs(), torch.zeros_like(v)).amax(dim=1) if v.shape[1] else \
        torch.zeros(v.shape[0], dtype=v.dtype, device=v.device)
    rows = torch.frexp(amax).exponent.to(torch.int64)  # amax = m * 2^rows, 0.5 <= m < 1 (0 -> 0)
    return (v * _pow2_f64(-rows)[:, None]).to(torch.float32), rows


def matmul_rounded(a64: torch.Tensor, b64: torch.Tensor, out_dtype: str) -> torch.Tensor:
    """RN_out(sum_k a64[m,k] * b64[n,k]) for float64 tensors whose entries have <= 8 significant bits
    (dequantized MXFP8, bf16): float64 matmul on CPU, row-scaled fp32 matmul on CUDA (module
    docstring). Exact zero sums give +0.0; NaN is written as the positive quiet NaN."""
    if a64.device.type == "cuda":
        a32, ra = _rows_to_f32(a64)
        b32, rb = _rows_to_f32(b64)
        # 2^(ra + rb) * the fp32 sum, exact in float64 (24-bit values, exponents within +-600)
        s = (a32 @ b32.T).to(torch.float64) * _pow2_f64(ra[:, None] + rb[None, :])
    else:
        s = a64 @ b64.T
    return round_f64_to(s + 0.0, out_dtype)  # -0.0 + 0.0 = +0.0: an exact zero sum is +0 (spec)


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
    return matmul_rounded(dequantize_f64(a), dequantize_f64(b), out_dtype)
