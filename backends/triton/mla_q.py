"""Triton fused MLA Q up-projection + RoPE + dual MXFP8 quantize, and its backward (SEMANTICS.md 6,
spec/mla_q.py).

Forward: ONE kernel, `mla_q_uproj_rope_quant(x, w, cos, sin) -> (q_row, q_col)`
- Kernel variants, registry entries the dispatcher chooses from (FORWARD_VARIANTS: each has its
  reasons, forward_variant_reasons, and a priority; name one with MXMLA_BACKEND
  `mla_q_uproj_rope_quant=triton:<variant>` or dispatch.run(..., variant=...)), all the same arithmetic:
  - gluon_ws128 (first choice): mla_q_gluon.py's persistent warp-specialized kernel on 128-token tiles,
    sm90, Triton 3.6 / 3.9, T % 128 == 0 (H200: 1.12x the cuBLAS GEMM at T = 4096 and 16384);
  - gluon_ws: its 64-token form (T % 64 == 0; 1.22-1.24x). An MXFP8 projection runs both on its
    guarded exact bf16 dequantization (_launch_gluon_dequantized; the gated MXFP8 pointer kernel is the
    exact fallback);
  - tma: `_mla_q_fwd_tma_kernel`, sm90+ (or the interpreter) with TMA-addressable x and w: x [BM, BK],
    the head's no-RoPE rows [128, BK] and RoPE rows [64, BK] as TMA boxes, zero-filled past T and K;
  - pointer: `_mla_q_fwd_kernel` (cp.async pointer loads; any strides; sm80/89 too): serves every call.
- Program = BLOCK_M tokens x one head (192 output features of w's rows head*192 .. head*192+191), in
  grouped order (GROUP_M token tiles per head run together: the head's 576 KB of w and a few x tiles
  stay in L2). BLOCK_M is a multiple of 32, so every columnwise block (32 tokens of one feature) lies
  inside one program and both quantizations finish in registers; no second pass, no fp32 q in memory.
- Main loop on tensor cores (tl.dot, fp32 accumulate), one x tile [BLOCK_M, BLOCK_K] feeding
  - the 128 no-RoPE features: one [BLOCK_M, 128] accumulator;
  - the 64 RoPE features, de-interleaved so the epilogue is register-local. Two variants, picked by
    the autotuner (ROPE_SPLIT):
      False: w's RoPE rows are loaded permuted -- even rows 128+2k into one [32, BK] tile, odd rows
             128+2k+1 into another -- so two [BLOCK_M, 32] accumulators hold x[2k] and x[2k+1] of
             every pair directly (two N=32 dots);
      True:  one N=64 dot in natural order, then tl.reshape [BM, 32, 2] + tl.split: in the wgmma
             accumulator layout each thread owns column pairs (2k, 2k+1), so the split is a
             register renaming, and the main loop has one dot fewer.
- MXFP8 projection (x and w MXTensors blocked along K): per 32-wide K block, a tl.dot of the codes
  from a zero accumulator gives the block's partial sum, then acc = fma(partial, 2^(sx-127) *
  2^(sw-127), acc) (the same scheme as backends/triton/gemm.py: code products are exact in fp32, the
  scale product is an exact power of two; folding the scales into bf16 operands instead is not always
  exact -- e4m3 code * 2^k leaves bf16's range for scale bytes outside [3, 246]). On CUDA the codes
  are widened to fp16 before the dot (_mxfp8.mx_block_dot): the fp8 MMA of sm90 sums the block with a
  narrower accumulator, which broke SEMANTICS 6's random-input bound on the H200 (4.3e-3 of code bytes
  flipped, bound 1e-3); MXMLA_TRITON_FP8_MMA=1 brings the fp8 MMA back.
- Epilogue, all in registers, in the order of the spec:
  1. RN to bf16 (the staging of q), widened back to fp32;
  2. mla RoPE: left[k] = RN(RN(e*c[k]) - RN(o*s[k])), right[k] = RN(RN(o*c[32+k]) + RN(e*s[32+k])),
     e/o the even/odd features; the kernel is launched with enable_fp_fusion=False so no product is
     contracted into an FMA (tl.dot is a tensor-core instruction, unaffected; the MX rescale uses an
     explicit tl.fma, which is outside the spec's exact arithmetic anyway);
  3. rowwise MXFP8: the 6 blocks of 32 along the head dim are the 4 no-RoPE chunks, `left` and
     `right` (RoPE outputs are halves, so each half is exactly one block) -> codes [T, H, 192],
     scales [T, H, 6];
  4. columnwise MXFP8: blocks of 32 tokens per feature (reshape [BM/32, 32, F], max over the 32) ->
     codes [T, H, 192], scales [T/32, H, 192].
  Scale bytes and codes come from backends/triton/_mxfp8.py (rceil, saturate, e4m3): the amax is a
  float max of |v| (maxnum ignores NaN; an all-NaN block is fixed to 0 per block), the scale byte five
  integer ops per block. The fp32 -> bf16 staging and fp32 -> e4m3 rounding use the GPU's cvt.rn
  (cvt.rn.satfinite.e4m3x2.f32 saturates overflow and Inf itself; every NaN reaching it is the product
  v * s_inv, which NVIDIA arithmetic returns as the canonical positive NaN, so it encodes to 0x7F
  without a select) on CUDA (HW_CVT), and the integer-bit versions under the interpreter, whose
  conversions are wrong; the two agree bit for bit.
- Cost (H200, tools/profile_cases.py mla_q_parts; BENCHMARKS.md): the epilogue is latency-bound in
  these kernels -- in the wgmma accumulator layout a 32-token column block spans 8 lanes and 2 warps,
  so each block is a shuffle tree and a shared-memory round behind barriers (ncu: 42 % of issue gaps
  at barriers, 28.7 % issue slots busy with one 8-warp CTA per SM). Measured at T = 16384: main loop
  alone 1.25-1.3x cuBLAS, each quantization +0.6-0.8 ms. 64-token tiles with 3 stages (98 KB shared)
  put two CTAs on an SM and win the autotune (1.70-1.76x); GROUP_M 16 keeps a group's x tiles in L2.
  With Triton 3.6 the 128-token tiles also draw ptxas warning C7514 (wgmma serialized: non-wgmma
  instructions read accumulator registers inside the pipeline), which the 64-token tiles and the
  Gluon kernel do not.
- Exactness: byte-equal to spec whenever the GEMM's fp32 sums are exact (small integers times powers
  of two); on random inputs the tensor-core summation order differs from the spec's exact sum, which
  moves acc by an fp32 ulp or so; after bf16 staging that rarely changes anything (bounded in
  tests/conformance/test_mla_q_triton.py).

Backward: `mla_q_uproj_rope_quant_backward(dq, x, w, cos, sin, quantize_grad=False) -> (dx, dw)`
- One fused pre-pass kernel over dq viewed [T, N] in tiles of [BLOCK_R, 64] (tile 2 of every head is
  the RoPE part): mla RoPE backward in fp32 (no FMA), then either g = RN_bf16 [T, N] (16-bit), or both
  MXFP8 quantizations of the fp32 g in one pass: g_row blocked along N ([T, N] + scales [T, N/32]) and
  g_col blocked along T, written transposed ([N, T] + scales [N, T/32]) so it is directly the K-major
  operand of dw = g^T x.
- 16-bit GEMMs: dx = g @ w, dw = g^T @ x through torch.matmul (cuBLAS, fp32 accumulation, one RN to
  bf16): these are plain bf16 GEMMs that cuBLAS already runs at the roofline. MX x / w (the forward's
  K-blocked tensors) are dequantized to bf16 first; exact for e4m3 scale bytes in [3, 246] (e5m2:
  [10, 239]), outside that a value leaves bf16's range and rounds/saturates where the spec's does not.
- quantize_grad=True, the "dequantized" variant (_backward_dequantized): the pre-pass writes
  the bf16 dequantization of both quantizations of g instead of their codes -- each value rounded to the
  e4m3 grid times its scale, exact in bf16 inside BF16_SAFE_SCALE_BYTES, a per-block guard flagging the
  rest -- and two cuBLAS bf16 GEMMs follow; a raised guard sends the op to the exact path (gated kernels,
  no host sync once compiled). That form of the pre-pass runs on mla_q_prepass.py's per-head kernel (the
  same bytes as _grad_prep_kernel's ROW_DQ / COL_DQ outputs; H200: 0.81 of copy bandwidth against 0.56-0.61;
  PREPASS_HEADS_KERNEL = False sends it back to the general kernel).
"""
from __future__ import annotations

import functools
import math
from typing import List

import torch
import triton
import triton.language as tl

from spec.constants import MLA_QK_HEAD_DIM, MLA_ROPE_DIM
from spec.mxtensor import MXTensor

from .. import kept, settings
from ..registry import register, register_variant, variants
from ._common import (autotune_cached, autotune_enabled, cdiv, device_capability, fast_launch, interpret_mode,
                      launch_gated, placeholder, triton_reasons)
from ._fpbits import round_bf16, round_f32, widen_f32
from ._mxfp8 import (amax_bits_ignoring_nan, e4m3_value, encode_e4m3_arith, fp8_mma_widened, mx_block_dot,
                     rceil_scale_from_amax_bits, scale_multiplier, scale_value)
from ._tiles import grouped_tile
from .gemm import BF16_SAFE_SCALE_BYTES, bf16_matmul_fp32_sum, exact_fallback, m_bucket, scale_offsets
from .mla_q_prepass import block_unsafe, prepass_dequantized, rope_grad_chunk
from .tile_choice import first_config

__all__ = ["mla_q_uproj_rope_quant", "mla_q_uproj_rope_quant_backward"]

_HEAD = MLA_QK_HEAD_DIM  # 192
# the backward pre-pass writes e4m3 only
SAFE_LO = tl.constexpr(BF16_SAFE_SCALE_BYTES["e4m3"][0])
SAFE_HI = tl.constexpr(BF16_SAFE_SCALE_BYTES["e4m3"][1])
_NOPE = MLA_QK_HEAD_DIM - MLA_ROPE_DIM  # 128
_ELEM_TORCH = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _empty(shape, dtype, device):
    """Output allocation (never initialised: every byte is written by a kernel). Tests replace this
    with a 0xFF-filled allocator so that an unwritten element fails the byte comparison."""
    return torch.empty(shape, dtype=dtype, device=device)


# --------------------------------------------------------------------------------------------------
# device helpers
# --------------------------------------------------------------------------------------------------
@triton.jit
def _stage_bf16(acc, HW_CVT: tl.constexpr):
    """fp32 value of RN_bf16(acc) (step 2 of the forward); NaN stays NaN."""
    if HW_CVT:
        return acc.to(tl.bfloat16).to(tl.float32)
    else:
        staged = widen_f32(round_f32(acc, tl.bfloat16))
        return tl.where(acc != acc, acc, staged)  # the bit rounding could carry a NaN into Inf


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    """tl.dot(a, b, acc); DOT_F32 (interpreter only) widens bf16 operands to fp32 first, because Triton's
    CPU interpreter mis-multiplies bf16 operands (it is exact: bf16 values fit fp32 and tf32)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _quantize_rows(v, HW_CVT: tl.constexpr):
    """v [R, NB, 32] fp32: (codes uint8 [R, NB, 32], scale bytes int32 [R, NB]), blocks along axis 2."""
    e = rceil_scale_from_amax_bits(amax_bits_ignoring_nan(v, 2))
    return encode_e4m3_arith(v * scale_multiplier(e)[:, :, None], HW_CVT), e


@triton.jit
def _quantize_cols(v, HW_CVT: tl.constexpr):
    """v [NB, 32, F] fp32: (codes uint8 [NB, 32, F], scale bytes int32 [NB, F]), blocks along axis 1."""
    e = rceil_scale_from_amax_bits(amax_bits_ignoring_nan(v, 1))
    return encode_e4m3_arith(v * scale_multiplier(e)[:, None, :], HW_CVT), e


@triton.jit
def _quantize_vec(v, HW_CVT: tl.constexpr):
    """v [R, 32] fp32, one block per row: (codes [R, 32], scale bytes [R])."""
    e = rceil_scale_from_amax_bits(amax_bits_ignoring_nan(v, 1))
    return encode_e4m3_arith(v * scale_multiplier(e)[:, None], HW_CVT), e


@triton.jit
def _store(ptrs, values, mask, UNMASKED: tl.constexpr):
    if UNMASKED:
        tl.store(ptrs, values)
    else:
        tl.store(ptrs, values, mask=mask)


@triton.jit
def _rope_quantize_store(nope, even, odd, pid_m, head, T, H, cos_ptr, sin_ptr, stride_cos, stride_sin,
                         row_code_ptr, row_scale_ptr, col_code_ptr, col_scale_ptr,
                         BLOCK_M: tl.constexpr, EVEN_T: tl.constexpr, HW_CVT: tl.constexpr,
                         ROW_Q: tl.constexpr = True, COL_Q: tl.constexpr = True):
    """Epilogue steps 2-4 for one [BLOCK_M tokens, head] tile: nope [BM, 128] and the even / odd RoPE
    inputs [BM, 32] (fp32 values of the bf16-staged q) -> mla RoPE -> both MXFP8 quantizations, stored.
    Addresses: one 64-bit base per output for the tile, 32-bit offsets inside it (the tile spans
    BLOCK_M * H * 192 bytes < 2^31); masks only when T is not a multiple of BLOCK_M (EVEN_T)."""
    HEAD: tl.constexpr = 192
    HALF: tl.constexpr = 32
    NB: tl.constexpr = BLOCK_M // 32
    m0 = pid_m * BLOCK_M
    rows = tl.arange(0, BLOCK_M)
    t_ok = (m0 + rows) < T
    rows_t = tl.minimum(m0 + rows, T - 1)
    offs_h = tl.arange(0, HALF)
    cos_row = cos_ptr + rows_t.to(tl.int64)[:, None] * stride_cos + offs_h[None, :]
    sin_row = sin_ptr + rows_t.to(tl.int64)[:, None] * stride_sin + offs_h[None, :]
    cos_l = widen_f32(tl.load(cos_row))
    cos_r = widen_f32(tl.load(cos_row + HALF))
    sin_l = widen_f32(tl.load(sin_row))
    sin_r = widen_f32(tl.load(sin_row + HALF))
    left = even * cos_l - odd * sin_l  # out[k]      (k < 32)
    right = odd * cos_r + even * sin_r  # out[32 + k]

    code_stride = H * HEAD  # [T, H, 192] codes, contiguous
    tile_codes = m0.to(tl.int64) * code_stride + head * HEAD
    row_codes = row_code_ptr + tile_codes
    col_codes = col_code_ptr + tile_codes
    row_scales = row_scale_ptr + (m0.to(tl.int64) * (H * 6) + head * 6)  # [T, H, 6]
    col_scales = col_scale_ptr + ((pid_m * NB).to(tl.int64) * code_stride + head * HEAD)  # [T/32, H, 192]
    row_off = rows * code_stride

    if ROW_Q:
        _store_rowwise(nope, left, right, rows, t_ok, row_codes, row_scales, row_off, H, BLOCK_M, EVEN_T, HW_CVT)
    if COL_Q:
        _store_columnwise(nope, left, right, pid_m, T, t_ok, col_codes, col_scales, row_off, code_stride,
                          BLOCK_M, EVEN_T, HW_CVT)


@triton.jit
def _store_rowwise(nope, left, right, rows, t_ok, row_codes, row_scales, row_off, H,
                   BLOCK_M: tl.constexpr, EVEN_T: tl.constexpr, HW_CVT: tl.constexpr):
    """Rowwise MXFP8 of one tile: blocks 0..3 are the no-RoPE chunks, block 4 `left`, block 5 `right`."""
    NOPE: tl.constexpr = 128
    HALF: tl.constexpr = 32
    offs_h = tl.arange(0, HALF)
    codes3, e3 = _quantize_rows(tl.reshape(nope, [BLOCK_M, 4, 32]), HW_CVT)
    feat3 = tl.arange(0, 4)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    _store(row_codes + row_off[:, None, None] + feat3, codes3, t_ok[:, None, None], EVEN_T)
    _store(row_scales + (rows * (H * 6))[:, None] + tl.arange(0, 4)[None, :], e3.to(tl.uint8), t_ok[:, None],
           EVEN_T)
    codes_l, e_l = _quantize_vec(left, HW_CVT)
    _store(row_codes + row_off[:, None] + (NOPE + offs_h)[None, :], codes_l, t_ok[:, None], EVEN_T)
    _store(row_scales + rows * (H * 6) + 4, e_l.to(tl.uint8), t_ok, EVEN_T)
    codes_r, e_r = _quantize_vec(right, HW_CVT)
    _store(row_codes + row_off[:, None] + (NOPE + HALF + offs_h)[None, :], codes_r, t_ok[:, None], EVEN_T)
    _store(row_scales + rows * (H * 6) + 5, e_r.to(tl.uint8), t_ok, EVEN_T)


@triton.jit
def _store_columnwise(nope, left, right, pid_m, T, t_ok, col_codes, col_scales, row_off, code_stride,
                      BLOCK_M: tl.constexpr, EVEN_T: tl.constexpr, HW_CVT: tl.constexpr):
    """Columnwise MXFP8 of one tile: blocks of 32 tokens per feature."""
    NOPE: tl.constexpr = 128
    HALF: tl.constexpr = 32
    NB: tl.constexpr = BLOCK_M // 32
    offs_h = tl.arange(0, HALF)
    row_off3 = tl.reshape(row_off, [NB, 32])
    ok3 = tl.reshape(t_ok, [NB, 32])
    blk_off = tl.arange(0, NB) * code_stride
    blk_ok = (pid_m * NB + tl.arange(0, NB)) < T // 32
    codes, e = _quantize_cols(tl.reshape(nope, [NB, 32, NOPE]), HW_CVT)
    feats = tl.arange(0, NOPE)
    _store(col_codes + row_off3[:, :, None] + feats[None, None, :], codes, ok3[:, :, None], EVEN_T)
    _store(col_scales + blk_off[:, None] + feats[None, :], e.to(tl.uint8), blk_ok[:, None], EVEN_T)
    codes, e = _quantize_cols(tl.reshape(left, [NB, 32, HALF]), HW_CVT)
    _store(col_codes + row_off3[:, :, None] + (NOPE + offs_h)[None, None, :], codes, ok3[:, :, None], EVEN_T)
    _store(col_scales + blk_off[:, None] + (NOPE + offs_h)[None, :], e.to(tl.uint8), blk_ok[:, None], EVEN_T)
    codes, e = _quantize_cols(tl.reshape(right, [NB, 32, HALF]), HW_CVT)
    _store(col_codes + row_off3[:, :, None] + (NOPE + HALF + offs_h)[None, None, :], codes, ok3[:, :, None],
           EVEN_T)
    _store(col_scales + blk_off[:, None] + (NOPE + HALF + offs_h)[None, :], e.to(tl.uint8), blk_ok[:, None],
           EVEN_T)


# --------------------------------------------------------------------------------------------------
# forward kernel
# --------------------------------------------------------------------------------------------------
@triton.jit
def _mla_q_fwd_kernel(
    x_ptr, w_ptr, xs_ptr, ws_ptr, cos_ptr, sin_ptr,
    row_code_ptr, row_scale_ptr, col_code_ptr, col_scale_ptr,
    T, K, H, T_BUCKET,
    stride_xt, stride_xk, stride_wn, stride_wk,
    stride_xs_row, stride_xs_col, stride_ws_row, stride_ws_col, xs_col_groups, ws_col_groups,
    stride_cos, stride_sin, gate_ptr,
    MX: tl.constexpr, XS_SWIZZLED: tl.constexpr, WS_SWIZZLED: tl.constexpr, HW_CVT: tl.constexpr,
    DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, ROPE_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_T: tl.constexpr, WIDEN_F16: tl.constexpr, GATED: tl.constexpr = False,
):
    """GATED: the exact fallback of the dequantized Gluon route (mla_q_forward_launch): every program
    returns at once unless *gate_ptr is nonzero (launched through launch_gated: no host sync once
    compiled, CUDA-graph safe)."""
    HEAD: tl.constexpr = 192
    NOPE: tl.constexpr = 128
    HALF: tl.constexpr = 32
    if GATED:
        if tl.load(gate_ptr) == 0:
            return
    pid = tl.program_id(0)
    pid_m, head = grouped_tile(pid, tl.cdiv(T, BLOCK_M), H, GROUP_M)
    tok = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_t = tl.minimum(tok, T - 1)  # tail rows read real data; their 32-row blocks are never stored
    n_nope = head * HEAD + tl.arange(0, NOPE)
    n_rope = head * HEAD + NOPE + tl.arange(0, 2 * HALF)  # natural order (ROPE_SPLIT)
    n_even = head * HEAD + NOPE + 2 * tl.arange(0, HALF)  # permuted rows: x[2k] of each pair
    n_odd = n_even + 1  # x[2k + 1]

    acc_nope = tl.zeros((BLOCK_M, NOPE), dtype=tl.float32)
    acc_rope = tl.zeros((BLOCK_M, 2 * HALF), dtype=tl.float32)
    acc_even = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    acc_odd = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)

    if MX:
        # fp8 operands, one dot per 32-wide MX block, fp32 rescale by the two power-of-two scales.
        offs_k = tl.arange(0, 32)
        x_ptrs = x_ptr + rows_t.to(tl.int64)[:, None] * stride_xt + offs_k[None, :] * stride_xk
        wn_ptrs = w_ptr + n_nope.to(tl.int64)[:, None] * stride_wn + offs_k[None, :] * stride_wk
        wr_ptrs = w_ptr + n_rope.to(tl.int64)[:, None] * stride_wn + offs_k[None, :] * stride_wk
        we_ptrs = w_ptr + n_even.to(tl.int64)[:, None] * stride_wn + offs_k[None, :] * stride_wk
        wo_ptrs = w_ptr + n_odd.to(tl.int64)[:, None] * stride_wn + offs_k[None, :] * stride_wk
        for k0 in range(0, K, BLOCK_K):
            for j in tl.static_range(BLOCK_K // 32):
                kk = k0 + j * 32
                kb = kk // 32
                if EVEN_K:
                    kmask = offs_k[None, :] >= 0
                else:
                    kmask = (kk + offs_k)[None, :] < K
                a = tl.load(x_ptrs + kk * stride_xk, mask=kmask, other=0.0)
                sx = scale_value(tl.load(xs_ptr + scale_offsets(rows_t, kb, stride_xs_row, stride_xs_col,
                                                                xs_col_groups, XS_SWIZZLED),
                                         mask=(rows_t * 0 + kk) < K, other=127).to(tl.int32))
                wn = tl.load(wn_ptrs + kk * stride_wk, mask=kmask, other=0.0)
                swn = scale_value(tl.load(ws_ptr + scale_offsets(n_nope, kb, stride_ws_row, stride_ws_col,
                                                                 ws_col_groups, WS_SWIZZLED),
                                          mask=(n_nope * 0 + kk) < K, other=127).to(tl.int32))
                acc_nope = tl.fma(mx_block_dot(a, tl.trans(wn), WIDEN_F16), sx[:, None] * swn[None, :], acc_nope)
                if ROPE_SPLIT:
                    wr = tl.load(wr_ptrs + kk * stride_wk, mask=kmask, other=0.0)
                    swr = scale_value(tl.load(ws_ptr + scale_offsets(n_rope, kb, stride_ws_row, stride_ws_col,
                                                                     ws_col_groups, WS_SWIZZLED),
                                              mask=(n_rope * 0 + kk) < K, other=127).to(tl.int32))
                    acc_rope = tl.fma(mx_block_dot(a, tl.trans(wr), WIDEN_F16), sx[:, None] * swr[None, :], acc_rope)
                else:
                    we = tl.load(we_ptrs + kk * stride_wk, mask=kmask, other=0.0)
                    wo = tl.load(wo_ptrs + kk * stride_wk, mask=kmask, other=0.0)
                    swe = scale_value(tl.load(ws_ptr + scale_offsets(n_even, kb, stride_ws_row, stride_ws_col,
                                                                     ws_col_groups, WS_SWIZZLED),
                                              mask=(n_even * 0 + kk) < K, other=127).to(tl.int32))
                    swo = scale_value(tl.load(ws_ptr + scale_offsets(n_odd, kb, stride_ws_row, stride_ws_col,
                                                                     ws_col_groups, WS_SWIZZLED),
                                              mask=(n_odd * 0 + kk) < K, other=127).to(tl.int32))
                    acc_even = tl.fma(mx_block_dot(a, tl.trans(we), WIDEN_F16), sx[:, None] * swe[None, :], acc_even)
                    acc_odd = tl.fma(mx_block_dot(a, tl.trans(wo), WIDEN_F16), sx[:, None] * swo[None, :], acc_odd)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows_t.to(tl.int64)[:, None] * stride_xt + offs_k[None, :] * stride_xk
        wn_ptrs = w_ptr + n_nope.to(tl.int64)[:, None] * stride_wn + offs_k[None, :] * stride_wk
        wr_ptrs = w_ptr + n_rope.to(tl.int64)[:, None] * stride_wn + offs_k[None, :] * stride_wk
        we_ptrs = w_ptr + n_even.to(tl.int64)[:, None] * stride_wn + offs_k[None, :] * stride_wk
        wo_ptrs = w_ptr + n_odd.to(tl.int64)[:, None] * stride_wn + offs_k[None, :] * stride_wk
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(x_ptrs)
                wn = tl.load(wn_ptrs)
            else:
                kmask = (k0 + offs_k)[None, :] < K
                a = tl.load(x_ptrs, mask=kmask, other=0.0)
                wn = tl.load(wn_ptrs, mask=kmask, other=0.0)
            acc_nope = _dot(a, tl.trans(wn), acc_nope, DOT_F32)
            if ROPE_SPLIT:
                if EVEN_K:
                    wr = tl.load(wr_ptrs)
                else:
                    wr = tl.load(wr_ptrs, mask=(k0 + offs_k)[None, :] < K, other=0.0)
                acc_rope = _dot(a, tl.trans(wr), acc_rope, DOT_F32)
            else:
                if EVEN_K:
                    we = tl.load(we_ptrs)
                    wo = tl.load(wo_ptrs)
                else:
                    we = tl.load(we_ptrs, mask=(k0 + offs_k)[None, :] < K, other=0.0)
                    wo = tl.load(wo_ptrs, mask=(k0 + offs_k)[None, :] < K, other=0.0)
                acc_even = _dot(a, tl.trans(we), acc_even, DOT_F32)
                acc_odd = _dot(a, tl.trans(wo), acc_odd, DOT_F32)
            x_ptrs += BLOCK_K * stride_xk
            wn_ptrs += BLOCK_K * stride_wk
            wr_ptrs += BLOCK_K * stride_wk
            we_ptrs += BLOCK_K * stride_wk
            wo_ptrs += BLOCK_K * stride_wk

    # ---- epilogue: stage to bf16, RoPE in fp32 (no FMA), two MXFP8 quantizations ----
    nope = _stage_bf16(acc_nope, HW_CVT)
    if ROPE_SPLIT:
        even, odd = tl.split(tl.reshape(_stage_bf16(acc_rope, HW_CVT), [BLOCK_M, 32, 2]))
    else:
        even = _stage_bf16(acc_even, HW_CVT)
        odd = _stage_bf16(acc_odd, HW_CVT)
    _rope_quantize_store(nope, even, odd, pid_m, head, T, H, cos_ptr, sin_ptr, stride_cos, stride_sin,
                         row_code_ptr, row_scale_ptr, col_code_ptr, col_scale_ptr, BLOCK_M, EVEN_T, HW_CVT)


@triton.jit
def _mla_q_fwd_tma_kernel(
    x_desc, wn_desc, wr_desc, xs_ptr, ws_ptr, cos_ptr, sin_ptr,
    row_code_ptr, row_scale_ptr, col_code_ptr, col_scale_ptr,
    T, K, H, T_BUCKET,
    stride_xs_row, stride_xs_col, stride_ws_row, stride_ws_col, xs_col_groups, ws_col_groups,
    stride_cos, stride_sin,
    MX: tl.constexpr, XS_SWIZZLED: tl.constexpr, WS_SWIZZLED: tl.constexpr, HW_CVT: tl.constexpr,
    DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_T: tl.constexpr, WIDEN_F16: tl.constexpr, EPILOGUE: tl.constexpr = 0,
):
    """The same op with TMA tile loads (Hopper tensor descriptors): x [BM, BK], the head's no-RoPE rows
    [128, BK] and RoPE rows [64, BK] (natural order, split in registers as ROPE_SPLIT). TMA zero-fills
    rows past T and columns past K, so the loop has no masks and no clamped addresses, and the copies
    use no registers (the pointer kernel holds 64-bit addresses for every cp.async)."""
    HEAD: tl.constexpr = 192
    NOPE: tl.constexpr = 128
    pid = tl.program_id(0)
    pid_m, head = grouped_tile(pid, tl.cdiv(T, BLOCK_M), H, GROUP_M)
    m0 = pid_m * BLOCK_M
    n0 = head * HEAD
    acc_nope = tl.zeros((BLOCK_M, NOPE), dtype=tl.float32)
    acc_rope = tl.zeros((BLOCK_M, HEAD - NOPE), dtype=tl.float32)
    if MX:
        rows_t = tl.minimum(m0 + tl.arange(0, BLOCK_M), T - 1)
        n_nope = n0 + tl.arange(0, NOPE)
        n_rope = n0 + NOPE + tl.arange(0, HEAD - NOPE)
        for k0 in range(0, K, BLOCK_K):
            for j in tl.static_range(BLOCK_K // 32):
                kk = k0 + j * 32
                kb = kk // 32
                a = x_desc.load([m0, kk])  # [BM, 32] fp8, one MX block
                wn = wn_desc.load([n0, kk])
                wr = wr_desc.load([n0 + NOPE, kk])
                sx = scale_value(tl.load(xs_ptr + scale_offsets(rows_t, kb, stride_xs_row, stride_xs_col,
                                                                xs_col_groups, XS_SWIZZLED),
                                         mask=(rows_t * 0 + kk) < K, other=127).to(tl.int32))
                swn = scale_value(tl.load(ws_ptr + scale_offsets(n_nope, kb, stride_ws_row, stride_ws_col,
                                                                 ws_col_groups, WS_SWIZZLED),
                                          mask=(n_nope * 0 + kk) < K, other=127).to(tl.int32))
                swr = scale_value(tl.load(ws_ptr + scale_offsets(n_rope, kb, stride_ws_row, stride_ws_col,
                                                                 ws_col_groups, WS_SWIZZLED),
                                          mask=(n_rope * 0 + kk) < K, other=127).to(tl.int32))
                acc_nope = tl.fma(mx_block_dot(a, tl.trans(wn), WIDEN_F16), sx[:, None] * swn[None, :], acc_nope)
                acc_rope = tl.fma(mx_block_dot(a, tl.trans(wr), WIDEN_F16), sx[:, None] * swr[None, :], acc_rope)
    else:
        for k0 in range(0, K, BLOCK_K):
            a = x_desc.load([m0, k0])
            wn = wn_desc.load([n0, k0])
            wr = wr_desc.load([n0 + NOPE, k0])
            acc_nope = _dot(a, tl.trans(wn), acc_nope, DOT_F32)
            acc_rope = _dot(a, tl.trans(wr), acc_rope, DOT_F32)

    if EPILOGUE == 3:  # profiling: the main loop alone (a store no launch takes keeps the dots alive)
        if T < 0:
            tl.store(row_code_ptr + tl.arange(0, BLOCK_M), tl.sum(acc_nope, 1) + tl.sum(acc_rope, 1))
    elif EPILOGUE == 4:  # profiling: the GEMM's own epilogue, q staged to bf16 and stored [T, H * 192]
        out = row_code_ptr.to(tl.pointer_type(tl.bfloat16)) + m0.to(tl.int64) * (H * HEAD) + n0
        offs_m = tl.arange(0, BLOCK_M)
        ok = (m0 + offs_m)[:, None] < T
        tl.store(out + (offs_m * (H * HEAD))[:, None] + tl.arange(0, NOPE)[None, :], acc_nope.to(tl.bfloat16), mask=ok)
        tl.store(out + (offs_m * (H * HEAD))[:, None] + (NOPE + tl.arange(0, HEAD - NOPE))[None, :],
                 acc_rope.to(tl.bfloat16), mask=ok)
    else:
        nope = _stage_bf16(acc_nope, HW_CVT)
        even, odd = tl.split(tl.reshape(_stage_bf16(acc_rope, HW_CVT), [BLOCK_M, 32, 2]))
        _rope_quantize_store(nope, even, odd, pid_m, head, T, H, cos_ptr, sin_ptr, stride_cos, stride_sin,
                             row_code_ptr, row_scale_ptr, col_code_ptr, col_scale_ptr, BLOCK_M, EVEN_T, HW_CVT,
                             EPILOGUE != 2, EPILOGUE != 1)


# Epilogue variants of the TMA kernel for profiling (tools/profile_cases.py mla_q_parts): the product
# is "full"; the others time the same main loop with part of the epilogue.
EPILOGUE_PARTS = {"full": 0, "rowwise": 1, "columnwise": 2, "mainloop": 3, "bf16_store": 4}


def _tma_block_hook(nargs):
    """Autotune pre-hook: a TensorDescriptor's box is part of the argument, so set it per config."""
    bk = 32 if nargs["MX"] else nargs["BLOCK_K"]
    nargs["x_desc"].block_shape = [nargs["BLOCK_M"], bk]
    nargs["wn_desc"].block_shape = [_NOPE, bk]
    nargs["wr_desc"].block_shape = [_HEAD - _NOPE, bk]


def _fwd_configs(mx: bool, tma: bool = False):
    """Autotune candidates (BLOCK_M, BLOCK_K, warps, stages, ROPE_SPLIT, maxnreg).

    bf16, one CTA per SM: 128 tokens x one head (192) x BLOCK_K 64 = 40 KB per stage, 3-4 stages,
    8 warps (two warpgroups of 64 rows); the epilogue (~3k instructions per thread, mostly the
    cross-lane amax reductions and per-block scale bytes) then runs while the tensor cores idle.
    bf16, two CTAs per SM: maxnreg=128 and <= 82 KB of shared memory (BLOCK_K 32 x 4 stages or
    64 x 2) let two programs share an SM, so one program's epilogue overlaps the other's main loop;
    the main loop keeps its accumulators in registers (96 per thread), only the epilogue spills.
    Small T: 64-row tiles, 4 warps (at 32-wide K steps several fit an SM). GROUP_M 16 token tiles per
    head run together: at T = 4096 each head's w is read from DRAM about twice. MX (fp8 operands, a dot per 32-wide K block): per-block partial
    accumulators raise register pressure, so 32/64-wide K steps.
    """
    if tma:
        # six of the eleven candidates timed on the H200 (results/h200-2026-11-30-e45dc49/mla_q_parts_*.txt): the
        # 128-token tiles, and 64-token tiles at 3 stages (with / without a register cap), 2 stages and
        # 32-wide K; 64 x 64, 4 warps, 3 stages (two CTAs per SM) won at T = 4096 and 16384
        shapes = ((128, 64, 8, 3, True, None), (128, 64, 8, 4, True, None), (64, 64, 4, 3, True, None),
                  (64, 64, 4, 3, True, 168), (64, 64, 4, 2, True, None), (64, 32, 4, 4, True, None))
        if mx:
            shapes = ((128, 32, 8, 6, True, None), (128, 64, 8, 4, True, None), (64, 64, 4, 4, True, None))
    elif not mx:
        shapes = ((128, 64, 8, 3, False, None), (128, 64, 8, 3, True, None), (128, 64, 8, 4, True, None),
                  (128, 32, 8, 4, True, 128), (64, 64, 4, 4, False, None))
    else:
        shapes = ((128, 32, 8, 6, True, None), (128, 64, 8, 4, False, None), (64, 64, 4, 4, False, None))
    cfgs = []
    for bm, bk, warps, stages, split, maxnreg in shapes:
        meta = {"BLOCK_M": bm, "BLOCK_K": bk, "GROUP_M": 16 if bm == 128 or tma else 8}
        if not tma:
            meta["ROPE_SPLIT"] = split
        cfgs.append(triton.Config(meta, num_warps=warps, num_stages=stages, maxnreg=maxnreg,
                                  pre_hook=_tma_block_hook if tma else None))
    return cfgs


def _even_k(args):
    return args["K"] % args["BLOCK_K"] == 0


def _even_t(args):
    return args["T"] % args["BLOCK_M"] == 0


_HEURISTICS = {"EVEN_K": _even_k, "EVEN_T": _even_t}
_FWD_KEY = ["T_BUCKET", "K", "H", "MX", "XS_SWIZZLED", "WS_SWIZZLED"]
_fwd_fixed = triton.heuristics(_HEURISTICS)(_mla_q_fwd_kernel)
_fwd_tma_fixed = triton.heuristics({"EVEN_T": _even_t})(_mla_q_fwd_tma_kernel)
# Without MXMLA_TRITON_AUTOTUNE=1 the launch takes _FWD_DEFAULT (below) and never these autotuners.
_fwd_tuned = {mx: autotune_cached(configs=_fwd_configs(mx), key=_FWD_KEY, heuristic=first_config)(_fwd_fixed)
              for mx in (False, True)}
_fwd_tma_tuned = {mx: autotune_cached(configs=_fwd_configs(mx, tma=True), key=_FWD_KEY, heuristic=first_config)(
    _fwd_tma_fixed) for mx in (False, True)}
_FWD_DEFAULT = {False: dict(BLOCK_M=128, BLOCK_K=32, GROUP_M=16, ROPE_SPLIT=True, num_warps=8, num_stages=4, maxnreg=128),
                True: dict(BLOCK_M=128, BLOCK_K=32, GROUP_M=8, ROPE_SPLIT=True, num_warps=8, num_stages=6)}


def _interpret_config(**overrides):
    cfg = dict(BLOCK_M=64, BLOCK_K=32, GROUP_M=2, ROPE_SPLIT=False, num_warps=4, num_stages=1)
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    return cfg


def _hw_cvt(device: torch.device) -> bool:
    """GPU cvt.rn instructions for bf16 / e4m3 (sm89+ has the fp8 conversion); bit versions otherwise."""
    return device.type == "cuda" and not interpret_mode() and device_capability(device) >= (8, 9)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _scale_args(t: MXTensor):
    """(scale tensor, row stride, column stride, col_groups, swizzled) of a K-blocked 2-D MXTensor."""
    if t.scale_layout == "swizzled":
        return t.scale, 0, 0, -(-(t.data.shape[1] // 32) // 4), True
    return t.scale, t.scale.stride(0), t.scale.stride(1), 0, False


def _tma_ok(t: torch.Tensor) -> bool:
    """A 2-D tensor a TMA descriptor can address: unit last stride, 16-byte aligned base and row stride."""
    return (t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0)


def gluon_reasons(x, w) -> List[str]:
    """Why the Gluon sm90 kernels (mla_q_gluon.py) cannot run on these operands; empty when they can.
    An MXFP8 projection runs them on the exact bf16 dequantization of x and w (see
    _launch_gluon_dequantized), so only device, version and token count apply to it."""
    mx = isinstance(x, MXTensor)
    if mx != isinstance(w, MXTensor):
        return ["x and w must both be bf16 or both MXTensors"]
    xd, wd = (x.data, w.data) if mx else (x, w)
    if interpret_mode() or xd.device.type != "cuda":
        return ["the Gluon kernel runs on CUDA only (no interpreter)"]
    try:
        from . import mla_q_gluon
    except ImportError as exc:  # a Triton without Gluon's Hopper API
        return [f"Gluon unavailable in this Triton ({triton.__version__}): {exc}"]
    return mla_q_gluon.gluon_reasons(xd, wd, dequantized=mx)


# --------------------------------------------------------------------------------------------------
# forward kernel variants: registry entries (backends/registry.py), each with its reasons and priority
# --------------------------------------------------------------------------------------------------
FORWARD_OP = "mla_q_uproj_rope_quant"
GLUON_VARIANTS = ("gluon_ws", "gluon_ws128")
# Priority: the automatic choice takes the highest whose reasons are empty. On the H200 (2026-11-30,
# bench_mla_q.py --quick) the warp-specialized 128-token kernel ran 1.12x the cuBLAS GEMM at T = 4096
# and 16384, its 64-token form 1.22-1.24x; the TMA kernel serves sm90+ where the Gluon kernels refuse,
# the pointer kernel every call.
FORWARD_VARIANTS = {"gluon_ws128": 40, "gluon_ws": 30, "tma": 20, "pointer": 10}


def _gluon_variant_reasons(variant, x, w) -> List[str]:
    """gluon_reasons, plus the 128-token kernel's token multiple."""
    reasons = gluon_reasons(x, w)
    tokens = (x.data if isinstance(x, MXTensor) else x).shape[0]
    if variant == "gluon_ws128" and tokens % 128:
        reasons.append(f"gluon_ws128 needs tokens % 128 == 0, got {tokens}")
    return reasons


def _tma_reasons(x, w) -> List[str]:
    xd, wd = (x.data, w.data) if isinstance(x, MXTensor) else (x, w)
    reasons = []
    if not (_tma_ok(xd) and _tma_ok(wd)):
        reasons.append("x and w must be TMA-addressable: 2-D, unit last stride, 16-byte aligned base and rows")
    if xd.device.type == "cuda" and not interpret_mode() and torch.cuda.get_device_capability(xd.device) < (9, 0):
        cc = torch.cuda.get_device_capability(xd.device)
        reasons.append(f"TMA needs compute capability >= 9.0, {xd.device} is {cc[0]}.{cc[1]}")
    return reasons


def forward_variant_reasons(variant, x, w) -> List[str]:
    """Why forward kernel `variant` cannot run on x, w (empty: it can)."""
    if variant in GLUON_VARIANTS:
        return _gluon_variant_reasons(variant, x, w)
    if variant == "tma":
        return _tma_reasons(x, w)
    if variant == "pointer":
        return []
    raise ValueError(f"variant: expected one of {', '.join(FORWARD_VARIANTS)}, got {variant!r}")


def _forward_check(variant):
    return lambda x, w, cos, sin: forward_variant_reasons(variant, x, w)


for _name, _priority in FORWARD_VARIANTS.items():
    register_variant(FORWARD_OP, "triton", _name, _priority, check=_forward_check(_name))


def forward_variant(x, w) -> str:
    """The automatic choice among FORWARD_VARIANTS (the dispatcher's rule: the highest priority whose
    reasons are empty; the pointer kernel serves every call)."""
    for v in variants(FORWARD_OP, "triton"):
        if not forward_variant_reasons(v.name, x, w):
            return v.name
    return "pointer"


def mla_q_forward_launch(x, w, cos, sin, config=None, variant=None, epilogue="full", verified=False):
    """Run the fused forward. `variant`: one of FORWARD_VARIANTS (default: forward_variant; a named one
    that cannot run raises ValueError with its reasons); `config` (dict of
    BLOCK_M, BLOCK_K, GROUP_M, ROPE_SPLIT (pointer only), num_warps, num_stages) bypasses autotuning
    (tests and benchmarks use it to pin a variant). `epilogue` other than "full" (EPILOGUE_PARTS; TMA
    variant and a pinned config only) is for profiling: its outputs are not the op's. `verified`: the
    caller already checked the named variant's reasons for these operands (the dispatcher does)."""
    mx = isinstance(x, MXTensor)
    xd, wd = (x.data, w.data) if mx else (x, w)
    tokens, k = xd.shape
    heads = wd.shape[0] // _HEAD
    device = xd.device
    if epilogue not in EPILOGUE_PARTS:
        raise ValueError(f"epilogue: expected one of {sorted(EPILOGUE_PARTS)}, got {epilogue!r}")
    if epilogue != "full" and (variant != "tma" or config is None):
        raise ValueError(f"epilogue={epilogue!r} (profiling) needs variant='tma' and a pinned config")
    row_codes = _empty((tokens, heads, _HEAD * (2 if epilogue == "bf16_store" else 1)), torch.float8_e4m3fn, device)
    row_scale = _empty((tokens, heads, _HEAD // 32), torch.uint8, device)
    col_codes = _empty((tokens, heads, _HEAD), torch.float8_e4m3fn, device)
    col_scale = _empty((tokens // 32, heads, _HEAD), torch.uint8, device)
    if epilogue == "full":
        q_row = MXTensor(row_codes, row_scale, 2, "e4m3", "compact")
        q_col = MXTensor(col_codes, col_scale, 0, "e4m3", "compact")
    else:  # profiling: raw buffers (bf16_store's row buffer holds bf16 q, not codes)
        q_row, q_col = (row_codes, row_scale), (col_codes, col_scale)
    if tokens == 0 or heads == 0 or k == 0:
        if tokens and heads:  # K = 0: q = 0 everywhere
            for t in (row_codes, col_codes, row_scale, col_scale):
                t.view(torch.uint8).zero_()
        return q_row, q_col
    if variant is None:
        variant, verified = forward_variant(x, w), True
    reasons = [] if verified else forward_variant_reasons(variant, x, w)
    if reasons:  # a named kernel runs or raises: never another one in its place
        raise ValueError(f"variant={variant!r} cannot run here: " + "; ".join(reasons))
    cos, sin = _unit_last(cos), _unit_last(sin)
    if variant in GLUON_VARIANTS:
        from . import mla_q_gluon

        if mx:
            _launch_gluon_dequantized(x, w, cos, sin, row_codes, row_scale, col_codes, col_scale, config, variant)
        else:
            mla_q_gluon.launch(xd, wd, cos, sin, row_codes.view(torch.uint8), row_scale, col_codes.view(torch.uint8),
                               col_scale, config=config, variant=variant)
        return q_row, q_col
    _launch_triton(x, w, cos, sin, (row_codes, row_scale, col_codes, col_scale), config, variant, epilogue)
    return q_row, q_col


def _launch_gluon_dequantized(x, w, cos, sin, row_codes, row_scale, col_codes, col_scale, config, variant):
    """The MXFP8 projection on the Gluon kernels: x and w dequantized to bf16 by the guarded flat pass
    (exact: an e4m3 / e5m2 code times a power of two inside BF16_SAFE_SCALE_BYTES is a bf16 value, and
    bf16 x bf16 products are exact in fp32, so the kernel computes the spec's fp32 sum of exact products
    like the MXFP8 kernels do, in another order), then the MXFP8 pointer kernel, gated on the guard,
    recomputes everything when a nonzero code sits under a scale byte outside that range or a value is
    not finite. Cost beside the GEMM: one pass over x, and one over w when its dequantization is not
    kept from an earlier call (_weight_bf16)."""
    from . import mla_q_gluon

    w16, flag, (x16,) = _weight_bf16(w, also=(x,))  # one launch for both (host time: one launch less)
    mla_q_gluon.launch(x16, w16, cos, sin, row_codes.view(torch.uint8), row_scale, col_codes.view(torch.uint8),
                       col_scale, config=config, variant=variant)
    cfg = _interpret_config() if interpret_mode() else dict(_FWD_DEFAULT[True])
    cfg["ROPE_SPLIT"] = True
    _launch_triton(x, w, cos, sin, (row_codes, row_scale, col_codes, col_scale), cfg, "pointer", "full", gate=flag)


def _launch_triton(x, w, cos, sin, outputs, config, variant, epilogue, gate=None):
    """The Triton kernels (TMA or pointer) filling the four output buffers; gate: an int32 flag tensor
    for the gated pointer kernel (the Gluon route's exact fallback)."""
    row_codes, row_scale, col_codes, col_scale = outputs
    mx = isinstance(x, MXTensor)
    xd, wd = (x.data, w.data) if mx else (x, w)
    tokens, k = xd.shape
    heads = wd.shape[0] // _HEAD
    device = xd.device
    if mx:
        xs, sxr, sxc, x_groups, x_swz = _scale_args(x)
        ws, swr, swc, w_groups, w_swz = _scale_args(w)
    else:
        dummy = placeholder(torch.uint8, device)  # scale pointers of a bf16 projection: never read
        xs, sxr, sxc, x_groups, x_swz = dummy, 0, 0, 0, False
        ws, swr, swc, w_groups, w_swz = dummy, 0, 0, 0, False
    outs = (row_codes.view(torch.uint8), row_scale, col_codes.view(torch.uint8), col_scale)
    tail = (sxr, sxc, swr, swc, x_groups, w_groups, cos.stride(0), sin.stride(0))
    meta = dict(MX=mx, XS_SWIZZLED=x_swz, WS_SWIZZLED=w_swz, HW_CVT=_hw_cvt(device), DOT_F32=interpret_mode(),
                WIDEN_F16=mx and fp8_mma_widened(device))
    if interpret_mode() and config is None:
        config = _interpret_config()
    if config is None and not autotune_enabled():
        config = dict(_FWD_DEFAULT[mx])
    if variant == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        bk = 32 if mx else (config["BLOCK_K"] if config else 64)  # boxes are reset per config by the hook
        bm = config["BLOCK_M"] if config else 128
        x_desc = TensorDescriptor(xd, list(xd.shape), list(xd.stride()), [bm, bk])
        wn_desc = TensorDescriptor(wd, list(wd.shape), list(wd.stride()), [_NOPE, bk])
        wr_desc = TensorDescriptor(wd, list(wd.shape), list(wd.stride()), [_HEAD - _NOPE, bk])
        args = (x_desc, wn_desc, wr_desc, xs, ws, cos, sin, *outs, tokens, k, heads, m_bucket(tokens), *tail)
        if config is not None:
            config = {key: v for key, v in config.items() if key != "ROPE_SPLIT"}
            grid = (cdiv(tokens, config["BLOCK_M"]) * heads,)
            _fwd_tma_fixed[grid](*args, **meta, **config, EPILOGUE=EPILOGUE_PARTS[epilogue], enable_fp_fusion=False)
        else:
            grid = lambda c: (cdiv(tokens, c["BLOCK_M"]) * heads,)  # noqa: E731
            _fwd_tma_tuned[mx][grid](*args, **meta, enable_fp_fusion=False)
        return
    args = (xd, wd, xs, ws, cos, sin, *outs, tokens, k, heads, m_bucket(tokens),
            xd.stride(0), xd.stride(1), wd.stride(0), wd.stride(1), *tail, gate if gate is not None else xs)
    if gate is not None:
        meta["GATED"] = True
    if config is not None:
        grid = (cdiv(tokens, config["BLOCK_M"]) * heads,)
        if gate is not None:
            launch_gated(_fwd_fixed, grid, gate, *args, **meta, **config, enable_fp_fusion=False)
        else:
            _fwd_fixed[grid](*args, **meta, **config, enable_fp_fusion=False)
    else:
        grid = lambda c: (cdiv(tokens, c["BLOCK_M"]) * heads,)  # noqa: E731
        _fwd_tuned[mx][grid](*args, **meta, enable_fp_fusion=False)


# --------------------------------------------------------------------------------------------------
# backward pre-pass: RoPE backward + bf16 staging or dual MXFP8 quantize (also: plain quantize along rows)
# --------------------------------------------------------------------------------------------------
@triton.jit
def _grad_prep_kernel(
    src_ptr, cos_ptr, sin_ptr,
    g_ptr, row_code_ptr, row_scale_ptr, colt_code_ptr, colt_scale_ptr,
    R, C, stride_sr, stride_sc, stride_cos, stride_sin,
    row_dq_ptr, col_dq_ptr, flag_ptr,
    ROPE: tl.constexpr, WRITE_BF16: tl.constexpr, ROW_Q: tl.constexpr, COL_Q: tl.constexpr,
    HW_CVT: tl.constexpr, BLOCK_R: tl.constexpr,
    ROW_DQ: tl.constexpr = False, COL_DQ: tl.constexpr = False, GATED: tl.constexpr = False,
):
    """src [R, C] (bf16) in tiles of [BLOCK_R, 64]. With ROPE, C = H * 192 and tile 2 of every head
    holds its RoPE gradient halves (gL | gR), turned into interleaved pairs by the mla backward rule.
    Outputs (each optional): g = RN_bf16 [R, C]; row-blocked codes [R, C] + scales [R, C/32];
    column-blocked (along R) codes written TRANSPOSED [C, R] + scales [C, R/32]; ROW_DQ / COL_DQ: the
    bf16 dequantization of the row- / column-blocked quantization, [R, C] each (exact where the guard
    stays down; *flag_ptr = 1 where a nonzero code's scale byte is outside the bf16-safe range or a value
    is not finite). GATED: every program returns at once unless *flag_ptr is nonzero (the fallback)."""
    WIDTH: tl.constexpr = 64
    HALF: tl.constexpr = 32
    if GATED:
        if tl.load(flag_ptr) == 0:
            return
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    rows = tl.minimum(offs_r, R - 1)
    offs_c = pid_c * WIDTH + tl.arange(0, WIDTH)
    c_ok = offs_c < C
    src_rows = src_ptr + rows.to(tl.int64)[:, None] * stride_sr
    if ROPE and (pid_c % 3 == 2):
        offs_h = tl.arange(0, HALF)
        cos_row = cos_ptr + rows.to(tl.int64)[:, None] * stride_cos + offs_h[None, :]
        sin_row = sin_ptr + rows.to(tl.int64)[:, None] * stride_sin + offs_h[None, :]
        v = rope_grad_chunk(src_rows, pid_c * WIDTH, stride_sc, cos_row, sin_row, BLOCK_R)
    else:
        v = widen_f32(tl.load(src_rows + offs_c[None, :] * stride_sc, mask=c_ok[None, :], other=0.0))

    if WRITE_BF16:
        tl.store(g_ptr + offs_r.to(tl.int64)[:, None] * C + offs_c[None, :], round_bf16(v, HW_CVT),
                 mask=r_ok[:, None] & c_ok[None, :])
    if ROW_Q:
        codes, e = _quantize_rows(tl.reshape(v, [BLOCK_R, 2, 32]), HW_CVT)
        blk = pid_c * 2 + tl.arange(0, 2)
        blk_ok = blk * 32 < C
        tl.store(row_code_ptr + offs_r.to(tl.int64)[:, None, None] * C
                 + tl.reshape(offs_c, [2, 32])[None, :, :], codes,
                 mask=r_ok[:, None, None] & blk_ok[None, :, None])
        tl.store(row_scale_ptr + offs_r.to(tl.int64)[:, None] * (C // 32) + blk[None, :], e.to(tl.uint8),
                 mask=r_ok[:, None] & blk_ok[None, :])
    if COL_Q:
        NB: tl.constexpr = BLOCK_R // 32
        codes, e = _quantize_cols(tl.reshape(v, [NB, 32, WIDTH]), HW_CVT)
        r3 = tl.reshape(offs_r, [NB, 32])
        tl.store(colt_code_ptr + offs_c.to(tl.int64)[None, None, :] * R + r3[:, :, None], codes,
                 mask=tl.reshape(r_ok, [NB, 32])[:, :, None] & c_ok[None, None, :])
        rb = pid_r * NB + tl.arange(0, NB)
        tl.store(colt_scale_ptr + offs_c.to(tl.int64)[None, :] * (R // 32) + rb[:, None], e.to(tl.uint8),
                 mask=(rb < R // 32)[:, None] & c_ok[None, :])
    if ROW_DQ or COL_DQ:
        out_off = offs_r.to(tl.int64)[:, None] * C + offs_c[None, :]
        ok2 = r_ok[:, None] & c_ok[None, :]
        # the guard per element is only "v is NaN": a nonzero code under an unsafe scale byte is decided
        # per block (the block's largest code is the code of its amax), and no other value can leave a
        # bf16-exact dequantization non-finite (Inf blocks take byte 254, outside the safe range). The
        # flag is raised by stores predicated on the condition (all writing 1), not by a reduction of
        # the tile: no cross-warp exchange on the path where nothing is raised
        tl.store(flag_ptr + tl.zeros([BLOCK_R, WIDTH], tl.int32), 1, mask=ok2 & (v != v))
        if ROW_DQ:
            v3 = tl.reshape(v, [BLOCK_R, 2, 32])
            amax = amax_bits_ignoring_nan(v3, 2)
            e = rceil_scale_from_amax_bits(amax)
            s_inv = scale_multiplier(e)
            dq_r = tl.reshape(e4m3_value(v3 * s_inv[:, :, None]) * scale_value(e)[:, :, None], [BLOCK_R, WIDTH])
            tl.store(row_dq_ptr + out_off, round_bf16(dq_r, HW_CVT), mask=ok2)
            blk_ok = r_ok[:, None] & ((pid_c * 2 + tl.arange(0, 2)) * 32 < C)[None, :]
            tl.store(flag_ptr + tl.zeros([BLOCK_R, 2], tl.int32), 1, mask=block_unsafe(amax, e, s_inv) & blk_ok)
        if COL_DQ:
            NB2: tl.constexpr = BLOCK_R // 32
            v3 = tl.reshape(v, [NB2, 32, WIDTH])
            amax = amax_bits_ignoring_nan(v3, 1)
            e = rceil_scale_from_amax_bits(amax)
            s_inv = scale_multiplier(e)
            dq_c = tl.reshape(e4m3_value(v3 * s_inv[:, None, :]) * scale_value(e)[:, None, :], [BLOCK_R, WIDTH])
            tl.store(col_dq_ptr + out_off, round_bf16(dq_c, HW_CVT), mask=ok2)
            blk_ok = ((pid_r * NB2 + tl.arange(0, NB2)) * 32 < R)[:, None] & c_ok[None, :]
            tl.store(flag_ptr + tl.zeros([NB2, WIDTH], tl.int32), 1, mask=block_unsafe(amax, e, s_inv) & blk_ok)


PREPASS_HEADS_KERNEL = True  # False: the general kernel below serves the backward's form too (tests compare the two)
_PREP_DQ_TILE = (32, 2)  # (rows per tile, warps) of the dequantized-output pre-pass: the fastest of six on the H200


def _prep_launch(src2d, cos=None, sin=None, rope=False, write_bf16=False, row_q=False, col_q=False,
                 row_dq=False, col_dq=False, flag=None, gated=False, buffers=None):
    """Run the pre-pass on a 2-D bf16 tensor; returns (g, (row codes, row scales), (colT codes, colT
    scales)), or with row_dq / col_dq (flag: the int32 guard flag) the bf16 dequantized (row, col)
    tensors. gated: the run happens only when *flag is set (buffers: preallocated (row codes, row
    scales, colT codes, colT scales) to write)."""
    rows, cols = src2d.shape
    device = src2d.device
    # the slots of outputs switched off (never written; the flag is written only with row_dq / col_dq,
    # which pass their own)
    dummy8 = placeholder(torch.uint8, device)
    g = _empty((rows, cols), torch.bfloat16, device) if write_bf16 else None
    if buffers is not None:
        row_codes, row_scale, colt_codes, colt_scale = buffers
    else:
        row_codes = _empty((rows, cols), torch.float8_e4m3fn, device) if row_q else None
        row_scale = _empty((rows, cols // 32), torch.uint8, device) if row_q else None
        colt_codes = _empty((cols, rows), torch.float8_e4m3fn, device) if col_q else None
        colt_scale = _empty((cols, rows // 32), torch.uint8, device) if col_q else None
    row_deq = _empty((rows, cols), torch.bfloat16, device) if row_dq else None
    col_deq = _empty((rows, cols), torch.bfloat16, device) if col_dq else None
    dq_out = row_dq or col_dq
    if rows == 0 or cols == 0:
        return (row_deq, col_deq) if dq_out else (g, (row_codes, row_scale), (colt_codes, colt_scale))
    if cos is None:
        cos = sin = torch.zeros((1, MLA_ROPE_DIM), dtype=torch.float32, device=device)
    cos, sin = _unit_last(cos), _unit_last(sin)
    if rope and row_dq and col_dq and not (gated or write_bf16 or row_q or col_q) and PREPASS_HEADS_KERNEL:
        # the backward's own form: the per-head kernel (mla_q_prepass), the same bytes in fewer instructions
        prepass_dequantized(src2d, cos, sin, flag, row_deq, col_deq, _hw_cvt(device))
        return row_deq, col_deq
    # dequantized outputs: small tiles (~80 registers a thread, many programs per SM in flight: the pass
    # is memory-bound; [32, 64] on 2 warps measured fastest on the H200); the codes outputs keep [128, 64]
    block_r, num_warps = _PREP_DQ_TILE if dq_out else (128, 4)
    if interpret_mode():
        block_r = 64
    grid = (cdiv(rows, block_r), cdiv(cols, 64))
    u8 = lambda t: t.view(torch.uint8) if t is not None else dummy8  # noqa: E731
    dummy16 = placeholder(torch.bfloat16, device)
    launch = (functools.partial(launch_gated, _grad_prep_kernel, grid, flag) if gated
              else functools.partial(fast_launch, _grad_prep_kernel, grid))
    launch(
        src2d, cos, sin,
        g if g is not None else dummy16,
        u8(row_codes), u8(row_scale), u8(colt_codes), u8(colt_scale),
        rows, cols, src2d.stride(0), src2d.stride(1), cos.stride(0), sin.stride(0),
        row_deq if row_deq is not None else dummy16, col_deq if col_deq is not None else dummy16,
        flag if flag is not None else dummy8,
        ROPE=rope, WRITE_BF16=write_bf16, ROW_Q=row_q, COL_Q=col_q, HW_CVT=_hw_cvt(device), BLOCK_R=block_r,
        ROW_DQ=row_dq, COL_DQ=col_dq, GATED=gated, num_warps=num_warps, enable_fp_fusion=False,
    )
    if dq_out:
        return row_deq, col_deq
    return g, (row_codes, row_scale), (colt_codes, colt_scale)


def _dequantize_bf16(t: MXTensor) -> torch.Tensor:
    """bf16 RN(code * 2^(e-127)) of a K-blocked 2-D MXTensor (exact for e4m3 scale bytes in [3, 246])."""
    if t.scale_layout == "swizzled":
        from ..torch.swizzle import unswizzle_scales

        t = unswizzle_scales(t)
    e = t.scale.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 0x400000), e << 23)
    bits = torch.where(e == 255, torch.full_like(e, 0x7FC00000), bits)
    factor = bits.view(torch.float32).repeat_interleave(32, dim=1)
    return (t.data.to(torch.float32) * factor).to(torch.bfloat16)


def _transposed_operand(t: MXTensor) -> MXTensor:
    """The K-blocked MXTensor of data.T for a 2-D tensor blocked along axis 0 (a view: strides swap;
    swizzled scales are already the [cols, rows/32] scale matrix, so they carry over unchanged)."""
    scale = t.scale if t.scale_layout == "swizzled" else t.scale.t()
    return MXTensor(t.data.t(), scale, 1, t.elem, t.scale_layout)


def mla_q_backward_launch(dq, x, w, cos, sin, quantize_grad=False):
    """The backward (module docstring): the 16-bit backward, or with quantize_grad=True the MXFP8
    backward on exact bf16 dequantizations (_backward_dequantized)."""
    tokens, heads = dq.shape[0], dq.shape[1]
    n = heads * _HEAD
    dq2 = dq.reshape(tokens, n)
    if not quantize_grad:
        g, _, _ = _prep_launch(dq2, cos, sin, rope=True, write_bf16=True)
        xb = _dequantize_bf16(x) if isinstance(x, MXTensor) else x
        wb = _dequantize_bf16(w) if isinstance(w, MXTensor) else w
        return torch.matmul(g, wb), torch.matmul(g.t(), xb)
    return _backward_dequantized(dq2, x, w, cos, sin)


def _carve(buf: torch.Tensor, parts):
    """Views into buf's bytes, one per (shape, dtype) in parts, laid end to end (the fallback's codes and
    scales reuse the fast path's bf16 buffers: no memory is held for a path that almost never runs)."""
    flat = torch.empty(0, dtype=torch.uint8, device=buf.device)
    flat.set_(buf.untyped_storage(), buf.storage_offset() * buf.element_size(), (buf.numel() * buf.element_size(),))
    views, at = [], 0
    for shape, dtype in parts:
        size = math.prod(shape)
        views.append(flat[at:at + size].view(dtype).view(shape))
        at += size
    assert at <= flat.numel(), "carved views exceed the buffer"
    return views


def _mx_bf16_many(ts, flag) -> List[torch.Tensor]:
    """bf16 dequantization of each MXTensor in ts by the guarded flat pass, all in one launch, raising
    flag (see dequantize_bf16_flat); a K-major 2-D copy (data.t() contiguous, as dispatch.weights stores
    the columnwise weight) is dequantized in that layout and handed back transposed."""
    from .quantize import dequantize_bf16_flat_many

    flat, transposed = [], []
    for t in ts:
        kmajor = t.data.dim() == 2 and not t.data.is_contiguous() and t.data.t().is_contiguous()
        flat.append(_transposed_operand(t) if kmajor else t)
        transposed.append(kmajor)
    outs = dequantize_bf16_flat_many(flat, guard=(flag, [BF16_SAFE_SCALE_BYTES[t.elem] for t in flat]))
    return [o.t() if kmajor else o for o, kmajor in zip(outs, transposed)]


def _mx_bf16(t: MXTensor, flag) -> torch.Tensor:
    """_mx_bf16_many of one MXTensor."""
    return _mx_bf16_many([t], flag)[0]


def _contraction_bf16(t, flag):
    """bf16 [R, K] of an operand blocked along R (axis 0, the GEMM's contraction axis in the backward):
    an MXTensor dequantized by the guarded flat pass (_mx_bf16); a bf16 tensor quantized along R and
    dequantized in one pre-pass (its exact MXFP8 value, as the spec's backward quantizes it)."""
    if isinstance(t, MXTensor):
        return _mx_bf16(t, flag)
    _, col = _prep_launch(t, col_dq=True, flag=flag)
    return col


# The projection weight's bf16 dequantization, kept per weight MXTensor. On sm90 the MXFP8 projection
# multiplies exact bf16 dequantizations (there is no MXFP8 MMA), and a training step hands the fused op
# the same weight MXTensors from one optimizer step to the next (dispatch.weights keeps them), so the
# dequantization -- and the guard's verdict on it -- is made once per MXTensor: per forward and per
# backward one pass over the weight (3 bytes an element) and one launch less. Cost: the bf16 copy (2
# bytes an element; one for the forward's row copy, one for the backward's column copy) lives as long
# as the codes it was made from. An entry is keyed on a weak reference to the codes' storage (it never
# keeps the codes' memory, and while it exists no other storage can take its identity) and holds the
# scale tensor; it is remade when the codes or scales are other views or were written in place (version
# counters), and entries whose codes are gone are dropped at the next miss. Writes that bypass the
# version counter (through `.data`) are not seen: as for dispatch.weights, call clear_weight_bf16()
# after them. Off by default (MXMLA_TRITON_WEIGHT_BF16=1 turns it on): a training step that
# re-quantizes its weight after every optimizer step uses each copy once, so the copies would only
# hold memory; with several forwards per update (gradient accumulation, inference) each saves a pass.
_WEIGHT_BF16: dict = {}  # StorageWeakRef of the codes -> (stamp, scale, w16, flag)


def _stamp(t: MXTensor):
    d, sc = t.data, t.scale
    return (d.data_ptr(), tuple(d.shape), d.stride(), d._version, d.dtype, sc.data_ptr(), tuple(sc.shape),
            sc.stride(), sc._version, t.axis, t.elem, t.scale_layout)


def _weight_bf16(w: MXTensor, also=()):
    """(bf16 dequantization of the weight MXTensor w, a fresh int32 guard flag holding the guard's
    verdict on it, [bf16 dequantizations of the MXTensors in `also`, guarded on the same flag]): w's
    from the cache above when it holds w, else made now (and kept), in the same launch as also's."""
    stamp = None
    # inside a CUDA graph (capture, or CUDA-graph trees' warm-up) the cache is neither filled (a pool
    # tensor kept past the call: backends.kept) nor read (a replay would read the copy of the weight as
    # it was when recorded, after later optimizer steps too)
    if settings.flag("MXMLA_TRITON_WEIGHT_BF16") and kept.may_keep(w.data.device):
        try:
            stamp = _stamp(w)
        except RuntimeError:  # inference tensors keep no version counter: nothing to key a copy on
            pass
    if stamp is not None:
        from torch.multiprocessing.reductions import StorageWeakRef

        key = StorageWeakRef(w.data.untyped_storage())
        entry = _WEIGHT_BF16.get(key)
        if entry is not None and entry[0] == stamp:
            flag = entry[3].clone()
            return entry[2], flag, (_mx_bf16_many(also, flag) if also else [])
        for dead in [k for k in _WEIGHT_BF16 if k.expired()]:
            del _WEIGHT_BF16[dead]
        _WEIGHT_BF16.pop(key, None)  # the stale copy goes before the new one is made
    flag = torch.zeros(1, dtype=torch.int32, device=w.data.device)
    w16, *others = _mx_bf16_many([w, *also], flag)
    if stamp is not None:
        # the entry keeps this call's own flag as the verdict: later calls copy it (in stream order, after
        # this call's kernels). This call's other operands may raise it too, and then later calls take
        # the exact path needlessly -- still exact -- while a weight changes every optimizer step and
        # is dequantized afresh at its first call, which so costs no launch more than without the copy
        _WEIGHT_BF16[key] = (stamp, w.scale, w16, flag)
    return w16, flag, others


def clear_weight_bf16() -> None:
    """Drop every kept weight dequantization (after writes to weight codes that bypass the version
    counter; tests)."""
    _WEIGHT_BF16.clear()


def _fallback_operand(t, bf16_buf, flag):
    """The K-major MXFP8 operand [K, R] (blocked along R) of t for the exact fallback GEMM: the
    MXTensor's transposed view, or, for bf16 t, its columnwise quantization written by a gated pre-pass
    into bf16_buf's bytes."""
    if isinstance(t, MXTensor):
        return _transposed_operand(t)
    rows, cols = t.shape
    codes, scales = _carve(bf16_buf, (((cols, rows), torch.float8_e4m3fn), ((cols, rows // 32), torch.uint8)))
    _prep_launch(t, col_q=True, flag=flag, gated=True, buffers=(None, None, codes, scales))
    return MXTensor(codes, scales, 1, "e4m3", "compact")


def _gated_exact_backward(dq2, x, w, cos, sin, dx, dw, flag, g_bufs, x16, w16):
    """The MXFP8 backward's exact path, each launch a no-op unless *flag is up (no host sync): the
    pre-pass writes both quantizations of g into g_bufs = (row codes, row scales, colT codes, colT
    scales), x and w become K-major MXFP8 operands (bf16 x / w quantized into x16 / w16's bytes), and
    the exact block GEMMs overwrite dx and dw."""
    g_codes, g_scale, gt_codes, gt_scale = g_bufs
    _prep_launch(dq2, cos, sin, rope=True, row_q=True, col_q=True, flag=flag, gated=True, buffers=g_bufs)
    w_t = _fallback_operand(w, w16, flag)
    x_t = _fallback_operand(x, x16, flag)
    exact_fallback(MXTensor(g_codes, g_scale, 1, "e4m3", "compact"), w_t, dx, flag)
    exact_fallback(MXTensor(gt_codes, gt_scale, 1, "e4m3", "compact"), x_t, dw, flag)


def _backward_dequantized(dq2, x, w, cos, sin):
    """The MXFP8 backward on bf16 GEMMs. One pre-pass reads dq once and writes the bf16 dequantization
    of both quantizations of g (row- and column-blocked, each exact in bf16 where the guard stays
    down); x and w blocked along T / N come dequantized likewise (w's dequantization kept across
    calls: _weight_bf16); then dx = g_row @ w_n and dw = g_col^T @ x_t are two cuBLAS bf16 GEMMs
    (exact products, fp32 sum, one rounding: the MXFP8 GEMM's contract, as its bf16 route keeps it).
    Against two MXFP8 GEMMs this writes g twice as bf16 (4 bytes an element instead of 2 of codes) but
    no GEMM re-reads codes to dequantize them, and cuBLAS runs both shapes at its bf16 rate. The guard (a nonzero code under a scale byte outside
    BF16_SAFE_SCALE_BYTES, or a value not finite) sends the whole op to the exact path, gated on the
    device-side flag (no host sync once those kernels are compiled: launch_gated): the pre-pass re-run
    writing codes and the exact block GEMMs."""
    tokens, n = dq2.shape
    device = dq2.device
    x16 = None
    if isinstance(w, MXTensor):  # a weight MXTensor: its dequantization kept across calls
        # an MXFP8 x is dequantized in the same launch as w [N, K]
        w16, flag, got = _weight_bf16(w, also=(x,) if isinstance(x, MXTensor) else ())
        x16 = got[0] if got else None
    else:
        w16, flag = None, torch.zeros(1, dtype=torch.int32, device=device)
    g_row16, g_col16 = _prep_launch(dq2, cos, sin, rope=True, row_dq=True, col_dq=True, flag=flag)
    if w16 is None:
        w16 = _contraction_bf16(w, flag)  # [N, K]
    if x16 is None:
        x16 = _contraction_bf16(x, flag)  # [T, K]
    k = x16.shape[1]
    dx = _empty((tokens, k), torch.bfloat16, device)
    dw = _empty((n, k), torch.bfloat16, device)
    if tokens and n and k:
        bf16_matmul_fp32_sum(g_row16, w16.t(), dx)
        bf16_matmul_fp32_sum(g_col16.t(), x16.t(), dw)
        g_codes, g_scale = _carve(g_row16, (((tokens, n), torch.float8_e4m3fn), ((tokens, n // 32), torch.uint8)))
        gt_codes, gt_scale = _carve(g_col16, (((n, tokens), torch.float8_e4m3fn), ((n, tokens // 32), torch.uint8)))
        _gated_exact_backward(dq2, x, w, cos, sin, dx, dw, flag, (g_codes, g_scale, gt_codes, gt_scale), x16, w16)
    else:  # an empty contraction: zeros (a zero-sized output stays as it is)
        dx.zero_()
        dw.zero_()
    return dx, dw


# --------------------------------------------------------------------------------------------------
# registration
# --------------------------------------------------------------------------------------------------
def _device_reasons(tensors, need_fp8: bool) -> List[str]:
    reasons = triton_reasons(*tensors)
    for t in tensors:
        arr = t.data if isinstance(t, MXTensor) else t
        if isinstance(arr, torch.Tensor) and arr.device.type == "cuda" and not interpret_mode():
            cc = torch.cuda.get_device_capability(arr.device)
            want = (8, 9) if need_fp8 else (8, 0)
            if cc < want:
                reasons.append(f"needs compute capability >= {want[0]}.{want[1]} "
                               f"({'fp8' if need_fp8 else 'bf16'} tensor-core dot), {arr.device} is {cc[0]}.{cc[1]}")
            break
    for name, t in zip(("x", "w"), tensors[:2]):
        if isinstance(t, MXTensor) and isinstance(t.data, torch.Tensor) and t.data.dtype != _ELEM_TORCH.get(t.elem):
            reasons.append(f"{name}: data dtype {t.data.dtype} does not match elem {t.elem!r}")
    return reasons


def _fwd_reasons(x, w, cos, sin) -> List[str]:
    return _device_reasons([x, w, cos, sin], need_fp8=isinstance(x, MXTensor))


def _bwd_reasons(dq, x, w, cos, sin, quantize_grad=False) -> List[str]:
    return _device_reasons([x, w, dq, cos, sin], need_fp8=bool(quantize_grad))


@register("mla_q_uproj_rope_quant", "triton", check=_fwd_reasons)
def mla_q_uproj_rope_quant(x, w, cos, sin, variant=None):
    """The dispatcher passes the FORWARD_VARIANTS entry it chose (or the caller named), having checked
    its reasons for this call signature (they read nothing else), so the launch does not check again."""
    return mla_q_forward_launch(x, w, cos, sin, variant=variant, verified=variant is not None)


# Backward variants: "bf16" is the quantize_grad=False backward (two bf16 GEMMs), "dequantized" the
# MXFP8 backward (quantize_grad=True); each call has exactly one.
BACKWARD_OP = "mla_q_uproj_rope_quant_backward"


def _backward_check(route):
    def check(dq, x, w, cos, sin, quantize_grad=False):
        if route == "bf16":
            return ["quantize_grad=True is the dequantized variant's"] if quantize_grad else []
        return [] if quantize_grad else [f"{route} is the MXFP8 backward (quantize_grad=True)"]
    return check


for _name, _priority in (("bf16", 30), ("dequantized", 20)):
    register_variant(BACKWARD_OP, "triton", _name, _priority, check=_backward_check(_name))


@register("mla_q_uproj_rope_quant_backward", "triton", check=_bwd_reasons)
def mla_q_uproj_rope_quant_backward(dq, x, w, cos, sin, quantize_grad=False, variant=None):
    """The dispatcher passes the variant it chose, which quantize_grad alone decides."""
    return mla_q_backward_launch(dq, x, w, cos, sin, quantize_grad)
