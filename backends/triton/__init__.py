"""Triton backend (CUDA; on CPU only under TRITON_INTERPRET=1, for testing)."""
from __future__ import annotations

import importlib

from ..registry import declare_backend

try:
    import triton
except ImportError as exc:  # the backend shows as unavailable with the reason
    declare_backend("triton", False, reasons=[f"triton is not installed ({exc})"])
else:
    declare_backend("triton", True, version=triton.__version__)
    for _module in ():  # filled in as kernels land: "quantize", "rope", ...
        importlib.import_module(f"{__name__}.{_module}")
