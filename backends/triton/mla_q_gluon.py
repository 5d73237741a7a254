"""The fused MLA Q forward (bf16 projection) as a Gluon kernel for sm90: the same arithmetic as
`_mla_q_fwd_tma_kernel` in mla_q.py, with the epilogue's data movement chosen by hand.

Why a second kernel: on the H200 the Triton kernel's main loop alone runs at 1.25-1.3x the cuBLAS
GEMM, and its epilogue adds as much again (tools/profile_cases.py mla_q_parts, BENCHMARKS.md). The
epilogue keeps q in the wgmma accumulator layout, where a 32-token column block spans 8 lanes and two
warps (shuffle trees plus a shared-memory round per block) and a 32-feature row block spans 4 lanes;
ncu shows the SM stalled on barriers 42 % of the time. Here each quantization reads the bf16-staged
tile back from shared memory in a layout where its blocks are thread-local:

- rowwise (32 features of one token): BlockedLayout size_per_thread [1, 32]; the amax, the scale
  byte and the 32 codes of a block live in one thread, no shuffles;
- columnwise (32 tokens of one feature): BlockedLayout size_per_thread [32, 2]; likewise;
- RoPE: eight threads per token row, each reading 4 interleaved pairs and computing their left and
  right outputs in registers (fp32, no FMA: launched with enable_fp_fusion=False); a warp holds four
  whole rows, so cos / sin load coalesced straight into that layout (earlier forms read them a row
  per thread -- ncu: L1-bound -- or staged them through shared memory), and a rowwise RoPE block's
  amax is three shuffles among the row's threads; the fp32 results go to shared memory for their
  columnwise pass;
- codes leave through shared memory and TMA stores (four boxes per tile, the no-RoPE two before the
  RoPE work), scales by plain stores.

Two kernels share that epilogue (_epilogue / _epilogue_staged, _epilogue_buffers):
- `gluon_ws`: persistent, one program per SM, warp-specialized: a TMA producer warp and two consumer
  warpgroups that take alternate 64-token tiles from one 4-stage ring, each with its own 48 KB of
  epilogue buffers, taking turns on the main loop so one's epilogue runs under the other's MMAs.
- `gluon_ws128` (the default for T % 128 == 0): the same on 128-token tiles, for L2 traffic: x and w
  reads per output drop from 64 to 40 bytes. A consumer holds both 64-row halves' accumulators (192
  fp32 registers a thread); the two consumers share one set of epilogue buffers (96 KB), taken in
  the same alternation as the main loop, which leaves a 3 x 40 KB ring (221.8 KB in all).

Measured (H200, 2026-11-30, BENCHMARKS.md): `gluon_ws128` 1.12x the cuBLAS GEMM at T = 4096 and
16384 (timed in turns with it), `gluon_ws` 1.22-1.24x, the Triton TMA kernel 1.70-1.76x.

Scope: bf16 x and w (an MXFP8 projection reaches them as its exact bf16 dequantization,
mla_q._launch_gluon_dequantized), T % 64 == 0, K % 8 == 0,
sm90 (wgmma), Triton 3.6 or 3.9 (the API differences behind _gluon_compat.py). Registered as the variants
gluon_ws and gluon_ws128 of mla_q.FORWARD_VARIANTS; the conformance suite compares its bytes
with spec and with the other variants.
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._common import cdiv, fast_launch, sm_count, settle_cache_keys
from ._gluon_compat import async_load, async_store, barrier, reinterpret, tile_coords, version_reasons
from ._gluon_codec import codes, scale_byte

BLOCK_M = 64
NUM_WARPS = 4
_HEAD, _NOPE, _ROPE = 192, 128, 64

@gluon.jit
def _epilogue(acc_nope, acc_rope, nope_smem, rope_smem, row_nope, row_rope, col_nope, col_rope, rope_f32,
              row_nope_desc, row_rope_desc, col_nope_desc, col_rope_desc, cos_ptr, sin_ptr, row_scale_ptr,
              col_scale_ptr, m0, n0, pid_m, head, H, stride_cos, stride_sin):
    """One [64 tokens, head] tile's epilogue: bf16 staging into the shared tiles, the two quantizations
    and RoPE each in its own layout, codes out by TMA (not waited for), scales by plain stores. The
    caller owns the buffers and waits for the TMA stores (tma.store_wait) before reusing them."""
    BM: gl.constexpr = 64
    NOPE: gl.constexpr = 128
    ROPE: gl.constexpr = 64
    HALF: gl.constexpr = 32
    HEAD: gl.constexpr = 192
    nope_smem.store(acc_nope.to(gl.bfloat16))
    rope_smem.store(acc_rope.to(gl.bfloat16))
    barrier()
    _epilogue_staged(nope_smem, rope_smem, row_nope, row_rope, col_nope, col_rope, rope_f32,
                     row_nope_desc, row_rope_desc, col_nope_desc, col_rope_desc, cos_ptr, sin_ptr, row_scale_ptr,
                     col_scale_ptr, m0, n0, pid_m, head, H, stride_cos, stride_sin)


@gluon.jit
def _epilogue_staged(nope_smem, rope_smem, row_nope, row_rope, col_nope, col_rope, rope_f32,
                     row_nope_desc, row_rope_desc, col_nope_desc, col_rope_desc, cos_ptr, sin_ptr, row_scale_ptr,
                     col_scale_ptr, m0, n0, pid_m, head, H, stride_cos, stride_sin):
    """_epilogue after the bf16 staging: q of the tile (64 tokens from m0, head's 192 features from n0)
    is in nope_smem / rope_smem, written and behind a barrier."""
    BM: gl.constexpr = 64
    NOPE: gl.constexpr = 128
    ROPE: gl.constexpr = 64
    HALF: gl.constexpr = 32
    HEAD: gl.constexpr = 192

    # cos / sin first: their global-load latency runs under the no-RoPE quantization below.
    # RoPE layout: 8 threads per token row, 4 pairs each, so a warp holds 4 whole rows: cos / sin load
    # straight into it coalesced (a warp instruction reads 4 rows x 128 contiguous bytes), and a rowwise
    # block's amax is 3 shuffles among the row's 8 threads
    pairs2d: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    pairs_l: gl.constexpr = gl.BlockedLayout([1, 4, 2], [4, 8, 1], [4, 1, 1], [2, 1, 0])
    half_l: gl.constexpr = gl.SliceLayout(2, pairs_l)
    rows_h = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, half_l))
    rows_t = rows_h.to(gl.int64)[:, None]
    k_h = gl.arange(0, HALF, layout=gl.SliceLayout(0, half_l))[None, :]
    cos_l = gl.load(cos_ptr + rows_t * stride_cos + k_h).to(gl.float32)
    cos_r = gl.load(cos_ptr + rows_t * stride_cos + (HALF + k_h)).to(gl.float32)
    sin_l = gl.load(sin_ptr + rows_t * stride_sin + k_h).to(gl.float32)
    sin_r = gl.load(sin_ptr + rows_t * stride_sin + (HALF + k_h)).to(gl.float32)
    # rowwise, no-RoPE blocks 0-3: [BM, 4, 32], one block per thread-row
    row2d: gl.constexpr = gl.BlockedLayout([1, 32], [8, 4], [4, 1], [1, 0])
    row_l: gl.constexpr = gl.BlockedLayout([1, 1, 32], [8, 4, 1], [4, 1, 1], [2, 1, 0])
    v = gl.convert_layout(gl.reshape(nope_smem.load(row2d), [BM, 4, 32]), row_l, assert_trivial=True).to(gl.float32)
    e = scale_byte(gl.max(gl.abs(v), axis=2))
    row_nope.store(gl.convert_layout(gl.reshape(codes(v, e[:, :, None]), [BM, NOPE]), row2d, assert_trivial=True))
    e_layout: gl.constexpr = gl.SliceLayout(2, row_l)
    rows_e = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, e_layout))
    blk_e = gl.arange(0, 4, layout=gl.SliceLayout(0, e_layout))
    gl.store(row_scale_ptr + (rows_e.to(gl.int64) * (H * 6) + head * 6)[:, None] + blk_e[None, :], e.to(gl.uint8))

    # columnwise: [2 blocks of 32 tokens, 32, features], one block per thread-column
    col2d: gl.constexpr = gl.BlockedLayout([32, 2], [1, 32], [2, 2], [1, 0])
    col_l: gl.constexpr = gl.BlockedLayout([1, 32, 2], [1, 1, 32], [2, 1, 2], [2, 1, 0])
    ce_layout: gl.constexpr = gl.SliceLayout(1, col_l)
    blocks = pid_m * 2 + gl.arange(0, 2, layout=gl.SliceLayout(1, ce_layout))
    feats = gl.arange(0, NOPE, layout=gl.SliceLayout(0, ce_layout))
    v = gl.convert_layout(gl.reshape(nope_smem.load(col2d), [2, 32, NOPE]), col_l, assert_trivial=True).to(gl.float32)
    e = scale_byte(gl.max(gl.abs(v), axis=1))
    col_nope.store(gl.convert_layout(gl.reshape(codes(v, e[:, None, :]), [BM, NOPE]), col2d, assert_trivial=True))
    gl.store(col_scale_ptr + blocks.to(gl.int64)[:, None] * (H * HEAD) + n0 + feats[None, :], e.to(gl.uint8))
    # the no-RoPE codes leave now (two TMA boxes), under the RoPE work below
    fence_async_shared()
    async_store(row_nope_desc, [m0, n0], row_nope)
    async_store(col_nope_desc, [m0, n0], col_nope)

    # rope_f32 aliases nope_smem, whose last reader is the columnwise pass above
    barrier()

    # RoPE (mla): 8 threads per token row, 4 pairs each (pairs_l above)
    staged = gl.convert_layout(gl.reshape(rope_smem.load(pairs2d), [BM, HALF, 2]), pairs_l, assert_trivial=True)
    even, odd = gl.split(staged.to(gl.float32))
    left = even * cos_l - odd * sin_l
    right = odd * cos_r + even * sin_r
    rope_f32.slice(0, HALF, dim=1).store(left)
    rope_f32.slice(HALF, HALF, dim=1).store(right)
    # rowwise blocks 4 (left) and 5 (right): amax over the row's 8 threads
    e_l = scale_byte(gl.max(gl.abs(left), axis=1))
    e_r = scale_byte(gl.max(gl.abs(right), axis=1))
    row_rope.slice(0, HALF, dim=1).store(codes(left, e_l[:, None]))
    row_rope.slice(HALF, HALF, dim=1).store(codes(right, e_r[:, None]))
    rs_ptrs = row_scale_ptr + rows_h.to(gl.int64) * (H * 6) + head * 6
    gl.store(rs_ptrs + 4, e_l.to(gl.uint8))
    gl.store(rs_ptrs + 5, e_r.to(gl.uint8))

    barrier()  # rope_f32 written by the RoPE rows, read by columns below

    colr2d: gl.constexpr = gl.BlockedLayout([32, 1], [1, 32], [2, 2], [1, 0])
    colr_l: gl.constexpr = gl.BlockedLayout([1, 32, 1], [1, 1, 32], [2, 1, 2], [2, 1, 0])
    cre_layout: gl.constexpr = gl.SliceLayout(1, colr_l)
    blocks_r = pid_m * 2 + gl.arange(0, 2, layout=gl.SliceLayout(1, cre_layout))
    feats_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, cre_layout))
    v = gl.convert_layout(gl.reshape(rope_f32.load(colr2d), [2, 32, ROPE]), colr_l, assert_trivial=True)
    e = scale_byte(gl.max(gl.abs(v), axis=1))
    col_rope.store(gl.convert_layout(gl.reshape(codes(v, e[:, None, :]), [BM, ROPE]), colr2d, assert_trivial=True))
    gl.store(col_scale_ptr + blocks_r.to(gl.int64)[:, None] * (H * HEAD) + (n0 + NOPE) + feats_r[None, :],
             e.to(gl.uint8))

    fence_async_shared()
    async_store(row_rope_desc, [m0, n0 + NOPE], row_rope)
    async_store(col_rope_desc, [m0, n0 + NOPE], col_rope)


@gluon.jit
def _epilogue_buffers(row_nope_desc, row_rope_desc, col_nope_desc, col_rope_desc):
    """One warpgroup's epilogue buffers (48 KB): the bf16 staging tiles, the four code boxes, and the
    fp32 RoPE tile, which reuses the no-RoPE staging tile's 16 KB (that tile is read for the last
    time before the RoPE part starts; the space buys the warp-specialized kernel a fourth ring stage).
    Shared layouts picked with gl.bank_conflicts for every store / load of _epilogue (all 0 but the
    rowwise load, 1): bf16 tiles XOR-swizzled in 16-byte vectors, the fp32 tile likewise."""
    BM: gl.constexpr = 64
    tile16: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    tile32: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
    nope_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, 128], tile16)
    return (nope_smem,
            gl.allocate_shared_memory(gl.bfloat16, [BM, 64], tile16),
            gl.allocate_shared_memory(gl.uint8, [BM, 128], row_nope_desc.layout),
            gl.allocate_shared_memory(gl.uint8, [BM, 64], row_rope_desc.layout),
            gl.allocate_shared_memory(gl.uint8, [BM, 128], col_nope_desc.layout),
            gl.allocate_shared_memory(gl.uint8, [BM, 64], col_rope_desc.layout),
            reinterpret(nope_smem, gl.float32, [BM, 64], tile32))


# --------------------------------------------------------------------------------------------------
# persistent, warp-specialized, 64-token tiles (the default where T % 128 != 0; H200-checked, 2026-11-30)
# --------------------------------------------------------------------------------------------------
@gluon.jit
def _ws_producer(x_desc, wn_desc, wr_desc, x_ring, xb_ring, wn_ring, wr_ring, ready, empty, T, K, H,
                 BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, TILE_M: gl.constexpr):
    """One warp: TMA loads of every k-step of this program's tiles, in tile order, into the ring. A
    128-token tile (TILE_M 128) loads its x rows as two 64-row boxes, x_ring and xb_ring."""
    NOPE: gl.constexpr = 128
    nbytes: gl.constexpr = (TILE_M + 192) * BLOCK_K * 2
    num_m = gl.cdiv(T, TILE_M)
    k_steps = gl.cdiv(K, BLOCK_K)
    c = 0
    for tile in range(gl.program_id(0), num_m * H, gl.num_programs(0)):
        pid_m, head = tile_coords(tile, num_m, H, GROUP_M)
        m0 = pid_m * TILE_M
        n0 = head * 192
        for kk in range(k_steps):
            s = c % STAGES
            # a fresh barrier counts as having completed the phase before its first: parity 1 passes
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            async_load(x_desc, [m0, kk * BLOCK_K], ready.index(s), x_ring.index(s))
            if TILE_M == 128:
                async_load(x_desc, [m0 + 64, kk * BLOCK_K], ready.index(s), xb_ring.index(s))
            async_load(wn_desc, [n0, kk * BLOCK_K], ready.index(s), wn_ring.index(s))
            async_load(wr_desc, [n0 + NOPE, kk * BLOCK_K], ready.index(s), wr_ring.index(s))
            c += 1


@gluon.jit
def _wait_turn(bars, CID: gl.constexpr, n):
    """Two warpgroups alternating through a pair of mbarriers (bars[c] is arrived when warpgroup c ends
    its part): warpgroup 0's n-th turn after warpgroup 1's (n-1)-th, warpgroup 1's n-th after 0's n-th."""
    if CID == 0:
        mbarrier.wait(bars.index(1), (n + 1) & 1, pred=n > 0)
    else:
        mbarrier.wait(bars.index(0), n & 1)


@gluon.jit
def _ws_consumer(CID: gl.constexpr, x_ring, wn_ring, wr_ring, ready, empty, done,
                 nope_smem, rope_smem, row_nope, row_rope, col_nope, col_rope, rope_f32,
                 row_nope_desc, row_rope_desc, col_nope_desc, col_rope_desc, cos_ptr, sin_ptr, row_scale_ptr,
                 col_scale_ptr, T, K, H, stride_cos, stride_sin,
                 BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """One warpgroup: this program's tiles CID, CID + 2, ... (the other warpgroup takes the rest), each
    a wgmma main loop over the ring's slots then the epilogue in this warpgroup's own buffers, so one
    warpgroup's epilogue runs under the other's main loop (ping-pong). The main loops take turns
    through `done` (one mbarrier per warpgroup, arrived when its main loop ends): besides ordering the
    tensor-core use, this keeps every wait on a ring slot within one phase of the slot's state -- a
    parity wait cannot tell phase n from n + 2, and a warpgroup starting its next tile early would
    wait for a fill STAGES x 2 ahead and pass on an old one."""
    BM: gl.constexpr = 64
    NOPE: gl.constexpr = 128
    ROPE: gl.constexpr = 64
    num_m = gl.cdiv(T, BM)
    k_steps = gl.cdiv(K, BLOCK_K)
    mma_nope: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NOPE, 16])
    mma_rope: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROPE, 16])
    nprog = gl.num_programs(0)
    j = CID  # this tile's position in the program's tile sequence (slot counter = j * k_steps + kk)
    n = 0  # this warpgroup's tile count
    for tile in range(gl.program_id(0) + CID * nprog, num_m * H, 2 * nprog):
        pid_m, head = tile_coords(tile, num_m, H, GROUP_M)
        _wait_turn(done, CID, n)
        acc_nope = gl.zeros([BM, NOPE], gl.float32, mma_nope)
        acc_rope = gl.zeros([BM, ROPE], gl.float32, mma_rope)
        c0 = j * k_steps
        for kk in range(k_steps):
            c = c0 + kk
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            acc_nope = warpgroup_mma(x_ring.index(s), wn_ring.index(s).permute((1, 0)), acc_nope, is_async=True)
            acc_rope = warpgroup_mma(x_ring.index(s), wr_ring.index(s).permute((1, 0)), acc_rope, is_async=True)
            acc_nope, acc_rope = warpgroup_mma_wait(num_outstanding=2, deps=(acc_nope, acc_rope))
            # step kk - 1's MMAs are done: its slot goes back to the producer
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=kk > 0)
        acc_nope, acc_rope = warpgroup_mma_wait(num_outstanding=0, deps=(acc_nope, acc_rope))
        mbarrier.arrive(empty.index((c0 + k_steps - 1) % STAGES))
        mbarrier.arrive(done.index(CID))
        tma.store_wait(0)  # the previous tile's code boxes have left this warpgroup's buffers
        _epilogue(acc_nope, acc_rope, nope_smem, rope_smem, row_nope, row_rope, col_nope, col_rope, rope_f32,
                  row_nope_desc, row_rope_desc, col_nope_desc, col_rope_desc, cos_ptr, sin_ptr, row_scale_ptr,
                  col_scale_ptr, pid_m * BM, head * 192, pid_m, head, H, stride_cos, stride_sin)
        j += 2
        n += 1
    tma.store_wait(0)


@gluon.jit
def _mla_q_fwd_gluon_ws_kernel(
    x_desc, wn_desc, wr_desc, cos_ptr, sin_ptr,
    row_nope_desc, row_rope_desc, col_nope_desc, col_rope_desc, row_scale_ptr, col_scale_ptr,
    T, K, H, stride_cos, stride_sin,
    BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
):
    """Persistent (one program per SM): a TMA producer warp and two consumer warpgroups that take
    alternate tiles, each with its own epilogue buffers (~64 KB each beside the ring)."""
    BM: gl.constexpr = 64
    NOPE: gl.constexpr = 128
    ROPE: gl.constexpr = 64
    x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BLOCK_K], x_desc.layout)
    wn_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, NOPE, BLOCK_K], wn_desc.layout)
    wr_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, ROPE, BLOCK_K], wr_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=1)
    for j in gl.static_range(2):
        mbarrier.init(done.index(j), count=1)
    bufs_a = _epilogue_buffers(row_nope_desc, row_rope_desc, col_nope_desc, col_rope_desc)
    bufs_b = _epilogue_buffers(row_nope_desc, row_rope_desc, col_nope_desc, col_rope_desc)
    rest = (row_nope_desc, row_rope_desc, col_nope_desc, col_rope_desc, cos_ptr, sin_ptr, row_scale_ptr,
            col_scale_ptr, T, K, H, stride_cos, stride_sin, BLOCK_K, STAGES, GROUP_M)
    ring = (x_ring, wn_ring, wr_ring, ready, empty, done)
    gl.warp_specialize([
        (_ws_consumer, (0,) + ring + bufs_a + rest),
        (_ws_consumer, (1,) + ring + bufs_b + rest),
        (_ws_producer, (x_desc, wn_desc, wr_desc, x_ring, x_ring, wn_ring, wr_ring, ready, empty, T, K, H,
                        BLOCK_K, STAGES, GROUP_M, 64)),
    ], [4, 1], [232, 40])


# --------------------------------------------------------------------------------------------------
# persistent, warp-specialized, 128-token tiles
# --------------------------------------------------------------------------------------------------
# Why: the 64-token kernels read 64 bytes of x and w from L2 per output element ((64 + 192) x K x 2 bytes
# for 64 x 192 outputs), and ncu of gluon_ws at K = 1536 put L2 at 69 % of its throughput (at ncu's locked
# clocks; the 64-token main loop alone ran 1.07-1.14x cuBLAS). A 128-token tile reads (128 + 192) x K x 2
# for 128 x 192 outputs: 40 bytes. Each consumer warpgroup holds the whole tile's accumulators (two
# 64-row halves: 192 fp32 registers a thread); the two warpgroups still take turns on the main loop,
# and share one set of epilogue buffers (96 KB), taken in the same alternation, so the ring keeps
# 3 x 40 KB.
@gluon.jit
def _ws128_consumer(CID: gl.constexpr, xa_ring, xb_ring, wn_ring, wr_ring, ready, empty, done, epi_done,
                    nope_a, rope_a, row_nope_a, row_rope_a, col_nope_a, col_rope_a, rope_f32_a,
                    nope_b, rope_b, row_nope_b, row_rope_b, col_nope_b, col_rope_b, rope_f32_b,
                    row_nope_desc, row_rope_desc, col_nope_desc, col_rope_desc, cos_ptr, sin_ptr, row_scale_ptr,
                    col_scale_ptr, T, K, H, stride_cos, stride_sin,
                    BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """One warpgroup: this program's 128-token tiles CID, CID + 2, ...: the main loop (four wgmma per
    k-step: rows 0-63 and 64-127 by the no-RoPE and RoPE columns) in turn with the other warpgroup
    (`done`, as _ws_consumer), then, in turn again (`epi_done`: the buffers are shared), both halves
    staged to bf16 and each half's epilogue. The turn waits have the same one-phase argument as
    _ws_consumer's: a warpgroup cannot be two epilogues ahead of the other."""
    TILE: gl.constexpr = 128
    NOPE: gl.constexpr = 128
    ROPE: gl.constexpr = 64
    num_m = gl.cdiv(T, TILE)
    k_steps = gl.cdiv(K, BLOCK_K)
    mma_nope: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NOPE, 16])
    mma_rope: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROPE, 16])
    nprog = gl.num_programs(0)
    j = CID
    n = 0
    for tile in range(gl.program_id(0) + CID * nprog, num_m * H, 2 * nprog):
        pid_m, head = tile_coords(tile, num_m, H, GROUP_M)
        _wait_turn(done, CID, n)
        acc_na = gl.zeros([64, NOPE], gl.float32, mma_nope)
        acc_ra = gl.zeros([64, ROPE], gl.float32, mma_rope)
        acc_nb = gl.zeros([64, NOPE], gl.float32, mma_nope)
        acc_rb = gl.zeros([64, ROPE], gl.float32, mma_rope)
        c0 = j * k_steps
        for kk in range(k_steps):
            c = c0 + kk
            s = c % STAGES
            mbarrier.wait(ready.index(s), (c // STAGES) & 1)
            wn = wn_ring.index(s).permute((1, 0))
            wr = wr_ring.index(s).permute((1, 0))
            acc_na = warpgroup_mma(xa_ring.index(s), wn, acc_na, is_async=True)
            acc_ra = warpgroup_mma(xa_ring.index(s), wr, acc_ra, is_async=True)
            acc_nb = warpgroup_mma(xb_ring.index(s), wn, acc_nb, is_async=True)
            acc_rb = warpgroup_mma(xb_ring.index(s), wr, acc_rb, is_async=True)
            acc_na, acc_ra, acc_nb, acc_rb = warpgroup_mma_wait(num_outstanding=4,
                                                                deps=(acc_na, acc_ra, acc_nb, acc_rb))
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=kk > 0)
        # the other warpgroup's turn starts as soon as the last MMAs are issued, so its first MMAs queue
        # behind them (no tensor-core gap for the drain and the barrier round trip); every fill its first
        # steps wait for is at most one phase old, as the last slots of this tile have all been waited on
        mbarrier.arrive(done.index(CID))
        acc_na, acc_ra, acc_nb, acc_rb = warpgroup_mma_wait(num_outstanding=0, deps=(acc_na, acc_ra, acc_nb, acc_rb))
        mbarrier.arrive(empty.index((c0 + k_steps - 1) % STAGES))
        # the shared epilogue buffers: after the other warpgroup's previous epilogue (its TMA stores drained)
        _wait_turn(epi_done, CID, n)
        nope_a.store(acc_na.to(gl.bfloat16))
        rope_a.store(acc_ra.to(gl.bfloat16))
        nope_b.store(acc_nb.to(gl.bfloat16))
        rope_b.store(acc_rb.to(gl.bfloat16))
        barrier()
        m0 = pid_m * TILE
        n0 = head * 192
        _epilogue_staged(nope_a, rope_a, row_nope_a, row_rope_a, col_nope_a, col_rope_a, rope_f32_a,
                         row_nope_desc, row_rope_desc, col_nope_desc, col_rope_desc, cos_ptr, sin_ptr, row_scale_ptr,
                         col_scale_ptr, m0, n0, pid_m * 2, head, H, stride_cos, stride_sin)
        _epilogue_staged(nope_b, rope_b, row_nope_b, row_rope_b, col_nope_b, col_rope_b, rope_f32_b,
                         row_nope_desc, row_rope_desc, col_nope_desc, col_rope_desc, cos_ptr, sin_ptr, row_scale_ptr,
                         col_scale_ptr, m0 + 64, n0, pid_m * 2 + 1, head, H, stride_cos, stride_sin)
        tma.store_wait(0)
        mbarrier.arrive(epi_done.index(CID))
        j += 2
        n += 1


@gluon.jit
def _mla_q_fwd_gluon_ws128_kernel(
    x_desc, wn_desc, wr_desc, cos_ptr, sin_ptr,
    row_nope_desc, row_rope_desc, col_nope_desc, col_rope_desc, row_scale_ptr, col_scale_ptr,
    T, K, H, stride_cos, stride_sin,
    BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
):
    """Persistent, one program per SM: a TMA producer warp and two consumer warpgroups taking alternate
    128-token tiles (T % 128 == 0)."""
    NOPE: gl.constexpr = 128
    ROPE: gl.constexpr = 64
    xa_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 64, BLOCK_K], x_desc.layout)
    xb_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 64, BLOCK_K], x_desc.layout)
    wn_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, NOPE, BLOCK_K], wn_desc.layout)
    wr_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, ROPE, BLOCK_K], wr_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    epi_done = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=1)
    for j in gl.static_range(2):
        mbarrier.init(done.index(j), count=1)
        mbarrier.init(epi_done.index(j), count=1)
    bufs_a = _epilogue_buffers(row_nope_desc, row_rope_desc, col_nope_desc, col_rope_desc)
    bufs_b = _epilogue_buffers(row_nope_desc, row_rope_desc, col_nope_desc, col_rope_desc)
    rest = (row_nope_desc, row_rope_desc, col_nope_desc, col_rope_desc, cos_ptr, sin_ptr, row_scale_ptr,
            col_scale_ptr, T, K, H, stride_cos, stride_sin, BLOCK_K, STAGES, GROUP_M)
    ring = (xa_ring, xb_ring, wn_ring, wr_ring, ready, empty, done, epi_done)
    gl.warp_specialize([
        (_ws128_consumer, (0,) + ring + bufs_a + bufs_b + rest),
        (_ws128_consumer, (1,) + ring + bufs_a + bufs_b + rest),
        (_ws_producer, (x_desc, wn_desc, wr_desc, xa_ring, xb_ring, wn_ring, wr_ring, ready, empty, T, K, H,
                        BLOCK_K, STAGES, GROUP_M, 128)),
    ], [4, 1], [232, 40])


# --------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------
# The warp-specialized kernel is one program per SM, so its ring alone hides the load latency (ncu, K 1536,
# 3 stages: the consumers' main loops waited on `ready` a third of the time): 4 stages of 64 or 8 of 32.
WS_CONFIGS = (dict(BLOCK_K=64, STAGES=4, GROUP_M=32), dict(BLOCK_K=32, STAGES=8, GROUP_M=32),
              dict(BLOCK_K=64, STAGES=4, GROUP_M=64))
# 128-token tiles: a ring stage is 40 KB at BLOCK_K 64 (3 fit beside the 96 KB of epilogue buffers).
# GROUP_M counts 128-token tiles: 16 keeps the same 2048 tokens of x in L2 as the 64-token kernels' 32.
# H200 (mla_q_by_k, T = 16384): G16 and G32 within noise, G8 ~2 % slower, G4 (dropped) ~7 %, BLOCK_K 32 ~7 %.
WS128_CONFIGS = (dict(BLOCK_K=64, STAGES=3, GROUP_M=16), dict(BLOCK_K=32, STAGES=6, GROUP_M=16),
                 dict(BLOCK_K=64, STAGES=3, GROUP_M=32), dict(BLOCK_K=64, STAGES=3, GROUP_M=8))
VARIANTS = ("gluon_ws", "gluon_ws128")  # the names mla_q.FORWARD_VARIANTS registers




def gluon_reasons(x, w, dequantized: bool = False) -> list:
    """Why the Gluon kernel cannot run these operands (empty: it can). dequantized: x and w are the codes
    of MXTensors whose exact bf16 dequantization (fresh contiguous tensors) the kernel will read, so
    only device, version and token count apply."""
    reasons = version_reasons()
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        return ["x and w must be tensors"]
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device)[0] != 9:
        reasons.append("needs an sm90 GPU (wgmma)")
    if x.shape[0] % BLOCK_M:
        reasons.append(f"tokens must be a multiple of {BLOCK_M}, got {x.shape[0]}")
    if dequantized:
        return reasons
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        reasons.append("x and w must be bf16")
    for name, t in (("x", x), ("w", w)):
        if t.dim() != 2 or t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * 2) % 16:
            reasons.append(f"{name} must be 2-D with unit last stride, 16-byte aligned base and rows (TMA)")
    return reasons


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple, bf16: bool):
    # one per tile shape: building it is host time on every launch otherwise
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if bf16 else gl.uint8)


def _desc(t, block):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _smem_layout(tuple(block), t.dtype == torch.bfloat16))


def launch(x, w, cos, sin, row_codes, row_scale, col_codes, col_scale, config=None, variant="gluon_ws"):
    """Fill the four outputs (codes [T, H, 192] uint8 views, row scales [T, H, 6], column scales
    [T / 32, H, 192]) for bf16 x [T, K], w [H * 192, K]. variant: "gluon_ws" (persistent producer /
    ping-pong consumers, WS_CONFIGS) or "gluon_ws128" (the same with 128-token tiles, WS128_CONFIGS;
    T % 128 == 0)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {', '.join(VARIANTS)}, got {variant!r}")
    table = {"gluon_ws": WS_CONFIGS, "gluon_ws128": WS128_CONFIGS}[variant]
    cfg = dict(table[0] if config is None else config)
    if set(cfg) != set(WS_CONFIGS[0]):
        raise ValueError(f"config: the Gluon kernel takes keys {sorted(WS_CONFIGS[0])}, got {sorted(cfg)}")
    if variant == "gluon_ws128" and x.shape[0] % 128:
        raise ValueError(f"x: variant 'gluon_ws128' needs tokens % 128 == 0, got {x.shape[0]}")
    tokens, k = x.shape
    heads = w.shape[0] // _HEAD
    bk = cfg["BLOCK_K"]
    rc2 = row_codes.view(tokens, heads * _HEAD)
    cc2 = col_codes.view(tokens, heads * _HEAD)
    args = (_desc(x, [BLOCK_M, bk]), _desc(w, [_NOPE, bk]), _desc(w, [_ROPE, bk]), cos, sin,
            _desc(rc2, [BLOCK_M, _NOPE]), _desc(rc2, [BLOCK_M, _ROPE]), _desc(cc2, [BLOCK_M, _NOPE]),
            _desc(cc2, [BLOCK_M, _ROPE]), row_scale, col_scale,
            tokens, k, heads, cos.stride(0), sin.stride(0))
    tiles = cdiv(tokens, BLOCK_M) * heads
    kernel = _mla_q_fwd_gluon_ws_kernel
    if variant == "gluon_ws128":
        kernel, tiles = _mla_q_fwd_gluon_ws128_kernel, tiles // 2
    fast_launch(kernel, (min(sm_count(x.device), tiles),), *args, BLOCK_K=bk, STAGES=cfg["STAGES"],
                GROUP_M=cfg["GROUP_M"], num_warps=NUM_WARPS, enable_fp_fusion=False)


settle_cache_keys(globals())  # before a compile-ahead thread can hash these kernels (_common)
