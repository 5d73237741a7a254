"""Backend choices made once, when torch.compile traces, and run without `dispatch.run`.

    choice = resolve("mla_attention", q, k, v, causal=True, backend=None)    # "=triton" / "=triton:pointer"
    o, lse = run("mla_attention", q, k, v, causal=True, backend=choice)      # the chosen function, called directly

`dispatch.run` chooses a backend (and kernel variant) per call: a cache lookup keyed on the call's
signature, index-value checks, then the call. That Python runs on every call, also inside a compiled
graph's custom ops. Under torch.compile the dispatch.autograd wrappers instead resolve the choice while
dynamo traces (`resolve`): the call's shapes, strides, dtypes and devices are compile-time constants
there, so the choice -- everything `dispatch.select` reads -- is one too. It travels into the custom op as
its `backend` string, marked resolved by a leading "=", and the op calls the chosen implementation
directly (`run`). A compiled step then runs no selection Python: no `dispatch.run`, no signature, no
validation (spec's validators ran on the traced shapes when the choice was made).

What a resolved choice fixes at trace time, and so for the life of the compiled graph (dynamo's guards
on shapes, dtypes and devices recompile it when those change):
- the sizes: a size torch.compile marked dynamic is specialized where a choice reads it (a capability
  can depend on it), so each new shape of a resolved op compiles once;
- the MXMLA_BACKEND value and `backend=` argument of the trace; a later change of MXMLA_BACKEND
  takes effect on the next trace (`torch._dynamo.reset()`), not on the running graph;
- data-pointer alignment: traced tensors have no address, so the choice assumes 16-byte-aligned data
  (what every fresh allocation and every compiled graph's buffers have). A variant that needs it and is
  handed a misaligned view by the caller raises in its launcher instead of being passed over;
- index values (cu_seqlens, positions) are not checked per call (the eager rule: CPU index tensors
  are; CUDA ones only with MXMLA_CHECK_VALUES=1).

The choice is made by `dispatch.select` on stand-ins: tensors with the traced tensors' shape, strides,
dtype and device but no storage (`_StandIn`; a capability check that reads data raises, and the
registry counts that as a reason, never as a pass). dynamo calls the chooser at trace time as a
constant function (`torch.compiler.assume_constant_result`) on a description of the arguments; the
autograd rules (traced by AOTAutograd, not dynamo) call it directly on the fake tensors' metadata.
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Tuple

import torch
from torch.fx.experimental.symbolic_shapes import guard_scalar

import dispatch as _dispatch
import backends as _backends
from backends import registry as _registry
from spec.mxtensor import MXTensor

__all__ = ["RESOLVED", "resolve", "resolve_described", "resolve_parts", "describe", "mx_description", "stand_in",
           "is_resolved", "request_of", "run", "bf16_twin"]

RESOLVED = "="  # leading mark of a backend string that names a resolved choice: "=choice;request"


def is_resolved(backend: Any) -> bool:
    return isinstance(backend, str) and backend.startswith(RESOLVED)


def request_of(backend: Optional[str]) -> Optional[str]:
    """The caller's `backend=` request a resolved string was made from (None: automatic / MXMLA_BACKEND);
    an unresolved string is its own request. Other ops of the same call (a backward, an operand's
    quantization) are resolved from it."""
    if not is_resolved(backend):
        return backend
    return backend.partition(";")[2] or None


class _StandIn(torch.Tensor):
    """A tensor of a traced tensor's metadata without storage, for capability checks: shape, strides,
    dtype, device; data_ptr() 0 (aligned); any op on it raises."""

    @staticmethod
    def __new__(cls, shape, stride, dtype, device):
        return torch.Tensor._make_wrapper_subclass(cls, shape, strides=stride, dtype=dtype, device=device)

    def data_ptr(self) -> int:
        return 0

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"a stand-in for backend selection holds no data ({func})")


def _concrete(n) -> int:
    """A size as a Python int. A symbolic size (torch.compile's dynamic shapes) is specialized: the
    trace guards on its value, so the choice is made per concrete shape (a capability can depend on a
    size, e.g. S divisible by 32) and stays valid for the graph, and the description stays a constant."""
    return int(guard_scalar(n))  # an int as it is (under dynamo, isinstance(n, torch.SymInt) is False)


def _contiguous_strides(shape) -> Tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(stride))


def describe(v: Any, contiguous: bool = False) -> Any:
    """A hashable description of an argument: tensors by (shape, strides, dtype, device) -- with
    contiguous strides when `contiguous` (what `.contiguous()` would hand the op) --, MXTensors by
    their parts, sequences element-wise, anything else as it is. Plain Python on metadata: dynamo
    traces it without a graph break."""
    if isinstance(v, torch.Tensor):
        shape = tuple(_concrete(n) for n in v.shape)
        stride = _contiguous_strides(shape) if contiguous else tuple(_concrete(n) for n in v.stride())
        return ("tensor", shape, stride, v.dtype, v.device)
    if isinstance(v, MXTensor):
        return ("mx", describe(v.data), describe(v.scale), v.axis, v.elem, v.scale_layout)
    if isinstance(v, (tuple, list)):
        return ("seq", type(v) is list, tuple(describe(x) for x in v))
    return ("value", v)


def mx_description(shape, axis: int, device, elem: str = "e4m3") -> Tuple:
    """The description (`describe`) of a contiguous compact MXTensor of `shape` blocked along `axis`
    that an op will make inside itself (e.g. RMSNorm's output handed to the fused projection)."""
    shape = tuple(int(n) for n in shape)
    scale = list(shape)
    scale[axis] //= 32
    codes = ("tensor", shape, _contiguous_strides(shape), torch.float8_e4m3fn if elem == "e4m3" else torch.float8_e5m2,
             device)
    return ("mx", codes, ("tensor", tuple(scale), _contiguous_strides(scale), torch.uint8, device), axis, elem,
            "compact")


def stand_in(shape, dtype: torch.dtype, device, stride=None) -> _StandIn:
    """A stand-in of a tensor of `shape`, `dtype`, `device` (contiguous unless `stride` is given;
    metadata only): for an autograd rule that resolves its backward op on what that op's custom op will
    pass on."""
    shape = tuple(int(n) for n in shape)
    stride = _contiguous_strides(shape) if stride is None else tuple(int(n) for n in stride)
    return _StandIn(shape, stride, dtype, torch.device(device))


def _rebuild(d: Any) -> Any:
    kind = d[0]
    if kind == "tensor":
        return _StandIn(*d[1:])
    if kind == "mx":
        return MXTensor(_rebuild(d[1]), _rebuild(d[2]), d[3], d[4], d[5])
    if kind == "seq":
        items = [_rebuild(x) for x in d[2]]
        return items if d[1] else tuple(items)
    return d[1]


@functools.lru_cache(maxsize=4096)
def _choose(op: str, backend: Optional[str], args: Tuple, kwargs: Tuple, env: Any) -> str:
    del env  # a cache key only: the selection reads MXMLA_BACKEND itself
    # dispatch.select without its index-value checks (they read data; a stand-in has none)
    _, impl, variant, _ = _dispatch._select(op, backend, tuple(_rebuild(a) for a in args),
                                            {k: _rebuild(v) for k, v in kwargs})
    return f"{RESOLVED}{impl.backend}{':' + variant if variant else ''};{backend or ''}"


def _constant_to_dynamo(fn):
    """`torch.compiler.assume_constant_result(fn)` without importing dynamo when this module is imported
    (most of a second on a 2-core CPU, which an eager process never needs): that decorator sets only this
    mark, which dynamo reads when it traces a call (tests/test_compile.py checks that the two agree)."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_to_dynamo
def resolve_described(op: str, backend: Optional[str], args: Tuple, kwargs: Tuple) -> str:
    """The resolved choice for described arguments (`describe`): a constant to dynamo, cached per
    description and MXMLA_BACKEND value."""
    return _choose(op, backend, args, kwargs, _dispatch._env_raw() if backend is None else None)


def _describe_keyword(name: str, v: Any) -> Any:
    """describe(v), except packed sequences' offsets (cu_seqlens*): their length, the number of
    sequences, is data (a dynamic or data-dependent size under torch.compile, which no constant
    describes) and no selection depends on it, so they are described as the offsets of one sequence."""
    if name.startswith("cu_seqlens") and isinstance(v, torch.Tensor):
        return ("tensor", (2,), (1,), v.dtype, v.device)
    return describe(v)


def resolve(op: str, *args, backend: Optional[str] = None, contiguous: Tuple[int, ...] = (), **kwargs) -> str:
    """The choice `dispatch.run(op, *args, backend=backend, **kwargs)` would make, resolved: "=" +
    `dispatch.select`'s answer + ";" + the request. A resolved `backend` (another op's) stands for its
    request. `contiguous`: positions of tensor arguments the op hands on as `.contiguous()`. Raises what
    dispatch.run would (spec's validators on the shapes, BackendUnavailable)."""
    return resolve_described(op, request_of(backend), tuple(describe(a, i in contiguous) for i, a in enumerate(args)),
                             tuple((k, _describe_keyword(k, v)) for k, v in kwargs.items()))


def resolve_parts(op: str, backend: Optional[str], args: Tuple, **kwargs) -> str:
    """`resolve` on positional arguments given as descriptions (`describe`, `mx_description`)."""
    return resolve_described(op, request_of(backend), tuple(args),
                             tuple((k, _describe_keyword(k, v)) for k, v in kwargs.items()))


@functools.lru_cache(maxsize=256)
def _function(op: str, choice: str):
    name, _, variant = choice[len(RESOLVED):].partition(";")[0].partition(":")
    _backends.load()
    impl = _backends.implementations(op).get(name)
    if impl is None:
        raise _dispatch.DispatchConfigError(f"backend: {choice!r} names no implementation of {op}")
    return functools.partial(impl.fn, variant=variant) if variant else impl.fn


def run(op: str, *args, backend: Optional[str] = None, **kwargs):
    """`dispatch.run`, or for a resolved `backend` the chosen implementation called directly."""
    if is_resolved(backend):
        return _function(op, backend)(*args, **kwargs)
    return _dispatch.run(op, *args, backend=backend, **kwargs)


def bf16_twin(op: str, choice: Optional[str]) -> Optional[str]:
    """For a resolved choice of `op` on MXFP8 operands whose variant declares a bf16 twin (backends'
    `register_variant(..., bf16_twin=)`): the resolved choice of that twin, which on the operands' exact
    bf16 dequantizations computes the same bytes. None otherwise."""
    if not is_resolved(choice):
        return None
    name, _, variant = choice[len(RESOLVED):].partition(";")[0].partition(":")
    found = [v for v in _registry.variants(op, name) if v.name == variant and v.bf16_twin]
    return f"{RESOLVED}{name}:{found[0].bf16_twin};{choice.partition(';')[2]}" if found else None
