"""Triton RMSNorm backward (spec.rmsnorm_backward): dx and dgamma in one pass over x and dy.

Kernel design (`_rmsnorm_backward_kernel`, memory bound: x, dy read once, dx written once)
- A row is one tile of BLOCK_D >= D columns (D up to MAX_D), so a row's mean term c needs no second
  read. A program walks `tiles_per_program` consecutive tiles of BLOCK_T rows; the grid is about two
  programs per SM, so the dgamma partials it writes stay small ([programs, D] fp32).
- Per tile, spec's steps in fp32 with one RN each (launched with enable_fp_fusion=False: no FMA, so
  every elementwise value is spec's): xhat = x * rstd, dxhat = dy * g, c = sum_D(dxhat * xhat) *
  RN32(1/D), dx = rstd * (dxhat - xhat * c), rounded once to x's dtype. x, dy and gamma are read in
  their own dtypes (bf16 widened exactly on its bits). The compiler lays a load out by its element size
  and a row sum adds in that layout's order, so a bf16 dy and its fp32 widening can differ in dx's
  last bit.
- dgamma: each program adds dy * xhat into a [BLOCK_T, BLOCK_D] fp32 accumulator tile by tile and
  reduces it over its rows once at the end into its row of `partials`; `partials.sum(0)` (a torch
  reduction with a fixed order) adds the programs' rows. The config depends only on T, D and the
  device, so the bytes are the same on every run.
- Lanes past T or D are forced to 0 before any sum, so a caller's Inf rstd or NaN in no real lane
  cannot reach a real one.
Only the sums' order differs from spec (its sums are exact, rounded once); the bounds that follow are
derived in tests/conformance/test_rmsnorm_backward.py.
Bytes per element (bf16 x and dy, bf16 dx): 2 + 2 read, 2 written; plus rstd, gamma and the partials.
"""
from __future__ import annotations

from typing import List

import numpy as np
import torch
import triton
import triton.language as tl

from ..registry import register, register_variant
from ..torch.rmsnorm import rmsnorm_backward as _composed
from ._common import cdiv, fast_launch, sm_count, triton_reasons
from ._fpbits import round_f32, widen_f32

MAX_D = 8192  # one row per tile: wider rows would spill the registers
_TILE_ELEMENTS = 4096  # BLOCK_T * BLOCK_D per tile: 16 fp32 per thread and tensor at 8 warps
_INTERPRET_PROGRAMS = 3  # few programs, so the tests' odd T give programs with several and with empty tiles
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _rmsnorm_backward_kernel(
    dy_ptr, x_ptr, gamma_ptr, rstd_ptr, dx_ptr, partials_ptr,
    T, D, stride_dy, stride_x, inv_d, tiles_per_program,
    ZERO_CENTERED: tl.constexpr, DX_DTYPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    g = widen_f32(tl.load(gamma_ptr + cols, mask=col_ok, other=0.0))
    if ZERO_CENTERED:
        g = g + 1.0
    dgamma = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    first_tile = program * tiles_per_program
    for i in range(0, tiles_per_program):
        rows = (first_tile + i).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        ok = row_ok[:, None] & col_ok[None, :]
        x = widen_f32(tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0))
        dy = widen_f32(tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0))
        r = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]
        xhat = tl.where(ok, x * r, 0.0)
        dxhat = dy * g[None, :]
        c = tl.sum(dxhat * xhat, axis=1) * inv_d
        dx = r * (dxhat - xhat * c[:, None])
        tl.store(dx_ptr + rows[:, None] * D + cols[None, :], round_f32(dx, DX_DTYPE), mask=ok)
        dgamma += dy * xhat
    tl.store(partials_ptr + program.to(tl.int64) * D + cols, tl.sum(dgamma, axis=0), mask=col_ok)


def launch_config(n_rows: int, d: int, device) -> dict:
    """The tile and grid without timing: BLOCK_D the power of two covering D, BLOCK_T rows up to
    _TILE_ELEMENTS per tile, 8 warps above 2048 elements, and about two programs per SM (on the CPU
    interpreter, _INTERPRET_PROGRAMS), each walking an equal run of tiles."""
    block_d = max(16, triton.next_power_of_2(d))
    block_t = max(1, min(32, _TILE_ELEMENTS // block_d))
    tiles = cdiv(n_rows, block_t)
    cap = _INTERPRET_PROGRAMS if device.type != "cuda" else 2 * sm_count(device)
    tiles_per_program = max(1, cdiv(tiles, cap))
    return {"BLOCK_T": block_t, "BLOCK_D": block_d, "num_warps": 8 if block_t * block_d > 2048 else 4,
            "programs": max(1, cdiv(tiles, tiles_per_program)), "tiles_per_program": tiles_per_program}


def _backend_reasons(dy, x, gamma, rstd, zero_centered_gamma=False) -> List[str]:
    return triton_reasons(dy, x, gamma, rstd)


def _fused_reasons(dy, x, gamma, rstd, zero_centered_gamma=False) -> List[str]:
    reasons = []
    d = x.shape[1]
    if d > MAX_D:
        reasons.append(f"x: D = {d} is wider than one tile of the kernel (at most {MAX_D} columns)")
    for name, t in (("dy", dy), ("x", x)):
        if t.shape[0] and d > 1 and t.stride(1) != 1:  # an empty tensor's strides are arbitrary
            reasons.append(f"{name}: rows are not contiguous (stride {tuple(t.stride())}); pass {name}.contiguous()")
    return reasons


# "fused": the kernel above. "composed": the torch backend's elementwise ops and reductions (any D, any
# strides), so that a call asking for triton is served where the kernel declines.
register_variant("rmsnorm_backward", "triton", "fused", 20, check=_fused_reasons)
register_variant("rmsnorm_backward", "triton", "composed", 10)


@register("rmsnorm_backward", "triton", check=_backend_reasons)
def rmsnorm_backward(dy, x, gamma, rstd, zero_centered_gamma=False, variant=None):
    """spec.rmsnorm_backward: the kernel (module docstring), or with variant "composed" the torch
    backend's ops. Returns (dx in x's dtype, dgamma in gamma's dtype). variant: the dispatcher's choice
    (None: the kernel)."""
    if variant == "composed":
        return _composed(dy, x, gamma, rstd, zero_centered_gamma)
    n_rows, d = x.shape
    gamma, rstd = gamma.contiguous(), rstd.contiguous()
    dx = torch.empty((n_rows, d), dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return dx, torch.zeros((d,), dtype=gamma.dtype, device=x.device)
    cfg = launch_config(n_rows, d, x.device)
    partials = torch.empty((cfg["programs"], d), dtype=torch.float32, device=x.device)
    inv_d = float(np.float32(1.0) / np.float32(d))  # RN32(1/D), exactly representable as a Python float
    fast_launch(_rmsnorm_backward_kernel, (cfg["programs"],), dy, x, gamma, rstd, dx, partials, n_rows, d,
                dy.stride(0), x.stride(0), inv_d, cfg["tiles_per_program"],
                ZERO_CENTERED=bool(zero_centered_gamma), DX_DTYPE=_TL_DTYPES[x.dtype], BLOCK_T=cfg["BLOCK_T"],
                BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"], enable_fp_fusion=False)
    return dx, partials.sum(dim=0).to(gamma.dtype)
