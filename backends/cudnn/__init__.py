"""cuDNN backend through nvidia-cudnn-frontend (graph SDPA on sm90+, MXFP8 paths on sm100)."""
from __future__ import annotations

from ..registry import declare_backend

try:
    import cudnn  # nvidia-cudnn-frontend
except ImportError as exc:
    declare_backend("cudnn", False, reasons=[f"nvidia-cudnn-frontend is not installed ({exc})"])
else:
    declare_backend("cudnn", True, version=getattr(cudnn, "__version__", "unknown"))
