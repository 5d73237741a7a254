"""Exact conversions between torch tensors and NumPy/ml_dtypes arrays (bit patterns preserved)."""
from __future__ import annotations

from typing import Any

import numpy as np

from spec.lazy_ml_dtypes import ml_dtypes
from spec.mxtensor import MXTensor

try:
    import torch
except ImportError:  # the spec backend still serves NumPy callers
    torch = None

# torch dtype -> (torch dtype of the same width, ml_dtypes name) for the types NumPy lacks
_TORCH_TO_NUMPY_BITS = {}
if torch is not None:
    _TORCH_TO_NUMPY_BITS = {
        torch.bfloat16: (torch.int16, "bfloat16"),
        torch.float8_e4m3fn: (torch.uint8, "float8_e4m3fn"),
        torch.float8_e5m2: (torch.uint8, "float8_e5m2"),
    }
_NUMPY_TO_TORCH = {
    "bfloat16": ("int16", "bfloat16"),
    "float8_e4m3fn": ("uint8", "float8_e4m3fn"),
    "float8_e5m2": ("uint8", "float8_e5m2"),
}


def is_torch(x: Any) -> bool:
    return torch is not None and isinstance(x, torch.Tensor)


def to_numpy(x: Any) -> Any:
    """torch tensor -> NumPy array with identical bytes; MXTensor maps its arrays; others unchanged."""
    if isinstance(x, MXTensor):
        return x.replace(data=to_numpy(x.data), scale=to_numpy(x.scale))
    if isinstance(x, (tuple, list)):
        return type(x)(to_numpy(v) for v in x)
    if not is_torch(x):
        return x
    t = x.detach().cpu().contiguous()
    if t.dtype in _TORCH_TO_NUMPY_BITS:
        bits, np_name = _TORCH_TO_NUMPY_BITS[t.dtype]
        return t.view(bits).numpy().view(getattr(ml_dtypes, np_name))
    return t.numpy()


def to_torch(x: Any, device: Any = "cpu") -> Any:
    """NumPy array -> torch tensor on `device` with identical bytes; MXTensor and tuples map through."""
    if isinstance(x, MXTensor):
        return x.replace(data=to_torch(x.data, device), scale=to_torch(x.scale, device))
    if isinstance(x, (tuple, list)):
        return type(x)(to_torch(v, device) for v in x)
    if not isinstance(x, np.ndarray):
        return x
    name = str(x.dtype)
    if name in _NUMPY_TO_TORCH:
        bits, tname = _NUMPY_TO_TORCH[name]
        t = torch.from_numpy(np.ascontiguousarray(x).view(bits)).view(getattr(torch, tname))
    else:
        t = torch.from_numpy(np.ascontiguousarray(x))
    return t.to(device)


def device_of(*args: Any, **kwargs: Any):
    """The torch device of the first tensor among the arguments (MXTensors included), or None."""
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, MXTensor):
            v = v.data
        if isinstance(v, (tuple, list)):
            d = device_of(*v)
            if d is not None:
                return d
        if is_torch(v):
            return v.device
    return None
