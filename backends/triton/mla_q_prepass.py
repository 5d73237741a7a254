"""The MXFP8 backward's pre-pass over the fused op's output gradient, with bf16 dequantized outputs.

    prepass_dequantized(dq2, cos, sin, flag, row_dq, col_dq, hw_cvt)   # fills row_dq, col_dq

dq2 is the gradient of q viewed [T, H * 192] (bf16). Per head, the mla RoPE backward turns the RoPE
part's halves (gL | gR, features 128..191) into interleaved pairs; the fp32 result g is then quantized
both ways (rows: blocks of 32 features; columns: blocks of 32 tokens) and each quantization is written
as its bf16 dequantization, [T, H * 192] each, the operands of the backward's two bf16 GEMMs. Every value
there is exact in bf16 unless a block's scale byte is outside BF16_SAFE_SCALE_BYTES over a nonzero code
or a value is NaN; such a block raises *flag (int32), and the caller's gated exact path replaces
everything (values written under a raised flag are not defined).

It computes the bytes of mla_q._grad_prep_kernel's dequantized outputs (tested byte for byte) with
fewer instructions an element, which is what this memory-bound pass runs out of first:
- the grid runs heads fastest, so the programs in flight together read and write whole token rows of
  g (one H200 sweep: 0.81 of copy bandwidth against 0.68-0.70 with tokens fastest); a program takes its
  head's three 64-feature chunks in a loop, one chunk's values alive at a time (96-126 registers a
  thread for sm90 by the grid order, Triton 3.9 offline; several programs an SM); more heads per
  program (cos / sin then come from L1 after the first head) measured slower;
- on the GPU, each value's e4m3 rounding is the hardware conversion pair (fp32 -> e4m3 -> fp32, RN-even,
  saturating: _mxfp8.e4m3_value's definition) instead of ~10 integer and fp32 operations;
- NaN is found per row block, from an integer max over |bits| (NaN's bits lie above Inf's, so the
  block's scale byte is 255, unsafe): no per-element flag store;
- a block's multiplier, factor and guard take a few integer ops (_block_factors), exact wherever the
  guard stays down, instead of the general helpers' special cases.
The interpreter runs the bit-level e4m3_value (its conversions are wrong).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from spec.constants import MLA_QK_HEAD_DIM, MLA_ROPE_DIM

from ._common import cdiv, fast_launch, settle_cache_keys
from ._fpbits import round_bf16, widen_f32
from ._mxfp8 import F32_ABS_MASK, e4m3_value, rceil_scale_from_amax_bits
from .gemm import BF16_SAFE_SCALE_BYTES

SAFE_LO = tl.constexpr(BF16_SAFE_SCALE_BYTES["e4m3"][0])
SAFE_HI = tl.constexpr(BF16_SAFE_SCALE_BYTES["e4m3"][1])


@triton.jit
def block_unsafe(amax_bits, e, s_inv):
    """Blocks whose dequantization is not exact in bf16: a scale byte outside [SAFE_LO, SAFE_HI] over a
    nonzero code. Codes are monotone in |y|, so the block has a nonzero code iff its amax's code is
    nonzero (all-zero blocks -- byte 0 -- stay on the fast path)."""
    nonzero = e4m3_value(amax_bits.to(tl.float32, bitcast=True) * s_inv) != 0.0
    return ((e < SAFE_LO) | (e > SAFE_HI)) & nonzero


@triton.jit
def _e4m3_grid(y, HW_CVT: tl.constexpr):
    """fp32 value of y's e4m3 code (RN-even, saturating to +-448)."""
    if HW_CVT:
        return y.to(tl.float8e4nv).to(tl.float32)
    else:
        return e4m3_value(y)


@triton.jit
def rope_grad_chunk(src_rows, base, stride_sc, cos_row, sin_row, BLOCK_R: tl.constexpr):
    """fp32 [BLOCK_R, 64]: the mla RoPE backward of the 64 RoPE features at column `base` of the rows
    src_rows (pointers [BLOCK_R, 1]): halves gL | gR in, interleaved pairs out (cos_row / sin_row:
    pointers [BLOCK_R, 32] to each row's first 32 cos / sin values). Launched without FMA contraction."""
    offs_h = tl.arange(0, 32)
    g_l = widen_f32(tl.load(src_rows + (base + offs_h)[None, :] * stride_sc))
    g_r = widen_f32(tl.load(src_rows + (base + 32 + offs_h)[None, :] * stride_sc))
    cos_l = widen_f32(tl.load(cos_row))
    cos_r = widen_f32(tl.load(cos_row + 32))
    sin_l = widen_f32(tl.load(sin_row))
    sin_r = widen_f32(tl.load(sin_row + 32))
    d_even = g_l * cos_l + g_r * sin_r  # dx[2k]   = RN(RN(gL*c[k]) + RN(gR*s[32+k]))
    d_odd = g_r * cos_r - g_l * sin_l  # dx[2k+1] = RN(RN(gR*c[32+k]) - RN(gL*s[k]))
    return tl.reshape(tl.join(d_even, d_odd), [BLOCK_R, 64])


@triton.jit
def _store_rows(ptrs, values, r_ok, EVEN_R: tl.constexpr):
    if EVEN_R:
        tl.store(ptrs, values)
    else:
        tl.store(ptrs, values, mask=r_ok[:, None])


@triton.jit
def _block_factors(amax_bits):
    """(s_inv, scale, unsafe) per block from the bits of its amax (NaN bits allowed): the multiplier
    2^(127 - e) and the factor 2^(e - 127) of its rceil scale byte e, each one shift (exact for e in
    [0, 253] and [1, 254]; e = 0 gives scale 0.0, which keeps an all-zero block's +-0 codes +-0), and
    whether the block is unsafe: e above SAFE_HI (such a block's amax code is >= 224: nonzero), or
    below SAFE_LO with a nonzero amax code (|y| > 2^-10: e4m3's smallest subnormal is 2^-9, and the tie
    at 2^-10 rounds to the even code 0). Every block the other formulas do not cover -- e = 254 (Inf,
    huge values) and e = 255 (a NaN amax) -- is unsafe, so its values are never used."""
    e = rceil_scale_from_amax_bits(amax_bits)
    s_inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    scale = (e << 23).to(tl.float32, bitcast=True)
    tiny_code = amax_bits.to(tl.float32, bitcast=True) * s_inv > 0.0009765625  # 2^-10
    return s_inv, scale, (e > SAFE_HI) | ((e < SAFE_LO) & tiny_code)


@triton.jit
def _chunk_out(v, out_off, r_ok, pid_r, R, row_dq_ptr, col_dq_ptr, flag_ptr,
               BLOCK_R: tl.constexpr, HW_CVT: tl.constexpr, EVEN_R: tl.constexpr):
    """Both dequantized quantizations of one [BLOCK_R, 64] chunk of g (two row blocks per token,
    BLOCK_R / 32 column blocks per feature), stored; unsafe blocks raise the flag."""
    NB: tl.constexpr = BLOCK_R // 32
    # rows; the integer amax over |bits| keeps NaN (its bits exceed Inf's), whose scale byte 255 makes
    # the block unsafe: every NaN raises the flag here
    v3 = tl.reshape(v, [BLOCK_R, 2, 32])
    s_inv, scale, bad = _block_factors(tl.max(v3.to(tl.int32, bitcast=True) & F32_ABS_MASK, axis=2))
    dq = tl.reshape(_e4m3_grid(v3 * s_inv[:, :, None], HW_CVT) * scale[:, :, None], [BLOCK_R, 64])
    _store_rows(row_dq_ptr + out_off, round_bf16(dq, HW_CVT), r_ok, EVEN_R)
    if not EVEN_R:
        bad = bad & r_ok[:, None]
    tl.store(flag_ptr + tl.zeros([BLOCK_R, 2], tl.int32), 1, mask=bad)
    # columns: the float max (one instruction an element, |.| folded in) ignores NaN, flagged above
    v3 = tl.reshape(v, [NB, 32, 64])
    s_inv, scale, bad = _block_factors(tl.max(tl.abs(v3), axis=1).to(tl.int32, bitcast=True))
    dq = tl.reshape(_e4m3_grid(v3 * s_inv[:, None, :], HW_CVT) * scale[:, None, :], [BLOCK_R, 64])
    _store_rows(col_dq_ptr + out_off, round_bf16(dq, HW_CVT), r_ok, EVEN_R)
    if not EVEN_R:
        bad = bad & ((pid_r * NB + tl.arange(0, NB)) * 32 < R)[:, None]
    tl.store(flag_ptr + tl.zeros([NB, 64], tl.int32), 1, mask=bad)


@triton.jit
def _prepass_dq_kernel(
    src_ptr, cos_ptr, sin_ptr, row_dq_ptr, col_dq_ptr, flag_ptr,
    R, H, stride_sr, stride_sc, stride_cos, stride_sin,
    HEADS: tl.constexpr, BLOCK_R: tl.constexpr, HW_CVT: tl.constexpr, EVEN_R: tl.constexpr,
    HEADS_FAST: tl.constexpr,
):
    """src [R, H * 192] bf16 -> row_dq, col_dq [R, H * 192] bf16 (contiguous); program (pid_r, pid_h):
    tokens pid_r * BLOCK_R .. + BLOCK_R of heads pid_h * HEADS .. + HEADS (HEADS_FAST: pid_h is grid
    axis 0, so programs running side by side cover whole token rows). EVEN_R: R % BLOCK_R == 0."""
    HALF: tl.constexpr = 32
    if HEADS_FAST:
        pid_h = tl.program_id(0)
        pid_r = tl.program_id(1)
    else:
        pid_r = tl.program_id(0)
        pid_h = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    if EVEN_R:
        rows = offs_r
    else:
        rows = tl.minimum(offs_r, R - 1)  # rows past R repeat the last one (their outputs are masked)
    src_rows = src_ptr + rows.to(tl.int64)[:, None] * stride_sr
    out_rows = offs_r.to(tl.int64)[:, None] * (H * 192)
    offs_w = tl.arange(0, 64)
    offs_h = tl.arange(0, HALF)
    cos_row = cos_ptr + rows.to(tl.int64)[:, None] * stride_cos + offs_h[None, :]
    sin_row = sin_ptr + rows.to(tl.int64)[:, None] * stride_sin + offs_h[None, :]
    # one 64-feature chunk per trip (a loop, not unrolled: one chunk's values live at a time, so several
    # programs share an SM); chunk 2 of every head is its RoPE part
    for c in range(HEADS * 3):
        head = pid_h * HEADS + c // 3
        if head < H:
            part = c % 3
            base = head * 192 + part * 64
            # each branch stores its own chunk (addresses made in the branch): a value merged from both,
            # or one address tensor for both, would take one layout, and the other branch's values would go
            # through shared memory to match it
            if part < 2:
                v = widen_f32(tl.load(src_rows + (base + offs_w)[None, :] * stride_sc))
                _chunk_out(v, out_rows + (base + offs_w)[None, :], r_ok, pid_r, R, row_dq_ptr, col_dq_ptr, flag_ptr, BLOCK_R, HW_CVT, EVEN_R)
            else:
                v = rope_grad_chunk(src_rows, base, stride_sc, cos_row, sin_row, BLOCK_R)
                _chunk_out(v, out_rows + (base + offs_w)[None, :], r_ok, pid_r, R, row_dq_ptr, col_dq_ptr, flag_ptr, BLOCK_R, HW_CVT, EVEN_R)


class Tile(NamedTuple):
    """A launch shape of the kernel: tokens and heads per program, warps, and the grid's order."""

    tokens: int = 32
    heads: int = 1
    warps: int = 2
    heads_fast: bool = False


# On the H200: 32 tokens of one head on 2 warps, heads fastest in the grid (0.81
# of copy bandwidth at T = 4096 and 16384; the other order 0.68-0.70, more heads or warps per program less)
TILE = Tile(32, 1, 2, heads_fast=True)


def prepass_dequantized(src2d: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, flag: torch.Tensor,
                        row_dq: torch.Tensor, col_dq: torch.Tensor, hw_cvt: bool, tile: Optional[Tile] = None) -> None:
    """Fill row_dq and col_dq ([R, H * 192] bf16, contiguous) from src2d [R, H * 192] bf16 (any strides)
    and cos / sin [R, 64] (unit last stride), raising flag (module docstring). hw_cvt: the GPU's
    conversions (sm89+), else the bit-level rounding."""
    rows, cols = src2d.shape
    assert cols % MLA_QK_HEAD_DIM == 0 and cos.shape[-1] == MLA_ROPE_DIM, "callers pass [T, H * 192] and [T, 64]"
    tile = tile or TILE
    if tile.tokens < 32 or tile.tokens & (tile.tokens - 1) or tile.heads < 1 or tile.warps < 1:
        raise ValueError(f"tile: expected tokens a power of two >= 32 (whole column blocks), heads >= 1 and "
                         f"warps >= 1, got {tile}")
    heads = cols // MLA_QK_HEAD_DIM
    grid = (cdiv(rows, tile.tokens), cdiv(heads, tile.heads))
    if tile.heads_fast:
        grid = grid[::-1]
    fast_launch(_prepass_dq_kernel, grid, src2d, cos, sin, row_dq, col_dq, flag,
                rows, heads, src2d.stride(0), src2d.stride(1), cos.stride(0), sin.stride(0),
                HEADS=tile.heads, BLOCK_R=tile.tokens, HW_CVT=hw_cvt, EVEN_R=rows % tile.tokens == 0,
                HEADS_FAST=tile.heads_fast, num_warps=tile.warps, enable_fp_fusion=False)


settle_cache_keys(globals())  # before a compile-ahead thread can hash these kernels (_common)
