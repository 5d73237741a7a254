"""Triton RMSNorm straight to MXFP8 (SEMANTICS.md section 7): one kernel computes rstd, y in fp32 and
both quantizations (rowwise along D, columnwise along T) without writing y.

Kernel design (`_rmsnorm_mxfp8_kernel`, memory bound: x read once from DRAM, codes written once)
- A program owns a band of 32 rows (one columnwise block) and a slice of the D chunks; the grid is
  (T/32, SPLIT). SPLIT > 1 only adds programs when T/32 bands do not fill the GPU.
- Pass 1 (rstd): the band's full rows are read chunk by chunk (BLOCK_D columns) in a fixed order
  0, 1, ..., and the squares are summed in float64 (a square of an fp32 value is exact in float64),
  elementwise across chunks then one tree reduction. The order depends only on BLOCK_D, so every
  program of a band gets the same rstd. Then, exactly as spec steps 3-5 (launched with
  enable_fp_fusion=False, so no FMA): ss = RN32(sum), ms = RN32(ss * RN32(1/D)),
  v = RN32(ms + RN32(eps)), rstd = RN32(float64 1/sqrt(v)) (sqrt.rn and div.rn in float64, as spec).
  The float64 sum differs from spec's exact sum only when that sum lies within ~D float64 ulps of an
  fp32 rounding boundary; rstd then differs by one fp32 ulp, inside spec's stated bound. A NaN rstd
  is written as 0x7FC00000, as spec does.
- Pass 2 (y, quantize): the program's own chunks are re-read in reverse order (the most recently read
  chunks first, so they come from L2, not DRAM): y = RN32(RN32(x * rstd) * g), then rowwise blocks
  (reshape [32, BLOCK_D/32, 32], reduce the last axis) and the columnwise block (reduce the 32 rows)
  from the same registers; both code tiles and both scale tiles are stored, compact.
- Scale bytes and codes come from backends.triton.quantize's device functions (rceil, saturate; the
  GPU uses cvt.rn.satfinite for the codes, the interpreter the bit version), so both ops share one rule.
Bytes per element (bf16 x): 2 read + 1 + 1 code bytes + 2/32 scale bytes.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional

import numpy as np
import torch
import triton
import triton.language as tl

from spec.constants import BLOCK_SIZE
from spec.mxtensor import MXTensor

from ..registry import register
from ._common import autotune_cached, cdiv, fast_launch, interpret_mode, sm_count, triton_reasons
from ._fpbits import widen_f32
from ._mx_codec import elem_meta, encode, scale_byte, scale_multiplier, use_hw_cvt
from .tile_choice import pick

_ELEM_TORCH = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _amax(y3, AXIS: tl.constexpr):
    """NaN-ignoring amax of each block along AXIS, from +0 (SEMANTICS 1.1 step 1): tl.max reduces with
    maxnum (PTX max.f32; nanmax in the interpreter), so only an all-NaN block gives NaN, read as 0."""
    amax = tl.max(tl.abs(y3), axis=AXIS)
    return tl.where(amax == amax, amax, 0.0)


@triton.jit
def _quantize_tile(y, IS_E5M2: tl.constexpr, INV_MAX_BITS: tl.constexpr, MAX_BITS: tl.constexpr,
                   EMAX: tl.constexpr, MBITS: tl.constexpr, CODE_SHIFT: tl.constexpr,
                   ROUND_HALF: tl.constexpr, EXP_REBIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr,
                   SUB_MAGIC_BITS: tl.constexpr, HW_CVT: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row and column MXFP8 of one [32, BLOCK_D] fp32 tile (rceil, saturate):
    (row codes [32, BLOCK_D], row scales [32, BLOCK_D/32], col codes [32, BLOCK_D], col scales [BLOCK_D])."""
    y3 = tl.reshape(y, [32, BLOCK_D // 32, 32])
    amax = _amax(y3, 2)
    e_row = scale_byte(amax, amax, INV_MAX_BITS, EMAX, MBITS, 0, False)  # rceil; no nan_block flag
    y_row = tl.reshape(y3 * scale_multiplier(e_row, False)[:, :, None], [32, BLOCK_D])
    row_codes = encode(y_row, IS_E5M2, MAX_BITS, CODE_SHIFT, ROUND_HALF, EXP_REBIAS, MIN_NORMAL_BITS,
                        SUB_MAGIC_BITS, HW_CVT)

    y3c = tl.reshape(y, [1, 32, BLOCK_D])
    amax_c = _amax(y3c, 1)
    e_col = scale_byte(amax_c, amax_c, INV_MAX_BITS, EMAX, MBITS, 0, False)  # [1, BLOCK_D]
    y_col = tl.reshape(y3c * scale_multiplier(e_col, False)[:, None, :], [32, BLOCK_D])
    col_codes = encode(y_col, IS_E5M2, MAX_BITS, CODE_SHIFT, ROUND_HALF, EXP_REBIAS, MIN_NORMAL_BITS,
                        SUB_MAGIC_BITS, HW_CVT)
    return row_codes, e_row.to(tl.uint8), col_codes, tl.reshape(e_col, [BLOCK_D]).to(tl.uint8)


@triton.jit
def _rmsnorm_mxfp8_kernel(
    x_ptr, gamma_ptr, row_code_ptr, row_scale_ptr, col_code_ptr, col_scale_ptr, rstd_ptr,
    D, stride_x, inv_d, eps,
    T_BUCKET,  # autotune key only
    ZERO_CENTERED: tl.constexpr, HW_CVT: tl.constexpr,
    IS_E5M2: tl.constexpr, INV_MAX_BITS: tl.constexpr, MAX_BITS: tl.constexpr, EMAX: tl.constexpr,
    MBITS: tl.constexpr, CODE_SHIFT: tl.constexpr, ROUND_HALF: tl.constexpr, EXP_REBIAS: tl.constexpr,
    MIN_NORMAL_BITS: tl.constexpr, SUB_MAGIC_BITS: tl.constexpr,
    BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
):
    band = tl.program_id(0)
    part = tl.program_id(1)
    rows = band.to(tl.int64) * 32 + tl.arange(0, 32)
    x_rows = x_ptr + rows[:, None] * stride_x
    cd = tl.arange(0, BLOCK_D)
    n_chunks = tl.cdiv(D, BLOCK_D)

    # Pass 1: float64 sum of squares over the full rows, chunks in a fixed order.
    acc = tl.zeros([32, BLOCK_D], dtype=tl.float64)
    for c in range(0, n_chunks):
        cols = c * BLOCK_D + cd
        x = widen_f32(tl.load(x_rows + cols[None, :], mask=(cols < D)[None, :], other=0.0))
        x64 = x.to(tl.float64)
        acc += x64 * x64
    ss = tl.sum(acc, axis=1).to(tl.float32)  # RN32 of the float64 sum
    ms = ss * inv_d  # RN32(ss * RN32(1/D)); no FMA with the add below (fp fusion disabled)
    v = ms + eps
    rstd = (1.0 / tl.sqrt(v.to(tl.float64))).to(tl.float32)
    rstd = tl.where(rstd != rstd, 0x7FC00000, rstd.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    if part == 0:
        tl.store(rstd_ptr + rows, rstd)

    # Pass 2: this program's chunks, most recently read first.
    per_part = tl.cdiv(n_chunks, SPLIT)
    first = part * per_part
    last = tl.minimum(first + per_part, n_chunks)
    for i in range(0, last - first):
        c = last - 1 - i
        cols = c * BLOCK_D + cd
        col_mask = cols < D  # D is a multiple of 32: masked lanes are whole blocks, never stored
        x = widen_f32(tl.load(x_rows + cols[None, :], mask=col_mask[None, :], other=0.0))
        g = widen_f32(tl.load(gamma_ptr + cols, mask=col_mask, other=0.0))
        if ZERO_CENTERED:
            g = g + 1.0
        y = (x * rstd[:, None]) * g[None, :]
        row_codes, row_e, col_codes, col_e = _quantize_tile(
            y, IS_E5M2, INV_MAX_BITS, MAX_BITS, EMAX, MBITS, CODE_SHIFT, ROUND_HALF, EXP_REBIAS,
            MIN_NORMAL_BITS, SUB_MAGIC_BITS, HW_CVT, BLOCK_D)
        offs = rows[:, None] * D + cols[None, :]
        tl.store(row_code_ptr + offs, row_codes, mask=col_mask[None, :])
        tl.store(col_code_ptr + offs, col_codes, mask=col_mask[None, :])
        blk = c * (BLOCK_D // 32) + tl.arange(0, BLOCK_D // 32)
        tl.store(row_scale_ptr + rows[:, None] * (D // 32) + blk[None, :], row_e,
                 mask=(blk * 32 < D)[None, :])
        tl.store(col_scale_ptr + band.to(tl.int64) * D + cols, col_e, mask=col_mask)


# --------------------------------------------------------------------------------------------------
# launch configuration
# --------------------------------------------------------------------------------------------------
def _configs() -> List[triton.Config]:
    configs = []
    for block_d in (64, 128, 256):
        for split in (1, 2, 4):
            for warps in (4, 8):
                configs.append(triton.Config({"BLOCK_D": block_d, "SPLIT": split}, num_warps=warps, num_stages=1))
    return configs


def _sm_count(device) -> int:
    return sm_count(device)


def _prune(configs, named_args, **kwargs):
    """Keep chunk widths not wider than D, and SPLIT > 1 only when the T/32 bands alone leave SMs
    idle (each split re-reads the band's full rows for rstd, from L2)."""
    d = named_args["D"]
    bands = named_args["rstd_ptr"].shape[0] // 32
    sms = _sm_count(named_args["rstd_ptr"].device)
    kept = []
    for cfg in configs:
        block_d, split = cfg.kwargs["BLOCK_D"], cfg.kwargs["SPLIT"]
        n_chunks = cdiv(d, block_d)
        if block_d > max(64, triton.next_power_of_2(d)) or split > n_chunks:
            continue
        if split > 1 and bands * (split // 2) >= 2 * sms:
            continue
        kept.append(cfg)
    return kept or configs[:1]


def _heuristic(configs, named):
    """The tile without timing: chunks of up to 256 columns (no wider than D), 4 warps, and two programs
    per 32-row band while the bands alone (T / 32, T at the top of its bucket) leave SMs idle. On the
    H200 it is what autotuning chose at D 1536, T 4096 to 16384 (the recorded table)."""
    d = named["D"]
    block_d = min(256, max(64, triton.next_power_of_2(d)))
    bands = (1 << named["T_BUCKET"]) // 32
    split = 2 if cdiv(d, block_d) >= 2 and bands < _sm_count(named["rstd_ptr"].device) else 1
    return pick(configs, BLOCK_D=block_d, SPLIT=split, num_warps=4)


_rmsnorm_tuned = autotune_cached(
    configs=_configs(),
    key=["D", "T_BUCKET", "ZERO_CENTERED", "IS_E5M2"],
    prune_configs_by={"early_config_prune": _prune},
    heuristic=_heuristic,
)(_rmsnorm_mxfp8_kernel)

# Used instead of the heuristic / autotuning in the interpreter, and while `forced_config` is active
# (tests run several tiles this way, on the GPU too).
_INTERPRET_CONFIG = {"BLOCK_D": 64, "SPLIT": 2, "num_warps": 4}
_forced_config: Optional[dict] = None


@contextlib.contextmanager
def forced_config(block_d: int, split: int, num_warps: int = 4):
    """Run the kernel with this tile (BLOCK_D columns per chunk, SPLIT programs per band)."""
    global _forced_config
    prev, _forced_config = _forced_config, {"BLOCK_D": block_d, "SPLIT": split, "num_warps": num_warps}
    try:
        yield
    finally:
        _forced_config = prev


# --------------------------------------------------------------------------------------------------
# wrapper
# --------------------------------------------------------------------------------------------------
def _rmsnorm_reasons(*args, **kwargs) -> List[str]:
    reasons = triton_reasons(*args, **kwargs)
    for name, v in zip(("x", "gamma"), args[:2]):
        if isinstance(v, torch.Tensor) and v.dtype not in _FLOATS:
            reasons.append(f"{name} dtype {v.dtype} is not float32/bfloat16/float16")
    return reasons


@register("rmsnorm_mxfp8", "triton", check=_rmsnorm_reasons)
def rmsnorm_mxfp8(x, gamma, eps=1e-6, zero_centered_gamma=False, elem="e4m3"):
    """spec.rmsnorm_mxfp8 in one kernel (module docstring). Returns (y_row, y_col, rstd)."""
    n_rows, d = x.shape
    device = x.device
    if x.stride(1) != 1:
        x = x.contiguous()
    gamma = gamma.contiguous()
    row_codes = torch.empty((n_rows, d), dtype=torch.uint8, device=device)
    col_codes = torch.empty((n_rows, d), dtype=torch.uint8, device=device)
    row_scale = torch.empty((n_rows, d // BLOCK_SIZE), dtype=torch.uint8, device=device)
    col_scale = torch.empty((n_rows // BLOCK_SIZE, d), dtype=torch.uint8, device=device)
    rstd = torch.empty((n_rows,), dtype=torch.float32, device=device)

    if x.numel() > 0:
        # fp32 constants of spec steps 3-4, passed as Python floats that are exactly those fp32 values.
        inv_d = float(np.float32(1.0) / np.float32(d))
        eps32 = float(np.float32(eps))
        args = (x, gamma, row_codes, row_scale, col_codes, col_scale, rstd, d, x.stride(0), inv_d, eps32,
                max(n_rows - 1, 1).bit_length())
        meta = dict(ZERO_CENTERED=bool(zero_centered_gamma), HW_CVT=use_hw_cvt(device), **elem_meta(elem))
        bands = n_rows // BLOCK_SIZE
        if interpret_mode() or _forced_config is not None:
            cfg = dict(_forced_config or _INTERPRET_CONFIG)
            fast_launch(_rmsnorm_mxfp8_kernel, (bands, cfg["SPLIT"]), *args, **meta, **cfg, enable_fp_fusion=False)
        else:
            grid = lambda m: (bands, m["SPLIT"])  # noqa: E731
            fast_launch(_rmsnorm_tuned, grid, *args, **meta, enable_fp_fusion=False)

    dtype = _ELEM_TORCH[elem]
    y_row = MXTensor(row_codes.view(dtype), row_scale, 1, elem)
    y_col = MXTensor(col_codes.view(dtype), col_scale, 0, elem)
    return y_row, y_col, rstd
