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
reads, and ptxas serialized the wgmma; so did a third set with wait(2): ptxas C7513). The producer and the main
loop live in _gluon_mx.py.

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
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._common import cdiv, settle_cache_keys
from ._gluon_compat import async_store, ring_barriers, tile_coords  # tile_coords: GROUP_M a tiles per b tile
from ._gluon_mx import (HALF, TILE_A, TILE_A_ROWS, TILE_B, TILE_B_ROWS, checked_config, guard_state, mainloop,
                        max_nan, producer, raise_guard, row_state)

NUM_WARPS = 4
_TILE_A, _TILE_B = TILE_A_ROWS, TILE_B_ROWS
# STAGES x (32 KB of a + 8 KB of b) beside 2 x 32 KB of epilogue tiles
# H200: 4 stages ran 5 % faster than 3 (5 do not fit)
CONFIGS = (dict(BLOCK_K=64, STAGES=4, GROUP_M=16), dict(BLOCK_K=64, STAGES=4, GROUP_M=8),
           dict(BLOCK_K=64, STAGES=3, GROUP_M=16))


@gluon.jit
def _consumer(CID: gl.constexpr, a_ring, b_ring, ready, empty, epi, out_desc, b_scale_ptr, flag_ptr,
              M, N, K, stride_sr, stride_sc, col_groups,
              SWIZZLED: gl.constexpr, IS_E5M2: gl.constexpr, LO: gl.constexpr, HI: gl.constexpr,
              BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, ODD_STEPS: gl.constexpr):
    """One warpgroup: rows CID * 64 .. + 63 of every tile's b rows against its TILE_A a rows (out^T
    [64, TILE_A] in registers, _gluon_mx.mainloop), stored transposed as bf16 by TMA."""
    num_m = gl.cdiv(M, TILE_A)
    num_n = gl.cdiv(N, TILE_B)
    bad, amax = guard_state()
    c = 0  # ring slot counter (both warpgroups walk every slot)
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        srow, sok = row_state(CID, b_scale_ptr, pid_n, N, stride_sr, col_groups, SWIZZLED)
        acc, bad, c = mainloop(CID, a_ring, b_ring, ready, empty, c, srow, sok, bad, K, stride_sc,
                               SWIZZLED, IS_E5M2, LO, HI, BLOCK_K, STAGES, ODD_STEPS)
        amax = max_nan(amax, gl.reduce(gl.abs(acc), 1, max_nan))
        o = acc.to(gl.bfloat16)
        tma.store_wait(0)  # this warpgroup's previous tile has left its buffer
        epi.store(gl.permute(o, (1, 0)))
        fence_async_shared()
        async_store(out_desc, [pid_m * TILE_A, pid_n * TILE_B + CID * HALF], epi)
    tma.store_wait(0)
    raise_guard(flag_ptr, bad, amax)


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
    ready, empty = ring_barriers(STAGES, 2)
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
        (producer, (a_desc, b_desc, a_ring, b_ring, ready, empty, M, N, K, BLOCK_K, STAGES, GROUP_M)),
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
    cfg = checked_config(config, CONFIGS, "the Gluon GEMM")
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
