"""Eager torch RMSNorm to MXFP8 (CPU and CUDA): `rmsnorm_mxfp8`, semantics in spec/rmsnorm.py.

Same operation order as the spec; each eager elementwise op is one fp32 RN (no FMA):
ss = RN32(float64 sum of the exact float64 squares) -- the spec sums exactly; a float64 sum differs
from that only when the exact sum lies within ~D float64 ulps of an fp32 rounding boundary, so on
ordinary data rstd is the spec's bytes and is otherwise within one fp32 ulp of it;
ms = RN32(ss * RN32(1/D)); v = RN32(ms + RN32(eps)); rstd = RN32(float64 1/sqrt(v)) (correctly rounded,
as the spec); y = RN32(RN32(x * rstd) * g) with g = gamma or RN32(gamma + 1); then
backends.torch.quantize along (-1, 0) from the fp32 y. Given rstd, y and its MXFP8 bytes are exact.
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
