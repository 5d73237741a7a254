"""A hashable call signature: what a capability check may depend on (dtype, shape, strides, device,
whether the data pointer is 16-byte aligned (TMA kernel variants need it), MXFP8 state, scalar
keyword values), and nothing that needs the data itself.

Scalars enter with their type: True == 1 == 1.0 in Python (equal hashes too), so without the type a
call with eps=True would find the entry cached by eps=1.0 and skip the validation that rejects it.

This runs on every dispatched call, so the common case (torch tensors, scalars) is a short path.
"""
from __future__ import annotations

from typing import Any

from spec.mxtensor import MXTensor

try:
    import torch

    _Tensor = torch.Tensor
except ImportError:  # pragma: no cover
    _Tensor = ()

_SCALARS = (int, float, str, bool, type(None))


def _value_sig(v: Any):
    if isinstance(v, _Tensor):
        return (v.dtype, v.shape, v.stride(), v.device, v.data_ptr() % 16)
    if type(v) in _SCALARS:
        return (type(v), v)
    if isinstance(v, MXTensor):
        return ("mx", v.axis, v.elem, v.scale_layout, _value_sig(v.data), _value_sig(v.scale))
    if hasattr(v, "shape") and hasattr(v, "dtype"):  # NumPy
        return ("np", str(v.dtype), tuple(v.shape))
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(_value_sig(x) for x in v))
    try:
        hash(v)
        return (type(v), v)
    except TypeError:
        return ("unhashable", type(v).__name__, id(v))


def call_signature(args: tuple, kwargs: dict):
    # Written out as loops with the tensor case inlined: this runs on every call and function calls
    # per argument cost more than the work. Keyword order is kept (not sorted): one call site always
    # passes the same order, and a different order only costs one more cache entry.
    sig = []
    for v in args:
        if isinstance(v, _Tensor):
            sig.append((v.dtype, v.shape, v.stride(), v.device, v.data_ptr() % 16))
        else:
            sig.append(_value_sig(v))
    for k, v in kwargs.items():
        if type(v) in _SCALARS:
            sig.append((k, type(v), v))
        elif isinstance(v, _Tensor):
            sig.append((k, v.dtype, v.shape, v.stride(), v.device, v.data_ptr() % 16))
        else:
            sig.append((k, _value_sig(v)))
    return tuple(sig)
