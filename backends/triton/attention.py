"""Triton MLA attention (SEMANTICS.md section 8): flash-attention forward and backward for the
DeepSeek-V3 head dims (q/k 192, v 128), bf16 or MXFP8 operands, bshd / sbhd / thd.

Kernel design
- Forward (`_mla_fwd_kernel`): one program per (batch*head, block of BLOCK_M queries); the query tile
  stays on chip while the program streams BLOCK_N keys at a time. Online softmax in the log2 domain:
  the softmax scale is folded with log2(e) into one multiplier, p = exp2(s * qk_scale - m), fp32 row
  max / row sum / accumulator; P is rounded to bf16 for the P v tensor-core dot (as every FA kernel
  does; 2^-9 relative per term). lse = (m + log2(l)) * ln(2) is written in natural log, fp32.
- 192 is not a power of two: q and k are held as two tiles, features 0..127 and 128..191, and
  S = q k^T is two tl.dot calls (K = 128 then K = 64 into the same accumulator), so no FLOP is spent
  on padding.
- Masking: key blocks below `full_end` are seen by every query row of the tile and skip the mask;
  blocks from `full_end` to `hi` (the causal diagonal band and the partial last key block) apply it
  (key j < S_kv and, causal, j <= i + S_kv - S_q: bottom-right aligned); blocks at or past `hi`, fully
  masked for the whole tile, are never visited. This is one loop with a runtime test, not two
  loops, and the loop is entered only when it runs at least once: otherwise ptxas serialises every
  wgmma of the kernel (C7515, "non wgmma instructions defining accumulator registers": a path that
  skips a loop writes the in-flight accumulator's registers), which the sm90 compile of every
  variant was checked for. Fully masked rows (causal with S_q > S_kv, or a varlen sequence without
  keys) keep m = -inf: the update shifts them by 0 instead of -inf (no inf - inf), so they end with
  l = 0, o = 0 and lse = -inf. When every key block is whole (bshd / sbhd with BLOCK_N | S_kv:
  `_even_kv`), the k / v loads carry no mask at all (H200, B1 S4096 H128 causal: 1.496 against
  1.528 ms, tools/profile_cases.py attn_fwd_configs).
- Grid (query blocks, heads, batch): the query blocks of one head are adjacent in launch order, so
  the programs resident at once share their head's k and v through L2 (k + v of a head at S = 4096
  is 2.6 MB; with heads fastest instead, 132 resident programs would stream 132 different heads from
  HBM). Query blocks run in reverse order, heaviest first under causal masking. The dkdv kernel's grid
  is (key blocks, heads, batch) for the same reason (q, do shared), in natural order (under causal
  masking the first key blocks see the most queries).
- Layouts are strides: a token's row is `b * stride_b + (seq_start + s) * stride_s + h * stride_h`,
  where thd has stride_b = 0 and seq_start = cu_seqlens[b]; bshd / sbhd have seq_start = 0. Only the
  feature stride must be 1. lse is [B, H, S_q] (thd: [H, T_q]), addressed the same way. thd sizes
  its grids by the longest sequence, read from cu_seqlens on the host (one synchronisation), except
  while a CUDA graph is captured: there the token counts bound it (programs past a sequence's end
  return), and the tile class follows that bound, so it can differ from an eager call's.
- MXFP8 operands (q, k blocked along D, v blocked along S): by default (`FWD_MX_DEQUANT =
  "predequant_qkv"`) one flat pass (quantize.dequantize_bf16_flat_many: the three operands in one
  launch, at device-copy speed) dequantizes the codes to bf16 and the bf16 kernel runs on the result.
  On the H200 at B=1 S=4096 H=128 causal (2026-11-30, tools/profile_cases.py attn_dequant) that is
  1.66 ms against 1.81 ms with only k, v pre-dequantized ("predequant", q in the load path) and
  2.81 ms with all three dequantized inside the kernel's loads ("load"): each k / v tile is re-read
  by every query block, and Triton has to write the dequantized tile back to shared memory for the
  wgmma (a B operand lives there), so the in-loop version repeats S / BLOCK_M times a conversion the
  pass does once. The load path stays selectable: code -> fp32, times 2^(e-127) built from the scale
  byte's bits (one fp32 multiply, exact: a code has 4 significant bits), then -> bf16 for the
  tensor-core dot. Either way the bf16 value is exact whenever it is at least 2^-130 in magnitude
  (bf16 keeps 8 significant bits down to 2^-126 and loses them one by one below), hence for every
  code of a block whose scale byte is >= 6 (e4m3) or >= 13 (e5m2); smaller values, never seen in
  attention inputs, are rounded once (RN) to bf16, as the spec's dequantize to bf16. Scale byte 255
  gives a NaN block, as the spec. In the load path q/k scales are loaded as [rows, groups] and
  broadcast over the 32 features of each group; v scales are rows of [S/32, H, 128] selected by
  token // 32 (the global token index, so thd blocks may straddle sequences, as in the spec).
  P is *not* quantized (cuDNN quantizes P to e4m3 with a fixed x16 scale): the MXFP8 error is the
  bf16 path's error. Swizzled scales are unswizzled to compact first.
- Backward (FA2 scheme, deterministic): `_mla_bwd_preprocess_kernel` writes D = rowsum(o * do) and
  lse in log2 units (lse2; rows with lse = -inf get +inf so their P is exactly 0). `_mla_bwd_dkdv_kernel`
  owns a block of BLOCK_N keys and loops over query blocks, accumulating dk (two tiles, 128 + 64) and
  dv in fp32; `_mla_bwd_dq_kernel` owns a block of queries and loops over key blocks accumulating dq.
  Each recomputes P from q, k and lse2 (no atomics: the same inputs give the same bits every run).
  dS is rounded to bf16 for its dots, as P is. `BWD_DQ = "atomic"` (opt-in) instead has the dkdv
  kernel add dS k into an fp32 dq buffer with vectorised atomics and skips the dq kernel: no
  recomputation of S and dP (38 % fewer FLOPs), but the summation order, hence the last bits of dq,
  varies from run to run. MXFP8 operands are dequantized to bf16 once (exactly,
  same rule as above) before the backward kernels: every q block is re-read by every key block, so a
  one-pass dequantize costs less than dequantizing in each program.
- Tiles (checked by compiling for sm90 without a GPU: registers, spills, shared memory, wgmma use).
  Forward: BLOCK_M 128 x BLOCK_N 64 over 8 warps (two warpgroups, 64 query rows each), 2-3 stages:
  ~185 registers, 128-170 KB shared memory, no spills; also 128 x 128 and 64 x 64 / 4 warps.
  dkdv: the program holds fp32 dk + dv [BLOCK_N, 320]: BLOCK_N 128 over 8 warps is 160 registers
  per thread, so query blocks are 32 rows (64 would spill); BLOCK_N 64 halves the accumulators but
  Triton then computes the [64, BLOCK_M] score tile in both warpgroups. dq: BLOCK_M 128 x BLOCK_N 64
  or 32 over 8 warps. The autotuner picks per (sequence-length bucket, causal, layout kind, MXFP8
  operands).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import triton
import triton.language as tl

from spec.attention import DEFAULT_SOFTMAX_SCALE
from spec.constants import MLA_QK_HEAD_DIM, MLA_V_HEAD_DIM
from spec.mxtensor import MXTensor
from ..torch.swizzle import unswizzle_scales

from ..registry import register
from ._common import autotune_cached, cdiv, interpret_mode, triton_reasons
from .tile_choice import first_config
from .quantize import dequantize_bf16_flat_many
from ._fpbits import round_f32

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# "load": dequantize MXFP8 q / k / v tiles inside the attention kernel; "predequant": k and v by one
# pass to bf16 before it (q in the load path); "predequant_qkv": all three by the pass.
# benchmarks/bench_attention.py times all three.
FWD_MX_DEQUANT_MODES = ("load", "predequant", "predequant_qkv")
FWD_MX_DEQUANT = "predequant_qkv"
# "separate": dq from its own kernel (deterministic, recomputes S and dP); "atomic": the dkdv kernel
# also adds dS k into an fp32 dq buffer with atomics (no recompute; summation order varies run to run).
BWD_DQ = "separate"
# Drop the key loop's load masks when every key block is whole (see _even_kv); a switch so that
# tools/profile_cases.py attn_fwd_configs can time both forms.
FWD_EVEN_KV = True

assert MLA_QK_HEAD_DIM == 192 and MLA_V_HEAD_DIM == 128  # the kernels hard-code the 128 + 64 split


# --------------------------------------------------------------------------------------------------
# Autotune configurations
# --------------------------------------------------------------------------------------------------

def _seq_bucket(n: int) -> int:
    """Autotune key for a sequence length: the next power of two (at least 64)."""
    return max(64, triton.next_power_of_2(max(int(n), 1)))


def _fwd_configs(interpret=None):
    if interpret_mode() if interpret is None else interpret:
        # Small tiles so the tiny CPU test shapes cross several blocks and both loop stages;
        # BLOCK_M != BLOCK_N exercises a diagonal band wider than one key block.
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    ]


def _dkdv_configs(interpret=None):
    if interpret_mode() if interpret is None else interpret:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    return [
        # 128 keys over two warpgroups (64 each): dk + dv are 160 fp32 registers per thread.
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 128}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 128}, num_warps=8, num_stages=2),
        # 64 keys: half the accumulator registers, but the [64, BLOCK_M] score tile is computed by
        # both warpgroups (Triton's layout for M = 64 over 8 warps replicates it).
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    ]


def _dq_configs(interpret=None):
    if interpret_mode() if interpret is None else interpret:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=8, num_stages=3),
    ]


# --------------------------------------------------------------------------------------------------
# Tile loaders
# --------------------------------------------------------------------------------------------------

# Triton's interpreter (the CPU test path) misreads bf16 operands of tl.dot; there the bf16 tiles are
# widened to fp32 (exact) before the dot, which then matches a bf16 tensor-core dot with fp32
# accumulation up to summation order.
_INTERPRET = tl.constexpr(interpret_mode())


@triton.jit
def _mma(a, b, acc):
    """a @ b (+ acc): bf16 tiles, fp32 accumulator."""
    if _INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _to_bf16(x):
    """RN-even fp32 -> bf16. The GPU's cast is cvt.rn; the interpreter's truncates, so there the
    rounding is done on the bits (backends/triton/_fpbits.py) to test the GPU's numerics."""
    if _INTERPRET:
        return round_f32(x, tl.bfloat16)
    else:
        return x.to(tl.bfloat16)

@triton.jit
def _e8m0_to_f32(e):
    """2^(e-127) as fp32 from a uint8 scale byte, built on the bits so it is exact: e = 0 is the
    subnormal 2^-127, e = 255 is NaN."""
    ei = e.to(tl.int32)
    bits = tl.where(ei == 0, 0x00400000, ei << 23)
    bits = tl.where(ei == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_d_tile(ptr, rows, row_mask, sc_ptr, sc_rows,
                 COL0: tl.constexpr, NCOL: tl.constexpr, IS_MX: tl.constexpr, MASKED: tl.constexpr):
    """bf16 tile [R, NCOL] of q or k: features COL0 .. COL0 + NCOL of the rows at element offsets
    `rows` from `ptr`. MXFP8 data is dequantized with its per-32-feature scale bytes at
    `sc_ptr + sc_rows + feature // 32`: the codes are loaded as [R, NCOL/32, 32] so each scale byte is
    loaded once and broadcast over its group."""
    if IS_MX:
        G: tl.constexpr = NCOL // 32
        grp = tl.arange(0, G)
        col = tl.arange(0, 32)
        offs = rows[:, None, None] + (COL0 + grp[None, :, None] * 32 + col[None, None, :])
        sc_offs = sc_rows[:, None] + (COL0 // 32 + grp)[None, :]
        if MASKED:
            codes = tl.load(ptr + offs, mask=row_mask[:, None, None], other=0.0)
            sc = tl.load(sc_ptr + sc_offs, mask=row_mask[:, None], other=127)
        else:
            codes = tl.load(ptr + offs)
            sc = tl.load(sc_ptr + sc_offs)
        x = codes.to(tl.float32) * _e8m0_to_f32(sc)[:, :, None]
        return tl.reshape(_to_bf16(x), (x.shape[0], NCOL))
    else:
        offs = rows[:, None] + (COL0 + tl.arange(0, NCOL))[None, :]
        if MASKED:
            x = tl.load(ptr + offs, mask=row_mask[:, None], other=0.0)
        else:
            x = tl.load(ptr + offs)
        return x


@triton.jit
def _load_v_tile(ptr, rows, row_mask, sc_ptr, sc_rows, IS_MX: tl.constexpr, MASKED: tl.constexpr):
    """bf16 tile [R, 128] of v. MXFP8 v is blocked along the sequence: `sc_rows` are the element
    offsets of the scale row (token // 32) of each tile row in the [.., S/32, H, 128] scales."""
    d = tl.arange(0, 128)
    offs = rows[:, None] + d[None, :]
    if IS_MX:
        sc_offs = sc_rows[:, None] + d[None, :]
        if MASKED:
            codes = tl.load(ptr + offs, mask=row_mask[:, None], other=0.0)
            sc = tl.load(sc_ptr + sc_offs, mask=row_mask[:, None], other=127)
        else:
            codes = tl.load(ptr + offs)
            sc = tl.load(sc_ptr + sc_offs)
        return _to_bf16(codes.to(tl.float32) * _e8m0_to_f32(sc))
    else:
        if MASKED:
            x = tl.load(ptr + offs, mask=row_mask[:, None], other=0.0)
        else:
            x = tl.load(ptr + offs)
        return x


@triton.jit
def _sequence(CU, b, SEQ_LEN, VARLEN: tl.constexpr):
    """(first token, length) of sequence b: from cu_seqlens for thd, else (0, SEQ_LEN)."""
    if VARLEN:
        start = tl.load(CU + b)
        length = tl.load(CU + b + 1) - start
    else:
        start = 0
        length = SEQ_LEN
    return start, length


@triton.jit
def _key_ranges(m_lo, seqlen_q, seqlen_kv, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr):
    """For the query tile starting at m_lo: (full_end, hi). Keys [0, full_end) are visible to every row
    (whole key blocks), keys [full_end, hi) need the mask, keys >= hi are masked for the whole tile."""
    if CAUSAL:
        shift = seqlen_kv - seqlen_q
        hi = tl.minimum(seqlen_kv, tl.maximum(m_lo + BLOCK_M + shift, 0))
        # Row m_lo sees keys j <= m_lo + shift, so every row sees the keys below m_lo + shift + 1.
        full = tl.maximum(m_lo + shift + 1, 0) // BLOCK_N * BLOCK_N
        full_end = tl.minimum(full, hi // BLOCK_N * BLOCK_N)
    else:
        hi = seqlen_kv
        full_end = seqlen_kv // BLOCK_N * BLOCK_N
    return full_end, hi


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------

@triton.jit
def _fwd_inner(acc, l_i, m_i, q0, q1,
               k_base, v_base, ks_base, vs_base,
               stride_ks, stride_kss, stride_vs, stride_vss,
               kv_tok0, q_idx, seqlen_kv, shift, qk_scale, mask_from, hi,
               BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
               K_MX: tl.constexpr, V_MX: tl.constexpr, EVEN_KV: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    k_rows = offs_n * stride_ks
    ks_rows = offs_n * stride_kss
    v_rows = offs_n * stride_vs
    for start_n in range(0, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        kv_idx = start_n + offs_n
        kv_mask = kv_idx < seqlen_kv
        kp = k_base + start_n.to(tl.int64) * stride_ks
        ksp = ks_base + start_n.to(tl.int64) * stride_kss
        k0 = _load_d_tile(kp, k_rows, kv_mask, ksp, ks_rows, 0, 128, K_MX, not EVEN_KV)
        k1 = _load_d_tile(kp, k_rows, kv_mask, ksp, ks_rows, 128, 64, K_MX, not EVEN_KV)
        qk = _mma(q0, tl.trans(k0), None)
        qk = _mma(q1, tl.trans(k1), qk)
        if start_n >= mask_from:
            if EVEN_KV:  # every key block is whole: only the causal band needs a mask
                keep = kv_idx[None, :] <= q_idx[:, None] + shift
            else:
                keep = kv_mask[None, :]
                if CAUSAL:
                    keep = keep & (kv_idx[None, :] <= q_idx[:, None] + shift)
            qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        # A row with every key so far masked keeps m = -inf; shift it by 0 (its p are all 0).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        vp = v_base + start_n.to(tl.int64) * stride_vs
        vs_rows = ((kv_tok0 + kv_idx) // 32).to(tl.int64) * stride_vss
        v = _load_v_tile(vp, v_rows, kv_mask, vs_base, vs_rows, V_MX, not EVEN_KV)
        acc = _mma(_to_bf16(p), v, acc)
        m_i = m_new
    return acc, l_i, m_i


def _even_kv(args) -> bool:
    """Every key block of the launch is whole (fixed-length layouts with BLOCK_N | S_kv): the key loop's
    loads then carry no mask (the causal band still does). Off when FWD_EVEN_KV is False."""
    return FWD_EVEN_KV and not args["VARLEN"] and args["SEQ_KV"] % args["BLOCK_N"] == 0


@autotune_cached(configs=_fwd_configs(), key=["SEQ_BUCKET", "CAUSAL", "VARLEN", "Q_MX", "K_MX", "V_MX"],
                 heuristic=first_config)
@triton.heuristics({"EVEN_KV": _even_kv})
@triton.jit
def _mla_fwd_kernel(
    Q, K, V, QS, KS, VS, O, LSE, CU_Q, CU_KV,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_qsb, stride_qss, stride_qsh,
    stride_ksb, stride_kss, stride_ksh,
    stride_vsb, stride_vss, stride_vsh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    SEQ_Q, SEQ_KV, qk_scale, SEQ_BUCKET,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
    Q_MX: tl.constexpr, K_MX: tl.constexpr, V_MX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_KV: tl.constexpr,
):
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest (last) query blocks first
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_tok0, seqlen_q = _sequence(CU_Q, b, SEQ_Q, VARLEN)
    kv_tok0, seqlen_kv = _sequence(CU_KV, b, SEQ_KV, VARLEN)
    m_lo = m_block * BLOCK_M
    if m_lo >= seqlen_q:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    q_row0 = (q_tok0 + m_lo).to(tl.int64)
    kv_row0 = (kv_tok0 + m_lo * 0).to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = m_lo + offs_m
    q_mask = q_idx < seqlen_q
    q_base = Q + b64 * stride_qb + h64 * stride_qh + q_row0 * stride_qs
    qs_base = QS + b64 * stride_qsb + h64 * stride_qsh + q_row0 * stride_qss
    q0 = _load_d_tile(q_base, offs_m * stride_qs, q_mask, qs_base, offs_m * stride_qss, 0, 128, Q_MX, True)
    q1 = _load_d_tile(q_base, offs_m * stride_qs, q_mask, qs_base, offs_m * stride_qss, 128, 64, Q_MX, True)

    k_base = K + b64 * stride_kb + h64 * stride_kh + kv_row0 * stride_ks
    ks_base = KS + b64 * stride_ksb + h64 * stride_ksh + kv_row0 * stride_kss
    v_base = V + b64 * stride_vb + h64 * stride_vh + kv_row0 * stride_vs
    vs_base = VS + b64 * stride_vsb + h64 * stride_vsh  # rows are chosen per key by token // 32

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, 128], tl.float32)
    shift = seqlen_kv - seqlen_q
    full_end, hi = _key_ranges(m_lo, seqlen_q, seqlen_kv, BLOCK_M, BLOCK_N, CAUSAL)
    # One key loop (a runtime test picks the iterations that need the mask), entered only when it runs
    # at least once: ptxas serialises every wgmma of a kernel (warning C7515) when a path that skips
    # the loop writes the loop's in-flight accumulator registers (the two-loop form, or a zero-trip
    # loop, does that).
    if hi > 0:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q0, q1, k_base, v_base, ks_base, vs_base,
                                   stride_ks, stride_kss, stride_vs, stride_vss,
                                   kv_tok0, q_idx, seqlen_kv, shift, qk_scale, full_end, hi,
                                   BLOCK_N, CAUSAL, K_MX, V_MX, EVEN_KV)

    # Epilogue: fully masked rows have l = 0 (and acc = 0): o = 0, lse = -inf.
    masked_row = l_i == 0.0
    l_safe = tl.where(masked_row, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(masked_row, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    d = tl.arange(0, 128)
    o_ptrs = O + b64 * stride_ob + h64 * stride_oh + q_row0 * stride_os + offs_m[:, None] * stride_os + d[None, :]
    tl.store(o_ptrs, _to_bf16(o), mask=q_mask[:, None])
    tl.store(LSE + b64 * stride_lb + h64 * stride_lh + q_tok0 + q_idx, lse, mask=q_mask)


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------

@triton.jit
def _mla_bwd_preprocess_kernel(
    O, DO, LSE, DELTA, LSE2, CU_Q,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_lb, stride_lh,
    SEQ_Q,
    VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """DELTA = rowsum(o * do) in fp32 (o, do widened exactly); LSE2 = lse * log2(e), +inf where
    lse = -inf so that P = exp2(s - LSE2) is exactly 0 on fully masked rows."""
    m_lo = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_tok0, seqlen_q = _sequence(CU_Q, b, SEQ_Q, VARLEN)
    if m_lo >= seqlen_q:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    row0 = (q_tok0 + m_lo).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    q_mask = m_lo + offs_m < seqlen_q
    d = tl.arange(0, 128)
    o = tl.load(O + b64 * stride_ob + h64 * stride_oh + row0 * stride_os + offs_m[:, None] * stride_os + d[None, :],
                mask=q_mask[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + b64 * stride_dob + h64 * stride_doh + row0 * stride_dos + offs_m[:, None] * stride_dos
                 + d[None, :], mask=q_mask[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    l_off = b64 * stride_lb + h64 * stride_lh + row0 + offs_m
    lse = tl.load(LSE + l_off, mask=q_mask, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(DELTA + l_off, delta, mask=q_mask)
    tl.store(LSE2 + l_off, lse2, mask=q_mask)


@triton.jit
def _bwd_dkdv_inner(dk0, dk1, dv, k0, k1, v,
                    q_base, do_base, lse2_base, delta_base, dqa_base,
                    stride_qs, stride_dos, stride_dqas,
                    kv_idx, seqlen_q, shift, qk_scale, lo, mask_to,
                    BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    q_rows = offs_m * stride_qs
    do_rows = offs_m * stride_dos
    for start_m in range(lo, seqlen_q, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        q_idx = start_m + offs_m
        q_mask = q_idx < seqlen_q
        qp = q_base + start_m.to(tl.int64) * stride_qs
        # The last query block may run past the sequence: loads are masked, and those rows get
        # lse2 = +inf so their P is 0 (and their do is 0): they add nothing to dk, dv.
        q0 = _load_d_tile(qp, q_rows, q_mask, qp, q_rows, 0, 128, False, True)
        q1 = _load_d_tile(qp, q_rows, q_mask, qp, q_rows, 128, 64, False, True)
        lse2 = tl.load(lse2_base + q_idx, mask=q_mask, other=float("inf"))
        qkT = _mma(k0, tl.trans(q0), None)
        qkT = _mma(k1, tl.trans(q1), qkT)
        pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
        if CAUSAL:
            if start_m < mask_to:  # the diagonal band: some (key, query) pairs are masked
                pT = tl.where(kv_idx[:, None] <= q_idx[None, :] + shift, pT, 0.0)
        dop = do_base + start_m.to(tl.int64) * stride_dos
        do = _load_v_tile(dop, do_rows, q_mask, dop, do_rows, False, True)
        dv = _mma(_to_bf16(pT), do, dv)
        delta = tl.load(delta_base + q_idx, mask=q_mask, other=0.0)
        dpT = _mma(v, tl.trans(do), None)
        dsT = _to_bf16(pT * (dpT - delta[None, :]))
        dk0 = _mma(dsT, q0, dk0)
        dk1 = _mma(dsT, q1, dk1)
        if ATOMIC_DQ:
            # dq += dS k (unscaled) into the fp32 accumulator shared by every key block.
            ds = tl.trans(dsT)
            dqp = dqa_base + start_m.to(tl.int64) * stride_dqas + (offs_m * stride_dqas)[:, None]
            tl.atomic_add(dqp + tl.arange(0, 128)[None, :], _mma(ds, k0, None), mask=q_mask[:, None],
                          sem="relaxed")
            tl.atomic_add(dqp + 128 + tl.arange(0, 64)[None, :], _mma(ds, k1, None), mask=q_mask[:, None],
                          sem="relaxed")
    return dk0, dk1, dv


@autotune_cached(configs=_dkdv_configs(), key=["SEQ_BUCKET", "CAUSAL", "VARLEN", "ATOMIC_DQ"], reset_to_zero=["DQA"],
                 heuristic=first_config)
@triton.jit
def _mla_bwd_dkdv_kernel(
    Q, K, V, DO, LSE2, DELTA, DK, DV, DQA, CU_Q, CU_KV,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_dqab, stride_dqas, stride_dqah,
    stride_lb, stride_lh,
    SEQ_Q, SEQ_KV, qk_scale, sm_scale, SEQ_BUCKET,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    n_block = tl.program_id(0)  # under causal masking the first key blocks see the most queries
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_tok0, seqlen_q = _sequence(CU_Q, b, SEQ_Q, VARLEN)
    kv_tok0, seqlen_kv = _sequence(CU_KV, b, SEQ_KV, VARLEN)
    n_lo = n_block * BLOCK_N
    if n_lo >= seqlen_kv:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    kv_row0 = (kv_tok0 + n_lo).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    kv_idx = n_lo + offs_n
    kv_mask = kv_idx < seqlen_kv
    k_base = K + b64 * stride_kb + h64 * stride_kh + kv_row0 * stride_ks
    v_base = V + b64 * stride_vb + h64 * stride_vh + kv_row0 * stride_vs
    k_rows = offs_n * stride_ks
    v_rows = offs_n * stride_vs
    k0 = _load_d_tile(k_base, k_rows, kv_mask, k_base, k_rows, 0, 128, False, True)
    k1 = _load_d_tile(k_base, k_rows, kv_mask, k_base, k_rows, 128, 64, False, True)
    v = _load_v_tile(v_base, v_rows, kv_mask, v_base, v_rows, False, True)

    q_row0 = (q_tok0 + n_lo * 0).to(tl.int64)
    q_base = Q + b64 * stride_qb + h64 * stride_qh + q_row0 * stride_qs
    do_base = DO + b64 * stride_dob + h64 * stride_doh + q_row0 * stride_dos
    l_off = b64 * stride_lb + h64 * stride_lh + q_row0
    dqa_base = DQA + b64 * stride_dqab + h64 * stride_dqah + q_row0 * stride_dqas
    dk0 = tl.zeros([BLOCK_N, 128], tl.float32)
    dk1 = tl.zeros([BLOCK_N, 64], tl.float32)
    dv = tl.zeros([BLOCK_N, 128], tl.float32)
    shift = seqlen_kv - seqlen_q
    if CAUSAL:
        # Query i sees key j iff i >= j - shift: rows below n_lo - shift see none of this block, rows
        # from n_lo + BLOCK_N - 1 - shift on see all of it; the band between needs the mask.
        m_start = tl.maximum(n_lo - shift, 0) // BLOCK_M * BLOCK_M
        m_full = (tl.maximum(n_lo + BLOCK_N - 1 - shift, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    else:
        m_start = n_lo * 0
        m_full = n_lo * 0
    if m_start < seqlen_q:  # one loop, entered only when it runs (see _mla_fwd_kernel)
        dk0, dk1, dv = _bwd_dkdv_inner(dk0, dk1, dv, k0, k1, v, q_base, do_base, LSE2 + l_off, DELTA + l_off,
                                       dqa_base, stride_qs, stride_dos, stride_dqas, kv_idx, seqlen_q, shift,
                                       qk_scale, m_start, m_full, BLOCK_M, CAUSAL, ATOMIC_DQ)

    d128 = tl.arange(0, 128)
    d64 = tl.arange(0, 64)
    dk_ptrs = DK + b64 * stride_dkb + h64 * stride_dkh + kv_row0 * stride_dks + offs_n[:, None] * stride_dks
    tl.store(dk_ptrs + d128[None, :], _to_bf16(dk0 * sm_scale), mask=kv_mask[:, None])
    tl.store(dk_ptrs + 128 + d64[None, :], _to_bf16(dk1 * sm_scale), mask=kv_mask[:, None])
    dv_ptrs = DV + b64 * stride_dvb + h64 * stride_dvh + kv_row0 * stride_dvs + offs_n[:, None] * stride_dvs
    tl.store(dv_ptrs + d128[None, :], _to_bf16(dv), mask=kv_mask[:, None])


@triton.jit
def _bwd_dq_inner(dq0, dq1, q0, q1, do, lse2, delta,
                  k_base, v_base, stride_ks, stride_vs,
                  q_idx, seqlen_kv, shift, qk_scale, mask_from, hi,
                  BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    k_rows = offs_n * stride_ks
    v_rows = offs_n * stride_vs
    for start_n in range(0, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        kv_idx = start_n + offs_n
        kv_mask = kv_idx < seqlen_kv
        kp = k_base + start_n.to(tl.int64) * stride_ks
        vp = v_base + start_n.to(tl.int64) * stride_vs
        k0 = _load_d_tile(kp, k_rows, kv_mask, kp, k_rows, 0, 128, False, True)
        k1 = _load_d_tile(kp, k_rows, kv_mask, kp, k_rows, 128, 64, False, True)
        v = _load_v_tile(vp, v_rows, kv_mask, vp, v_rows, False, True)
        qk = _mma(q0, tl.trans(k0), None)
        qk = _mma(q1, tl.trans(k1), qk)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if start_n >= mask_from:
            keep = kv_mask[None, :]
            if CAUSAL:
                keep = keep & (kv_idx[None, :] <= q_idx[:, None] + shift)
            p = tl.where(keep, p, 0.0)
        dp = _mma(do, tl.trans(v), None)
        ds = _to_bf16(p * (dp - delta[:, None]))
        dq0 = _mma(ds, k0, dq0)
        dq1 = _mma(ds, k1, dq1)
    return dq0, dq1


@autotune_cached(configs=_dq_configs(), key=["SEQ_BUCKET", "CAUSAL", "VARLEN"], heuristic=first_config)
@triton.jit
def _mla_bwd_dq_kernel(
    Q, K, V, DO, LSE2, DELTA, DQ, CU_Q, CU_KV,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh,
    SEQ_Q, SEQ_KV, qk_scale, sm_scale, SEQ_BUCKET,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest (last) query blocks first
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_tok0, seqlen_q = _sequence(CU_Q, b, SEQ_Q, VARLEN)
    kv_tok0, seqlen_kv = _sequence(CU_KV, b, SEQ_KV, VARLEN)
    m_lo = m_block * BLOCK_M
    if m_lo >= seqlen_q:
        return
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    q_row0 = (q_tok0 + m_lo).to(tl.int64)
    kv_row0 = (kv_tok0 + m_lo * 0).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = m_lo + offs_m
    q_mask = q_idx < seqlen_q
    q_base = Q + b64 * stride_qb + h64 * stride_qh + q_row0 * stride_qs
    do_base = DO + b64 * stride_dob + h64 * stride_doh + q_row0 * stride_dos
    q_rows = offs_m * stride_qs
    do_rows = offs_m * stride_dos
    q0 = _load_d_tile(q_base, q_rows, q_mask, q_base, q_rows, 0, 128, False, True)
    q1 = _load_d_tile(q_base, q_rows, q_mask, q_base, q_rows, 128, 64, False, True)
    do = _load_v_tile(do_base, do_rows, q_mask, do_base, do_rows, False, True)
    l_off = b64 * stride_lb + h64 * stride_lh + q_row0 + offs_m
    lse2 = tl.load(LSE2 + l_off, mask=q_mask, other=float("inf"))
    delta = tl.load(DELTA + l_off, mask=q_mask, other=0.0)

    k_base = K + b64 * stride_kb + h64 * stride_kh + kv_row0 * stride_ks
    v_base = V + b64 * stride_vb + h64 * stride_vh + kv_row0 * stride_vs
    dq0 = tl.zeros([BLOCK_M, 128], tl.float32)
    dq1 = tl.zeros([BLOCK_M, 64], tl.float32)
    shift = seqlen_kv - seqlen_q
    full_end, hi = _key_ranges(m_lo, seqlen_q, seqlen_kv, BLOCK_M, BLOCK_N, CAUSAL)
    if hi > 0:  # one loop, entered only when it runs (see _mla_fwd_kernel)
        dq0, dq1 = _bwd_dq_inner(dq0, dq1, q0, q1, do, lse2, delta, k_base, v_base, stride_ks, stride_vs,
                                 q_idx, seqlen_kv, shift, qk_scale, full_end, hi, BLOCK_N, CAUSAL)

    d128 = tl.arange(0, 128)
    d64 = tl.arange(0, 64)
    dq_ptrs = DQ + b64 * stride_dqb + h64 * stride_dqh + q_row0 * stride_dqs + offs_m[:, None] * stride_dqs
    tl.store(dq_ptrs + d128[None, :], _to_bf16(dq0 * sm_scale), mask=q_mask[:, None])
    tl.store(dq_ptrs + 128 + d64[None, :], _to_bf16(dq1 * sm_scale), mask=q_mask[:, None])


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------

def _compact_scale(t: MXTensor) -> torch.Tensor:
    """t's scale bytes in the compact layout (swizzled scales are unswizzled first)."""
    return unswizzle_scales(t).scale


def _dequantize_mx(*ts) -> list:
    """ts with every MXTensor among them dequantized to bf16 by the flat pass (all in one launch);
    other operands as they are."""
    out = list(ts)
    mx = [i for i, t in enumerate(ts) if isinstance(t, MXTensor)]
    for i, d in zip(mx, dequantize_bf16_flat_many([ts[i] for i in mx])):
        out[i] = d
    return out


def _feature_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _operand(x):
    """(data, compact scale or None) with unit feature stride."""
    if isinstance(x, MXTensor):
        return _feature_contiguous(x.data), _feature_contiguous(_compact_scale(x))
    return _feature_contiguous(x), None


def _bsh_strides(x: Optional[torch.Tensor], layout: str):
    """(batch, sequence, head) element strides of a [.., H, D] tensor; thd has no batch stride."""
    if x is None:
        return 0, 0, 0
    if layout == "bshd":
        return x.stride(0), x.stride(1), x.stride(2)
    if layout == "sbhd":
        return x.stride(1), x.stride(0), x.stride(2)
    return 0, x.stride(0), x.stride(1)


class _Geometry:
    """Batch, heads and sequence lengths of a call, in one place for every layout."""

    def __init__(self, q_shape, kv_shape, layout, cu_seqlens_q, cu_seqlens_kv):
        self.layout = layout
        self.heads = q_shape[-2]
        self.varlen = layout == "thd"
        if self.varlen:
            self.batch = cu_seqlens_q.shape[0] - 1
            self.cu_q = cu_seqlens_q.to(torch.int32).contiguous()
            self.cu_kv = cu_seqlens_kv.to(torch.int32).contiguous()
            self.tokens_q = q_shape[0]
            if self.cu_q.is_cuda and torch.cuda.is_current_stream_capturing():
                # a CUDA graph cannot read the lengths on the host: the token counts bound every
                # sequence, and programs past their sequence's end return at once. The tile class
                # follows the bound, so it may differ from an eager call's (module docstring)
                self.max_q, self.max_kv = (self.tokens_q, kv_shape[0]) if self.batch else (0, 0)
            else:
                # One host sync: the grid needs the longest sequence (flash-attn's varlen API takes it
                # as an argument; ours is derived).
                self.max_q = int((self.cu_q[1:] - self.cu_q[:-1]).max().item()) if self.batch else 0
                self.max_kv = int((self.cu_kv[1:] - self.cu_kv[:-1]).max().item()) if self.batch else 0
            self.seq_q = self.seq_kv = 0
            self.lse_shape = (self.heads, self.tokens_q)
            self.lse_strides = (0, self.tokens_q)
        else:
            b_axis, s_axis = (0, 1) if layout == "bshd" else (1, 0)
            self.batch = q_shape[b_axis]
            self.seq_q, self.seq_kv = q_shape[s_axis], kv_shape[s_axis]
            self.max_q, self.max_kv = self.seq_q, self.seq_kv
            self.cu_q = self.cu_kv = None
            self.lse_shape = (self.batch, self.heads, self.seq_q)
            self.lse_strides = (self.heads * self.seq_q, self.seq_q)

    def out_shape(self, x_shape, d):
        return tuple(x_shape[:-1]) + (d,)


def _scale_value(softmax_scale) -> float:
    return DEFAULT_SOFTMAX_SCALE if softmax_scale is None else float(softmax_scale)


def _forward(q, k, v, causal, softmax_scale, layout, cu_seqlens_q, cu_seqlens_kv, mx_dequant=None):
    mode = mx_dequant or FWD_MX_DEQUANT
    if mode not in FWD_MX_DEQUANT_MODES:
        raise ValueError(f"FWD_MX_DEQUANT: expected one of {', '.join(FWD_MX_DEQUANT_MODES)}, got {mode!r}")
    if mode == "predequant_qkv":
        q, k, v = _dequantize_mx(q, k, v)
    elif mode == "predequant":
        k, v = _dequantize_mx(k, v)
    qd, qs = _operand(q)
    kd, ks = _operand(k)
    vd, vs = _operand(v)
    geo = _Geometry(qd.shape, kd.shape, layout, cu_seqlens_q, cu_seqlens_kv)
    o = torch.empty(geo.out_shape(qd.shape, MLA_V_HEAD_DIM), dtype=torch.bfloat16, device=qd.device)
    lse = torch.empty(geo.lse_shape, dtype=torch.float32, device=qd.device)
    if geo.batch * geo.heads == 0 or geo.max_q == 0:
        return o, lse
    scale = _scale_value(softmax_scale)
    cu_q = geo.cu_q if geo.varlen else lse
    cu_kv = geo.cu_kv if geo.varlen else lse
    grid = lambda meta: (cdiv(geo.max_q, meta["BLOCK_M"]), geo.heads, geo.batch)  # noqa: E731
    _mla_fwd_kernel[grid](
        qd, kd, vd,
        qs if qs is not None else qd, ks if ks is not None else kd, vs if vs is not None else vd,
        o, lse, cu_q, cu_kv,
        *_bsh_strides(qd, layout), *_bsh_strides(kd, layout), *_bsh_strides(vd, layout),
        *_bsh_strides(qs, layout), *_bsh_strides(ks, layout), *_bsh_strides(vs, layout),
        *_bsh_strides(o, layout), *geo.lse_strides,
        geo.seq_q, geo.seq_kv, scale * LOG2E, _seq_bucket(geo.max_q),
        CAUSAL=bool(causal), VARLEN=geo.varlen,
        Q_MX=qs is not None, K_MX=ks is not None, V_MX=vs is not None,
    )
    return o, lse


def _backward(do, q, k, v, o, lse, causal, softmax_scale, layout, cu_seqlens_q, cu_seqlens_kv, dq_mode=None):
    dq_mode = dq_mode or BWD_DQ
    if dq_mode not in ("separate", "atomic"):
        raise ValueError(f"BWD_DQ: expected 'separate' or 'atomic', got {dq_mode!r}")
    atomic = dq_mode == "atomic"
    q, k, v = (_feature_contiguous(x) for x in _dequantize_mx(q, k, v))
    do, o = _feature_contiguous(do), _feature_contiguous(o)
    geo = _Geometry(q.shape, k.shape, layout, cu_seqlens_q, cu_seqlens_kv)
    dq = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    dk = torch.empty(k.shape, dtype=torch.bfloat16, device=q.device)
    dv = torch.empty(v.shape, dtype=torch.bfloat16, device=q.device)
    if geo.batch * geo.heads == 0:
        return dq, dk, dv
    scale = _scale_value(softmax_scale)
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    lse2 = torch.empty_like(lse)
    cu_q = geo.cu_q if geo.varlen else lse
    cu_kv = geo.cu_kv if geo.varlen else lse
    if geo.max_q:
        block = 64
        _mla_bwd_preprocess_kernel[(cdiv(geo.max_q, block), geo.heads, geo.batch)](
            o, do, lse, delta, lse2, cu_q,
            *_bsh_strides(o, layout), *_bsh_strides(do, layout), *geo.lse_strides,
            geo.seq_q, VARLEN=geo.varlen, BLOCK_M=block,
        )
    common = (geo.seq_q, geo.seq_kv, scale * LOG2E, scale)
    # Atomic mode: unscaled fp32 dq sums (zeroed by the autotuner's reset before its final run too).
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic else dq

    def dkdv():
        _mla_bwd_dkdv_kernel[lambda meta: (cdiv(geo.max_kv, meta["BLOCK_N"]), geo.heads, geo.batch)](
            q, k, v, do, lse2, delta, dk, dv, dq_acc, cu_q, cu_kv,
            *_bsh_strides(q, layout), *_bsh_strides(k, layout), *_bsh_strides(v, layout),
            *_bsh_strides(do, layout), *_bsh_strides(dk, layout), *_bsh_strides(dv, layout),
            *_bsh_strides(dq_acc, layout), *geo.lse_strides, *common, _seq_bucket(geo.max_kv),
            CAUSAL=bool(causal), VARLEN=geo.varlen, ATOMIC_DQ=atomic,
        )

    if geo.max_kv:
        tuned = len(getattr(_mla_bwd_dkdv_kernel, "cache", {}))
        dkdv()
        if atomic and len(getattr(_mla_bwd_dkdv_kernel, "cache", {})) != tuned:
            # This call autotuned: the timing runs added into dq_acc too. Recent Triton zeroes
            # reset_to_zero arguments before the final run, older ones may not; redo it from zero.
            dq_acc.zero_()
            dkdv()
    if atomic:
        dq.copy_(dq_acc * scale)  # one fp32 multiply, then RN to bf16 (as the dq kernel's epilogue)
        return dq, dk, dv
    if geo.max_q:
        _mla_bwd_dq_kernel[lambda meta: (cdiv(geo.max_q, meta["BLOCK_M"]), geo.heads, geo.batch)](
            q, k, v, do, lse2, delta, dq, cu_q, cu_kv,
            *_bsh_strides(q, layout), *_bsh_strides(k, layout), *_bsh_strides(v, layout),
            *_bsh_strides(do, layout), *_bsh_strides(dq, layout),
            *geo.lse_strides, *common, _seq_bucket(geo.max_q),
            CAUSAL=bool(causal), VARLEN=geo.varlen,
        )
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------
# Capability checks and registration
# --------------------------------------------------------------------------------------------------

def _operand_reasons(named) -> List[str]:
    reasons = []
    has_mx = False
    for name, x in named:
        if isinstance(x, MXTensor):
            has_mx = True
        elif isinstance(x, torch.Tensor) and x.dtype != torch.bfloat16:
            reasons.append(f"{name}: the triton attention kernels take bfloat16 or MXFP8 operands, got {x.dtype}")
    if has_mx:
        for name, x in named:
            if isinstance(x, MXTensor) and x.data.device.type == "cuda" and not interpret_mode():
                if torch.cuda.get_device_capability(x.data.device) < (8, 9):
                    reasons.append(f"{name}: MXFP8 (float8) loads need compute capability >= 8.9")
    return reasons


def attention_reasons(q, k, v, causal=False, softmax_scale=None, layout="bshd", cu_seqlens_q=None,
                      cu_seqlens_kv=None) -> List[str]:
    reasons = triton_reasons(q, k, v, cu_seqlens_q, cu_seqlens_kv, min_capability=(8, 0))
    return reasons + _operand_reasons((("q", q), ("k", k), ("v", v)))


def attention_backward_reasons(do, q, k, v, o, lse, causal=False, softmax_scale=None, layout="bshd",
                               cu_seqlens_q=None, cu_seqlens_kv=None) -> List[str]:
    reasons = triton_reasons(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_kv, min_capability=(8, 0))
    return reasons + _operand_reasons((("do", do), ("q", q), ("k", k), ("v", v)))


@register("mla_attention", "triton", check=attention_reasons)
def mla_attention(q, k, v, causal=False, softmax_scale=None, layout="bshd", cu_seqlens_q=None,
                  cu_seqlens_kv=None):
    """spec.mla_attention as flash-attention kernels: (o bf16 shaped like q with head dim 128,
    lse fp32 [B, H, S_q], thd [H, T_q])."""
    return _forward(q, k, v, causal, softmax_scale, layout, cu_seqlens_q, cu_seqlens_kv)


@register("mla_attention_backward", "triton", check=attention_backward_reasons)
def mla_attention_backward(do, q, k, v, o, lse, causal=False, softmax_scale=None, layout="bshd",
                           cu_seqlens_q=None, cu_seqlens_kv=None):
    """spec.mla_attention_backward: (dq, dk, dv) bf16 shaped like q, k, v (gradients w.r.t. the
    dequantized values for MXFP8 operands)."""
    return _backward(do, q, k, v, o, lse, causal, softmax_scale, layout, cu_seqlens_q, cu_seqlens_kv)
