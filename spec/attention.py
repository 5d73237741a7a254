"""MLA attention (SEMANTICS.md section 8): the float64 reference of the DeepSeek-V3 attention core.

Choices this module makes where SEMANTICS.md is silent (each is tested in tests/test_attention.py):

- Inputs: q, k, v are each either a plain array (float32, bfloat16 or float16, widened exactly) or an
  `MXTensor` (dequantized exactly with `mxfp8_dequantize`; scale byte 255 gives a NaN block). Plain and
  MXFP8 operands may be mixed; all plain operands must share one dtype (a mix is most likely a caller
  bug). q and k must be blocked along D (the last axis), v along the sequence axis (S for bshd/sbhd,
  T for thd). An MXFP8 v in thd layout has blocks that may straddle sequence boundaries: it is
  dequantized whole, then split, so this is harmless.
- Shapes: q, k `[.., H, 192]`, v `[.., H, 128]`; the same H everywhere (no GQA/MQA); k and v share
  their sequence length; q and k/v share the batch.
- `lse` is `[B, H, S_q]` for bshd and sbhd, and `[H, T_q]` for thd (packed like the tokens, as
  flash-attention's varlen kernels return it).
- thd needs both `cu_seqlens_q` and `cu_seqlens_kv` (int32 `[B+1]`, starting at 0, non-decreasing,
  ending at T); bshd/sbhd reject them. A sequence with no keys gives fully masked query rows (o = 0,
  lse = -inf), causal or not.
- `softmax_scale` is applied to the float64 product q k^T, after the product.
- Fully masked rows: o = 0 and lse = -inf, whatever v holds. Otherwise non-finite inputs propagate by
  IEEE rules through dense float64 products: a masked score is -inf (so k at a masked key never
  matters in the forward), but v (forward) and k, v (backward) meet P = 0 at masked keys, and a
  non-finite value there gives 0 * inf = NaN, as a kernel multiplying a partly masked tile would.
  Kernels that skip whole masked tiles differ there, so conformance keeps non-finite values away
  from masked keys.
- o and the gradients are rounded once from float64 to bf16 (RN-even; `_round_f64_to_bf16`, since
  ml_dtypes' own float64 -> bfloat16 cast rounds twice through float32). lse is rounded once to fp32.
- Backward: P is recomputed as exp(S - lse) with the lse *given* (fp32, widened), and
  D = rowsum(o * do) with o and do as given (widened). Rows whose lse is -inf get P = 0 (otherwise
  -inf - -inf = NaN). Gradients are w.r.t. the dequantized values for MXFP8 operands, in the layout
  and shape of q, k, v; always bf16, whatever the input dtype.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import numpy as np

from .lazy_ml_dtypes import ml_dtypes
from .checks import dtype_name, require_bool, require_choice, require_dtype, require_real, value_checks_enabled
from .constants import (
    ELEM_FORMATS,
    FLOAT_DTYPES,
    LAYOUTS,
    MLA_QK_HEAD_DIM,
    MLA_V_HEAD_DIM,
)
from .mxtensor import MXTensor
from .quantize import mxfp8_dequantize

DEFAULT_SOFTMAX_SCALE = 1.0 / math.sqrt(MLA_QK_HEAD_DIM)

# Where the sequence axis sits in each layout (the axis an MXFP8 v must be blocked along).
SEQ_AXIS = {"bshd": 1, "sbhd": 0, "thd": 0}


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------

def _check_operand(name: str, x: Any, layout: str, head_dim: int, blocked_on: str) -> None:
    """One of q, k, v, o, do: plain float array or (when blocked_on is set) an MXTensor."""
    ndim = 3 if layout == "thd" else 4
    if isinstance(x, MXTensor):
        if blocked_on is None:
            raise TypeError(f"{name}: expected a plain array (float32, bfloat16, float16), got an MXTensor")
        fmt = ELEM_FORMATS[x.elem]
        if dtype_name(x.data) != fmt.numpy_dtype_name:
            raise TypeError(
                f"{name}: MXTensor data dtype {dtype_name(x.data)} does not match elem {x.elem!r} "
                f"(expected {fmt.numpy_dtype_name})"
            )
        if dtype_name(x.scale) != "uint8":
            raise TypeError(f"{name}: MXTensor scale must be uint8 E8M0 bytes, got {dtype_name(x.scale)}")
        shape = x.shape
    else:
        require_dtype(name, x, FLOAT_DTYPES)
        shape = tuple(x.shape)
    if len(shape) != ndim:
        dims = "[T, H, D]" if layout == "thd" else ("[B, S, H, D]" if layout == "bshd" else "[S, B, H, D]")
        raise ValueError(f"{name}: layout {layout!r} expects {ndim} dimensions {dims}, got shape {shape}")
    if shape[-1] != head_dim:
        raise ValueError(f"{name}: expected head dim {head_dim} (last axis), got shape {shape}")
    if isinstance(x, MXTensor):
        want = ndim - 1 if blocked_on == "D" else SEQ_AXIS[layout]
        what = "D (the last axis)" if blocked_on == "D" else f"the sequence axis ({layout} axis {want})"
        if x.axis != want:
            raise ValueError(f"{name}: MXTensor must be blocked along {what}, got axis {x.axis}")


def _seq_batch(shape: tuple, layout: str) -> Tuple[int, int]:
    """(batch, sequence length) of a bshd/sbhd shape."""
    return (shape[0], shape[1]) if layout == "bshd" else (shape[1], shape[0])


def _check_cu_seqlens(name: str, cu: Any, total: int) -> list:
    if cu is None:
        raise ValueError(f"{name}: required for layout 'thd'")
    require_dtype(name, cu, ("int32",))
    if len(cu.shape) != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name}: expected shape [B+1] with B >= 1, got {tuple(cu.shape)}")
    if not value_checks_enabled():
        return None
    vals = [int(v) for v in cu.tolist()]
    if vals[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {vals[0]}")
    if any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"{name}: must be non-decreasing, got {vals}")
    if vals[-1] != total:
        raise ValueError(f"{name}: must end at the token count {total}, got {vals[-1]}")
    return vals


def _check_common(q, k, v, causal, softmax_scale, layout, cu_seqlens_q, cu_seqlens_kv) -> None:
    require_choice("layout", layout, LAYOUTS)
    require_bool("causal", causal)
    if softmax_scale is not None:
        require_real("softmax_scale", softmax_scale)
        if not (math.isfinite(float(softmax_scale)) and float(softmax_scale) > 0):
            raise ValueError(f"softmax_scale: expected a finite positive float, got {softmax_scale!r}")
    _check_operand("q", q, layout, MLA_QK_HEAD_DIM, "D")
    _check_operand("k", k, layout, MLA_QK_HEAD_DIM, "D")
    _check_operand("v", v, layout, MLA_V_HEAD_DIM, "S")
    plain = {n: dtype_name(x) for n, x in (("q", q), ("k", k), ("v", v)) if not isinstance(x, MXTensor)}
    if len(set(plain.values())) > 1:
        raise TypeError(f"q, k, v: plain operands must share one dtype, got {plain}")
    qs, ks, vs = tuple(q.shape), tuple(k.shape), tuple(v.shape)
    if not (qs[-2] == ks[-2] == vs[-2]):
        raise ValueError(f"q, k, v: expected the same head count H (no GQA/MQA), got shapes {qs}, {ks}, {vs}")
    if ks[:-1] != vs[:-1]:
        raise ValueError(f"k and v: expected equal shapes up to the head dim, got {ks} and {vs}")
    if layout == "thd":
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, qs[0])
        _check_cu_seqlens("cu_seqlens_kv", cu_seqlens_kv, ks[0])
        if cu_seqlens_kv.shape[0] != cu_seqlens_q.shape[0]:
            raise ValueError(
                f"cu_seqlens_kv: expected the same batch as cu_seqlens_q ({cu_seqlens_q.shape[0]} entries), "
                f"got {cu_seqlens_kv.shape[0]}"
            )
    else:
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
            if cu is not None:
                raise ValueError(f"{name}: only for layout 'thd', got layout {layout!r}")
        if _seq_batch(qs, layout)[0] != _seq_batch(ks, layout)[0]:
            raise ValueError(f"q and k: expected the same batch size, got shapes {qs} and {ks}")


def _lse_shape(q_shape: tuple, layout: str) -> tuple:
    if layout == "thd":
        return (q_shape[1], q_shape[0])
    b, s = _seq_batch(q_shape, layout)
    return (b, q_shape[-2], s)


def validate_mla_attention(q, k, v, causal=False, softmax_scale=None, layout="bshd",
                           cu_seqlens_q=None, cu_seqlens_kv=None) -> None:
    """Raise ValueError/TypeError (message starts with the argument's name) for a bad call."""
    _check_common(q, k, v, causal, softmax_scale, layout, cu_seqlens_q, cu_seqlens_kv)


def validate_mla_attention_backward(do, q, k, v, o, lse, causal=False, softmax_scale=None, layout="bshd",
                                    cu_seqlens_q=None, cu_seqlens_kv=None) -> None:
    """As validate_mla_attention, plus: o and do plain float arrays shaped like q with head dim 128,
    lse float32 shaped [B, H, S_q] (thd: [H, T_q])."""
    _check_common(q, k, v, causal, softmax_scale, layout, cu_seqlens_q, cu_seqlens_kv)
    _check_operand("o", o, layout, MLA_V_HEAD_DIM, None)
    _check_operand("do", do, layout, MLA_V_HEAD_DIM, None)
    want = tuple(q.shape[:-1]) + (MLA_V_HEAD_DIM,)
    for name, x in (("o", o), ("do", do)):
        if tuple(x.shape) != want:
            raise ValueError(f"{name}: expected shape {want} (q's with head dim {MLA_V_HEAD_DIM}), got {tuple(x.shape)}")
    require_dtype("lse", lse, ("float32",))
    want = _lse_shape(tuple(q.shape), layout)
    if tuple(lse.shape) != want:
        raise ValueError(f"lse: expected shape {want} for layout {layout!r}, got {tuple(lse.shape)}")


# --------------------------------------------------------------------------------------------------
# Exact conversions
# --------------------------------------------------------------------------------------------------

def _widen(x: Any) -> np.ndarray:
    """Exact float64 values of a plain array or of a dequantized MXTensor."""
    if isinstance(x, MXTensor):
        # fp32 holds every dequantized value (decode * 2^(e-127), one fp32 RN per SEMANTICS 2).
        return np.asarray(mxfp8_dequantize(x, out_dtype="float32"), dtype=np.float64)
    return np.asarray(x).astype(np.float64)


def _round_f64_to_bf16(x: np.ndarray) -> np.ndarray:
    """One RN-even rounding float64 -> bfloat16.

    ml_dtypes casts float64 via float32, which rounds twice (1 + 2^-8 + 2^-30 lands on the tie
    1 + 2^-8 and then goes to 1.0 instead of 1 + 2^-7). Rounding to float32 *to odd* first keeps a
    sticky bit below bf16's precision, so the second rounding is correct (29 spare bits >= 2).
    """
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):  # beyond fp32 range: inf, then stepped back to fp32 max below
        f = x.astype(np.float32)
    inexact = np.isfinite(x) & (f.astype(np.float64) != x)
    # Truncate toward zero: when RN went away from zero (|f| > |x|), step back one ulp toward zero.
    away = inexact & (np.abs(f.astype(np.float64)) > np.abs(x))
    f = np.where(away, np.nextafter(f, np.float32(0)), f)
    bits = f.view(np.uint32) | inexact.astype(np.uint32)  # round-to-odd: set the sticky bit
    return bits.view(np.float32).astype(ml_dtypes.bfloat16)


# --------------------------------------------------------------------------------------------------
# Float64 core on [N, H, S, D] arrays
# --------------------------------------------------------------------------------------------------

def _causal_mask(s_q: int, s_kv: int) -> np.ndarray:
    """[S_q, S_kv] bool, True where key j is masked for query i: j > i + (S_kv - S_q)."""
    i = np.arange(s_q)[:, None]
    j = np.arange(s_kv)[None, :]
    return j > i + (s_kv - s_q)


def _scores(q: np.ndarray, k: np.ndarray, causal: bool, scale: float) -> np.ndarray:
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    if causal:
        s = np.where(_causal_mask(q.shape[-2], k.shape[-2]), -np.inf, s)
    return s


def _forward_bhsd(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, scale: float):
    """float64 q [N,H,Sq,192], k [N,H,Skv,192], v [N,H,Skv,128] -> (o float64 [N,H,Sq,128],
    lse float64 [N,H,Sq]). No rounding: tests use this for finite differences."""
    s = _scores(q, k, causal, scale)
    row_max = np.max(s, axis=-1, initial=-np.inf)  # initial: an empty key set gives -inf
    masked_row = row_max == -np.inf
    # Shift by the row max so exp never overflows; a fully masked row shifts by 0 (its exps are 0).
    shift = np.where(masked_row, 0.0, row_max)
    e = np.exp(s - shift[..., None])
    row_sum = e.sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        o = np.matmul(e, v) / row_sum[..., None]
        lse = shift + np.log(row_sum)  # log(0) = -inf for fully masked rows
    o = np.where(masked_row[..., None], 0.0, o)
    lse = np.where(masked_row, -np.inf, lse)
    return o, lse


def _backward_bhsd(do, q, k, v, o, lse, causal: bool, scale: float):
    """float64 gradients (dq, dk, dv) on [N,H,S,D] arrays from the given o and lse (no rounding)."""
    s = _scores(q, k, causal, scale)
    masked_row = lse == -np.inf
    with np.errstate(invalid="ignore"):
        p = np.exp(s - np.where(masked_row, 0.0, lse)[..., None])
    p = np.where(masked_row[..., None], 0.0, p)
    d = np.sum(o * do, axis=-1)  # rowsum(o * do) = sum_j P_ij dP_ij for the exact o
    dp = np.matmul(do, np.swapaxes(v, -1, -2))
    ds = p * (dp - d[..., None])
    dq = np.matmul(ds, k) * scale
    dk = np.matmul(np.swapaxes(ds, -1, -2), q) * scale
    dv = np.matmul(np.swapaxes(p, -1, -2), do)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------
# Layout plumbing
# --------------------------------------------------------------------------------------------------

def _to_bhsd(x: np.ndarray, layout: str) -> np.ndarray:
    """bshd/sbhd -> contiguous [B, H, S, D]."""
    perm = (0, 2, 1, 3) if layout == "bshd" else (1, 2, 0, 3)
    return np.ascontiguousarray(np.transpose(x, perm))


def _from_bhsd(x: np.ndarray, layout: str) -> np.ndarray:
    perm = (0, 2, 1, 3) if layout == "bshd" else (2, 0, 1, 3)
    return np.transpose(x, perm)


def _thd_seq(x: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of a [T, H, D] array as a contiguous [1, H, S, D]."""
    return np.ascontiguousarray(np.transpose(x[start:stop], (1, 0, 2)))[None]


def _scale(softmax_scale: Optional[float]) -> float:
    return DEFAULT_SOFTMAX_SCALE if softmax_scale is None else float(softmax_scale)


# --------------------------------------------------------------------------------------------------
# Ops
# --------------------------------------------------------------------------------------------------

def mla_attention(q, k, v, causal=False, softmax_scale=None, layout="bshd", cu_seqlens_q=None,
                  cu_seqlens_kv=None):
    """MLA attention forward in float64: returns (o bf16 shaped like q with head dim 128, lse fp32).

    q, k `[.., H, 192]` and v `[.., H, 128]` in `layout` ("bshd" [B,S,H,D], "sbhd" [S,B,H,D],
    "thd" [T,H,D] with int32 cu_seqlens_q / cu_seqlens_kv [B+1]). Each operand is a float32/bf16/fp16
    array or an MXTensor (q, k blocked along D; v along the sequence axis). softmax_scale defaults to
    1/sqrt(192). causal masks key j for query i when j > i + (S_kv - S_q) (bottom-right aligned).
    lse = log(sum_j exp(S_ij)) in natural log, fp32, shaped [B, H, S_q] (thd: [H, T_q]). Fully masked
    rows give o = 0 and lse = -inf. See the module docstring for the remaining choices.
    """
    validate_mla_attention(q, k, v, causal, softmax_scale, layout, cu_seqlens_q, cu_seqlens_kv)
    scale = _scale(softmax_scale)
    q64, k64, v64 = _widen(q), _widen(k), _widen(v)
    if layout == "thd":
        cq = [int(c) for c in cu_seqlens_q.tolist()]
        ckv = [int(c) for c in cu_seqlens_kv.tolist()]
        o = np.zeros(q64.shape[:-1] + (MLA_V_HEAD_DIM,), dtype=np.float64)
        lse = np.full((q64.shape[1], q64.shape[0]), -np.inf, dtype=np.float64)
        for b in range(len(cq) - 1):
            if cq[b + 1] == cq[b]:
                continue
            o_b, lse_b = _forward_bhsd(
                _thd_seq(q64, cq[b], cq[b + 1]), _thd_seq(k64, ckv[b], ckv[b + 1]),
                _thd_seq(v64, ckv[b], ckv[b + 1]), causal, scale,
            )
            o[cq[b]:cq[b + 1]] = np.transpose(o_b[0], (1, 0, 2))
            lse[:, cq[b]:cq[b + 1]] = lse_b[0]
    else:
        o, lse = _forward_bhsd(_to_bhsd(q64, layout), _to_bhsd(k64, layout), _to_bhsd(v64, layout), causal, scale)
        o = _from_bhsd(o, layout)
    return np.ascontiguousarray(_round_f64_to_bf16(o)), np.ascontiguousarray(lse.astype(np.float32))


def mla_attention_backward(do, q, k, v, o, lse, causal=False, softmax_scale=None, layout="bshd",
                           cu_seqlens_q=None, cu_seqlens_kv=None):
    """MLA attention backward in float64: returns (dq, dk, dv), bf16, shaped like q, k, v.

    P = exp(q k^T * scale - lse) (masked keys 0; rows with lse = -inf all 0), D = rowsum(o * do),
    dP = do v^T, dS = P * (dP - D), dq = dS k * scale, dk = dS^T q * scale, dv = P^T do. o, do and
    lse are used as given (widened exactly); for MXFP8 operands the gradients are w.r.t. the
    dequantized values.
    """
    validate_mla_attention_backward(do, q, k, v, o, lse, causal, softmax_scale, layout, cu_seqlens_q, cu_seqlens_kv)
    scale = _scale(softmax_scale)
    q64, k64, v64 = _widen(q), _widen(k), _widen(v)
    o64, do64, lse64 = _widen(o), _widen(do), _widen(lse)
    if layout == "thd":
        cq = [int(c) for c in cu_seqlens_q.tolist()]
        ckv = [int(c) for c in cu_seqlens_kv.tolist()]
        dq, dk, dv = np.zeros_like(q64), np.zeros_like(k64), np.zeros_like(v64)
        for b in range(len(cq) - 1):
            if cq[b + 1] == cq[b] or ckv[b + 1] == ckv[b]:
                continue  # no query or no key: every gradient of this sequence is 0
            qsl, ksl = slice(cq[b], cq[b + 1]), slice(ckv[b], ckv[b + 1])
            g = _backward_bhsd(
                _thd_seq(do64, qsl.start, qsl.stop), _thd_seq(q64, qsl.start, qsl.stop),
                _thd_seq(k64, ksl.start, ksl.stop), _thd_seq(v64, ksl.start, ksl.stop),
                _thd_seq(o64, qsl.start, qsl.stop), lse64[None, :, qsl], causal, scale,
            )
            for out, grad, sl in ((dq, g[0], qsl), (dk, g[1], ksl), (dv, g[2], ksl)):
                out[sl] = np.transpose(grad[0], (1, 0, 2))
    else:
        dq, dk, dv = _backward_bhsd(
            _to_bhsd(do64, layout), _to_bhsd(q64, layout), _to_bhsd(k64, layout), _to_bhsd(v64, layout),
            _to_bhsd(o64, layout), lse64, causal, scale,
        )
        dq, dk, dv = (_from_bhsd(g, layout) for g in (dq, dk, dv))
    return tuple(np.ascontiguousarray(_round_f64_to_bf16(g)) for g in (dq, dk, dv))
