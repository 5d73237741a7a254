"""RoPE forward and backward (SEMANTICS.md section 4), bit-exact in NumPy.

Rotates the last `rope_dim = cos.shape[-1]` features of every head by the cos/sin table rows of the
token's position; features before them pass through. Every operation is one fp32 RN, never an FMA:
`out = RN(RN(a*c) -+ RN(b*s))`, then one rounding to `out_dtype`.

Arguments
- x: `[T, H, D]` (layout "thd"), `[S, B, H, D]` ("sbhd") or `[B, S, H, D]` ("bshd");
  float32, bfloat16 or float16 (widened to fp32 exactly).
- cos, sin: `[max_positions, rope_dim]` tables, float32 or bfloat16, equal shape and dtype; rope_dim
  even, 2 <= rope_dim <= D. Row p holds the values for position p.
- style: "mla" | "neox" | "interleaved" (formulas in `rotation_indices`).
- cu_seqlens: thd only, int32 `[B+1]`, starting at 0, non-decreasing, ending at T. Sequences may be
  empty. Absent in thd: the whole T is one sequence.
- positions: explicit per-token positions, int32 or int64: `[T]` for thd; `[S]` (shared by every
  batch entry) or `[B, S]` (batch first, in both sbhd and bshd) for the 4-D layouts.
- start_positions: int32 or int64 `[B]`, added to the position of every token of sequence b
  (B = len(cu_seqlens) - 1 in thd, or 1 without cu_seqlens).
- cp_size, cp_rank: context parallelism. x holds this rank's tokens only; a sequence of global length
  G is split into 2*cp_size chunks of G/(2*cp_size) and rank r holds chunks r and 2*cp_size-1-r, in
  that order. Local token i of a local sequence of length L (so chunk = L/2) has global position
  r*chunk + i for i < chunk and (2*cp_size-1-r)*chunk + (i - chunk) otherwise.
- out_dtype: "float32" | "bfloat16" | "float16"; default x's (grad's) dtype.

Choices SEMANTICS.md leaves open (each tested in tests/test_rope.py)
- cu_seqlens describe x as given, i.e. the *local* sequences on this rank (they end at T). TE's API
  instead takes the global padded cu_seqlens and divides by cp_size; pass those divided here.
- With cp_size > 1 every local sequence length must be even (else ValueError naming cu_seqlens, or x
  when the lengths come from x's shape).
- start_positions compose with context parallelism: position = start_positions[b] + global position.
- Explicit `positions` are final: combining them with start_positions or cp_size > 1 is a ValueError.
- cu_seqlens with layout sbhd/bshd is a ValueError (those layouts have one length, S).
- Every position must lie in [0, cos.shape[0]); otherwise ValueError (naming positions when they were
  explicit, start_positions when those are negative, cos otherwise).
- NaN: every NaN the rotation produces is written as the output dtype's positive quiet NaN
  (fp32 0x7FC00000, bf16 0x7FC0, fp16 0x7E00), because NaN sign/payload after arithmetic differs
  between CPUs and GPUs. Pass-through features are byte copies when out_dtype is x's dtype; when it is
  not they are widened to fp32 exactly and rounded once to out_dtype, NaN made canonical as above.
- The validators read the values of cu_seqlens, positions and start_positions (monotonicity, table
  range), so a CUDA caller pays one small device-to-host copy in validation. What shapes alone decide
  (the table length when no index tensor is given, an odd local length with cp_size > 1) is checked
  without reading values, so `dispatch` checks it for every call; the value checks run there on CPU
  calls, and on CUDA under MXMLA_CHECK_VALUES=1 (dispatch's docstring).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .lazy_ml_dtypes import ml_dtypes
from .checks import (
    dtype_name,
    require_choice,
    require_dtype,
    require_ndim,
    require_same_shape,
    value_checks_enabled,
)
from .constants import FLOAT_DTYPES, LAYOUTS, ROPE_STYLES

TABLE_DTYPES = ("float32", "bfloat16")
POSITION_DTYPES = ("int32", "int64")
CU_SEQLENS_DTYPES = ("int32",)


def _numpy_dtype(name: str):
    return {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[name]


# --------------------------------------------------------------------------------------------------
# The three styles as index tables (shared with the backends so every implementation reads one rule)
# --------------------------------------------------------------------------------------------------
def rotation_indices(style: str, rope_dim: int):
    """Forward rule as index tables `(first, second, sign)`, each of length rope_dim:

        out[i] = RN( RN(x[first[i]] * c[i]) + sign[i] * RN(x[second[i]] * s[i]) )

    sign is +-1, and multiplying by -1 is an exact negation, so this is RN(p - q) or RN(p + q).
    With h = rope_dim / 2 and k < h:
    - mla:         out[k]   = x[2k]*c[k] - x[2k+1]*s[k];   out[h+k] = x[2k+1]*c[h+k] + x[2k]*s[h+k]
    - neox:        out[k]   = x[k]*c[k]  - x[h+k]*s[k];    out[h+k] = x[h+k]*c[h+k]  + x[k]*s[h+k]
    - interleaved: out[2k]  = x[2k]*c[2k] - x[2k+1]*s[2k]; out[2k+1] = x[2k+1]*c[2k+1] + x[2k]*s[2k+1]
    """
    h = rope_dim // 2
    k = np.arange(h, dtype=np.int64)
    i = np.arange(rope_dim, dtype=np.int64)
    halves_sign = np.concatenate([-np.ones(h), np.ones(h)]).astype(np.float32)
    if style == "mla":
        return np.concatenate([2 * k, 2 * k + 1]), np.concatenate([2 * k + 1, 2 * k]), halves_sign
    if style == "neox":
        return i, np.concatenate([k + h, k]), halves_sign
    if style == "interleaved":
        return i, i ^ 1, np.where(i % 2 == 0, -1.0, 1.0).astype(np.float32)
    raise ValueError(f"style: expected one of {ROPE_STYLES}, got {style!r}")


def transpose_indices(style: str, rope_dim: int):
    """Backward rule (the exact transpose of `rotation_indices`) as `(first, second, sign)`:

        dx[j] = RN( RN(g[first[j]] * c[first[j]]) + sign[j] * RN(g[second[j]] * s[second[j]]) )

    x[j] enters the forward once as x[first_fwd[i]] (coefficient c[i]) and once as x[second_fwd[i']]
    (coefficient sign[i'] * s[i']); both index maps are permutations, so their inverses give the
    transpose. For mla this is dx[2k] = RN(RN(gL*c[k]) + RN(gR*s[h+k])) and
    dx[2k+1] = RN(RN(gR*c[h+k]) - RN(gL*s[k])) with gL = g[k], gR = g[h+k].
    """
    first, second, sign = rotation_indices(style, rope_dim)
    first_inv = np.argsort(first)
    second_inv = np.argsort(second)
    return first_inv, second_inv, sign[second_inv]


# --------------------------------------------------------------------------------------------------
# Validation and positions
# --------------------------------------------------------------------------------------------------
def _host_ints(x: Any) -> np.ndarray:
    """Values of a NumPy array or torch tensor (duck-typed: spec never imports torch) as int64."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(np.int64)


def _require_int(name: str, value: Any, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {value!r}")
    value = int(value)
    if value < lo or (hi is not None and value >= hi):
        bound = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}: expected a value in {bound}, got {value}")
    return value


def _check_table_length_from_shapes(x_name, x, layout, cu_seqlens, positions, start_positions, cp_size,
                                    cp_rank, n_rows) -> None:
    """The table-length and cp checks that shapes alone decide: without cu_seqlens, positions and
    start_positions every sequence has the length of x's sequence axis, so the largest position
    needed is known without reading any index tensor (run under shape_checks_only too)."""
    if positions is not None or start_positions is not None or (layout == "thd" and cu_seqlens is not None):
        return
    seq_len = int(x.shape[0] if layout in ("thd", "sbhd") else x.shape[1])
    if seq_len == 0 or (layout != "thd" and 0 in (int(x.shape[0]), int(x.shape[1]))):
        return
    if cp_size > 1:
        if seq_len % 2:
            raise ValueError(f"{x_name}: sequence 0 has local length {seq_len}, expected a multiple of 2 "
                             f"with cp_size={cp_size}")
        # rank r holds global chunks r and 2*cp_size-1-r; the second ends at (2*cp_size-r)*chunk - 1
        chunk = seq_len // 2
        last = (2 * cp_size - cp_rank) * chunk - 1
    else:
        last = seq_len - 1
    if last >= n_rows:
        raise ValueError(f"cos: tables have {n_rows} rows but a token needs position {last} "
                         f"(cos and sin need at least {last + 1} rows)")


def _check_and_positions(x_name, x, cos, sin, style, layout, cu_seqlens, positions, start_positions,
                         cp_size, cp_rank, out_dtype) -> np.ndarray:
    """Validate every argument; return the int64 position of every token, shaped like x.shape[:-2]
    (thd [T], sbhd [S, B], bshd [B, S])."""
    require_choice("style", style, ROPE_STYLES)
    require_choice("layout", layout, LAYOUTS)
    require_dtype(x_name, x, FLOAT_DTYPES)
    require_ndim(x_name, x, (3,) if layout == "thd" else (4,))
    if out_dtype is not None:
        require_choice("out_dtype", out_dtype, FLOAT_DTYPES)

    require_dtype("cos", cos, TABLE_DTYPES)
    require_dtype("sin", sin, TABLE_DTYPES)
    require_ndim("cos", cos, (2,))
    require_same_shape("cos", cos, "sin", sin)
    if dtype_name(sin) != dtype_name(cos):
        raise TypeError(f"sin: expected the dtype of cos ({dtype_name(cos)}), got {dtype_name(sin)}")
    n_rows, rope_dim = int(cos.shape[0]), int(cos.shape[1])
    head_dim = int(x.shape[-1])
    if rope_dim < 2 or rope_dim % 2:
        raise ValueError(f"cos: rope_dim (last dim) must be a positive even number, got shape {tuple(cos.shape)}")
    if rope_dim > head_dim:
        raise ValueError(f"cos: rope_dim {rope_dim} exceeds the head dim {head_dim} of {x_name} (shape {tuple(x.shape)})")

    cp_size = _require_int("cp_size", cp_size, 1)
    cp_rank = _require_int("cp_rank", cp_rank, 0, cp_size)

    # Shape-only checks first: the dispatcher runs validators under shape_checks_only() (no reads of
    # index-tensor values, which could live on a GPU), and everything below that line reads values.
    if layout == "thd":
        if cu_seqlens is not None:
            require_dtype("cu_seqlens", cu_seqlens, CU_SEQLENS_DTYPES)
            require_ndim("cu_seqlens", cu_seqlens, (1,))
            if cu_seqlens.shape[0] < 2:
                raise ValueError(f"cu_seqlens: expected shape [B+1] with B >= 1, got shape {tuple(cu_seqlens.shape)}")
        n_seqs_static = 1 if cu_seqlens is None else int(cu_seqlens.shape[0]) - 1
    else:
        if cu_seqlens is not None:
            raise ValueError(f"cu_seqlens: only valid with layout 'thd', got layout {layout!r}")
        s_axis, b_axis = (0, 1) if layout == "sbhd" else (1, 0)
        seq_len, n_seqs_static = int(x.shape[s_axis]), int(x.shape[b_axis])
    if start_positions is not None:
        require_dtype("start_positions", start_positions, POSITION_DTYPES)
        require_ndim("start_positions", start_positions, (1,))
        if start_positions.shape[0] != n_seqs_static:
            raise ValueError(f"start_positions: expected shape [{n_seqs_static}] (one per sequence), "
                             f"got shape {tuple(start_positions.shape)}")
    if positions is not None:
        require_dtype("positions", positions, POSITION_DTYPES)
        if start_positions is not None:
            raise ValueError("positions: explicit positions are final; do not combine with start_positions")
        if cp_size > 1:
            raise ValueError(f"positions: explicit positions are global; do not combine with cp_size={cp_size}")
        if layout == "thd":
            require_ndim("positions", positions, (1,))
            if positions.shape[0] != x.shape[0]:
                raise ValueError(f"positions: expected shape [{x.shape[0]}] (one per token), got shape {tuple(positions.shape)}")
        else:
            require_ndim("positions", positions, (1, 2))
            want = [(seq_len,), (n_seqs_static, seq_len)]
            if tuple(positions.shape) not in want:
                raise ValueError(f"positions: expected shape [{seq_len}] or [{n_seqs_static}, {seq_len}] "
                                 f"([S] or [B, S]), got shape {tuple(positions.shape)}")
    _check_table_length_from_shapes(x_name, x, layout, cu_seqlens, positions, start_positions, cp_size,
                                    cp_rank, n_rows)
    if not value_checks_enabled():
        return None

    # Local index of each token inside its sequence, the sequence it belongs to, and its length.
    if layout == "thd":
        n_tokens = int(x.shape[0])
        if cu_seqlens is None:
            cu = np.array([0, n_tokens], dtype=np.int64)
            length_source = x_name
        else:
            cu = _host_ints(cu_seqlens)
            if cu[0] != 0:
                raise ValueError(f"cu_seqlens: expected to start at 0, got {cu[0]}")
            if np.any(np.diff(cu) < 0):
                raise ValueError(f"cu_seqlens: expected non-decreasing values, got {cu.tolist()}")
            if cu[-1] != n_tokens:
                raise ValueError(f"cu_seqlens: expected to end at T={n_tokens} (x.shape[0]), got {cu[-1]}")
            length_source = "cu_seqlens"
        n_seqs = cu.shape[0] - 1
        token = np.arange(n_tokens, dtype=np.int64)
        seq = np.searchsorted(cu[1:], token, side="right")
        local = token - cu[seq]
        lengths = np.diff(cu)
        seq_length = lengths[seq]
    else:
        n_seqs = n_seqs_static
        # Built batch-first [B, S]; transposed to the layout's token order at the end.
        seq = np.repeat(np.arange(n_seqs, dtype=np.int64)[:, None], seq_len, axis=1)
        local = np.repeat(np.arange(seq_len, dtype=np.int64)[None, :], n_seqs, axis=0)
        lengths = np.full(n_seqs, seq_len, dtype=np.int64)
        seq_length = np.full_like(local, seq_len)
        length_source = x_name

    if start_positions is not None:
        start = _host_ints(start_positions)
        if np.any(start < 0):
            raise ValueError(f"start_positions: expected non-negative values, got {start.tolist()}")

    if positions is not None:
        if layout == "thd":
            pos = _host_ints(positions)
        else:
            pos = np.broadcast_to(_host_ints(positions), (n_seqs, seq_len))
        if pos.size and (pos.min() < 0 or pos.max() >= n_rows):
            bad = int(pos.min()) if pos.min() < 0 else int(pos.max())
            raise ValueError(f"positions: value {bad} out of range [0, {n_rows}) of the cos/sin tables")
    else:
        if cp_size > 1:
            odd = np.nonzero(lengths % 2)[0]
            if odd.size:
                b = int(odd[0])
                raise ValueError(f"{length_source}: sequence {b} has local length {int(lengths[b])}, "
                                 f"expected a multiple of 2 with cp_size={cp_size}")
            chunk = seq_length // 2
            second = local >= chunk
            chunk_index = np.where(second, 2 * cp_size - 1 - cp_rank, cp_rank)
            pos = chunk_index * chunk + local - np.where(second, chunk, 0)
        else:
            pos = local
        if start_positions is not None:
            pos = pos + start[seq]
        if pos.size and pos.max() >= n_rows:
            raise ValueError(f"cos: tables have {n_rows} rows but a token needs position {int(pos.max())}")

    if layout == "sbhd":
        pos = pos.T
    return np.ascontiguousarray(pos, dtype=np.int64)


def validate_rope(x, cos, sin, style="mla", layout="thd", cu_seqlens=None, positions=None,
                  start_positions=None, cp_size=1, cp_rank=0, out_dtype=None) -> None:
    """Raise ValueError/TypeError naming the first bad argument of `rope`."""
    _check_and_positions("x", x, cos, sin, style, layout, cu_seqlens, positions, start_positions,
                         cp_size, cp_rank, out_dtype)


def validate_rope_backward(grad, cos, sin, style="mla", layout="thd", cu_seqlens=None, positions=None,
                           start_positions=None, cp_size=1, cp_rank=0, out_dtype=None) -> None:
    """Raise ValueError/TypeError naming the first bad argument of `rope_backward`."""
    _check_and_positions("grad", grad, cos, sin, style, layout, cu_seqlens, positions, start_positions,
                         cp_size, cp_rank, out_dtype)


# --------------------------------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------------------------------
def _canonical_nan(a: np.ndarray) -> np.ndarray:
    """Write every NaN of `a` (in place) as its dtype's positive quiet NaN."""
    nan = np.isnan(a)
    if nan.any():
        a[nan] = a.dtype.type(np.nan)
    return a


def _apply(v, cos, sin, pos, first, second, sign, c_cols, s_cols, out_dtype):
    """v: [..., H, D] in any float dtype; pos: int64 shaped v.shape[:-2]. Rotate the last rope_dim
    features with `out[i] = RN(RN(v[first[i]] * c[c_cols[i]]) + sign[i] * RN(v[second[i]] * s[s_cols[i]]))`."""
    with np.errstate(all="ignore"):  # inf/NaN/overflow follow IEEE; no warnings
        return _apply_quiet(v, cos, sin, pos, first, second, sign, c_cols, s_cols, out_dtype)


def _apply_quiet(v, cos, sin, pos, first, second, sign, c_cols, s_cols, out_dtype):
    rope_dim = cos.shape[-1]
    head_dim = v.shape[-1]
    out_np = _numpy_dtype(out_dtype or str(v.dtype))
    # Gather the token rows first (the tables can be long), then widen exactly to fp32: [..., 1, R].
    c = np.asarray(cos)[pos].astype(np.float32)[..., None, c_cols]
    s = np.asarray(sin)[pos].astype(np.float32)[..., None, s_cols]
    vr = v[..., head_dim - rope_dim:].astype(np.float32)
    p = vr[..., first] * c  # NumPy float32 ops: one RN each, no FMA
    q = vr[..., second] * s
    rotated = p + q * sign  # sign is +-1: exact negation, so RN(p - q) or RN(p + q)

    out = np.empty(v.shape, dtype=out_np)
    out[..., head_dim - rope_dim:] = _canonical_nan(rotated.astype(out_np))
    kept = v[..., : head_dim - rope_dim]
    if kept.dtype == out.dtype:
        out[..., : head_dim - rope_dim] = kept  # same-dtype copy: bytes untouched
    else:
        out[..., : head_dim - rope_dim] = _canonical_nan(kept.astype(np.float32).astype(out_np))
    return out


def rope(x, cos, sin, style="mla", layout="thd", cu_seqlens=None, positions=None, start_positions=None,
         cp_size=1, cp_rank=0, out_dtype=None):
    """Apply RoPE to the last cos.shape[-1] features of every head of x (see the module docstring)."""
    pos = _check_and_positions("x", x, cos, sin, style, layout, cu_seqlens, positions, start_positions,
                               cp_size, cp_rank, out_dtype)
    first, second, sign = rotation_indices(style, cos.shape[-1])
    identity = np.arange(cos.shape[-1])
    return _apply(np.asarray(x), cos, sin, pos, first, second, sign, identity, identity, out_dtype)


def rope_backward(grad, cos, sin, style="mla", layout="thd", cu_seqlens=None, positions=None,
                  start_positions=None, cp_size=1, cp_rank=0, out_dtype=None):
    """Gradient of `rope` with respect to x: the exact transpose of the rotation, same rounding rule
    (see `transpose_indices`). Pass-through features pass the gradient through unchanged."""
    pos = _check_and_positions("grad", grad, cos, sin, style, layout, cu_seqlens, positions,
                               start_positions, cp_size, cp_rank, out_dtype)
    first, second, sign = transpose_indices(style, cos.shape[-1])
    return _apply(np.asarray(grad), cos, sin, pos, first, second, sign, first, second, out_dtype)
