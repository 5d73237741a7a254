"""Backend selection: `run(op, *args, backend=None, **kw)`.

With no backend named (argument or MXMLA_BACKEND), the first backend in the device's priority order
whose capability check accepts the call serves it (CUDA: cudnn, triton, torch; CPU: torch). `spec`
serves only when named. A named backend that cannot serve raises BackendUnavailable with every reason:
the dispatcher never swaps in another backend behind the caller's back.

Arguments are validated by spec's validators before any backend runs, so every backend raises the
same errors. Shapes, dtypes, divisibility and choices are checked once per call signature (everything
decidable from them: a RoPE table too short for the tokens raises here, never as a device-side
assert). Index-tensor values (cu_seqlens starting at 0, non-decreasing, ending at T; positions inside
the table) need the data and are checked on every call whose index tensors are on the CPU (or NumPy);
on CUDA only with MXMLA_CHECK_VALUES=1, because reading them copies them to the host, one device
synchronisation per call. Without it a bad CUDA index value is the caller's responsibility.

Selections are cached per (op, backend request, MXMLA_BACKEND, MXMLA_CHECK_VALUES, call signature);
the cache is thread-safe and a change of either variable selects afresh. Every selection also parses
every environment switch (backends/settings.py), so a bad value raises naming the variable.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Dict, List, Optional, Tuple

import backends as _backends
import spec as _spec
from backends import settings as _settings
from backends.convert import device_of
from spec.checks import dtype_name, shape_checks_only
from spec.constants import OPS

from .errors import BackendUnavailable, DispatchConfigError
from .policy import KNOWN_BACKENDS, parse_backend_list, parse_policy, requested_backends
from .signature import call_signature
from .version import package_version

__version__ = package_version()

log = logging.getLogger("mxmla.dispatch")

ENV_VAR = "MXMLA_BACKEND"
CHECK_VALUES_VAR = "MXMLA_CHECK_VALUES"
PRIORITY = {"cuda": ("cudnn", "triton", "torch"), "cpu": ("torch",), None: ()}

_cache: Dict[tuple, Any] = {}
_cache_lock = threading.Lock()

# os.environ.get costs about a microsecond (key encoding); on POSIX the mapping keeps its raw bytes in
# a dict that every assignment through os.environ updates, so the hot path reads that dict instead.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY = ENV_VAR.encode() if os.name == "posix" else ENV_VAR.upper()
_CHECK_KEY = CHECK_VALUES_VAR.encode() if os.name == "posix" else CHECK_VALUES_VAR.upper()
if not isinstance(_ENV_DATA, dict):  # pragma: no cover - other platforms
    _ENV_DATA, _ENV_KEY, _CHECK_KEY = os.environ, ENV_VAR, CHECK_VALUES_VAR


def _env_raw():
    """The variable's current value, raw (bytes on POSIX): only compared and used as a cache key."""
    return _ENV_DATA.get(_ENV_KEY)


def _check_op(op: str) -> None:
    if op not in OPS:
        raise DispatchConfigError(f"op: unknown op {op!r}; valid ops: {', '.join(OPS)}")


def _device_kind(args, kwargs) -> Optional[str]:
    dev = device_of(*args, **kwargs)
    if dev is None:
        return None
    return "cuda" if dev.type == "cuda" else "cpu"


def _same_device(op: str, args, kwargs) -> None:
    seen: Dict[str, str] = {}
    named = [(f"argument {i}", v) for i, v in enumerate(args)] + list(kwargs.items())
    for name, v in named:
        dev = device_of(v)
        if dev is not None:
            seen.setdefault(str(dev), name)
    if len(seen) > 1:
        where = ", ".join(f"{name} on {dev}" for dev, name in seen.items())
        raise ValueError(f"{op}: expected all tensors on one device, got {where}")


def _request(op: str, backend: Optional[str]) -> Tuple[Optional[Tuple[str, ...]], str]:
    """(the backend tuple asked for, or None for automatic; where the request came from)."""
    if backend is not None:
        return parse_backend_list(backend, "backend"), "argument backend="
    env = os.environ.get(ENV_VAR)
    return requested_backends(parse_policy(env), op), f"{ENV_VAR}={env!r}"


def _evaluate(op: str, candidates, args, kwargs) -> Tuple[Optional[Any], Dict[str, List[str]]]:
    impls = _backends.implementations(op)
    infos = _backends.backend_infos()
    reasons: Dict[str, List[str]] = {}
    for name in candidates:
        info = infos.get(name)
        if info is not None and not info.available:
            reasons[name] = list(info.reasons) or ["backend unavailable"]
            continue
        impl = impls.get(name)
        if impl is None:
            reasons[name] = [f"backend {name} does not implement {op}"]
            continue
        why = impl.reasons(*args, **kwargs)
        if not why:
            return impl, reasons
        reasons[name] = why
    return None, reasons


def validate(op: str, *args, backend: Optional[str] = None, **kwargs) -> None:
    """Raise what `run` would raise for these arguments before any backend runs: an unknown op, a bad
    `backend=`, or spec's validator error (TypeError / ValueError naming the argument); index values
    as the module docstring says. Layers above dispatch (the autograd wrappers) call this on the
    caller's arguments before converting them."""
    _check_op(op)
    if backend is not None:
        parse_backend_list(backend, "backend")
    _validate_args(op, args, kwargs)
    if _values_checked(args, kwargs):
        _check_values(op, args, kwargs)


def _validate_args(op: str, args, kwargs) -> None:
    with shape_checks_only():
        _spec.VALIDATORS[op](*args, **kwargs)


def _check_values(op: str, args, kwargs) -> None:
    """The validator with its index-value checks (the default outside shape_checks_only)."""
    _spec.VALIDATORS[op](*args, **kwargs)


def _values_checked(args, kwargs) -> bool:
    """Whether every call of this signature gets its index values checked: it passes an integer
    tensor (cu_seqlens, positions, start_positions) and that is on the host or MXMLA_CHECK_VALUES=1."""
    index = [v for v in list(args) + list(kwargs.values())
             if hasattr(v, "dtype") and hasattr(v, "shape") and dtype_name(v) in ("int32", "int64")]
    if not index:
        return False
    on_host = all(getattr(device_of(v), "type", "cpu") == "cpu" for v in index)
    return on_host or _settings.flag(CHECK_VALUES_VAR)


def _key(op: str, backend, args, kwargs) -> tuple:
    return (op, backend, _env_raw() if backend is None else None, _ENV_DATA.get(_CHECK_KEY),
            call_signature(args, kwargs))


def _select(op: str, backend: Optional[str], args, kwargs, key=None):
    """(implementation, whether each call checks index values) for this call, cached."""
    if key is None:
        key = _key(op, backend, args, kwargs)
        try:
            entry = _cache.get(key)
        except TypeError:  # an unhashable backend= (a list): _request below raises naming it
            entry = None
        if entry is not None:
            return entry
    _check_op(op)
    _backends.load()
    _settings.check_all()
    _validate_args(op, args, kwargs)
    _same_device(op, args, kwargs)
    requested, source = _request(op, backend)
    candidates = requested if requested is not None else PRIORITY[_device_kind(args, kwargs)]
    impl, reasons = _evaluate(op, candidates, args, kwargs)
    if impl is None:
        if requested is None and not candidates:
            reasons = {"auto": ["NumPy inputs: name backend='spec' (the reference) or pass torch tensors"]}
        raise BackendUnavailable(op, f"{','.join(candidates)} ({source})" if requested else "auto", reasons)
    entry = (impl, _values_checked(args, kwargs))
    with _cache_lock:
        _cache[key] = entry
    log.debug("%s -> %s (%s; rejected: %s)", op, impl.backend, source if requested else "auto", reasons)
    return entry


def run(op: str, *args, backend: Optional[str] = None, **kwargs):
    """Run `op` on the chosen backend. See the module docstring for how the choice is made."""
    # The cache lookup is inlined: this path is every call's overhead.
    key = (op, backend, _ENV_DATA.get(_ENV_KEY) if backend is None else None, _ENV_DATA.get(_CHECK_KEY),
           call_signature(args, kwargs))
    try:
        entry = _cache.get(key)
    except TypeError:  # an unhashable backend= (a list): _select raises the TypeError naming it
        entry = None
    if entry is None:
        entry = _select(op, backend, args, kwargs, key)
    impl, check_values = entry
    if check_values:
        _check_values(op, args, kwargs)
    return impl.fn(*args, **kwargs)


def select(op: str, *args, backend: Optional[str] = None, **kwargs) -> str:
    """The name of the backend `run` would use for this call."""
    impl, check_values = _select(op, backend, args, kwargs)
    if check_values:
        _check_values(op, args, kwargs)
    return impl.backend


def explain(op: str, *args, backend: Optional[str] = None, print_table: bool = True, **kwargs) -> List[dict]:
    """Every backend's verdict on this call: chosen, accepted, or rejected with its reasons."""
    _check_op(op)
    _backends.load()
    _settings.check_all()
    _validate_args(op, args, kwargs)
    if _values_checked(args, kwargs):
        _check_values(op, args, kwargs)
    requested, source = _request(op, backend)
    device = _device_kind(args, kwargs)
    order = requested if requested is not None else PRIORITY[device]
    chosen, _ = _evaluate(op, order, args, kwargs)
    rows = []
    impls = _backends.implementations(op)
    infos = _backends.backend_infos()
    for name in KNOWN_BACKENDS:
        info = infos.get(name)
        if info is not None and not info.available:
            why = list(info.reasons) or ["backend unavailable"]
        elif name not in impls:
            why = [f"backend {name} does not implement {op}"]
        else:
            why = impls[name].reasons(*args, **kwargs)
        if name == "spec" and not why and (requested is None or name not in requested):
            note = "serves only when named"
        elif requested is not None and name not in requested:
            note = f"not requested ({source})"
        elif requested is None and name not in order:
            note = f"not in the {device or 'NumPy'} priority order"
        else:
            note = ""
        rows.append({
            "backend": name,
            "chosen": chosen is not None and chosen.backend == name,
            "accepts": not why,
            "reasons": why,
            "note": note,
        })
    if print_table:
        print(format_explain(op, rows, chosen.backend if chosen else None, source if requested else "auto"))
    return rows


def format_explain(op: str, rows: List[dict], chosen: Optional[str], source: str) -> str:
    lines = [f"{op}: chosen {chosen or 'NONE'} ({source})", f"  {'backend':8} {'verdict':9} why"]
    for r in rows:
        verdict = "CHOSEN" if r["chosen"] else ("accepts" if r["accepts"] else "rejects")
        why = "; ".join(r["reasons"]) or r["note"]
        if r["reasons"] and r["note"]:
            why += f" ({r['note']})"
        lines.append(f"  {r['backend']:8} {verdict:9} {why}")
    return "\n".join(lines)


def backends() -> List[dict]:
    """Every known backend with availability, version and, when unavailable, why."""
    _backends.load()
    infos = _backends.backend_infos()
    out = []
    for name in KNOWN_BACKENDS:
        info = infos.get(name)
        ops = [op for op in OPS if name in _backends.implementations(op)]
        out.append({
            "backend": name,
            "available": bool(info and info.available),
            "version": info.version if info else "",
            "reasons": list(info.reasons) if info else ["not registered"],
            "ops": ops,
        })
    return out


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()


__all__ = [
    "run", "validate", "select", "explain", "backends", "clear_cache", "BackendUnavailable", "DispatchConfigError",
    "ENV_VAR", "PRIORITY",
]
