"""Triton MXFP8 GEMM (SEMANTICS.md section 5): out [M, N] = RN_out(sum_k dq(a)[m, k] * dq(b)[n, k]) for
MXTensors a [M, K], b [N, K] blocked along K (compact or swizzled scales, e4m3 or e5m2 elements).

Kernel variants (GEMM_VARIANTS, registry entries with their reasons and priorities; the dispatcher
takes the first that can serve, or the one named in MXMLA_BACKEND `mxfp8_gemm=triton:<variant>` or by
`variant=`): dot_scaled (sm100+), gluon, bf16, pointer, each described below.

Kernel design
- sm90 where the Gluon route cannot run (fp32 out, another Triton), the "bf16" route (_launch_bf16):
  a code times its scale is a bf16 value exactly when the scale byte lies in BF16_SAFE_SCALE_BYTES (e4m3 [10, 246], e5m2 [17, 239]), so a and b are
  dequantized once to bf16 (quantize.dequantize_bf16_flat, a flat pass at ~3 TB/s that also raises a
  device flag for a byte outside that range or a NaN / Inf value), multiplied by one cuBLAS bf16
  GEMM with fp32 accumulation (bf16 reduced-precision split-K reductions off for the call), and the
  exact per-block kernel below is launched persistent and gated on the flag: when it is up, it
  recomputes every output tile; when it is down (real data), it returns at once. No host sync once
  that kernel is compiled (its first call compiles it in the background and reads the flag on the
  host meanwhile: _common.launch_gated), so the op stays CUDA-graph safe. Products exact, sum in
  fp32: the block kernels' contract, at 0.96-0.98x the bf16 cuBLAS GEMM on [4096 x 1536] @
  [24576 x 1536]^T on the H200 (BENCHMARKS.md; the two dequantize passes are the difference).
- sm90 default where it can run (bf16 out, Triton 3.6 / 3.9), the "gluon" route (_launch_gluon,
  gemm_gluon.py): a dequantized by the same guarded flat pass, b's fp8 codes widened to bf16 in the
  registers of a Gluon warp-specialized GEMM (wgmma with a register A operand), the same gated exact
  fallback; no bf16 copy of b. Its figures against cuBLAS are in gemm_gluon.py and BENCHMARKS.md.
- The block kernel "pointer" (sm89; sm90 by name, and the gated exact fallback of the gluon and bf16
  routes): one tensor-core tl.dot per 32-wide K block. For every K block b the
  program issues one dot of the codes from a zero accumulator (exactly one MX block), giving the
  block's partial sum P_b in fp32, and folds it in on the CUDA cores:
      acc = fma(P_b, 2^(sa[m,b]-127) * 2^(sb[n,b]-127), acc)
  (the scale product is exact: a product of two powers of two). Every product of two fp8 codes is exact
  in fp32, so P_b is the exact block sum whenever the 32 products fit fp32's 24 bits (always for the
  byte tests' small integers); the only roundings are those of fp32 accumulation across blocks, in
  block order. That holds for the fp16 MMA, and so by default the codes are widened to fp16 (exact)
  before the dot (_mxfp8.mx_block_dot). The fp8 MMA (wgmma k32) sums with a narrower accumulator on
  sm90: on the H200 its results left the fp32-summation bound of tests/conformance/test_gemm.py
  (errors up to ~2^-8 relative on wide-exponent data), as the DeepSeek-V3 report describes for
  H800 (~14 accumulator bits). MXMLA_TRITON_FP8_MMA=1 selects it for speed, outside that bound.
  Why per block and not one long dot: MX scales change every 32 elements of K, and Hopper's wgmma has
  no scale operand. Pre-scaling a larger K tile into one fp8 dot is not exact
  (fp8 codes shifted by 2^d lose bits or overflow), and a data-dependent "equal scales" fast path
  almost never fires on real weights, so it is not done.
  Cost model (H100/H200 SM, per output element per K block): the tensor core does 32 fp8 FMAs at
  ~4096 FMA/clk/SM, the CUDA cores must issue at least 2 instructions (FMUL for the scale product,
  FFMA) at 128 lanes/clk/SM: 2 * 32 / 128 = 1/2048 clk per FMA, exactly the bf16 tensor-core peak.
  So on Hopper an exact MX-block-32 GEMM is bound by the rescale at ~ the bf16 peak, whatever the
  fp8 rate; it can only beat bf16 cuBLAS by the margin by which cuBLAS misses the bf16 peak, and
  only if the rescale of one warpgroup overlaps the wgmma of the other. On the H200 this kernel and a
  TMA-fed form of it ran at a fraction of bf16 cuBLAS (BENCHMARKS.md), so sm90 runs the gluon / bf16
  routes; native MX on sm100 removes the rescale entirely. The kernel uses cp.async pointer loads (any
  strides) and decodes the scale bytes in the loop.
- Scale bytes are read in the kernel from either layout: the swizzled (cuBLAS / F8_128x4) offset of
  S[i, j] is computed from SEMANTICS 3 step 3, so swizzled MXTensors need no unswizzle pass.
- Grouped program order (GROUP_M tiles of M share each N tile) for L2 reuse; rows/columns past M/N
  are clamped on load (their results are masked on store), so the main loop has no masks when K is a
  multiple of BLOCK_K.
- Output: fp32 acc rounded once to bf16 (RN-even on the bits) or kept fp32; NaN written as the positive
  quiet NaN (spec's rule); an exact zero sum is +0.0 (the accumulator starts at +0).
- sm100+ (Blackwell): tl.dot_scaled (native MX block-scaled MMA), scales fed as [BM, BK/32] /
  [BN, BK/32] tiles. Gated on compute capability >= 10.0 because on sm90 Triton emulates dot_scaled
  by upcasting to bf16 (slower than the kernel above). UNVERIFIED: no sm100 machine was available;
  it runs under the interpreter in the tests (semantics), not on hardware. Triton's emulation (the
  interpreter) dequantizes before multiplying, so a code times a scale beyond fp32 (448 * 2^127)
  becomes Inf there, and Inf * 0 NaN, where spec's exact sum is finite; native sm100 MMA may differ.

Deviations from spec (both bounded by the tests): the fp32 accumulation across K blocks rounds (spec
sums exactly), and a scale pair whose product 2^(sa+sb-254) is outside fp32 (sa + sb > 381 or
< 105 - 24) overflows / underflows where the spec's float64 does not.
"""
from __future__ import annotations

from typing import List

import torch
import triton
import triton.language as tl

from spec.mxtensor import MXTensor

from ..registry import register, register_variant, variants
from ._common import autotune_enabled, cdiv, interpret_mode, launch_gated, sm_count, triton_reasons
from ._fpbits import round_f32_canonical_nan
from ._mxfp8 import fp8_mma_widened, mx_block_dot, scale_value
from ._tiles import grouped_tile
from .quantize import dequantize_bf16_flat

__all__ = ["mxfp8_gemm", "mxfp8_gemm_tensors", "scale_offsets"]

_OUT_TORCH = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_ELEM_TORCH = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_DOT_SCALED_FORMAT = {"e4m3": "e4m3", "e5m2": "e5m2"}


def _empty(shape, dtype, device):
    """Output allocation (never initialised); tests replace it with a 0xFF-filled one (poison)."""
    return torch.empty(shape, dtype=dtype, device=device)


# --------------------------------------------------------------------------------------------------
# device helpers
# --------------------------------------------------------------------------------------------------
@triton.jit
def scale_offsets(rows, kblock, stride_row, stride_col, col_groups, SWIZZLED: tl.constexpr):
    """Element offsets of scale bytes S[rows, kblock] (broadcasting int tensors) in an MXTensor's scale
    buffer: compact (row stride, column stride) or swizzled (SEMANTICS 3 step 3, col_groups = C'/4)."""
    if SWIZZLED:
        return (((rows // 128) * col_groups + kblock // 4) * 512 + (rows % 32) * 16
                + ((rows % 128) // 32) * 4 + (kblock % 4))
    else:
        return rows * stride_row + kblock * stride_col


# --------------------------------------------------------------------------------------------------
# sm89 / sm90 kernel: fp8 dot per K block, fp32 rescale
# --------------------------------------------------------------------------------------------------
@triton.jit
def _mxfp8_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr,
    M, N, K, M_BUCKET,
    stride_am, stride_ak, stride_bn, stride_bk,
    stride_as_row, stride_as_col, stride_bs_row, stride_bs_col, a_col_groups, b_col_groups,
    stride_cm, stride_cn, gate_ptr,
    A_SWIZZLED: tl.constexpr, B_SWIZZLED: tl.constexpr, OUT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, WIDEN_F16: tl.constexpr, GATED: tl.constexpr = False,
):
    """One output tile per program; GATED: the bf16 route's exact fallback, launched persistent (one
    program per SM) so that when *gate_ptr is 0, as it almost always is, it costs one short wave."""
    if GATED:
        if tl.load(gate_ptr) != 0:
            num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
            for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
                _mxfp8_gemm_tile(
                    tile, a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, M, N, K,
                    stride_am, stride_ak, stride_bn, stride_bk,
                    stride_as_row, stride_as_col, stride_bs_row, stride_bs_col, a_col_groups, b_col_groups,
                    stride_cm, stride_cn, A_SWIZZLED, B_SWIZZLED, OUT_DTYPE,
                    BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, WIDEN_F16)
    else:
        _mxfp8_gemm_tile(
            tl.program_id(0), a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, M, N, K,
            stride_am, stride_ak, stride_bn, stride_bk,
            stride_as_row, stride_as_col, stride_bs_row, stride_bs_col, a_col_groups, b_col_groups,
            stride_cm, stride_cn, A_SWIZZLED, B_SWIZZLED, OUT_DTYPE,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K, WIDEN_F16)


@triton.jit
def _mxfp8_gemm_tile(
    pid, a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk,
    stride_as_row, stride_as_col, stride_bs_row, stride_bs_col, a_col_groups, b_col_groups,
    stride_cm, stride_cn,
    A_SWIZZLED: tl.constexpr, B_SWIZZLED: tl.constexpr, OUT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, WIDEN_F16: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = tl.minimum(offs_m, M - 1)  # clamped: tail rows load real data, their results are masked
    rows_b = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, 32)
    a_ptrs = a_ptr + rows_a.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + rows_b.to(tl.int64)[:, None] * stride_bn + offs_k[None, :] * stride_bk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for j in tl.static_range(BLOCK_K // 32):
            kk = k0 + j * 32
            kb = kk // 32
            sa_ptrs = a_scale_ptr + scale_offsets(rows_a, kb, stride_as_row, stride_as_col, a_col_groups, A_SWIZZLED)
            sb_ptrs = b_scale_ptr + scale_offsets(rows_b, kb, stride_bs_row, stride_bs_col, b_col_groups, B_SWIZZLED)
            if EVEN_K:
                a = tl.load(a_ptrs + kk * stride_ak)
                b = tl.load(b_ptrs + kk * stride_bk)
                sa = tl.load(sa_ptrs).to(tl.int32)
                sb = tl.load(sb_ptrs).to(tl.int32)
            else:  # K is a multiple of 32: a sub-block is wholly inside or wholly past K
                inside = (kk + offs_k) < K
                a = tl.load(a_ptrs + kk * stride_ak, mask=inside[None, :], other=0.0)
                b = tl.load(b_ptrs + kk * stride_bk, mask=inside[None, :], other=0.0)
                sa = tl.load(sa_ptrs, mask=(rows_a * 0 + kk) < K, other=127).to(tl.int32)
                sb = tl.load(sb_ptrs, mask=(rows_b * 0 + kk) < K, other=127).to(tl.int32)
            partial = mx_block_dot(a, tl.trans(b), WIDEN_F16)  # one MX block, fp32 sum from +0
            factor = scale_value(sa)[:, None] * scale_value(sb)[None, :]  # exact: powers of two
            acc = tl.fma(partial, factor, acc)

    out = round_f32_canonical_nan(acc, OUT_DTYPE)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, out, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


# --------------------------------------------------------------------------------------------------
# sm100 kernel: tl.dot_scaled (UNVERIFIED on hardware, see module docstring)
# --------------------------------------------------------------------------------------------------
@triton.jit
def _mxfp8_gemm_dot_scaled_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr,
    M, N, K, M_BUCKET,
    stride_am, stride_ak, stride_bn, stride_bk,
    stride_as_row, stride_as_col, stride_bs_row, stride_bs_col, a_col_groups, b_col_groups,
    stride_cm, stride_cn, gate_ptr,
    A_SWIZZLED: tl.constexpr, B_SWIZZLED: tl.constexpr, OUT_DTYPE: tl.constexpr,
    A_FORMAT: tl.constexpr, B_FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = tl.minimum(offs_m, M - 1)
    rows_b = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 32)
    a_ptrs = a_ptr + rows_a.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + rows_b.to(tl.int64)[:, None] * stride_bn + offs_k[None, :] * stride_bk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kb = k0 // 32 + offs_kb
        if EVEN_K:
            a = tl.load(a_ptrs + k0 * stride_ak)
            b = tl.load(b_ptrs + k0 * stride_bk)
            sa = tl.load(a_scale_ptr + scale_offsets(rows_a[:, None], kb[None, :], stride_as_row, stride_as_col,
                                                     a_col_groups, A_SWIZZLED))
            sb = tl.load(b_scale_ptr + scale_offsets(rows_b[:, None], kb[None, :], stride_bs_row, stride_bs_col,
                                                     b_col_groups, B_SWIZZLED))
        else:
            inside = (k0 + offs_k) < K
            a = tl.load(a_ptrs + k0 * stride_ak, mask=inside[None, :], other=0.0)
            b = tl.load(b_ptrs + k0 * stride_bk, mask=inside[None, :], other=0.0)
            kb_inside = (kb * 32) < K
            sa = tl.load(a_scale_ptr + scale_offsets(rows_a[:, None], kb[None, :], stride_as_row, stride_as_col,
                                                     a_col_groups, A_SWIZZLED), mask=kb_inside[None, :], other=127)
            sb = tl.load(b_scale_ptr + scale_offsets(rows_b[:, None], kb[None, :], stride_bs_row, stride_bs_col,
                                                     b_col_groups, B_SWIZZLED), mask=kb_inside[None, :], other=127)
        acc = tl.dot_scaled(a, sa, A_FORMAT, tl.trans(b), sb, B_FORMAT, acc)

    out = round_f32_canonical_nan(acc, OUT_DTYPE)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, out, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


# --------------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------------
def _sm90_configs():
    """Tiles for the H200 pointer kernel: 128 x 128 with 8 warps (two warpgroups: one rescales while the
    other's wgmma runs) and 64-row tiles for small M. 16-warp 128 x 256 tiles were dropped: with the
    partial and the accumulator both live (64 + 64 registers) they spill at the 128-register cap.
    fp8 stage = (BM + BN) * BK bytes."""
    cfgs = []
    for bm, bn, bk, warps, stages in ((128, 128, 128, 8, 4), (128, 128, 64, 8, 5), (64, 128, 128, 4, 4),
                                      (128, 64, 128, 4, 4)):
        cfgs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                                  num_warps=warps, num_stages=stages))
    return cfgs


def _sm100_configs():
    cfgs = []
    for bm, bn, bk, warps, stages in ((128, 128, 128, 4, 4), (128, 256, 128, 8, 3), (128, 128, 256, 8, 3)):
        cfgs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                                  num_warps=warps, num_stages=stages))
    return cfgs


def _even_k(args):
    return args["K"] % args["BLOCK_K"] == 0


_KEY = ["M_BUCKET", "N", "K", "A_SWIZZLED", "B_SWIZZLED", "OUT_DTYPE"]
_gemm_sm90 = triton.autotune(configs=_sm90_configs(), key=_KEY)(
    triton.heuristics({"EVEN_K": _even_k})(_mxfp8_gemm_kernel))
_gemm_sm90_fixed = triton.heuristics({"EVEN_K": _even_k})(_mxfp8_gemm_kernel)
_gemm_sm100 = triton.autotune(configs=_sm100_configs(), key=_KEY + ["A_FORMAT", "B_FORMAT"])(
    triton.heuristics({"EVEN_K": _even_k})(_mxfp8_gemm_dot_scaled_kernel))
_gemm_sm100_fixed = triton.heuristics({"EVEN_K": _even_k})(_mxfp8_gemm_dot_scaled_kernel)

_FIXED_SM90 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)
_FIXED_SM100 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
_INTERPRET = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=1)


def m_bucket(m: int) -> int:
    """Autotune key for a token count: the next power of two (at least 128), so a varying M retunes
    once per bucket, not per value."""
    return max(128, triton.next_power_of_2(max(int(m), 1)))


# --------------------------------------------------------------------------------------------------
# wrappers
# --------------------------------------------------------------------------------------------------
def _operand(t: MXTensor):
    """(data with unit K stride, scale tensor, scale strides, col_groups, swizzled) of a K-blocked MXTensor.

    A transposed view (K stride != 1) is copied to contiguous: the fp8 wgmma wants K-major tiles, and
    the copy (one byte per element) costs far less than the GEMM it feeds."""
    data = t.data if t.data.stride(1) == 1 else t.data.contiguous()
    k_blocks = t.data.shape[1] // 32
    if t.scale_layout == "swizzled":
        return data, t.scale, (0, 0), -(-k_blocks // 4), True
    return data, t.scale, (t.scale.stride(0), t.scale.stride(1)), 0, False


def use_dot_scaled(device: torch.device) -> bool:
    """tl.dot_scaled only where it is native (sm100+); sm89/sm90 run the per-block fp8 kernels."""
    return device.type == "cuda" and not interpret_mode() and torch.cuda.get_device_capability(device) >= (10, 0)


def _tma_ok(t: torch.Tensor) -> bool:
    return (t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0)


# --------------------------------------------------------------------------------------------------
# kernel variants: registry entries (backends/registry.py), each with its reasons and priority
# --------------------------------------------------------------------------------------------------
GEMM_OP = "mxfp8_gemm"
# Priority (the automatic choice: the highest whose reasons are empty): dot_scaled where native
# (sm100+); on sm90 the Gluon route (1.013x bf16 cuBLAS on the H200, BENCHMARKS.md), else the bf16
# route (dequantize, one cuBLAS bf16 GEMM), both with the gated exact fallback; then the pointer
# block kernel (sm89). The interpreter runs bf16 and pointer (auto: bf16).
GEMM_VARIANTS = {"dot_scaled": 50, "gluon": 40, "bf16": 30, "pointer": 10}


def _tma_ok_launched(t: torch.Tensor) -> bool:
    """_tma_ok for the codes the launcher will use: a K-strided operand is first copied K-contiguous
    (mxfp8_gemm_tensors), into a fresh allocation whose rows (K % 32 == 0 bytes) are 16-byte aligned."""
    return t.stride(1) != 1 or _tma_ok(t)


def gemm_variant_reasons(variant: str, a: MXTensor, b: MXTensor, out_dtype: str = "bfloat16") -> List[str]:
    """Why GEMM kernel `variant` cannot run these operands (empty: it can)."""
    device = a.data.device
    if variant == "dot_scaled":
        if use_dot_scaled(device):
            return []
        if interpret_mode():  # test_gemm_triton runs the emulation by name, on other scale bytes
            return ["tl.dot_scaled is native on sm100+ only (the interpreter's emulation misreads scale byte 254)"]
        return ["tl.dot_scaled is native on sm100+ only"]
    if variant == "gluon":
        return gluon_reasons(a, b, out_dtype)
    if variant == "bf16":
        if device.type == "cuda" and not interpret_mode() and torch.cuda.get_device_capability(device) < (9, 0):
            cc = torch.cuda.get_device_capability(device)
            return [f"the bf16 route needs compute capability >= 9.0, {device} is {cc[0]}.{cc[1]}"]
        return []
    if variant == "pointer":
        return []
    raise ValueError(f"variant: expected one of {', '.join(GEMM_VARIANTS)}, got {variant!r}")


def _gemm_check(variant):
    return lambda a, b, out_dtype="bfloat16": gemm_variant_reasons(variant, a, b, out_dtype)


for _name, _priority in GEMM_VARIANTS.items():
    register_variant(GEMM_OP, "triton", _name, _priority, check=_gemm_check(_name))


def gemm_variant(a: MXTensor, b: MXTensor, out_dtype: str = "bfloat16") -> str:
    """The automatic choice among GEMM_VARIANTS (the dispatcher's rule: the highest priority whose
    reasons are empty; the pointer kernel serves every call)."""
    for v in variants(GEMM_OP, "triton"):
        if not gemm_variant_reasons(v.name, a, b, out_dtype):
            return v.name
    return "pointer"


def _roundup(n: int, m: int) -> int:
    return -(-n // m) * m


# Scale bytes for which every code of a block dequantizes to a normal bf16 (or zero): e4m3 codes span
# [2^-9, 448 = 1.75 * 2^8], e5m2 [2^-16, 57344 = 1.75 * 2^15], bf16's normals [2^-126, ~2^128).
BF16_SAFE_SCALE_BYTES = {"e4m3": (10, 246), "e5m2": (17, 239)}


def bf16_matmul_fp32_sum(a16: torch.Tensor, b16: torch.Tensor, out: torch.Tensor) -> None:
    """out = a16 @ b16^T with every product exact and the sum in fp32, rounded once to out's dtype."""
    if out.device.type != "cuda":
        # CPU (interpreter tests): the same arithmetic, bf16 x bf16 products are exact in fp32
        out.copy_(a16.float() @ b16.float().t())
        return
    flags = torch.backends.cuda.matmul
    prev = flags.allow_bf16_reduced_precision_reduction
    # no bf16 split-K partial sums; the switch is process-wide (restored below), so a matmul that
    # another thread runs during this call sees it off too
    flags.allow_bf16_reduced_precision_reduction = False
    try:
        if out.dtype == torch.bfloat16 and out.is_contiguous():
            torch.mm(a16, b16.t(), out=out)
        elif out.dtype == torch.bfloat16:
            out.copy_(torch.mm(a16, b16.t()))
        else:
            out.copy_(torch.mm(a16, b16.t(), out_dtype=torch.float32))
    finally:
        flags.allow_bf16_reduced_precision_reduction = prev


def gluon_reasons(a: MXTensor, b: MXTensor, out_dtype: str = "bfloat16") -> List[str]:
    """Why the Gluon sm90 route (gemm_gluon.py) cannot run these operands; empty when it can."""
    dev = a.data.device
    if interpret_mode() or dev.type != "cuda":
        return ["the Gluon GEMM runs on CUDA only (no interpreter)"]
    reasons = []
    if torch.cuda.get_device_capability(dev)[0] != 9:
        reasons.append("the Gluon GEMM needs an sm90 GPU (wgmma with a register operand)")
    try:
        from . import _gluon_compat
    except ImportError as exc:  # a Triton without Gluon's Hopper API
        return reasons + [f"Gluon unavailable in this Triton ({triton.__version__}): {exc}"]
    reasons += _gluon_compat.version_reasons()
    if out_dtype != "bfloat16":
        reasons.append(f"the Gluon GEMM writes bf16 only, out_dtype is {out_dtype}")
    if not _tma_ok_launched(b.data):
        reasons.append("b's codes must be K-contiguous with 16-byte aligned base and rows (TMA)")
    return reasons


def exact_fallback(a: MXTensor, b: MXTensor, out: torch.Tensor, flag: torch.Tensor) -> None:
    """The exact per-block kernel, persistent and gated on *flag: it recomputes every output tile when a
    guard was raised, and returns at once otherwise (no host sync once compiled -- launch_gated -- and
    CUDA-graph safe)."""
    m, k = a.data.shape
    n = b.data.shape[0]
    a_data, a_scale, (sar, sac), a_groups, a_swz = _operand(a)
    b_data, b_scale, (sbr, sbc), b_groups, b_swz = _operand(b)
    cfg = _INTERPRET if interpret_mode() else _FIXED_SM90
    tiles = cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"])
    programs = tiles if interpret_mode() else min(tiles, _sm_count(out.device))
    launch_gated(
        _gemm_sm90_fixed, (programs,), flag,
        a_data, a_scale, b_data, b_scale, out, m, n, k, m_bucket(m),
        a_data.stride(0), a_data.stride(1), b_data.stride(0), b_data.stride(1),
        sar, sac, sbr, sbc, a_groups, b_groups, out.stride(0), out.stride(1), flag,
        A_SWIZZLED=a_swz, B_SWIZZLED=b_swz, OUT_DTYPE=tl.bfloat16 if out.dtype == torch.bfloat16 else tl.float32,
        WIDEN_F16=fp8_mma_widened(out.device), GATED=True, **cfg)


def gluon_gemm_kernel(a16: torch.Tensor, b: MXTensor, out: torch.Tensor, flag: torch.Tensor, config=None) -> None:
    """The Gluon route's GEMM alone (gemm_gluon.launch): out [M, N] bf16 (TMA-addressable) = a16 [M, K]
    bf16 @ dq(b)^T, raising *flag for b's scale bytes outside BF16_SAFE_SCALE_BYTES or an output not
    finite in bf16."""
    from . import gemm_gluon

    b_data, b_scale, strides, b_groups, b_swz = _operand(b)
    gemm_gluon.launch(a16, b_data.view(torch.uint8), b_scale, strides, b_groups, b_swz, b.elem == "e5m2",
                      BF16_SAFE_SCALE_BYTES[b.elem], out, flag, config)


def _launch_gluon(a: MXTensor, b: MXTensor, out: torch.Tensor, config=None) -> torch.Tensor:
    """The Gluon sm90 route: a dequantized to bf16 by the guarded flat pass, b's codes widened in the
    GEMM's registers (gluon_gemm_kernel), the exact kernel as the gated fallback. An out whose rows are
    not TMA-addressable gets a padded buffer, copied back."""
    flag = torch.zeros(1, dtype=torch.int32, device=out.device)
    a16 = dequantize_bf16_flat(a, guard=(flag, *BF16_SAFE_SCALE_BYTES[a.elem]))
    m, n = out.shape
    # TMA needs 16-byte aligned rows: otherwise a padded buffer, its [m, n] view written, then copied
    dst = out if _tma_ok(out) else torch.empty((m, _roundup(n, 8)), dtype=out.dtype, device=out.device)[:, :n]
    gluon_gemm_kernel(a16, b, dst, flag, config)
    if dst is not out:
        out.copy_(dst)
    exact_fallback(a, b, out, flag)
    return out


def _launch_bf16(a: MXTensor, b: MXTensor, out: torch.Tensor) -> torch.Tensor:
    """The sm90 route: dequantize a and b to bf16 (exact for scale bytes in BF16_SAFE_SCALE_BYTES),
    one bf16 GEMM with fp32 accumulation (cuBLAS), then the exact per-block kernel as a gated
    fallback that recomputes everything when a guard flag was raised (a scale byte outside the
    safe range, a NaN or Inf operand): no host sync once the fallback is compiled (launch_gated),
    CUDA-graph safe, and the same products-exact-fp32-sum contract as the block kernels."""
    flag = torch.zeros(1, dtype=torch.int32, device=out.device)
    a16 = dequantize_bf16_flat(a, guard=(flag, *BF16_SAFE_SCALE_BYTES[a.elem]))
    b16 = dequantize_bf16_flat(b, guard=(flag, *BF16_SAFE_SCALE_BYTES[b.elem]))
    bf16_matmul_fp32_sum(a16, b16, out)
    exact_fallback(a, b, out, flag)
    return out


def _sm_count(device: torch.device) -> int:
    return sm_count(device)


def mxfp8_gemm_tensors(a: MXTensor, b: MXTensor, out: torch.Tensor, variant=None, config=None) -> torch.Tensor:
    """out[M, N] (preallocated bf16 or fp32, any strides) = a @ b^T for K-blocked MXTensors.
    variant: one of GEMM_VARIANTS (default gemm_variant; a named one that cannot run raises ValueError
    with its reasons); config: a fixed
    tile dict (for "gluon", one of gemm_gluon.CONFIGS' form)."""
    m, k = a.data.shape
    n = b.data.shape[0]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    a = a if a.data.stride(1) == 1 else a.replace(data=a.data.contiguous())
    b = b if b.data.stride(1) == 1 else b.replace(data=b.data.contiguous())
    out_dtype_name = "bfloat16" if out.dtype == torch.bfloat16 else "float32"
    variant = variant or gemm_variant(a, b, out_dtype_name)
    reasons = gemm_variant_reasons(variant, a, b, out_dtype_name)
    if variant == "dot_scaled" and interpret_mode():
        reasons = []  # the emulation, named by the tests (they avoid the scale byte it misreads)
    if reasons:  # a named kernel runs or raises: never another one in its place
        raise ValueError(f"variant {variant!r} cannot run here: " + "; ".join(reasons))
    if variant == "gluon":
        return _launch_gluon(a, b, out, config)
    if variant == "bf16":
        return _launch_bf16(a, b, out)
    a_data, a_scale, (sar, sac), a_groups, a_swz = _operand(a)
    b_data, b_scale, (sbr, sbc), b_groups, b_swz = _operand(b)
    out_dtype = tl.bfloat16 if out.dtype == torch.bfloat16 else tl.float32
    args = (a_data, a_scale, b_data, b_scale, out, m, n, k, m_bucket(m),
            a_data.stride(0), a_data.stride(1), b_data.stride(0), b_data.stride(1),
            sar, sac, sbr, sbc, a_groups, b_groups, out.stride(0), out.stride(1), a_data)
    meta = dict(A_SWIZZLED=a_swz, B_SWIZZLED=b_swz, OUT_DTYPE=out_dtype)
    if variant == "dot_scaled":
        meta.update(A_FORMAT=_DOT_SCALED_FORMAT[a.elem], B_FORMAT=_DOT_SCALED_FORMAT[b.elem])
        tuned, fixed, cfg = _gemm_sm100, _gemm_sm100_fixed, _FIXED_SM100
    else:
        meta.update(WIDEN_F16=fp8_mma_widened(out.device))
        tuned, fixed, cfg = _gemm_sm90, _gemm_sm90_fixed, _FIXED_SM90
    if interpret_mode():
        cfg = _INTERPRET
    cfg = config or cfg
    if config is not None or interpret_mode() or not autotune_enabled():
        grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]),)
        fixed[grid](*args, **meta, **cfg)
    else:
        grid = lambda c: (cdiv(m, c["BLOCK_M"]) * cdiv(n, c["BLOCK_N"]),)  # noqa: E731
        tuned[grid](*args, **meta)
    return out


def _gemm_reasons(a, b, out_dtype="bfloat16") -> List[str]:
    reasons = triton_reasons(a, b)
    dev = a.data.device if isinstance(a, MXTensor) and isinstance(a.data, torch.Tensor) else None
    if dev is not None and dev.type == "cuda" and not interpret_mode():
        cc = torch.cuda.get_device_capability(dev)
        if cc < (8, 9):
            reasons.append(f"fp8 tensor-core dot needs compute capability >= 8.9, {dev} is {cc[0]}.{cc[1]}")
    for name, t in (("a", a), ("b", b)):
        if isinstance(t, MXTensor) and isinstance(t.data, torch.Tensor):
            if t.data.dtype != _ELEM_TORCH.get(t.elem):
                reasons.append(f"{name}: data dtype {t.data.dtype} does not match elem {t.elem!r}")
    return reasons


@register("mxfp8_gemm", "triton", check=_gemm_reasons)
def mxfp8_gemm(a: MXTensor, b: MXTensor, out_dtype: str = "bfloat16", variant=None) -> torch.Tensor:
    """The dispatcher passes the GEMM_VARIANTS entry it chose (or the caller named)."""
    out = _empty((a.data.shape[0], b.data.shape[0]), _OUT_TORCH[out_dtype], a.data.device)
    return mxfp8_gemm_tensors(a, b, out, variant=variant)
