"""The e4m3 scale-byte and code helpers of the Gluon fused-Q kernels (mla_q_gluon.py).

They restate _mxfp8's (same constants, same operations): Gluon cannot call those triton.jit functions,
whose tl.full carries no layout.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ._mxfp8 import E4M3_INV_MAX_BITS, F32_ABS_MASK, F32_INF_BITS, F32_MANT_MASK, HALF_SUBNORMAL_MANT

_ABS, _INF, _MANT = F32_ABS_MASK, F32_INF_BITS, F32_MANT_MASK
_HALF_SUBNORMAL, _INV_448 = HALF_SUBNORMAL_MANT, E4M3_INV_MAX_BITS


@gluon.jit
def scale_byte(amax):
    """E8M0 byte (int32) of an e4m3 block, rceil (SEMANTICS 1.1; _mxfp8.rceil_scale_from_amax_bits):
    amax is the NaN-ignoring max of |v| (an all-NaN block reduced to NaN counts as 0)."""
    amax = gl.where(amax == amax, amax, 0.0)
    r = gl.full(amax.shape, _INV_448, gl.int32, amax.type.layout).to(gl.float32, bitcast=True)
    p = (amax * r).to(gl.int32, bitcast=True) & _ABS
    e = (gl.minimum(p, 0x7F000000) + _MANT) >> 23
    e = gl.where(p <= _HALF_SUBNORMAL, 0, e)
    return gl.where(p > _INF, 255, e)


@gluon.jit
def _multiplier(e):
    """fp32 2^(127 - e), the factor codes are computed with (_mxfp8.scale_multiplier)."""
    bits = gl.where(e <= 253, (254 - e) << 23, _HALF_SUBNORMAL)
    bits = gl.where(e == 255, 0x7FC00000, bits)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def codes(v, e_expanded):
    """e4m3 codes (uint8) of v * 2^(127 - e): the hardware cvt.rn.satfinite saturates and maps the
    canonical NaN of the product to 0x7F (see _mxfp8.encode_e4m3_arith)."""
    return (v * _multiplier(e_expanded)).to(gl.float8e4nv).to(gl.uint8, bitcast=True)
