"""Tile choices recorded on a GPU model and shipped with the package: they refine the heuristic tiles
(tile_choice.py) at the keys they hold, and spare a process that autotunes (MXMLA_TRITON_AUTOTUNE=1)
the timing runs, and the compilation of every losing config, at those keys.

Every autotuner made by `tile_choice.tuned` registers here under its kernel's qualified name. Its
recorded choices for the current device's name come from `pretuned/<device slug>.json`: without
autotuning a launch at a recorded key takes the recorded config instead of the heuristic's; with it
they fill the autotuner's in-memory cache (Triton's Autotuner.cache: key -> Config) at its first
launch, exactly as if it had timed them itself in this process, and a key that is not recorded is
autotuned as usual. A recorded choice is only a tile choice: each config of an autotuner computes the
same result, so a table never changes what a kernel returns.

No table ships: the heuristics give what autotuning chose on the H200 at the DeepSeek-V3 shapes
(tests/test_tile_choice.py holds that recording as their reference). A table for a GPU where they do
not is recorded with `MXMLA_TRITON_AUTOTUNE=1 python tools/record_pretuned.py --what pretuned`.
MXMLA_TRITON_PRETUNED=0 ignores the tables.

File format: {"device": name, "triton": version, "kernels": {qualified name: [[key, config], ...]}},
key the autotuner's key as a list (its key arguments' values, then the dtype names of its tensor
arguments: Triton's own key), config the chosen Config's all_kwargs(). An entry whose config is not
(or no longer) among the autotuner's configs is skipped.
"""
from __future__ import annotations

import json
import os
import re
import threading
from typing import Any, Dict, List, Optional

from .. import settings

DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pretuned")

_lock = threading.Lock()
_tuners: Dict[str, Any] = {}       # qualified name -> triton Autotuner
_tables: Dict[str, Optional[dict]] = {}  # device name -> its table's "kernels" (None: no file)


def device_slug(name: str) -> str:
    """File stem for a device name: 'NVIDIA H200' -> 'nvidia_h200'."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _base_function(fn):
    """The JITFunction under heuristics / autotune wrappers (each keeps the next one in .fn)."""
    from triton.runtime.jit import JITFunction

    while not isinstance(fn, JITFunction) and hasattr(fn, "fn"):
        fn = fn.fn
    return fn


def register(tuner) -> str:
    """Register an autotuner (made by tile_choice.tuned); returns its name: module.kernel, with #2, #3,
    ... for further autotuners of one kernel, in import order."""
    base = _base_function(tuner.fn)
    name = f"{getattr(base, '__module__', '?')}.{getattr(base, '__name__', '?')}"
    with _lock:
        unique, n = name, 1
        while unique in _tuners:
            n += 1
            unique = f"{name}#{n}"
        _tuners[unique] = tuner
    return unique


def tuners() -> Dict[str, Any]:
    with _lock:
        return dict(_tuners)


def _current_device_name() -> Optional[str]:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.cuda.current_device())


def table(device_name: str) -> Optional[dict]:
    """The recorded kernels of this device name ({name: [[key, config], ...]}), None without a file."""
    with _lock:
        if device_name not in _tables:
            path = os.path.join(DIR, device_slug(device_name) + ".json")
            try:
                with open(path) as f:
                    _tables[device_name] = json.load(f).get("kernels", {})
            except FileNotFoundError:
                _tables[device_name] = None
        return _tables[device_name]


def _jsonable(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def config_kwargs(config) -> dict:
    """A Config's all_kwargs() with its JSON-representable values (what a table stores)."""
    return {k: v for k, v in config.all_kwargs().items() if _jsonable(v)}


def recorded(name: str, tuner) -> dict:
    """The recorded choices of the current device for this autotuner ({key tuple: Config}); empty with
    MXMLA_TRITON_PRETUNED=0, in the interpreter, or without a table for this GPU model."""
    if settings.interpret_mode() or not settings.flag("MXMLA_TRITON_PRETUNED"):
        return {}
    device = _current_device_name()
    table_ = table(device) if device else None
    if not table_:
        return {}
    by_kwargs = [(config_kwargs(c), c) for c in tuner.configs]
    out = {}
    for key, wanted in table_.get(name, ()):
        match = next((c for kw, c in by_kwargs if kw == wanted), None)
        if match is not None:
            out[tuple(key)] = match
    return out


def prefill(name: str, tuner) -> int:
    """Copy the recorded choices of the current device into tuner.cache (keys it lacks); returns how
    many."""
    filled = 0
    for key, config in recorded(name, tuner).items():
        if key not in tuner.cache:
            tuner.cache[key] = config
            filled += 1
    return filled


def record() -> Dict[str, List[list]]:
    """Every registered autotuner's current choices ({name: [[key, config kwargs], ...]}), for a table
    (tools/record_pretuned.py writes them after running the shapes to cover)."""
    out = {}
    for name, tuner in sorted(tuners().items()):
        rows = [[list(key), config_kwargs(cfg)] for key, cfg in tuner.cache.items()
                if all(_jsonable(v) for v in key)]
        if rows:
            out[name] = sorted(rows, key=lambda r: json.dumps(r[0]))
    return out
