"""Scale swizzle (SEMANTICS.md section 3): the cuBLAS / cuDNN F8_128x4 block-scaling-factor layout.

The 2-D scale matrix S[R, C] (compact scales with the blocked axis moved last and the other axes
flattened in order) is padded with 0x00 to R' = roundup(R, 128), C' = roundup(C, 4) and its byte
S[i, j] is stored at

    ((i // 128) * (C' / 4) + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + (j % 4),

which is the padded matrix viewed as (R'/128, 4, 32, C'/4, 4), permuted to (0, 3, 2, 1, 4) and flattened.
A swizzled MXTensor holds those bytes in an array of shape (R', C') (row-major order = swizzled order).

Choices SEMANTICS.md leaves open (tested in tests/test_swizzle.py):
- `swizzle_scales` on an already swizzled tensor and `unswizzle_scales` on a compact one return the
  tensor unchanged (the same object): the layout lives in the type, so "give me this tensor in layout
  L" is well defined and idempotent; there is no way to swizzle twice by accident.
- `swizzle_matrix` / `unswizzle_matrix` work on a batch of matrices ([..., R, C]); `unswizzle_matrix`
  accepts the buffer as [..., R', C'] or flat [..., R'*C'].
- `pack_attention_scales` supports layouts "bshd" and "sbhd" ("thd" has no per-(batch, head) padded
  matrix without per-sequence offsets, so it is a ValueError). For role "v" the 2-D matrix of each
  (batch, head) is, as section 3 step 1 says for any blocked axis, the blocked axis (S/32) last:
  [D, S/32], padded to [roundup(D, 128), roundup(S/32, 4)] and swizzled. Its bytes are returned in an
  array of the cuDNN logical shape [B, H, roundup(S/32, 4), roundup(D, 128)] (C-contiguous, so each
  (b, h) slice holds the swizzled bytes in order; describe it to cuDNN as that shape with the S/32
  dim fastest, like cuDNN's column-major "B" scale tensors).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import checks
from .constants import SWIZZLE_COLS, SWIZZLE_ROWS
from .mxtensor import MXTensor

__all__ = [
    "swizzle_scales",
    "unswizzle_scales",
    "validate_swizzle_scales",
    "validate_unswizzle_scales",
    "swizzle_matrix",
    "unswizzle_matrix",
    "swizzle_offset",
    "pack_attention_scales",
    "validate_pack_attention_scales",
]

ATTENTION_ROLES = ("qk", "v")
ATTENTION_LAYOUTS = ("bshd", "sbhd")
# rows of one swizzle tile are split into 4 groups of 32 interleaved inside each 512-byte tile
_ROW_GROUPS = SWIZZLE_ROWS // 32
_TILE_BYTES = SWIZZLE_ROWS * SWIZZLE_COLS


def _roundup(n: int, m: int) -> int:
    return -(-n // m) * m


def swizzle_offset(i: Any, j: Any, cols: int) -> Any:
    """Byte offset of S[i, j] in the swizzled buffer of a matrix with `cols` columns (unpadded).

    The formula of SEMANTICS 3.3; works on ints and integer arrays."""
    tiles_per_row = _roundup(cols, SWIZZLE_COLS) // SWIZZLE_COLS
    return (
        ((i // SWIZZLE_ROWS) * tiles_per_row + j // SWIZZLE_COLS) * _TILE_BYTES
        + (i % 32) * (_ROW_GROUPS * SWIZZLE_COLS)
        + ((i % SWIZZLE_ROWS) // 32) * SWIZZLE_COLS
        + (j % SWIZZLE_COLS)
    )


def swizzle_matrix(s: Any) -> np.ndarray:
    """Pad S[..., R, C] with zeros to [..., R', C'] and return its bytes in swizzled order, shape [..., R', C']."""
    s = np.asarray(s)
    if s.ndim < 2:
        raise ValueError(f"s: expected a matrix [..., R, C], got shape {s.shape}")
    *batch, rows, cols = s.shape
    rp, cp = _roundup(rows, SWIZZLE_ROWS), _roundup(cols, SWIZZLE_COLS)
    padded = np.zeros((*batch, rp, cp), dtype=s.dtype)
    padded[..., :rows, :cols] = s
    nb = len(batch)
    tiles = padded.reshape(*batch, rp // SWIZZLE_ROWS, _ROW_GROUPS, 32, cp // SWIZZLE_COLS, SWIZZLE_COLS)
    lead = tuple(range(nb))
    perm = lead + tuple(nb + k for k in (0, 3, 2, 1, 4))
    return np.ascontiguousarray(tiles.transpose(perm)).reshape(*batch, rp, cp)


def unswizzle_matrix(buf: Any, rows: int, cols: int) -> np.ndarray:
    """Inverse of `swizzle_matrix`: swizzled bytes [..., R', C'] (or flat [..., R'*C']) -> S[..., rows, cols]."""
    buf = np.asarray(buf)
    rp, cp = _roundup(rows, SWIZZLE_ROWS), _roundup(cols, SWIZZLE_COLS)
    if buf.ndim >= 2 and tuple(buf.shape[-2:]) == (rp, cp):
        batch = buf.shape[:-2]
    elif buf.ndim >= 1 and buf.shape[-1] == rp * cp:
        batch = buf.shape[:-1]
    else:
        raise ValueError(
            f"buf: expected shape [..., {rp}, {cp}] or [..., {rp * cp}] for a {rows}x{cols} scale matrix, "
            f"got {tuple(buf.shape)}"
        )
    nb = len(batch)
    tiles = buf.reshape(*batch, rp // SWIZZLE_ROWS, cp // SWIZZLE_COLS, 32, _ROW_GROUPS, SWIZZLE_COLS)
    perm = tuple(range(nb)) + tuple(nb + k for k in (0, 3, 2, 1, 4))  # the permutation is its own inverse
    padded = tiles.transpose(perm).reshape(*batch, rp, cp)
    return np.ascontiguousarray(padded[..., :rows, :cols])


def _require_mxtensor(name: str, t: Any) -> None:
    if not isinstance(t, MXTensor):
        raise TypeError(f"{name}: expected an MXTensor, got {type(t).__name__}")
    if checks.dtype_name(t.scale) != "uint8":
        raise TypeError(f"{name}: expected scale dtype uint8, got {checks.dtype_name(t.scale)}")


def validate_swizzle_scales(t):
    _require_mxtensor("t", t)


def validate_unswizzle_scales(t):
    _require_mxtensor("t", t)


def _scale_matrix(t: MXTensor) -> np.ndarray:
    """The compact scales as S[R, C]: blocked axis last, other axes flattened in order."""
    return np.moveaxis(np.asarray(t.scale), t.axis, -1).reshape(t.scale_matrix_shape)


def swizzle_scales(t: MXTensor) -> MXTensor:
    """Compact -> swizzled scales (shape t.swizzled_scale_shape, zero padding). Swizzled input: returned as is."""
    validate_swizzle_scales(t)
    if t.scale_layout == "swizzled":
        return t
    return t.replace(scale=swizzle_matrix(_scale_matrix(t)), scale_layout="swizzled")


def unswizzle_scales(t: MXTensor) -> MXTensor:
    """Swizzled -> compact scales, padding dropped. Compact input: returned as is."""
    validate_unswizzle_scales(t)
    if t.scale_layout == "compact":
        return t
    rows, cols = t.scale_matrix_shape
    s = unswizzle_matrix(t.scale, rows, cols)
    other = [n for i, n in enumerate(t.compact_scale_shape) if i != t.axis]
    compact = np.moveaxis(s.reshape(*other, cols), -1, t.axis)
    return t.replace(scale=np.ascontiguousarray(compact), scale_layout="compact")


def _attention_axes(layout: str):
    """(batch axis, sequence axis) of a 4-D q/k/v tensor; heads are axis 2, features axis 3."""
    return (0, 1) if layout == "bshd" else (1, 0)


def validate_pack_attention_scales(t, role, layout="bshd"):
    _require_mxtensor("t", t)
    checks.require_choice("role", role, ATTENTION_ROLES)
    checks.require_choice("layout", layout, ATTENTION_LAYOUTS)
    if t.ndim != 4:
        raise ValueError(f"t: expected 4 dimensions ({layout}), got shape {t.shape}")
    _, seq_axis = _attention_axes(layout)
    want = 3 if role == "qk" else seq_axis
    if t.axis != want:
        what = "D (features)" if role == "qk" else "S (sequence)"
        raise ValueError(f"t: role {role!r} needs scales blocked along {what}, axis {want} of {layout}; got axis {t.axis}")


def pack_attention_scales(t: MXTensor, role: str, layout: str = "bshd") -> np.ndarray:
    """Per-(batch, head) swizzled scale matrices for cuDNN's MXFP8 SDPA (SEMANTICS 3, attention).

    role "qk" (t blocked along D): [B, H, roundup(S, 128), roundup(D/32, 4)], each (b, h) the swizzle of
    its [S, D/32] matrix. role "v" (t blocked along S): [B, H, roundup(S/32, 4), roundup(D, 128)], each
    (b, h) holding the swizzle of its [D, S/32] matrix (module docstring). Padding bytes are 0x00.
    """
    validate_pack_attention_scales(t, role, layout)
    t = unswizzle_scales(t)
    batch_axis, seq_axis = _attention_axes(layout)
    scale = np.asarray(t.scale)
    if role == "qk":
        # [.., S, .., H, D/32] -> [B, H, S, D/32]
        per_head = np.transpose(scale, (batch_axis, 2, seq_axis, 3))
        return swizzle_matrix(per_head)
    # [.., S/32, .., H, D] -> [B, H, D, S/32] (blocked axis last), swizzled, stored as [B, H, S'/32, D']
    per_head = np.transpose(scale, (batch_axis, 2, 3, seq_axis))
    swz = swizzle_matrix(per_head)
    b, h, dp, sp = swz.shape
    return swz.reshape(b, h, sp, dp)
