"""Capability checks and helpers shared by the Triton kernels."""
from __future__ import annotations

import os
from typing import Any, List, Optional, Tuple

import torch

from spec.mxtensor import MXTensor


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def env_flag(name: str, default: bool) -> bool:
    """A 0 / 1 switch from the environment (unset or empty: `default`). Any other value raises, naming
    the variable: a typo such as `true` is never read as "off"."""
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"environment variable {name}={value!r}: expected 0 or 1")
    return value == "1"


def env_choice(name: str, choices: Tuple[str, ...], default: str) -> str:
    """One of `choices` from the environment (unset or empty: `default`); anything else raises."""
    value = os.environ.get(name, "") or default
    if value not in choices:
        raise ValueError(f"environment variable {name}={value!r}: expected one of {', '.join(choices)}")
    return value


def _tensors(args, kwargs):
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, MXTensor):
            yield v.data
            yield v.scale
        elif isinstance(v, torch.Tensor):
            yield v


def triton_reasons(*args: Any, min_capability: Optional[Tuple[int, int]] = None, **kwargs: Any) -> List[str]:
    """Device reasons common to every Triton kernel: torch tensors, on CUDA (or CPU when interpreting),
    and at least `min_capability` on CUDA."""
    reasons = []
    for i, v in enumerate(list(args) + list(kwargs.values())):
        arr = v.data if isinstance(v, MXTensor) else v
        if hasattr(arr, "shape") and hasattr(arr, "dtype") and not isinstance(arr, torch.Tensor):
            reasons.append(f"argument {i} is a {type(arr).__name__}, the triton backend takes torch tensors")
    devices = {t.device for t in _tensors(args, kwargs)}
    for dev in devices:
        if dev.type == "cuda":
            if interpret_mode():
                reasons.append("TRITON_INTERPRET=1 is set: kernels run on the CPU, inputs are on CUDA")
            elif min_capability is not None:
                cc = torch.cuda.get_device_capability(dev)
                if cc < min_capability:
                    reasons.append(f"needs compute capability >= {min_capability[0]}.{min_capability[1]}, "
                                   f"{dev} is {cc[0]}.{cc[1]}")
        elif dev.type == "cpu":
            if not interpret_mode():
                reasons.append("inputs are on the CPU: triton needs CUDA (or TRITON_INTERPRET=1 for testing)")
        else:
            reasons.append(f"unsupported device {dev}")
    return reasons
