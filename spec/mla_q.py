"""Fused MLA query up-projection + RoPE + MXFP8 quantize, and its backward (SEMANTICS.md section 6).

Forward `mla_q_uproj_rope_quant(x, w, cos, sin) -> (q_row, q_col)`
- x [T, K], w [N, K] with N = H * 192 (head = 128 no-RoPE + 64 RoPE features): both bfloat16, or both
  MXTensors blocked along K (axis 1; compact or swizzled scales -- SEMANTICS fixes compact weight
  scales for the kernels, the spec reads either). T a multiple of 32.
- cos, sin [T, 64]: the table rows already gathered per token row (row t is token t's), float32 or
  bfloat16, equal dtype.
1. acc[t, n] = RN_f32(exact sum_k x[t,k] * w[n,k]) (dequantized values for MXFP8; spec.gemm's exact
   rounding).
2. q = RN_bf16(acc), viewed [T, H, 192].
3. spec.rope.rope(q, cos, sin, style="mla", layout="thd", positions=arange(T), out_dtype="float32"):
   features 128..191 of every head rotated in fp32 by the rule of SEMANTICS 4, features 0..127 the bf16
   values widened; nothing re-rounded to bf16.
4. spec.quantize.mxfp8_quantize of those fp32 values along axis (-1, 0), e4m3, rceil, saturate,
   compact: q_row blocked along the head dim (axis 2, scales [T, H, 6]) and q_col blocked along T
   (axis 0, scales [T/32, H, 192]).

Backward `mla_q_uproj_rope_quant_backward(dq, x, w, cos, sin, quantize_grad=False) -> (dx, dw)`
- dq [T, H, 192] bfloat16, the gradient of the forward's (pre-quantization) q.
1. g32 = spec.rope.rope_backward(dq, cos, sin, style="mla", layout="thd", positions=arange(T),
   out_dtype="float32") viewed [T, N]: the exact transpose of step 3, each value one fp32 rounding;
   no-RoPE features are dq widened.
2. quantize_grad=False (16-bit backward): g = RN_bf16(g32) -- what an unfused bf16 RoPE backward
   hands to a bf16 GEMM. x and w: both bfloat16 [T, K] / [N, K], or both the forward's MXTensors
   blocked along K (their dequantized values are used exactly).
   dx = RN_bf16(exact g @ w) [T, K];  dw = RN_bf16(exact g^T @ x) [N, K].
3. quantize_grad=True (MXFP8 backward). Every operand is blocked along the GEMM's contraction axis:
   - g_row = mxfp8_quantize(g32, axis=1)  (blocked along N)  -- for dx = g @ w  (sum over N)
   - g_col = mxfp8_quantize(g32, axis=0)  (blocked along T)  -- for dw = g^T @ x (sum over T)
     Both quantized from the fp32 g32, not from RN_bf16(g32): like the forward, a fused RoPE-backward
     kernel quantizes from its fp32 registers, and no bf16 tensor exists in between.
   - w blocked along N: w given as bfloat16 is quantized here with mxfp8_quantize(w, axis=0); or w is
     passed as an MXTensor already blocked along N (axis 0), e.g. the columnwise copy a forward saved.
   - x blocked along T: likewise mxfp8_quantize(x, axis=0) from bfloat16, or an MXTensor on axis 0.
   (e4m3, rceil, saturate, compact everywhere.) x and w are both bfloat16 or both MXTensors.
   dx = mxfp8_gemm(g_row, w_n^T, "bfloat16");  dw = mxfp8_gemm(g_col^T, x_t^T, "bfloat16"), where ^T
   swaps the two axes of data and compact scales (the blocked axis becomes axis 1, K of the GEMM).

Choices SEMANTICS.md leaves open: the bf16 staging of g in the 16-bit backward and the fp32 source of
the quantized g in the MXFP8 backward (above); swizzled x/w scales accepted; positions are arange(T)
(cos/sin are per token row, so no sequence structure enters); NaN handling is that of the ops composed
(spec.gemm, spec.rope, spec.quantize).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .lazy_ml_dtypes import ml_dtypes
from . import checks
from .constants import BLOCK_SIZE, MLA_QK_HEAD_DIM, MLA_ROPE_DIM
from .gemm import MX_SIG_BITS, dequantize_f64, exact_matmul_rounded, mxfp8_gemm, require_mxtensor_operand
from .mxtensor import MXTensor
from .quantize import mxfp8_quantize
from .rope import rope, rope_backward

__all__ = [
    "mla_q_uproj_rope_quant",
    "mla_q_uproj_rope_quant_backward",
    "validate_mla_q_uproj_rope_quant",
    "validate_mla_q_uproj_rope_quant_backward",
]

TABLE_DTYPES = ("float32", "bfloat16")
_HEAD_LABEL = (
    f"dim 0 (N = H * {MLA_QK_HEAD_DIM}; head dim {MLA_QK_HEAD_DIM} = "
    f"{MLA_QK_HEAD_DIM - MLA_ROPE_DIM} no-RoPE + {MLA_ROPE_DIM} RoPE features)"
)


# ----------------------------------------------------------------------------------------------
# validators


def _check_operands(x: Any, w: Any, mx_axes=(1, 1), mx_labels=("K", "K")) -> None:
    """x [T, K] and w [N, K]: both bfloat16 arrays or both MXTensors blocked on the given axes."""
    if isinstance(x, MXTensor) or isinstance(w, MXTensor):
        for name, t, axis, label in (("x", x, mx_axes[0], mx_labels[0]), ("w", w, mx_axes[1], mx_labels[1])):
            if not isinstance(t, MXTensor):
                other = "w" if name == "x" else "x"
                raise TypeError(
                    f"{name}: expected an MXTensor like {other} (both MXFP8 or both bfloat16), "
                    f"got {type(t).__name__}"
                )
            require_mxtensor_operand(name, t, axis, label)
    else:
        for name, t in (("x", x), ("w", w)):
            checks.require_dtype(name, t, ("bfloat16",))
            checks.require_ndim(name, t, (2,))
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"w: expected K = {x.shape[1]} (x's dim 1) at dim 1, got shape {tuple(w.shape)}")
    checks.require_multiple("w", w.shape[0], MLA_QK_HEAD_DIM, _HEAD_LABEL)
    checks.require_multiple("x", x.shape[0], BLOCK_SIZE, "dim 0 (T, blocked columnwise)")


def _check_tables(cos: Any, sin: Any, tokens: int) -> None:
    for name, t in (("cos", cos), ("sin", sin)):
        checks.require_dtype(name, t, TABLE_DTYPES)
        if tuple(t.shape) != (tokens, MLA_ROPE_DIM):
            raise ValueError(
                f"{name}: expected shape ({tokens}, {MLA_ROPE_DIM}) (one row per token of x, "
                f"{MLA_ROPE_DIM} RoPE features), got {tuple(t.shape)}"
            )
    if checks.dtype_name(cos) != checks.dtype_name(sin):
        raise TypeError(f"sin: expected the dtype of cos ({checks.dtype_name(cos)}), got {checks.dtype_name(sin)}")


def validate_mla_q_uproj_rope_quant(x, w, cos, sin):
    """Raise TypeError/ValueError naming the first bad argument of `mla_q_uproj_rope_quant`."""
    _check_operands(x, w)
    _check_tables(cos, sin, x.shape[0])


def validate_mla_q_uproj_rope_quant_backward(dq, x, w, cos, sin, quantize_grad=False):
    """Raise TypeError/ValueError naming the first bad argument of `mla_q_uproj_rope_quant_backward`."""
    checks.require_bool("quantize_grad", quantize_grad)
    if quantize_grad:
        _check_operands(x, w, mx_axes=(0, 0), mx_labels=("T", "N"))
    else:
        _check_operands(x, w)
    checks.require_dtype("dq", dq, ("bfloat16",))
    checks.require_ndim("dq", dq, (3,))
    want = (x.shape[0], w.shape[0] // MLA_QK_HEAD_DIM, MLA_QK_HEAD_DIM)
    if tuple(dq.shape) != want:
        raise ValueError(f"dq: expected shape {want} ([T, H, {MLA_QK_HEAD_DIM}] from x and w), got {tuple(dq.shape)}")
    _check_tables(cos, sin, x.shape[0])


# ----------------------------------------------------------------------------------------------
# the ops


def _widen(t: Any):
    """(exact float64 values, significant-bit bound) of a bfloat16 array or an MXTensor."""
    if isinstance(t, MXTensor):
        return dequantize_f64(t), MX_SIG_BITS
    return np.asarray(t).astype(np.float64), 8


def _transposed(t: MXTensor) -> MXTensor:
    """The MXTensor of data.T: a 2-D tensor blocked on axis a becomes one blocked on axis 1 - a."""
    if t.scale_layout == "swizzled":
        from .swizzle import unswizzle_scales

        t = unswizzle_scales(t)
    return MXTensor(np.asarray(t.data).T, np.asarray(t.scale).T, 1 - t.axis, t.elem, "compact")


def _positions(tokens: int) -> np.ndarray:
    return np.arange(tokens, dtype=np.int64)


def mla_q_uproj_rope_quant(x, w, cos, sin):
    """q = x @ w^T staged to bf16, mla RoPE on each head's last 64 features in fp32, quantized to MXFP8
    rowwise (head dim) and columnwise (T). Returns (q_row, q_col); details in the module docstring."""
    validate_mla_q_uproj_rope_quant(x, w, cos, sin)
    tokens, heads = x.shape[0], w.shape[0] // MLA_QK_HEAD_DIM
    (xv, x_bits), (wv, w_bits) = _widen(x), _widen(w)
    acc = exact_matmul_rounded(xv, wv, "float32", x_bits, w_bits)
    q = acc.astype(ml_dtypes.bfloat16).reshape(tokens, heads, MLA_QK_HEAD_DIM)  # one RN, fp32 -> bf16
    q32 = rope(q, cos, sin, style="mla", layout="thd", positions=_positions(tokens), out_dtype="float32")
    q_row, q_col = mxfp8_quantize(q32, axis=(-1, 0), elem="e4m3", scale_mode="rceil", nonfinite="saturate",
                                  scale_layout="compact")
    return q_row, q_col


def mla_q_uproj_rope_quant_backward(dq, x, w, cos, sin, quantize_grad=False):
    """(dx [T, K], dw [N, K]) in bfloat16 from dq [T, H, 192]; 16-bit or MXFP8 (quantize_grad=True)
    GEMMs as the module docstring defines."""
    validate_mla_q_uproj_rope_quant_backward(dq, x, w, cos, sin, quantize_grad)
    tokens, n = x.shape[0], w.shape[0]
    g32 = rope_backward(dq, cos, sin, style="mla", layout="thd", positions=_positions(tokens),
                        out_dtype="float32").reshape(tokens, n)
    if not quantize_grad:
        g = g32.astype(ml_dtypes.bfloat16).astype(np.float64)  # bf16 staging, one RN
        (xv, x_bits), (wv, w_bits) = _widen(x), _widen(w)
        dx = exact_matmul_rounded(g, wv.T, "bfloat16", 8, w_bits)
        dw = exact_matmul_rounded(g.T, xv.T, "bfloat16", 8, x_bits)
        return dx, dw
    quant = dict(elem="e4m3", scale_mode="rceil", nonfinite="saturate", scale_layout="compact")
    g_row, g_col = mxfp8_quantize(g32, axis=(1, 0), **quant)
    x_t = x if isinstance(x, MXTensor) else mxfp8_quantize(x, axis=0, **quant)
    w_n = w if isinstance(w, MXTensor) else mxfp8_quantize(w, axis=0, **quant)
    dx = mxfp8_gemm(g_row, _transposed(w_n), "bfloat16")
    dw = mxfp8_gemm(_transposed(g_col), _transposed(x_t), "bfloat16")
    return dx, dw
