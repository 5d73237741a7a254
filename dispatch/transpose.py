"""`transpose_bytes_into(src, out)`: out = src.t(), byte for byte, written into a given tensor.

For the physically transposed MXFP8 copies (dispatch.weights): codes and scales are 1-byte elements,
and torch's strided copy of them (`.t().contiguous()`, `out.copy_(src.t())`) moves one byte per lane
with one side uncoalesced. The Triton kernel (backends.triton.transpose) moves tiles, coalesced on both
sides. It serves where the Triton backend is available and can run on the tensors (CUDA, or CPU under
TRITON_INTERPRET=1) and the request allows triton: the caller's `backend=`, else MXMLA_BACKEND's entry
for `mxfp8_quantize` (the op that made the bytes it moves; e.g. MXMLA_BACKEND=torch turns it off);
otherwise torch's copy does. The bytes are the same either way.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import backends as _backends
from backends import registry as _registry
from backends import settings as _settings

import dispatch as _dispatch

from .policy import split_entry

__all__ = ["transpose_bytes_into"]


def _check(src, out) -> None:
    for name, t in (("src", src), ("out", out)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D tensor, got shape {tuple(t.shape)}")
        if t.element_size() != 1:
            raise TypeError(f"{name}: expected 1-byte elements (uint8, int8, float8), got {t.dtype}")
    if tuple(out.shape) != (src.shape[1], src.shape[0]):
        raise ValueError(f"out: expected shape {(src.shape[1], src.shape[0])} (src {tuple(src.shape)} transposed), "
                         f"got {tuple(out.shape)}")
    if any(stride == 0 and n > 1 for stride, n in zip(out.stride(), out.shape)):
        raise ValueError(f"out: expected no element written twice, got strides {tuple(out.stride())} "
                         f"for shape {tuple(out.shape)} (an expanded tensor)")
    if out.device != src.device:
        raise ValueError(f"out: expected src's device {src.device}, got {out.device}")


_chosen: dict = {}  # (device, backend=, MXMLA_BACKEND, interpreter on) -> the Triton launcher or None


def _triton_kernel(src: Tensor, out: Tensor, backend: Optional[str]):
    """The Triton transpose when it may and can serve (src, out), else None; decided once per device,
    backend request (MXMLA_BACKEND's value too) and interpreter mode (what the decision reads of the
    tensors is their device)."""
    key = (src.device, backend, _dispatch._env_raw() if backend is None else None, _settings.interpret_mode())
    kernel = _chosen.get(key, _chosen)
    if kernel is _chosen:
        kernel = _chosen[key] = _choose(src, out, backend)
    return kernel


def _choose(src: Tensor, out: Tensor, backend: Optional[str]):
    requested = _dispatch._request("mxfp8_quantize", backend)[0]
    if requested is not None and "triton" not in {split_entry(entry)[0] for entry in requested}:
        return None
    _backends.load()
    info = _registry.backend_infos().get("triton")
    if info is None or not info.available:
        return None
    from backends.triton import transpose

    return None if transpose.transpose_reasons(src, out) else transpose.transpose_bytes_into


def transpose_bytes_into(src: Tensor, out: Tensor, *, backend: Optional[str] = None) -> Tensor:
    """Write src.t() into out: src [R, C] and out [C, R], 1-byte elements (uint8 / int8 / float8,
    bytes copied as they are, whatever the two dtypes), one device, any strides; out must not overlap
    src. Returns out. `backend`: a backend request as mxmla's ops take (None: MXMLA_BACKEND's entry for
    mxfp8_quantize, else automatic); the Triton kernel serves only where it allows triton. No autograd
    (the bytes are copied, not differentiated)."""
    _check(src, out)
    kernel = _triton_kernel(src, out, backend)
    with torch.no_grad():
        if kernel is None:
            out.copy_(src.view(out.dtype).t())
        else:
            kernel(src, out)
    return out
