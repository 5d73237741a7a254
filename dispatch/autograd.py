"""Autograd for the mxmla ops: torch.library custom ops (namespace "mxmla") plus thin wrappers.

    import dispatch.autograd as mxag
    y_row, y_col, rstd = mxag.rmsnorm_mxfp8(c_q, gamma)                       # MXFP8 outputs, tracked
    w_row, w_col = mxag.mxfp8_quantize(w, axis=(1, 0))                        # straight-through
    q_row, q_col = mxag.mla_q_uproj_rope_quant(y_row, w_row, cos, sin,
                                               quantize_grad=True, x_t=y_col, w_n=w_col)
    o, lse = mxag.mla_attention(mxag.reshape_mx(q_row, (B, S, H, 192)), k, v, causal=True)
    o.float().square().mean().backward()                                     # grads reach c_q, gamma, w

Every forward and every backward is one `dispatch.run` call inside a custom op, with the same
`backend=` argument (None: MXMLA_BACKEND or the automatic choice, read when the op runs), so a backend
choice holds for both directions. The custom ops are opaque to torch.compile (no graph breaks inside
them; `register_fake` gives their shapes), pass `torch.library.opcheck`, and contain no host
synchronisation of their own, so CUDA graphs can capture them when the chosen backends can.

## MXFP8 tensors in the autograd graph (straight-through)

A custom op can only take and return tensors, and an MXFP8 value is two of them (codes, scales) that
autograd cannot differentiate: fp8 codes would receive a gradient cast to fp8 (the engine casts every
gradient to its input's dtype) and uint8 scales receive none. So every MXFP8 value that takes part in
autograd carries a **gradient proxy**: a tensor of the value's logical shape that stands in for the
dequantized values in the graph. It is a zero-filled 0-d tensor expanded to that shape (2 bytes of
memory whatever the shape; its values are never read). An op producing MXFP8 outputs returns the
proxy as a differentiable output; an op consuming an MXFP8 operand takes the proxy as an input and
returns the gradient with respect to the dequantized operand in its place. `TrackedMXTensor` is an
`MXTensor` holding its proxy, so the wrappers pass it along; codes cross the op boundary as uint8
bit views (integer outputs are non-differentiable, and opcheck can sum them).

Gradient definitions (SEMANTICS.md has none for training; these are the choices):
- `mxfp8_quantize` / `mxfp8_dequantize`: identity (straight-through estimator). The gradient with
  respect to the dequantized values is the gradient with respect to the input, cast to its dtype.
- `mla_q_uproj_rope_quant`: the outputs q_row and q_col are the same q quantized twice and share one
  bf16 proxy [T, H, 192]; the gradient arriving there is taken as dL/dq for the forward's fp32
  pre-quantization q (straight through the quantizer) and goes to `mla_q_uproj_rope_quant_backward`
  (RoPE transpose, then dx = g @ w and dw = g^T @ x, bf16). dx and dw are gradients with respect to
  x and w, or to their dequantized values when they are MXFP8 (so they reach the proxies of tracked
  inputs, e.g. an RMSNorm's y or a quantized weight's bf16 master). `quantize_grad=True` selects the
  MXFP8 backward, which needs x and w blocked along T and N: pass `x_t` / `w_n` (the columnwise
  copies a producer made) or give x / w in bf16 and the backend quantizes them.
- `rmsnorm_mxfp8`: y_row and y_col share one fp32 proxy [T, D]; the gradient arriving there is taken
  as dL/dy for the fp32 y = x * rstd * g before quantization, and dx, dgamma are that of RMSNorm:
      xhat = x * rstd,  dgamma = sum_t dy * xhat,
      dx = rstd * (dy * g - xhat * mean_D(dy * g * xhat)),
  in fp32 with the forward's rstd; g = gamma (+ 1 when zero_centered_gamma, whose gradient is the
  same). That is the op `rmsnorm_backward` (spec/rmsnorm.py; custom op `mxmla::rmsnorm_backward`, its
  backend chosen like the forward's), checked against finite differences in tests. rstd is an output
  without gradient (marked non-differentiable).
- `rope`: linear in x; dx = `rope_backward` (the exact transpose, SEMANTICS 4) in x's dtype. The
  cos/sin tables are constants (no gradient), as are positions and sequence offsets.
- `mla_attention`: o is differentiable, lse is not (marked non-differentiable). dq, dk, dv come from
  `mla_attention_backward` in bf16, with respect to the dequantized q, k, v for MXFP8 operands.

Double backward is not supported (the backward ops have no autograd formula).

Helpers on tracked MXFP8 tensors (views and joins of codes and scales; no kernels of their own):
`reshape_mx` (new leading shape, blocked last axis kept), `expand_mx` (broadcast over the other axes;
the proxy is expanded, so the gradients of the copies sum back) and `cat_mx` (concatenation: exact,
since every block lies inside one input, so byte-equal to quantizing the concatenated values; the
result's proxy hands each input its slice of the gradient). MLA's key is the example:
`cat_mx([k_nope, expand_mx(k_pe, (B, S, H, 64))], -1)` writes one fp8 copy instead of a bf16
concatenation followed by a quantize pass over it.

## Why custom ops throughout
torch.autograd.Function would need no proxy, but dynamo traces into its forward and backward, i.e.
into `dispatch.run` and the backends' Python (environment reads, selection caches, NumPy in the spec
backend, kernel launchers), where it breaks the graph or specialises on what it saw. Custom ops are
opaque to dynamo, so every wrapper here compiles with fullgraph=True (tests/test_autograd.py). No op
needed the Function fallback.

Tests: tests/test_autograd.py (gradients, plumbing, torch.compile, Triton interpreter, the example),
tests/test_autograd_opcheck.py (opcheck of every op in `OPS`), tests/test_autograd_cuda.py (CUDA-graph
capture of forward + backward; `gpu` marker).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch.utils import _python_dispatch

import dispatch as _dispatch
import dispatch.resolution as _resolution
from dispatch import compile_cache as _compile_cache
from backends import kept as _kept
from spec.checks import require_bool
from spec.constants import BLOCK_SIZE, MLA_QK_HEAD_DIM, MLA_ROPE_DIM, MLA_V_HEAD_DIM, SWIZZLE_COLS, SWIZZLE_ROWS
from spec.mla_kv import MLA_KV_LAYOUTS, mla_kv_axes, validate_mla_kv_quantize, validate_mla_kv_tables
from spec.mxtensor import MXTensor

__all__ = [
    "TrackedMXTensor",
    "mxfp8_quantize",
    "mxfp8_dequantize",
    "rope",
    "mla_q_uproj_rope_quant",
    "rmsnorm_mxfp8",
    "rmsnorm_backward",
    "mla_attention",
    "reshape_mx",
    "expand_mx",
    "cat_mx",
    "mla_kv_mxfp8",
    "grad_proxy",
    "OPS",
]

_compile_cache.tag()  # cached compiled graphs made under other versions of these ops' rules miss

NAMESPACE = "mxmla"

_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


@dataclass(frozen=True, repr=False, eq=False)
class TrackedMXTensor(MXTensor):
    """An MXTensor that takes part in autograd: `grad_proxy` (a zero-filled, zero-stride tensor of the
    logical shape; see the module docstring) receives the gradient with respect to its dequantized
    values. A plain MXTensor passed to the wrappers is treated as a constant."""

    grad_proxy: Any = None


_EAGER = threading.local()  # .active: inside _EagerOp.forward (plain eager autograd calls)
_ZEROS: dict = {}  # (dtype, device) -> a 0-dim zero the eager path's proxies expand


def grad_proxy(shape: Sequence[int], dtype: torch.dtype, device: Any) -> Tensor:
    """A zero-filled tensor of `shape` backed by one element (every stride 0). Inside a plain eager
    call the element is one kept zero per dtype and device (an expanded tensor cannot be written to, so
    sharing it is safe, and each op saves an allocation and a fill launch); a custom-op call (compile,
    tensor subclasses) gets a fresh one, as custom ops' outputs must not share storage."""
    if getattr(_EAGER, "active", False):
        return shared_grad_proxy(shape, dtype, device)
    return torch.zeros((), dtype=dtype, device=device).expand(tuple(shape))


def shared_grad_proxy(shape: Sequence[int], dtype: torch.dtype, device: Any) -> Tensor:
    """grad_proxy's eager form: the kept zero of (dtype, device), expanded (torch.autograd.Function outputs
    may share storage). Kept only where `backends.kept.may_keep` allows (not in a CUDA graph's pool)."""
    key = (dtype, device if isinstance(device, torch.device) else torch.device(device))
    base = _ZEROS.get(key)
    if base is None:
        base = torch.zeros((), dtype=dtype, device=key[1])
        if _kept.may_keep(key[1]):
            _ZEROS[key] = base
    return base.expand(tuple(shape))


# --------------------------------------------------------------------------------------------------
# Eager calls: the same implementation and autograd rules without the custom op's dispatch
# --------------------------------------------------------------------------------------------------
# A torch.library custom op costs a few hundred microseconds of host time per call in eager mode
# (argument boxing, schema defaults, pytree plumbing of its autograd wrapper; H200 host, measured with
# tools/profile_block_ops.py), which left the MXFP8 block's forward bound by the host. Calls whose
# tensors are all plain torch.Tensors, outside torch.compile, therefore run the op's own function under
# a torch.autograd.Function with the op's registered setup_context / backward; everything else (compile
# tracing, FakeTensor, DTensor and other subclasses) goes through the custom op, so graphs, fake
# kernels and sharding rules still see the op.

_EAGER_RULES: dict = {}  # custom op -> (setup_context, backward) as registered with register_autograd


def _register_autograd(op, backward, setup_context) -> None:
    op.register_autograd(backward, setup_context=setup_context)
    _EAGER_RULES[op] = (setup_context, backward)


def plain_classes(args) -> bool:
    """Every tensor argument (MXTensors' codes and scales included) of the plain classes torch.Tensor /
    nn.Parameter (no subclass: DTensor, ...). While dynamo traces, tensors show their user-visible
    class: plain ones pass."""
    for a in args:
        if isinstance(a, MXTensor):
            if not plain_classes((a.data, a.scale)):
                return False
            continue
        # exact classes: a DTensor parameter passes isinstance(Parameter) but is a DTensor
        if isinstance(a, Tensor) and type(a) is not Tensor and type(a) is not torch.nn.Parameter:
            return False
    return True


def plain_eager(args) -> bool:
    """Every tensor argument a plain torch.Tensor (no subclass: FakeTensor, DTensor, ...), not compiling,
    and no TorchDispatchMode active (selective activation checkpointing's policy, FLOP counters: they
    see the custom ops only when the call goes through the dispatcher): the calls that take the eager
    path (above), here and in the layers that build their own nodes."""
    return (not torch.compiler.is_compiling() and plain_classes(args)
            and _python_dispatch._get_current_dispatch_mode() is None)


class _EagerOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, *args):
        outer = getattr(_EAGER, "active", False)
        _EAGER.active = True
        try:
            out = op._init_fn(*args)
        finally:
            _EAGER.active = outer
        setup, backward = _EAGER_RULES[op]
        setup(ctx, args, out)
        ctx.mx_rule = (backward, isinstance(out, list))
        return tuple(out) if isinstance(out, list) else out

    @staticmethod
    def backward(ctx, *grads):
        backward, list_output = ctx.mx_rule
        res = backward(ctx, list(grads)) if list_output else backward(ctx, *grads)
        res = res if isinstance(res, tuple) else (res,)
        return (None, *res)


def _call(op, *args):
    """op(*args) -- through _EagerOp (or, for an op without autograd, its function) for plain eager
    calls (see above). A List[Tensor] result comes back as a tuple on that path; callers index it."""
    if plain_eager(args):
        if op in _EAGER_RULES:
            return _EagerOp.apply(op, *args)
        return op._init_fn(*args)
    return op(*args)


# --------------------------------------------------------------------------------------------------
# Operand slots: how a plain tensor or an MXTensor crosses a custom-op boundary
# --------------------------------------------------------------------------------------------------
# Each operand is four arguments: value (the plain tensor, or the MXFP8 operand's gradient proxy, or
# None for an untracked MXTensor), codes (uint8 view of the fp8 codes), scales (uint8) and a format
# string "elem/scale_layout/axis" ("" for a plain tensor).


def _format_of(t: MXTensor) -> str:
    return f"{t.elem}/{t.scale_layout}/{t.axis}"


def _parse_format(fmt: str) -> Tuple[str, str, int]:
    elem, layout, axis = fmt.split("/")
    return elem, layout, int(axis)


def _slots(t: Any) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor], str]:
    if isinstance(t, MXTensor):
        proxy = t.grad_proxy if isinstance(t, TrackedMXTensor) else None
        return proxy, t.data.view(torch.uint8), t.scale, _format_of(t)
    return t, None, None, ""


def _mx_slots(t: Optional[MXTensor]) -> Tuple[Optional[Tensor], Optional[Tensor], str]:
    """codes, scales, format of an MXTensor that only travels to the backward (no value slot)."""
    if t is None:
        return None, None, ""
    return t.data.view(torch.uint8), t.scale, _format_of(t)


def _operand(value: Optional[Tensor], codes: Optional[Tensor], scales: Optional[Tensor], fmt: str):
    """The plain tensor, or the MXTensor the slots describe (for dispatch.run)."""
    if not fmt:
        return value
    elem, layout, axis = _parse_format(fmt)
    return MXTensor(codes.view(_FP8[elem]), scales, axis, elem, layout)


def _logical_shape(value: Optional[Tensor], codes: Optional[Tensor], fmt: str) -> Tuple[int, ...]:
    return tuple(codes.shape) if fmt else tuple(value.shape)


def _device_of(*tensors: Optional[Tensor]) -> torch.device:
    return next(t.device for t in tensors if t is not None)


def _scale_shape(shape: Sequence[int], axis: int, layout: str) -> Tuple[int, ...]:
    """Shape of the scale tensor of MXFP8 data `shape` blocked on `axis` (spec.mxtensor's rule)."""
    compact = list(shape)
    compact[axis] //= BLOCK_SIZE
    if layout == "compact":
        return tuple(compact)
    rows = 1
    for i, n in enumerate(shape):
        if i != axis:
            rows *= n
    cols = shape[axis] // BLOCK_SIZE
    return (-(-rows // SWIZZLE_ROWS) * SWIZZLE_ROWS, -(-cols // SWIZZLE_COLS) * SWIZZLE_COLS)


def _tracked(codes: Tensor, scales: Tensor, axis: int, elem: str, layout: str, proxy: Tensor) -> TrackedMXTensor:
    return TrackedMXTensor(codes.view(_FP8[elem]), scales, axis, elem, layout, proxy)


def _grad_for(value: Optional[Tensor], grad: Optional[Tensor]) -> Optional[Tensor]:
    """grad cast to the dtype of the slot it is returned for (None when there is no slot)."""
    if value is None or grad is None:
        return None
    return grad.to(value.dtype)


def _validate(op: str, *args, **kwargs) -> None:
    """The caller's arguments through `dispatch.validate` (spec's validators, as `dispatch.run` runs
    them) before any conversion for the custom op: bool(), float() and int() would otherwise turn
    causal="False" into True, eps="1e-6" into 1e-6 and axis=1.7 into 1. While torch.compile traces,
    the custom op's own `dispatch.run` validates when the graph runs."""
    if not torch.compiler.is_compiling():
        _dispatch.validate(op, *args, **kwargs)


_run = _resolution.run  # dispatch.run, or a backend resolved at trace time called directly


def _trace_choice(op: str, backend: Optional[str], *args, contiguous: Tuple[int, ...] = (), **kwargs):
    """The `backend` a wrapper hands its custom op: while torch.compile traces plain tensors, the choice
    for these arguments (as the op will pass them to the backend; `contiguous`: positions it makes
    contiguous) resolved now (dispatch.resolution), so the compiled op runs no selection; else as given."""
    if torch.compiler.is_compiling() and plain_classes(list(args) + list(kwargs.values())):
        return _resolution.resolve(op, *args, backend=backend, contiguous=contiguous, **kwargs)
    return backend


def _backward_choice(backend: Optional[str], op: str, *args, contiguous: Tuple[int, ...] = (), **kwargs):
    """The backend of an autograd rule's backward op: resolved (from the same request) when the forward's
    was, i.e. while AOTAutograd traces the backward of a compiled graph; else the forward's."""
    if _resolution.is_resolved(backend):
        return _resolution.resolve(op, *args, backend=backend, contiguous=contiguous, **kwargs)
    return backend


def _contiguous(t: Any) -> Any:
    return t.contiguous() if isinstance(t, Tensor) else t


# --------------------------------------------------------------------------------------------------
# mxfp8_quantize / mxfp8_dequantize (straight-through)
# --------------------------------------------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::mxfp8_quantize", mutates_args=())
def _quantize_op(x: Tensor, axes: List[int], elem: str, scale_mode: str, nonfinite: str, scale_layout: str,
                 backend: Optional[str]) -> List[Tensor]:
    """[proxy, codes_0, scales_0, codes_1, scales_1, ...]: one (codes, scales) pair per axis."""
    axis = tuple(axes) if len(axes) > 1 else axes[0]
    outs = _run("mxfp8_quantize", x, axis=axis, elem=elem, scale_mode=scale_mode,
                         nonfinite=nonfinite, scale_layout=scale_layout, backend=backend)
    outs = outs if isinstance(outs, tuple) else (outs,)
    result = [grad_proxy(x.shape, x.dtype, x.device)]
    for t in outs:
        result += [t.data.view(torch.uint8).contiguous(), t.scale.contiguous()]
    return result


@_quantize_op.register_fake
def _(x, axes, elem, scale_mode, nonfinite, scale_layout, backend):
    result = [grad_proxy(x.shape, x.dtype, x.device)]
    for a in axes:
        a = a % x.dim()
        result += [x.new_empty(x.shape, dtype=torch.uint8),
                   x.new_empty(_scale_shape(x.shape, a, scale_layout), dtype=torch.uint8)]
    return result


def _quantize_setup(ctx, inputs, output):
    ctx.x_dtype = inputs[0].dtype


def _quantize_backward(ctx, grads):
    g = grads[0]
    return (None if g is None else g.to(ctx.x_dtype)), None, None, None, None, None, None


_register_autograd(_quantize_op, _quantize_backward, _quantize_setup)


def mxfp8_quantize(x: Tensor, axis: Union[int, Sequence[int]] = -1, elem: str = "e4m3", scale_mode: str = "rceil",
                   nonfinite: str = "saturate", scale_layout: str = "compact", backend: Optional[str] = None):
    """`dispatch.run("mxfp8_quantize", ...)` returning TrackedMXTensor(s); the gradient passes straight
    through to x (identity). A tuple axis gives a tuple sharing one proxy."""
    _validate("mxfp8_quantize", x, axis=axis, elem=elem, scale_mode=scale_mode, nonfinite=nonfinite,
              scale_layout=scale_layout, backend=backend)
    as_tuple = isinstance(axis, (tuple, list))
    axes = [int(a) for a in axis] if as_tuple else [int(axis)]
    backend = _trace_choice("mxfp8_quantize", backend, x, axis=tuple(axes) if len(axes) > 1 else axes[0], elem=elem,
                            scale_mode=scale_mode, nonfinite=nonfinite, scale_layout=scale_layout)
    out = _call(_quantize_op, x, axes, elem, scale_mode, nonfinite, scale_layout, backend)
    proxy = out[0]
    tensors = tuple(_tracked(out[1 + 2 * i], out[2 + 2 * i], a % x.dim(), elem, scale_layout, proxy)
                    for i, a in enumerate(axes))
    return tensors if as_tuple else tensors[0]


@torch.library.custom_op(f"{NAMESPACE}::mxfp8_dequantize", mutates_args=())
def _dequantize_op(value: Optional[Tensor], codes: Tensor, scales: Tensor, fmt: str, out_dtype: str,
                   backend: Optional[str]) -> Tensor:
    t = _operand(value, codes, scales, fmt)
    return _run("mxfp8_dequantize", t, out_dtype=out_dtype, backend=backend).contiguous()


@_dequantize_op.register_fake
def _(value, codes, scales, fmt, out_dtype, backend):
    return codes.new_empty(codes.shape, dtype=_TORCH_DTYPES[out_dtype])


def _dequantize_setup(ctx, inputs, output):
    value = inputs[0]
    ctx.value_dtype = None if value is None else value.dtype


def _dequantize_backward(ctx, grad):
    g = None if ctx.value_dtype is None or grad is None else grad.to(ctx.value_dtype)
    return g, None, None, None, None, None


_register_autograd(_dequantize_op, _dequantize_backward, _dequantize_setup)


def mxfp8_dequantize(t: MXTensor, out_dtype: str = "float32", backend: Optional[str] = None) -> Tensor:
    """Dequantized values of t; the gradient goes straight through to t's proxy (if tracked)."""
    _validate("mxfp8_dequantize", t, out_dtype=out_dtype, backend=backend)
    value, codes, scales, fmt = _slots(t)
    backend = _trace_choice("mxfp8_dequantize", backend, t, out_dtype=out_dtype)
    return _call(_dequantize_op, value, codes, scales, fmt, out_dtype, backend)


# --------------------------------------------------------------------------------------------------
# rope
# --------------------------------------------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::rope", mutates_args=())
def _rope_op(x: Tensor, cos: Tensor, sin: Tensor, style: str, layout: str, cu_seqlens: Optional[Tensor],
             positions: Optional[Tensor], start_positions: Optional[Tensor], cp_size: int, cp_rank: int,
             out_dtype: Optional[str], backend: Optional[str]) -> Tensor:
    # x as it is: every backend honours its strides (a k_pe sliced from the kv projection is not copied)
    return _run("rope", x, cos, sin, style=style, layout=layout, cu_seqlens=cu_seqlens,
                         positions=positions, start_positions=start_positions, cp_size=cp_size, cp_rank=cp_rank,
                         out_dtype=out_dtype, backend=backend).contiguous()


@_rope_op.register_fake
def _(x, cos, sin, style, layout, cu_seqlens, positions, start_positions, cp_size, cp_rank, out_dtype, backend):
    dtype = x.dtype if out_dtype is None else _TORCH_DTYPES[out_dtype]
    return x.new_empty(x.shape, dtype=dtype)


@torch.library.custom_op(f"{NAMESPACE}::rope_backward", mutates_args=())
def _rope_backward_op(grad: Tensor, cos: Tensor, sin: Tensor, style: str, layout: str,
                      cu_seqlens: Optional[Tensor], positions: Optional[Tensor], start_positions: Optional[Tensor],
                      cp_size: int, cp_rank: int, out_dtype: Optional[str], backend: Optional[str]) -> Tensor:
    return _run("rope_backward", grad.contiguous(), cos, sin, style=style, layout=layout,
                         cu_seqlens=cu_seqlens, positions=positions, start_positions=start_positions,
                         cp_size=cp_size, cp_rank=cp_rank, out_dtype=out_dtype, backend=backend).contiguous()


@_rope_backward_op.register_fake
def _(grad, cos, sin, style, layout, cu_seqlens, positions, start_positions, cp_size, cp_rank, out_dtype, backend):
    dtype = grad.dtype if out_dtype is None else _TORCH_DTYPES[out_dtype]
    return grad.new_empty(grad.shape, dtype=dtype)


def _rope_setup(ctx, inputs, output):
    x, cos, sin, style, layout, cu_seqlens, positions, start_positions, cp_size, cp_rank, _, backend = inputs
    ctx.save_for_backward(cos, sin, cu_seqlens, positions, start_positions)
    ctx.options = (style, layout, cp_size, cp_rank, _DTYPE_NAMES[x.dtype], backend)


def _rope_backward(ctx, grad):
    if grad is None:
        return (None,) * 12
    cos, sin, cu_seqlens, positions, start_positions = ctx.saved_tensors
    style, layout, cp_size, cp_rank, x_dtype, backend = ctx.options
    backend = _backward_choice(backend, "rope_backward", grad, cos, sin, contiguous=(0,), style=style, layout=layout,
                               cu_seqlens=cu_seqlens, positions=positions, start_positions=start_positions,
                               cp_size=cp_size, cp_rank=cp_rank, out_dtype=x_dtype)
    # The gradient arrives in the output's dtype; rope_backward accepts any float dtype, and out_dtype
    # returns dx in x's dtype (one rounding from the fp32 result).
    dx = _call(_rope_backward_op, grad, cos, sin, style, layout, cu_seqlens, positions, start_positions, cp_size,
                           cp_rank, x_dtype, backend)
    return (dx,) + (None,) * 11


_register_autograd(_rope_op, _rope_backward, _rope_setup)


def rope(x: Tensor, cos: Tensor, sin: Tensor, style: str = "mla", layout: str = "thd",
         cu_seqlens: Optional[Tensor] = None, positions: Optional[Tensor] = None,
         start_positions: Optional[Tensor] = None, cp_size: int = 1, cp_rank: int = 0,
         out_dtype: Optional[str] = None, backend: Optional[str] = None) -> Tensor:
    """`dispatch.run("rope", ...)` with dx = rope_backward(dL/dout) (tables are constants)."""
    _validate("rope", x, cos, sin, style=style, layout=layout, cu_seqlens=cu_seqlens, positions=positions,
              start_positions=start_positions, cp_size=cp_size, cp_rank=cp_rank, out_dtype=out_dtype,
              backend=backend)
    backend = _trace_choice("rope", backend, x, cos, sin, style=style, layout=layout, cu_seqlens=cu_seqlens,
                            positions=positions, start_positions=start_positions, cp_size=int(cp_size),
                            cp_rank=int(cp_rank), out_dtype=out_dtype)
    return _call(_rope_op, x, cos, sin, style, layout, cu_seqlens, positions, start_positions, int(cp_size),
                    int(cp_rank), out_dtype, backend)


# --------------------------------------------------------------------------------------------------
# mla_q_uproj_rope_quant
# --------------------------------------------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::mla_q_uproj_rope_quant", mutates_args=())
def _mla_q_op(x: Optional[Tensor], x_codes: Optional[Tensor], x_scales: Optional[Tensor], x_format: str,
              w: Optional[Tensor], w_codes: Optional[Tensor], w_scales: Optional[Tensor], w_format: str,
              cos: Tensor, sin: Tensor,
              x_t_codes: Optional[Tensor], x_t_scales: Optional[Tensor], x_t_format: str,
              w_n_codes: Optional[Tensor], w_n_scales: Optional[Tensor], w_n_format: str,
              quantize_grad: bool, backend: Optional[str]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(q proxy bf16 [T, H, 192], q_row codes, q_row scales, q_col codes, q_col scales). The x_t / w_n
    slots are not read here: they are inputs only so that the backward can have them."""
    q_row, q_col = _run("mla_q_uproj_rope_quant", _operand(x, x_codes, x_scales, x_format),
                                 _operand(w, w_codes, w_scales, w_format), cos, sin, backend=backend)
    proxy = grad_proxy(q_row.data.shape, torch.bfloat16, cos.device)
    return (proxy, q_row.data.view(torch.uint8).contiguous(), q_row.scale.contiguous(),
            q_col.data.view(torch.uint8).contiguous(), q_col.scale.contiguous())


@_mla_q_op.register_fake
def _(x, x_codes, x_scales, x_format, w, w_codes, w_scales, w_format, cos, sin, x_t_codes, x_t_scales,
      x_t_format, w_n_codes, w_n_scales, w_n_format, quantize_grad, backend):
    tokens = _logical_shape(x, x_codes, x_format)[0]
    heads = _logical_shape(w, w_codes, w_format)[0] // MLA_QK_HEAD_DIM
    shape = (tokens, heads, MLA_QK_HEAD_DIM)
    return (grad_proxy(shape, torch.bfloat16, cos.device), cos.new_empty(shape, dtype=torch.uint8),
            cos.new_empty(_scale_shape(shape, 2, "compact"), dtype=torch.uint8),
            cos.new_empty(shape, dtype=torch.uint8),
            cos.new_empty(_scale_shape(shape, 0, "compact"), dtype=torch.uint8))


@torch.library.custom_op(f"{NAMESPACE}::mla_q_uproj_rope_quant_backward", mutates_args=())
def _mla_q_backward_op(dq: Tensor, x: Optional[Tensor], x_codes: Optional[Tensor], x_scales: Optional[Tensor],
                       x_format: str, w: Optional[Tensor], w_codes: Optional[Tensor], w_scales: Optional[Tensor],
                       w_format: str, cos: Tensor, sin: Tensor, quantize_grad: bool,
                       backend: Optional[str]) -> Tuple[Tensor, Tensor]:
    """(dx bf16 [T, K], dw bf16 [N, K]); x and w as the backward wants them (module docstring)."""
    x_arg = _operand(x, x_codes, x_scales, x_format)
    w_arg = _operand(w, w_codes, w_scales, w_format)
    if quantize_grad and (isinstance(x_arg, MXTensor) != isinstance(w_arg, MXTensor)):
        # The op takes both bf16 or both MXFP8 along T / N: quantize the bf16 one as the backend would.
        quant = dict(axis=0, elem="e4m3", scale_mode="rceil", nonfinite="saturate", scale_layout="compact",
                     backend=_resolution.request_of(backend))
        if not isinstance(x_arg, MXTensor):
            x_arg = _run("mxfp8_quantize", x_arg, **quant)
        else:
            w_arg = _run("mxfp8_quantize", w_arg, **quant)
    dx, dw = _run("mla_q_uproj_rope_quant_backward", dq.contiguous(), x_arg, w_arg, cos, sin,
                           quantize_grad=quantize_grad, backend=backend)
    return dx.contiguous(), dw.contiguous()


@_mla_q_backward_op.register_fake
def _(dq, x, x_codes, x_scales, x_format, w, w_codes, w_scales, w_format, cos, sin, quantize_grad, backend):
    tokens, k = _logical_shape(x, x_codes, x_format)
    n = _logical_shape(w, w_codes, w_format)[0]
    return dq.new_empty((tokens, k), dtype=torch.bfloat16), dq.new_empty((n, k), dtype=torch.bfloat16)


def _mla_q_setup(ctx, inputs, output):
    (x, x_codes, x_scales, x_format, w, w_codes, w_scales, w_format, cos, sin,
     x_t_codes, x_t_scales, x_t_format, w_n_codes, w_n_scales, w_n_format, quantize_grad, backend) = inputs
    if quantize_grad:
        # MXFP8 backward: x and w blocked along T and N (given copies), else bf16 for the backend to quantize
        x_slots = (None, x_t_codes, x_t_scales, x_t_format) if x_t_format else (x, None, None, "")
        w_slots = (None, w_n_codes, w_n_scales, w_n_format) if w_n_format else (w, None, None, "")
    else:
        x_slots = (x if not x_format else None, x_codes, x_scales, x_format)
        w_slots = (w if not w_format else None, w_codes, w_scales, w_format)
    ctx.save_for_backward(x_slots[0], x_slots[1], x_slots[2], w_slots[0], w_slots[1], w_slots[2], cos, sin)
    ctx.formats = (x_slots[3], w_slots[3])
    ctx.options = (bool(quantize_grad), backend)
    ctx.x_dtype = None if x is None else x.dtype  # dx goes to x's slot (the tensor or the proxy)
    ctx.w_dtype = None if w is None else w.dtype


def _mla_q_backward(ctx, dq, *_unused_integer_grads):
    none = [None] * 18
    if dq is None:
        return tuple(none)
    x, x_codes, x_scales, w, w_codes, w_scales, cos, sin = ctx.saved_tensors
    x_format, w_format = ctx.formats
    quantize_grad, backend = ctx.options
    x_arg, w_arg = _operand(x, x_codes, x_scales, x_format), _operand(w, w_codes, w_scales, w_format)
    if quantize_grad and isinstance(x_arg, MXTensor) != isinstance(w_arg, MXTensor):
        backend = _resolution.request_of(backend)  # the op quantizes one operand first: chosen per call
    else:
        backend = _backward_choice(backend, "mla_q_uproj_rope_quant_backward", dq, x_arg, w_arg, cos, sin,
                                   contiguous=(0,), quantize_grad=quantize_grad)
    dx, dw = _call(_mla_q_backward_op, dq, x, x_codes, x_scales, x_format, w, w_codes, w_scales, w_format, cos, sin,
                                quantize_grad, backend)
    if ctx.x_dtype is not None:
        none[0] = dx.to(ctx.x_dtype)
    if ctx.w_dtype is not None:
        none[4] = dw.to(ctx.w_dtype)
    return tuple(none)


_register_autograd(_mla_q_op, _mla_q_backward, _mla_q_setup)


def mla_q_uproj_rope_quant(x, w, cos: Tensor, sin: Tensor, quantize_grad: bool = False,
                           x_t: Optional[MXTensor] = None, w_n: Optional[MXTensor] = None,
                           backend: Optional[str] = None) -> Tuple[TrackedMXTensor, TrackedMXTensor]:
    """The fused op as `dispatch.run("mla_q_uproj_rope_quant", x, w, cos, sin)`, returning (q_row,
    q_col) TrackedMXTensors that share one bf16 proxy [T, H, 192]. Backward (module docstring):
    `mla_q_uproj_rope_quant_backward` with `quantize_grad`; for the MXFP8 backward with MXFP8 x or w,
    `x_t` (x blocked along T, axis 0) / `w_n` (w blocked along N, axis 0) are required."""
    _validate("mla_q_uproj_rope_quant", x, w, cos, sin, backend=backend)
    require_bool("quantize_grad", quantize_grad)
    if quantize_grad:
        needed = (("x", x, x_t, "x_t (x blocked along T, axis 0; e.g. rmsnorm_mxfp8's y_col)"),
                  ("w", w, w_n, "w_n (w blocked along N, axis 0; e.g. mxfp8_quantize(w, axis=(1, 0))[1])"))
        for name, operand, copy, what in needed:
            if isinstance(operand, MXTensor) and copy is None:
                raise ValueError(f"{name}: the MXFP8 backward (quantize_grad=True) of an MXFP8 {name} needs {what}")
    x_slots, w_slots = _slots(x), _slots(w)
    backend = _trace_choice("mla_q_uproj_rope_quant", backend, x, w, cos, sin)
    out = _call(_mla_q_op, *x_slots, *w_slots, cos, sin, *_mx_slots(x_t), *_mx_slots(w_n), bool(quantize_grad), backend)
    proxy, row_codes, row_scales, col_codes, col_scales = out
    return (_tracked(row_codes, row_scales, 2, "e4m3", "compact", proxy),
            _tracked(col_codes, col_scales, 0, "e4m3", "compact", proxy))


# --------------------------------------------------------------------------------------------------
# rmsnorm_mxfp8
# --------------------------------------------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::rmsnorm_mxfp8", mutates_args=())
def _rmsnorm_op(x: Tensor, gamma: Tensor, eps: float, zero_centered_gamma: bool, elem: str,
                backend: Optional[str]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y proxy fp32 [T, D], y_row codes, y_row scales, y_col codes, y_col scales, rstd fp32 [T])."""
    y_row, y_col, rstd = _run("rmsnorm_mxfp8", x.contiguous(), gamma.contiguous(), eps=eps,
                                       zero_centered_gamma=zero_centered_gamma, elem=elem, backend=backend)
    return (grad_proxy(x.shape, torch.float32, x.device), y_row.data.view(torch.uint8).contiguous(),
            y_row.scale.contiguous(), y_col.data.view(torch.uint8).contiguous(), y_col.scale.contiguous(),
            rstd.contiguous())


@_rmsnorm_op.register_fake
def _(x, gamma, eps, zero_centered_gamma, elem, backend):
    shape = tuple(x.shape)
    return (grad_proxy(shape, torch.float32, x.device), x.new_empty(shape, dtype=torch.uint8),
            x.new_empty(_scale_shape(shape, 1, "compact"), dtype=torch.uint8), x.new_empty(shape, dtype=torch.uint8),
            x.new_empty(_scale_shape(shape, 0, "compact"), dtype=torch.uint8),
            x.new_empty(shape[:1], dtype=torch.float32))


@torch.library.custom_op(f"{NAMESPACE}::rmsnorm_backward", mutates_args=())
def _rmsnorm_backward_op(dy: Tensor, x: Tensor, gamma: Tensor, rstd: Tensor, zero_centered_gamma: bool,
                         backend: Optional[str]) -> Tuple[Tensor, Tensor]:
    """(dx in x's dtype, dgamma in gamma's dtype)."""
    dx, dgamma = _run("rmsnorm_backward", dy.contiguous(), x.contiguous(), gamma.contiguous(), rstd.contiguous(),
                      zero_centered_gamma=zero_centered_gamma, backend=backend)
    return dx.contiguous(), dgamma.contiguous()


@_rmsnorm_backward_op.register_fake
def _(dy, x, gamma, rstd, zero_centered_gamma, backend):
    return x.new_empty(x.shape), gamma.new_empty(gamma.shape)


def rmsnorm_backward(dy: Tensor, x: Tensor, gamma: Tensor, rstd: Tensor, zero_centered_gamma: bool = False,
                     backend: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """(dx, dgamma) of y = x * rstd[:, None] * g for dL/dy `dy` [T, D] with the forward's rstd [T]:
    `dispatch.run("rmsnorm_backward", ...)` (dx in x's dtype, dgamma in gamma's), what the autograd rule
    of `rmsnorm_mxfp8` computes."""
    return _run("rmsnorm_backward", dy, x, gamma, rstd, zero_centered_gamma=zero_centered_gamma, backend=backend)


def _rmsnorm_setup(ctx, inputs, output):
    x, gamma, eps, zero_centered_gamma, elem, backend = inputs
    rstd = output[5]
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, gamma, rstd)
    ctx.zero_centered_gamma, ctx.backend = bool(zero_centered_gamma), backend


def _rmsnorm_backward(ctx, dy, *_unused):
    if dy is None:
        return (None,) * 6
    x, gamma, rstd = ctx.saved_tensors
    backend = _backward_choice(ctx.backend, "rmsnorm_backward", dy, x, gamma, rstd, contiguous=(0, 1, 2, 3),
                               zero_centered_gamma=ctx.zero_centered_gamma)
    dx, dgamma = _call(_rmsnorm_backward_op, dy, x, gamma, rstd, ctx.zero_centered_gamma, backend)
    return dx, dgamma, None, None, None, None


_register_autograd(_rmsnorm_op, _rmsnorm_backward, _rmsnorm_setup)


def rmsnorm_mxfp8(x: Tensor, gamma: Tensor, eps: float = 1e-6, zero_centered_gamma: bool = False,
                  elem: str = "e4m3", backend: Optional[str] = None) -> Tuple[TrackedMXTensor, TrackedMXTensor, Tensor]:
    """`dispatch.run("rmsnorm_mxfp8", ...)` returning (y_row, y_col, rstd): y_row / y_col share one fp32
    proxy, whose gradient (dL/dy of the fp32 y, straight through the quantizer) gives dx and dgamma
    through the op `rmsnorm_backward`. rstd has no gradient."""
    _validate("rmsnorm_mxfp8", x, gamma, eps=eps, zero_centered_gamma=zero_centered_gamma, elem=elem,
              backend=backend)
    backend = _trace_choice("rmsnorm_mxfp8", backend, x, gamma, contiguous=(0, 1), eps=float(eps),
                            zero_centered_gamma=bool(zero_centered_gamma), elem=elem)
    proxy, row_codes, row_scales, col_codes, col_scales, rstd = _call(_rmsnorm_op,
        x, gamma, float(eps), bool(zero_centered_gamma), elem, backend)
    return (_tracked(row_codes, row_scales, 1, elem, "compact", proxy),
            _tracked(col_codes, col_scales, 0, elem, "compact", proxy), rstd)


# --------------------------------------------------------------------------------------------------
# mla_attention
# --------------------------------------------------------------------------------------------------

def _lse_shape(q_shape: Sequence[int], layout: str) -> Tuple[int, ...]:
    if layout == "thd":
        return (q_shape[1], q_shape[0])
    if layout == "bshd":
        return (q_shape[0], q_shape[2], q_shape[1])
    return (q_shape[1], q_shape[2], q_shape[0])  # sbhd


@torch.library.custom_op(f"{NAMESPACE}::mla_attention", mutates_args=())
def _attention_op(q: Optional[Tensor], q_codes: Optional[Tensor], q_scales: Optional[Tensor], q_format: str,
                  k: Optional[Tensor], k_codes: Optional[Tensor], k_scales: Optional[Tensor], k_format: str,
                  v: Optional[Tensor], v_codes: Optional[Tensor], v_scales: Optional[Tensor], v_format: str,
                  causal: bool, softmax_scale: Optional[float], layout: str, cu_seqlens_q: Optional[Tensor],
                  cu_seqlens_kv: Optional[Tensor], backend: Optional[str]) -> Tuple[Tensor, Tensor]:
    """(o bf16 shaped like q with head dim 128, lse fp32)."""
    o, lse = _run(
        "mla_attention", _contiguous(_operand(q, q_codes, q_scales, q_format)),
        _contiguous(_operand(k, k_codes, k_scales, k_format)), _contiguous(_operand(v, v_codes, v_scales, v_format)),
        causal=causal, softmax_scale=softmax_scale, layout=layout, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_kv=cu_seqlens_kv, backend=backend)
    return o.contiguous(), lse.contiguous()


@_attention_op.register_fake
def _(q, q_codes, q_scales, q_format, k, k_codes, k_scales, k_format, v, v_codes, v_scales, v_format,
      causal, softmax_scale, layout, cu_seqlens_q, cu_seqlens_kv, backend):
    q_shape = _logical_shape(q, q_codes, q_format)
    device = _device_of(q, q_codes)
    o = torch.empty(q_shape[:-1] + (MLA_V_HEAD_DIM,), dtype=torch.bfloat16, device=device)
    return o, torch.empty(_lse_shape(q_shape, layout), dtype=torch.float32, device=device)


@torch.library.custom_op(f"{NAMESPACE}::mla_attention_backward", mutates_args=())
def _attention_backward_op(do: Tensor, q: Optional[Tensor], q_codes: Optional[Tensor], q_scales: Optional[Tensor],
                           q_format: str, k: Optional[Tensor], k_codes: Optional[Tensor],
                           k_scales: Optional[Tensor], k_format: str, v: Optional[Tensor],
                           v_codes: Optional[Tensor], v_scales: Optional[Tensor], v_format: str, o: Tensor,
                           lse: Tensor, causal: bool, softmax_scale: Optional[float], layout: str,
                           cu_seqlens_q: Optional[Tensor], cu_seqlens_kv: Optional[Tensor],
                           backend: Optional[str]) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) bf16, with respect to the dequantized values of MXFP8 operands."""
    dq, dk, dv = _run(
        "mla_attention_backward", do.contiguous(), _contiguous(_operand(q, q_codes, q_scales, q_format)),
        _contiguous(_operand(k, k_codes, k_scales, k_format)), _contiguous(_operand(v, v_codes, v_scales, v_format)),
        o, lse, causal=causal, softmax_scale=softmax_scale, layout=layout, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_kv=cu_seqlens_kv, backend=backend)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_attention_backward_op.register_fake
def _(do, q, q_codes, q_scales, q_format, k, k_codes, k_scales, k_format, v, v_codes, v_scales, v_format,
      o, lse, causal, softmax_scale, layout, cu_seqlens_q, cu_seqlens_kv, backend):
    return tuple(do.new_empty(shape, dtype=torch.bfloat16) for shape in (
        _logical_shape(q, q_codes, q_format), _logical_shape(k, k_codes, k_format),
        _logical_shape(v, v_codes, v_format)))


def _attention_setup(ctx, inputs, output):
    (q, q_codes, q_scales, q_format, k, k_codes, k_scales, k_format, v, v_codes, v_scales, v_format,
     causal, softmax_scale, layout, cu_seqlens_q, cu_seqlens_kv, backend) = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    # MXFP8 operands: the codes are what the backward reads, so the proxy is not saved (it is None there)
    ctx.save_for_backward(None if q_format else q, q_codes, q_scales, None if k_format else k, k_codes, k_scales,
                          None if v_format else v, v_codes, v_scales, o, lse, cu_seqlens_q, cu_seqlens_kv)
    ctx.formats = (q_format, k_format, v_format)
    ctx.options = (bool(causal), softmax_scale, layout, backend)
    ctx.dtypes = tuple(None if t is None else t.dtype for t in (q, k, v))


def _dequantized_twin(backend: Optional[str], *operands) -> Optional[Tuple[List[Tensor], str]]:
    """While AOTAutograd traces a compiled backward whose resolved attention backward is, on MXFP8 q, k
    and v, its bf16 twin on their exact bf16 dequantizations (`resolution.bf16_twin`; cuDNN's sm90
    route): ([q, k, v] dequantized by mxfp8_dequantize ops of their own, the twin's choice). Inside one
    op the saved codes would stay alive through the whole bf16 backward; as graph nodes of their own,
    the graph frees them at their last use, before the gradients are allocated. None otherwise (eager
    calls, plain operands, any other route, or no dequantize backend for these operands)."""
    if not all(fmt for _, _, fmt in operands):
        return None
    choice = _resolution.bf16_twin("mla_attention_backward", backend)
    if choice is None:
        return None
    mx = [_operand(None, codes, scales, fmt) for codes, scales, fmt in operands]
    try:
        dequantize = [_resolution.resolve("mxfp8_dequantize", t, out_dtype="bfloat16") for t in mx]
    except _dispatch.BackendUnavailable:  # no backend dequantizes these here: keep the one op
        return None
    return ([_dequantize_op(None, codes, scales, fmt, "bfloat16", how)
             for (codes, scales, fmt), how in zip(operands, dequantize)], choice)


def _attention_backward(ctx, do, _lse_grad):
    none = [None] * 18
    if do is None:
        return tuple(none)
    (q, q_codes, q_scales, k, k_codes, k_scales, v, v_codes, v_scales, o, lse, cu_seqlens_q,
     cu_seqlens_kv) = ctx.saved_tensors
    q_format, k_format, v_format = ctx.formats
    causal, softmax_scale, layout, backend = ctx.options
    backend = _backward_choice(backend, "mla_attention_backward", do, _operand(q, q_codes, q_scales, q_format),
                               _operand(k, k_codes, k_scales, k_format), _operand(v, v_codes, v_scales, v_format), o,
                               lse, contiguous=(0, 1, 2, 3), causal=causal, softmax_scale=softmax_scale,
                               layout=layout, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv)
    twin = _dequantized_twin(backend, (q_codes, q_scales, q_format), (k_codes, k_scales, k_format),
                             (v_codes, v_scales, v_format))
    if twin is not None:  # compiled: the same bytes, the saved codes freed before the bf16 backward runs
        (q16, k16, v16), backend = twin
        q_codes = q_scales = k_codes = k_scales = v_codes = v_scales = None
        q_format = k_format = v_format = ""
        q, k, v = q16, k16, v16
    grads = _call(_attention_backward_op, do, q, q_codes, q_scales, q_format, k, k_codes, k_scales, k_format, v, v_codes,
                                   v_scales, v_format, o, lse, causal, softmax_scale, layout, cu_seqlens_q,
                                   cu_seqlens_kv, backend)
    for slot, grad, dtype in zip((0, 4, 8), grads, ctx.dtypes):
        if dtype is not None:
            none[slot] = grad.to(dtype)
    return tuple(none)


_register_autograd(_attention_op, _attention_backward, _attention_setup)


def mla_attention(q, k, v, causal: bool = False, softmax_scale: Optional[float] = None, layout: str = "bshd",
                  cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_kv: Optional[Tensor] = None,
                  backend: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """`dispatch.run("mla_attention", ...)`: (o, lse). q, k, v are tensors or MXTensors (tracked ones
    receive gradients through their proxies). o is differentiable, lse is not."""
    _validate("mla_attention", q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout,
              cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, backend=backend)
    backend = _trace_choice("mla_attention", backend, q, k, v, contiguous=(0, 1, 2), causal=bool(causal),
                            softmax_scale=None if softmax_scale is None else float(softmax_scale), layout=layout,
                            cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv)
    return _call(_attention_op, *_slots(q), *_slots(k), *_slots(v), bool(causal),
                         None if softmax_scale is None else float(softmax_scale), layout, cu_seqlens_q,
                         cu_seqlens_kv, backend)


# --------------------------------------------------------------------------------------------------
# helpers on tracked MXFP8 tensors
# --------------------------------------------------------------------------------------------------

def reshape_mx(t: MXTensor, shape: Sequence[int]) -> MXTensor:
    """A view of t with a new shape that keeps the blocked axis last and its length (e.g. q_row
    [T, H, 192] -> [B, S, H, 192]); codes, compact scales and the proxy are reshaped alike."""
    shape = tuple(int(n) for n in shape)
    if t.axis != t.ndim - 1 or shape[-1] != t.shape[-1] or t.scale_layout != "compact":
        raise ValueError(f"t: reshape_mx keeps the blocked last axis of a compact MXTensor; got axis {t.axis} of "
                         f"shape {t.shape} ({t.scale_layout} scales) -> {shape}")
    scale_shape = shape[:-1] + (shape[-1] // BLOCK_SIZE,)
    return _view_like(t, t.data.reshape(shape), t.scale.reshape(scale_shape), len(shape) - 1,
                      lambda proxy: proxy.reshape(shape))


def _proxy_of(t: MXTensor) -> Optional[Tensor]:
    return t.grad_proxy if isinstance(t, TrackedMXTensor) else None


def _view_like(t: MXTensor, data: Tensor, scale: Tensor, axis: int, proxy_view) -> MXTensor:
    """A compact MXTensor over new views of t's codes and scales; tracked (its proxy through
    proxy_view) when t is."""
    if isinstance(t, TrackedMXTensor):
        proxy = _proxy_of(t)
        return TrackedMXTensor(data, scale, axis, t.elem, "compact", None if proxy is None else proxy_view(proxy))
    return MXTensor(data, scale, axis, t.elem, "compact")


def expand_mx(t: MXTensor, shape: Sequence[int]) -> MXTensor:
    """A broadcast view of t (torch.expand rules) that keeps the blocked axis's length: codes and
    compact scales are expanded alike (no copy), and a tracked t's proxy is expanded, so the gradient of
    the copies sums back into t's."""
    shape = tuple(int(n) for n in shape)
    if t.scale_layout != "compact" or len(shape) != t.ndim or shape[t.axis] != t.shape[t.axis]:
        raise ValueError(f"t: expand_mx broadcasts a compact MXTensor over its other axes, keeping axis {t.axis} "
                         f"of length {t.shape[t.axis]}; got {t.scale_layout} scales of shape {t.shape} -> {shape}")
    scale_shape = shape[:t.axis] + (shape[t.axis] // BLOCK_SIZE,) + shape[t.axis + 1:]
    return _view_like(t, t.data.expand(shape), t.scale.expand(scale_shape), t.axis,
                      lambda proxy: proxy.expand(shape))


class _ProxyCat(torch.autograd.Function):
    """The proxy of a concatenation: a fresh zero-stride proxy (never a materialized zero tensor), whose
    gradient goes back to each input's proxy as its slice."""

    @staticmethod
    def forward(ctx, dim: int, shape: Tuple[int, ...], *proxies):
        ctx.dim, ctx.sizes = dim, [p.shape[dim] for p in proxies]
        return grad_proxy(shape, proxies[0].dtype, proxies[0].device)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, *grad.split(ctx.sizes, dim=ctx.dim))


def _cat_bytes(parts: Sequence[Tensor], dim: int) -> Tensor:
    """torch.cat of uint8 tensors along dim; along the last axis in 4-byte words where every part allows
    it (torch's byte-wise concatenation runs at a fraction of copy bandwidth), else byte-wise."""
    last = dim == parts[0].dim() - 1
    # plain tensors only: a DTensor's dtype view does not rescale its (global) last axis
    if last and all(type(p) is torch.Tensor and p.shape[-1] % 4 == 0 and p.stride(-1) == 1
                    and all(st % 4 == 0 for st in p.stride()[:-1]) and p.data_ptr() % 4 == 0 for p in parts):
        return torch.cat([p.view(torch.int32) for p in parts], dim=dim).view(torch.uint8)
    return torch.cat(list(parts), dim=dim)


def cat_mx(tensors: Sequence[MXTensor], dim: int) -> MXTensor:
    """The MXTensor of torch.cat(dequantized tensors, dim), from the codes and compact scales alone:
    exact, since every MXFP8 block lies inside one input (along the blocked axis each input's length is
    a multiple of 32), so the result is byte-equal to quantizing the concatenated values. Inputs share
    elem and blocked axis; tracked inputs give a tracked result whose gradient is split back to them
    (e.g. k = cat_mx([k_nope, expand_mx(k_pe, ...)], -1): one fp8 copy instead of a bf16 cat and a
    quantize pass over it)."""
    tensors = list(tensors)
    if not tensors or not all(isinstance(t, MXTensor) for t in tensors):
        raise TypeError(f"tensors: expected a non-empty sequence of MXTensors, got "
                        f"{[type(t).__name__ for t in tensors] or 'an empty one'}")
    first = tensors[0]
    nd = first.ndim
    if not isinstance(dim, int) or isinstance(dim, bool) or not -nd <= dim < nd:
        raise ValueError(f"dim: expected an int in [{-nd}, {nd}), got {dim!r}")
    dim %= nd
    for i, t in enumerate(tensors):
        if (t.ndim, t.axis, t.elem, t.scale_layout) != (nd, first.axis, first.elem, "compact"):
            raise ValueError(f"tensors[{i}]: expected compact scales, {nd} dims, blocked axis {first.axis} and "
                             f"elem {first.elem!r} like tensors[0]; got {t.scale_layout} scales, {t.ndim} dims, "
                             f"axis {t.axis}, elem {t.elem!r}")
        other = [n for j, n in enumerate(t.shape) if j != dim]
        if other != [n for j, n in enumerate(first.shape) if j != dim]:
            raise ValueError(f"tensors[{i}]: shape {t.shape} differs from tensors[0] {first.shape} outside dim {dim}")
    data = _cat_bytes([t.data.view(torch.uint8) for t in tensors], dim).view(_FP8[first.elem])
    scale = torch.cat([t.scale for t in tensors], dim=dim)
    given = [_proxy_of(t) for t in tensors]
    like = next((p for p in given if p is not None), None)
    if like is None:
        return MXTensor(data, scale, first.axis, first.elem, "compact")
    proxies = [grad_proxy(t.shape, like.dtype, like.device) if p is None else p for t, p in zip(tensors, given)]
    if len({p.dtype for p in proxies}) != 1:
        raise ValueError(f"tensors: tracked inputs' gradients differ in dtype "
                         f"({sorted({str(p.dtype) for p in proxies})})")
    proxy = _ProxyCat.apply(dim, tuple(data.shape), *proxies)
    return TrackedMXTensor(data, scale, first.axis, first.elem, "compact", proxy)


_NOPE_DIM = MLA_QK_HEAD_DIM - MLA_ROPE_DIM  # 128


def _check_kv(k_nope, k_pe, v, layout, cos=None, sin=None) -> Tuple[int, int]:
    """(sequence axis, head axis) of the mla_kv_mxfp8 operands: torch tensors on one device, and what
    spec.mla_kv's validator checks (also on the compile and subclass paths, which do not reach
    `mla_kv_quantize`); raises naming the argument otherwise."""
    if not isinstance(layout, str) or layout not in MLA_KV_LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(MLA_KV_LAYOUTS)}, got {layout!r}")
    named = [("k_nope", k_nope), ("k_pe", k_pe), ("v", v)]
    named += [(name, t) for name, t in (("cos", cos), ("sin", sin)) if t is not None]
    for name, t in named:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if torch.compiler.is_compiling():
        # spec.rope's validator reads a context variable that dynamo cannot trace; the rope op checks
        # the tables against k_pe when the graph runs, as every wrapper's custom op does
        validate_mla_kv_quantize(k_nope, k_pe, v, layout)
        validate_mla_kv_tables(cos, sin)
    else:
        # through dispatch.validate: cached per call signature, so a repeated forward skips the validators
        _validate("mla_kv_quantize", k_nope, k_pe, v, layout=layout, cos=cos, sin=sin)
    if len({t.device for _, t in named}) != 1:
        raise ValueError(f"{', '.join(name for name, _ in named)}: expected one device, got "
                         f"{', '.join(str(t.device) for _, t in named)}")
    return mla_kv_axes(layout)


def _kv_composed(k_nope, k_pe, v, layout, backend, cos=None, sin=None):
    """mla_kv_mxfp8 from the custom ops (compile tracing, tensor subclasses): k_pe rotated by the rope op
    when tables are given, then k quantized from the concatenation (the same bytes: every block lies
    inside one part)."""
    seq, _ = mla_kv_axes(layout)
    if cos is not None:
        k_pe = rope(k_pe, cos, sin, style="mla", layout=layout, backend=backend)
    k = torch.cat([k_nope, k_pe.expand(tuple(k_nope.shape[:-1]) + (MLA_ROPE_DIM,))], dim=-1)
    return mxfp8_quantize(k, axis=-1, backend=backend), mxfp8_quantize(v, axis=seq, backend=backend)


def _kv_forward(k_nope, k_pe, v, cos, sin, layout, backend):
    """(k codes uint8, k scales, v codes uint8, v scales) of one `mla_kv_quantize` call."""
    kq, vq = _run("mla_kv_quantize", k_nope, k_pe, v, layout=layout, cos=cos, sin=sin, backend=backend)
    return kq.data.view(torch.uint8), kq.scale, vq.data.view(torch.uint8), vq.scale


def _kv_pe_grad(dk, cos, sin, layout, pe_shared, pe_dtype, backend):
    """k_pe's gradient from k's: the composition's -- the slice, the sum over heads that expand's
    backward takes for a shared k_pe (`pe_shared`: k_pe has one head and k_nope more; a flag, not a
    head count, so that it holds on a rank's head shard too, where the sum is that rank's share), the
    cast to k_pe's dtype, and the rope op's own backward when the op rotated k_pe."""
    dk_pe = dk[..., _NOPE_DIM:]
    if pe_shared:
        dk_pe = dk_pe.sum(mla_kv_axes(layout)[1], keepdim=True)
    dk_pe = dk_pe.to(pe_dtype)
    if cos is not None:
        # the rope op's own backward, on the gradient it would receive in the composition
        dk_pe = _run("rope_backward", dk_pe.contiguous(), cos, sin, style="mla", layout=layout,
                     out_dtype=_DTYPE_NAMES[pe_dtype], backend=backend)
    return dk_pe


def _kv_grads(dk, dv, cos, sin, layout, pe_shared, dtypes, backend):
    """(dk_nope, dk_pe, dv) from the gradients of k's and v's proxies (either may be None): k_nope's
    and v's are the slice and casts to the inputs' dtypes (views where no cast is needed), k_pe's
    `_kv_pe_grad`."""
    nope_dtype, pe_dtype, v_dtype = dtypes
    dk_nope = dk_pe = None
    if dk is not None:
        dk_nope = dk[..., :_NOPE_DIM].to(nope_dtype)
        dk_pe = _kv_pe_grad(dk, cos, sin, layout, pe_shared, pe_dtype, backend)
    return dk_nope, dk_pe, None if dv is None else dv.to(v_dtype)


def _kv_pe_shared(k_nope, k_pe, head) -> bool:
    """Whether one k_pe head serves every head of k_nope (its gradient sums over them)."""
    return bool(k_pe.shape[head] != k_nope.shape[head])


def _kv_proxies(k_nope, v, proxy):
    shape = tuple(k_nope.shape[:-1]) + (MLA_QK_HEAD_DIM,)
    return proxy(shape, k_nope.dtype, k_nope.device), proxy(v.shape, v.dtype, v.device)


class _KVQuant(torch.autograd.Function):
    """The eager mla_kv_mxfp8: one `dispatch.run("mla_kv_quantize", ...)` under one graph node (the
    composition's gradients, computed the same way: `_kv_grads`)."""

    @staticmethod
    def forward(ctx, k_nope, k_pe, v, cos, sin, layout, head, backend):
        k_data, k_scale, v_data, v_scale = _kv_forward(k_nope, k_pe, v, cos, sin, layout, backend)
        ctx.mark_non_differentiable(k_data, k_scale, v_data, v_scale)
        ctx.set_materialize_grads(False)
        ctx.pe_shared, ctx.dtypes = _kv_pe_shared(k_nope, k_pe, head), (k_nope.dtype, k_pe.dtype, v.dtype)
        ctx.layout, ctx.backend = layout, backend
        ctx.save_for_backward(cos, sin)
        k_proxy, v_proxy = _kv_proxies(k_nope, v, shared_grad_proxy)
        return k_proxy, k_data, k_scale, v_proxy, v_data, v_scale

    @staticmethod
    def backward(ctx, dk, _k_data, _k_scale, dv, _v_data, _v_scale):
        cos, sin = ctx.saved_tensors
        grads = _kv_grads(dk, dv, cos, sin, ctx.layout, ctx.pe_shared, ctx.dtypes, ctx.backend)
        return (*grads, None, None, None, None, None)


# The same node as custom ops, for torch.compile: the forward one `mla_kv_quantize` and, in the
# backward, one op for k_pe's gradient (`_kv_pe_grad`: the head sum and rope_backward inside it, so a
# compiled backward computes the eager one's bytes: a compiler's reduction could sum the heads in
# another order). k_nope's and v's gradients (a slice and casts) stay in the traced graph: a custom
# op's outputs may not alias its inputs, so returning them from the op cost two copies, and in the
# graph the compiler fuses them into their consumer (e.g. the slice backward of a [.., H, 256] projection).

@torch.library.custom_op(f"{NAMESPACE}::mla_kv_mxfp8", mutates_args=())
def _kv_op(k_nope: Tensor, k_pe: Tensor, v: Tensor, cos: Optional[Tensor], sin: Optional[Tensor], layout: str,
           backend: Optional[str]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(k proxy, k codes uint8 [..., H, 192], k scales, v proxy, v codes uint8, v scales)."""
    k_data, k_scale, v_data, v_scale = _kv_forward(k_nope, k_pe, v, cos, sin, layout, backend)
    k_proxy, v_proxy = _kv_proxies(k_nope, v, grad_proxy)
    return k_proxy, k_data.contiguous(), k_scale.contiguous(), v_proxy, v_data.contiguous(), v_scale.contiguous()


@_kv_op.register_fake
def _(k_nope, k_pe, v, cos, sin, layout, backend):
    k_proxy, v_proxy = _kv_proxies(k_nope, v, grad_proxy)
    k_shape, v_shape = tuple(k_proxy.shape), tuple(v.shape)
    seq = mla_kv_axes(layout)[0]
    return (k_proxy, k_nope.new_empty(k_shape, dtype=torch.uint8),
            k_nope.new_empty(_scale_shape(k_shape, len(k_shape) - 1, "compact"), dtype=torch.uint8),
            v_proxy, v.new_empty(v_shape, dtype=torch.uint8),
            v.new_empty(_scale_shape(v_shape, seq, "compact"), dtype=torch.uint8))


@torch.library.custom_op(f"{NAMESPACE}::mla_kv_mxfp8_pe_backward", mutates_args=())
def _kv_backward_op(dk: Tensor, cos: Optional[Tensor], sin: Optional[Tensor], layout: str, pe_shared: bool,
                    pe_dtype: str, backend: Optional[str]) -> Tensor:
    """dk_pe, k_pe's gradient from k's (`_kv_pe_grad`)."""
    g = _kv_pe_grad(dk, cos, sin, layout, pe_shared, _TORCH_DTYPES[pe_dtype], backend)
    # a custom op's output may not alias its inputs (an unsummed, unrotated slice of dk in its own dtype)
    return g.clone() if g.untyped_storage().data_ptr() == dk.untyped_storage().data_ptr() else g.contiguous()


@_kv_backward_op.register_fake
def _(dk, cos, sin, layout, pe_shared, pe_dtype, backend):
    lead = list(dk.shape[:-1])
    if pe_shared:
        lead[mla_kv_axes(layout)[1]] = 1
    return dk.new_empty(tuple(lead) + (MLA_ROPE_DIM,), dtype=_TORCH_DTYPES[pe_dtype])


def _kv_setup(ctx, inputs, output):
    k_nope, k_pe, v, cos, sin, layout, backend = inputs
    ctx.mark_non_differentiable(*(output[i] for i in (1, 2, 4, 5)))
    ctx.set_materialize_grads(False)
    head = mla_kv_axes(layout)[1]
    ctx.save_for_backward(cos, sin)
    ctx.options = (layout, _kv_pe_shared(k_nope, k_pe, head), _DTYPE_NAMES[k_nope.dtype], _DTYPE_NAMES[k_pe.dtype],
                   _DTYPE_NAMES[v.dtype], backend)
    ctx.pe_shape = tuple(k_pe.shape)


def _kv_backward(ctx, dk, _k_data, _k_scale, dv, _v_data, _v_scale):
    if dk is None and dv is None:
        return (None,) * 7
    cos, sin = ctx.saved_tensors
    layout, pe_shared, nope_dtype, pe_dtype, v_dtype, backend = ctx.options
    dk_nope = dk_pe = None
    if dk is not None:
        if cos is not None:
            pe = _resolution.stand_in(ctx.pe_shape, _TORCH_DTYPES[pe_dtype], dk.device)
            backend = _backward_choice(backend, "rope_backward", pe, cos, sin, style="mla", layout=layout,
                                       out_dtype=pe_dtype)
        dk_nope = dk[..., :_NOPE_DIM].to(_TORCH_DTYPES[nope_dtype])
        dk_pe = _call(_kv_backward_op, dk, cos, sin, layout, pe_shared, pe_dtype, backend)
    return dk_nope, dk_pe, None if dv is None else dv.to(_TORCH_DTYPES[v_dtype]), None, None, None, None


_register_autograd(_kv_op, _kv_backward, _kv_setup)


def _kv_compiled(k_nope, k_pe, v, layout, backend, cos=None, sin=None):
    """mla_kv_mxfp8 while torch.compile traces plain tensors: the two custom ops above, the backend
    resolved now (dispatch.resolution)."""
    backend = _resolution.resolve("mla_kv_quantize", k_nope, k_pe, v, layout=layout, cos=cos, sin=sin,
                                  backend=backend)
    k_proxy, k_data, k_scale, v_proxy, v_data, v_scale = _kv_op(k_nope, k_pe, v, cos, sin, layout, backend)
    return k_proxy, k_data, k_scale, v_proxy, v_data, v_scale


def mla_kv_mxfp8(k_nope: Tensor, k_pe: Tensor, v: Tensor, layout: str = "bshd", cos: Optional[Tensor] = None,
                 sin: Optional[Tensor] = None, backend: Optional[str] = None) -> Tuple[MXTensor, MXTensor]:
    """MLA's key and value as attention's MXFP8 operands, tracked: k = [k_nope | k_pe] [..., H, 192]
    blocked along D, where k_pe is [..., 1, 64] shared by every head or [..., H, 64]; v [..., H, 128]
    blocked along the sequence axis (bshd: 1, sbhd / thd: 0). e4m3, rceil, saturate, compact scales:
    byte-equal to `mxfp8_quantize` of the concatenation and of v, with gradients straight through to
    k_nope, k_pe (summed over the heads it is shared by) and v, as the composition's. k_pe is taken with
    RoPE applied, or with `cos` / `sin` ([max_positions, 64] tables) it is rotated here first, as
    `rope(k_pe, cos, sin, style="mla", layout=layout)` would (each row at its sequence index; in thd
    the whole T is one sequence): the same bytes and gradients as that rope followed by this call
    without tables, k_pe's gradient going through `rope_backward`; the tables get none. k_nope and v
    may be strided slices of one [..., H, 256] projection (read in place where the backend can). A
    plain eager call is one graph node around one `mla_kv_quantize` op (on the Triton backend one
    kernel launch writing k's and v's codes and scales, k_pe rotated in it; no bf16 concatenation is
    written); under torch.compile plain tensors take the same op as the custom op `mxmla::mla_kv_mxfp8`
    (backward: k_pe's gradient in `mxmla::mla_kv_mxfp8_pe_backward`), its backend resolved at trace time;
    tensor subclasses (DTensor) take the composition of the custom ops (rope, then quantize of the concatenation and of
    v: the same bytes)."""
    seq, head = _check_kv(k_nope, k_pe, v, layout, cos, sin)
    tensors = (k_nope, k_pe, v, cos, sin)
    if plain_eager(tensors):
        outs = _KVQuant.apply(k_nope, k_pe, v, cos, sin, layout, head, backend)
    elif plain_classes(tensors):
        outs = _kv_compiled(k_nope, k_pe, v, layout, backend, cos, sin)
    else:
        return _kv_composed(k_nope, k_pe, v, layout, backend, cos, sin)
    k_proxy, k_data, k_scale, v_proxy, v_data, v_scale = outs
    return (TrackedMXTensor(k_data.view(torch.float8_e4m3fn), k_scale, k_data.dim() - 1, "e4m3", "compact", k_proxy),
            TrackedMXTensor(v_data.view(torch.float8_e4m3fn), v_scale, seq, "e4m3", "compact", v_proxy))


OPS = {
    "mxfp8_quantize": _quantize_op,
    "mxfp8_dequantize": _dequantize_op,
    "rope": _rope_op,
    "rope_backward": _rope_backward_op,
    "mla_kv_mxfp8": _kv_op,
    "mla_kv_mxfp8_pe_backward": _kv_backward_op,
    "mla_q_uproj_rope_quant": _mla_q_op,
    "mla_q_uproj_rope_quant_backward": _mla_q_backward_op,
    "rmsnorm_mxfp8": _rmsnorm_op,
    "rmsnorm_backward": _rmsnorm_backward_op,
    "mla_attention": _attention_op,
    "mla_attention_backward": _attention_backward_op,
}
