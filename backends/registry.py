"""The op registry: backends declare (op, implementation, capability check); the dispatcher reads it.

A capability check takes the op's call arguments and returns a list of reasons the backend cannot
serve that call (wrong device, arch, dtype, shape limit, missing package). Empty means it can.

Kernel variants: an implementation may run one of several kernels for the same op (the Triton fused
mla_q forward: Gluon warp-specialized, TMA, pointer, ...). Each registers with `register_variant(op,
backend, name, priority, check)`: its own capability check (reasons, as above) and a priority. The
dispatcher picks the highest-priority variant whose check is empty, or the one the caller names
(MXMLA_BACKEND `op=backend:variant`, or `variant=`), and calls the implementation with
`variant=<name>`; a named variant that cannot serve raises with its reasons, never a downgrade.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from spec.constants import OPS

Check = Callable[..., List[str]]


def _check_reasons(check: Optional[Check], args, kwargs) -> List[str]:
    """check(*args, **kwargs) as a list; a check that raises is a reason (a broken check must never hide
    as "available")."""
    if check is None:
        return []
    try:
        return list(check(*args, **kwargs))
    except Exception as exc:
        return [f"capability check raised {type(exc).__name__}: {exc}"]


@dataclass(frozen=True)
class Implementation:
    op: str
    backend: str
    fn: Callable[..., Any]
    check: Optional[Check] = None

    def reasons(self, *args, **kwargs) -> List[str]:
        """Why this implementation cannot serve the call; [] when it can."""
        return _check_reasons(self.check, args, kwargs)


@dataclass(frozen=True)
class Variant:
    op: str
    backend: str
    name: str
    priority: int  # higher first when nothing is named
    check: Optional[Check] = None
    doc: str = ""
    bf16_twin: str = ""
    """For MXFP8 operands: the variant of the same backend and op that this one equals on the operands'
    exact bf16 dequantizations (spec's mxfp8_dequantize to bfloat16), or "" (it is no such composition).
    A compiled graph may then run the dequantizations as ops of their own and free the codes sooner."""

    def reasons(self, *args, **kwargs) -> List[str]:
        """Why this variant cannot serve the call; [] when it can."""
        return _check_reasons(self.check, args, kwargs)


@dataclass
class BackendInfo:
    name: str
    available: bool
    version: str = ""
    reasons: List[str] = field(default_factory=list)


_lock = threading.RLock()
_impls: Dict[str, Dict[str, Implementation]] = {op: {} for op in OPS}
_backends: Dict[str, BackendInfo] = {}
_variants: Dict[str, Dict[str, Dict[str, Variant]]] = {op: {} for op in OPS}  # op -> backend -> name


def register(op: str, backend: str, check: Optional[Check] = None):
    """Decorator: register `fn` as `backend`'s implementation of `op`."""
    if op not in _impls:
        raise ValueError(f"register: unknown op {op!r}; valid ops: {', '.join(OPS)}")

    def deco(fn):
        with _lock:
            _impls[op][backend] = Implementation(op, backend, fn, check)
            _backends.setdefault(backend, BackendInfo(backend, True))
        return fn

    return deco


def register_variant(op: str, backend: str, name: str, priority: int, check: Optional[Check] = None,
                     doc: str = "", bf16_twin: str = "") -> Variant:
    """Declare kernel variant `name` of `backend`'s `op` (see the module docstring)."""
    if op not in _variants:
        raise ValueError(f"register_variant: unknown op {op!r}; valid ops: {', '.join(OPS)}")
    if not name or not all(c.isalnum() or c == "_" for c in name):
        raise ValueError(f"register_variant: name must be letters, digits and '_', got {name!r}")
    variant = Variant(op, backend, name, int(priority), check, doc, bf16_twin)
    with _lock:
        _variants[op].setdefault(backend, {})[name] = variant
    return variant


def variants(op: str, backend: str) -> List[Variant]:
    """`backend`'s variants of `op`, highest priority first (empty: the backend has one kernel)."""
    with _lock:
        found = list(_variants[op].get(backend, {}).values())
    return sorted(found, key=lambda v: -v.priority)


def declare_backend(name: str, available: bool, version: str = "", reasons: Optional[List[str]] = None):
    """Record a backend's import-time availability (a backend whose package is missing still shows)."""
    with _lock:
        _backends[name] = BackendInfo(name, available, version, list(reasons or []))


def wrap_backend(backend: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace every registered function of `backend` by `wrapper(fn)` (its checks are kept)."""
    with _lock:
        for impls in _impls.values():
            impl = impls.get(backend)
            if impl is not None:
                impls[backend] = Implementation(impl.op, backend, wrapper(impl.fn), impl.check)


def implementations(op: str) -> Dict[str, Implementation]:
    with _lock:
        return dict(_impls[op])


def backend_infos() -> Dict[str, BackendInfo]:
    with _lock:
        return dict(_backends)
