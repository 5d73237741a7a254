"""Backends register their ops on import; `load()` imports every backend once."""
from __future__ import annotations

import importlib
import threading

from .registry import backend_infos, declare_backend, implementations, register

_BACKEND_MODULES = ("reference", "torch", "triton", "cudnn")
_loaded = False
_load_lock = threading.Lock()


def load() -> None:
    global _loaded
    if _loaded:
        return
    with _load_lock:
        if _loaded:
            return
        for mod in _BACKEND_MODULES:
            name = "spec" if mod == "reference" else mod
            try:
                importlib.import_module(f"{__name__}.{mod}")
            except ImportError as exc:
                declare_backend(name, False, reasons=[f"import failed: {exc}"])
        _loaded = True


__all__ = ["load", "register", "declare_backend", "implementations", "backend_infos"]
