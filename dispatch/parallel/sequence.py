"""Load-balanced causal sharding of the sequence axis over a process group.

A sequence of length S is cut into 2*W equal chunks (W the group size); rank r holds chunks r and
2*W-1-r, in that order. Under a causal mask, chunk j attends to j + 1 chunks, so every rank's two
chunks attend to (r + 1) + (2*W - r) = 2*W + 1 chunks together: equal work on every rank. This is the
layout `spec.rope`'s cp_size / cp_rank arguments describe and `context_parallel_attention` expects
when causal.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from spec.constants import BLOCK_SIZE
from spec.mxtensor import MXTensor

from .operands import concat, group_size_rank, narrow, wire_tensors

__all__ = ["shard_sequence", "unshard_sequence", "shard_positions", "chunk_indices"]


def chunk_indices(world: int, rank: int):
    """The two chunk indices (of 2*world) rank holds: (rank, 2*world - 1 - rank)."""
    return rank, 2 * world - 1 - rank


def _axis(name: str, x: Any, dim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim: expected an int, got {dim!r}")
    nd = len(x.shape)
    if not -nd <= dim < nd:
        raise ValueError(f"dim: expected an axis of {name} (shape {tuple(x.shape)}), got {dim}")
    return dim % nd


def _check_kind(name: str, x: Any) -> None:
    if not isinstance(x, (Tensor, MXTensor)):
        raise TypeError(f"{name}: expected a torch.Tensor or an MXTensor, got {type(x).__name__}")


def _chunk_multiple(x: Any, dim: int) -> int:
    """A chunk must hold whole scale blocks when x is an MXTensor blocked along dim."""
    return BLOCK_SIZE if isinstance(x, MXTensor) and x.axis == dim else 1


def shard_sequence(x: Any, dim: int, group: Optional[dist.ProcessGroup] = None) -> Any:
    """This rank's load-balanced shard of the whole-sequence `x` (a tensor or a compact MXTensor, the
    same on every rank): chunks r and 2*W-1-r of 2*W equal chunks along `dim`, joined in that order.
    The length along dim must divide by 2*W (and each chunk by 32 when an MXTensor is blocked along
    dim). Differentiable for tensors (a slice and a concatenation)."""
    _check_kind("x", x)
    dim = _axis("x", x, dim)
    world, rank = group_size_rank(group)
    length = int(x.shape[dim])
    multiple = _chunk_multiple(x, dim)
    if length % (2 * world) or (length // (2 * world)) % multiple:
        extra = f" and each chunk a multiple of {multiple} (x is MXFP8 blocked along dim)" if multiple > 1 else ""
        raise ValueError(f"x: the length {length} along dim {dim} must divide into 2*W = {2 * world} equal "
                         f"chunks{extra}")
    chunk = length // (2 * world)
    first, second = chunk_indices(world, rank)
    parts = [narrow("x", x, dim, j * chunk, (j + 1) * chunk) for j in (first, second)]
    return concat("x", parts, dim)


def unshard_sequence(x_local: Any, dim: int, group: Optional[dist.ProcessGroup] = None) -> Any:
    """The whole sequence from every rank's `shard_sequence` output (all ranks call it; every rank
    gets the result). Each rank's shard must have the same shape. The result is gathered with
    all_gather and carries no autograd history: it is meant for outputs and checks."""
    _check_kind("x_local", x_local)
    dim = _axis("x_local", x_local, dim)
    world, _ = group_size_rank(group)
    length = int(x_local.shape[dim])
    multiple = _chunk_multiple(x_local, dim)
    if length % 2 or (length // 2) % multiple:
        extra = f" of whole {multiple}-element scale blocks" if multiple > 1 else ""
        raise ValueError(f"x_local: expected two equal chunks{extra} along dim {dim}, got length {length}")
    chunk = length // 2
    pieces = []
    for t in wire_tensors(x_local):
        t = t.detach()
        gathered = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(gathered, t, group=group)
        pieces.append(gathered)
    if isinstance(x_local, MXTensor):
        shards = [MXTensor(codes.view(x_local.data.dtype), scale, x_local.axis, x_local.elem, "compact")
                  for codes, scale in zip(*pieces)]
    else:
        shards = pieces[0]
    order = []
    for j in range(2 * world):
        owner, half = (j, 0) if j < world else (2 * world - 1 - j, 1)
        order.append(narrow("x_local", shards[owner], dim, half * chunk, (half + 1) * chunk))
    return concat("x_local", order, dim)


def shard_positions(S: int, group: Optional[dist.ProcessGroup] = None, device: Any = None) -> Tensor:
    """int64 [2*S/(2*W)]: the global positions (RoPE table rows) of this rank's tokens of a length-S
    sequence under shard_sequence: r*c .. r*c+c-1, then (2W-1-r)*c .. (2W-1-r)*c+c-1, c = S/(2W)."""
    if isinstance(S, bool) or not isinstance(S, int):
        raise TypeError(f"S: expected an int, got {S!r}")
    world, rank = group_size_rank(group)
    if S <= 0 or S % (2 * world):
        raise ValueError(f"S: expected a positive multiple of 2*W = {2 * world}, got {S}")
    chunk = S // (2 * world)
    first, second = chunk_indices(world, rank)
    idx = torch.arange(chunk, dtype=torch.int64, device=device)
    return torch.cat([first * chunk + idx, second * chunk + idx])
