"""Eager torch `mla_kv_quantize` (SEMANTICS.md section 9): k_nope, k_pe and v quantized by this backend's
mxfp8_quantize (strided inputs read as they are), k's codes and scales joined along the last axis
with k_pe's broadcast over the heads when it is shared. Byte-equal to spec.mla_kv: every block of k
lies inside one part, so quantizing the parts is quantizing the concatenation. With cos / sin, k_pe is
first rotated by this backend's rope (byte-equal to spec.rope), as spec.mla_kv composes the two."""
from __future__ import annotations

import torch

from spec.constants import BLOCK_SIZE, MLA_ROPE_DIM
from spec.mla_kv import mla_kv_axes
from spec.mxtensor import MXTensor

from ..registry import register
from ._common import torch_tensor_reasons
from .quantize import mxfp8_quantize
from .rope import rope


@register("mla_kv_quantize", "torch", check=torch_tensor_reasons)
def mla_kv_quantize(k_nope, k_pe, v, layout="bshd", cos=None, sin=None):
    seq, _ = mla_kv_axes(layout)
    if cos is not None:
        k_pe = rope(k_pe, cos, sin, style="mla", layout=layout)
    lead = tuple(k_nope.shape[:-1])
    kn = mxfp8_quantize(k_nope, axis=-1)
    kp = mxfp8_quantize(k_pe, axis=-1)
    vq = mxfp8_quantize(v, axis=seq)
    kp_data = kp.data.view(torch.uint8).expand(lead + (MLA_ROPE_DIM,))
    kp_scale = kp.scale.expand(lead + (MLA_ROPE_DIM // BLOCK_SIZE,))
    codes = torch.cat([kn.data.view(torch.uint8), kp_data], dim=-1).view(torch.float8_e4m3fn)
    scales = torch.cat([kn.scale, kp_scale], dim=-1)
    return (MXTensor(codes, scales, len(lead), "e4m3", "compact"),
            MXTensor(vq.data.contiguous(), vq.scale.contiguous(), seq, "e4m3", "compact"))
