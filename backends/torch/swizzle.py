"""Eager torch scale swizzle (CPU and CUDA), byte-equal to spec.swizzle (SEMANTICS 3).

Zero-pad the 2-D scale matrix to (R', C'), view it as (R'/128, 4, 32, C'/4, 4), permute to
(0, 3, 2, 1, 4) and make it contiguous; the inverse applies the same (self-inverse) permutation to the
swizzled bytes viewed as (R'/128, C'/4, 32, 4, 4). Same choices as spec: an already swizzled (or compact)
tensor is returned as is; matrices may carry leading batch dimensions.
`pack_attention_scales` mirrors spec.swizzle.pack_attention_scales for device-side callers (cuDNN).
"""
from __future__ import annotations

import torch

from spec.constants import SWIZZLE_COLS, SWIZZLE_ROWS
from spec.mxtensor import MXTensor
from spec.swizzle import validate_pack_attention_scales

from ..registry import register
from ._common import torch_tensor_reasons

_ROW_GROUPS = SWIZZLE_ROWS // 32


def _roundup(n: int, m: int) -> int:
    return -(-n // m) * m


def _permute(nb: int):
    return tuple(range(nb)) + tuple(nb + k for k in (0, 3, 2, 1, 4))


def swizzle_matrix(s: torch.Tensor) -> torch.Tensor:
    """S[..., R, C] -> swizzled bytes [..., R', C'] (zero padding), on s's device."""
    *batch, rows, cols = s.shape
    rp, cp = _roundup(rows, SWIZZLE_ROWS), _roundup(cols, SWIZZLE_COLS)
    padded = s.new_zeros((*batch, rp, cp))
    padded[..., :rows, :cols] = s
    tiles = padded.view(*batch, rp // SWIZZLE_ROWS, _ROW_GROUPS, 32, cp // SWIZZLE_COLS, SWIZZLE_COLS)
    return tiles.permute(_permute(len(batch))).contiguous().view(*batch, rp, cp)


def unswizzle_matrix(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Swizzled bytes [..., R', C'] (or flat [..., R'*C']) -> S[..., rows, cols]."""
    rp, cp = _roundup(rows, SWIZZLE_ROWS), _roundup(cols, SWIZZLE_COLS)
    if buf.dim() >= 2 and tuple(buf.shape[-2:]) == (rp, cp):
        batch = tuple(buf.shape[:-2])
    elif buf.dim() >= 1 and buf.shape[-1] == rp * cp:
        batch = tuple(buf.shape[:-1])
    else:
        raise ValueError(
            f"buf: expected shape [..., {rp}, {cp}] or [..., {rp * cp}] for a {rows}x{cols} scale matrix, "
            f"got {tuple(buf.shape)}"
        )
    tiles = buf.reshape(*batch, rp // SWIZZLE_ROWS, cp // SWIZZLE_COLS, 32, _ROW_GROUPS, SWIZZLE_COLS)
    padded = tiles.permute(_permute(len(batch))).reshape(*batch, rp, cp)
    return padded[..., :rows, :cols].contiguous()


@register("swizzle_scales", "torch", check=torch_tensor_reasons)
def swizzle_scales(t: MXTensor) -> MXTensor:
    if t.scale_layout == "swizzled":
        return t
    mat = t.scale.movedim(t.axis, -1).reshape(t.scale_matrix_shape)
    return t.replace(scale=swizzle_matrix(mat), scale_layout="swizzled")


@register("unswizzle_scales", "torch", check=torch_tensor_reasons)
def unswizzle_scales(t: MXTensor) -> MXTensor:
    if t.scale_layout == "compact":
        return t
    rows, cols = t.scale_matrix_shape
    mat = unswizzle_matrix(t.scale, rows, cols)
    other = [n for i, n in enumerate(t.compact_scale_shape) if i != t.axis]
    compact = mat.reshape(*other, cols).movedim(-1, t.axis).contiguous()
    return t.replace(scale=compact, scale_layout="compact")


def pack_attention_scales(t: MXTensor, role: str, layout: str = "bshd") -> torch.Tensor:
    """Per-(batch, head) swizzled scales for cuDNN MXFP8 SDPA; same bytes and shapes as spec's."""
    validate_pack_attention_scales(t, role, layout)
    t = unswizzle_scales(t)
    batch_axis, seq_axis = (0, 1) if layout == "bshd" else (1, 0)
    if role == "qk":
        return swizzle_matrix(t.scale.permute(batch_axis, 2, seq_axis, 3))
    swz = swizzle_matrix(t.scale.permute(batch_axis, 2, 3, seq_axis))  # [B, H, D', S'/32]: blocked axis last
    b, h, dp, sp = swz.shape
    return swz.view(b, h, sp, dp)
