"""The MXFP8 backward's two GEMMs with g's RoPE backward and MXFP8 quantize-dequantize inside the main
loop (sm90, Gluon): no pre-pass, and no quantized or dequantized copy of g is written.

    launch(FORM_DX, g2, w16p, cos, sin, dx, flag)   # dx [T, K] = Q_rows(g) @ w_n        (sum over N)
    launch(FORM_DW, g2, x16,  cos, sin, dw, flag)   # dw [N, K] = Q_cols(g)^T @ x_t      (sum over T)

g2 is the fused op's output gradient viewed [T, N = H * 192] (bf16, read as it is, by TMA). Each
k-step's g tile goes from shared memory into the wgmma A-operand registers, is widened to fp32, put
through the mla RoPE backward where it holds a head's RoPE features (fp32, no FMA contraction: the
pre-pass's rounding), and quantized to e4m3 with its rceil block scale along the GEMM's contraction axis
and dequantized again (exact in bf16 where the guard stays down), so the MMA multiplies exactly the
spec's g_row (dx) or g_col (dw) by the other operand. This is the spec's MXFP8 backward (spec/mla_q.py)
with the products exact and the sum in fp32: the contract of the two-GEMM route it replaces
(mla_q._backward_dequantized), whose pre-pass reads g once and writes two bf16 copies (6 bytes an
element; 0.18 ms of a 1.12 ms backward at T = 4096 on the H200).

Why g is the register operand: wgmma takes only A from registers, and the per-element work (about a
dozen instructions) is paid once per A element per output tile of 192 columns; as the B operand (in
shared memory) it would be paid per 128-row tile and need a second shared-memory pass.

The RoPE pairs (a head's features 128 + j and 160 + j turn into its features 128 + 2j and 129 + 2j):
- dx (K = features): a k-step is one 64-feature chunk, loaded as two 32-feature halves, so feature j and
  j + 32 of the chunk sit in one thread at the same register index of the two halves. The rotated
  values stay there -- position j holds feature 2j, position 32 + j feature 2j + 1 -- and w's
  dequantized copy is written in that order (`permuted_weight`), so the contraction pairs them right.
  The quantization blocks then are positions {0..15, 32..47} (features 0..31) and {16..31, 48..63}.
- dw (rows = features): a RoPE chunk is one warpgroup's 64 rows; rows j and j + 32 belong to different
  warps, so its two halves are loaded into one blocked layout (pairs in one thread), rotated,
  interleaved back to feature order and moved into the A-operand layout through shared memory
  (gl.convert_layout). The output keeps feature order.

Guards (the caller's gated exact path recomputes everything when *flag is raised): a quantization block
whose scale byte is outside BF16_SAFE_SCALE_BYTES over a nonzero code, or that holds NaN / Inf
(mla_q_prepass._block_factors' rule), and an output not finite in bf16.

Kernel: persistent (one program per SM); a TMA producer warp fills a ring of STAGES slots, each the two
32-wide K halves of a [128, 64] tile of g and of a [192, 64] tile of the other operand; two consumer
warpgroups share each 128 x 192 output tile (64 g rows each, 96 fp32 accumulator registers a thread),
prepare step k's A operand while step k - 1's MMAs run (two register sets used alternately, the loop
unrolled by two as in _gluon_mx.mainloop) and store their half of the tile by TMA. Output tiles run
with the 192-column side fastest, so a g band is read from memory once.

Scope: sm90, Triton 3.6 or 3.9 (_gluon_compat.py); g2 and the other operand with unit last stride and
16-byte aligned rows; T a multiple of 32; K (the output's width) a multiple of 8.
"""
from __future__ import annotations

import struct

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._common import cdiv, settle_cache_keys
from ._gluon_compat import async_load, async_store

FORM_DX, FORM_DW = 0, 1
TILE_G = gl.constexpr(128)  # g rows per output tile (tokens for dx, features for dw)
HALF = gl.constexpr(64)  # g rows per consumer warpgroup
TILE_N = gl.constexpr(256)  # output columns per tile
KH = gl.constexpr(32)  # one K half: one quantization block along the contraction
TILE_G_ROWS, TILE_N_COLS, K_HALF = 128, 256, 32
NUM_WARPS = 4
CONFIGS = (dict(STAGES=3),)

ACC_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
A_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=ACC_LAYOUT.value, k_width=2))
# dw's RoPE chunks: a [64, 32] tile wraps this [32, 32] layout twice along rows, so rows j and j + 32
# are one thread's
PAIR_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0]))
F32_ABS = gl.constexpr(0x7FFFFFFF)
E4M3_INV_MAX = gl.constexpr(struct.unpack("<f", struct.pack("<I", 0x3B124925))[0])  # RN_f32(1/448): rceil's multiplier
BF16_ROUNDS_TO_INF = gl.constexpr(float.fromhex("0x1.ffp127"))


# --------------------------------------------------------------------------------------------------
# producer
# --------------------------------------------------------------------------------------------------
@gluon.jit
def _producer(g_desc, o_desc, g_ring, o_ring, ready, empty, R, K_SUM, NOUT,
              FORM: gl.constexpr, STAGES: gl.constexpr):
    """One warp: every k-step of this program's tiles, in order, into the ring (TMA zero fill past the
    edges): g's tile as two K halves ([128, 32] for dx; for dw [32, 64] per warpgroup) and the other
    operand's [192, 32] K halves in three [64, 32] boxes each (a TMA box side is a power of two)."""
    nbytes: gl.constexpr = (TILE_G + TILE_N) * 64 * 2
    num_n = gl.cdiv(NOUT, TILE_N)
    k_steps = gl.cdiv(K_SUM, 64)
    c = 0
    for tile in range(gl.program_id(0), gl.cdiv(R, TILE_G) * num_n, gl.num_programs(0)):
        g0 = (tile // num_n) * TILE_G
        n0 = (tile % num_n) * TILE_N
        for kk in range(k_steps):
            s = c % STAGES
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            for h in gl.static_range(2):
                k0 = kk * 64 + h * KH
                if FORM == 0:  # g [T, N]: rows g0.. are tokens, K = features
                    async_load(g_desc, [g0, k0], ready.index(s), g_ring.index(2 * s + h))
                else:  # K = tokens, rows g0.. are features: one box per warpgroup
                    async_load(g_desc, [k0, g0], ready.index(s), g_ring.index(4 * s + 2 * h))
                    async_load(g_desc, [k0, g0 + HALF], ready.index(s), g_ring.index(4 * s + 2 * h + 1))
                async_load(o_desc, [n0, k0], ready.index(s), o_ring.index(2 * s + h))
            c += 1


# --------------------------------------------------------------------------------------------------
# the A operand: RoPE backward + quantize-dequantize of one k-step of g
# --------------------------------------------------------------------------------------------------
@gluon.jit
def _factors(amax_bits, LO: gl.constexpr, HI: gl.constexpr):
    """(multiplier 2^(127 - e), factor 2^(e - 127), unsafe) of each block's rceil scale byte e from its
    amax bits (NaN allowed): mla_q_prepass._block_factors in Gluon."""
    amax = amax_bits.to(gl.float32, bitcast=True)
    p = (amax * E4M3_INV_MAX).to(gl.int32, bitcast=True) & F32_ABS
    e = (gl.minimum(p, 0x7F000000) + 0x007FFFFF) >> 23
    e = gl.where(p <= 0x00400000, 0, e)
    e = gl.where(p > 0x7F800000, 255, e)
    s_inv = ((254 - e) << 23).to(gl.float32, bitcast=True)
    scale = (e << 23).to(gl.float32, bitcast=True)
    tiny_code = amax * s_inv > 0.0009765625  # 2^-10: the block's largest code is nonzero
    return s_inv, scale, (e > HI) | ((e < LO) & tiny_code)


@gluon.jit
def _qdq(v, s_inv, scale):
    """bf16 of RN_e4m3(v * s_inv) * scale (hardware RN-even, saturating conversions)."""
    return ((v * s_inv).to(gl.float8e4nv).to(gl.float32) * scale).to(gl.bfloat16)


@gluon.jit
def _abs_bits(v):
    return v.to(gl.int32, bitcast=True) & F32_ABS


@gluon.jit
def _qdq_rows(lo, hi, LO: gl.constexpr, HI: gl.constexpr):
    """Each half one quantization block per row: (bf16 lo, bf16 hi, unsafe rows)."""
    ia, fa, ua = _factors(gl.max(_abs_bits(lo), axis=1), LO, HI)
    ib, fb, ub = _factors(gl.max(_abs_bits(hi), axis=1), LO, HI)
    return (_qdq(lo, gl.expand_dims(ia, 1), gl.expand_dims(fa, 1)), _qdq(hi, gl.expand_dims(ib, 1), gl.expand_dims(fb, 1)),
            ua | ub)


@gluon.jit
def _qdq_rows_paired(lo, hi, j, LO: gl.constexpr, HI: gl.constexpr):
    """dx's RoPE chunk, positions j / 32 + j holding features 2j / 2j + 1: block A is positions 0..15 of
    both halves (features 0..31), block B positions 16..31: (bf16 lo, bf16 hi, unsafe rows)."""
    first = j < 16
    ma = gl.maximum(gl.max(gl.where(first, _abs_bits(lo), 0), axis=1),
                    gl.max(gl.where(first, _abs_bits(hi), 0), axis=1))
    mb = gl.maximum(gl.max(gl.where(first, 0, _abs_bits(lo)), axis=1),
                    gl.max(gl.where(first, 0, _abs_bits(hi)), axis=1))
    ia, fa, ua = _factors(ma, LO, HI)
    ib, fb, ub = _factors(mb, LO, HI)
    s_inv = gl.where(first, gl.expand_dims(ia, 1), gl.expand_dims(ib, 1))
    scale = gl.where(first, gl.expand_dims(fa, 1), gl.expand_dims(fb, 1))
    return _qdq(lo, s_inv, scale), _qdq(hi, s_inv, scale), ua | ub


@gluon.jit
def _prep_dx(g_lo, g_hi, pe, t0, T, cos_ptr, sin_ptr, stride_cos, stride_sin, bad,
             LO: gl.constexpr, HI: gl.constexpr):
    """A operand halves (bf16 [64, 32] each) of dx's k-step: 64 rows of tokens (from t0) of one 64-feature
    chunk, its RoPE backward when pe (positions j / 32 + j then hold features 2j / 2j + 1), quantized
    along the chunk in its two 32-feature blocks."""
    lo = g_lo.load(A_LAYOUT).to(gl.float32)
    hi = g_hi.load(A_LAYOUT).to(gl.float32)
    if pe:
        j = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, A_LAYOUT)), 0)
        rows = t0 + gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, A_LAYOUT)), 1)
        rows = gl.minimum(rows, T - 1)  # rows past T (TMA zero fill) read the last row's table
        c_row = cos_ptr + rows * stride_cos
        s_row = sin_ptr + rows * stride_sin
        # one pair of tables at a time (fewer registers live)
        ev = lo * gl.load(c_row + j).to(gl.float32) + hi * gl.load(s_row + (j + 32)).to(gl.float32)
        od = hi * gl.load(c_row + (j + 32)).to(gl.float32) - lo * gl.load(s_row + j).to(gl.float32)
        qlo, qhi, unsafe = _qdq_rows_paired(ev, od, j, LO, HI)
    else:
        qlo, qhi, unsafe = _qdq_rows(lo, hi, LO, HI)
    return qlo, qhi, bad | unsafe.to(gl.int32)


@gluon.jit
def _rope_dw_half(g_half, t0, T, cos_ptr, sin_ptr, stride_cos, stride_sin):
    """fp32 [64, 32] in the A-operand layout: the RoPE backward of one warpgroup's 64 RoPE features
    (rows; gL = rows 0..31, gR = rows 32..63) over 32 tokens (from t0), rows back in feature order."""
    g_l = (g_half.slice(0, 32, dim=0).load(PAIR_LAYOUT)).to(gl.float32)
    g_r = (g_half.slice(32, 32, dim=0).load(PAIR_LAYOUT)).to(gl.float32)
    j = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(1, PAIR_LAYOUT)), 1)
    toks = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, PAIR_LAYOUT)), 0)
    toks = gl.minimum(t0 + toks, T - 1)
    c_tok = cos_ptr + toks * stride_cos
    s_tok = sin_ptr + toks * stride_sin
    ev = g_l * gl.load(c_tok + j).to(gl.float32) + g_r * gl.load(s_tok + (j + 32)).to(gl.float32)
    od = g_r * gl.load(c_tok + (j + 32)).to(gl.float32) - g_l * gl.load(s_tok + j).to(gl.float32)
    pairs = gl.permute(gl.join(ev, od), (0, 2, 1))  # [32, 2, 32]: row 2j + parity
    return gl.convert_layout(gl.reshape(pairs, [64, 32]), A_LAYOUT)


@gluon.jit
def _qdq_half(v, LO: gl.constexpr, HI: gl.constexpr):
    """One quantization block per row of v [64, 32]: (bf16, unsafe rows)."""
    s_inv, scale, unsafe = _factors(gl.max(_abs_bits(v), axis=1), LO, HI)
    return _qdq(v, gl.expand_dims(s_inv, 1), gl.expand_dims(scale, 1)), unsafe


@gluon.jit
def _dw_half(g_half, pe, t0, T, cos_ptr, sin_ptr, stride_cos, stride_sin, LO: gl.constexpr, HI: gl.constexpr):
    if pe:
        v = _rope_dw_half(g_half, t0, T, cos_ptr, sin_ptr, stride_cos, stride_sin)
    else:
        v = g_half.load(A_LAYOUT).to(gl.float32)
    return _qdq_half(v, LO, HI)


@gluon.jit
def _prep_dw(g_lo, g_hi, pe, t0, T, cos_ptr, sin_ptr, stride_cos, stride_sin, bad,
             LO: gl.constexpr, HI: gl.constexpr):
    """A operand halves of dw's k-step: 64 feature rows by 64 tokens (from t0); each half's 32 tokens of
    a feature are one quantization block. One half's fp32 values live at a time."""
    qlo, ulo = _dw_half(g_lo, pe, t0, T, cos_ptr, sin_ptr, stride_cos, stride_sin, LO, HI)
    qhi, uhi = _dw_half(g_hi, pe, t0 + 32, T, cos_ptr, sin_ptr, stride_cos, stride_sin, LO, HI)
    return qlo, qhi, bad | (ulo | uhi).to(gl.int32)


@gluon.jit
def _prep(FORM: gl.constexpr, CID: gl.constexpr, g_ring, slot, kk, g0, T, cos_ptr, sin_ptr, stride_cos,
          stride_sin, bad, LO: gl.constexpr, HI: gl.constexpr):
    """This warpgroup's A operand halves for k-step kk of the tile at g row g0 (ring slot `slot`)."""
    if FORM == 0:
        g_lo = g_ring.index(2 * slot).slice(CID * HALF, HALF, dim=0)
        g_hi = g_ring.index(2 * slot + 1).slice(CID * HALF, HALF, dim=0)
        return _prep_dx(g_lo, g_hi, kk % 3 == 2, g0 + CID * HALF, T, cos_ptr, sin_ptr, stride_cos, stride_sin,
                        bad, LO, HI)
    else:
        g_lo = g_ring.index(4 * slot + CID).permute((1, 0))
        g_hi = g_ring.index(4 * slot + 2 + CID).permute((1, 0))
        pe = ((g0 + CID * HALF) // 64) % 3 == 2
        return _prep_dw(g_lo, g_hi, pe, kk * 64, T, cos_ptr, sin_ptr, stride_cos, stride_sin, bad, LO, HI)


@gluon.jit
def _mma(FORM: gl.constexpr, qlo, qhi, o_ring, slot, acc):
    """Both K halves' MMAs of one step (the other operand K-major: [TILE_N, 32] tiles as B [32, TILE_N])."""
    acc = warpgroup_mma(qlo, o_ring.index(2 * slot).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma(qhi, o_ring.index(2 * slot + 1).permute((1, 0)), acc, is_async=True)


# --------------------------------------------------------------------------------------------------
# consumers
# --------------------------------------------------------------------------------------------------
@gluon.jit
def _mainloop(FORM: gl.constexpr, CID: gl.constexpr, g_ring, o_ring, ready, empty, c, g0, K_SUM, T,
              cos_ptr, sin_ptr, stride_cos, stride_sin, bad,
              LO: gl.constexpr, HI: gl.constexpr, STAGES: gl.constexpr, ODD_STEPS: gl.constexpr):
    """One tile's [64, TILE_N] fp32 accumulator for warpgroup CID from ring step c on; returns (acc, bad,
    c past the tile). Two A register sets (a, b) used alternately: a set is rewritten only after the
    wait that retires the MMAs reading it (two wgmma groups a step)."""
    k_steps = gl.cdiv(K_SUM, 64)
    acc = gl.zeros([HALF, TILE_N], gl.float32, ACC_LAYOUT)
    if ODD_STEPS:
        first = 1
        s = c % STAGES
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        b_lo, b_hi, bad = _prep(FORM, CID, g_ring, s, 0, g0, T, cos_ptr, sin_ptr, stride_cos, stride_sin, bad, LO, HI)
        acc = _mma(FORM, b_lo, b_hi, o_ring, s, acc)
        acc, b_lo, b_hi = warpgroup_mma_wait(num_outstanding=2, deps=(acc, b_lo, b_hi))
        a_lo = b_lo
        a_hi = b_hi
    else:
        first = 2
        s = c % STAGES
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        a_lo, a_hi, bad = _prep(FORM, CID, g_ring, s, 0, g0, T, cos_ptr, sin_ptr, stride_cos, stride_sin, bad, LO, HI)
        acc = _mma(FORM, a_lo, a_hi, o_ring, s, acc)
        acc, a_lo, a_hi = warpgroup_mma_wait(num_outstanding=2, deps=(acc, a_lo, a_hi))
        s1 = (c + 1) % STAGES
        mbarrier.wait(ready.index(s1), ((c + 1) // STAGES) & 1)
        b_lo, b_hi, bad = _prep(FORM, CID, g_ring, s1, 1, g0, T, cos_ptr, sin_ptr, stride_cos, stride_sin, bad, LO, HI)
        acc = _mma(FORM, b_lo, b_hi, o_ring, s1, acc)
        acc, a_lo, a_hi = warpgroup_mma_wait(num_outstanding=2, deps=(acc, a_lo, a_hi))
        mbarrier.arrive(empty.index(s))
    for kk in range(first, k_steps, 2):
        s = (c + kk) % STAGES
        mbarrier.wait(ready.index(s), ((c + kk) // STAGES) & 1)
        a_lo, a_hi, bad = _prep(FORM, CID, g_ring, s, kk, g0, T, cos_ptr, sin_ptr, stride_cos, stride_sin, bad, LO, HI)
        acc = _mma(FORM, a_lo, a_hi, o_ring, s, acc)
        acc, b_lo, b_hi = warpgroup_mma_wait(num_outstanding=2, deps=(acc, b_lo, b_hi))
        mbarrier.arrive(empty.index((c + kk - 1) % STAGES))
        s = (c + kk + 1) % STAGES
        mbarrier.wait(ready.index(s), ((c + kk + 1) // STAGES) & 1)
        b_lo, b_hi, bad = _prep(FORM, CID, g_ring, s, kk + 1, g0, T, cos_ptr, sin_ptr, stride_cos, stride_sin, bad,
                                LO, HI)
        acc = _mma(FORM, b_lo, b_hi, o_ring, s, acc)
        acc, a_lo, a_hi = warpgroup_mma_wait(num_outstanding=2, deps=(acc, a_lo, a_hi))
        mbarrier.arrive(empty.index((c + kk) % STAGES))
    acc, a_lo, a_hi, b_lo, b_hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_lo, a_hi, b_lo, b_hi))
    mbarrier.arrive(empty.index((c + k_steps - 1) % STAGES))
    return acc, bad, c + k_steps


@gluon.jit
def _consumer(FORM: gl.constexpr, CID: gl.constexpr, g_ring, o_ring, ready, empty, epi, out_desc, cos_ptr, sin_ptr,
              flag_ptr, R, K_SUM, NOUT, T, stride_cos, stride_sin,
              LO: gl.constexpr, HI: gl.constexpr, STAGES: gl.constexpr, ODD_STEPS: gl.constexpr):
    """Warpgroup CID: rows CID * 64 .. + 63 of every tile, stored by TMA as bf16; raises *flag_ptr for an
    unsafe quantization block or an output not finite in bf16."""
    num_n = gl.cdiv(NOUT, TILE_N)
    bad = gl.zeros([HALF], gl.int32, gl.SliceLayout(1, A_LAYOUT))
    amax = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, ACC_LAYOUT))
    c = 0
    for tile in range(gl.program_id(0), gl.cdiv(R, TILE_G) * num_n, gl.num_programs(0)):
        g0 = (tile // num_n) * TILE_G
        n0 = (tile % num_n) * TILE_N
        acc, bad, c = _mainloop(FORM, CID, g_ring, o_ring, ready, empty, c, g0, K_SUM, T, cos_ptr, sin_ptr,
                                stride_cos, stride_sin, bad, LO, HI, STAGES, ODD_STEPS)
        # |acc| >= the bf16 overflow threshold, or NaN (a NaN compares false: counted through the sum)
        big = gl.max(gl.where(gl.abs(acc) < BF16_ROUNDS_TO_INF, 0.0, 1.0), axis=1)
        amax = gl.maximum(amax, big)
        tma.store_wait(0)  # this warpgroup's previous tile has left its buffer
        epi.store(acc.to(gl.bfloat16))
        fence_async_shared()
        for r in gl.static_range(TILE_N // 64):
            async_store(out_desc, [g0 + CID * HALF, n0 + r * 64], epi.slice(r * 64, 64, dim=1))
    tma.store_wait(0)
    raise_flag = (gl.max(bad, axis=0) != 0) | (gl.max(amax, axis=0) != 0.0)
    gl.store(flag_ptr, 1, mask=raise_flag)


@gluon.jit
def _mla_q_grad_gemm_kernel(g_desc, o_desc, out_desc, cos_ptr, sin_ptr, flag_ptr, R, K_SUM, NOUT, T,
                            stride_cos, stride_sin,
                            FORM: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr, STAGES: gl.constexpr,
                            ODD_STEPS: gl.constexpr):
    """Persistent: a TMA producer warp and two consumer warpgroups sharing each TILE_G x TILE_N tile."""
    if FORM == 0:  # g: [rows, K half] per half
        g_ring = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, TILE_G, KH], g_desc.layout)
    else:  # g: [K half, 64 rows] per half and warpgroup
        g_ring = gl.allocate_shared_memory(gl.bfloat16, [4 * STAGES, KH, HALF], g_desc.layout)
    o_ring = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, TILE_N, KH], o_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    epi_a = gl.allocate_shared_memory(gl.bfloat16, [HALF, TILE_N], out_desc.layout)
    epi_b = gl.allocate_shared_memory(gl.bfloat16, [HALF, TILE_N], out_desc.layout)
    gl.warp_specialize([
        (_consumer, (FORM, 0, g_ring, o_ring, ready, empty, epi_a, out_desc, cos_ptr, sin_ptr, flag_ptr, R, K_SUM,
                     NOUT, T, stride_cos, stride_sin, LO, HI, STAGES, ODD_STEPS)),
        (_consumer, (FORM, 1, g_ring, o_ring, ready, empty, epi_b, out_desc, cos_ptr, sin_ptr, flag_ptr, R, K_SUM,
                     NOUT, T, stride_cos, stride_sin, LO, HI, STAGES, ODD_STEPS)),
        (_producer, (g_desc, o_desc, g_ring, o_ring, ready, empty, R, K_SUM, NOUT, FORM, STAGES)),
    ], [4, 1], [232, 40])


# --------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------
def _desc(t, block):
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def launch(form: int, g2: torch.Tensor, other: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           out: torch.Tensor, flag: torch.Tensor, safe_bytes, config=None) -> None:
    """form FORM_DX: out [T, K] = Q_rows(g) @ other^T with other [K, N] (permuted_weight's order);
    form FORM_DW: out [N, K] = Q_cols(g)^T @ other^T with other [K, T] (x's dequantization, K-major).
    g2 [T, N] bf16; cos / sin [T, 64] (unit last stride); flag int32 [1], raised (never cleared) when
    the caller's exact path must recompute."""
    cfg = dict(CONFIGS[0] if config is None else config)
    tokens, n = g2.shape
    if form == FORM_DX:
        rows, k_sum = tokens, n
        g_desc = _desc(g2, [TILE_G_ROWS, K_HALF])
    elif form == FORM_DW:
        rows, k_sum = n, tokens
        g_desc = _desc(g2, [K_HALF, 64])
    else:
        raise ValueError(f"form: expected FORM_DX or FORM_DW, got {form!r}")
    nout = other.shape[0]
    o_desc = _desc(other, [TILE_N_COLS, K_HALF])
    out_desc = _desc(out, [64, 64])
    tiles = cdiv(rows, TILE_G_ROWS) * cdiv(nout, TILE_N_COLS)
    sms = torch.cuda.get_device_properties(out.device).multi_processor_count
    _mla_q_grad_gemm_kernel[(min(sms, tiles),)](
        g_desc, o_desc, out_desc, cos, sin, flag, rows, k_sum, nout, tokens, cos.stride(0), sin.stride(0),
        FORM=form, LO=int(safe_bytes[0]), HI=int(safe_bytes[1]), STAGES=cfg["STAGES"],
        ODD_STEPS=int(cdiv(k_sum, 64) % 2 == 1), num_warps=NUM_WARPS, enable_fp_fusion=False)


settle_cache_keys(globals())  # before a compile-ahead thread can hash these kernels (_common)
