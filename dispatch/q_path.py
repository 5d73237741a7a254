"""The MXFP8 query path with RMSNorm as one autograd node.

    from dispatch.q_path import rmsnorm_mla_q
    q_row = rmsnorm_mla_q(c_q, gamma, w_uq, cos, sin, eps=1e-6)     # TrackedMXTensor [T, H, 192]

is, byte for byte and gradient for gradient, the composition

    y_row, y_col, _ = mxag.rmsnorm_mxfp8(c_q, gamma, eps=1e-6)
    w_row, w_col = quantized_weight(w_uq)                           # dispatch.weights: cached copies
    q_row, _ = mxag.mla_q_uproj_rope_quant(y_row, w_row, cos, sin, quantize_grad=True, x_t=y_col, w_n=w_col)

for plain eager calls (every tensor a plain torch.Tensor or nn.Parameter, not compiling; see
`dispatch.autograd.plain_eager`). Under torch.compile `rmsnorm_mla_q_traced` is the same node as the
custom ops `mxmla::rmsnorm_mla_q` / `mxmla::rmsnorm_mla_q_backward` (the same functions inside, so the
same bytes), reading the weight's persistent copies (`dispatch.weights.WeightCopies`) as graph inputs,
with the backends resolved at trace time (`dispatch.resolution`). `dispatch.nn.mla_q_projection` takes
these on its mxfp8 path with a norm weight and the MXFP8 backward (compiled: when it has the weight's
copies), and the composition everywhere else.

Why one node: on a GPU the MXFP8 block's forward is bound by host time, not by the kernels. Each
wrapper of the composition pays for its own argument validation, operand-slot conversion (MXTensors
taken apart into codes and scales and rebuilt), a torch.autograd.Function apply, gradient proxies,
TrackedMXTensor construction and contiguous / uint8-view round trips of every output; the weight's
copies add a proxy node of their own. Here the two ops run as two `dispatch.run` calls on the
MXTensors they return, the weight's copies come from the caller's `WeightCopies` or from
`dispatch.weights.plain_copies` (the same cache, so copies made after an optimizer step are reused),
and one node's backward computes what the composition's chain of three backwards computes, in the same order and dtypes:
- `mla_q_uproj_rope_quant_backward` (quantize_grad=True) on dq with y blocked along T and w along N;
- dy = dx cast to float32, as the composition's RMSNorm gradient proxy casts it, then the op
  `rmsnorm_backward` with the forward's rstd: the gradients of x and gamma. The values would be the same
  from bf16 (the op widens dy itself), but the bytes need not be: Triton lays out a load by its element
  size (8 bf16 or 4 fp32 per thread), and a row's sum adds in that order, so the same dtype keeps the
  node byte-equal to the composition (the cast reads 2 bytes and writes 4 per element of dy, and the kernel
  reads 4 instead of 2: ~8 bytes an element more);
- dw cast to bfloat16 (the dtype of the weight's proxy), then `dispatch.weights.weight_grad` (scatter
  back through `rows`, cast to w's dtype).
Only q_row is returned (the composition's q_col is not read by attention). RMSNorm's arguments are
validated before anything runs, as the composition's wrapper does; the fused op's arguments are
validated by `dispatch.run` (per call signature, before any backend runs) with the same validators.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

import dispatch as _dispatch
import dispatch.resolution as _resolution
from dispatch.autograd import NAMESPACE, TrackedMXTensor, _scale_shape, grad_proxy, shared_grad_proxy
from dispatch.weights import MXFP8Weight, plain_copies, weight_grad
from spec.constants import MLA_QK_HEAD_DIM
from spec.mxtensor import MXTensor

__all__ = ["rmsnorm_mla_q", "rmsnorm_mla_q_traced"]

_E4M3 = torch.float8_e4m3fn
_run = _resolution.run


def _contiguous_mx(t: MXTensor) -> MXTensor:
    # the composition hands each op contiguous codes and scales (its custom ops' outputs are)
    if t.data.is_contiguous() and t.scale.is_contiguous():
        return t
    return MXTensor(t.data.contiguous(), t.scale.contiguous(), t.axis, t.elem, t.scale_layout)


def _forward(x, gamma, w_row: MXTensor, cos, sin, eps, norm_backend, q_backend):
    """(q_row, y_col, rstd): RMSNorm to MXFP8, then the fused up-projection on the weight's row copy."""
    y_row, y_col, rstd = _run("rmsnorm_mxfp8", x.contiguous(), gamma.contiguous(), eps=eps,
                              zero_centered_gamma=False, elem="e4m3", backend=norm_backend)
    y_row, y_col = _contiguous_mx(y_row), _contiguous_mx(y_col)
    q_row, _ = _run("mla_q_uproj_rope_quant", y_row, w_row, cos, sin, backend=q_backend)
    return q_row, y_col, rstd.contiguous()


def _backward(dq, x, gamma, rstd, y_col: MXTensor, w_col: MXTensor, cos, sin, backend, norm_backend,
              needs=(True, True)):
    """(dx, dgamma, dw16): the fused op's MXFP8 backward and RMSNorm's; dw16 is the gradient of the
    weight proxy (bf16, in the copies' row order), which `weight_grad` turns into w's."""
    dy, dw = _run("mla_q_uproj_rope_quant_backward", dq.contiguous(), y_col, w_col, cos, sin, quantize_grad=True,
                  backend=backend)
    dx = dgamma = None
    if needs[0] or needs[1]:
        dx, dgamma = _run("rmsnorm_backward", dy.float().contiguous(), x.contiguous(), gamma.contiguous(),
                          rstd.contiguous(), zero_centered_gamma=False, backend=norm_backend)
    return dx, dgamma, dw.contiguous().to(torch.bfloat16)


class _RMSNormMLAQ(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, gamma, w, rows, cos, sin, eps, backend, copies):
        if copies is None:
            copies = plain_copies(w, backend=backend, rows=rows)
        q_row, y_col, rstd = _forward(x, gamma, copies.row, cos, sin, eps, backend, backend)
        codes, scales = q_row.data.view(torch.uint8).contiguous(), q_row.scale.contiguous()
        ctx.mark_non_differentiable(codes, scales)
        ctx.set_materialize_grads(False)
        # through save_for_backward (not ctx attributes), so saved-tensor hooks (offloading,
        # checkpointing) see what the composition's nodes save
        ctx.save_for_backward(x, gamma, rstd, y_col.data, y_col.scale, copies.col.data, copies.col.scale,
                              cos, sin, rows)
        ctx.w_dtype, ctx.backend = w.dtype, backend
        return shared_grad_proxy(codes.shape, torch.bfloat16, cos.device), codes, scales

    @staticmethod
    def backward(ctx, dq, _codes_grad, _scales_grad):
        if dq is None:
            return (None,) * 9
        x, gamma, rstd, y_codes, y_scales, w_codes, w_scales, cos, sin, rows = ctx.saved_tensors
        y_col = MXTensor(y_codes, y_scales, 0, "e4m3", "compact")
        w_col = MXTensor(w_codes, w_scales, 0, "e4m3", "compact")
        dx, dgamma, dw16 = _backward(dq, x, gamma, rstd, y_col, w_col, cos, sin, ctx.backend, ctx.backend,
                                     (ctx.needs_input_grad[0], ctx.needs_input_grad[1]))
        dw = weight_grad(dw16, ctx.w_dtype, rows) if ctx.needs_input_grad[2] else None
        return dx, dgamma, dw, None, None, None, None, None, None


def rmsnorm_mla_q(x: Tensor, gamma: Tensor, w: Tensor, cos: Tensor, sin: Tensor, *, eps: float = 1e-6,
                  rows: Optional[Tensor] = None, backend: Optional[str] = None,
                  copies: Optional[MXFP8Weight] = None) -> TrackedMXTensor:
    """q_row [T, H, 192] (e4m3, compact scales, blocked along the head dim; bf16 gradient proxy) of
    RMSNorm(x [T, K]; gamma [K], eps) up-projected by w [H * 192, K] (MXFP8 copies of w.to(bfloat16),
    or of w[rows]) with the fused RoPE (cos / sin [T, 64] per-token rows) and quantize: the
    composition's bytes and gradients (module docstring). Plain eager tensors only (the caller picks
    the composition or `rmsnorm_mla_q_traced` for the others); `backend` as for every mxmla op.
    `copies`: the weight's copies when the caller keeps them (`WeightCopies.current`), else
    `dispatch.weights`' cache is used."""
    _validate_norm(x, gamma, eps, backend)
    proxy, codes, scales = _RMSNormMLAQ.apply(x, gamma, w, rows, cos, sin, float(eps), backend, copies)
    return TrackedMXTensor(codes.view(_E4M3), scales, 2, "e4m3", "compact", proxy)


def _validate_norm(x, gamma, eps, backend):
    _dispatch.validate("rmsnorm_mxfp8", x, gamma, eps=eps, zero_centered_gamma=False, elem="e4m3", backend=backend)


# --------------------------------------------------------------------------------------------------
# The same node as custom ops, for torch.compile
# --------------------------------------------------------------------------------------------------
# The weight's copies are inputs (a WeightCopies' buffers: the graph never quantizes the weight); w
# itself is an input only so that its gradient has a place. Two backends travel in, resolved at trace
# time: RMSNorm's and the fused forward's; the backward's is resolved when AOTAutograd traces the rule.

def _w_col(codes_t: Tensor, scales_t: Tensor) -> MXTensor:
    return MXTensor(codes_t.view(_E4M3).t(), scales_t.t(), 0, "e4m3", "compact")


@torch.library.custom_op(f"{NAMESPACE}::rmsnorm_mla_q", mutates_args=())
def _rmsnorm_mla_q_op(x: Tensor, gamma: Tensor, w: Tensor, w_row_codes: Tensor, w_row_scales: Tensor,
                      w_col_codes_t: Tensor, w_col_scales_t: Tensor, cos: Tensor, sin: Tensor,
                      rows: Optional[Tensor], eps: float, norm_backend: Optional[str],
                      q_backend: Optional[str]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(q proxy bf16 [T, H, 192], q codes uint8, q scales, rstd fp32 [T], y_col codes uint8 [T, K],
    y_col scales [T/32, K]); the last three are saved for the backward."""
    w_row = MXTensor(w_row_codes.view(_E4M3), w_row_scales, 1, "e4m3", "compact")
    q_row, y_col, rstd = _forward(x, gamma, w_row, cos, sin, eps, norm_backend, q_backend)
    codes = q_row.data.view(torch.uint8).contiguous()
    return (grad_proxy(codes.shape, torch.bfloat16, cos.device), codes, q_row.scale.contiguous(), rstd,
            y_col.data.view(torch.uint8), y_col.scale)


@_rmsnorm_mla_q_op.register_fake
def _(x, gamma, w, w_row_codes, w_row_scales, w_col_codes_t, w_col_scales_t, cos, sin, rows, eps, norm_backend,
      q_backend):
    tokens, k = x.shape
    shape = (tokens, w.shape[0] // MLA_QK_HEAD_DIM, MLA_QK_HEAD_DIM)
    return (grad_proxy(shape, torch.bfloat16, cos.device), x.new_empty(shape, dtype=torch.uint8),
            x.new_empty(_scale_shape(shape, 2, "compact"), dtype=torch.uint8),
            x.new_empty((tokens,), dtype=torch.float32), x.new_empty((tokens, k), dtype=torch.uint8),
            x.new_empty(_scale_shape((tokens, k), 0, "compact"), dtype=torch.uint8))


@torch.library.custom_op(f"{NAMESPACE}::rmsnorm_mla_q_backward", mutates_args=())
def _rmsnorm_mla_q_backward_op(dq: Tensor, x: Tensor, gamma: Tensor, rstd: Tensor, y_col_codes: Tensor,
                               y_col_scales: Tensor, w_col_codes_t: Tensor, w_col_scales_t: Tensor, cos: Tensor,
                               sin: Tensor, backend: Optional[str],
                               norm_backend: Optional[str]) -> Tuple[Tensor, Tensor, Tensor]:
    """(dx, dgamma, dw16): dx and dgamma in the dtypes of x and gamma, dw16 the weight proxy's bf16
    gradient [N, K]. Scattering it to w's rows and casting it to w's dtype is left to the traced rule,
    where Inductor fuses that cast with its neighbours (inside the op it would be one more eager pass
    over the weight's gradient)."""
    y_col = MXTensor(y_col_codes.view(_E4M3), y_col_scales, 0, "e4m3", "compact")
    dx, dgamma, dw16 = _backward(dq, x, gamma, rstd, y_col, _w_col(w_col_codes_t, w_col_scales_t), cos, sin, backend,
                                 norm_backend)
    return dx.contiguous(), dgamma.contiguous(), dw16


@_rmsnorm_mla_q_backward_op.register_fake
def _(dq, x, gamma, rstd, y_col_codes, y_col_scales, w_col_codes_t, w_col_scales_t, cos, sin, backend, norm_backend):
    k, n = w_col_codes_t.shape
    return x.new_empty(x.shape), gamma.new_empty(gamma.shape), x.new_empty((n, k), dtype=torch.bfloat16)


def _setup(ctx, inputs, output):
    (x, gamma, w, _row_codes, _row_scales, w_col_codes_t, w_col_scales_t, cos, sin, rows, _eps, norm_backend,
     q_backend) = inputs
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, gamma, output[3], output[4], output[5], w_col_codes_t, w_col_scales_t, cos, sin, rows)
    ctx.w_dtype, ctx.backend = w.dtype, q_backend


def _backward_rule(ctx, dq, *_unused):
    if dq is None:
        return (None,) * 13
    x, gamma, rstd, y_codes, y_scales, w_codes_t, w_scales_t, cos, sin, rows = ctx.saved_tensors
    backend = norm_backend = ctx.backend
    if _resolution.is_resolved(backend):
        y_col = MXTensor(_resolution.stand_in(y_codes.shape, _E4M3, y_codes.device), y_scales, 0, "e4m3", "compact")
        k, n = w_codes_t.shape
        w_col = MXTensor(_resolution.stand_in((n, k), _E4M3, w_codes_t.device, stride=(1, n)),
                         _resolution.stand_in((n // 32, k), torch.uint8, w_codes_t.device, stride=(1, n // 32)), 0,
                         "e4m3", "compact")
        backend = _resolution.resolve("mla_q_uproj_rope_quant_backward", dq, y_col, w_col, cos, sin, contiguous=(0,),
                                      quantize_grad=True, backend=backend)
        # RMSNorm's dy is the fused backward's dx cast to float32 inside the op: [T, K]
        dy = _resolution.stand_in(x.shape, torch.float32, x.device)
        norm_backend = _resolution.resolve("rmsnorm_backward", dy, x, gamma, rstd, contiguous=(0, 1, 2, 3),
                                           zero_centered_gamma=False, backend=backend)
    dx, dgamma, dw16 = _rmsnorm_mla_q_backward_op(dq, x, gamma, rstd, y_codes, y_scales, w_codes_t, w_scales_t, cos,
                                                  sin, backend, norm_backend)
    dw = weight_grad(dw16, ctx.w_dtype, rows)  # traced: Inductor fuses the cast
    return dx, dgamma, dw, None, None, None, None, None, None, None, None, None, None


_rmsnorm_mla_q_op.register_autograd(_backward_rule, setup_context=_setup)


def rmsnorm_mla_q_traced(x: Tensor, gamma: Tensor, w: Tensor, copies: MXFP8Weight, cos: Tensor, sin: Tensor, *,
                         eps: float = 1e-6, rows: Optional[Tensor] = None,
                         backend: Optional[str] = None) -> TrackedMXTensor:
    """`rmsnorm_mla_q` for torch.compile: one custom op (forward and backward) reading the weight's
    persistent copies (`WeightCopies.traced()`: `copies.row` and the transposed storage of
    `copies.col`), backends resolved now (dispatch.resolution). The same bytes and gradients."""
    tokens, k = x.shape
    norm_backend = _resolution.resolve("rmsnorm_mxfp8", x, gamma, contiguous=(0, 1), eps=float(eps),
                                       zero_centered_gamma=False, elem="e4m3", backend=backend)
    y_row = _resolution.mx_description((tokens, k), 1, x.device)
    q_backend = _resolution.resolve_parts("mla_q_uproj_rope_quant", backend,
                                          (y_row, _resolution.describe(copies.row), _resolution.describe(cos),
                                           _resolution.describe(sin)))
    w_col = copies.col
    proxy, codes, scales, _rstd, _y_codes, _y_scales = _rmsnorm_mla_q_op(
        x, gamma, w, copies.row.data.view(torch.uint8), copies.row.scale, w_col.data.t().view(torch.uint8),
        w_col.scale.t(), cos, sin, rows, float(eps), norm_backend, q_backend)
    return TrackedMXTensor(codes.view(_E4M3), scales, 2, "e4m3", "compact", proxy)
