"""The MXFP8 query path with RMSNorm as one autograd node.

    from dispatch.q_path import rmsnorm_mla_q
    q_row = rmsnorm_mla_q(c_q, gamma, w_uq, cos, sin, eps=1e-6)     # TrackedMXTensor [T, H, 192]

is, byte for byte and gradient for gradient, the composition

    y_row, y_col, _ = mxag.rmsnorm_mxfp8(c_q, gamma, eps=1e-6)
    w_row, w_col = quantized_weight(w_uq)                           # dispatch.weights: cached copies
    q_row, _ = mxag.mla_q_uproj_rope_quant(y_row, w_row, cos, sin, quantize_grad=True, x_t=y_col, w_n=w_col)

for plain eager calls (every tensor a plain torch.Tensor or nn.Parameter, not compiling; see
`dispatch.autograd.plain_eager`). `dispatch.nn.mla_q_projection` takes this path on its mxfp8 path with
a norm weight and the MXFP8 backward, and the composition everywhere else.

Why one node: on a GPU the MXFP8 block's forward is bound by host time, not by the kernels. Each
wrapper of the composition pays for its own argument validation, operand-slot conversion (MXTensors
taken apart into codes and scales and rebuilt), a torch.autograd.Function apply, gradient proxies,
TrackedMXTensor construction and contiguous / uint8-view round trips of every output; the weight's
copies add a proxy node of their own. Here the two ops run as two `dispatch.run` calls on the
MXTensors they return, the weight's copies come from `dispatch.weights.plain_copies` (the same cache,
so copies made after an optimizer step are reused), and one node's backward computes what the
composition's chain of three backwards computes, in the same order and dtypes:
- `mla_q_uproj_rope_quant_backward` (quantize_grad=True) on dq with y blocked along T and w along N;
- dy = dx cast to float32 (the dtype of RMSNorm's gradient proxy), then `rmsnorm_backward` with the
  forward's rstd: the gradients of x and gamma;
- dw cast to bfloat16 (the dtype of the weight's proxy), then `dispatch.weights.weight_grad` (scatter
  back through `rows`, cast to w's dtype).
Only q_row is returned (the composition's q_col is not read by attention). RMSNorm's arguments are
validated before anything runs, as the composition's wrapper does; the fused op's arguments are
validated by `dispatch.run` (per call signature, before any backend runs) with the same validators.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import dispatch as _dispatch
from dispatch.autograd import TrackedMXTensor, rmsnorm_backward, shared_grad_proxy
from dispatch.weights import plain_copies, weight_grad
from spec.mxtensor import MXTensor

__all__ = ["rmsnorm_mla_q"]

_E4M3 = torch.float8_e4m3fn


def _contiguous_mx(t: MXTensor) -> MXTensor:
    # the composition hands each op contiguous codes and scales (its custom ops' outputs are)
    if t.data.is_contiguous() and t.scale.is_contiguous():
        return t
    return MXTensor(t.data.contiguous(), t.scale.contiguous(), t.axis, t.elem, t.scale_layout)


class _RMSNormMLAQ(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, gamma, w, rows, cos, sin, eps, backend):
        y_row, y_col, rstd = _dispatch.run("rmsnorm_mxfp8", x.contiguous(), gamma.contiguous(), eps=eps,
                                           zero_centered_gamma=False, elem="e4m3", backend=backend)
        y_row, y_col = _contiguous_mx(y_row), _contiguous_mx(y_col)
        copies = plain_copies(w, backend=backend, rows=rows)
        q_row, _ = _dispatch.run("mla_q_uproj_rope_quant", y_row, copies.row, cos, sin, backend=backend)
        codes, scales = q_row.data.view(torch.uint8).contiguous(), q_row.scale.contiguous()
        ctx.mark_non_differentiable(codes, scales)
        ctx.set_materialize_grads(False)
        # through save_for_backward (not ctx attributes), so saved-tensor hooks (offloading,
        # checkpointing) see what the composition's nodes save
        ctx.save_for_backward(x, gamma, rstd.contiguous(), y_col.data, y_col.scale, copies.col.data, copies.col.scale,
                              cos, sin, rows)
        ctx.w_dtype, ctx.backend = w.dtype, backend
        return shared_grad_proxy(codes.shape, torch.bfloat16, cos.device), codes, scales

    @staticmethod
    def backward(ctx, dq, _codes_grad, _scales_grad):
        if dq is None:
            return (None,) * 8
        x, gamma, rstd, y_codes, y_scales, w_codes, w_scales, cos, sin, rows = ctx.saved_tensors
        y_col = MXTensor(y_codes, y_scales, 0, "e4m3", "compact")
        w_col = MXTensor(w_codes, w_scales, 0, "e4m3", "compact")
        dy, dw = _dispatch.run("mla_q_uproj_rope_quant_backward", dq.contiguous(), y_col, w_col, cos, sin,
                               quantize_grad=True, backend=ctx.backend)
        dx = dgamma = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            dx, dgamma = rmsnorm_backward(dy.contiguous().to(torch.float32), x, gamma, rstd)
        if ctx.needs_input_grad[2]:
            dw = weight_grad(dw.contiguous().to(torch.bfloat16), ctx.w_dtype, rows)
        else:
            dw = None
        return dx, dgamma, dw, None, None, None, None, None


def rmsnorm_mla_q(x: Tensor, gamma: Tensor, w: Tensor, cos: Tensor, sin: Tensor, *, eps: float = 1e-6,
                  rows: Optional[Tensor] = None, backend: Optional[str] = None) -> TrackedMXTensor:
    """q_row [T, H, 192] (e4m3, compact scales, blocked along the head dim; bf16 gradient proxy) of
    RMSNorm(x [T, K]; gamma [K], eps) up-projected by w [H * 192, K] (MXFP8 copies of w.to(bfloat16),
    or of w[rows]) with the fused RoPE (cos / sin [T, 64] per-token rows) and quantize: the
    composition's bytes and gradients (module docstring). Plain eager tensors only (the caller picks
    the composition for the others); `backend` as for every mxmla op."""
    _dispatch.validate("rmsnorm_mxfp8", x, gamma, eps=eps, zero_centered_gamma=False, elem="e4m3", backend=backend)
    proxy, codes, scales = _RMSNormMLAQ.apply(x, gamma, w, rows, cos, sin, float(eps), backend)
    return TrackedMXTensor(codes.view(_E4M3), scales, 2, "e4m3", "compact", proxy)
