"""Eager torch backend (CPU and CUDA): every op, byte-equal to spec wherever spec is bit-exact."""
from __future__ import annotations

import importlib

import torch

from ..registry import declare_backend

declare_backend("torch", True, version=torch.__version__)

for _module in ("quantize", "swizzle", "rope", "gemm", "mla_q", "rmsnorm", "mla_kv", "attention"):
    importlib.import_module(f"{__name__}.{_module}")
