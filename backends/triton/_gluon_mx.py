"""The sm90 widened-operand main loop of the MXFP8 GEMM's "gluon" route (gemm_gluon.py).

It computes out^T tiles, TILE_B rows of b (features: the weight) by TILE_A rows of a (tokens): only
wgmma's A operand can come from registers, and the operand held as e4m3 / e5m2 codes is the weight.
A program is persistent (one per SM) with one TMA producer warp (`producer`) filling a ring of STAGES
slots, each a [TILE_A, BLOCK_K] bf16 tile of a and a [TILE_B, BLOCK_K] tile of b's codes, and two
consumer warpgroups, each running `mainloop` over its 64 of the tile's TILE_B b rows: the codes are
read from shared memory in the A-operand register layout, widened to bf16 (exact) and multiplied by
their block's scale, a bf16 power of two (exact for scale bytes in [LO, HI]; others raise the guard),
so the MMA multiplies exactly dq(b) by a. Step k's codes are widened while step k - 1's MMA runs,
through two A register sets used alternately in a loop unrolled by two (a loop-carried swap moved
registers an MMA in flight reads, and ptxas serialized the wgmma; so did a third set with wait(2):
ptxas C7513). The widening is cvt e4m3x2 -> f16x2, two HADD2.F32 and one f32x2 -> bf16x2 pack a pair
of codes, then a bf16 multiply by the block's factor (Triton's own f16 -> bf16 ran ~7 % slower on the
H200; gemm_gluon.py has the measurements).
"""
from __future__ import annotations

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from ._gluon_compat import async_load, tile_coords

TILE_A = gl.constexpr(256)  # output tile: TILE_A rows of a (tokens) x TILE_B rows of b (features)
TILE_B = gl.constexpr(128)
HALF = gl.constexpr(64)  # b rows per consumer warpgroup (one wgmma M)
TILE_A_ROWS, TILE_B_ROWS = 256, 128  # the same, for the host
# the consumer's accumulator (out^T [64, TILE_A], fp32) and its widened A operand ([64, BLOCK_K] bf16)
ACC_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
A_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=ACC_LAYOUT.value, k_width=2))
# the least fp32 that rounds (RN-even) to Inf in bf16: bits 0x7F7F8000, halfway above bf16's largest
BF16_ROUNDS_TO_INF = gl.constexpr(float.fromhex("0x1.ffp127"))


def checked_config(config, configs, what: str) -> dict:
    """config (None: configs[0]) as a dict with configs' keys and BLOCK_K 32 or 64, else ValueError."""
    cfg = dict(configs[0] if config is None else config)
    if set(cfg) != set(configs[0]):
        raise ValueError(f"config: {what} takes keys {sorted(configs[0])}, got {sorted(cfg)}")
    if cfg["BLOCK_K"] not in (32, 64):
        raise ValueError(f"config: BLOCK_K must be 32 or 64, got {cfg['BLOCK_K']}")
    return cfg


@gluon.jit
def producer(a_desc, b_desc, a_ring, b_ring, ready, empty, M, N, K,
             BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """One warp: TMA loads of every k-step of this program's tiles, in tile order, into the ring
    (zero fill past M, N and K)."""
    nbytes: gl.constexpr = (TILE_A * 2 + TILE_B) * BLOCK_K
    num_m = gl.cdiv(M, TILE_A)
    num_n = gl.cdiv(N, TILE_B)
    k_steps = gl.cdiv(K, BLOCK_K)
    c = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        for kk in range(k_steps):
            s = c % STAGES
            # a fresh barrier counts as having completed the phase before its first: parity 1 passes
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            async_load(a_desc, [pid_m * TILE_A, kk * BLOCK_K], ready.index(s), a_ring.index(s))
            async_load(b_desc, [pid_n * TILE_B, kk * BLOCK_K], ready.index(s), b_ring.index(s))
            c += 1


@gluon.jit
def scale_row_ptrs(scale_ptr, rows, stride_row, col_groups, SWIZZLED: gl.constexpr):
    """Pointers to S[rows, 0] in compact or swizzled (SEMANTICS 3 step 3) storage: the per-row part of the
    offset, computed once a tile (load_scales adds the K block's part)."""
    if SWIZZLED:
        return scale_ptr + ((rows // 128) * col_groups * 512 + (rows % 32) * 16 + ((rows % 128) // 32) * 4)
    else:
        return scale_ptr + rows * stride_row


@gluon.jit
def _scale_col(kb, stride_col, SWIZZLED: gl.constexpr):
    if SWIZZLED:
        return (kb // 4) * 512 + kb % 4
    else:
        return kb * stride_col


@gluon.jit
def load_scales(row_ptrs, row_ok, kk, KB, stride_col, BLOCK_K: gl.constexpr, SWIZZLED: gl.constexpr):
    """Scale bytes (int32) of the rows at k-step kk: one per row for BLOCK_K 32, two (first, second K block)
    for 64; past N or K they read as 127 (factor 1, in range; those codes are TMA zero fill)."""
    kb = kk * (BLOCK_K // 32)
    s0 = gl.load(row_ptrs + _scale_col(kb, stride_col, SWIZZLED), mask=row_ok & (kb < KB), other=127).to(gl.int32)
    if BLOCK_K == 64:
        s1 = gl.load(row_ptrs + _scale_col(kb + 1, stride_col, SWIZZLED), mask=row_ok & (kb + 1 < KB),
                     other=127).to(gl.int32)
    else:
        s1 = s0
    return s0, s1


@gluon.jit
def _widen(codes_smem, s0, s1, layout: gl.constexpr, BLOCK_K: gl.constexpr, IS_E5M2: gl.constexpr):
    """dq of a [64, BLOCK_K] code tile as bf16 in the wgmma A-operand layout: code widened (exact), times
    the bf16 factor 2^(s - 127) of its K block (exact for safe scale bytes; others raise the guard)."""
    codes = codes_smem.load(layout)
    # through fp16 and fp32 (exact for every e4m3 / e5m2 code, Inf and NaN included): Triton's direct
    # e5m2 -> bf16 conversion turned the NaN code into a finite value on the H200 (and Inf into 65536)
    if IS_E5M2:
        v = codes.to(gl.float8e5, bitcast=True).to(gl.float16).to(gl.float32).to(gl.bfloat16)
    else:
        v = codes.to(gl.float8e4nv, bitcast=True).to(gl.float16).to(gl.float32).to(gl.bfloat16)
    f0 = gl.expand_dims((s0 << 7).to(gl.int16).to(gl.bfloat16, bitcast=True), 1)
    if BLOCK_K == 64:
        f1 = gl.expand_dims((s1 << 7).to(gl.int16).to(gl.bfloat16, bitcast=True), 1)
        k_layout: gl.constexpr = gl.SliceLayout(0, layout)
        k = gl.expand_dims(gl.arange(0, BLOCK_K, layout=k_layout), 0)
        f = gl.where(k < 32, f0, f1)
    else:
        f = f0
    return v * f


@gluon.jit
def max_nan(x, y):
    return gl.maximum(x, y, propagate_nan=tl.PropagateNan.ALL)


@gluon.jit
def _unsafe(s0, s1, LO: gl.constexpr, HI: gl.constexpr):
    return (s0 < LO) | (s0 > HI) | (s1 < LO) | (s1 > HI)


@gluon.jit
def mainloop(CID: gl.constexpr, a_ring, b_ring, ready, empty, c, srow, sok, bad, K, stride_sc,
             SWIZZLED: gl.constexpr, IS_E5M2: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr,
             BLOCK_K: gl.constexpr, STAGES: gl.constexpr, ODD_STEPS: gl.constexpr):
    """One tile's main loop for consumer warpgroup CID: out^T [64, TILE_A] (fp32, the wgmma accumulator
    layout) of its 64 b rows (scale row pointers srow, in range sok) against the tile's TILE_A a rows,
    from ring slot c on. Returns (acc, bad | the rows' scale bytes outside [LO, HI], c past the tile)."""
    k_steps = gl.cdiv(K, BLOCK_K)
    KB = K // 32
    s0, s1 = load_scales(srow, sok, 0, KB, stride_sc, BLOCK_K, SWIZZLED)
    acc = gl.zeros([HALF, TILE_A], gl.float32, ACC_LAYOUT)
    # Steps two at a time, A operands alternating between w and w2 with no register copies: each step's
    # b codes are widened while the previous step's MMA runs, and an A register set is rewritten only
    # after the wait that retires the MMA reading it.
    # prologue: one step into w2 (odd step count) or two, into w then w2 (even), so that the pairs
    # below cover the rest and each starts with the MMA of w2 in flight
    if ODD_STEPS:
        first = 1
        mbarrier.wait(ready.index(c % STAGES), (c // STAGES) & 1)
        bad |= _unsafe(s0, s1, LO, HI)
        w2 = _widen(b_ring.index(c % STAGES).slice(CID * HALF, HALF, dim=0), s0, s1, A_LAYOUT, BLOCK_K, IS_E5M2)
        s0, s1 = load_scales(srow, sok, 1, KB, stride_sc, BLOCK_K, SWIZZLED)
        acc = warpgroup_mma(w2, a_ring.index(c % STAGES).permute((1, 0)), acc, is_async=True)
        # returns at once (one MMA in flight): acc back as a tensor, w2 kept live
        acc, w2 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, w2))
        w = w2
    else:
        first = 2
        mbarrier.wait(ready.index(c % STAGES), (c // STAGES) & 1)
        bad |= _unsafe(s0, s1, LO, HI)
        w = _widen(b_ring.index(c % STAGES).slice(CID * HALF, HALF, dim=0), s0, s1, A_LAYOUT, BLOCK_K, IS_E5M2)
        s0, s1 = load_scales(srow, sok, 1, KB, stride_sc, BLOCK_K, SWIZZLED)
        acc = warpgroup_mma(w, a_ring.index(c % STAGES).permute((1, 0)), acc, is_async=True)
        acc, w = warpgroup_mma_wait(num_outstanding=1, deps=(acc, w))
        s = (c + 1) % STAGES
        mbarrier.wait(ready.index(s), ((c + 1) // STAGES) & 1)
        bad |= _unsafe(s0, s1, LO, HI)
        w2 = _widen(b_ring.index(s).slice(CID * HALF, HALF, dim=0), s0, s1, A_LAYOUT, BLOCK_K, IS_E5M2)
        s0, s1 = load_scales(srow, sok, 2, KB, stride_sc, BLOCK_K, SWIZZLED)
        acc = warpgroup_mma(w2, a_ring.index(s).permute((1, 0)), acc, is_async=True)
        acc, w = warpgroup_mma_wait(num_outstanding=1, deps=(acc, w))
        mbarrier.arrive(empty.index(c % STAGES))
    for kk in range(first, k_steps, 2):
        s = (c + kk) % STAGES
        bad |= _unsafe(s0, s1, LO, HI)
        mbarrier.wait(ready.index(s), ((c + kk) // STAGES) & 1)
        w = _widen(b_ring.index(s).slice(CID * HALF, HALF, dim=0), s0, s1, A_LAYOUT, BLOCK_K, IS_E5M2)
        s0, s1 = load_scales(srow, sok, kk + 1, KB, stride_sc, BLOCK_K, SWIZZLED)
        acc = warpgroup_mma(w, a_ring.index(s).permute((1, 0)), acc, is_async=True)
        acc, w2 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, w2))
        mbarrier.arrive(empty.index((c + kk - 1) % STAGES))
        s = (c + kk + 1) % STAGES
        bad |= _unsafe(s0, s1, LO, HI)
        mbarrier.wait(ready.index(s), ((c + kk + 1) // STAGES) & 1)
        w2 = _widen(b_ring.index(s).slice(CID * HALF, HALF, dim=0), s0, s1, A_LAYOUT, BLOCK_K, IS_E5M2)
        s0, s1 = load_scales(srow, sok, kk + 2, KB, stride_sc, BLOCK_K, SWIZZLED)
        acc = warpgroup_mma(w2, a_ring.index(s).permute((1, 0)), acc, is_async=True)
        acc, w = warpgroup_mma_wait(num_outstanding=1, deps=(acc, w))
        mbarrier.arrive(empty.index((c + kk) % STAGES))
    acc, w, w2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w, w2))
    mbarrier.arrive(empty.index((c + k_steps - 1) % STAGES))
    return acc, bad, c + k_steps


@gluon.jit
def row_state(CID: gl.constexpr, b_scale_ptr, pid_n, N, stride_sr, col_groups, SWIZZLED: gl.constexpr):
    """(scale row pointers, in-range mask) of consumer CID's 64 b rows in b tile pid_n."""
    rows = pid_n * TILE_B + CID * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, A_LAYOUT))
    return scale_row_ptrs(b_scale_ptr, rows, stride_sr, col_groups, SWIZZLED), rows < N


@gluon.jit
def guard_state():
    """(bad, amax): the consumer's guard accumulators (b scale bytes outside [LO, HI]; NaN-propagating
    max |acc|, whose `not (amax < BF16_ROUNDS_TO_INF)` flags every output not finite in bf16)."""
    return (gl.zeros([HALF], gl.int32, gl.SliceLayout(1, A_LAYOUT)),
            gl.zeros([HALF], gl.float32, gl.SliceLayout(1, ACC_LAYOUT)))


@gluon.jit
def raise_guard(flag_ptr, bad, amax):
    """*flag_ptr = 1 where a scale byte was out of range or an output is not finite in bf16."""
    top = gl.reduce(amax, 0, max_nan)
    raise_flag = (gl.max(bad, axis=0) != 0) | (top != top) | (top >= BF16_ROUNDS_TO_INF)
    gl.store(flag_ptr, 1, mask=raise_flag)
