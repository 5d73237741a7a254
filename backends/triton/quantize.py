"""Triton MXFP8 quantize / dequantize (SEMANTICS.md sections 1-2), byte-equal to spec.quantize for every
element format, scale mode and non-finite policy, with compact or swizzled scales.

Quantize kernel (`_quantize_kernel`, memory bound)
- Views: the input is [P, M, N] (contiguous; a single-axis quantize also reads in place an input
  whose rows / batches are strided, and whose N is runs of D elements a fixed step apart, such as a
  [.., H, 128] slice of a [.., H, 256] projection: `_strided_geometry`, compact scales). "Row"
  output = blocks of 32 along N, "col" output = blocks of 32 along M. axis=-1 of any tensor is the row mode of [1, prod(lead), K]; axis=0 the col
  mode of [1, M, prod(rest)]; a middle axis the col mode with P = product of the axes before it.
  axis=(-1, 0) / (0, -1) is ONE pass in the dual mode of [1, M, prod(rest)]: each [BM, BN] tile is
  loaded once (16-byte vector loads), both amaxes come from the same registers, both code arrays
  and both scale arrays are written once. Other tuples run one pass per axis.
- Per tile: x widened to fp32 exactly (bf16 by shifting its bits: Triton's interpreter flushes bf16
  subnormals in its cast; on the GPU the shift is what the cast does). Row blocks = reshape
  [BM, BN/32, 32] reduced over axis 2, col blocks = reshape [BM/32, 32, BN] reduced over axis 1; the
  multiplier is broadcast back over the same view, so data moves between threads only inside the
  reductions (warp shuffles; shared memory when a 32-row block spans warps).
- Fast path (every tile without NaN / Inf, i.e. nearly always): the block amax is a NaN-propagating
  max of |x| (one max.NaN per element per direction) and a tile whose amaxes are all finite is
  exactly a tile the rules below reduce to: rceil as (bits(amax * R) + 0x7FFFFF) >> 23 (0 when
  amax * R <= 2^-127; e <= 253 for finite amax, so s_inv = 2^(127-e) is a normal number), y = x *
  s_inv (one fp32 multiply), and the code is Triton's fp32 -> fp8 cast, which on sm90 lowers to
  cvt.rn.satfinite.{e4m3,e5m2}x2.f32: round to nearest even, finite overflow saturated to +-max.
  For finite y that is exactly clamp-then-round (SEMANTICS 1.4), and no NaN can occur.
- Other tiles (NaN or Inf present): the full rules, one 32-column slice at a time, reloading the slice
  (an L1/L2 hit) so this path needs few registers: amax ignoring NaN (NaN lanes zeroed first: nothing
  depends on how max treats NaN operands, and NumPy's fmax in the interpreter returns NaN for
  signaling NaNs), the scale byte of the chosen mode and policy from the fp32 bits (never log2 or a
  division), s_inv from the bits (2^-127 subnormal for 254, NaN for 255), clamp to +-max before the
  cast, NaN lanes written as 0x7F.
- Without the hardware conversion (Triton's interpreter, which truncates fp32 -> fp8, and GPUs before
  sm90, where Triton goes through an fp16 round-toward-zero step) codes come from the same rounding
  done on the fp32 bits (`_encode_bits`). MXMLA_TRITON_SOFT_FP8=1 forces that path on the GPU too.
- Launched with enable_fp_fusion=False (no multiply-add contraction anywhere; spec rounds every op).
- Scales are written compact or directly in the swizzled layout (swizzle.swizzle_offset); a
  [128, 128] tile's row scales and its col scales are each one contiguous 512-byte swizzle tile.
  Padding of a swizzled buffer: where the scale matrix's padding lies inside the data grid (2-D views:
  always for col scales, and for row scales unless the row axis is the flattened tail of an N-D
  tensor), the launch grid is extended to roundup(M, 128) x roundup(N, 128); the extra tiles load
  zeros (masked), whose blocks get scale byte 0 in every mode, so the kernel writes every byte of a
  torch.empty buffer. Otherwise (N-D dual or a middle axis, when padding is needed) the buffer is
  zero-initialised with torch.zeros and the kernel writes the rest.
- Tiles (BM, BN, warps) autotuned per shape bucket (log2 of M and N) and mode from a short list with
  per-config register caps (`_quantize_configs`); interior tiles of divisible shapes run unmasked.
Bytes per element (bf16 in, dual): 2 read + 2 code bytes + 2/32 scale bytes = 4.0625.

Dequantize (`_dequantize_kernel`): same views and tiles; codes decoded by Triton's fp8 -> fp32 cast
on sm90 (exact) or on the bits (sign | mag << (23 - mbits) is the value times 2^(ebias-127), exact for
subnormal codes too), one fp32 multiply by 2^(e-127), RN to bf16 when asked; every NaN is written as
the canonical quiet NaN (0x7FC00000 / 0x7FC0), as spec does.
"""
from __future__ import annotations

import contextlib
import math
from typing import Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl

from spec.constants import BLOCK_SIZE, SCALE_MODES, SWIZZLE_COLS, SWIZZLE_ROWS
from spec.mxtensor import MXTensor
from spec.quantize import normalize_axes

from ..registry import register
from ._common import autotune_cached, cdiv, fast_launch, interpret_mode, triton_reasons
from ._fpbits import round_f32
from ._mxfp8 import bf16_unsafe
from ._mx_codec import (F32_ABS_MASK, F32_INF_BITS, F32_QNAN_BITS, HALF_SUBNORMAL_MANT, amax_nan, block_amax,
                        elem_meta, emit_codes, load_f32, use_hw_cvt)
from .swizzle import empty_output, swizzle_offset
from .tile_choice import pick

_ELEM_TORCH = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_SCALE_MODE_CODE = {name: i for i, name in enumerate(SCALE_MODES)}  # rceil 0, floor 1, ceil 2, even 3
assert _SCALE_MODE_CODE == {"rceil": 0, "floor": 1, "ceil": 2, "even": 3}
_X_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_OUT_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# --------------------------------------------------------------------------------------------------
# quantize kernel
# --------------------------------------------------------------------------------------------------
@triton.jit
def _row_scale_offsets(offs_m, offs_n0, N, ROW_LAST, ROW_CP, NB: tl.constexpr, ROW_SWIZZLED: tl.constexpr,
                       ROW_SPLIT: tl.constexpr, IDX64: tl.constexpr):
    """Offsets [len(offs_m), NB] of the row scales of blocks starting at column offs_n0 (a multiple of 32)."""
    blk = offs_n0 // 32 + tl.arange(0, NB)  # global block column
    if IDX64:
        blk = blk.to(tl.int64)
    if ROW_SWIZZLED:
        if ROW_SPLIT:  # S = [M * N / LAST, LAST / 32]: the flat row is split by the tensor's last axis
            col0 = blk * 32
            return swizzle_offset(offs_m[:, None] * (N // ROW_LAST) + (col0 // ROW_LAST)[None, :],
                                  ((col0 % ROW_LAST) // 32)[None, :], ROW_CP), blk
        else:
            return swizzle_offset(offs_m[:, None], blk[None, :], ROW_CP), blk
    else:
        return offs_m[:, None] * (N // 32) + blk[None, :], blk


@triton.jit
def _col_scale_offsets(m0, offs_n, batch, M, N, COL_CP, MB: tl.constexpr, COL_SWIZZLED: tl.constexpr,
                       IDX64: tl.constexpr):
    """Offsets [MB, len(offs_n)] of the col scales of the blocks starting at row m0 (a multiple of 32)."""
    mblk = m0 // 32 + tl.arange(0, MB)  # global block row
    if IDX64:
        mblk = mblk.to(tl.int64)
    if COL_SWIZZLED:  # S = [P * N, M / 32]
        return swizzle_offset(batch * N + offs_n[None, :], mblk[:, None], COL_CP), mblk
    else:  # compact [P, M / 32, N]
        return batch * (M // 32) * N + mblk[:, None] * N + offs_n[None, :], mblk


@triton.jit
def _x_cols(offs_n, SXH, X_INNER: tl.constexpr):
    """Input offsets of columns offs_n: contiguous, or runs of X_INNER elements SXH apart (the heads of
    a [.., H, D] view whose D is a slice of a wider last axis)."""
    if X_INNER == 0:
        return offs_n
    return (offs_n // X_INNER) * SXH + offs_n % X_INNER


@triton.jit
def _quantize_kernel(
    x_ptr, row_code_ptr, row_scale_ptr, col_code_ptr, col_scale_ptr,
    M, N,  # data extent of one [M, N] batch
    SXP, SXM, SXH,  # input strides (elements): batch, row, and the head step of a split N (X_INNER)
    GRID_M, GRID_N,  # extent covered by tiles (M, N, or both rounded up to 128 to write swizzle padding)
    ROW_LIM_M, ROW_LIM_N, COL_LIM_M, COL_LIM_N,  # scale-store limits in data coordinates
    ROW_LAST,  # row mode with swizzled scales of an N-D tensor: length of its last axis
    ROW_CP, COL_CP,  # padded column count C' of the swizzled scale matrices
    M_BUCKET, N_BUCKET,  # autotune keys only
    X_KIND: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr,
    ROW_SWIZZLED: tl.constexpr, COL_SWIZZLED: tl.constexpr, ROW_SPLIT: tl.constexpr,
    SCALE_MODE: tl.constexpr, NAN_BLOCK: tl.constexpr, HW_CVT: tl.constexpr, IDX64: tl.constexpr,
    IS_E5M2: tl.constexpr, INV_MAX_BITS: tl.constexpr, MAX_BITS: tl.constexpr, EMAX: tl.constexpr,
    MBITS: tl.constexpr, CODE_SHIFT: tl.constexpr, ROUND_HALF: tl.constexpr, EXP_REBIAS: tl.constexpr,
    MIN_NORMAL_BITS: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr,
    INTERPRET: tl.constexpr, MASKED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    X_INNER: tl.constexpr = 0,  # 0: column n of the input at +n; else at (n // X_INNER) * SXH + n % X_INNER
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(GRID_N, BN)
    tiles_per_batch = tl.cdiv(GRID_M, BM) * tiles_n
    batch = pid // tiles_per_batch
    tile = pid % tiles_per_batch
    pid_m = tile // tiles_n  # consecutive programs walk along N: one row band streams through DRAM
    pid_n = tile % tiles_n
    m0 = pid_m * BM
    n0 = pid_n * BN
    offs_m = m0 + tl.arange(0, BM)
    offs_n = n0 + tl.arange(0, BN)
    if IDX64:
        offs_m = offs_m.to(tl.int64)
        batch = batch.to(tl.int64)
    base = batch * M * N
    offs = base + offs_m[:, None] * N + offs_n[None, :]  # the outputs' (contiguous) element offsets
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    x_row0 = batch * SXP + offs_m[:, None] * SXM
    x = load_f32(x_ptr + x_row0 + _x_cols(offs_n, SXH, X_INNER)[None, :], mask, X_KIND, MASKED)

    # NaN-propagating block amaxes: NaN marks blocks holding NaN, Inf blocks holding Inf; on a finite
    # tile they are the spec's amaxes. Both directions see the same elements, so the row amaxes decide
    # for the dual kernel.
    if ROW:
        x_row = tl.reshape(x, [BM, BN // 32, 32])
        row_amax = amax_nan(x_row, 2, INTERPRET)
        tile_finite = tl.max(tl.where(row_amax < float("inf"), 0, 1)) == 0
    else:
        x_col = tl.reshape(x, [BM // 32, 32, BN])
        col_amax = amax_nan(x_col, 1, INTERPRET)
        tile_finite = tl.max(tl.where(col_amax < float("inf"), 0, 1)) == 0

    if tile_finite:  # the common case: no NaN / Inf anywhere in the tile
        if ROW:
            s_off, blk = _row_scale_offsets(offs_m, n0, N, ROW_LAST, ROW_CP, BN // 32, ROW_SWIZZLED, ROW_SPLIT, IDX64)
            s_mask = (offs_m[:, None] < ROW_LIM_M) & (blk[None, :] * 32 < ROW_LIM_N)
            emit_codes(x_row, row_amax, row_amax != row_amax, offs, mask, row_code_ptr, row_scale_ptr, s_off, s_mask,
                  2, BM, BN, True, MASKED, SCALE_MODE, NAN_BLOCK, HW_CVT, IS_E5M2, INV_MAX_BITS, MAX_BITS,
                  EMAX, MBITS, CODE_SHIFT, ROUND_HALF, EXP_REBIAS, MIN_NORMAL_BITS, SUB_MAGIC_BITS)
        if COL:
            if ROW:  # computed here, not before the branch: shuffles cannot sink into it, and a
                # [BM/32, BN] amax held across the row work costs registers
                x_col = tl.reshape(x, [BM // 32, 32, BN])
                col_amax = amax_nan(x_col, 1, INTERPRET)
            s_off, mblk = _col_scale_offsets(m0, offs_n, batch, M, N, COL_CP, BM // 32, COL_SWIZZLED, IDX64)
            s_mask = (mblk[:, None] * 32 < COL_LIM_M) & (offs_n[None, :] < COL_LIM_N)
            emit_codes(x_col, col_amax, col_amax != col_amax, offs, mask, col_code_ptr, col_scale_ptr, s_off, s_mask,
                  1, BM, BN, True, MASKED, SCALE_MODE, NAN_BLOCK, HW_CVT, IS_E5M2, INV_MAX_BITS, MAX_BITS,
                  EMAX, MBITS, CODE_SHIFT, ROUND_HALF, EXP_REBIAS, MIN_NORMAL_BITS, SUB_MAGIC_BITS)
    else:
        # NaN / Inf in the tile (rare): the full rules (amax ignoring NaN, the policy's scale bytes,
        # clamp, NaN codes), one 32-column slice at a time, reloading the slice (an L1/L2 hit) so this
        # path needs few registers and does not lower the occupancy of the common one.
        for c in range(BN // 32):
            offs_c = n0 + c * 32 + tl.arange(0, 32)
            offs_s = base + offs_m[:, None] * N + offs_c[None, :]
            mask_s = (offs_m[:, None] < M) & (offs_c[None, :] < N)
            xs = load_f32(x_ptr + x_row0 + _x_cols(offs_c, SXH, X_INNER)[None, :], mask_s, X_KIND, MASKED)
            if ROW:
                xs_row = tl.reshape(xs, [BM, 1, 32])
                bits = xs_row.to(tl.int32, bitcast=True) & F32_ABS_MASK
                s_off, blk = _row_scale_offsets(offs_m, n0 + c * 32, N, ROW_LAST, ROW_CP, 1, ROW_SWIZZLED,
                                                ROW_SPLIT, IDX64)
                s_mask = (offs_m[:, None] < ROW_LIM_M) & (blk[None, :] * 32 < ROW_LIM_N)
                emit_codes(xs_row, block_amax(xs_row, 2), tl.max(bits, axis=2) >= F32_INF_BITS, offs_s, mask_s,
                      row_code_ptr, row_scale_ptr, s_off, s_mask, 2, BM, 32, False, MASKED, SCALE_MODE,
                      NAN_BLOCK, HW_CVT, IS_E5M2, INV_MAX_BITS, MAX_BITS, EMAX, MBITS, CODE_SHIFT, ROUND_HALF,
                      EXP_REBIAS, MIN_NORMAL_BITS, SUB_MAGIC_BITS)
            if COL:
                xs_col = tl.reshape(xs, [BM // 32, 32, 32])
                bits = xs_col.to(tl.int32, bitcast=True) & F32_ABS_MASK
                s_off, mblk = _col_scale_offsets(m0, offs_c, batch, M, N, COL_CP, BM // 32, COL_SWIZZLED, IDX64)
                s_mask = (mblk[:, None] * 32 < COL_LIM_M) & (offs_c[None, :] < COL_LIM_N)
                emit_codes(xs_col, block_amax(xs_col, 1), tl.max(bits, axis=1) >= F32_INF_BITS, offs_s, mask_s,
                      col_code_ptr, col_scale_ptr, s_off, s_mask, 1, BM, 32, False, MASKED, SCALE_MODE,
                      NAN_BLOCK, HW_CVT, IS_E5M2, INV_MAX_BITS, MAX_BITS, EMAX, MBITS, CODE_SHIFT, ROUND_HALF,
                      EXP_REBIAS, MIN_NORMAL_BITS, SUB_MAGIC_BITS)


def _quantize_configs() -> List[triton.Config]:
    """(BM, BN, warps, register cap). Triton lays a tile out with 16 contiguous bf16 per thread and the
    warps stacked along M, so a 32-row col block stays inside one warp only for the 1-warp tiles
    (reductions by shuffles); taller multi-warp tiles reduce through shared memory. The register caps
    are what ptxas needs without spilling (checked on sm90 with ptxas from CUDA 13); left alone it
    takes more for the branchy kernel and lowers occupancy (a 1-warp tile at 96 registers: 21 warps
    per SM, each with 4 KB of loads in flight)."""
    shapes = [(32, 64, 1, 96), (32, 128, 1, 168), (32, 128, 2, 104), (64, 64, 2, 128), (64, 128, 4, 128)]
    return [triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=1, maxnreg=r) for bm, bn, w, r in shapes]


def _prune_configs(configs, named_args, **kwargs):
    """Small problems (under 4M elements: launch-bound, and every new shape bucket or mode would compile
    and time each config) run the first, smallest tile; larger ones tune over the list."""
    # Triton 3.6 passes keyword launch arguments in kwargs and only positional ones in named_args.
    args = {**named_args, **kwargs}
    if args["M"] * args["N"] < (1 << 22):
        return configs[:1]
    return configs


def _masked(args) -> bool:
    """Masks are needed unless every tile is full and every scale position of the grid is stored."""
    bm, bn = args["BM"], args["BN"]
    grid_m, grid_n = _roundup(args["GRID_M"], bm), _roundup(args["GRID_N"], bn)
    m, n = args["M"], args["N"]
    lims = [(m, n)]
    if args["ROW"]:
        lims.append((args["ROW_LIM_M"], args["ROW_LIM_N"]))
    if args["COL"]:
        lims.append((args["COL_LIM_M"], args["COL_LIM_N"]))
    return any(lm != grid_m or ln != grid_n for lm, ln in lims)


def _tune_bench(fn, quantiles):
    """Autotuning timer: each candidate runs ~25 ms (the default 100 ms per config makes the first call
    of every shape bucket several seconds long); these kernels take well under a millisecond."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


def _tile_heuristic(configs, named):
    """The tile without timing, from the key's size buckets (M, N at the top of theirs): problems under
    4M elements the first, smallest tile (as _prune_configs); larger ones one warp of 32 rows (col
    blocks reduced by shuffles) by 128 columns, or 64 where rows are at most 128 wide. On the H200 it is
    what autotuning chose at 8 of the 10 recorded keys (tests/test_tile_choice.py names the others)."""
    mb, nb = named["M_BUCKET"], named["N_BUCKET"]
    if mb + nb <= 22:
        return configs[0]
    return pick(configs, BM=32, BN=64 if nb <= 7 else 128, num_warps=1)


_quantize_heuristic = triton.heuristics({"MASKED": _masked})(_quantize_kernel)
_quantize_tuned = autotune_cached(
    configs=_quantize_configs(),
    key=["M_BUCKET", "N_BUCKET", "X_KIND", "ROW", "COL", "ROW_SWIZZLED", "COL_SWIZZLED", "SCALE_MODE",
         "NAN_BLOCK", "IS_E5M2"],
    prune_configs_by={"early_config_prune": _prune_configs},
    do_bench=_tune_bench,
    heuristic=_tile_heuristic,
)(_quantize_heuristic)

# (BM, BN, num_warps) used instead of the heuristic / autotuning: in the interpreter (the first tile of
# the list, the one calls under 4M elements always run), and while `forced_config` is active (tests
# run every config on the GPU this way).
_INTERPRET_CONFIG = (32, 64, 1)
_forced_config: Optional[Tuple[int, int, int]] = None


@contextlib.contextmanager
def forced_config(bm: int, bn: int, num_warps: int):
    """Run the quantize / dequantize kernels with this tile instead of the autotuned one."""
    global _forced_config
    prev, _forced_config = _forced_config, (bm, bn, num_warps)
    try:
        yield
    finally:
        _forced_config = prev


def _fixed_tile() -> Optional[Tuple[int, int, int]]:
    """The tile to launch instead of the autotuner's choice, or None to let it choose."""
    if _forced_config is not None:
        return _forced_config
    return _INTERPRET_CONFIG if interpret_mode() else None


def _register_cap(tile: Tuple[int, int, int]) -> Optional[int]:
    """The autotune list's register cap for this tile (None when the tile is not in the list)."""
    if interpret_mode():
        return None
    caps = [c.maxnreg for c in _quantize_configs() if (c.kwargs["BM"], c.kwargs["BN"], c.num_warps) == tile]
    return caps[0] if caps else None


def config_space() -> List[Tuple[int, int, int]]:
    """Distinct (BM, BN, num_warps) tiles of the autotune space (tests run each one)."""
    return sorted({(c.kwargs["BM"], c.kwargs["BN"], c.num_warps) for c in _quantize_configs()})


def _bucket(n: int) -> int:
    return min(max(int(n) - 1, 1).bit_length(), 20)


def _roundup(n: int, m: int) -> int:
    return -(-n // m) * m


def _launch_quantize(x3: torch.Tensor, row: Optional[dict], col: Optional[dict], elem: str, scale_mode: str,
                     nonfinite: str, geometry: Optional[Tuple[int, ...]] = None) -> None:
    """One pass over x3 (contiguous [P, M, N]) writing the row and/or col outputs described by
    `row` / `col`: dict(code, scale (uint8 buffers), swizzled, lim (scale-store limits in data
    coordinates), cp (C' of the swizzled matrix), last (row: the tensor's last-axis length), pad
    (write the swizzle padding from an extended grid)). geometry: (P, M, N, SXP, SXM, SXH, X_INNER)
    when x3 is a strided tensor read in place (_strided_geometry); the outputs stay contiguous."""
    if geometry is None:
        p, m, n = x3.shape
        sxp, sxm, sxh, inner = m * n, n, 0, 0
    else:
        p, m, n, sxp, sxm, sxh, inner = geometry
    x_extent = (p - 1) * sxp + (m - 1) * sxm + ((n // inner - 1) * sxh + inner if inner else n)
    pad = bool((row and row["pad"]) or (col and col["pad"]))
    grid_m, grid_n = (_roundup(m, SWIZZLE_ROWS), _roundup(n, SWIZZLE_ROWS)) if pad else (m, n)
    row_last = row["last"] if row else n
    x_arg = x3.view(torch.int16) if x3.dtype == torch.bfloat16 else x3
    unused = row["code"] if row else col["code"]
    args = dict(
        x_ptr=x_arg,
        row_code_ptr=row["code"] if row else unused, row_scale_ptr=row["scale"] if row else unused,
        col_code_ptr=col["code"] if col else unused, col_scale_ptr=col["scale"] if col else unused,
        M=m, N=n, SXP=sxp, SXM=sxm, SXH=sxh, GRID_M=grid_m, GRID_N=grid_n,
        ROW_LIM_M=row["lim"][0] if row else 0, ROW_LIM_N=row["lim"][1] if row else 0,
        COL_LIM_M=col["lim"][0] if col else 0, COL_LIM_N=col["lim"][1] if col else 0,
        ROW_LAST=row_last, ROW_CP=row["cp"] if row else 4, COL_CP=col["cp"] if col else 4,
        M_BUCKET=_bucket(m), N_BUCKET=_bucket(n),
        X_KIND=_X_KIND[x3.dtype], ROW=row is not None, COL=col is not None,
        ROW_SWIZZLED=bool(row and row["swizzled"]), COL_SWIZZLED=bool(col and col["swizzled"]),
        ROW_SPLIT=bool(row and row["swizzled"] and row_last != n),
        SCALE_MODE=_SCALE_MODE_CODE[scale_mode], NAN_BLOCK=nonfinite == "nan_block",
        HW_CVT=use_hw_cvt(x3.device), INTERPRET=interpret_mode(),
        IDX64=p * (grid_m + 128) * (grid_n + 128) >= 2**31 or x_extent >= 2**31, X_INNER=inner,
        **elem_meta(elem),
    )

    def grid(meta):
        return (p * cdiv(grid_m, meta["BM"]) * cdiv(grid_n, meta["BN"]),)

    forced = _fixed_tile()
    if forced is not None:
        bm, bn, warps = forced
        fast_launch(_quantize_heuristic, grid({"BM": bm, "BN": bn}), **args, BM=bm, BN=bn, num_warps=warps,
                    num_stages=1, maxnreg=_register_cap(forced), enable_fp_fusion=False)
    else:
        fast_launch(_quantize_tuned, grid, **args, enable_fp_fusion=False)


def _new_output(shape: Tuple[int, ...], axis: int, elem: str, swizzled: bool, in_kernel_pad_ok: bool,
                device: torch.device):
    """(data, scale, launch dict) for one blocked axis: fp8 codes with the input's shape, the scale
    buffer (compact, or swizzled [R', C']) and what `_launch_quantize` needs to write them."""
    data = empty_output(shape, _ELEM_TORCH[elem], device)
    compact = list(shape)
    compact[axis] //= BLOCK_SIZE
    pad = False
    cp = 4
    if swizzled:
        rows = math.prod(n for i, n in enumerate(shape) if i != axis)
        cols = shape[axis] // BLOCK_SIZE
        rp, cp = _roundup(rows, SWIZZLE_ROWS), _roundup(cols, SWIZZLE_COLS)
        needs_pad = (rp, cp) != (rows, cols)
        pad = needs_pad and in_kernel_pad_ok
        if needs_pad and not pad:  # padding not reachable from the data grid: zero-initialised
            scale = torch.zeros((rp, cp), dtype=torch.uint8, device=device)
        else:
            scale = empty_output((rp, cp), torch.uint8, device)
    else:
        scale = empty_output(compact, torch.uint8, device)
    launch = dict(code=data.view(torch.uint8), scale=scale, swizzled=swizzled, cp=cp, pad=pad)
    return data, scale, launch


def _finish_lims(launch: dict, m: int, n: int) -> dict:
    """Scale-store limits: the data extent, or the whole padded grid when the kernel writes padding."""
    launch["lim"] = (_roundup(m, SWIZZLE_ROWS), _roundup(n, SWIZZLE_ROWS)) if launch["pad"] else (m, n)
    return launch


def _quantize_pair(x: torch.Tensor, elem, scale_mode, nonfinite, swizzled) -> Tuple[MXTensor, MXTensor]:
    """Rowwise (last axis) and columnwise (axis 0) of x in one pass over the [M, prod(rest)] view."""
    shape = tuple(x.shape)
    m, last = shape[0], shape[-1]
    n = math.prod(shape[1:])
    r_data, r_scale, row = _new_output(shape, len(shape) - 1, elem, swizzled, last == n, x.device)
    c_data, c_scale, col = _new_output(shape, 0, elem, swizzled, True, x.device)
    row["last"] = last
    if x.numel():
        # the grid extends for padding if either output asks; the other one masks its scale stores
        _launch_quantize(x.view(1, m, n), _finish_lims(row, m, n), _finish_lims(col, m, n), elem, scale_mode,
                         nonfinite)
    layout = "swizzled" if swizzled else "compact"
    return (MXTensor(r_data, r_scale, len(shape) - 1, elem, layout), MXTensor(c_data, c_scale, 0, elem, layout))


def _collapse(dims) -> Optional[Tuple[int, int]]:
    """(size, stride) of dims [(size, stride), ...] (outer first) as one strided axis, or None when they
    do not form one (size-1 dims are ignored)."""
    dims = [(n, st) for n, st in dims if n != 1]
    if not dims:
        return 1, 0
    for (_, outer), (n_in, inner) in zip(dims, dims[1:]):
        if outer != inner * n_in:
            return None
    return math.prod(n for n, _ in dims), dims[-1][1]


def _strided_geometry(x: torch.Tensor, axis: int) -> Optional[Tuple[int, ...]]:
    """(P, M, N, SXP, SXM, SXH, X_INNER) for reading x in place when quantizing along one axis (a slice
    of a wider last axis, such as k_nope or v of a fused [.., H, 256] projection), or None when x
    needs a contiguous copy. Row mode (the last axis): the leading axes must form one strided axis. Col
    mode: the axes before `axis` one strided axis, the axes after it a contiguous last axis, optionally
    below one strided head axis."""
    shape, strides = tuple(x.shape), x.stride()
    nd = len(shape)
    if strides[-1] != 1 and shape[-1] != 1:
        return None
    if axis == nd - 1:
        lead = _collapse(zip(shape[:-1], strides[:-1]))
        if lead is None:
            return None
        rows, sxm = lead
        return 1, rows, shape[-1], 0, sxm, 0, 0
    before = _collapse(zip(shape[:axis], strides[:axis]))
    if before is None:
        return None
    after = [(n, st) for n, st in zip(shape[axis + 1:], strides[axis + 1:]) if n != 1]
    if not after or (len(after) == 1 and after[0][1] == 1):
        inner, sxh = 0, 0
    elif len(after) == 2 and after[1][1] == 1 and after[1][0] % BLOCK_SIZE == 0:
        inner, sxh = after[1][0], after[0][1]
    else:
        return None
    p, sxp = before
    return p, shape[axis], math.prod(shape[axis + 1:]), sxp, strides[axis], sxh, inner


def _quantize_one(x: torch.Tensor, axis: int, elem, scale_mode, nonfinite, swizzled) -> MXTensor:
    """One axis of x; a strided x is read in place where _strided_geometry can describe it (compact
    scales), else through a contiguous copy."""
    shape = tuple(x.shape)
    layout = "swizzled" if swizzled else "compact"
    geometry = None
    if not x.is_contiguous():
        geometry = None if swizzled else _strided_geometry(x, axis)
        if geometry is None:
            x = x.contiguous()
    if axis == len(shape) - 1:  # row mode of [prod(lead), K]
        k = shape[-1]
        r = math.prod(shape[:-1])
        data, scale, row = _new_output(shape, axis, elem, swizzled, True, x.device)
        row["last"] = k
        if x.numel():
            x3 = x if geometry is not None else x.view(1, r, k)
            _launch_quantize(x3, _finish_lims(row, r, k), None, elem, scale_mode, nonfinite, geometry)
        return MXTensor(data, scale, axis, elem, layout)
    # col mode of [P, M, N]: P axes before, N the flattened axes after
    p, m, n = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
    data, scale, col = _new_output(shape, axis, elem, swizzled, p == 1, x.device)
    if x.numel():
        x3 = x if geometry is not None else x.view(p, m, n)
        _launch_quantize(x3, None, _finish_lims(col, m, n), elem, scale_mode, nonfinite, geometry)
    return MXTensor(data, scale, axis, elem, layout)


def quantize_reasons(x, axis=-1, elem="e4m3", scale_mode="rceil", nonfinite="saturate",
                     scale_layout="compact") -> List[str]:
    return triton_reasons(x, min_capability=(8, 0))


@register("mxfp8_quantize", "triton", check=quantize_reasons)
def mxfp8_quantize(x, axis=-1, elem="e4m3", scale_mode="rceil", nonfinite="saturate", scale_layout="compact"):
    axes, as_tuple = normalize_axes(axis, x.dim())
    swizzled = scale_layout == "swizzled"
    last = x.dim() - 1
    done: Dict[int, MXTensor] = {}
    if len(axes) > 1:  # several passes over one copy (a single axis may read a strided x in place)
        x = x.contiguous()
    if last > 0 and 0 in axes and last in axes:  # the one-pass dual kernel
        done[last], done[0] = _quantize_pair(x, elem, scale_mode, nonfinite, swizzled)
    for a in axes:
        if a not in done:
            done[a] = _quantize_one(x, a, elem, scale_mode, nonfinite, swizzled)
    outs = tuple(done[a] for a in axes)
    return outs if as_tuple else outs[0]


# --------------------------------------------------------------------------------------------------
# dequantize
# --------------------------------------------------------------------------------------------------
@triton.jit
def _decode(codes, IS_E5M2: tl.constexpr, HW_CVT: tl.constexpr):
    """fp32 value of fp8 codes (uint8), exact. GPU (sm90+): Triton's cast, cvt.rn.f16x2.{e4m3,e5m2}x2
    then f16 -> f32, both exact for every code. Otherwise on the bits: sign | mag << (23 - mbits) is
    the value times 2^(ebias - 127) for normal and subnormal codes alike, and the multiply by
    2^(127 - ebias) is exact (the interpreter's fp8 cast is wrong)."""
    if HW_CVT:
        if IS_E5M2:
            return codes.to(tl.float8e5, bitcast=True).to(tl.float32)
        else:
            return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    c = codes.to(tl.int32)
    mag = c & 0x7F
    sign = (c & 0x80) << 24
    if IS_E5M2:
        v = ((mag << 21) | sign).to(tl.float32, bitcast=True) * 5.192296858534828e33  # 2^112
        v = tl.where(mag == 0x7C, (sign | F32_INF_BITS).to(tl.float32, bitcast=True), v)
        is_nan = mag > 0x7C
    else:
        v = ((mag << 20) | sign).to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120
        is_nan = mag == 0x7F
    return tl.where(is_nan, float("nan"), v)


@triton.jit
def _scale_value(e):
    """fp32 2^(e - 127) (e = 0 -> the subnormal 2^-127, e = 255 -> NaN)."""
    bits = tl.where(e == 0, HALF_SUBNORMAL_MANT, e << 23)
    return tl.where(e == 255, F32_QNAN_BITS, bits).to(tl.float32, bitcast=True)


@triton.jit
def _dequantize_kernel(
    code_ptr, scale_ptr, out_ptr, M, N, CP, M_BUCKET, N_BUCKET,
    ROW: tl.constexpr, SWIZZLED: tl.constexpr, IS_E5M2: tl.constexpr, OUT_BF16: tl.constexpr,
    HW_CVT: tl.constexpr, IDX64: tl.constexpr, MASKED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    tiles_per_batch = tl.cdiv(M, BM) * tiles_n
    batch = pid // tiles_per_batch
    tile = pid % tiles_per_batch
    pid_m = tile // tiles_n
    pid_n = tile % tiles_n
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    if IDX64:
        offs_m = offs_m.to(tl.int64)
        batch = batch.to(tl.int64)
    offs = batch * M * N + offs_m[:, None] * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if MASKED:
        codes = tl.load(code_ptr + offs, mask=mask, other=0)
    else:
        codes = tl.load(code_ptr + offs)
    v = _decode(codes, IS_E5M2, HW_CVT)
    if ROW:
        blk = pid_n * (BN // 32) + tl.arange(0, BN // 32)
        if SWIZZLED:
            s_off = swizzle_offset(offs_m[:, None], blk[None, :], CP)
        else:
            s_off = offs_m[:, None] * (N // 32) + blk[None, :]
        if MASKED:
            e = tl.load(scale_ptr + s_off, mask=(offs_m[:, None] < M) & (blk[None, :] * 32 < N), other=0)
        else:
            e = tl.load(scale_ptr + s_off)
        e = e.to(tl.int32)
        x = tl.reshape(tl.reshape(v, [BM, BN // 32, 32]) * _scale_value(e)[:, :, None], [BM, BN])
    else:
        mblk = pid_m * (BM // 32) + tl.arange(0, BM // 32)
        if SWIZZLED:
            s_off = swizzle_offset(batch * N + offs_n[None, :], mblk[:, None], CP)
        else:
            s_off = batch * (M // 32) * N + mblk[:, None] * N + offs_n[None, :]
        if MASKED:
            e = tl.load(scale_ptr + s_off, mask=(mblk[:, None] * 32 < M) & (offs_n[None, :] < N), other=0)
        else:
            e = tl.load(scale_ptr + s_off)
        e = e.to(tl.int32)
        x = tl.reshape(tl.reshape(v, [BM // 32, 32, BN]) * _scale_value(e)[:, None, :], [BM, BN])
    # NaN comes only from NaN codes or scale 255 (finite or Inf codes times 2^k never make NaN); spec
    # writes every NaN as the positive quiet NaN
    nan = x != x
    bits = x.to(tl.int32, bitcast=True)
    if OUT_BF16:
        if HW_CVT:  # cvt.rn.bf16.f32: round to nearest even (subnormals kept)
            out = x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True)
        else:  # the same rounding on the bits (a carry may bump the exponent or reach Inf, as RN does)
            out = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF).to(tl.int16)
        out = tl.where(nan, 0x7FC0, out).to(tl.int16)
    else:
        out = tl.where(nan, F32_QNAN_BITS, bits)
    if MASKED:
        tl.store(out_ptr + offs, out, mask=mask)
    else:
        tl.store(out_ptr + offs, out)


_dequantize_heuristic = triton.heuristics(
    {"MASKED": lambda a: a["M"] % a["BM"] != 0 or a["N"] % a["BN"] != 0})(_dequantize_kernel)
_dequantize_tuned = autotune_cached(
    configs=_quantize_configs(),
    key=["M_BUCKET", "N_BUCKET", "ROW", "SWIZZLED", "IS_E5M2", "OUT_BF16"],
    prune_configs_by={"early_config_prune": _prune_configs},
    do_bench=_tune_bench,
    heuristic=_tile_heuristic,
)(_dequantize_heuristic)


@triton.jit
def _flat_bf16_pass(X, S, Y, N, flag_ptr, blk, W, INNER: tl.constexpr, BLOCK: tl.constexpr, IS_E5M2: tl.constexpr,
                    HW_CVT: tl.constexpr, GUARD: tl.constexpr, GUARD_LO: tl.constexpr, GUARD_HI: tl.constexpr):
    """Block `blk` of the flat pass: Y = RN_bf16(code * 2^(e-127)) for contiguous codes viewed as
    [outer, L, INNER] blocked along L, contiguous compact scales [outer, L/32, INNER]. INNER == 0: the
    row width is the runtime W, a multiple of BLOCK (a block lies in one row: one division per
    program), so one compiled kernel serves every such width (e.g. v's heads x 128 for any head count,
    _flat_inner). One flat 1-D pass
    (no tiles): a scale byte is re-read per element from L1, so it streams at copy speed (H200: 3.7 TB/s
    on attention's k, v; the GEMM's two operands in 0.044 ms where the tiled _dequantize_kernel took
    0.118 ms). GUARD: also set *flag_ptr = 1 when a nonzero code's scale byte lies outside [GUARD_LO,
    GUARD_HI] or a value is not finite (the bf16 routes of the MXFP8 GEMMs). NaN lanes keep the
    hardware's NaN bits (sign included), unlike mxfp8_dequantize's canonical NaN: the callers never
    hand them out (attention's NaN stays NaN; the GEMM routes' guard sends NaN operands to their exact
    fallback)."""
    offs = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    codes = tl.load(X + offs, mask=mask, other=0)
    # row = outer * L + l; L is a multiple of 32, so row // 32 = outer * L/32 + l // 32
    if INNER == 0:
        start = blk.to(tl.int64) * BLOCK
        row = start // W
        s_offs = (row // 32) * W + (start - row * W) + tl.arange(0, BLOCK)
    else:
        row = offs // INNER
        s_offs = (row // 32) * INNER + (offs - row * INNER)
    e = tl.load(S + s_offs, mask=mask, other=127).to(tl.int32)
    x = _decode(codes, IS_E5M2, HW_CVT) * _scale_value(e)
    if GUARD:
        bits = x.to(tl.int32, bitcast=True)
        bad = (bf16_unsafe(codes, e, GUARD_LO, GUARD_HI) != 0) | ((bits & 0x7F800000) == 0x7F800000)
        if tl.max(bad.to(tl.int32), axis=0) > 0:
            tl.store(flag_ptr, 1)
    if HW_CVT:  # cvt.rn.bf16.f32
        y = x.to(tl.bfloat16)
    else:  # the interpreter's cast truncates: round on the bits
        y = round_f32(x, tl.bfloat16)
    tl.store(Y + offs, y, mask=mask)


@triton.jit
def _dequantize_bf16_flat_kernel(X, S, Y, N, flag_ptr, W, INNER: tl.constexpr, BLOCK: tl.constexpr,
                                 IS_E5M2: tl.constexpr, HW_CVT: tl.constexpr,
                                 GUARD: tl.constexpr, GUARD_LO: tl.constexpr, GUARD_HI: tl.constexpr):
    """One MXTensor's flat pass (_flat_bf16_pass), one block per program."""
    _flat_bf16_pass(X, S, Y, N, flag_ptr, tl.program_id(0), W, INNER, BLOCK, IS_E5M2, HW_CVT, GUARD, GUARD_LO,
                    GUARD_HI)


@triton.jit
def _dequantize_bf16_flat3_kernel(X0, S0, Y0, N0, X1, S1, Y1, N1, X2, S2, Y2, N2, END0, END1, flag_ptr, W0, W1, W2,
                                  INNER0: tl.constexpr, INNER1: tl.constexpr, INNER2: tl.constexpr,
                                  E5M2_0: tl.constexpr, E5M2_1: tl.constexpr, E5M2_2: tl.constexpr,
                                  LO0: tl.constexpr, HI0: tl.constexpr, LO1: tl.constexpr, HI1: tl.constexpr,
                                  LO2: tl.constexpr, HI2: tl.constexpr, BLOCK: tl.constexpr,
                                  HW_CVT: tl.constexpr, GUARD: tl.constexpr):
    """Up to three MXTensors' flat passes in one launch: programs [0, END0) run tensor 0's blocks,
    [END0, END1) tensor 1's, the rest tensor 2's (with two tensors, END1 is the grid's end). Each
    element gets exactly what _dequantize_bf16_flat_kernel gives it; one launch instead of three saves
    host time where the host, not the GPU, sets the pace (attention's q, k, v; the projection's x, w)."""
    pid = tl.program_id(0)
    if pid < END0:
        _flat_bf16_pass(X0, S0, Y0, N0, flag_ptr, pid, W0, INNER0, BLOCK, E5M2_0, HW_CVT, GUARD, LO0, HI0)
    elif pid < END1:
        _flat_bf16_pass(X1, S1, Y1, N1, flag_ptr, pid - END0, W1, INNER1, BLOCK, E5M2_1, HW_CVT, GUARD, LO1, HI1)
    else:
        _flat_bf16_pass(X2, S2, Y2, N2, flag_ptr, pid - END1, W2, INNER2, BLOCK, E5M2_2, HW_CVT, GUARD, LO2, HI2)


_FLAT_BLOCK = 1024


def _flat_inner(inner: int) -> Tuple[int, int]:
    """(W, INNER) of the flat pass for rows `inner` wide: a multiple of the block as the runtime W
    (INNER 0), anything else as the constexpr INNER (its divisions by a constant; W unused, 0)."""
    return (inner, 0) if inner % _FLAT_BLOCK == 0 else (0, inner)


def _flat_operand(t: MXTensor):
    """(codes as contiguous uint8, contiguous compact scales, INNER) of an MXTensor for the flat pass
    (swizzled scales are unswizzled first)."""
    from ..torch.swizzle import unswizzle_scales

    data = t.data.contiguous()
    scale = (unswizzle_scales(t).scale if t.scale_layout == "swizzled" else t.scale).contiguous()
    return data, scale, math.prod(data.shape[t.axis + 1:])


def dequantize_bf16_flat(t: MXTensor, guard=None) -> torch.Tensor:
    """bf16 dequantize of any MXTensor by _dequantize_bf16_flat_kernel (swizzled scales are unswizzled
    first). guard = (int32 flag tensor, lo, hi) raises the flag (never clears it) when a scale byte is
    outside [lo, hi] or a dequantized value is not finite."""
    data, scale, inner = _flat_operand(t)
    out = torch.empty(data.shape, dtype=torch.bfloat16, device=data.device)
    n = data.numel()
    if n:
        flag, lo, hi = guard if guard is not None else (data, 0, 255)
        w, inner = _flat_inner(inner)
        fast_launch(
            _dequantize_bf16_flat_kernel, (cdiv(n, _FLAT_BLOCK),), data.view(torch.uint8), scale, out, n, flag, w,
            INNER=inner, BLOCK=_FLAT_BLOCK, IS_E5M2=t.elem == "e5m2", HW_CVT=use_hw_cvt(data.device),
            GUARD=guard is not None, GUARD_LO=int(lo), GUARD_HI=int(hi))
    return out


def dequantize_bf16_flat_many(tensors, guard=None) -> List[torch.Tensor]:
    """[dequantize_bf16_flat(t) for t in tensors], the same bytes, in one launch per three tensors
    (_dequantize_bf16_flat3_kernel; the tensors share a device). guard = (int32 flag tensor, ranges):
    ranges[i] = (lo, hi) guards tensors[i] as dequantize_bf16_flat's guard does, all on the one flag."""
    tensors = list(tensors)
    if guard is not None:
        flag, ranges = guard
        ranges = list(ranges)
        if len(ranges) != len(tensors):
            raise ValueError(f"guard: expected {len(tensors)} (lo, hi) ranges, one per tensor, got {len(ranges)}")
    else:
        flag, ranges = None, [(0, 255)] * len(tensors)
    outs: List[torch.Tensor] = []
    for i in range(0, len(tensors), 3):
        group, bounds = tensors[i:i + 3], ranges[i:i + 3]
        if len(group) == 1:
            outs.append(dequantize_bf16_flat(group[0], None if flag is None else (flag, *bounds[0])))
            continue
        slots, ends, total = [], [], 0
        for t in group:
            data, scale, inner = _flat_operand(t)
            out = torch.empty(data.shape, dtype=torch.bfloat16, device=data.device)
            outs.append(out)
            total += cdiv(data.numel(), _FLAT_BLOCK)
            ends.append(total)
            slots.append((data, scale, out, inner, t.elem == "e5m2"))
        if len(group) == 2:  # the third slot repeats the second and is never reached (END1 = the grid's end)
            slots.append(slots[1])
            bounds = bounds + bounds[1:]
        if not total:
            continue
        args = []
        for data, scale, out, _, _ in slots:
            args += [data.view(torch.uint8), scale, out, data.numel()]
        (lo0, hi0), (lo1, hi1), (lo2, hi2) = [(int(lo), int(hi)) for lo, hi in bounds]
        first = slots[0][0]
        (w0, inner0), (w1, inner1), (w2, inner2) = [_flat_inner(slot[3]) for slot in slots]
        fast_launch(
            _dequantize_bf16_flat3_kernel, (total,), *args, ends[0], ends[1], first if flag is None else flag,
            w0, w1, w2, INNER0=inner0, INNER1=inner1, INNER2=inner2,
            E5M2_0=slots[0][4], E5M2_1=slots[1][4], E5M2_2=slots[2][4],
            LO0=lo0, HI0=hi0, LO1=lo1, HI1=hi1, LO2=lo2, HI2=hi2, BLOCK=_FLAT_BLOCK,
            HW_CVT=use_hw_cvt(first.device), GUARD=flag is not None)
    return outs


def dequantize_reasons(t, out_dtype="float32") -> List[str]:
    return triton_reasons(t, min_capability=(8, 0))


@register("mxfp8_dequantize", "triton", check=dequantize_reasons)
def mxfp8_dequantize(t: MXTensor, out_dtype="float32"):
    data = t.data.contiguous()
    shape = tuple(data.shape)
    out = empty_output(shape, _OUT_TORCH[out_dtype], data.device)
    if not data.numel():
        return out
    swizzled = t.scale_layout == "swizzled"
    if t.axis == len(shape) - 1:  # row mode of [prod(lead), K]
        p, m, n = 1, math.prod(shape[:-1]), shape[-1]
    else:  # col mode of [P, M, N]
        p, m, n = math.prod(shape[: t.axis]), shape[t.axis], math.prod(shape[t.axis + 1:])
    args = dict(
        code_ptr=data.view(torch.uint8), scale_ptr=t.scale.contiguous(),
        out_ptr=out.view(torch.int16 if out_dtype == "bfloat16" else torch.int32),
        M=m, N=n, CP=t.swizzled_scale_shape[1] if swizzled else 4, M_BUCKET=_bucket(m), N_BUCKET=_bucket(n),
        ROW=t.axis == len(shape) - 1, SWIZZLED=swizzled, IS_E5M2=t.elem == "e5m2",
        OUT_BF16=out_dtype == "bfloat16", HW_CVT=use_hw_cvt(data.device), IDX64=p * (m + 128) * (n + 128) >= 2**31,
    )

    def grid(meta):
        return (p * cdiv(m, meta["BM"]) * cdiv(n, meta["BN"]),)

    forced = _fixed_tile()
    if forced is not None:
        bm, bn, warps = forced
        fast_launch(_dequantize_heuristic, grid({"BM": bm, "BN": bn}), **args, BM=bm, BN=bn, num_warps=warps,
                    num_stages=1, maxnreg=_register_cap(forced), enable_fp_fusion=False)
    else:
        fast_launch(_dequantize_tuned, grid, **args, enable_fp_fusion=False)
    return out
