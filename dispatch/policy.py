"""The MXMLA_BACKEND grammar.

    unset | "" | "auto"                    automatic choice for every op
    "triton"                               only triton, for every op
    "triton,torch"                         try triton, then torch (an explicit, user-chosen order)
    "mla_attention=cudnn;rope=torch;*=triton"
                                           per-op lists; "*" covers the ops not named; ops not
                                           covered at all are chosen automatically

Every name is checked: an unknown backend or op raises DispatchConfigError listing the valid ones.
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
    names = tuple(n.strip() for n in text.split(","))
    for n in names:
        if n not in KNOWN_BACKENDS:
            raise DispatchConfigError(
                f"{where}: unknown backend {n!r}; valid backends: {', '.join(KNOWN_BACKENDS)} (or 'auto')"
            )
    return names


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
