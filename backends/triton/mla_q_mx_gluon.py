"""The fused MLA Q forward with an MXFP8 projection as one Gluon kernel for sm90 (variant `gluon_mx`):
the weight's e4m3 / e5m2 codes go from global memory to the tensor cores without a bf16 copy.

Why: sm90 has no MXFP8 MMA, so the MXFP8 projection multiplies exact bf16 dequantizations. The
`gluon_ws128` route (mla_q._launch_gluon_dequantized) writes the weight's dequantization to memory
in a flat pass and reads it back: at [4096 x 1536] x [24576 x 1536] that pass (37.7 MB of codes read,
75 MB of bf16 written and re-read by the GEMM) put the op at 1.20x the bf16 cuBLAS GEMM while the
kernel alone ran 1.12x. Here the weight is the register operand of wgmma, widened from its codes
(the main loop the MXFP8 GEMM's Gluon route runs, _gluon_mx.py), and only x (6.3 MB of codes) is
dequantized by the guarded flat pass.

Tiles: out^T, 128 features (weight rows) x 256 tokens. A head's 192 features are three 64-feature
slabs (no-RoPE, no-RoPE, RoPE), so a 128-feature tile holds two slabs of one head or the ends of two
heads; every slab lies in one consumer warpgroup's 64 rows, and slab s (global) is a RoPE part when
s % 3 == 2. The two quantizations' blocks (32 features of a token; 32 tokens of a feature) and the
RoPE pairs (features k and 32 + k of a RoPE part) never cross a slab.

Partitions (one persistent program per SM, 12 warps):
- two consumers (a warpgroup each, 64 feature rows of every tile): _gluon_mx.mainloop over a ring of
  STAGES slots ([256, BLOCK_K] of x's bf16, [128, BLOCK_K] of the weight's codes), then the
  accumulator rounded once to bf16 (the spec's bf16 stage) and stored transposed into the warpgroup's
  [256 tokens, 64 features] staging tile, handed over by mbarrier (stage_full / stage_free).
  Consumer 0 also issues the ring's TMA loads (_gluon_mx.issue_load of step j + STAGES once step j is
  freed by both): there is no producer warp, because a fourth warpgroup does not fit the register file
  beside two 128-register accumulators (16 warps cap ptxas at 128 registers a thread before setmaxnreg
  applies: ptxas C7602), and a producer warp sharing the epilogue's warpgroup leaves the epilogue two
  warps, which ran 2.1-2.8x the cuBLAS GEMM;
- epilogue (a warpgroup): each staged slab in four 64-token chunks, in the layouts the bf16
  projection's kernels use (mla_q_gluon.py: a quantization's block thread-local, RoPE eight threads a
  token row), codes out by TMA from two alternating box pairs, scales by plain stores, while the
  consumers run the next tile's main loop.

Measured (H200, 2026-12-03, `tools/profile_cases.py mla_q_mx`, in turns with cuBLAS; BENCHMARKS.md):
byte-identical to the gluon_ws128 route on the benchmark's data, guard down, but **1.55-1.66x** the
bf16 cuBLAS GEMM at T = 4096 and 1.49-1.53x at 16384, against 1.20-1.23x / 1.08-1.11x for gluon_ws128
on the exact dequantization; hence registered for naming only (mla_q.FORWARD_VARIANTS). With the
epilogue reduced to the staging handoffs (`epilogue_skip`) it ran 1.30x at T = 4096: the main loop
with consumer-issued loads and 3 stages is itself 1.25x slower than the MXFP8 GEMM's (1.047x: a
producer warp, 4 stages), and the four-warp epilogue (32 K elements a tile against a 26 K-cycle main
loop) does not keep up. Register splits (consumer / epilogue 184-200 / 112-136) moved it by under 1 %,
GROUP_M 8 by 3 %, BLOCK_K 32 with 6 stages ran 40 % slower.

Guards (the gated pointer kernel recomputes the whole op when the flag is up): x's flat pass raises
it for x's scale bytes outside BF16_SAFE_SCALE_BYTES and for non-finite values; the consumers raise
it for the weight's scale bytes outside that range and for an accumulator not finite in bf16.

Scope: sm90, Triton 3.6 or 3.9 (_gluon_compat.py), T % 256 == 0, H even (N % 128 == 0), K % 32 == 0,
K-blocked weight codes with K-contiguous 16-byte aligned rows.
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._common import cdiv, fast_launch, sm_count, settle_cache_keys
from ._gluon_compat import async_store, barrier, tile_coords
from ._gluon_mx import (HALF, TILE_A, TILE_A_ROWS, TILE_B, TILE_B_ROWS, checked_config, guard_state, issue_load,
                        mainloop, max_nan, raise_guard, row_state)
from ._gluon_codec import codes, scale_byte

NUM_WARPS = 4
# a ring stage is 40 KB at BLOCK_K 64 (32 KB of x, 8 KB of codes); beside it 2 x 32 KB of staging tiles,
# 4 x 4 KB of code boxes and the 16 KB fp32 RoPE tile: 3 stages fit in 227 KB
# H200 (T = 4096): GROUP_M 8 ran 3 % faster than 16; BLOCK_K 32 with 6 stages 40 % slower (dropped)
CONFIGS = (dict(BLOCK_K=64, STAGES=3, GROUP_M=8), dict(BLOCK_K=64, STAGES=3, GROUP_M=16))
# registers a thread per worker partition (consumer warpgroup 1, epilogue warpgroup; the default
# partition, consumer warpgroup 0, gets the rest of the 64 K): the consumers hold a [64, 256] fp32
# accumulator and two A register sets; offline ptxas: no spills at (192, 128), spills at (200, 112)
REGS = (192, 128)


@gluon.jit
def _consumer(CID: gl.constexpr, x_desc, w_desc, a_ring, b_ring, ready, empty, stage, stage_full, stage_free,
              b_scale_ptr, flag_ptr, T, N, K, stride_sr, stride_sc, col_groups,
              SWIZZLED: gl.constexpr, IS_E5M2: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr,
              BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, ODD_STEPS: gl.constexpr):
    """One warpgroup: its 64 feature rows of every tile (main loop), staged as bf16 [256 tokens, 64].
    Warpgroup 0 also fills the ring (no producer warp: its registers go to the epilogue warpgroup)."""
    num_m = gl.cdiv(T, TILE_A)
    num_n = gl.cdiv(N, TILE_B)
    k_steps = gl.cdiv(K, BLOCK_K)
    my_tiles = gl.cdiv(num_m * num_n - gl.program_id(0), gl.num_programs(0))
    total = my_tiles * k_steps
    if CID == 0:
        for g in gl.static_range(STAGES):
            issue_load(g, x_desc, w_desc, a_ring, b_ring, ready, empty, num_m, num_n, k_steps, total,
                       BLOCK_K, STAGES, GROUP_M)
    bad, amax = guard_state()
    c = 0
    n = 0  # tiles staged by this warpgroup (the staging tile's phase)
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        srow, sok = row_state(CID, b_scale_ptr, pid_n, N, stride_sr, col_groups, SWIZZLED)
        acc, bad, c = mainloop(CID, a_ring, b_ring, ready, empty, c, srow, sok, bad, K, stride_sc,
                               SWIZZLED, IS_E5M2, LO, HI, BLOCK_K, STAGES, ODD_STEPS,
                               1 - CID, x_desc, w_desc, num_m, num_n, total, GROUP_M)
        amax = max_nan(amax, gl.reduce(gl.abs(acc), 1, max_nan))
        o = acc.to(gl.bfloat16)
        # the epilogue has read the previous tile's slab (a fresh barrier passes parity 1)
        mbarrier.wait(stage_free.index(CID), (n & 1) ^ 1)
        stage.store(gl.permute(o, (1, 0)))
        barrier()  # every thread's part is written before the one arrive
        mbarrier.arrive(stage_full.index(CID))
        n += 1
    raise_guard(flag_ptr, bad, amax)


@gluon.jit
def _columnwise_and_store(src, row_box, col_box, row_desc, col_desc, col_scale_ptr, m0, g0, N):
    """A chunk's columnwise quantization from src ([64 tokens, 64] in shared memory: the staged bf16, or
    the fp32 RoPE results), then both code boxes out by TMA (the rowwise box already written)."""
    # [2 blocks of 32 tokens, 32, 64 features], one block per thread
    col2d: gl.constexpr = gl.BlockedLayout([32, 1], [1, 32], [2, 2], [1, 0])
    col_l: gl.constexpr = gl.BlockedLayout([1, 32, 1], [1, 1, 32], [2, 1, 2], [2, 1, 0])
    ce_layout: gl.constexpr = gl.SliceLayout(1, col_l)
    v = gl.convert_layout(gl.reshape(src.load(col2d), [2, 32, 64]), col_l, assert_trivial=True).to(gl.float32)
    e = scale_byte(gl.max(gl.abs(v), axis=1))
    col_box.store(gl.convert_layout(gl.reshape(codes(v, e[:, None, :]), [64, 64]), col2d, assert_trivial=True))
    blocks = m0 // 32 + gl.arange(0, 2, layout=gl.SliceLayout(1, ce_layout))
    feats = g0 + gl.arange(0, 64, layout=gl.SliceLayout(0, ce_layout))
    gl.store(col_scale_ptr + blocks.to(gl.int64)[:, None] * N + feats[None, :], e.to(gl.uint8))
    fence_async_shared()
    barrier()  # every thread's codes are in the boxes before the one thread that issues the stores
    async_store(row_desc, [m0, g0], row_box)
    async_store(col_desc, [m0, g0], col_box)


@gluon.jit
def _nope_chunk(chunk, row_box, col_box, row_desc, col_desc, row_scale_ptr, col_scale_ptr, m0, g0, N):
    """A [64 tokens, 64 features] no-RoPE chunk (bf16, staged): both quantizations, codes by TMA."""
    BM: gl.constexpr = 64
    # rowwise: [64, 2 blocks, 32], one block per thread
    row2d: gl.constexpr = gl.BlockedLayout([1, 32], [16, 2], [4, 1], [1, 0])
    row_l: gl.constexpr = gl.BlockedLayout([1, 1, 32], [16, 2, 1], [4, 1, 1], [2, 1, 0])
    v = gl.convert_layout(gl.reshape(chunk.load(row2d), [BM, 2, 32]), row_l, assert_trivial=True).to(gl.float32)
    e = scale_byte(gl.max(gl.abs(v), axis=2))
    row_box.store(gl.convert_layout(gl.reshape(codes(v, e[:, :, None]), [BM, 64]), row2d, assert_trivial=True))
    e_layout: gl.constexpr = gl.SliceLayout(2, row_l)
    rows_e = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, e_layout))
    blk_e = gl.arange(0, 2, layout=gl.SliceLayout(0, e_layout))
    gl.store(row_scale_ptr + (rows_e.to(gl.int64) * (N // 32) + g0 // 32)[:, None] + blk_e[None, :], e.to(gl.uint8))
    _columnwise_and_store(chunk, row_box, col_box, row_desc, col_desc, col_scale_ptr, m0, g0, N)


@gluon.jit
def _rope_chunk(chunk, row_box, col_box, rope_f32, row_desc, col_desc, cos_ptr, sin_ptr, row_scale_ptr,
                col_scale_ptr, m0, g0, N, stride_cos, stride_sin):
    """A [64 tokens, 64] RoPE-part chunk: RoPE (mla: interleaved pairs to halves, fp32, no FMA), both
    quantizations of the fp32 results (columnwise through rope_f32), codes by TMA."""
    BM: gl.constexpr = 64
    HALF_R: gl.constexpr = 32
    # 8 threads per token row, 4 pairs each: a warp holds 4 whole rows, so cos / sin load coalesced
    pairs2d: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    pairs_l: gl.constexpr = gl.BlockedLayout([1, 4, 2], [4, 8, 1], [4, 1, 1], [2, 1, 0])
    half_l: gl.constexpr = gl.SliceLayout(2, pairs_l)
    rows_h = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, half_l))
    rows_t = rows_h.to(gl.int64)[:, None]
    k_h = gl.arange(0, HALF_R, layout=gl.SliceLayout(0, half_l))[None, :]
    rs_ptrs = row_scale_ptr + rows_h.to(gl.int64) * (N // 32) + g0 // 32
    staged = gl.convert_layout(gl.reshape(chunk.load(pairs2d), [BM, HALF_R, 2]), pairs_l, assert_trivial=True)
    even, odd = gl.split(staged.to(gl.float32))
    # left half, then right half (fewer values live at once); rowwise, each half is one block: amax
    # over the row's 8 threads
    cos_l = gl.load(cos_ptr + rows_t * stride_cos + k_h).to(gl.float32)
    sin_l = gl.load(sin_ptr + rows_t * stride_sin + k_h).to(gl.float32)
    left = even * cos_l - odd * sin_l
    rope_f32.slice(0, HALF_R, dim=1).store(left)
    e_l = scale_byte(gl.max(gl.abs(left), axis=1))
    row_box.slice(0, HALF_R, dim=1).store(codes(left, e_l[:, None]))
    gl.store(rs_ptrs, e_l.to(gl.uint8))
    cos_r = gl.load(cos_ptr + rows_t * stride_cos + (HALF_R + k_h)).to(gl.float32)
    sin_r = gl.load(sin_ptr + rows_t * stride_sin + (HALF_R + k_h)).to(gl.float32)
    right = odd * cos_r + even * sin_r
    rope_f32.slice(HALF_R, HALF_R, dim=1).store(right)
    e_r = scale_byte(gl.max(gl.abs(right), axis=1))
    row_box.slice(HALF_R, HALF_R, dim=1).store(codes(right, e_r[:, None]))
    gl.store(rs_ptrs + 1, e_r.to(gl.uint8))

    barrier()  # rope_f32 written by rows, read by columns below

    _columnwise_and_store(rope_f32, row_box, col_box, row_desc, col_desc, col_scale_ptr, m0, g0, N)


@gluon.jit
def _slab(stage, stage_full, stage_free, CID: gl.constexpr, n, pid_m, slab, row_a, col_a, row_b, col_b, rope_f32,
          row_desc, col_desc, cos_ptr, sin_ptr, row_scale_ptr, col_scale_ptr, N, stride_cos, stride_sin,
          SKIP: gl.constexpr):
    """The epilogue of one staged slab (features slab * 64 .. + 63, tokens pid_m * 256 .. + 255), in
    four 64-token chunks; chunk j writes box pair j % 2, whose stores of chunk j - 2 have been read."""
    mbarrier.wait(stage_full.index(CID), n & 1)
    g0 = slab * 64
    rope = slab % 3 == 2
    for ch in gl.static_range(0 if SKIP else 4):  # SKIP (profiling): the handoffs alone
        chunk = stage.slice(ch * 64, 64, dim=0)
        m0 = pid_m * TILE_A + ch * 64
        tma.store_wait(2)  # two chunks ago: this chunk's box pair has left (the last pair may be in flight)
        barrier()  # ... for every thread, and every thread is past the previous chunk's rope_f32 reads
        if ch % 2 == 0:
            if rope:
                _rope_chunk(chunk, row_a, col_a, rope_f32, row_desc, col_desc, cos_ptr, sin_ptr, row_scale_ptr,
                            col_scale_ptr, m0, g0, N, stride_cos, stride_sin)
            else:
                _nope_chunk(chunk, row_a, col_a, row_desc, col_desc, row_scale_ptr, col_scale_ptr, m0, g0, N)
        else:
            if rope:
                _rope_chunk(chunk, row_b, col_b, rope_f32, row_desc, col_desc, cos_ptr, sin_ptr, row_scale_ptr,
                            col_scale_ptr, m0, g0, N, stride_cos, stride_sin)
            else:
                _nope_chunk(chunk, row_b, col_b, row_desc, col_desc, row_scale_ptr, col_scale_ptr, m0, g0, N)
    barrier()  # every thread's reads of the slab are done before the one arrive
    mbarrier.arrive(stage_free.index(CID))


@gluon.jit
def _epilogue(stage0, stage1, stage_full, stage_free, row_a, col_a, row_b, col_b, rope_f32, row_desc, col_desc,
              cos_ptr, sin_ptr, row_scale_ptr, col_scale_ptr, T, N, stride_cos, stride_sin, GROUP_M: gl.constexpr,
              SKIP: gl.constexpr):
    """One warpgroup: both staged slabs of every tile of this program, in the consumers' tile order."""
    num_m = gl.cdiv(T, TILE_A)
    num_n = gl.cdiv(N, TILE_B)
    n = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        _slab(stage0, stage_full, stage_free, 0, n, pid_m, pid_n * 2, row_a, col_a, row_b, col_b, rope_f32,
              row_desc, col_desc, cos_ptr, sin_ptr, row_scale_ptr, col_scale_ptr, N, stride_cos, stride_sin, SKIP)
        _slab(stage1, stage_full, stage_free, 1, n, pid_m, pid_n * 2 + 1, row_a, col_a, row_b, col_b, rope_f32,
              row_desc, col_desc, cos_ptr, sin_ptr, row_scale_ptr, col_scale_ptr, N, stride_cos, stride_sin, SKIP)
        n += 1
    tma.store_wait(0)


@gluon.jit
def _mla_q_fwd_gluon_mx_kernel(
    x_desc, w_desc, w_scale_ptr, flag_ptr, cos_ptr, sin_ptr, row_desc, col_desc, row_scale_ptr, col_scale_ptr,
    T, N, K, stride_sr, stride_sc, col_groups, stride_cos, stride_sin,
    SWIZZLED: gl.constexpr, IS_E5M2: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr,
    BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, ODD_STEPS: gl.constexpr,
    R_CONSUMER: gl.constexpr, R_EPILOGUE: gl.constexpr, EPILOGUE_SKIP: gl.constexpr = 0,
):
    """Persistent (one program per SM): two consumer warpgroups (the first also loading), an epilogue
    warpgroup."""
    a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, TILE_A, BLOCK_K], x_desc.layout)
    b_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, TILE_B, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    stage_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    stage_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(stage_full.index(i), count=1)
        mbarrier.init(stage_free.index(i), count=1)
    # staging tiles: 128-byte rows, 16-byte vectors XOR-swizzled by row (the store from the accumulator
    # goes through stmatrix; the epilogue's loads are the bf16 kernels' conflict-free ones)
    stage_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    stage0 = gl.allocate_shared_memory(gl.bfloat16, [TILE_A, HALF], stage_layout)
    stage1 = gl.allocate_shared_memory(gl.bfloat16, [TILE_A, HALF], stage_layout)
    row_a = gl.allocate_shared_memory(gl.uint8, [64, 64], row_desc.layout)
    col_a = gl.allocate_shared_memory(gl.uint8, [64, 64], col_desc.layout)
    row_b = gl.allocate_shared_memory(gl.uint8, [64, 64], row_desc.layout)
    col_b = gl.allocate_shared_memory(gl.uint8, [64, 64], col_desc.layout)
    tile32: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
    rope_f32 = gl.allocate_shared_memory(gl.float32, [64, 64], tile32)
    # every argument tuple written out in full (see gemm_gluon: constexprs must cross warp_specialize)
    gl.warp_specialize([
        (_consumer, (0, x_desc, w_desc, a_ring, b_ring, ready, empty, stage0, stage_full, stage_free, w_scale_ptr,
                     flag_ptr, T, N, K, stride_sr, stride_sc, col_groups, SWIZZLED, IS_E5M2, LO, HI, BLOCK_K, STAGES,
                     GROUP_M, ODD_STEPS)),
        (_consumer, (1, x_desc, w_desc, a_ring, b_ring, ready, empty, stage1, stage_full, stage_free, w_scale_ptr,
                     flag_ptr, T, N, K, stride_sr, stride_sc, col_groups, SWIZZLED, IS_E5M2, LO, HI, BLOCK_K, STAGES,
                     GROUP_M, ODD_STEPS)),
        (_epilogue, (stage0, stage1, stage_full, stage_free, row_a, col_a, row_b, col_b, rope_f32, row_desc,
                     col_desc, cos_ptr, sin_ptr, row_scale_ptr, col_scale_ptr, T, N, stride_cos, stride_sin,
                     GROUP_M, EPILOGUE_SKIP)),
    ], [4, 4], [R_CONSUMER, R_EPILOGUE])


# --------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------
def reasons(x16_shape, w_codes, w_axis: int, heads: int) -> list:
    """Why this kernel cannot run (empty: it can), beyond the MXFP8 projection's own checks: token and
    head multiples, K-blocked weight codes TMA can address."""
    out = []
    tokens, k = x16_shape
    if tokens % TILE_A_ROWS:
        out.append(f"gluon_mx needs tokens % {TILE_A_ROWS} == 0, got {tokens}")
    if heads % 2:
        out.append(f"gluon_mx needs an even head count (128-feature tiles), got {heads}")
    if w_axis != 1:
        out.append(f"gluon_mx needs the weight blocked along K (axis 1), got axis {w_axis}")
    if (w_codes.dim() != 2 or w_codes.stride(1) != 1 or w_codes.data_ptr() % 16 or w_codes.stride(0) % 16):
        out.append("gluon_mx needs the weight's codes 2-D, K-contiguous, 16-byte aligned base and rows (TMA)")
    if k % 8:
        out.append(f"gluon_mx needs K % 8 == 0 (TMA rows of x's bf16 dequantization), got {k}")
    return out


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple, bf16: bool):
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if bf16 else gl.uint8)


def _desc(t, block):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                            _smem_layout(tuple(block), t.dtype == torch.bfloat16))


def launch(x16, w_codes, w_scale, scale_strides, col_groups: int, swizzled: bool, is_e5m2: bool, safe_bytes,
           cos, sin, row_codes, row_scale, col_codes, col_scale, flag, config=None, epilogue_skip=False):
    """Fill the four outputs (codes [T, H, 192] uint8 views, row scales [T, H, 6], column scales
    [T / 32, H, 192]) for x16 [T, K] bf16 (x's exact dequantization) and the weight's codes [H * 192, K]
    (uint8 view) with its K-blocked scale bytes; *flag (int32) is raised for scale bytes outside
    safe_bytes or an accumulator not finite in bf16 (the caller's exact kernel then recomputes).
    epilogue_skip (profiling; its outputs are not the op's): the epilogue only hands the staging tiles
    back, so the time is the main loop's and the staging's."""
    cfg = checked_config(config, CONFIGS, "the gluon_mx kernel")
    tokens, k = x16.shape
    n = w_codes.shape[0]
    bk = cfg["BLOCK_K"]
    rc2 = row_codes.view(tokens, n)
    cc2 = col_codes.view(tokens, n)
    tiles = cdiv(tokens, TILE_A_ROWS) * cdiv(n, TILE_B_ROWS)
    fast_launch(_mla_q_fwd_gluon_mx_kernel, (min(sm_count(x16.device), tiles),),
                _desc(x16, [TILE_A_ROWS, bk]), _desc(w_codes, [TILE_B_ROWS, bk]), w_scale, flag, cos, sin,
                _desc(rc2, [64, 64]), _desc(cc2, [64, 64]), row_scale, col_scale,
                tokens, n, k, scale_strides[0], scale_strides[1], col_groups, cos.stride(0), sin.stride(0),
                SWIZZLED=int(swizzled), IS_E5M2=int(is_e5m2), LO=int(safe_bytes[0]), HI=int(safe_bytes[1]),
                BLOCK_K=bk, STAGES=cfg["STAGES"], GROUP_M=cfg["GROUP_M"], ODD_STEPS=int(cdiv(k, bk) % 2 == 1),
                R_CONSUMER=REGS[0], R_EPILOGUE=REGS[1], EPILOGUE_SKIP=int(epilogue_skip),
                num_warps=NUM_WARPS, enable_fp_fusion=False)


settle_cache_keys(globals())  # before a compile-ahead thread can hash these kernels (_common)
