"""Triton transpose of a 2-D tensor of 1-byte elements into a given output, byte for byte.

The MXFP8 weight copies keep the copy blocked along N physically transposed (dispatch.weights): its
codes [N, K] and scales [N/32, K] are stored as [K, N] and [K, N/32]. torch's `.t().contiguous()` of a
1-byte tensor runs its generic strided copy, one byte per lane with every read or every write strided
(0.3 ms for a DeepSeek-V3 q_b_proj weight on an H100, several times its memory traffic). Here a program
loads a [BLOCK_R, BLOCK_C] tile with rows as the contiguous axis, transposes it in registers and shared
memory (`tl.trans`), and stores it with the output's rows contiguous: both sides coalesced.

Registers no op: it moves bytes and computes nothing a spec defines (dispatch.transpose chooses it or
torch's copy). Any strides on either side (the tile's loads are coalesced when the source's last
stride is 1, its stores when the output's is). Every output element is written once.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from ._common import INTERPRETER_LOCK, cdiv, fast_launch, interpret_mode, triton_reasons


@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, R, C, s_r, s_c, d_c, d_r, tiles_c,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, IDX64: tl.constexpr):
    # dst[c, r] = src[r, c]; a 1-D grid (a 2-D one's second axis stops at 65535 programs)
    pid = tl.program_id(0)
    pid_r = pid // tiles_c
    pid_c = pid % tiles_c
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    if IDX64:
        r = r.to(tl.int64)
        c = c.to(tl.int64)
    mask = (r < R)[:, None] & (c < C)[None, :]
    tile = tl.load(src_ptr + r[:, None] * s_r + c[None, :] * s_c, mask=mask)
    mask_t = (c < C)[:, None] & (r < R)[None, :]
    tl.store(dst_ptr + c[:, None] * d_c + r[None, :] * d_r, tl.trans(tile), mask=mask_t)


def _tile(n: int) -> int:
    """A tile side for an axis of n elements: 64, or the power of two >= n (at least 16) below that."""
    return min(64, max(16, 1 << (n - 1).bit_length()))


@functools.lru_cache(maxsize=256)
def _plan(rows: int, cols: int, s_r: int, s_c: int, d_c: int, d_r: int):
    """(grid, tiles along C, BLOCK_R, BLOCK_C, 64-bit offsets) of a launch, kept per shape and strides
    (a refresh transposes the same two tensors every step): 64 x 64 byte tiles (4 KiB, a 64-byte run
    per tile row on each side), smaller where a side is shorter than a tile (a scale matrix)."""
    block_r, block_c = _tile(rows), _tile(cols)
    tiles_c = cdiv(cols, block_c)
    # the largest offset a lane computes, a tile's overhang included: past int32 -> 64-bit offsets
    reach = max((rows + block_r) * abs(s_r) + (cols + block_c) * abs(s_c),
                (cols + block_c) * abs(d_c) + (rows + block_r) * abs(d_r))
    return (cdiv(rows, block_r) * tiles_c,), tiles_c, block_r, block_c, reach >= 2**31


def transpose_reasons(src: torch.Tensor, out: torch.Tensor):
    """Why this kernel cannot run on (src, out) here (device reasons; an empty list when it can)."""
    return triton_reasons(src, out)


def transpose_bytes_into(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[c, r] = src[r, c] for a 2-D src [R, C] and out [C, R] of 1-byte elements (bytes copied as
    they are, whatever the two 1-byte dtypes), on one device. Returns out. Arguments are checked by
    the caller (dispatch.transpose)."""
    rows, cols = src.shape
    if rows == 0 or cols == 0:
        return out
    (s_r, s_c), (d_c, d_r) = src.stride(), out.stride()
    grid, tiles_c, block_r, block_c, idx64 = _plan(rows, cols, s_r, s_c, d_c, d_r)
    s8, o8 = src.view(torch.uint8), out.view(torch.uint8)  # one compiled kernel for every byte type
    # the interpreter keeps launch state in module globals: one interpreted launch at a time
    with INTERPRETER_LOCK if interpret_mode() else contextlib.nullcontext():
        fast_launch(_transpose_kernel, grid, s8, o8, rows, cols, s_r, s_c, d_c, d_r, tiles_c,
                    BLOCK_R=block_r, BLOCK_C=block_c, IDX64=idx64, num_warps=4)
    return out
