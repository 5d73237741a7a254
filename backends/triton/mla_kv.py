"""Triton `mla_kv_quantize`: MLA's key and value as MXFP8 attention operands in one launch, byte-equal to
spec.mla_kv (k = [k_nope | k_pe] quantized along D, v along the sequence axis; e4m3, rceil, saturate,
compact scales).

One kernel, two kinds of program, one grid:
- key programs: BR rows of (batch, position, head), each [128 | 64] features. The k_nope row and the
  k_pe row (the one shared row of its position, or the head's own) are loaded (strided: k_nope may be a
  slice of a [.., H, 256] projection, read in place) and quantized as six row blocks, written straight
  into k's [.., H, 192] codes and [.., H, 6] scales. No bf16 concatenation and no join of codes is ever
  written; a shared k_pe row is re-read per head from L2 (it is 128 bytes per position).
- value programs: VB positions x 128 features of one (batch, head), quantized in column blocks of 32
  positions (SEMANTICS: v blocked along the sequence axis), v read in place as well.
- with cos / sin (ROPE), a key program rotates its k_pe rows before quantizing them: spec.rope's mla
  rule `out[i] = RN(RN(x[first[i]] * c[i]) + sign[i] * RN(x[second[i]] * s[i]))` in fp32 on the table
  row of the row's position (its sequence index), then one rounding to k_pe's dtype with rope's
  canonical NaN, so the bytes are those of the rope op followed by this one. x[first] and x[second]
  are two gathers of the same k_pe row (the second one hits the cache) rather than a load split into
  even / odd features and joined back in registers: the tile arrives in the [BR, 64] layout the
  quantizer takes, with no layout conversion. Tables are read through both strides.
Every block uses the quantize kernel's device functions (_mx_codec: exact widening, NaN-propagating
amax, the finite fast path and the full rules for a tile holding NaN / Inf), so the bytes are those of
`mxfp8_quantize` of each part. Launched with enable_fp_fusion=False, as the quantize kernel.

Against the composition it replaces (three quantize launches and two concatenations), the host issues
one launch instead of five and the GPU writes k once instead of twice.
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from spec.constants import BLOCK_SIZE, MLA_QK_HEAD_DIM, MLA_ROPE_DIM
from spec.mla_kv import mla_kv_axes
from spec.mxtensor import MXTensor

from ..registry import register
from ._common import cdiv, fast_launch, interpret_mode, placeholder, triton_reasons
from ._fpbits import round_f32_canonical_nan, widen_f32
from ._mx_codec import F32_ABS_MASK, F32_INF_BITS, amax_nan, block_amax, elem_meta, emit_codes, load_f32, use_hw_cvt
from .swizzle import empty_output

_NOPE = MLA_QK_HEAD_DIM - MLA_ROPE_DIM  # 128
_X_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
BR = 32  # key rows per program
VB = 64  # value positions per program (two column blocks)
NUM_WARPS = 4
_BITS = {torch.bfloat16: torch.int16}  # bf16 inputs are loaded as their bits (load_f32 widens them)


@triton.jit
def _quantize_tile(x, offs, mask, code_ptr, s_ptr, s_off, s_mask, AXIS: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, MASKED: tl.constexpr, INTERPRET: tl.constexpr, HW_CVT: tl.constexpr,
                   IS_E5M2: tl.constexpr, INV_MAX_BITS: tl.constexpr, MAX_BITS: tl.constexpr, EMAX: tl.constexpr,
                   MBITS: tl.constexpr, CODE_SHIFT: tl.constexpr, ROUND_HALF: tl.constexpr,
                   EXP_REBIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr):
    """rceil / saturate codes and scale bytes of fp32 tile x [BM, BN], blocks of 32 along AXIS (2: rows,
    1: columns of the [.., 32, ..] view): the quantize kernel's finite fast path, or its full rules when
    a block holds NaN / Inf."""
    if AXIS == 2:
        x3 = tl.reshape(x, [BM, BN // 32, 32])
    else:
        x3 = tl.reshape(x, [BM // 32, 32, BN])
    amax = amax_nan(x3, AXIS, INTERPRET)
    if tl.max(tl.where(amax < float("inf"), 0, 1)) == 0:
        emit_codes(x3, amax, amax != amax, offs, mask, code_ptr, s_ptr, s_off, s_mask, AXIS, BM, BN, True, MASKED,
                   0, False, HW_CVT, IS_E5M2, INV_MAX_BITS, MAX_BITS, EMAX, MBITS, CODE_SHIFT, ROUND_HALF,
                   EXP_REBIAS, MIN_NORMAL_BITS, SUB_MAGIC_BITS)
    else:
        bits = x3.to(tl.int32, bitcast=True) & F32_ABS_MASK
        emit_codes(x3, block_amax(x3, AXIS), tl.max(bits, axis=AXIS) >= F32_INF_BITS, offs, mask, code_ptr, s_ptr,
                   s_off, s_mask, AXIS, BM, BN, False, MASKED, 0, False, HW_CVT, IS_E5M2, INV_MAX_BITS, MAX_BITS,
                   EMAX, MBITS, CODE_SHIFT, ROUND_HALF, EXP_REBIAS, MIN_NORMAL_BITS, SUB_MAGIC_BITS)


@triton.jit
def _rope_mla_rows(pe_row, c_row, s_row, C_D, S_D, mask, K_KIND: tl.constexpr, T_KIND: tl.constexpr,
                   MASKED: tl.constexpr):
    """The [BR, 64] k_pe rows at pe_row rotated by their table rows (spec.rope, style mla), rounded to
    k_pe's dtype and widened back to fp32 exactly. For mla, first[i] = 2k + (i >= 32) with k = i mod 32,
    second[i] = first[i] ^ 1, sign[i] = -1 for i < 32 (spec.rope.rotation_indices("mla", 64))."""
    i = tl.arange(0, 64)
    first = 2 * (i % 32) + i // 32
    a = load_f32(pe_row + first[None, :], mask, K_KIND, MASKED)
    b = load_f32(pe_row + (first ^ 1)[None, :], mask, K_KIND, MASKED)
    c = load_f32(c_row + (i * C_D)[None, :], mask, T_KIND, MASKED)
    s = load_f32(s_row + (i * S_D)[None, :], mask, T_KIND, MASKED)
    p = a * c  # one RN each: the launch disables fp fusion, so no FMA forms here
    q = b * s
    out = tl.where((i < 32)[None, :], p - q, p + q)
    if K_KIND == 0:
        return widen_f32(round_f32_canonical_nan(out, tl.bfloat16))
    elif K_KIND == 1:
        return widen_f32(round_f32_canonical_nan(out, tl.float16))
    else:
        return round_f32_canonical_nan(out, tl.float32)


@triton.jit
def _key_rows(pid, kn_ptr, kp_ptr, kc_ptr, ks_ptr, cos_ptr, sin_ptr, S, H, K_ROWS, KN_B, KN_S, KN_H, KP_B,
              KP_S, KP_H, KC_B, KC_S, KC_H, KS_B, KS_S, KS_H, C_S, C_D, S_S, S_D, K_KIND: tl.constexpr,
              K_MASKED: tl.constexpr, ROPE: tl.constexpr, T_KIND: tl.constexpr,
              IDX64: tl.constexpr, INTERPRET: tl.constexpr, HW_CVT: tl.constexpr,
              IS_E5M2: tl.constexpr, INV_MAX_BITS: tl.constexpr, MAX_BITS: tl.constexpr, EMAX: tl.constexpr,
              MBITS: tl.constexpr, CODE_SHIFT: tl.constexpr, ROUND_HALF: tl.constexpr, EXP_REBIAS: tl.constexpr,
              MIN_NORMAL_BITS: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr, BR: tl.constexpr):
    """One key program: BR rows of (batch, position, head), [128 | 64] features each."""
    d_nope = tl.arange(0, 128)
    rows = pid * BR + tl.arange(0, BR)  # (batch, position, head) flattened, head fastest
    if IDX64:
        rows = rows.to(tl.int64)
    h = rows % H
    bs = rows // H
    s = bs % S
    b = bs // S
    rmask = rows < K_ROWS
    code_row = b * KC_B + s * KC_S + h * KC_H
    scale_row = b * KS_B + s * KS_S + h * KS_H
    mask = rmask[:, None] & (d_nope[None, :] < 128)
    x = load_f32(kn_ptr + (b * KN_B + s * KN_S + h * KN_H)[:, None] + d_nope[None, :], mask, K_KIND, K_MASKED)
    j4 = tl.arange(0, 4)
    _quantize_tile(x, code_row[:, None] + d_nope[None, :], mask, kc_ptr, ks_ptr, scale_row[:, None] + j4[None, :],
                   rmask[:, None] & (j4[None, :] < 4), 2, BR, 128, K_MASKED, INTERPRET, HW_CVT, IS_E5M2,
                   INV_MAX_BITS, MAX_BITS, EMAX, MBITS, CODE_SHIFT, ROUND_HALF, EXP_REBIAS, MIN_NORMAL_BITS,
                   SUB_MAGIC_BITS)
    d_pe = tl.arange(0, 64)
    mask_pe = rmask[:, None] & (d_pe[None, :] < 64)
    pe_row = kp_ptr + (b * KP_B + s * KP_S + h * KP_H)[:, None]
    if ROPE:
        pe = _rope_mla_rows(pe_row, cos_ptr + (s * C_S)[:, None], sin_ptr + (s * S_S)[:, None], C_D, S_D, mask_pe,
                            K_KIND, T_KIND, K_MASKED)
    else:
        pe = load_f32(pe_row + d_pe[None, :], mask_pe, K_KIND, K_MASKED)
    j2 = tl.arange(0, 2)
    _quantize_tile(pe, code_row[:, None] + 128 + d_pe[None, :], mask_pe, kc_ptr, ks_ptr,
                   scale_row[:, None] + 4 + j2[None, :], rmask[:, None] & (j2[None, :] < 2), 2, BR, 64, K_MASKED,
                   INTERPRET, HW_CVT, IS_E5M2, INV_MAX_BITS, MAX_BITS, EMAX, MBITS, CODE_SHIFT, ROUND_HALF,
                   EXP_REBIAS, MIN_NORMAL_BITS, SUB_MAGIC_BITS)


@triton.jit
def _value_tile(vp, v_ptr, vc_ptr, vs_ptr, S, H, V_SBLOCKS, V_B, V_S, V_H, VC_B, VC_S, VC_H, VS_B, VS_S, VS_H,
                V_KIND: tl.constexpr, V_MASKED: tl.constexpr, IDX64: tl.constexpr, INTERPRET: tl.constexpr,
                HW_CVT: tl.constexpr, IS_E5M2: tl.constexpr, INV_MAX_BITS: tl.constexpr, MAX_BITS: tl.constexpr,
                EMAX: tl.constexpr, MBITS: tl.constexpr, CODE_SHIFT: tl.constexpr, ROUND_HALF: tl.constexpr,
                EXP_REBIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr,
                VB: tl.constexpr):
    """One value program: VB positions x 128 features of one (batch, head), head fastest over programs."""
    d_nope = tl.arange(0, 128)
    if IDX64:
        vp = vp.to(tl.int64)
    h = vp % H
    t = vp // H
    sblk = t % V_SBLOCKS
    b = t // V_SBLOCKS
    s = sblk * VB + tl.arange(0, VB)
    smask = s < S
    mask = smask[:, None] & (d_nope[None, :] < 128)
    x = load_f32(v_ptr + b * V_B + h * V_H + s[:, None] * V_S + d_nope[None, :], mask, V_KIND, V_MASKED)
    mblk = sblk * (VB // 32) + tl.arange(0, VB // 32)  # position block rows of the scales
    s_off = b * VS_B + h * VS_H + mblk[:, None] * VS_S + d_nope[None, :]
    _quantize_tile(x, b * VC_B + h * VC_H + s[:, None] * VC_S + d_nope[None, :], mask, vc_ptr, vs_ptr, s_off,
                   (mblk[:, None] * 32 < S) & (d_nope[None, :] < 128), 1, VB, 128, V_MASKED, INTERPRET, HW_CVT,
                   IS_E5M2, INV_MAX_BITS, MAX_BITS, EMAX, MBITS, CODE_SHIFT, ROUND_HALF, EXP_REBIAS,
                   MIN_NORMAL_BITS, SUB_MAGIC_BITS)


@triton.jit
def _mla_kv_kernel(
    kn_ptr, kp_ptr, v_ptr, kc_ptr, ks_ptr, vc_ptr, vs_ptr, cos_ptr, sin_ptr,
    S, H, K_ROWS, K_PROGRAMS, V_SBLOCKS,
    KN_B, KN_S, KN_H, KP_B, KP_S, KP_H, V_B, V_S, V_H,  # input strides (elements) by batch, position, head
    KC_B, KC_S, KC_H, KS_B, KS_S, KS_H, VC_B, VC_S, VC_H, VS_B, VS_S, VS_H,  # output strides, the same axes
    C_S, C_D, S_S, S_D,  # table strides (elements) by position and feature
    K_KIND: tl.constexpr, V_KIND: tl.constexpr, K_MASKED: tl.constexpr, V_MASKED: tl.constexpr,
    ROPE: tl.constexpr, T_KIND: tl.constexpr,
    IDX64: tl.constexpr, INTERPRET: tl.constexpr, HW_CVT: tl.constexpr,
    IS_E5M2: tl.constexpr, INV_MAX_BITS: tl.constexpr, MAX_BITS: tl.constexpr, EMAX: tl.constexpr,
    MBITS: tl.constexpr, CODE_SHIFT: tl.constexpr, ROUND_HALF: tl.constexpr, EXP_REBIAS: tl.constexpr,
    MIN_NORMAL_BITS: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr,
    BR: tl.constexpr, VB: tl.constexpr,
):
    # each kind of program in its own function: Triton types a name once across both branches
    pid = tl.program_id(0)
    if pid < K_PROGRAMS:
        _key_rows(pid, kn_ptr, kp_ptr, kc_ptr, ks_ptr, cos_ptr, sin_ptr, S, H, K_ROWS, KN_B, KN_S, KN_H, KP_B,
                  KP_S, KP_H, KC_B, KC_S, KC_H, KS_B, KS_S, KS_H, C_S, C_D, S_S, S_D, K_KIND, K_MASKED, ROPE,
                  T_KIND, IDX64, INTERPRET, HW_CVT,
                  IS_E5M2, INV_MAX_BITS, MAX_BITS, EMAX, MBITS, CODE_SHIFT, ROUND_HALF, EXP_REBIAS, MIN_NORMAL_BITS,
                  SUB_MAGIC_BITS, BR)
    else:
        _value_tile(pid - K_PROGRAMS, v_ptr, vc_ptr, vs_ptr, S, H, V_SBLOCKS, V_B, V_S, V_H, VC_B, VC_S, VC_H,
                    VS_B, VS_S, VS_H, V_KIND, V_MASKED, IDX64, INTERPRET, HW_CVT,
                    IS_E5M2, INV_MAX_BITS, MAX_BITS, EMAX, MBITS, CODE_SHIFT, ROUND_HALF, EXP_REBIAS, MIN_NORMAL_BITS,
                    SUB_MAGIC_BITS, VB)


def _bsh(t: torch.Tensor, seq: int, head: int) -> Tuple[int, int, int]:
    """t's strides (elements) along batch, position, head; batch 0 for the 3-D thd layout."""
    st = t.stride()
    batch = [i for i in range(t.dim() - 1) if i not in (seq, head)]
    return (st[batch[0]] if batch else 0), st[seq], st[head]


def mla_kv_reasons(k_nope, k_pe, v, layout="bshd", cos=None, sin=None):
    reasons = triton_reasons(k_nope, k_pe, v, cos, sin, min_capability=(8, 0))
    for name, t in (("k_nope", k_nope), ("k_pe", k_pe), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() and t.stride(-1) != 1 and t.shape[-1] != 1:
            reasons.append(f"{name}: the kernel reads the feature axis contiguously (stride 1), got stride {t.stride(-1)}")
    return reasons


@register("mla_kv_quantize", "triton", check=mla_kv_reasons)
def mla_kv_quantize(k_nope, k_pe, v, layout="bshd", cos=None, sin=None):
    seq, head = mla_kv_axes(layout)
    lead = tuple(k_nope.shape[:-1])
    device = k_nope.device
    k_codes = empty_output(lead + (MLA_QK_HEAD_DIM,), torch.float8_e4m3fn, device)
    k_scale = empty_output(lead + (MLA_QK_HEAD_DIM // BLOCK_SIZE,), torch.uint8, device)
    v_codes = empty_output(tuple(v.shape), torch.float8_e4m3fn, device)
    v_scale_shape = list(v.shape)
    v_scale_shape[seq] //= BLOCK_SIZE
    v_scale = empty_output(tuple(v_scale_shape), torch.uint8, device)
    k_out = MXTensor(k_codes, k_scale, len(lead), "e4m3", "compact")
    v_out = MXTensor(v_codes, v_scale, seq, "e4m3", "compact")
    if k_nope.numel() == 0:
        return k_out, v_out
    positions, heads = k_nope.shape[seq], k_nope.shape[head]
    batch = k_nope.numel() // (positions * heads * _NOPE)
    k_rows = batch * positions * heads
    k_programs = cdiv(k_rows, BR)
    v_sblocks = cdiv(positions, VB)
    rope = cos is not None
    if not rope:  # pointers the kernel never reads (ROPE off)
        cos = sin = placeholder(torch.float32, device)
    tables = (cos, sin) if rope else ()
    # the furthest element any input offset reaches (strided inputs reach beyond numel)
    extent = max(1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) for t in (k_nope, k_pe, v, *tables))
    kn_s, kp_s, v_s = _bsh(k_nope, seq, head), _bsh(k_pe, seq, head), _bsh(v, seq, head)
    if k_pe.shape[head] == 1:
        kp_s = kp_s[:2] + (0,)  # one row shared by every head
    args = (k_nope.view(_BITS.get(k_nope.dtype, k_nope.dtype)), k_pe.view(_BITS.get(k_pe.dtype, k_pe.dtype)),
            v.view(_BITS.get(v.dtype, v.dtype)), k_codes.view(torch.uint8), k_scale, v_codes.view(torch.uint8), v_scale,
            cos.view(_BITS.get(cos.dtype, cos.dtype)), sin.view(_BITS.get(sin.dtype, sin.dtype)),
            positions, heads, k_rows, k_programs, v_sblocks, *kn_s, *kp_s, *v_s,
            *_bsh(k_codes, seq, head), *_bsh(k_scale, seq, head), *_bsh(v_codes, seq, head), *_bsh(v_scale, seq, head),
            *(cos.stride() + sin.stride() if rope else (0, 0, 0, 0)))
    fast_launch(_mla_kv_kernel, (k_programs + batch * v_sblocks * heads,), *args,
                K_KIND=_X_KIND[k_nope.dtype], V_KIND=_X_KIND[v.dtype], K_MASKED=k_rows % BR != 0,
                V_MASKED=positions % VB != 0, ROPE=rope, T_KIND=_X_KIND[cos.dtype],
                IDX64=max(extent, k_codes.numel()) >= 2**31,
                INTERPRET=interpret_mode(), HW_CVT=use_hw_cvt(device), **elem_meta("e4m3"), BR=BR, VB=VB,
                num_warps=NUM_WARPS, enable_fp_fusion=False)
    return k_out, v_out
