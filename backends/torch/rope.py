"""Eager torch RoPE (CPU and CUDA), byte-equal to spec.rope.

Eager torch runs each elementwise mul / add as its own kernel (one fp32 RN each), so
`RN(RN(a*c) + sign*RN(b*s))` is computed without FMA contraction, exactly as the spec does. The style
rule comes from spec.rope's index tables, so spec and torch read one definition of each style.
Arguments were validated by the dispatcher (spec.rope validators); semantics in spec/rope.py.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from spec.rope import rotation_indices, transpose_indices

from ..registry import register
from ._common import TORCH_DTYPES, torch_tensor_reasons


def token_positions(x: torch.Tensor, layout: str = "thd", cu_seqlens: Optional[torch.Tensor] = None,
                    positions: Optional[torch.Tensor] = None, start_positions: Optional[torch.Tensor] = None,
                    cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """int64 position of every token of x on x's device, shaped x.shape[:-2] (thd [T], sbhd [S, B],
    bshd [B, S]). Same rule as spec.rope; no host synchronisation (searchsorted, not repeat)."""
    device = x.device
    if layout == "thd":
        n_tokens = x.shape[0]
        if positions is not None:
            return positions.to(device=device, dtype=torch.int64)
        if cu_seqlens is None:
            cu = torch.tensor([0, n_tokens], dtype=torch.int64, device=device)
        else:
            cu = cu_seqlens.to(device=device, dtype=torch.int64)
        token = torch.arange(n_tokens, dtype=torch.int64, device=device)
        # Sequence of each token: the first b with cu[b+1] > token (empty sequences are skipped).
        seq = torch.searchsorted(cu[1:], token, right=True)
        local = token - cu[seq]
        seq_length = (cu[1:] - cu[:-1])[seq]
    else:
        s_axis, b_axis = (0, 1) if layout == "sbhd" else (1, 0)
        seq_len, n_seqs = x.shape[s_axis], x.shape[b_axis]
        if positions is not None:
            pos = positions.to(device=device, dtype=torch.int64).expand(n_seqs, seq_len)
            return (pos.t() if layout == "sbhd" else pos).contiguous()
        # Batch-first [B, S]; transposed to the layout's token order at the end.
        seq = torch.arange(n_seqs, dtype=torch.int64, device=device)[:, None].expand(n_seqs, seq_len)
        local = torch.arange(seq_len, dtype=torch.int64, device=device)[None, :].expand(n_seqs, seq_len)
        seq_length = torch.full_like(local, seq_len)

    if cp_size > 1:
        # Rank r holds chunks r and 2*cp_size-1-r of each sequence, each chunk half its local length.
        chunk = seq_length // 2
        second = local >= chunk
        chunk_index = torch.where(second, 2 * cp_size - 1 - cp_rank, cp_rank)
        pos = chunk_index * chunk + local - torch.where(second, chunk, torch.zeros_like(chunk))
    else:
        pos = local
    if start_positions is not None:
        pos = pos + start_positions.to(device=device, dtype=torch.int64)[seq]
    if layout == "sbhd":
        pos = pos.t()
    return pos.contiguous()


def _canonical_nan_(t: torch.Tensor) -> torch.Tensor:
    """Write every NaN of t as its dtype's positive quiet NaN (fp32 0x7FC00000, bf16 0x7FC0,
    fp16 0x7E00), matching spec (NaN bits after arithmetic differ between CPU and GPU)."""
    return t.masked_fill_(torch.isnan(t), math.nan)


def _apply(v, cos, sin, pos, first, second, sign, c_cols, s_cols, out_dtype):
    """out[i] = RN(RN(v[first[i]] * c[c_cols[i]]) + sign[i] * RN(v[second[i]] * s[s_cols[i]])) on the
    last rope_dim features of every head; the others pass through."""
    device = v.device
    rope_dim, head_dim = cos.shape[-1], v.shape[-1]
    keep = head_dim - rope_dim
    dtype = TORCH_DTYPES[out_dtype] if out_dtype is not None else v.dtype
    idx = lambda a: torch.as_tensor(a, dtype=torch.int64, device=device)  # noqa: E731
    first, second, c_cols, s_cols = idx(first), idx(second), idx(c_cols), idx(s_cols)
    sign = torch.as_tensor(sign, dtype=torch.float32, device=device)

    flat_pos = pos.reshape(-1)
    # Gather the token rows, widen exactly to fp32, then broadcast over heads: [..., 1, R].
    c = cos.index_select(0, flat_pos).float().index_select(-1, c_cols).reshape(*pos.shape, 1, rope_dim)
    s = sin.index_select(0, flat_pos).float().index_select(-1, s_cols).reshape(*pos.shape, 1, rope_dim)
    vr = v[..., keep:].float()
    p = vr.index_select(-1, first) * c  # separate eager kernels: one RN each, no FMA
    q = vr.index_select(-1, second) * s
    rotated = p + q * sign  # sign is +-1: exact negation, so RN(p - q) or RN(p + q)

    out = torch.empty(v.shape, dtype=dtype, device=device)
    out[..., keep:] = _canonical_nan_(rotated.to(dtype))
    kept = v[..., :keep]
    if kept.dtype == dtype:
        out[..., :keep] = kept  # same-dtype copy: bytes untouched
    else:
        out[..., :keep] = _canonical_nan_(kept.float().to(dtype))
    return out


@register("rope", "torch", check=torch_tensor_reasons)
def rope(x, cos, sin, style="mla", layout="thd", cu_seqlens=None, positions=None, start_positions=None,
         cp_size=1, cp_rank=0, out_dtype=None):
    pos = token_positions(x, layout, cu_seqlens, positions, start_positions, cp_size, cp_rank)
    rope_dim = cos.shape[-1]
    first, second, sign = rotation_indices(style, rope_dim)
    identity = range(rope_dim)
    return _apply(x, cos, sin, pos, first, second, sign, identity, identity, out_dtype)


@register("rope_backward", "torch", check=torch_tensor_reasons)
def rope_backward(grad, cos, sin, style="mla", layout="thd", cu_seqlens=None, positions=None,
                  start_positions=None, cp_size=1, cp_rank=0, out_dtype=None):
    pos = token_positions(grad, layout, cu_seqlens, positions, start_positions, cp_size, cp_rank)
    first, second, sign = transpose_indices(style, cos.shape[-1])
    return _apply(grad, cos, sin, pos, first, second, sign, first, second, out_dtype)
