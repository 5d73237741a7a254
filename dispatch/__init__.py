"""Backend selection: `run(op, *args, backend=None, **kw)`.

With no backend named (argument or MXMLA_BACKEND), the first backend in the device's priority order
whose capability check accepts the call serves it (CUDA: cudnn, triton, torch; CPU: torch). `spec`
serves only when named. A named backend that cannot serve raises BackendUnavailable with every reason:
the dispatcher never swaps in another backend behind the caller's back.

Kernel variants (backends/registry.py `register_variant`) are chosen the same way, one level down: a
backend with variants serves through its highest-priority variant whose own check accepts the call;
a variant named in MXMLA_BACKEND (`op=backend:variant`), in `backend=` or by `variant=` either serves
or raises BackendUnavailable with its reasons. `explain()` lists every variant with its verdict.

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

import functools
import inspect
import logging
import os
import threading
from typing import Any, Dict, List, Optional, Tuple

import backends as _backends
import spec as _spec
from backends import registry as _registry
from backends import settings as _settings
from backends.convert import device_of
from spec.checks import dtype_name, shape_checks_only
from spec.constants import OPS

from .errors import BackendUnavailable, DispatchConfigError
from .policy import KNOWN_BACKENDS, parse_backend_list, parse_policy, requested_backends, split_entry
from .signature import call_signature
from .version import package_version

__version__ = package_version()

log = logging.getLogger("mxmla.dispatch")

ENV_VAR = "MXMLA_BACKEND"
CHECK_VALUES_VAR = "MXMLA_CHECK_VALUES"
PRIORITY = {"cuda": ("cudnn", "triton", "torch"), "cpu": ("torch",), None: ()}

_cache: Dict[tuple, Any] = {}
_validated: dict = {}  # (op, backend, MXMLA_CHECK_VALUES, call signature) validate() passed -> _values_checked
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


def _request(op: str, backend: Optional[str], variant: Optional[str] = None
             ) -> Tuple[Optional[Tuple[str, ...]], str]:
    """(the entries asked for -- 'backend' or 'backend:variant' -- or None for automatic; where the
    request came from). `variant=` names a variant of the one requested (or implied) backend owning it."""
    if backend is not None:
        requested, source = parse_backend_list(backend, "backend"), "argument backend="
    else:
        env = os.environ.get(ENV_VAR)
        requested, source = requested_backends(parse_policy(env), op), f"{ENV_VAR}={env!r}"
    if variant is None:
        return requested, source
    if not isinstance(variant, str) or not variant:
        raise TypeError(f"variant: expected a variant name (str), got {type(variant).__name__} {variant!r}")
    owners = [b for b in KNOWN_BACKENDS if any(v.name == variant for v in _registry.variants(op, b))]
    if not owners:
        raise DispatchConfigError(f"variant: {op} has no variant {variant!r}; {_variant_list(op)}")
    pool = [split_entry(e)[0] for e in requested] if requested is not None else owners
    hits = [b for b in pool if b in owners]
    if len(hits) != 1:
        raise DispatchConfigError(f"variant: {variant!r} belongs to {', '.join(owners)}; name that backend "
                                  f"(backend=) once, got {', '.join(pool) or 'none'} ({source})")
    entries = []
    for e in (requested if requested is not None else (hits[0],)):
        b, v = split_entry(e)
        if b == hits[0]:
            if v is not None and v != variant:
                raise DispatchConfigError(f"variant: {variant!r} conflicts with {e!r} ({source})")
            e = f"{b}:{variant}"
        entries.append(e)
    return tuple(entries), f"{source} and variant={variant!r}" if requested is not None else f"variant={variant!r}"


def _variant_list(op: str) -> str:
    named = [f"{b}:{v.name}" for b in KNOWN_BACKENDS for v in _registry.variants(op, b)]
    return f"valid variants: {', '.join(named)}" if named else "it has no kernel variants"


def _variant_verdicts(op: str, backend: str, args, kwargs) -> List[Tuple[Any, List[str]]]:
    """(variant, reasons) for every variant of backend's op, highest priority first."""
    return [(v, v.reasons(*args, **kwargs)) for v in _registry.variants(op, backend)]


def _evaluate(op: str, candidates, args, kwargs) -> Tuple[Optional[Any], Optional[str], Dict[str, List[str]]]:
    """(implementation, variant name or None, reasons of every candidate tried before it)."""
    impls = _backends.implementations(op)
    infos = _backends.backend_infos()
    reasons: Dict[str, List[str]] = {}
    for entry in candidates:
        name, wanted = split_entry(entry)
        info = infos.get(name)
        if info is not None and not info.available:
            reasons[entry] = list(info.reasons) or ["backend unavailable"]
            continue
        impl = impls.get(name)
        if impl is None:
            reasons[entry] = [f"backend {name} does not implement {op}"]
            continue
        why = impl.reasons(*args, **kwargs)
        if why:
            reasons[entry] = why
            continue
        verdicts = _variant_verdicts(op, name, args, kwargs)
        if wanted is not None:
            match = [(v, w) for v, w in verdicts if v.name == wanted]
            if not match:
                raise DispatchConfigError(f"{entry}: {name} has no variant {wanted!r} of {op}; {_variant_list(op)}")
            if match[0][1]:
                reasons[entry] = match[0][1]
                continue
            return impl, wanted, reasons
        if not verdicts:
            return impl, None, reasons
        for v, w in verdicts:
            if not w:
                return impl, v.name, reasons
        reasons[entry] = [f"{v.name}: {r}" for v, w in verdicts for r in w]
    return None, None, reasons


def validate(op: str, *args, backend: Optional[str] = None, **kwargs) -> None:
    """Raise what `run` would raise for these arguments before any backend runs: an unknown op, a bad
    `backend=`, or spec's validator error (TypeError / ValueError naming the argument); index values
    as the module docstring says. Layers above dispatch (the autograd wrappers) call this on the
    caller's arguments before converting them."""
    # a signature validated once passes again without the validators (they read only what the
    # signature holds: shapes, dtypes, strides, scalar types and values); index values are still
    # checked per call where _values_checked says so
    key = (op, backend, _ENV_DATA.get(_CHECK_KEY), call_signature(args, kwargs))
    try:
        check_values = _validated.get(key)
    except TypeError:  # an unhashable backend= (a list): parse_backend_list below raises naming it
        check_values = None
    if check_values is None:
        _check_op(op)
        if backend is not None:
            parse_backend_list(backend, "backend")
        _validate_args(op, args, kwargs)
        # whether index values are checked per call depends only on what the key holds (dtypes, devices,
        # the MXMLA_CHECK_VALUES setting)
        check_values = _values_checked(args, kwargs)
        with _cache_lock:
            _validated[key] = check_values
    if check_values:
        _check_values(op, args, kwargs)


@functools.lru_cache(maxsize=None)
def _op_signature(op: str) -> inspect.Signature:
    """The op's arguments: its spec validator's, which takes exactly what every backend takes."""
    return inspect.signature(_spec.VALIDATORS[op])


def _bind(op: str, args, kwargs) -> None:
    """A TypeError naming the op and its arguments for a call the op cannot take (an unknown keyword,
    too many or missing arguments), rather than one naming spec's internal validator."""
    signature = _op_signature(op)
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{op}: {exc}; {op} takes {', '.join(signature.parameters)} "
                        f"(and run's backend, variant)") from None


def _validate_args(op: str, args, kwargs) -> None:
    _bind(op, args, kwargs)
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


def _key(op: str, backend, variant, args, kwargs) -> tuple:
    return (op, backend, variant, _env_raw() if backend is None else None, _ENV_DATA.get(_CHECK_KEY),
            call_signature(args, kwargs))


def _select(op: str, backend: Optional[str], args, kwargs, key=None, variant: Optional[str] = None):
    """(function to call, implementation, variant name or None, whether each call checks index values)
    for this call, cached."""
    if key is None:
        key = _key(op, backend, variant, args, kwargs)
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
    requested, source = _request(op, backend, variant)
    candidates = requested if requested is not None else PRIORITY[_device_kind(args, kwargs)]
    impl, chosen_variant, reasons = _evaluate(op, candidates, args, kwargs)
    if impl is None:
        if requested is None and not candidates:
            reasons = {"auto": ["NumPy inputs: name backend='spec' (the reference) or pass torch tensors"]}
        raise BackendUnavailable(op, f"{','.join(candidates)} ({source})" if requested else "auto", reasons)
    fn = impl.fn if chosen_variant is None else functools.partial(impl.fn, variant=chosen_variant)
    entry = (fn, impl, chosen_variant, _values_checked(args, kwargs))
    with _cache_lock:
        _cache[key] = entry
    log.debug("%s -> %s%s (%s; rejected: %s)", op, impl.backend, f":{chosen_variant}" if chosen_variant else "",
              source if requested else "auto", reasons)
    return entry


def run(op: str, *args, backend: Optional[str] = None, variant: Optional[str] = None, **kwargs):
    """Run `op` on the chosen backend (and kernel variant). See the module docstring for the choice."""
    # The cache lookup is inlined: this path is every call's overhead.
    key = (op, backend, variant, _ENV_DATA.get(_ENV_KEY) if backend is None else None, _ENV_DATA.get(_CHECK_KEY),
           call_signature(args, kwargs))
    try:
        entry = _cache.get(key)
    except TypeError:  # an unhashable backend= (a list): _select raises the TypeError naming it
        entry = None
    if entry is None:
        entry = _select(op, backend, args, kwargs, key, variant)
    if entry[3]:
        _check_values(op, args, kwargs)
    return entry[0](*args, **kwargs)


def select(op: str, *args, backend: Optional[str] = None, variant: Optional[str] = None, **kwargs) -> str:
    """The backend `run` would use for this call: 'backend', or 'backend:variant' for an op whose
    backend has kernel variants."""
    _, impl, chosen_variant, check_values = _select(op, backend, args, kwargs, variant=variant)
    if check_values:
        _check_values(op, args, kwargs)
    return impl.backend if chosen_variant is None else f"{impl.backend}:{chosen_variant}"


def explain(op: str, *args, backend: Optional[str] = None, variant: Optional[str] = None, print_table: bool = True,
            **kwargs) -> List[dict]:
    """Every backend's verdict on this call -- chosen, accepted, or rejected with its reasons -- and,
    for a backend with kernel variants, every variant's (row["variants"]: name, priority, chosen,
    accepts, reasons)."""
    _check_op(op)
    _backends.load()
    _settings.check_all()
    _validate_args(op, args, kwargs)
    if _values_checked(args, kwargs):
        _check_values(op, args, kwargs)
    requested, source = _request(op, backend, variant)
    device = _device_kind(args, kwargs)
    order = requested if requested is not None else PRIORITY[device]
    chosen, chosen_variant, _ = _evaluate(op, order, args, kwargs)
    requested_names = None if requested is None else [split_entry(e)[0] for e in requested]
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
        if name == "spec" and not why and (requested_names is None or name not in requested_names):
            note = "serves only when named"
        elif requested_names is not None and name not in requested_names:
            note = f"not requested ({source})"
        elif requested is None and name not in order:
            note = f"not in the {device or 'NumPy'} priority order"
        else:
            note = ""
        is_chosen = chosen is not None and chosen.backend == name
        rows.append({
            "backend": name,
            "chosen": is_chosen,
            "accepts": not why,
            "reasons": why,
            "note": note,
            "variants": [{"variant": v.name, "priority": v.priority, "chosen": is_chosen and v.name == chosen_variant,
                          "accepts": not w, "reasons": w}
                         for v, w in _variant_verdicts(op, name, args, kwargs)],
        })
    if print_table:
        label = None if chosen is None else (chosen.backend + (f":{chosen_variant}" if chosen_variant else ""))
        print(format_explain(op, rows, label, source if requested else "auto"))
    return rows


def format_explain(op: str, rows: List[dict], chosen: Optional[str], source: str) -> str:
    lines = [f"{op}: chosen {chosen or 'NONE'} ({source})", f"  {'backend':8} {'verdict':9} why"]
    for r in rows:
        verdict = "CHOSEN" if r["chosen"] else ("accepts" if r["accepts"] else "rejects")
        why = "; ".join(r["reasons"]) or r["note"]
        if r["reasons"] and r["note"]:
            why += f" ({r['note']})"
        lines.append(f"  {r['backend']:8} {verdict:9} {why}")
        for v in r.get("variants", ()):
            verdict = "CHOSEN" if v["chosen"] else ("accepts" if v["accepts"] else "rejects")
            lines.append(f"    :{v['variant']:<14} {verdict:9} priority {v['priority']}"
                         + (f"; {'; '.join(v['reasons'])}" if v["reasons"] else ""))
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
        _validated.clear()


def _start_background_load() -> None:
    try:
        wanted = _settings.flag("MXMLA_BACKGROUND_LOAD")
    except ValueError:  # a bad value raises at the first selection (settings.check_all), not at import
        return
    if wanted:
        _backends.load_in_background()


_start_background_load()


__all__ = [
    "run", "validate", "select", "explain", "backends", "clear_cache", "BackendUnavailable", "DispatchConfigError",
    "ENV_VAR", "PRIORITY",
]
