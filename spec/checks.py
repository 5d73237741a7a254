"""Array-agnostic argument checks shared by every op's validator.

They read only `.shape` and `.dtype`, so the same checks run on NumPy arrays and torch tensors and
every backend raises the same message. Each message names the argument and what was expected.
"""
from __future__ import annotations

import contextlib
import contextvars
import numbers
from typing import Any, Iterable, Sequence

from .constants import BLOCK_SIZE


def dtype_name(x: Any) -> str:
    """'float32', 'bfloat16', 'float8_e4m3fn', 'uint8', ... for NumPy/ml_dtypes and torch alike."""
    name = str(getattr(x, "dtype", type(x).__name__))
    return name.replace("torch.", "")


def is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def require_array(name: str, x: Any) -> None:
    if not is_array(x):
        raise TypeError(f"{name}: expected a NumPy array or torch tensor, got {type(x).__name__}")


def require_choice(name: str, value: Any, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {tuple(choices)}, got {value!r}")


def require_dtype(name: str, x: Any, allowed: Iterable[str]) -> None:
    require_array(name, x)
    allowed = tuple(allowed)
    if dtype_name(x) not in allowed:
        raise TypeError(f"{name}: expected dtype in {allowed}, got {dtype_name(x)}")


def require_ndim(name: str, x: Any, ndims: Iterable[int]) -> None:
    require_array(name, x)
    ndims = tuple(ndims)
    if len(x.shape) not in ndims:
        raise ValueError(
            f"{name}: expected {' or '.join(str(n) for n in ndims)} dimensions, got shape {tuple(x.shape)}"
        )


def require_dim(name: str, x: Any, dim: int, expected: int, what: str = "") -> None:
    n = x.shape[dim]
    if n != expected:
        label = f" ({what})" if what else ""
        raise ValueError(f"{name}: expected size {expected} at dim {dim}{label}, got shape {tuple(x.shape)}")


def require_multiple(name: str, length: int, multiple: int, what: str) -> None:
    if length % multiple:
        raise ValueError(f"{name}: {what} has length {length}, expected a multiple of {multiple}")


def require_bool(name: str, value: Any) -> None:
    """A bool (Python or NumPy); 0 / 1 and other truthy objects are refused, not coerced."""
    if type(value).__name__ not in ("bool", "bool_"):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")


def require_real(name: str, value: Any) -> None:
    """An int or float (Python or NumPy), never a bool (True would silently read as 1.0) or a string."""
    if type(value).__name__ in ("bool", "bool_") or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__} {value!r}")


def normalize_axis(name: str, axis: Any, ndim: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"{name}: expected an int axis, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}: axis {axis} out of range for {ndim} dimensions")
    return axis % ndim


def require_blocked_axis(name: str, x: Any, axis: int) -> None:
    require_multiple(name, x.shape[axis], BLOCK_SIZE, f"blocked axis {axis} (shape {tuple(x.shape)})")


def require_same_shape(name_a: str, a: Any, name_b: str, b: Any) -> None:
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"{name_a} and {name_b}: expected equal shapes, got {tuple(a.shape)} and {tuple(b.shape)}")


# Value checks (cu_seqlens monotone, positions inside the table) read the data. The spec always runs
# them; the dispatcher validates once per call signature (shapes, dtypes, choices) inside
# `shape_checks_only()`, because reading a CUDA index tensor would synchronise the device on every call.
_value_checks = contextvars.ContextVar("mxmla_value_checks", default=True)


def value_checks_enabled() -> bool:
    return _value_checks.get()


@contextlib.contextmanager
def shape_checks_only():
    token = _value_checks.set(False)
    try:
        yield
    finally:
        _value_checks.reset(token)
