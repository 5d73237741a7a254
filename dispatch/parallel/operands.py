"""Pieces the parallel layers share: process-group facts, MXTensor slicing along one axis, and
operand slots (how a tensor or an MXTensor crosses an autograd.Function boundary).

An MXFP8 value is codes plus scale bytes; slicing it along an axis slices both. Along an axis it is
not blocked on, compact scales keep that axis at full length, so they slice alike. Along its blocked
axis the scales hold one byte per 32 elements, so a slice must start and stop on a block boundary.
Swizzled scales mix every axis into a padded 2-D matrix and cannot be sliced (ValueError).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from dispatch.autograd import TrackedMXTensor
from spec.constants import BLOCK_SIZE
from spec.mxtensor import MXTensor

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


# --------------------------------------------------------------------------------------------------
# process groups
# --------------------------------------------------------------------------------------------------

def group_size_rank(group: Optional[dist.ProcessGroup]) -> Tuple[int, int]:
    """(size, this process's rank) in `group` (None: the default group), which must be initialised."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialised (call init_process_group first)")
    return dist.get_world_size(group), dist.get_rank(group)


def global_rank(group: Optional[dist.ProcessGroup], group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (P2P ops name peers by global rank)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


# --------------------------------------------------------------------------------------------------
# slicing and joining along one axis, tensors and MXTensors alike
# --------------------------------------------------------------------------------------------------

def seq_length(x: Any, dim: int) -> int:
    return int(x.shape[dim])


def _check_sliceable(name: str, t: MXTensor, dim: int, start: int, stop: int) -> None:
    if t.scale_layout != "compact":
        raise ValueError(f"{name}: an MXTensor is sliced along axis {dim} only with compact scales, "
                         f"got {t.scale_layout!r} scales (unswizzle them first)")
    if dim == t.axis and (start % BLOCK_SIZE or stop % BLOCK_SIZE):
        raise ValueError(f"{name}: an MXTensor blocked along axis {dim} is sliced there only at multiples "
                         f"of {BLOCK_SIZE} (whole scale blocks), got [{start}, {stop})")


def narrow(name: str, x: Any, dim: int, start: int, stop: int) -> Any:
    """x[start:stop] along dim, contiguous; an MXTensor's codes, scales (and proxy) alike."""
    if not isinstance(x, MXTensor):
        return x.narrow(dim, start, stop - start).contiguous()
    _check_sliceable(name, x, dim, start, stop)
    blocks = BLOCK_SIZE if dim == x.axis else 1
    data = x.data.narrow(dim, start, stop - start).contiguous()
    scale = x.scale.narrow(dim, start // blocks, (stop - start) // blocks).contiguous()
    if isinstance(x, TrackedMXTensor) and x.grad_proxy is not None:
        proxy = x.grad_proxy.narrow(dim, start, stop - start)
        return TrackedMXTensor(data, scale, x.axis, x.elem, "compact", proxy)
    return MXTensor(data, scale, x.axis, x.elem, "compact")


def concat(name: str, parts: Sequence[Any], dim: int) -> Any:
    """parts joined along dim (all tensors, or all compact MXTensors of one format)."""
    first = parts[0]
    if not isinstance(first, MXTensor):
        return torch.cat(list(parts), dim=dim)
    for p in parts:
        if not isinstance(p, MXTensor) or (p.axis, p.elem, p.scale_layout) != (first.axis, first.elem, "compact"):
            raise ValueError(f"{name}: expected compact MXTensors blocked on axis {first.axis} ({first.elem}) "
                             f"to join along axis {dim}")
    data = torch.cat([p.data.view(torch.uint8) for p in parts], dim=dim).view(first.data.dtype)
    scale = torch.cat([p.scale for p in parts], dim=dim)
    return MXTensor(data, scale, first.axis, first.elem, "compact")


# --------------------------------------------------------------------------------------------------
# operand slots: (value, codes, scales, format) with the value the differentiable slot
# --------------------------------------------------------------------------------------------------

def to_slots(x: Any) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tuple[int, str, str]]]:
    """A plain tensor -> (x, None, None, None). An MXTensor -> (its gradient proxy or None, uint8
    codes, scales, (axis, elem, scale_layout))."""
    if isinstance(x, MXTensor):
        proxy = x.grad_proxy if isinstance(x, TrackedMXTensor) else None
        return proxy, x.data.view(torch.uint8), x.scale, (x.axis, x.elem, x.scale_layout)
    return x, None, None, None


def from_slots(value: Optional[Tensor], codes: Optional[Tensor], scales: Optional[Tensor],
               fmt: Optional[Tuple[int, str, str]]) -> Any:
    """The operand a backend takes: the tensor, or a plain MXTensor of the codes and scales."""
    if fmt is None:
        return value
    axis, elem, layout = fmt
    return MXTensor(codes.view(FP8_DTYPES[elem]), scales, axis, elem, layout)


def wire_tensors(x: Any) -> List[Tensor]:
    """The contiguous tensors that carry x between ranks: [x] or [uint8 codes, scales]."""
    if isinstance(x, MXTensor):
        return [x.data.view(torch.uint8).contiguous(), x.scale.contiguous()]
    return [x.contiguous()]


def from_wire(like: Any, tensors: Sequence[Tensor]) -> Any:
    """The operand shaped like `like` rebuilt from what wire_tensors(like) sent."""
    if isinstance(like, MXTensor):
        return MXTensor(tensors[0].view(like.data.dtype), tensors[1], like.axis, like.elem, like.scale_layout)
    return tensors[0]
