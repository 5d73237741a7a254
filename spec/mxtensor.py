"""The MXFP8 tensor: element codes plus E8M0 scale bytes, and the state needed to read them.

Array-agnostic: `data` and `scale` may be NumPy arrays (spec) or torch tensors (backends). The type
carries everything a consumer needs (blocked axis, element format, scale layout), so nobody has to
remember whether scales were swizzled.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .constants import BLOCK_SIZE, ELEM_FORMATS, SCALE_LAYOUTS, SWIZZLE_COLS, SWIZZLE_ROWS


def _roundup(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class MXTensor:
    """data: FP8 codes with the logical shape (float8_e4m3fn / float8_e5m2).
    scale: uint8 E8M0 bytes. Compact layout: the logical shape with the blocked axis divided by 32.
    Swizzled layout: the padded 2-D scale matrix (R', C') holding its bytes in swizzled order, where
    the 2-D matrix is the compact scales with the blocked axis moved last and the others flattened.
    axis: the blocked axis, non-negative.
    """

    data: Any
    scale: Any
    axis: int
    elem: str = "e4m3"
    scale_layout: str = "compact"

    def __post_init__(self):
        nd = len(self.data.shape)
        if not (0 <= self.axis < nd):
            raise ValueError(f"MXTensor axis: expected 0 <= axis < {nd}, got {self.axis}")
        if self.elem not in ELEM_FORMATS:
            raise ValueError(f"MXTensor elem: expected one of {tuple(ELEM_FORMATS)}, got {self.elem!r}")
        if self.scale_layout not in SCALE_LAYOUTS:
            raise ValueError(
                f"MXTensor scale_layout: expected one of {SCALE_LAYOUTS}, got {self.scale_layout!r}"
            )
        if self.data.shape[self.axis] % BLOCK_SIZE:
            raise ValueError(
                f"MXTensor data: blocked axis {self.axis} has length {self.data.shape[self.axis]}, "
                f"expected a multiple of {BLOCK_SIZE}"
            )
        expect = self.compact_scale_shape if self.scale_layout == "compact" else self.swizzled_scale_shape
        if tuple(self.scale.shape) != expect:
            raise ValueError(
                f"MXTensor scale: expected shape {expect} for {self.scale_layout} scales of data "
                f"{tuple(self.data.shape)} blocked on axis {self.axis}, got {tuple(self.scale.shape)}"
            )

    @property
    def shape(self) -> tuple:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    @property
    def compact_scale_shape(self) -> tuple:
        s = list(self.data.shape)
        s[self.axis] //= BLOCK_SIZE
        return tuple(s)

    @property
    def scale_matrix_shape(self) -> tuple:
        """(R, C) of the 2-D scale matrix: blocked axis last, other axes flattened in order."""
        c = self.data.shape[self.axis] // BLOCK_SIZE
        r = 1
        for i, n in enumerate(self.data.shape):
            if i != self.axis:
                r *= n
        return (r, c)

    @property
    def swizzled_scale_shape(self) -> tuple:
        r, c = self.scale_matrix_shape
        return (_roundup(r, SWIZZLE_ROWS), _roundup(c, SWIZZLE_COLS))

    def replace(self, **changes) -> "MXTensor":
        return replace(self, **changes)

    def __repr__(self) -> str:
        return (
            f"MXTensor(shape={self.shape}, axis={self.axis}, elem={self.elem!r}, "
            f"scale_layout={self.scale_layout!r}, data={type(self.data).__module__}.{type(self.data).__name__})"
        )
