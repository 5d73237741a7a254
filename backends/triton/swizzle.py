"""Triton scale swizzle / unswizzle (SEMANTICS.md section 3), byte-equal to spec.swizzle.

The 2-D scale matrix S[R, C] of an MXTensor is its compact scales with the blocked axis moved last and
the other axes flattened. Viewing the compact scales as [P, C, Q] (P = product of the axes before the
blocked one, Q = product of the axes after it), S[i, j] = compact[i // Q, j, i % Q], so one kernel
serves every blocked axis: Q = 1 for the last axis (S is the compact buffer itself).

- swizzle: one lane per byte of the swizzled [R', C'] buffer. The lane decodes its (i, j) from the
  offset formula (a 512-byte tile = 128 rows x 4 columns) and gathers S[i, j], or writes 0 in the
  padding. Every output byte is written by the kernel (no zero-initialised buffer), writes are
  contiguous, and reads are 4-byte runs of S when Q = 1.
- unswizzle: one lane per compact byte, gathering from the swizzled buffer.
Both are tiny memory-bound copies (scales are 1/32 of the data); BLOCK bytes per program.

`swizzle_offset` is the device form of the offset formula, shared with the quantize kernel that writes
swizzled scales directly. Choices follow spec.swizzle: swizzling a swizzled tensor (or unswizzling a
compact one) returns it unchanged.
"""
from __future__ import annotations

import math
from typing import List

import torch
import triton
import triton.language as tl

from spec.mxtensor import MXTensor

from ..registry import register
from ._common import cdiv, triton_reasons

SWIZZLE_BLOCK = 2048  # bytes per program: small kernels, but enough lanes to fill the GPU

# Tests set this to fill every output buffer with 0xFF bytes before the kernels run, so a byte the
# kernels fail to write shows up (torch.empty may hand back zeroed memory that would hide it).
POISON_OUTPUTS = False


def empty_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty for kernel outputs (poisoned with 0xFF bytes when POISON_OUTPUTS is set)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if POISON_OUTPUTS:
        out.view(torch.uint8).fill_(0xFF)
    return out


@triton.jit
def swizzle_offset(i, j, COLS_PADDED):
    """Byte offset of S[i, j] in the swizzled buffer whose padded width is COLS_PADDED (C', a multiple
    of 4): ((i // 128) * (C' / 4) + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4."""
    return (((i >> 7) * (COLS_PADDED >> 2) + (j >> 2)) << 9) + ((i & 31) << 4) + (((i >> 5) & 3) << 2) + (j & 3)


@triton.jit
def _swizzle_kernel(src_ptr, dst_ptr, R, C, Q, CP, TOTAL, BLOCK: tl.constexpr, IDX64: tl.constexpr):
    pid = tl.program_id(0)
    if IDX64:
        o = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        o = pid * BLOCK + tl.arange(0, BLOCK)
    in_buf = o < TOTAL
    # Invert the offset formula: o = tile * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4.
    tile = o >> 9
    within = o & 511
    tiles_per_row = CP >> 2
    i = (tile // tiles_per_row) * 128 + ((within >> 2) & 3) * 32 + (within >> 4)
    j = (tile % tiles_per_row) * 4 + (within & 3)
    valid = in_buf & (i < R) & (j < C)
    # S[i, j] = compact[p, j, q] with p = i // Q, q = i % Q
    src = ((i // Q) * C + j) * Q + (i % Q)
    v = tl.load(src_ptr + src, mask=valid, other=0)  # padding bytes are 0x00
    tl.store(dst_ptr + o, v, mask=in_buf)


@triton.jit
def _unswizzle_kernel(src_ptr, dst_ptr, C, Q, CP, TOTAL, BLOCK: tl.constexpr, IDX64: tl.constexpr):
    pid = tl.program_id(0)
    if IDX64:
        s = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        s = pid * BLOCK + tl.arange(0, BLOCK)
    valid = s < TOTAL
    # compact index s = (p * C + j) * Q + q  ->  S row i = p * Q + q, column j
    q = s % Q
    pj = s // Q
    j = pj % C
    i = (pj // C) * Q + q
    v = tl.load(src_ptr + swizzle_offset(i, j, CP), mask=valid, other=0)
    tl.store(dst_ptr + s, v, mask=valid)


def _pcq(t: MXTensor):
    """(P, C, Q) of the compact scales viewed as [P, C, Q] around the blocked axis."""
    shape = tuple(t.data.shape)
    p = math.prod(shape[: t.axis])
    q = math.prod(shape[t.axis + 1:])
    return p, shape[t.axis] // 32, q


def swizzle_reasons(t) -> List[str]:
    return triton_reasons(t)


@register("swizzle_scales", "triton", check=swizzle_reasons)
def swizzle_scales(t: MXTensor) -> MXTensor:
    if t.scale_layout == "swizzled":
        return t
    rows, cols = t.scale_matrix_shape
    rp, cp = t.swizzled_scale_shape
    _, c, q = _pcq(t)
    src = t.scale.contiguous()
    out = empty_output((rp, cp), torch.uint8, src.device)  # fully written by the kernel
    total = rp * cp
    if total:
        grid = (cdiv(total, SWIZZLE_BLOCK),)
        _swizzle_kernel[grid](src, out, rows, c, q, cp, total, BLOCK=SWIZZLE_BLOCK,
                              IDX64=total + SWIZZLE_BLOCK >= 2**31, num_warps=4)
    return t.replace(scale=out, scale_layout="swizzled")


@register("unswizzle_scales", "triton", check=swizzle_reasons)
def unswizzle_scales(t: MXTensor) -> MXTensor:
    if t.scale_layout == "compact":
        return t
    _, cp = t.swizzled_scale_shape
    _, c, q = _pcq(t)
    src = t.scale.contiguous()
    out = empty_output(t.compact_scale_shape, torch.uint8, src.device)
    total = out.numel()
    if total:
        grid = (cdiv(total, SWIZZLE_BLOCK),)
        _unswizzle_kernel[grid](src, out, c, q, cp, total, BLOCK=SWIZZLE_BLOCK,
                                IDX64=src.numel() + SWIZZLE_BLOCK >= 2**31, num_warps=4)
    return t.replace(scale=out, scale_layout="compact")
