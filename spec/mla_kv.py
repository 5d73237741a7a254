"""MLA's key and value as MXFP8 attention operands (SEMANTICS.md section 9), NumPy + ml_dtypes.

`mla_kv_quantize(k_nope, k_pe, v, layout="bshd", cos=None, sin=None) -> (k, v)`:
- k_nope [..., H, 128], the per-head part of the key; k_pe [..., 1 or H, 64], its RoPE part: one row
  per position shared by every head (MLA's decoupled key), or one per head; v [..., H, 128] with
  k_nope's leading shape.
- cos, sin (both or neither): RoPE tables [max_positions, 64] as spec.rope takes them. Given, k_pe is
  first replaced by `rope(k_pe, cos, sin, style="mla", layout=layout)` in k_pe's dtype: a row's
  position is its index along the sequence axis (in thd the whole T is one sequence), rope's defaults
  with no cu_seqlens, positions or context parallelism. The result is that of calling this op on the
  rotated k_pe, byte for byte. Absent, k_pe is taken as already rotated; any other RoPE (packed thd
  sequences, explicit positions, another style) is `rope` first, then this op without tables.
- k = mxfp8_quantize(concatenate([k_nope, k_pe broadcast to H heads], last axis), axis=-1): the key
  [..., H, 192] blocked along the head dim, as attention's q . k contracts it.
- v = mxfp8_quantize(v, axis=<sequence axis>): blocked along the positions, as p . v contracts them.
Both e4m3, rceil, saturate, compact scales (spec.quantize's defaults). The concatenation is in
k_nope's dtype (k_pe must share it) and is never rounded: every 32-block of k lies inside one part
(128 and 64 are multiples of 32), so k's codes and scales are those of k_nope and of k_pe quantized
each on their own, side by side. A backend may therefore skip writing the concatenation.

Layouts (the sequence and head axes): "bshd" [B, S, H, D] (1, 2), "sbhd" [S, B, H, D] (0, 2),
"thd" [T, H, D] (0, 1). The sequence length must be a multiple of 32 (v's blocks).
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from . import checks
from .constants import BLOCK_SIZE, FLOAT_DTYPES, MLA_QK_HEAD_DIM, MLA_ROPE_DIM, MLA_V_HEAD_DIM
from .quantize import mxfp8_quantize
from .rope import rope, validate_rope

__all__ = ["mla_kv_quantize", "validate_mla_kv_quantize", "validate_mla_kv_tables", "mla_kv_axes", "MLA_KV_LAYOUTS"]

# layout -> (dims, sequence axis, head axis)
MLA_KV_LAYOUTS: Dict[str, Tuple[int, int, int]] = {"bshd": (4, 1, 2), "sbhd": (4, 0, 2), "thd": (3, 0, 1)}
NOPE_DIM = MLA_QK_HEAD_DIM - MLA_ROPE_DIM  # 128


def mla_kv_axes(layout: str) -> Tuple[int, int]:
    """(sequence axis, head axis) of a layout."""
    checks.require_choice("layout", layout, tuple(MLA_KV_LAYOUTS))
    _, seq, head = MLA_KV_LAYOUTS[layout]
    return seq, head


def validate_mla_kv_quantize(k_nope, k_pe, v, layout="bshd", cos=None, sin=None):
    """Raise TypeError/ValueError naming the first bad argument of `mla_kv_quantize`."""
    if not isinstance(layout, str) or layout not in MLA_KV_LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(MLA_KV_LAYOUTS)}, got {layout!r}")
    nd, seq, head = MLA_KV_LAYOUTS[layout]
    for name, t, d in (("k_nope", k_nope, NOPE_DIM), ("k_pe", k_pe, MLA_ROPE_DIM), ("v", v, MLA_V_HEAD_DIM)):
        checks.require_array(name, t)
        if checks.dtype_name(t) not in FLOAT_DTYPES:
            raise TypeError(f"{name}: expected float32, bfloat16 or float16, got {checks.dtype_name(t)}")
        if len(t.shape) != nd or t.shape[-1] != d:
            raise ValueError(f"{name}: expected {nd} dims ({layout}) with last axis {d}, got shape {tuple(t.shape)}")
    lead = tuple(k_nope.shape[:-1])
    if tuple(v.shape[:-1]) != lead:
        raise ValueError(f"v: expected the leading shape of k_nope {lead}, got {tuple(v.shape)}")
    pe_lead = tuple(k_pe.shape[:-1])
    heads = lead[head]
    if pe_lead[:head] + pe_lead[head + 1:] != lead[:head] + lead[head + 1:] or pe_lead[head] not in (1, heads):
        raise ValueError(f"k_pe: expected shape {lead[:head]} + (1 or {heads},) + {lead[head + 1:]} + "
                         f"({MLA_ROPE_DIM},), got {tuple(k_pe.shape)}")
    if checks.dtype_name(k_pe) != checks.dtype_name(k_nope):
        raise TypeError(f"k_pe: expected the dtype of k_nope ({checks.dtype_name(k_nope)}: k is one tensor), "
                        f"got {checks.dtype_name(k_pe)}")
    if v.shape[seq] % BLOCK_SIZE:
        raise ValueError(f"v: its sequence axis {seq} ({layout}) is blocked by {BLOCK_SIZE}; got length "
                         f"{v.shape[seq]}, not a multiple of {BLOCK_SIZE}")
    validate_mla_kv_tables(cos, sin)
    if cos is not None:
        validate_rope(k_pe, cos, sin, style="mla", layout=layout)


def validate_mla_kv_tables(cos, sin):
    """The rules mla_kv_quantize adds to rope's for its tables: both or neither, and exactly k_pe's
    width (rope itself would take narrower tables and pass k_pe's leading features through). Kept apart
    from rope's validator for callers that defer that one (dispatch.autograd while compiling)."""
    if (cos is None) != (sin is None):
        given, missing = ("cos", "sin") if sin is None else ("sin", "cos")
        raise ValueError(f"{missing}: RoPE of k_pe takes both tables; {given} was given without {missing}")
    if cos is not None:
        checks.require_array("cos", cos)
        if len(cos.shape) == 2 and cos.shape[1] != MLA_ROPE_DIM:
            raise ValueError(f"cos: expected tables [max_positions, {MLA_ROPE_DIM}] (k_pe's width), got shape "
                             f"{tuple(cos.shape)}")


def mla_kv_quantize(k_nope, k_pe, v, layout: str = "bshd", cos=None, sin=None):
    """(k, v) MXTensors: k [..., H, 192] blocked along the last axis, v blocked along the sequence axis;
    k_pe rotated first when cos and sin are given (module docstring)."""
    validate_mla_kv_quantize(k_nope, k_pe, v, layout, cos, sin)
    seq, _ = mla_kv_axes(layout)
    if cos is not None:
        k_pe = rope(k_pe, cos, sin, style="mla", layout=layout)
    k_nope = np.asarray(k_nope)
    k_pe = np.broadcast_to(np.asarray(k_pe), k_nope.shape[:-1] + (MLA_ROPE_DIM,))
    k = np.concatenate([k_nope, k_pe], axis=-1)  # same dtype: no rounding
    return mxfp8_quantize(k, axis=-1), mxfp8_quantize(np.asarray(v), axis=seq)
