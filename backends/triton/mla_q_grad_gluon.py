"""The MXFP8 backward's two GEMMs with g's RoPE backward and MXFP8 quantize-dequantize inside the main
loop (sm90, Gluon): no pre-pass, and no quantized or dequantized copy of g is written.

    launch_pair(g2, w16p, x16t, cos, sin, dx, dw, flag, safe)  # both, one persistent launch
    # dx [T, K] = Q_rows(g) @ w_n   (sum over N);   dw [N, K] = Q_cols(g)^T @ x_t   (sum over T)
    launch(FORM_DX or FORM_DW, g2, other, cos, sin, out, flag, safe)  # one of them

g2 is the fused op's output gradient viewed [T, N = H * 192] (bf16, read as it is, by TMA). Each
k-step's g tile goes from shared memory into the wgmma A-operand registers and is quantized to e4m3
with its rceil block scale along the GEMM's contraction axis and dequantized again (exact in bf16 where
the guard stays down), so the MMA multiplies exactly the spec's g_row (dx) or g_col (dw) by the other
operand. A head's RoPE features are widened to fp32 and put through the mla RoPE backward first (fp32,
no FMA contraction: the pre-pass's rounding), then quantized through the hardware e4m3 conversions; the
other chunks (two thirds) are quantize-dequantized on their bf16 bits (_qdq_bits: an add and a subtract
of a per-value magic on packed pairs; BITS=0, a launch config key, takes the conversions for them too).
This is the spec's MXFP8 backward (spec/mla_q.py) with the products exact and the sum in fp32: the
contract of the two-GEMM route (mla_q's "dequantized"), whose pre-pass reads g once and writes two
bf16 copies (6 bytes an element; 0.18 ms of a 1.12 ms backward at T = 4096 on the H200). The other operands come from mla_q_grad_operands.py: w16p [K, N]
(w's RoPE rows in this kernel's order, below) and x16t [K, T], both dequantized K-major.

Why g is the register operand: wgmma takes only A from registers, and the per-element work is paid
once per A element per 256-column output tile; as the B operand (in shared memory) it would be paid
per 128-row tile and need a second shared-memory pass. Measured (BENCHMARKS.md), that work is still
what sets the pace: the route is named only.

The RoPE pairs (a head's features 128 + j and 160 + j turn into its features 128 + 2j and 129 + 2j):
- dx (K = features): a k-step is one 64-feature chunk, loaded as two 32-feature halves, so feature j and
  j + 32 of the chunk sit in one thread at the same register index of the two halves. The rotated
  values stay there -- position j holds feature 2j, position 32 + j feature 2j + 1 -- and w's
  dequantized copy is written in that order, so the contraction pairs them right. The quantization
  blocks then are positions {0..15, 32..47} (features 0..31) and {16..31, 48..63}.
- dw (rows = features): a RoPE chunk is one warpgroup's 64 rows; rows j and j + 32 belong to different
  warps, so its two halves are loaded into one blocked layout (pairs in one thread), rotated,
  quantized, interleaved back to feature order and moved into the A-operand layout through shared
  memory (gl.convert_layout). The output keeps feature order.

Guards (the caller's gated exact path recomputes everything when *flag is raised): a quantization block
whose scale byte is outside BF16_SAFE_SCALE_BYTES over a nonzero code, or that holds NaN / Inf
(mla_q_prepass._block_factors' rule), gets a NaN factor, so its output row is NaN; the epilogue raises
the flag for every output not finite in bf16.

Kernel: persistent (one program per SM), its work items (dx and dw tiles of 128 g rows x 256 output
columns) listed per program by `schedule` (longest first, each to the least loaded program: dx alone is
192 tiles for 132 SMs at T = 4096). A TMA producer warp fills a ring of STAGES slots, each the two
32-wide K halves of a tile of g and of the other operand; two consumer warpgroups share each tile (64 g
rows each, 128 fp32 accumulator registers a thread), prepare step k's A operand while step k - 1's MMAs
run (two register sets used alternately, k-steps in pairs: an odd count gets one zero step) and store
their half of the tile by TMA. PROFILE (a launch config key) leaves the quantization (1) or the RoPE (2)
out, for timing only.

Why not a shared-memory A operand (a transform warpgroup preparing each k-step's A once per 128-row
tile into a ring that both consumers' wgmma read): measured on an H100 (BENCHMARKS.md), that form gave
the same bytes at 2.91-3.01x the two GEMMs against this one's 2.64-2.72x, and 1.37x against 1.14x with
no quantization or RoPE at all.

Scope: sm90, Triton 3.6 or 3.9 (_gluon_compat.py); g2 and the other operand with unit last stride and
16-byte aligned rows; T a multiple of 32; K (the output's width) a multiple of 8.
"""
from __future__ import annotations

import heapq

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._common import cdiv, settle_cache_keys
from ._gluon_codec import scale_byte
from ._gluon_compat import async_load, async_store, reinterpret, ring_barriers

FORM_DX, FORM_DW = 0, 1
TILE_G = gl.constexpr(128)  # g rows per output tile (tokens for dx, features for dw)
HALF = gl.constexpr(64)  # g rows per consumer warpgroup
TILE_N = gl.constexpr(256)  # output columns per tile
KH = gl.constexpr(32)  # one K half: one quantization block along the contraction
TILE_G_ROWS, TILE_N_COLS, K_HALF = 128, 256, 32
NUM_WARPS = 4
CONFIGS = (dict(STAGES=3),)
CONFIG_KEYS = {"STAGES", "PROFILE", "BITS"}  # PROFILE is timing only (wrong results); BITS=0: conversions

ACC_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
A_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=ACC_LAYOUT.value, k_width=2))
# dw's RoPE chunks: a [64, 32] tile wraps this [32, 32] layout twice along rows, so rows j and j + 32
# are one thread's
PAIR_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0]))
BF16_ROUNDS_TO_INF = gl.constexpr(float.fromhex("0x1.ffp127"))


# --------------------------------------------------------------------------------------------------
# producer
# --------------------------------------------------------------------------------------------------
@gluon.jit
def _tile(item, n_dx, num_n, N, T):
    """(form, first g row, first output column, k-steps) of a work item: ids below n_dx are dx tiles."""
    form = (item >= n_dx).to(gl.int32)
    t = gl.where(form == 0, item, item - n_dx)
    k_sum = gl.where(form == 0, N, T)
    # an even number of k-steps (the main loop takes them in pairs): an odd count gets one more, past K,
    # which TMA fills with zeros (quantized to zero codes under scale byte 0: nothing added, no guard)
    return form, (t // num_n) * TILE_G, (t % num_n) * TILE_N, ((gl.cdiv(k_sum, 64) + 1) // 2) * 2


@gluon.jit
def _load_step(c, form, g0, n0, kk, gx_desc, gw_desc, w_desc, x_desc, g_dx, g_dw, o_ring, ready, empty,
               STAGES: gl.constexpr):
    """Ring step c = k-step kk of the work item (form, g0, n0) of _tile, once its slot is free: g's tile
    as two K halves ([128, 32] for dx; for dw [32, 64] per warpgroup) and the other operand's [256, 32]
    K halves (TMA zero fill past the edges)."""
    nbytes: gl.constexpr = (TILE_G + TILE_N) * 64 * 2
    s = c % STAGES
    mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(s), nbytes)
    for h in gl.static_range(2):
        k0 = kk * 64 + h * KH
        if form == 0:  # g [T, N]: rows g0.. are tokens, K = features
            async_load(gx_desc, [g0, k0], ready.index(s), g_dx.index(2 * s + h))
            async_load(w_desc, [n0, k0], ready.index(s), o_ring.index(2 * s + h))
        else:  # K = tokens, rows g0.. are features: one box per warpgroup
            async_load(gw_desc, [k0, g0], ready.index(s), g_dw.index(4 * s + 2 * h))
            async_load(gw_desc, [k0, g0 + HALF], ready.index(s), g_dw.index(4 * s + 2 * h + 1))
            async_load(x_desc, [n0, k0], ready.index(s), o_ring.index(2 * s + h))


@gluon.jit
def _producer(gx_desc, gw_desc, w_desc, x_desc, g_dx, g_dw, o_ring, ready, empty, sched_ptr, sched_len, n_dx, N, T,
              KOUT, STAGES: gl.constexpr):
    """One warp: every k-step of this program's items, in order, into the ring (_load_step)."""
    num_n = gl.cdiv(KOUT, TILE_N)
    row = sched_ptr + gl.program_id(0) * sched_len
    c = 0
    for i in range(gl.load(row)):
        form, g0, n0, k_steps = _tile(gl.load(row + 1 + i), n_dx, num_n, N, T)
        for kk in range(k_steps):
            _load_step(c, form, g0, n0, kk, gx_desc, gw_desc, w_desc, x_desc, g_dx, g_dw, o_ring, ready, empty,
                       STAGES)
            c += 1


# --------------------------------------------------------------------------------------------------
# the A operand: RoPE backward + quantize-dequantize of one k-step of g
# --------------------------------------------------------------------------------------------------
@gluon.jit
def _block_scale(amax, LO: gl.constexpr, HI: gl.constexpr):
    """(rceil scale byte e, multiplier 2^(127 - e), unsafe) of each block from its amax: unsafe = e above
    HI (Inf included), or below LO with a nonzero code (the dequantization would not be exact in bf16)."""
    e = scale_byte(amax)
    s_inv = ((254 - e) << 23).to(gl.float32, bitcast=True)
    tiny_code = amax * s_inv > 0.0009765625  # 2^-10: the block's largest code is nonzero
    return e, s_inv, (e > HI) | ((e < LO) & tiny_code)


@gluon.jit
def _factors(amax, LO: gl.constexpr, HI: gl.constexpr):
    """(multiplier 2^(127 - e), factor 2^(e - 127)) of each block from its amax (|v| max; NaN in a block
    reaches the output through the NaN code of its own value) and rceil scale byte e (_gluon_codec).
    The factor of an unsafe block -- e above HI (Inf included), or below LO with a nonzero code -- is
    NaN: its dequantized values are NaN, so its output row is, and the epilogue's finiteness check
    raises the guard (no flag is carried through the main loop: reducing one across the warpgroup's
    warps took a barrier every step)."""
    e, s_inv, unsafe = _block_scale(amax, LO, HI)
    scale = gl.where(unsafe, 0x7FC00000, e << 23).to(gl.float32, bitcast=True)
    return s_inv, scale


@gluon.jit
def _bits_magic(amax, LO: gl.constexpr, HI: gl.constexpr):
    """int16 per block for _qdq_bits from its amax: the bf16 bits of M_min = 1.5 * 2^(e - 129), the
    rounding magic of the block's smallest e4m3 binade (e4m3's least normal 2^-6 under the scale 2^(e - 127),
    plus 4 binades: 1.5 * 2^4 times the subnormal step 2^-9); for a block whose codes are all zero (scale
    byte below LO, no nonzero code) 2^119 (every value rounds to 0); for an unsafe block NaN (0x7FC0), so
    its values and output row are NaN and the epilogue raises the guard. HI is capped at 242 here: above
    it a value's magic would overflow bf16's exponent (such blocks go the exact path like other unsafe ones)."""
    e, s_inv, unsafe = _block_scale(amax, LO, min(HI, 242))
    magic = gl.where(e < LO, 0x7B00, ((e - 6) << 7) + 0x240)
    return gl.where(unsafe, 0x7FC0, magic).to(gl.int16)


@gluon.jit
def _qdq_bits(vb, magic):
    """The bf16 quantize-dequantize of bf16 vb [R, 32] (one block a row; magic [R] from _bits_magic) on
    packed bf16 pairs, no fp32 and no conversion: v's e4m3 value under the block scale is v rounded
    (RN-even) to the grid step of max(binade of v, the block's least e4m3 binade) - 3 bits, i.e. to 4
    significant bits in e4m3's normal range and to the subnormal step below it. (v + M) - M does that in
    one bf16 rounding with M = 1.5 * 2^(max(exponent of v, the block's) + 4): v + M stays in M's binade
    (|v| < M / 12), where the bf16 step is the wanted one. rceil keeps |v| <= 448 * scale, so nothing
    saturates. Byte-equal to _qdq's conversions for safe blocks (checked exhaustively per binade on the
    CPU: tests/test_mla_q_grad_bits.py). NaN values stay NaN (their exponent's magic is negative as
    int16, so the block's is taken); Inf makes the block unsafe (scale byte 255)."""
    m = gl.broadcast(gl.expand_dims(magic, 1), vb.to(gl.int16, bitcast=True))[0]
    out = gl.inline_asm_elementwise(
        """{
        .reg .b32 m;
        and.b32 m, $1, 0x7F807F80;
        add.u32 m, m, 0x02400240;
        max.s16x2 m, m, $2;
        add.rn.bf16x2 $0, $1, m;
        sub.rn.bf16x2 $0, $0, m;
        }""",
        "=r,r,r", [vb.to(gl.int16, bitcast=True), m], dtype=gl.int16, is_pure=True, pack=2)
    return out.to(gl.bfloat16, bitcast=True)


@gluon.jit
def _qdq_half_bits(vb, LO: gl.constexpr, HI: gl.constexpr):
    """_qdq_half of bf16 vb [R, 32] through _qdq_bits (the block max from the widened values)."""
    return _qdq_bits(vb, _bits_magic(gl.max(gl.abs(vb.to(gl.float32)), axis=1), LO, HI))


@gluon.jit
def _qdq(v, s_inv, scale):
    """bf16 of RN_e4m3(v * s_inv) * scale (hardware RN-even, saturating conversions)."""
    return ((v * s_inv).to(gl.float8e4nv).to(gl.float32) * scale).to(gl.bfloat16)


@gluon.jit
def _qdq_rows_paired(lo, hi, j, LO: gl.constexpr, HI: gl.constexpr):
    """dx's RoPE chunk, positions j / 32 + j holding features 2j / 2j + 1: block A is positions 0..15 of
    both halves (features 0..31), block B positions 16..31: (bf16 lo, bf16 hi)."""
    first = j < 16
    ma = gl.maximum(gl.max(gl.where(first, gl.abs(lo), 0.0), axis=1),
                    gl.max(gl.where(first, gl.abs(hi), 0.0), axis=1))
    mb = gl.maximum(gl.max(gl.where(first, 0.0, gl.abs(lo)), axis=1),
                    gl.max(gl.where(first, 0.0, gl.abs(hi)), axis=1))
    ia, fa = _factors(ma, LO, HI)
    ib, fb = _factors(mb, LO, HI)
    s_inv = gl.where(first, gl.expand_dims(ia, 1), gl.expand_dims(ib, 1))
    scale = gl.where(first, gl.expand_dims(fa, 1), gl.expand_dims(fb, 1))
    return _qdq(lo, s_inv, scale), _qdq(hi, s_inv, scale)


@gluon.jit
def _prep_dx(g_lo, g_hi, pe, t0, T, cos_ptr, sin_ptr, stride_cos, stride_sin, LO: gl.constexpr, HI: gl.constexpr,
             BITS: gl.constexpr):
    """A operand halves (bf16 [64, 32] each) of dx's k-step: 64 rows of tokens (from t0) of one 64-feature
    chunk, its RoPE backward when pe (positions j / 32 + j then hold features 2j / 2j + 1), quantized
    along the chunk in its two 32-feature blocks."""
    if pe:
        lo = g_lo.load(A_LAYOUT).to(gl.float32)
        hi = g_hi.load(A_LAYOUT).to(gl.float32)
        j = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, A_LAYOUT)), 0)
        rows = t0 + gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, A_LAYOUT)), 1)
        rows = gl.minimum(rows, T - 1)  # rows past T (TMA zero fill) read the last row's table
        c_row = cos_ptr + rows * stride_cos
        s_row = sin_ptr + rows * stride_sin
        # one pair of tables at a time (fewer registers live)
        ev = lo * gl.load(c_row + j).to(gl.float32) + hi * gl.load(s_row + (j + 32)).to(gl.float32)
        od = hi * gl.load(c_row + (j + 32)).to(gl.float32) - lo * gl.load(s_row + j).to(gl.float32)
        qlo, qhi = _qdq_rows_paired(ev, od, j, LO, HI)
    elif BITS:
        qlo = _qdq_half_bits(g_lo.load(A_LAYOUT), LO, HI)
        qhi = _qdq_half_bits(g_hi.load(A_LAYOUT), LO, HI)
    else:
        qlo = _qdq_half(g_lo.load(A_LAYOUT).to(gl.float32), LO, HI)
        qhi = _qdq_half(g_hi.load(A_LAYOUT).to(gl.float32), LO, HI)
    return qlo, qhi


@gluon.jit
def _rope_dw_half(g_half, t0, T, cos_ptr, sin_ptr, stride_cos, stride_sin, LO: gl.constexpr, HI: gl.constexpr):
    """bf16 [64, 32] in the A-operand layout: one warpgroup's 64 RoPE feature rows (gL = rows 0..31, gR =
    rows 32..63) over 32 tokens (from t0) through the RoPE backward and the quantize-dequantize (one
    block per feature) in a layout holding each (j, j + 32) row pair in one thread, then interleaved back
    to feature order and moved to the A-operand layout as bf16 (through shared memory)."""
    g_l = g_half.slice(0, 32, dim=0).load(PAIR_LAYOUT).to(gl.float32)
    g_r = g_half.slice(32, 32, dim=0).load(PAIR_LAYOUT).to(gl.float32)
    j = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(1, PAIR_LAYOUT)), 1)
    toks = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, PAIR_LAYOUT)), 0)
    toks = gl.minimum(t0 + toks, T - 1)  # tokens past T (TMA zero fill) read the last row's table
    c_tok = cos_ptr + toks * stride_cos
    s_tok = sin_ptr + toks * stride_sin
    ev = g_l * gl.load(c_tok + j).to(gl.float32) + g_r * gl.load(s_tok + (j + 32)).to(gl.float32)
    qe = _qdq_half(ev, LO, HI)
    od = g_r * gl.load(c_tok + (j + 32)).to(gl.float32) - g_l * gl.load(s_tok + j).to(gl.float32)
    qo = _qdq_half(od, LO, HI)
    pairs = gl.permute(gl.join(qe, qo), (0, 2, 1))  # [32, 2, 32]: row 2j + parity
    return gl.convert_layout(gl.reshape(pairs, [64, 32]), A_LAYOUT)


@gluon.jit
def _qdq_half(v, LO: gl.constexpr, HI: gl.constexpr):
    """bf16 quantize-dequantize of v [R, 32], one block per row."""
    s_inv, scale = _factors(gl.max(gl.abs(v), axis=1), LO, HI)
    return _qdq(v, gl.expand_dims(s_inv, 1), gl.expand_dims(scale, 1))


@gluon.jit
def _dw_half(g_half, pe, t0, T, cos_ptr, sin_ptr, stride_cos, stride_sin, LO: gl.constexpr, HI: gl.constexpr,
             BITS: gl.constexpr):
    """bf16 A operand half of dw's k-step half."""
    if pe:
        q = _rope_dw_half(g_half, t0, T, cos_ptr, sin_ptr, stride_cos, stride_sin, LO, HI)
    elif BITS:
        q = _qdq_half_bits(g_half.load(A_LAYOUT), LO, HI)
    else:
        q = _qdq_half(g_half.load(A_LAYOUT).to(gl.float32), LO, HI)
    return q


@gluon.jit
def _prep_dw(g_lo, g_hi, pe, t0, T, cos_ptr, sin_ptr, stride_cos, stride_sin, LO: gl.constexpr, HI: gl.constexpr,
             BITS: gl.constexpr):
    """A operand halves of dw's k-step: 64 feature rows by 64 tokens (from t0); each half's 32 tokens of
    a feature are one quantization block. One half's fp32 values live at a time."""
    return (_dw_half(g_lo, pe, t0, T, cos_ptr, sin_ptr, stride_cos, stride_sin, LO, HI, BITS),
            _dw_half(g_hi, pe, t0 + 32, T, cos_ptr, sin_ptr, stride_cos, stride_sin, LO, HI, BITS))


@gluon.jit
def _prep(form, CID: gl.constexpr, g_dx, g_dw, slot, kk, g0, T, cos_ptr, sin_ptr, stride_cos, stride_sin,
          LO: gl.constexpr, HI: gl.constexpr, PROFILE: gl.constexpr, BITS: gl.constexpr):
    """This warpgroup's A operand halves for k-step kk of the item at g row g0 (ring slot `slot`).
    PROFILE (timing only, wrong results): 1 hands g's bf16 values to the MMA as they are, 2 quantizes
    without the RoPE backward."""
    if PROFILE == 1:
        if form == 0:
            qlo = g_dx.index(2 * slot).slice(CID * HALF, HALF, dim=0).load(A_LAYOUT)
            qhi = g_dx.index(2 * slot + 1).slice(CID * HALF, HALF, dim=0).load(A_LAYOUT)
        else:
            qlo = g_dw.index(4 * slot + CID).permute((1, 0)).load(A_LAYOUT)
            qhi = g_dw.index(4 * slot + 2 + CID).permute((1, 0)).load(A_LAYOUT)
        return qlo, qhi
    if form == 0:
        g_lo = g_dx.index(2 * slot).slice(CID * HALF, HALF, dim=0)
        g_hi = g_dx.index(2 * slot + 1).slice(CID * HALF, HALF, dim=0)
        qlo, qhi = _prep_dx(g_lo, g_hi, (kk % 3 == 2) & (PROFILE != 2), g0 + CID * HALF, T, cos_ptr, sin_ptr, stride_cos, stride_sin,
                            LO, HI, BITS)
    else:
        t_lo = g_dw.index(4 * slot + CID).permute((1, 0))
        t_hi = g_dw.index(4 * slot + 2 + CID).permute((1, 0))
        pe = (((g0 + CID * HALF) // 64) % 3 == 2) & (PROFILE != 2)
        qlo, qhi = _prep_dw(t_lo, t_hi, pe, kk * 64, T, cos_ptr, sin_ptr, stride_cos, stride_sin, LO, HI, BITS)
    return qlo, qhi


@gluon.jit
def _mma(qlo, qhi, o_ring, slot, acc):
    """Both K halves' MMAs of one step (the other operand K-major: [TILE_N, 32] tiles as B [32, TILE_N])."""
    acc = warpgroup_mma(qlo, o_ring.index(2 * slot).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma(qhi, o_ring.index(2 * slot + 1).permute((1, 0)), acc, is_async=True)


# --------------------------------------------------------------------------------------------------
# consumers
# --------------------------------------------------------------------------------------------------
@gluon.jit
def _mainloop(form, CID: gl.constexpr, g_dx, g_dw, o_ring, ready, empty, c, g0, k_steps, T,
              cos_ptr, sin_ptr, stride_cos, stride_sin, LO: gl.constexpr, HI: gl.constexpr, STAGES: gl.constexpr,
              PROFILE: gl.constexpr, BITS: gl.constexpr):
    """One tile's [64, TILE_N] fp32 accumulator for warpgroup CID from ring step c on; returns (acc, c past
    the tile). Two A register sets (a, b) used alternately: a set is rewritten only after the
    wait that retires the MMAs reading it (two wgmma groups a step). A runtime branch between an odd
    and an even prologue made ptxas serialize the wgmma (C7512, register resources), hence even counts."""
    acc = gl.zeros([HALF, TILE_N], gl.float32, ACC_LAYOUT)
    # prologue: steps 0 and 1 (k_steps is even: _tile), so each pair below starts with one MMA in flight
    s = c % STAGES
    mbarrier.wait(ready.index(s), (c // STAGES) & 1)
    a_lo, a_hi = _prep(form, CID, g_dx, g_dw, s, 0, g0, T, cos_ptr, sin_ptr, stride_cos, stride_sin, LO, HI, PROFILE, BITS)
    acc = _mma(a_lo, a_hi, o_ring, s, acc)
    acc, a_lo, a_hi = warpgroup_mma_wait(num_outstanding=2, deps=(acc, a_lo, a_hi))
    s1 = (c + 1) % STAGES
    mbarrier.wait(ready.index(s1), ((c + 1) // STAGES) & 1)
    b_lo, b_hi = _prep(form, CID, g_dx, g_dw, s1, 1, g0, T, cos_ptr, sin_ptr, stride_cos, stride_sin, LO, HI, PROFILE, BITS)
    acc = _mma(b_lo, b_hi, o_ring, s1, acc)
    acc, a_lo, a_hi = warpgroup_mma_wait(num_outstanding=2, deps=(acc, a_lo, a_hi))
    mbarrier.arrive(empty.index(s))
    for kk in range(2, k_steps, 2):
        s = (c + kk) % STAGES
        mbarrier.wait(ready.index(s), ((c + kk) // STAGES) & 1)
        a_lo, a_hi = _prep(form, CID, g_dx, g_dw, s, kk, g0, T, cos_ptr, sin_ptr, stride_cos, stride_sin, LO, HI, PROFILE, BITS)
        acc = _mma(a_lo, a_hi, o_ring, s, acc)
        acc, b_lo, b_hi = warpgroup_mma_wait(num_outstanding=2, deps=(acc, b_lo, b_hi))
        mbarrier.arrive(empty.index((c + kk - 1) % STAGES))
        s = (c + kk + 1) % STAGES
        mbarrier.wait(ready.index(s), ((c + kk + 1) // STAGES) & 1)
        b_lo, b_hi = _prep(form, CID, g_dx, g_dw, s, kk + 1, g0, T, cos_ptr, sin_ptr, stride_cos, stride_sin,
                                LO, HI, PROFILE, BITS)
        acc = _mma(b_lo, b_hi, o_ring, s, acc)
        acc, a_lo, a_hi = warpgroup_mma_wait(num_outstanding=2, deps=(acc, a_lo, a_hi))
        mbarrier.arrive(empty.index((c + kk) % STAGES))
    acc, a_lo, a_hi, b_lo, b_hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_lo, a_hi, b_lo, b_hi))
    mbarrier.arrive(empty.index((c + k_steps - 1) % STAGES))
    return acc, c + k_steps


@gluon.jit
def _consumer(CID: gl.constexpr, g_dx, g_dw, o_ring, ready, empty, epi, dx_desc, dw_desc, cos_ptr, sin_ptr, flag_ptr,
              sched_ptr, sched_len, n_dx, N, T, KOUT, stride_cos, stride_sin,
              LO: gl.constexpr, HI: gl.constexpr, STAGES: gl.constexpr, PROFILE: gl.constexpr, BITS: gl.constexpr):
    """Warpgroup CID: rows CID * 64 .. + 63 of every item's tile, stored by TMA as bf16; raises *flag_ptr
    for an output not finite in bf16 (an unsafe quantization block makes its rows NaN: _factors)."""
    num_n = gl.cdiv(KOUT, TILE_N)
    big = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, ACC_LAYOUT))
    row = sched_ptr + gl.program_id(0) * sched_len
    c = 0
    for i in range(gl.load(row)):
        form, g0, n0, k_steps = _tile(gl.load(row + 1 + i), n_dx, num_n, N, T)
        acc, c = _mainloop(form, CID, g_dx, g_dw, o_ring, ready, empty, c, g0, k_steps, T, cos_ptr, sin_ptr,
                           stride_cos, stride_sin, LO, HI, STAGES, PROFILE, BITS)
        # |acc| at or past the bf16 overflow threshold, or NaN (which compares false)
        big = gl.maximum(big, gl.max(gl.where(gl.abs(acc) < BF16_ROUNDS_TO_INF, 0.0, 1.0), axis=1))
        tma.store_wait(0)  # this warpgroup's previous tile has left its buffer
        epi.store(acc.to(gl.bfloat16))
        fence_async_shared()
        for r in gl.static_range(TILE_N // 64):
            if form == 0:
                async_store(dx_desc, [g0 + CID * HALF, n0 + r * 64], epi.slice(r * 64, 64, dim=1))
            else:
                async_store(dw_desc, [g0 + CID * HALF, n0 + r * 64], epi.slice(r * 64, 64, dim=1))
    tma.store_wait(0)
    raise_flag = gl.max(big, axis=0) != 0.0
    gl.store(flag_ptr, 1, mask=raise_flag)


@gluon.jit
def _mla_q_grad_gemm_kernel(gx_desc, gw_desc, w_desc, x_desc, dx_desc, dw_desc, sched_ptr, cos_ptr, sin_ptr, flag_ptr,
                            sched_len, n_dx, N, T, KOUT, stride_cos, stride_sin,
                            LO: gl.constexpr, HI: gl.constexpr, STAGES: gl.constexpr, PROFILE: gl.constexpr = 0,
                            BITS: gl.constexpr = 1):
    """Persistent: a TMA producer warp and two consumer warpgroups sharing each TILE_G x TILE_N tile of
    the items the schedule row of this program lists."""
    # g's ring, viewed per form: dw's [32, 64] boxes (128-byte swizzle), dx's [128, 32] (64-byte)
    g_dw = gl.allocate_shared_memory(gl.bfloat16, [4 * STAGES, KH, HALF], gw_desc.layout)
    g_dx = reinterpret(g_dw, gl.bfloat16, [2 * STAGES, TILE_G, KH], gx_desc.layout)
    o_ring = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, TILE_N, KH], w_desc.layout)
    ready, empty = ring_barriers(STAGES, 2)
    epi_a = gl.allocate_shared_memory(gl.bfloat16, [HALF, TILE_N], dx_desc.layout)
    epi_b = gl.allocate_shared_memory(gl.bfloat16, [HALF, TILE_N], dx_desc.layout)
    gl.warp_specialize([
        (_consumer, (0, g_dx, g_dw, o_ring, ready, empty, epi_a, dx_desc, dw_desc, cos_ptr, sin_ptr, flag_ptr,
                     sched_ptr, sched_len, n_dx, N, T, KOUT, stride_cos, stride_sin, LO, HI, STAGES, PROFILE, BITS)),
        (_consumer, (1, g_dx, g_dw, o_ring, ready, empty, epi_b, dx_desc, dw_desc, cos_ptr, sin_ptr, flag_ptr,
                     sched_ptr, sched_len, n_dx, N, T, KOUT, stride_cos, stride_sin, LO, HI, STAGES, PROFILE, BITS)),
        (_producer, (gx_desc, gw_desc, w_desc, x_desc, g_dx, g_dw, o_ring, ready, empty, sched_ptr, sched_len, n_dx,
                     N, T, KOUT, STAGES)),
    ], [4, 1], [232, 40])


# --------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------
def _desc(t, block):
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


_SCHEDULES: dict = {}


def schedule(n_dx: int, dx_steps: int, n_dw: int, dw_steps: int, programs: int, device) -> torch.Tensor:
    """int32 [programs, 1 + L]: row p = (count, item ids...) of program p. Longest items first, each to
    the least loaded program (ties: the lower index), so dx's long tiles and dw's short ones end within
    one short item of each other; cached per shape."""
    key = (n_dx, dx_steps, n_dw, dw_steps, programs, str(device))
    sched = _SCHEDULES.get(key)
    if sched is None:
        items = sorted([(dx_steps, i) for i in range(n_dx)] + [(dw_steps, n_dx + i) for i in range(n_dw)],
                       key=lambda it: (-it[0], it[1]))
        heap = [(0, p) for p in range(programs)]
        lists = [[] for _ in range(programs)]
        for steps, item in items:
            load, p = heapq.heappop(heap)
            lists[p].append(item)
            heapq.heappush(heap, (load + steps, p))
        width = 1 + max(len(lst) for lst in lists)
        rows = [[len(lst)] + lst + [0] * (width - 1 - len(lst)) for lst in lists]
        sched = torch.tensor(rows, dtype=torch.int32, device=device)
        _SCHEDULES[key] = sched
    return sched


def launch_pair(g2: torch.Tensor, w16p, x16t, cos: torch.Tensor, sin: torch.Tensor, dx, dw, flag: torch.Tensor,
                safe_bytes, config=None) -> None:
    """dx [T, K] = Q_rows(g) @ w16p^T with w16p [K, N] (permuted_weight's order) and dw [N, K] =
    Q_cols(g)^T @ x16t^T with x16t [K, T] (x's dequantization, K-major), in one persistent launch; either
    pair member may be None (that output is not computed). g2 [T, N] bf16; cos / sin [T, 64] (unit last
    stride); flag int32 [1], raised (never cleared) when the caller's exact path must recompute."""
    cfg = dict(CONFIGS[0] if config is None else config)
    if not set(cfg) <= CONFIG_KEYS or "STAGES" not in cfg:
        raise ValueError(f"config: expected STAGES and optionally PROFILE, BITS, got {sorted(cfg)}")
    tokens, n = g2.shape
    other = w16p if w16p is not None else x16t
    kout = other.shape[0]
    num_n = cdiv(kout, TILE_N_COLS)
    n_dx = cdiv(tokens, TILE_G_ROWS) * num_n if w16p is not None else 0
    n_dw = cdiv(n, TILE_G_ROWS) * num_n if x16t is not None else 0
    if not (n_dx or n_dw):
        return
    sms = torch.cuda.get_device_properties(g2.device).multi_processor_count
    programs = min(sms, n_dx + n_dw)
    sched = schedule(n_dx, cdiv(n, 64), n_dw, cdiv(tokens, 64), programs, g2.device)
    w_desc = _desc(w16p if w16p is not None else x16t, [TILE_N_COLS, K_HALF])
    x_desc = _desc(x16t if x16t is not None else w16p, [TILE_N_COLS, K_HALF])
    dx_desc = _desc(dx if dx is not None else dw, [64, 64])
    dw_desc = _desc(dw if dw is not None else dx, [64, 64])
    _mla_q_grad_gemm_kernel[(programs,)](
        _desc(g2, [TILE_G_ROWS, K_HALF]), _desc(g2, [K_HALF, 64]), w_desc, x_desc, dx_desc, dw_desc, sched,
        cos, sin, flag, sched.shape[1], n_dx, n, tokens, kout, cos.stride(0), sin.stride(0),
        LO=int(safe_bytes[0]), HI=int(safe_bytes[1]), STAGES=cfg["STAGES"], PROFILE=cfg.get("PROFILE", 0),
        BITS=cfg.get("BITS", 1),
        num_warps=NUM_WARPS,
        enable_fp_fusion=False)


def launch(form: int, g2, other, cos, sin, out, flag, safe_bytes, config=None) -> None:
    """One of launch_pair's GEMMs: form FORM_DX (other = w16p, out = dx) or FORM_DW (x16t, dw)."""
    if form == FORM_DX:
        launch_pair(g2, other, None, cos, sin, out, None, flag, safe_bytes, config)
    elif form == FORM_DW:
        launch_pair(g2, None, other, cos, sin, None, out, flag, safe_bytes, config)
    else:
        raise ValueError(f"form: expected FORM_DX or FORM_DW, got {form!r}")


settle_cache_keys(globals())  # before a compile-ahead thread can hash these kernels (_common)
