"""Eager torch RMSNorm to MXFP8 (CPU and CUDA): `rmsnorm_mxfp8`, semantics in spec/rmsnorm.py.

Same operation order as the spec; each eager elementwise op is one fp32 RN (no FMA):
ss = RN32(float64 sum of the exact float64 squares) -- the spec sums exactly; a float64 sum differs
from that only when the exact sum lies within ~D float64 ulps of an fp32 rounding boundary, so on
ordinary data rstd is the spec's bytes and is otherwise within one fp32 ulp of it;
ms = RN32(ss * RN32(1/D)); v = RN32(ms + RN32(eps)); rstd = RN32(float64 1/sqrt(v)) (correctly rounded,
as the spec); y = RN32(RN32(x * rstd) * g) with g = gamma or RN32(gamma + 1); then
backends.torch.quantize along (-1, 0) from the fp32 y. Given rstd, y and its MXFP8 bytes are exact.

`rmsnorm_backward`: spec's formula in eager fp32 ops (one RN each, no FMA); the sums are torch's fp32
reductions (their own order, within spec's any-order bound) and the mean divides by D. float64 inputs
compute in float64 instead (not part of the op's contract: the finite-difference tests call this
function directly with float64 tensors).
"""
from __future__ import annotations

import math

import torch

from ..registry import register
from ._common import torch_tensor_reasons
from .quantize import mxfp8_quantize


def rmsnorm_rstd(x32: torch.Tensor, eps: float) -> torch.Tensor:
    d = x32.shape[1]
    ss = x32.to(torch.float64).square().sum(dim=1).to(torch.float32)  # squares exact in float64
    inv_d = torch.tensor(1.0, dtype=torch.float32) / d  # RN32(1/D)
    v = ss * inv_d.to(x32.device) + torch.tensor(eps, dtype=torch.float32, device=x32.device)
    rstd = (1.0 / torch.sqrt(v.to(torch.float64))).to(torch.float32)
    return rstd.masked_fill_(torch.isnan(rstd), math.nan)  # positive quiet NaN, as spec


@register("rmsnorm_mxfp8", "torch", check=torch_tensor_reasons)
def rmsnorm_mxfp8(x, gamma, eps=1e-6, zero_centered_gamma=False, elem="e4m3"):
    x32 = x.to(torch.float32)
    rstd = rmsnorm_rstd(x32, eps)
    g = gamma.to(torch.float32)
    if zero_centered_gamma:
        g = g + 1.0
    y = (x32 * rstd[:, None]) * g[None, :]  # two eager kernels: two fp32 RN, no FMA
    y_row, y_col = mxfp8_quantize(y, axis=(-1, 0), elem=elem, scale_mode="rceil", nonfinite="saturate",
                                  scale_layout="compact")
    return y_row, y_col, rstd


@register("rmsnorm_backward", "torch", check=torch_tensor_reasons)
def rmsnorm_backward(dy, x, gamma, rstd, zero_centered_gamma=False):
    """(dx in x's dtype, dgamma in gamma's dtype): spec.rmsnorm_backward in eager ops (module docstring)."""
    compute = torch.float64 if torch.float64 in (dy.dtype, x.dtype, gamma.dtype, rstd.dtype) else torch.float32
    x32, dy32, r = x.to(compute), dy.to(compute), rstd.to(compute)[:, None]
    g = gamma.to(compute)
    if zero_centered_gamma:
        g = g + 1.0
    xhat = x32 * r
    dxhat = dy32 * g
    dgamma = (dy32 * xhat).sum(dim=0)
    dx = r * (dxhat - xhat * (dxhat * xhat).mean(dim=1, keepdim=True))
    return dx.to(x.dtype), dgamma.to(gamma.dtype)
