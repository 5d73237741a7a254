"""cuDNN backend through nvidia-cudnn-frontend (graph SDPA on sm90+, MXFP8 paths on sm100).

Modules: `attention` (mla_attention / mla_attention_backward: bf16 graph SDPA, MXFP8 SDPA) and
`mla_q` (mla_q_uproj_rope_quant via the fused sm100 wrapper). They register only when the frontend
imports; otherwise the backend is declared unavailable with the import error as its reason.
docs/CUDNN.md says what runs where.
"""
from __future__ import annotations

import importlib

from ..registry import declare_backend

MODULES = ("attention", "mla_q")


def _load() -> None:
    try:
        import cudnn  # nvidia-cudnn-frontend
    except ImportError as exc:
        declare_backend("cudnn", False, reasons=[f"nvidia-cudnn-frontend is not installed ({exc})"])
        return
    declare_backend("cudnn", True, version=getattr(cudnn, "__version__", "unknown"))
    for name in MODULES:
        importlib.import_module(f"{__name__}.{name}")


_load()
