"""Triton backend (CUDA; on CPU only under TRITON_INTERPRET=1, for testing).

Every module in this package registers its ops on import.
"""
from __future__ import annotations

import importlib
import pkgutil

from ..registry import declare_backend

try:
    import triton
except ImportError as exc:  # the backend shows as unavailable with the reason
    declare_backend("triton", False, reasons=[f"triton is not installed ({exc})"])
else:
    declare_backend("triton", True, version=triton.__version__)
    for _info in pkgutil.iter_modules(__path__):
        if not _info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{_info.name}")
