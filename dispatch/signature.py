"""A hashable call signature: what a capability check may depend on (dtype, shape, strides, device,
MXFP8 state, scalar keyword values), and nothing that needs the data itself."""
from __future__ import annotations

from typing import Any

from spec.mxtensor import MXTensor

try:
    import torch

    _Tensor = torch.Tensor
except ImportError:  # pragma: no cover
    _Tensor = ()


def _value_sig(v: Any):
    if isinstance(v, _Tensor):
        return (v.dtype, v.shape, v.stride(), v.device)
    if isinstance(v, MXTensor):
        return ("mx", v.axis, v.elem, v.scale_layout, _value_sig(v.data), _value_sig(v.scale))
    if hasattr(v, "shape") and hasattr(v, "dtype"):  # NumPy
        return ("np", str(v.dtype), tuple(v.shape))
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(_value_sig(x) for x in v))
    try:
        hash(v)
        return v
    except TypeError:
        return ("unhashable", type(v).__name__, id(v))


def call_signature(args: tuple, kwargs: dict):
    return (
        tuple(_value_sig(a) for a in args),
        tuple(sorted((k, _value_sig(v)) for k, v in kwargs.items())) if kwargs else (),
    )
