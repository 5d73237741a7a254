"""The sm90 MXFP8 GEMM's "gluon" route (SEMANTICS.md section 5): out [M, N] = a [M, K] @ b [N, K]^T with
b's e4m3 / e5m2 codes widened to bf16 in registers, as the register (A) operand of wgmma. The sm90
default where it can run (gemm.GEMM_VARIANTS; MXMLA_BACKEND `mxfp8_gemm=triton:<variant>` names a route).

Why: the "bf16" route (gemm.py) dequantizes both operands in flat passes and runs one cuBLAS GEMM; at
[4096 x 1536] x [24576 x 1536] the passes cost ~0.04 ms beside a ~0.43 ms GEMM, so that route sits at
0.96-0.99x the bf16 cuBLAS GEMM. b is the large operand (37.7 MB of codes, 75 MB as bf16); here its
codes go from global memory to the tensor cores without a bf16 copy:

- b's tiles travel by TMA as fp8 codes (half the bytes of bf16), are read from shared memory in the
  wgmma A-operand register layout, widened to bf16 (exact) and multiplied by their block's scale, a
  bf16 power of two (exact for scale bytes in BF16_SAFE_SCALE_BYTES), so the A operand holds exactly
  dq(b). Only the A operand can come from registers, so the kernel computes out^T tiles (b rows x
  a rows) and stores them transposed (stmatrix into the TMA-store tile).
- a (the small operand, 6.3 MB of codes) is dequantized to bf16 by the bf16 route's flat pass and
  read by TMA as the B operand.
- Products exact, the sum in fp32 by the tensor cores, rounded once to bf16: the cuBLAS route's
  contract. On the benchmark's data its output was byte-identical to the cuBLAS route's.

Guards (the bf16 route's exact fallback kernel recomputes every tile when the flag is up): a's flat
pass raises the flag for a's scale bytes outside the safe range and for non-finite values; this
kernel raises it for b's scale bytes outside the safe range and when an output is not finite in bf16
(NaN-propagating max of |acc|): a NaN code of b makes its whole output column NaN, so the canonical-NaN
rule and the exact-sum cases where fp32 overflows are left to the exact kernel.

Kernel: persistent (one program per SM), warp-specialized: a TMA producer warp and two consumer
warpgroups that share each 256 (a rows) x 128 (b rows) output tile, 64 b rows each (out^T [64, 256]
in 128 fp32 registers a thread). A ring of STAGES x (32 KB of a + 8 KB of codes) beside 2 x 32 KB of
epilogue tiles. Step k's codes are widened while step k - 1's MMA runs, through two A register sets
used alternately in a loop unrolled by two (a loop-carried swap moved registers an MMA in flight
reads, and ptxas serialized the wgmma; so did a third set with wait(2): ptxas C7513).

Measured (H200, 2026-11-30, BENCHMARKS.md; `tools/profile_cases.py gemm_gluon` and `bench_gemm.py`, in
turns with cuBLAS): the route **1.013x** the bf16 cuBLAS GEMM (0.4462 vs 0.4519 ms), the kernel alone
1.047x; byte-identical to the cuBLAS route on that data. ncu of an earlier form (locked clocks): tensor
pipe 74.9 %, issue slots 31.9 %. What limits it: 3072 tiles on 132 SMs (3 % wave quantization), the
epilogue and next-tile prologue not overlapped with MMAs (cooperative tiles), 4 ring stages at most
(3 ran 5 % slower; 5 do not fit beside the epilogue tiles). The widening is cvt e4m3x2 -> f16x2, two
HADD2.F32 and one f32x2 -> bf16x2 pack a pair of codes, then a bf16 multiply by the block's factor:
Triton's own f16 -> bf16 (two F2F and a permute a pair) ran the kernel ~7 % slower, and taking the
fp32 high halves by integer permutes instead of the pack ran slower too. Earlier forms, for the
record: ping-pong warpgroups on 128 x 128 tiles ran 0.50x (one warp per scheduler could not widen
twice the codes per MAC in time); widening the next tile's first step before the epilogue, 4 % slower.

Scope: sm90, Triton 3.6 or 3.9 (_gluon_compat.py), bf16 output, K % 32 == 0
(MX blocks), b's codes K-contiguous with 16-byte aligned rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._common import cdiv, settle_cache_keys
from ._gluon_compat import async_load, async_store, tile_coords  # tile_coords: GROUP_M a tiles per b tile

TILE_A = gl.constexpr(256)  # output tile: TILE_A rows of a (tokens) x TILE_B rows of b (features)
TILE_B = gl.constexpr(128)
HALF = gl.constexpr(64)  # b rows per consumer warpgroup (one wgmma M)
NUM_WARPS = 4
_TILE_A, _TILE_B = 256, 128
# the least fp32 that rounds (RN-even) to Inf in bf16: bits 0x7F7F8000, halfway above bf16's largest
BF16_ROUNDS_TO_INF = gl.constexpr(float.fromhex("0x1.ffp127"))
# STAGES x (32 KB of a + 8 KB of b) beside 2 x 32 KB of epilogue tiles
# H200: 4 stages ran 5 % faster than 3 (5 do not fit)
CONFIGS = (dict(BLOCK_K=64, STAGES=4, GROUP_M=16), dict(BLOCK_K=64, STAGES=4, GROUP_M=8),
           dict(BLOCK_K=64, STAGES=3, GROUP_M=16))


@gluon.jit
def _producer(a_desc, b_desc, a_ring, b_ring, ready, empty, M, N, K,
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
def _scale_row_ptrs(scale_ptr, rows, stride_row, col_groups, SWIZZLED: gl.constexpr):
    """Pointers to S[rows, 0] in compact or swizzled (SEMANTICS 3 step 3) storage: the per-row part of the
    offset, computed once a tile (_load_scales adds the K block's part)."""
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
def _load_scales(row_ptrs, row_ok, kk, KB, stride_col, BLOCK_K: gl.constexpr, SWIZZLED: gl.constexpr):
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
    # (cvt e4m3x2 -> f16x2, two HADD2.F32 and one f32x2 -> bf16x2 pack a pair: see the module notes)
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
def _max_nan(x, y):
    return gl.maximum(x, y, propagate_nan=tl.PropagateNan.ALL)


@gluon.jit
def _consumer(CID: gl.constexpr, a_ring, b_ring, ready, empty, epi, out_desc, b_scale_ptr, flag_ptr,
              M, N, K, stride_sr, stride_sc, col_groups,
              SWIZZLED: gl.constexpr, IS_E5M2: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr,
              BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, ODD_STEPS: gl.constexpr):
    """One warpgroup: rows CID * 64 .. + 63 of every tile's b rows against its TILE_A a rows (out^T
    [64, TILE_A] in registers). Step k's b codes are widened while step k - 1's MMA runs (two A
    register sets: the wait that retires an MMA keeps its A operand alive until then)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, TILE_A, 16])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_l: gl.constexpr = gl.SliceLayout(1, a_op)
    num_m = gl.cdiv(M, TILE_A)
    num_n = gl.cdiv(N, TILE_B)
    k_steps = gl.cdiv(K, BLOCK_K)
    KB = K // 32
    offs_r = gl.arange(0, HALF, layout=rows_l)
    bad = gl.zeros([HALF], gl.int32, rows_l)  # b scale bytes outside [LO, HI]
    # NaN-propagating max |acc| over this warpgroup's outputs: `not (amax < BF16_ROUNDS_TO_INF)` flags
    # every output that is not finite in bf16
    amax = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, mma))
    c = 0  # ring slot counter (both warpgroups walk every slot)
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        rows = pid_n * TILE_B + CID * HALF + offs_r
        srow = _scale_row_ptrs(b_scale_ptr, rows, stride_sr, col_groups, SWIZZLED)
        sok = rows < N
        s0, s1 = _load_scales(srow, sok, 0, KB, stride_sc, BLOCK_K, SWIZZLED)
        acc = gl.zeros([HALF, TILE_A], gl.float32, mma)
        # Steps two at a time, A operands alternating between w and w2 with no register copies (a loop-
        # carried swap would move registers an MMA in flight reads, and ptxas would serialize the wgmma):
        # each step's b codes are widened while the previous step's MMA runs, and an A register set is
        # rewritten only after the wait that retires the MMA reading it.
        # prologue: one step into w2 (odd step count) or two, into w then w2 (even), so that the pairs
        # below cover the rest and each starts with the MMA of w2 in flight
        if ODD_STEPS:
            first = 1
            mbarrier.wait(ready.index(c % STAGES), (c // STAGES) & 1)
            bad |= (s0 < LO) | (s0 > HI) | (s1 < LO) | (s1 > HI)
            w2 = _widen(b_ring.index(c % STAGES).slice(CID * HALF, HALF, dim=0), s0, s1, a_op, BLOCK_K, IS_E5M2)
            s0, s1 = _load_scales(srow, sok, 1, KB, stride_sc, BLOCK_K, SWIZZLED)
            acc = warpgroup_mma(w2, a_ring.index(c % STAGES).permute((1, 0)), acc, is_async=True)
            # returns at once (one MMA in flight): acc back as a tensor, w2 kept live
            acc, w2 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, w2))
            w = w2
        else:
            first = 2
            mbarrier.wait(ready.index(c % STAGES), (c // STAGES) & 1)
            bad |= (s0 < LO) | (s0 > HI) | (s1 < LO) | (s1 > HI)
            w = _widen(b_ring.index(c % STAGES).slice(CID * HALF, HALF, dim=0), s0, s1, a_op, BLOCK_K, IS_E5M2)
            s0, s1 = _load_scales(srow, sok, 1, KB, stride_sc, BLOCK_K, SWIZZLED)
            acc = warpgroup_mma(w, a_ring.index(c % STAGES).permute((1, 0)), acc, is_async=True)
            acc, w = warpgroup_mma_wait(num_outstanding=1, deps=(acc, w))
            s = (c + 1) % STAGES
            mbarrier.wait(ready.index(s), ((c + 1) // STAGES) & 1)
            bad |= (s0 < LO) | (s0 > HI) | (s1 < LO) | (s1 > HI)
            w2 = _widen(b_ring.index(s).slice(CID * HALF, HALF, dim=0), s0, s1, a_op, BLOCK_K, IS_E5M2)
            s0, s1 = _load_scales(srow, sok, 2, KB, stride_sc, BLOCK_K, SWIZZLED)
            acc = warpgroup_mma(w2, a_ring.index(s).permute((1, 0)), acc, is_async=True)
            acc, w = warpgroup_mma_wait(num_outstanding=1, deps=(acc, w))
            mbarrier.arrive(empty.index(c % STAGES))
        for kk in range(first, k_steps, 2):
            s = (c + kk) % STAGES
            bad |= (s0 < LO) | (s0 > HI) | (s1 < LO) | (s1 > HI)
            mbarrier.wait(ready.index(s), ((c + kk) // STAGES) & 1)
            w = _widen(b_ring.index(s).slice(CID * HALF, HALF, dim=0), s0, s1, a_op, BLOCK_K, IS_E5M2)
            s0, s1 = _load_scales(srow, sok, kk + 1, KB, stride_sc, BLOCK_K, SWIZZLED)
            acc = warpgroup_mma(w, a_ring.index(s).permute((1, 0)), acc, is_async=True)
            acc, w2 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, w2))
            mbarrier.arrive(empty.index((c + kk - 1) % STAGES))
            s = (c + kk + 1) % STAGES
            bad |= (s0 < LO) | (s0 > HI) | (s1 < LO) | (s1 > HI)
            mbarrier.wait(ready.index(s), ((c + kk + 1) // STAGES) & 1)
            w2 = _widen(b_ring.index(s).slice(CID * HALF, HALF, dim=0), s0, s1, a_op, BLOCK_K, IS_E5M2)
            s0, s1 = _load_scales(srow, sok, kk + 2, KB, stride_sc, BLOCK_K, SWIZZLED)
            acc = warpgroup_mma(w2, a_ring.index(s).permute((1, 0)), acc, is_async=True)
            acc, w = warpgroup_mma_wait(num_outstanding=1, deps=(acc, w))
            mbarrier.arrive(empty.index((c + kk) % STAGES))
        acc, w, w2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w, w2))
        mbarrier.arrive(empty.index((c + k_steps - 1) % STAGES))
        c += k_steps
        amax = _max_nan(amax, gl.reduce(gl.abs(acc), 1, _max_nan))
        o = acc.to(gl.bfloat16)
        tma.store_wait(0)  # this warpgroup's previous tile has left its buffer
        epi.store(gl.permute(o, (1, 0)))
        fence_async_shared()
        async_store(out_desc, [pid_m * TILE_A, pid_n * TILE_B + CID * HALF], epi)
    tma.store_wait(0)
    top = gl.reduce(amax, 0, _max_nan)
    raise_flag = (gl.max(bad, axis=0) != 0) | (top != top) | (top >= BF16_ROUNDS_TO_INF)
    gl.store(flag_ptr, 1, mask=raise_flag)


@gluon.jit
def _mxfp8_gemm_gluon_kernel(a_desc, b_desc, out_desc, b_scale_ptr, flag_ptr, M, N, K,
                             stride_sr, stride_sc, col_groups,
                             SWIZZLED: gl.constexpr, IS_E5M2: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr,
                             BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                             ODD_STEPS: gl.constexpr):
    """Persistent (one program per SM): a TMA producer warp and two consumer warpgroups sharing each
    TILE_A x TILE_B output tile (64 of its b rows each)."""
    a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, TILE_A, BLOCK_K], a_desc.layout)
    b_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, TILE_B, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    epi_a = gl.allocate_shared_memory(gl.bfloat16, [TILE_A, HALF], out_desc.layout)
    epi_b = gl.allocate_shared_memory(gl.bfloat16, [TILE_A, HALF], out_desc.layout)
    # every argument tuple written out in full: a tuple assigned to a name, or concatenated, turns
    # constexprs into tensors or bare ints that cannot cross warp_specialize
    gl.warp_specialize([
        (_consumer, (0, a_ring, b_ring, ready, empty, epi_a, out_desc, b_scale_ptr, flag_ptr, M, N, K,
                     stride_sr, stride_sc, col_groups, SWIZZLED, IS_E5M2, LO, HI, BLOCK_K, STAGES, GROUP_M,
                     ODD_STEPS)),
        (_consumer, (1, a_ring, b_ring, ready, empty, epi_b, out_desc, b_scale_ptr, flag_ptr, M, N, K,
                     stride_sr, stride_sc, col_groups, SWIZZLED, IS_E5M2, LO, HI, BLOCK_K, STAGES, GROUP_M,
                     ODD_STEPS)),
        (_producer, (a_desc, b_desc, a_ring, b_ring, ready, empty, M, N, K, BLOCK_K, STAGES, GROUP_M)),
    ], [4, 1], [232, 40])


# --------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------
def _desc(t, block, dtype):
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def launch(a16: torch.Tensor, b_codes: torch.Tensor, b_scale: torch.Tensor, scale_strides, col_groups: int,
           swizzled: bool, is_e5m2: bool, safe_bytes, out: torch.Tensor, flag: torch.Tensor, config=None):
    """out [M, N] bf16 = a16 [M, K] bf16 @ dq(b)^T for b's codes [N, K] (uint8 view) and scale bytes;
    flag (int32 [1]) is set when b's scale bytes leave safe_bytes = (lo, hi) or an output is not
    finite (the caller's exact kernel then recomputes)."""
    cfg = dict(CONFIGS[0] if config is None else config)
    if set(cfg) != set(CONFIGS[0]):
        raise ValueError(f"config: the Gluon GEMM takes keys {sorted(CONFIGS[0])}, got {sorted(cfg)}")
    if cfg["BLOCK_K"] not in (32, 64):
        raise ValueError(f"config: BLOCK_K must be 32 or 64, got {cfg['BLOCK_K']}")
    m, k = a16.shape
    n = b_codes.shape[0]
    bk = cfg["BLOCK_K"]
    a_desc = _desc(a16, [_TILE_A, bk], gl.bfloat16)
    b_desc = _desc(b_codes, [_TILE_B, bk], gl.uint8)
    out_desc = _desc(out, [_TILE_A, 64], gl.bfloat16)
    tiles = cdiv(m, _TILE_A) * cdiv(n, _TILE_B)
    sms = torch.cuda.get_device_properties(out.device).multi_processor_count
    _mxfp8_gemm_gluon_kernel[(min(sms, tiles),)](
        a_desc, b_desc, out_desc, b_scale, flag, m, n, k, scale_strides[0], scale_strides[1], col_groups,
        SWIZZLED=int(swizzled), IS_E5M2=int(is_e5m2),  # ints: a bool constexpr cannot cross warp_specialize
        LO=int(safe_bytes[0]), HI=int(safe_bytes[1]),
        BLOCK_K=bk, STAGES=cfg["STAGES"], GROUP_M=cfg["GROUP_M"], ODD_STEPS=int(cdiv(k, bk) % 2 == 1),
        num_warps=NUM_WARPS)


settle_cache_keys(globals())  # before a compile-ahead thread can hash these kernels (_common)
