"""Tensors a backend keeps across calls (caches of constants and scratch) and CUDA graphs' memory pools.

A CUDA graph's memory comes from a private pool. `torch.cuda.graph` captures on a side stream, and
torch.compile's CUDA-graph trees (mode="reduce-overhead", the "cudagraphs" backend) run a compiled
graph's warm-up call and its capture on a side stream of their own, with the thread's allocations
routed to the graph's pool; they require every tensor still alive in that pool afterwards to be a
graph output ("tensor(s) in the cudagraph pool not tracked as outputs"). A cache filled during such a
call would keep a pool tensor alive behind their back (and its memory, reused by the next replay,
would be overwritten under it). So a cache keeps a tensor it made only when `may_keep(device)`: off
CUDA, or on the device's default stream while no graph is being captured; elsewhere the tensor serves
the call that made it, and the next call makes its own. Keep-worthy tensors made on the default stream
before a graph is recorded (an eager warm-up step) are reused inside it.
"""
from __future__ import annotations

import torch

__all__ = ["may_keep"]


def may_keep(device) -> bool:
    """Whether a tensor made now on `device` may be kept past this call (module docstring). Asked
    when a cache misses, not on every call."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    if device.type != "cuda":
        return True
    if torch.cuda.is_current_stream_capturing():
        return False
    return torch.cuda.current_stream(device) == torch.cuda.default_stream(device)
