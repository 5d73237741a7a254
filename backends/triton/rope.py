"""Triton RoPE forward / backward (SEMANTICS.md section 4), byte-equal to spec.rope.

Kernel design (memory bound: one read of x, one write of out, table rows once per program)
- x is viewed as [N0, N1, H, D] with its own strides: thd [T, H, D] is (T, 1), sbhd is (S, B),
  bshd is (B, S). The token index n = i0 * N1 + i1 walks the first two axes in memory order of the
  contiguous case, so any strided view works without a copy (only the feature stride must be 1).
- One program owns BLOCK_T tokens and loops over all heads in chunks of BLOCK_H: the token's cos/sin
  row and its position are computed once and shared by every head. Each chunk copies the
  pass-through features [BT, BH, D - R] and rotates the RoPE features [BT, BH, R].
- Token positions are computed in the kernel (no torch prologue): explicit positions are loaded;
  otherwise the sequence of a thd token comes from a binary search in cu_seqlens, then context
  parallel chunk mapping and start_positions are applied, all in integer registers.
- The three styles and the backward are one rule over a pair (a, b) of input features and a pair
  (A, B) of output features:
      forward:  out_A = RN(RN(a*cA) - RN(b*sA))   out_B = RN(RN(b*cB) + RN(a*sB))
      backward: out_A = RN(RN(a*cA) + RN(b*sB))   out_B = RN(RN(b*cB) - RN(a*sA))
  where a pair is either adjacent features (2k, 2k+1) ("paired") or the two halves (k, h+k).
  mla forward reads pairs and writes halves; its backward reads halves and writes pairs; neox uses
  halves on both sides; interleaved uses pairs on both sides (and its tables are paired too).
  Paired features are loaded as one contiguous [.., R] vector and split with tl.reshape/tl.split, so
  every global access is a contiguous run (16-byte vectors on the GPU).
- No FMA: launched with enable_fp_fusion=False, so each product and each sum is its own RN, as spec.
- NaN produced by the rotation (and pass-through NaN when out_dtype differs from x's dtype) is
  written as the output dtype's canonical quiet NaN, selected on the integer bits after the cast
  because the GPU's own NaN after a conversion differs.
"""
from __future__ import annotations

from typing import List

import torch
import triton
import triton.language as tl

from spec.constants import FLOAT_DTYPES, LAYOUTS, ROPE_STYLES

from ..registry import register
from ._common import autotune_cached, cdiv, fast_launch, interpret_mode, placeholder, triton_reasons
from .tile_choice import pick
from ._fpbits import round_f32_canonical_nan, widen_f32

_TORCH_FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NAME_OF = {v: k for k, v in _TORCH_FLOATS.items()}

_LAYOUT_CODE = {"thd": 0, "sbhd": 1, "bshd": 2}


# --------------------------------------------------------------------------------------------------
# kernel
# --------------------------------------------------------------------------------------------------
@triton.jit
def _token_positions(tok, tok_mask, i0, i1, pos_ptr, cu_ptr, start_ptr, n_tokens, n_seqs, search_steps,
                     seq_len, sp_b, sp_s, cp_size, cp_rank,
                     LAYOUT: tl.constexpr, EXPLICIT: tl.constexpr, HAS_CU: tl.constexpr,
                     HAS_START: tl.constexpr, CP: tl.constexpr):
    """int64 table row of every token of the block (same rule as spec.rope._check_and_positions)."""
    if LAYOUT == 0:  # thd: the token is its own coordinate
        s = tok
        b = tok * 0
    elif LAYOUT == 1:  # sbhd: i0 = s, i1 = b
        s = i0
        b = i1
    else:  # bshd: i0 = b, i1 = s
        s = i1
        b = i0
    if EXPLICIT:
        # thd positions [T] have sp_b = 0; [S] positions of the 4-D layouts too (shared by batch).
        pos = tl.load(pos_ptr + b.to(tl.int64) * sp_b + s.to(tl.int64) * sp_s, mask=tok_mask, other=0)
        pos = pos.to(tl.int64)
    else:
        if LAYOUT == 0:
            if HAS_CU:
                # seq = number of b < B with cu[b+1] <= tok (the sequence holding tok; empty
                # sequences are skipped). Fixed-count binary search, lanes stop when lo == hi.
                lo = tok * 0
                hi = lo + n_seqs
                for _ in range(search_steps):
                    active = lo < hi
                    mid = (lo + hi) // 2
                    end = tl.load(cu_ptr + mid + 1, mask=active & tok_mask, other=0)
                    right = active & (end <= tok)
                    lo = tl.where(right, mid + 1, lo)
                    hi = tl.where(active & (end > tok), mid, hi)
                b = tl.minimum(lo, n_seqs - 1)
                first = tl.load(cu_ptr + b, mask=tok_mask, other=0)
                last = tl.load(cu_ptr + b + 1, mask=tok_mask, other=0)
                local = tok - first
                length = last - first
            else:
                local = tok
                length = tok * 0 + n_tokens
        else:
            local = s
            length = s * 0 + seq_len
        local = local.to(tl.int64)
        if CP:
            # Rank r holds chunks r and 2*cp_size-1-r of each sequence, each half its local length.
            chunk = (length // 2).to(tl.int64)
            second = local >= chunk
            pos = tl.where(second, (2 * cp_size - 1 - cp_rank) * chunk + local - chunk, cp_rank * chunk + local)
        else:
            pos = local
        if HAS_START:
            pos += tl.load(start_ptr + b, mask=tok_mask, other=0).to(tl.int64)
    return pos


@triton.jit
def _load_heads(x_ptr, x_tok, tok_mask, h0, n_heads, sxh, j, j_mask, k, k_mask, kk, kk_mask,
                KEEP: tl.constexpr, HALF: tl.constexpr, IN_PAIRED: tl.constexpr, BLOCK_H: tl.constexpr):
    """Raw (not widened) features of heads h0 .. h0+BLOCK_H-1 of the block's tokens:
    (pass-through [BT, BH, BLOCK_KEEP], then the RoPE features either as one paired vector
    [BT, BH, 2*BLOCK_HALF] (returned twice) or as the two halves [BT, BH, BLOCK_HALF])."""
    h = h0 + tl.arange(0, BLOCK_H)
    row_mask = (tok_mask[:, None] & (h < n_heads)[None, :])[:, :, None]
    x_row = x_ptr + (x_tok[:, None] + h[None, :].to(tl.int64) * sxh)[:, :, None]
    if KEEP > 0:
        keep = tl.load(x_row + kk[None, None, :], mask=row_mask & kk_mask[None, None, :])
    else:
        keep = tl.zeros([1], dtype=x_ptr.dtype.element_ty)
    if IN_PAIRED:
        r0 = tl.load(x_row + KEEP + j[None, None, :], mask=row_mask & j_mask[None, None, :], other=0.0)
        r1 = r0
    else:
        half_mask = row_mask & k_mask[None, None, :]
        r0 = tl.load(x_row + KEEP + k[None, None, :], mask=half_mask, other=0.0)
        r1 = tl.load(x_row + KEEP + HALF + k[None, None, :], mask=half_mask, other=0.0)
    return keep, r0, r1


@triton.jit
def _rope_kernel(
    x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, cu_ptr, start_ptr,
    n_tokens, n1, n_heads,
    sx0, sx1, sxh, so0, so1, soh, sc_row, ss_row,
    sp_b, sp_s, n_seqs, search_steps, seq_len, cp_size, cp_rank,
    TOK_BUCKET,  # autotune key only: log2 bucket of the token count
    KEEP: tl.constexpr, BLOCK_KEEP: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    LAYOUT: tl.constexpr, EXPLICIT: tl.constexpr, HAS_CU: tl.constexpr, HAS_START: tl.constexpr,
    CP: tl.constexpr,
    IN_PAIRED: tl.constexpr, OUT_PAIRED: tl.constexpr, TAB_PAIRED: tl.constexpr, BACKWARD: tl.constexpr,
    CONVERT_KEEP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    OUT_DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    R: tl.constexpr = 2 * HALF

    pid = tl.program_id(0)
    tok = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < n_tokens
    i0 = tok // n1
    i1 = tok % n1
    x_tok = i0.to(tl.int64) * sx0 + i1.to(tl.int64) * sx1  # [BT]
    o_tok = i0.to(tl.int64) * so0 + i1.to(tl.int64) * so1

    j = tl.arange(0, 2 * BLOCK_HALF)  # paired features as one contiguous vector
    j_mask = j < R
    k = tl.arange(0, BLOCK_HALF)
    k_mask = k < HALF
    kk = tl.arange(0, BLOCK_KEEP)
    kk_mask = kk < KEEP

    # The first head chunk is loaded before the position prologue (a chain of dependent cu_seqlens
    # loads), so its DRAM latency overlaps it; each iteration then loads the next chunk before it
    # computes and stores the current one (the load past the last head is fully masked: no traffic).
    keep_next, r0_next, r1_next = _load_heads(x_ptr, x_tok, tok_mask, 0, n_heads, sxh, j, j_mask, k, k_mask,
                                              kk, kk_mask, KEEP, HALF, IN_PAIRED, BLOCK_H)

    pos = _token_positions(tok, tok_mask, i0, i1, pos_ptr, cu_ptr, start_ptr, n_tokens, n_seqs,
                           search_steps, seq_len, sp_b, sp_s, cp_size, cp_rank,
                           LAYOUT, EXPLICIT, HAS_CU, HAS_START, CP)

    # Table columns of the pair: cA/sA belong to output A, cB/sB to output B. [BT, 1, BLOCK_HALF]
    tab_mask = tok_mask[:, None] & k_mask[None, :]
    if TAB_PAIRED:
        col_a = 2 * k
        col_b = 2 * k + 1
    else:
        col_a = k
        col_b = HALF + k
    c_row = cos_ptr + (pos * sc_row)[:, None]
    s_row = sin_ptr + (pos * ss_row)[:, None]
    c_a = widen_f32(tl.load(c_row + col_a[None, :], mask=tab_mask, other=0.0))[:, None, :]
    c_b = widen_f32(tl.load(c_row + col_b[None, :], mask=tab_mask, other=0.0))[:, None, :]
    s_a = widen_f32(tl.load(s_row + col_a[None, :], mask=tab_mask, other=0.0))[:, None, :]
    s_b = widen_f32(tl.load(s_row + col_b[None, :], mask=tab_mask, other=0.0))[:, None, :]

    for h0 in range(0, n_heads, BLOCK_H):
        keep_v, r0, r1 = keep_next, r0_next, r1_next
        keep_next, r0_next, r1_next = _load_heads(x_ptr, x_tok, tok_mask, h0 + BLOCK_H, n_heads, sxh, j, j_mask,
                                                  k, k_mask, kk, kk_mask, KEEP, HALF, IN_PAIRED, BLOCK_H)
        h = h0 + tl.arange(0, BLOCK_H)
        row_mask = (tok_mask[:, None] & (h < n_heads)[None, :])[:, :, None]  # [BT, BH, 1]
        o_row = out_ptr + (o_tok[:, None] + h[None, :].to(tl.int64) * soh)[:, :, None]

        if KEEP > 0:
            if CONVERT_KEEP:
                keep_v = round_f32_canonical_nan(widen_f32(keep_v), OUT_DTYPE)
            tl.store(o_row + kk[None, None, :], keep_v, mask=row_mask & kk_mask[None, None, :])

        if IN_PAIRED:
            a, b = tl.split(tl.reshape(widen_f32(r0), (BLOCK_T, BLOCK_H, BLOCK_HALF, 2)))
        else:
            a = widen_f32(r0)
            b = widen_f32(r1)

        # Each product and each sum one RN (no FMA: the launch disables fp fusion).
        if BACKWARD:
            out_a = a * c_a + b * s_b
            out_b = b * c_b - a * s_a
        else:
            out_a = a * c_a - b * s_a
            out_b = b * c_b + a * s_b
        out_a = round_f32_canonical_nan(out_a, OUT_DTYPE)
        out_b = round_f32_canonical_nan(out_b, OUT_DTYPE)

        if OUT_PAIRED:
            joined = tl.reshape(tl.join(out_a, out_b), (BLOCK_T, BLOCK_H, 2 * BLOCK_HALF))
            tl.store(o_row + KEEP + j[None, None, :], joined, mask=row_mask & j_mask[None, None, :])
        else:
            half_mask = row_mask & k_mask[None, None, :]
            tl.store(o_row + KEEP + k[None, None, :], out_a, mask=half_mask)
            tl.store(o_row + KEEP + HALF + k[None, None, :], out_b, mask=half_mask)


# --------------------------------------------------------------------------------------------------
# launch configuration
# --------------------------------------------------------------------------------------------------
def _tile_elems(block_t: int, block_h: int, block_keep: int, block_half: int) -> int:
    return block_t * block_h * (block_keep + 2 * block_half)


def _gpu_configs() -> List[triton.Config]:
    """Candidate tiles; _prune keeps those that fit the call's head count and row size."""
    configs = []
    for block_t in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        for block_h in (1, 2, 4, 8, 16, 32, 64, 128):
            for warps in (4, 8):
                configs.append(triton.Config({"BLOCK_T": block_t, "BLOCK_H": block_h}, num_warps=warps))
    return configs


def _prune(configs, named_args, **kwargs):
    """Keep tiles of 2K-16K elements per head-chunk iteration that do not over-cover the heads, and
    that put many heads of one token in a program before adding tokens (tables shared across heads)."""
    n_heads = named_args["n_heads"]
    block_keep = kwargs.get("BLOCK_KEEP", named_args.get("BLOCK_KEEP"))
    block_half = kwargs.get("BLOCK_HALF", named_args.get("BLOCK_HALF"))
    heads_p2 = triton.next_power_of_2(n_heads)
    kept = []
    for cfg in configs:
        bt, bh = cfg.kwargs["BLOCK_T"], cfg.kwargs["BLOCK_H"]
        if bh > heads_p2 or (bt > 1 and bh < heads_p2):
            continue
        elems = _tile_elems(bt, bh, block_keep, block_half)
        if 2048 <= elems <= 16384:
            kept.append(cfg)
    if not kept:  # rows too long for any tile in range: one token, the fewest heads
        kept = [triton.Config({"BLOCK_T": 1, "BLOCK_H": 1}, num_warps=8)]
    return kept


def _fixed_config(n_heads: int, block_keep: int, block_half: int):
    """The interpreter's tile: all heads of a token (at most 32), several tokens when rows are tiny."""
    block_h = min(triton.next_power_of_2(n_heads), 32)
    row = block_keep + 2 * block_half
    block_t = 1
    if block_h == triton.next_power_of_2(n_heads):
        block_t = 1 << max(0, min(4, (4096 // (block_h * row)).bit_length() - 1))  # power of 2, <= 16
    return {"BLOCK_T": block_t, "BLOCK_H": block_h, "num_warps": 4}


def _heuristic(configs, named):
    """The tile without timing, from the head count and the row width (as _prune's window): all heads
    of a token when they fit 16K elements, else the widest power-of-two head block that does; then,
    with all heads in, tokens added until the tile holds 2K elements (a short row gets many programs);
    8 warps from 8K elements. On the H200 it is what autotuning chose for the 128-head q rows at every
    recorded key (tests/test_tile_choice.py names the one-head k_pe keys where it is not)."""
    heads_p2 = triton.next_power_of_2(named["n_heads"])
    row = named["BLOCK_KEEP"] + 2 * named["BLOCK_HALF"]
    block_h = 1
    while block_h < heads_p2 and 2 * block_h * row <= 16384:
        block_h *= 2
    block_t = 1
    if block_h == heads_p2:
        while block_t < 256 and block_t * block_h * row < 2048:
            block_t *= 2
    warps = 8 if block_t * block_h * row >= 8192 else 4
    return pick(configs, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=warps)


_rope_autotuned = autotune_cached(
    configs=_gpu_configs(),
    key=["TOK_BUCKET", "n_heads", "KEEP", "HALF", "IN_PAIRED", "OUT_PAIRED", "CONVERT_KEEP"],
    prune_configs_by={"early_config_prune": _prune},
    heuristic=_heuristic,
)(_rope_kernel)


# --------------------------------------------------------------------------------------------------
# wrappers
# --------------------------------------------------------------------------------------------------
def _launch(x, cos, sin, style, layout, cu_seqlens, positions, start_positions, cp_size, cp_rank,
            out_dtype, backward):
    device = x.device
    dtype = _TORCH_FLOATS[out_dtype] if out_dtype is not None else x.dtype
    out = torch.empty(x.shape, dtype=dtype, device=device)
    rope_dim = cos.shape[-1]
    head_dim = x.shape[-1]
    keep, half = head_dim - rope_dim, rope_dim // 2

    if x.stride(-1) != 1:
        x = x.contiguous()
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()

    if layout == "thd":
        n0, n1, n_heads = x.shape[0], 1, x.shape[1]
        sx0, sx1, sxh = x.stride(0), 0, x.stride(1)
        so0, so1, soh = out.stride(0), 0, out.stride(1)
        n_seqs = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
        seq_len = 0
    else:
        n0, n1, n_heads = x.shape[0], x.shape[1], x.shape[2]
        sx0, sx1, sxh = x.stride(0), x.stride(1), x.stride(2)
        so0, so1, soh = out.stride(0), out.stride(1), out.stride(2)
        seq_len = x.shape[0] if layout == "sbhd" else x.shape[1]
        n_seqs = x.shape[1] if layout == "sbhd" else x.shape[0]
    n_tokens = n0 * n1
    if out.numel() == 0:
        return out

    dummy = placeholder(torch.int32, device)  # positions / cu_seqlens / start slots switched off
    sp_b = sp_s = 0
    if positions is not None:
        positions = positions.to(device)
        if positions.dim() == 2:  # [B, S] of the 4-D layouts
            sp_b, sp_s = positions.stride(0), positions.stride(1)
        else:  # thd [T], or [S] shared by every batch entry
            sp_s = positions.stride(0)
    cu = cu_seqlens.to(device) if cu_seqlens is not None else dummy
    start = start_positions.to(device) if start_positions is not None else dummy

    if backward:  # the transpose reads the forward's outputs and writes its inputs
        in_paired, out_paired = style == "interleaved", style in ("mla", "interleaved")
    else:
        in_paired, out_paired = style in ("mla", "interleaved"), style == "interleaved"

    block_keep = triton.next_power_of_2(keep) if keep > 0 else 1
    block_half = triton.next_power_of_2(half)
    args = (x, out, cos, sin, positions if positions is not None else dummy, cu, start,
            n_tokens, n1, n_heads, sx0, sx1, sxh, so0, so1, soh, cos.stride(0), sin.stride(0),
            sp_b, sp_s, n_seqs, n_seqs.bit_length() + 1, seq_len, cp_size, cp_rank,
            min(max(n_tokens - 1, 1).bit_length(), 24))
    meta = dict(
        KEEP=keep, BLOCK_KEEP=block_keep, HALF=half, BLOCK_HALF=block_half,
        LAYOUT=_LAYOUT_CODE[layout], EXPLICIT=positions is not None,
        HAS_CU=cu_seqlens is not None, HAS_START=start_positions is not None, CP=cp_size > 1,
        IN_PAIRED=in_paired, OUT_PAIRED=out_paired, TAB_PAIRED=style == "interleaved", BACKWARD=backward,
        CONVERT_KEEP=x.dtype != dtype,
    )
    if interpret_mode():
        cfg = _fixed_config(n_heads, block_keep, block_half)
        grid = (cdiv(n_tokens, cfg["BLOCK_T"]),)
        fast_launch(_rope_kernel, grid, *args, **meta, **cfg, enable_fp_fusion=False)
    else:
        grid = lambda m: (cdiv(n_tokens, m["BLOCK_T"]),)  # noqa: E731
        fast_launch(_rope_autotuned, grid, *args, **meta, enable_fp_fusion=False)
    return out



def _rope_reasons(*args, **kwargs) -> List[str]:
    """Device reasons, plus the dtypes this kernel reads (x / grad is the first argument)."""
    reasons = triton_reasons(*args, **kwargs)
    x = args[0] if args else kwargs.get("x", kwargs.get("grad"))
    if isinstance(x, torch.Tensor) and _NAME_OF.get(x.dtype) not in FLOAT_DTYPES:
        reasons.append(f"x dtype {x.dtype} is not one of {FLOAT_DTYPES}")
    return reasons


@register("rope", "triton", check=_rope_reasons)
def rope(x, cos, sin, style="mla", layout="thd", cu_seqlens=None, positions=None, start_positions=None,
         cp_size=1, cp_rank=0, out_dtype=None):
    """spec.rope on CUDA (or the interpreter): see the module docstring for the kernel."""
    assert style in ROPE_STYLES and layout in LAYOUTS
    return _launch(x, cos, sin, style, layout, cu_seqlens, positions, start_positions, cp_size, cp_rank,
                   out_dtype, backward=False)


@register("rope_backward", "triton", check=_rope_reasons)
def rope_backward(grad, cos, sin, style="mla", layout="thd", cu_seqlens=None, positions=None,
                  start_positions=None, cp_size=1, cp_rank=0, out_dtype=None):
    """spec.rope_backward: the exact transpose of the rotation, same kernel with BACKWARD set."""
    assert style in ROPE_STYLES and layout in LAYOUTS
    return _launch(grad, cos, sin, style, layout, cu_seqlens, positions, start_positions, cp_size, cp_rank,
                   out_dtype, backward=True)
