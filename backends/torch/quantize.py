"""Eager torch MXFP8 quantize / dequantize (CPU and CUDA), byte-equal to spec.quantize.

Same method as the spec: scale bytes from integer views of fp32 bits (no log2, no division), one fp32
multiply by an exact power of two, then torch's fp8 cast. That cast rounds to nearest even but does not
saturate (out-of-range values become NaN in e4m3fn, Inf in e5m2) and its NaN bytes differ, so values
are clamped to +-max first and NaN codes are written as 0x7F afterwards. Nothing here synchronises
with the host. Arguments were validated by the dispatcher (spec validators); choices: spec/quantize.py.

A tuple axis shares the fp32 widening and the |x| bit pass between the axes; each axis then reduces
its own blocks of the original values.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch

from spec.constants import (
    BLOCK_SIZE,
    E8M0_MAX_FINITE,
    E8M0_NAN,
    ELEM_FORMATS,
    NAN_CODE,
    ElemFormat,
)
from spec.mxtensor import MXTensor
from spec.quantize import normalize_axes

from ..registry import register
from ._common import ELEM_TORCH_DTYPES, TORCH_DTYPES, torch_tensor_reasons
from .swizzle import swizzle_scales, unswizzle_scales

_F32_EXP_MASK = 0x7F800000
_F32_MANT_MASK = 0x007FFFFF
_F32_ABS_MASK = 0x7FFFFFFF
_F32_NAN_BITS = 0x7FC00000
_HALF_SUBNORMAL_MANT = 0x400000  # mantissa of 2^-127


def _bits_to_f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def scale_bytes(amax: torch.Tensor, elem: str = "e4m3", scale_mode: str = "rceil") -> torch.Tensor:
    """uint8 E8M0 bytes for fp32 amax (>= 0; NaN -> 255, +Inf -> 254 in every mode), as spec.quantize."""
    fmt = ELEM_FORMATS[elem]
    amax = amax.to(torch.float32).abs()
    if scale_mode == "rceil":
        r = torch.tensor(fmt.inv_max_bits, dtype=torch.int32, device=amax.device).view(torch.float32)
        bits = (amax * r).view(torch.int32).to(torch.int64)  # p = RN_f32(amax * R)
        biased = (bits >> 23) & 0xFF
        mant = bits & _F32_MANT_MASK
        e = biased + (mant > 0).to(torch.int64)
        e = torch.where(biased == E8M0_MAX_FINITE, E8M0_MAX_FINITE, e)
        e = torch.where((biased == 0) & (mant <= _HALF_SUBNORMAL_MANT), 0, e)
        e = torch.where(biased == 0xFF, torch.where(mant > 0, E8M0_NAN, E8M0_MAX_FINITE), e)
        return e.to(torch.uint8)
    bits = amax.view(torch.int32).to(torch.int64)
    top = (bits >> 23) & 0xFF
    is_nan = (top == 0xFF) & ((bits & _F32_MANT_MASK) != 0)
    is_inf = (top == 0xFF) & ((bits & _F32_MANT_MASK) == 0)
    if scale_mode == "even":
        shift = 23 - fmt.mbits
        bits = (bits + (1 << (shift - 1))) & ~((1 << shift) - 1)
    e = ((bits >> 23) & 0x1FF) - fmt.emax
    if scale_mode == "ceil":
        e = e + ((bits & _F32_MANT_MASK) != 0).to(torch.int64)
    e = e.clamp_min(0)
    e = torch.where(is_inf, E8M0_MAX_FINITE, e)
    e = torch.where(is_nan, E8M0_NAN, e)
    return e.to(torch.uint8)


def scale_multiplier(scale: torch.Tensor) -> torch.Tensor:
    """fp32 exact 2^(127-e) (e=254 -> the subnormal 2^-127, e=255 -> NaN)."""
    e = scale.to(torch.int32)
    bits = torch.where(e <= 253, (254 - e.clamp_max(253)) << 23, _HALF_SUBNORMAL_MANT)
    bits = torch.where(e == E8M0_NAN, _F32_NAN_BITS, bits)
    return _bits_to_f32(bits)


def scale_value(scale: torch.Tensor) -> torch.Tensor:
    """fp32 exact 2^(e-127) (e=0 -> the subnormal 2^-127, e=255 -> NaN)."""
    e = scale.to(torch.int32)
    bits = torch.where(e == 0, _HALF_SUBNORMAL_MANT, e << 23)
    bits = torch.where(e == E8M0_NAN, _F32_NAN_BITS, bits)
    return _bits_to_f32(bits)


def encode(y: torch.Tensor, elem: str = "e4m3") -> torch.Tensor:
    """fp8 codes (torch float8 dtype) of fp32 y: RN with saturation to +-max, NaN -> 0x7F, signed zeros kept."""
    lim = ELEM_FORMATS[elem].max
    codes = y.clamp(-lim, lim).to(ELEM_TORCH_DTYPES[elem]).view(torch.uint8)  # clamp keeps NaN
    codes = torch.where(torch.isnan(y), NAN_CODE, codes)
    return codes.view(ELEM_TORCH_DTYPES[elem])


def _dims(shape, axis: int) -> Tuple[int, int, int]:
    pre = math.prod(shape[:axis])
    post = math.prod(shape[axis + 1:])
    return pre, shape[axis] // BLOCK_SIZE, post


def _quantize_axis(x32: torch.Tensor, abs_bits: torch.Tensor, clean_bits: torch.Tensor, axis: int,
                   fmt: ElemFormat, scale_mode: str, nonfinite: str, scale_layout: str) -> MXTensor:
    pre, nb, post = _dims(x32.shape, axis)
    view = (pre, nb, BLOCK_SIZE, post)
    amax_bits = clean_bits.view(view).amax(dim=2)  # NaN-free |x| bits: integer max = float max
    amax = amax_bits.view(torch.float32)
    scale = scale_bytes(amax, fmt.name, scale_mode)
    if nonfinite == "saturate":
        scale = torch.where(amax_bits == _F32_EXP_MASK, E8M0_MAX_FINITE, scale)
    else:  # nan_block: any NaN or Inf -> 255; its NaN multiplier makes every code of the block NaN
        any_nonfinite = abs_bits.view(view).amax(dim=2) >= _F32_EXP_MASK
        scale = torch.where(any_nonfinite, E8M0_NAN, scale)
    scale = scale.to(torch.uint8)
    y = x32.view(view) * scale_multiplier(scale).unsqueeze(2)
    data = encode(y, fmt.name).view(x32.shape)
    compact_shape = list(x32.shape)
    compact_shape[axis] //= BLOCK_SIZE
    t = MXTensor(data, scale.view(compact_shape), axis, fmt.name)
    return swizzle_scales(t) if scale_layout == "swizzled" else t


@register("mxfp8_quantize", "torch", check=torch_tensor_reasons)
def mxfp8_quantize(x, axis=-1, elem="e4m3", scale_mode="rceil", nonfinite="saturate", scale_layout="compact"):
    axes, as_tuple = normalize_axes(axis, x.dim())
    x32 = x.contiguous().to(torch.float32)  # widening is exact
    abs_bits = x32.view(torch.int32) & _F32_ABS_MASK
    # amax ignores NaN (SEMANTICS 1.1): NaN bits (above Inf's) count as 0
    clean_bits = torch.where(abs_bits > _F32_EXP_MASK, 0, abs_bits)
    fmt = ELEM_FORMATS[elem]
    outs = tuple(_quantize_axis(x32, abs_bits, clean_bits, a, fmt, scale_mode, nonfinite, scale_layout)
                 for a in axes)
    return outs if as_tuple else outs[0]


@register("mxfp8_dequantize", "torch", check=torch_tensor_reasons)
def mxfp8_dequantize(t: MXTensor, out_dtype="float32"):
    t = unswizzle_scales(t)
    data = t.data.contiguous()
    pre, nb, post = _dims(data.shape, t.axis)
    values = data.to(torch.float32).view(pre, nb, BLOCK_SIZE, post)  # fp8 -> fp32 is exact
    scale = t.scale.reshape(pre, nb, post)
    out = (values * scale_value(scale).unsqueeze(2)).view(data.shape).to(TORCH_DTYPES[out_dtype])
    return _canonical_nan(out)


_CANONICAL_NAN_BITS = {torch.float32: (torch.int32, _F32_NAN_BITS), torch.bfloat16: (torch.int16, 0x7FC0)}


def _canonical_nan(out: torch.Tensor) -> torch.Tensor:
    """Every NaN as the positive quiet NaN, like spec: GPUs make 0x7FFFFFFF and torch's CPU bf16 cast
    writes 0xFFFF, so the bits are set through an integer view after the cast."""
    int_dtype, nan_bits = _CANONICAL_NAN_BITS[out.dtype]
    return torch.where(torch.isnan(out), nan_bits, out.view(int_dtype)).view(out.dtype)
