"""The selection grammar: MXMLA_BACKEND, and the same backend lists in `backend=`.

    unset | "" | "auto"                    automatic choice for every op
    "triton"                               only triton, for every op
    "triton,torch"                         try triton, then torch (an explicit, user-chosen order)
    "mla_attention=cudnn;rope=torch;*=triton"
                                           per-op lists; "*" covers the ops not named; ops not
                                           covered at all are chosen automatically
    "mla_q_uproj_rope_quant=triton:tma"    a backend entry may name one of its kernel variants
                                           (backends/registry.py); without one the backend picks
                                           its highest-priority variant that can serve the call

Every name is checked: an unknown backend or op raises DispatchConfigError listing the valid ones
here; an unknown variant name raises when an op selects (the registry knows each op's variants).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Dict, Optional, Tuple

from spec.constants import OPS

from .errors import DispatchConfigError

KNOWN_BACKENDS = ("spec", "torch", "triton", "cudnn")
AUTO = None


def parse_backend_list(text: str, where: str) -> Optional[Tuple[str, ...]]:
    if not isinstance(text, str):
        raise TypeError(f"{where}: expected a string such as 'triton' or 'triton,torch' (or None for the "
                        f"automatic choice), got {type(text).__name__} {text!r}")
    text = text.strip()
    if text in ("", "auto"):
        return AUTO
    names = []
    for entry in text.split(","):
        backend, _, variant = (s.strip() for s in entry.partition(":"))
        if backend not in KNOWN_BACKENDS:
            raise DispatchConfigError(
                f"{where}: unknown backend {backend!r}; valid backends: {', '.join(KNOWN_BACKENDS)} (or 'auto')"
            )
        if ":" in entry and not (variant and all(c.isalnum() or c == "_" for c in variant)):
            raise DispatchConfigError(f"{where}: entry {entry.strip()!r}: expected 'backend:variant' with a "
                                      f"variant name of letters, digits and '_'")
        names.append(f"{backend}:{variant}" if variant else backend)
    return tuple(names)


def split_entry(entry: str) -> Tuple[str, Optional[str]]:
    """'triton:tma' -> ('triton', 'tma'); 'triton' -> ('triton', None)."""
    backend, _, variant = entry.partition(":")
    return backend, (variant or None)


@lru_cache(maxsize=64)
def parse_policy(value: Optional[str]) -> Dict[str, Optional[Tuple[str, ...]]]:
    """MXMLA_BACKEND text -> {op or '*': backend tuple or AUTO}."""
    if value is None:
        return {}
    value = value.strip()
    if "=" not in value:
        return {"*": parse_backend_list(value, "MXMLA_BACKEND")}
    policy: Dict[str, Optional[Tuple[str, ...]]] = {}
    for entry in value.split(";"):
        entry = entry.strip()
        if not entry:
            continue
        if "=" not in entry:
            raise DispatchConfigError(
                f"MXMLA_BACKEND: entry {entry!r} has no '='; expected 'op=backend[,backend]' or '*=backend'"
            )
        op, names = (s.strip() for s in entry.split("=", 1))
        if op != "*" and op not in OPS:
            raise DispatchConfigError(f"MXMLA_BACKEND: unknown op {op!r}; valid ops: {', '.join(OPS)} (or '*')")
        policy[op] = parse_backend_list(names, f"MXMLA_BACKEND entry {op!r}")
    return policy


def requested_backends(policy, op: str) -> Optional[Tuple[str, ...]]:
    if op in policy:
        return policy[op]
    return policy.get("*", AUTO)
