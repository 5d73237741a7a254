"""Backends register their ops on import; `load()` imports every backend once."""
from __future__ import annotations

import importlib
import threading

from . import settings
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


_background: list = []  # the one background loader thread, once started


def _load_for_device() -> None:
    # Only where a CUDA device is: on a CPU machine the first op loads the backends itself, and no
    # import runs beside the caller's (a test importing a kernel module directly, say). device_count
    # asks NVML, which (unlike is_available) leaves the CUDA driver uninitialized, so a process that
    # forks workers after importing dispatch can still use CUDA in them.
    import torch

    if torch.cuda.device_count() < 1:
        return
    load()
    info = backend_infos().get("triton")
    if info is None or not info.available or settings.interpret_mode():
        return
    from .triton.compile_ahead import triton_fingerprint

    triton_fingerprint()


def _background_main() -> None:
    try:
        _load_for_device()
    except Exception:  # noqa: BLE001 - the first op's own load() raises, or declares the backend unavailable
        pass


def load_in_background() -> None:
    """Start (once) a daemon thread doing what a process's first op would otherwise do on the caller's
    thread: import every backend and compute Triton's compiler fingerprint (a hash of its 500 MB
    library, needed before the first kernel loads from Triton's cache). `load()` holds a lock, so an op
    called meanwhile waits for the thread instead of importing twice."""
    with _load_lock:
        if _loaded or _background:
            return
        thread = threading.Thread(target=_background_main, name="mxmla-background-load", daemon=True)
        _background.append(thread)
    thread.start()


__all__ = ["load", "load_in_background", "register", "declare_backend", "implementations", "backend_infos"]
