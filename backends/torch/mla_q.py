"""Eager torch fused MLA Q up-projection + RoPE + MXFP8 quantize and its backward (CPU and CUDA).

Semantics in spec/mla_q.py; this is the same composition on torch tensors:
projection (backends.torch.gemm.matmul_rounded: float64 on CPU, row-scaled fp32 on CUDA) -> fp32 ->
bf16 staging -> backends.torch.rope (mla, positions = arange(T), fp32 out) -> backends.torch.quantize
along (-1, 0). RoPE and quantize are byte-equal to spec; the projection is byte-equal whenever the
float64 (CPU) / fp32 (CUDA) sums are exact -- always for the small-integer inputs of the byte tests --
and otherwise differs only where the exact sum sits within a few ulps of a rounding boundary (see
backends/torch/gemm.py), which can flip one bf16 value and so at most one element code or the scale
of its block.

Backward: rope_backward in fp32, then either bf16 g with 16-bit GEMMs or, with quantize_grad=True,
g quantized along N and T from fp32 (x and w quantized along T and N from bf16 unless given as
MXTensors on axis 0) and MXFP8 GEMMs. Arguments were validated by the dispatcher (spec validators).
"""
from __future__ import annotations

import torch

from spec.constants import MLA_QK_HEAD_DIM
from spec.mxtensor import MXTensor

from ..registry import register
from ._common import torch_tensor_reasons
from .gemm import compact_scales, dequantize_f64, matmul_rounded, mxfp8_gemm
from .quantize import mxfp8_quantize
from .rope import rope, rope_backward

_QUANT = dict(elem="e4m3", scale_mode="rceil", nonfinite="saturate", scale_layout="compact")


def _widen(t) -> torch.Tensor:
    """Exact float64 values of a bf16 tensor or an MXTensor."""
    return dequantize_f64(t) if isinstance(t, MXTensor) else t.to(torch.float64)


def _transposed(t: MXTensor) -> MXTensor:
    """The MXTensor of data.T (a 2-D tensor blocked on axis a becomes one blocked on axis 1 - a)."""
    return MXTensor(t.data.T, compact_scales(t).T, 1 - t.axis, t.elem, "compact")


def _positions(tokens: int, device) -> torch.Tensor:
    return torch.arange(tokens, dtype=torch.int64, device=device)


@register("mla_q_uproj_rope_quant", "torch", check=torch_tensor_reasons)
def mla_q_uproj_rope_quant(x, w, cos, sin):
    tokens, n = x.shape[0], w.shape[0]
    device = cos.device
    acc = matmul_rounded(_widen(x), _widen(w), "float32")  # RN_f32 of the sum
    q = acc.to(torch.bfloat16).view(tokens, n // MLA_QK_HEAD_DIM, MLA_QK_HEAD_DIM)  # bf16 staging
    q32 = rope(q, cos, sin, style="mla", layout="thd", positions=_positions(tokens, device), out_dtype="float32")
    return mxfp8_quantize(q32, axis=(-1, 0), **_QUANT)


@register("mla_q_uproj_rope_quant_backward", "torch", check=torch_tensor_reasons)
def mla_q_uproj_rope_quant_backward(dq, x, w, cos, sin, quantize_grad=False):
    tokens, n = x.shape[0], w.shape[0]
    g32 = rope_backward(dq, cos, sin, style="mla", layout="thd", positions=_positions(tokens, dq.device),
                        out_dtype="float32").reshape(tokens, n)
    if not quantize_grad:
        g = g32.to(torch.bfloat16).to(torch.float64)  # bf16 staging (one RN), then exact widening
        dx = matmul_rounded(g, _widen(w).T, "bfloat16")
        dw = matmul_rounded(g.T, _widen(x).T, "bfloat16")
        return dx, dw
    g_row, g_col = mxfp8_quantize(g32, axis=(1, 0), **_QUANT)
    x_t = x if isinstance(x, MXTensor) else mxfp8_quantize(x, axis=0, **_QUANT)
    w_n = w if isinstance(w, MXTensor) else mxfp8_quantize(w, axis=0, **_QUANT)
    dx = mxfp8_gemm(g_row, _transposed(w_n), "bfloat16")
    dw = mxfp8_gemm(_transposed(g_col), _transposed(x_t), "bfloat16")
    return dx, dw
