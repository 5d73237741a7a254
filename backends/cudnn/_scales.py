"""MXFP8 scale re-layout for cuDNN's MXFP8 SDPA, in torch (same bytes as spec.swizzle).

`pack_attention_scales(t, role, layout)` returns exactly the bytes and shape of
`spec.swizzle.pack_attention_scales` (SEMANTICS 3, attention paragraph): per (batch, head), the 2-D
scale matrix with the blocked axis last, zero-padded to (roundup(rows, 128), roundup(cols, 4)) and
stored in F8_128x4 order. role "qk" (blocked along D): [B, H, roundup(S,128), roundup(D/32,4)];
role "v" (blocked along S): the [D, S/32] matrix's bytes in an array shaped
[B, H, roundup(S/32,4), roundup(D,128)], which cuDNN reads as that logical shape with the S/32 dim
fastest (`v_role_view`). Swizzled input scales are unswizzled first.

Columnwise (S-blocked) scales with D > 128 -- the MXFP8 backward's q_T and k_T, D = 192 padded to 256 --
are where spec and the frontend part ways. spec packs each (batch, head) separately, so the two
128-row D planes of one (b, h) sit next to each other. The frontend 1.32 documents the dense
columnwise layout as D-plane-major over the whole tensor: atom (plane, g = b*H + h, s_tile) at
`plane * (B*H*T) + g * T + s_tile` -- the swizzle of the whole [D, (B*H*S)/32] matrix that TE's
`swizzle_col_scaling_kernel` produces, "the 128-row D tile OUTSIDE the head plane"
(cudnn/sdpa/bwd/kernels/sm100/bprop_sf_repack_mxfp8.py, which also states that the two orders
coincide for D <= 128; cudnn/sdpa/kernels/_mxfp8_sf.py, build_columnwise_sf_desc; the sdpa_mxfp8
docstring's paged-pool note). `pack_columnwise` follows the frontend: for D <= 128 (one plane; forward V, dO_T) its bytes
equal spec's, for D > 128 it writes the plane-major order (`pack_columnwise_plane_major`). Both are
tested (tests/test_cudnn_backend.py); SEMANTICS 3 should say which one it means for D > 128.

`mla_q_uproj_rope_quant`'s q_row ([T, H, 192] blocked along D, compact [T, H, 6] scales) is one
sequence in thd layout: `thd_as_bshd` views it as bshd [1, T, H, 192] (no copy), after which the
"qk" packing applies (checked against spec byte for byte in tests/test_cudnn_backend.py).
"""
from __future__ import annotations

import torch

from spec.constants import SWIZZLE_COLS, SWIZZLE_ROWS
from spec.mxtensor import MXTensor

from ..torch.swizzle import pack_attention_scales, swizzle_matrix, unswizzle_scales  # noqa: F401 (re-exported)


def _roundup(n: int, m: int) -> int:
    return -(-n // m) * m


def compact_scales(t: MXTensor) -> torch.Tensor:
    """t's compact scale bytes (the swizzled matrix unswizzled, padding dropped)."""
    return unswizzle_scales(t).scale


def _axes(layout: str):
    """(batch axis, sequence axis) of a 4-D bshd / sbhd tensor (heads axis 2, features axis 3)."""
    if layout == "bshd":
        return 0, 1
    if layout == "sbhd":
        return 1, 0
    raise ValueError(f"layout: expected 'bshd' or 'sbhd' for per-(batch, head) scale packing, got {layout!r}")


def pack_columnwise_plane_major(t: MXTensor, layout: str = "bshd") -> torch.Tensor:
    """S-blocked scales of a bshd / sbhd MXTensor in the frontend's dense columnwise order: the matrix
    [D', B*H*S''] (D padded to 128, each (b, h)'s S/32 blocks padded to 4) swizzled as one, so the
    F8_128x4 atoms run plane-major, then (b, h), then S tile. Returned as [B, H, S'', D'] bytes
    (contiguous; the same byte count as spec's packing)."""
    b_axis, s_axis = _axes(layout)
    if t.ndim != 4 or t.axis != s_axis:
        raise ValueError(f"t: expected a 4-D {layout} MXTensor blocked along axis {s_axis}, got {t.shape} axis {t.axis}")
    scale = compact_scales(t).permute(3, b_axis, 2, s_axis)  # [D, B, H, S/32]
    d, b, h, sb = scale.shape
    dp, sp = _roundup(d, SWIZZLE_ROWS), _roundup(sb, SWIZZLE_COLS)
    padded = scale.new_zeros((dp, b, h, sp))
    padded[:d, :, :, :sb] = scale
    return swizzle_matrix(padded.view(dp, b * h * sp)).view(b, h, sp, dp)


def pack_columnwise(t: MXTensor, layout: str = "bshd") -> torch.Tensor:
    """The columnwise scale bytes cuDNN's MXFP8 SDPA reads (module docstring): spec's packing when D
    fits one 128-row plane (identical bytes then), the frontend's plane-major order otherwise."""
    if _roundup(t.shape[3], SWIZZLE_ROWS) == SWIZZLE_ROWS:
        return pack_attention_scales(t, "v", layout)
    return pack_columnwise_plane_major(t, layout)


def v_role_view(packed: torch.Tensor) -> torch.Tensor:
    """A role-"v" packed buffer [B, H, S'', D'] as the strided view cuDNN is told about: logical
    [B, H, S'', D'] with strides (H*S''*D', S''*D', 1, S'') -- the same bytes, S/32 fastest."""
    b, h, sp, dp = packed.shape
    return packed.view(b, h, dp, sp).transpose(2, 3)


def v_role_strides(b: int, h: int, s_blocks_padded: int, d_padded: int):
    return (h * s_blocks_padded * d_padded, s_blocks_padded * d_padded, 1, s_blocks_padded)


def thd_as_bshd(t: MXTensor) -> MXTensor:
    """A [T, H, D] MXTensor (one sequence, e.g. mla_q_uproj_rope_quant's q_row or q_col) as bshd
    [1, T, H, D]: data and compact scales gain a leading batch axis of 1, the blocked axis shifts by one."""
    scale = compact_scales(t)
    return MXTensor(t.data.unsqueeze(0), scale.unsqueeze(0), t.axis + 1, t.elem, "compact")
