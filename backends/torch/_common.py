"""Helpers shared by the torch backend's ops."""
from __future__ import annotations

from typing import Any, List

import torch

from spec.mxtensor import MXTensor

TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
ELEM_TORCH_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def torch_tensor_reasons(*args: Any, **kwargs: Any) -> List[str]:
    """The torch backend serves torch tensors only: NumPy callers must name backend='spec'."""
    reasons = []
    for i, v in enumerate(list(args) + list(kwargs.values())):
        arr = v.data if isinstance(v, MXTensor) else v
        if hasattr(arr, "shape") and hasattr(arr, "dtype") and not isinstance(arr, torch.Tensor):
            reasons.append(f"argument {i} is a {type(arr).__name__}, the torch backend takes torch tensors")
    return reasons
