"""MXFP8 quantize and dequantize (SEMANTICS.md sections 1 and 2), bit-exact, NumPy + ml_dtypes.

Every step works on fp32 bit patterns held in integer arrays, so nothing depends on the platform's
log2 or on division: the scale byte is read from exponent/mantissa fields, element codes come from one
fp32 multiply by an exact power of two followed by one round-to-nearest-even into the element format.

Layout trick: an input of shape (..., L, ...) blocked on axis `a` is viewed, without copying, as
(pre, L/32, 32, post) where pre/post are the products of the dimensions before/after `a`. Reducing over
the size-32 dimension gives the compact scales (pre, L/32, post), which reshape straight to the
compact scale shape; broadcasting the per-block multiplier back over that dimension keeps the data in
its original layout for any axis (no transposes, no Python loops over blocks).

Choices SEMANTICS.md leaves open (tested in tests/test_quantize.py):
- `scale_bytes` on a NaN amax returns 255 in every mode and on +Inf amax returns 254 in every mode
  (rceil gets both from the bit rule; floor/ceil/even follow the saturate policy of 1.2).
- "even" rounds amax's mantissa with an integer add that may carry into the exponent field; a carry out
  of fp32's largest binade (amax >= 2^128 after rounding) still reads the exponent 255 -> byte 247 for
  e4m3 / 240 for e5m2, the same as floor of the next binade. Only fp32 values within half an element
  ulp of fp32 max reach it.
- A tuple `axis` must name distinct axes; repeating one (also as a negative alias) is a ValueError.
- Dequantize computes the product in fp32; decode(code) * 2^(e-127) is exact there except when it
  exceeds fp32 max (scale bytes above 254-8 with large codes), where it becomes +-Inf -- e.g. the
  saturated code 0x7E in a block whose scale is 254 (an Inf block) dequantizes back to Inf.
"""
from __future__ import annotations

import functools
from typing import Any, Tuple, Union

import numpy as np

from .lazy_ml_dtypes import ml_dtypes
from . import checks
from .constants import (
    BLOCK_SIZE,
    E8M0_MAX_FINITE,
    E8M0_NAN,
    ELEM_FORMATS,
    FLOAT_DTYPES,
    NAN_CODE,
    NONFINITE_POLICIES,
    OUT_DTYPES,
    SCALE_LAYOUTS,
    SCALE_MODES,
    ElemFormat,
)
from .mxtensor import MXTensor

__all__ = [
    "mxfp8_quantize",
    "mxfp8_dequantize",
    "validate_mxfp8_quantize",
    "validate_mxfp8_dequantize",
    "scale_bytes",
    "encode",
    "scale_multiplier",
    "scale_value",
    "normalize_axes",
]

_F32_EXP_MASK = 0x7F800000  # bits of +Inf: the exponent field all ones
_F32_MANT_MASK = 0x007FFFFF
_F32_ABS_MASK = 0x7FFFFFFF
_F32_NAN_BITS = 0x7FC00000
_HALF_SUBNORMAL_MANT = 0x400000  # mantissa of 2^-127 = 0.5 * 2^-126, fp32's largest E8M0-0 value


def _numpy_elem_dtype(elem: str):
    """ml_dtypes' type of an element format's codes (ml_dtypes loads at the first reference call)."""
    return getattr(ml_dtypes, ELEM_FORMATS[elem].numpy_dtype_name)


@functools.lru_cache(maxsize=None)
def _max_finite_code(elem: str) -> int:
    """Byte of +max: 0x7E (e4m3), 0x7B (e5m2); codes of larger magnitude are NaN (or e5m2's Inf)."""
    return int(np.array(ELEM_FORMATS[elem].max, np.float32).astype(_numpy_elem_dtype(elem)).view(np.uint8))


def _out_numpy_dtype(name: str) -> np.dtype:
    return np.dtype({"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[name])


AxisArg = Union[int, Tuple[int, ...]]


# ----------------------------------------------------------------------------------------------
# validators


def normalize_axes(axis: Any, ndim: int) -> Tuple[Tuple[int, ...], bool]:
    """(non-negative axes, whether the caller passed a tuple) for mxfp8_quantize's `axis` argument."""
    if isinstance(axis, (tuple, list)):
        if len(axis) == 0:
            raise ValueError("axis: expected an int or a non-empty tuple of ints, got ()")
        axes = tuple(checks.normalize_axis("axis", a, ndim) for a in axis)
        if len(set(axes)) != len(axes):
            raise ValueError(f"axis: expected distinct axes, got {tuple(axis)} (normalised {axes})")
        return axes, True
    return (checks.normalize_axis("axis", axis, ndim),), False


def validate_mxfp8_quantize(x, axis=-1, elem="e4m3", scale_mode="rceil", nonfinite="saturate",
                            scale_layout="compact"):
    checks.require_dtype("x", x, FLOAT_DTYPES)
    checks.require_choice("elem", elem, tuple(ELEM_FORMATS))
    checks.require_choice("scale_mode", scale_mode, SCALE_MODES)
    checks.require_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
    checks.require_choice("scale_layout", scale_layout, SCALE_LAYOUTS)
    axes, _ = normalize_axes(axis, len(x.shape))
    for a in axes:
        checks.require_blocked_axis("x", x, a)


def validate_mxfp8_dequantize(t, out_dtype="float32"):
    if not isinstance(t, MXTensor):
        raise TypeError(f"t: expected an MXTensor, got {type(t).__name__}")
    expect = ELEM_FORMATS[t.elem].numpy_dtype_name
    if checks.dtype_name(t.data) != expect:
        raise TypeError(f"t: expected data dtype {expect} for elem {t.elem!r}, got {checks.dtype_name(t.data)}")
    if checks.dtype_name(t.scale) != "uint8":
        raise TypeError(f"t: expected scale dtype uint8, got {checks.dtype_name(t.scale)}")
    checks.require_choice("out_dtype", out_dtype, OUT_DTYPES)


# ----------------------------------------------------------------------------------------------
# public bit-level helpers


def _f32_bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def scale_bytes(amax_f32: Any, elem: str = "e4m3", scale_mode: str = "rceil") -> np.ndarray:
    """E8M0 scale bytes (uint8, same shape) for per-block fp32 amax values (>= 0, Inf or NaN allowed).

    rceil: SEMANTICS 1.1 steps 2-3 (one fp32 multiply by the constant R, then the exponent-bit rule).
    floor / ceil / even: SEMANTICS 1.2 from amax's own exponent bits.
    NaN amax -> 255 and +Inf amax -> 254 in every mode (see the module docstring).
    """
    fmt = ELEM_FORMATS[elem]
    amax = np.abs(np.asarray(amax_f32, dtype=np.float32))  # the sign of an amax carries nothing
    if scale_mode == "rceil":
        r = np.array(fmt.inv_max_bits, dtype=np.uint32).view(np.float32)
        bits = _f32_bits(amax * r).astype(np.int64)  # p = RN_f32(amax * R)
        biased = bits >> 23 & 0xFF
        mant = bits & _F32_MANT_MASK
        e = biased + (mant > 0)
        e = np.where(biased == E8M0_MAX_FINITE, E8M0_MAX_FINITE, e)  # p >= 2^127: the largest scale
        e = np.where((biased == 0) & (mant <= _HALF_SUBNORMAL_MANT), 0, e)  # p <= 2^-127
        e = np.where(biased == 0xFF, np.where(mant > 0, E8M0_NAN, E8M0_MAX_FINITE), e)
        return e.astype(np.uint8)
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode: expected one of {SCALE_MODES}, got {scale_mode!r}")
    bits = _f32_bits(amax).astype(np.int64)
    nonfinite = bits >> 23 & 0xFF
    is_nan = (nonfinite == 0xFF) & ((bits & _F32_MANT_MASK) != 0)
    is_inf = (nonfinite == 0xFF) & ((bits & _F32_MANT_MASK) == 0)
    if scale_mode == "even":
        # Round amax's mantissa to the element's width (ties away from zero in magnitude, like
        # torchao), letting the carry bump the exponent.
        shift = 23 - fmt.mbits
        bits = (bits + (1 << (shift - 1))) & ~((1 << shift) - 1)
    biased = bits >> 23 & 0x1FF  # 9 bits: an "even" carry out of 254 reads 255
    e = biased - fmt.emax
    if scale_mode == "ceil":
        e = e + ((bits & _F32_MANT_MASK) != 0)
    e = np.maximum(e, 0)
    e = np.where(is_inf, E8M0_MAX_FINITE, e)
    e = np.where(is_nan, E8M0_NAN, e)
    return e.astype(np.uint8)


def scale_multiplier(scale_u8: Any) -> np.ndarray:
    """fp32 s_inv = exact 2^(127-e) for E8M0 bytes e (e=0 -> 2^127, e=254 -> 2^-127, 255 -> NaN)."""
    e = np.asarray(scale_u8, dtype=np.uint8).astype(np.uint32)
    # 2^(127-e) has biased exponent 254-e for e <= 253; e = 254 is the subnormal 2^-127.
    bits = np.where(e <= 253, (254 - np.minimum(e, 253)) << 23, _HALF_SUBNORMAL_MANT)
    bits = np.where(e == E8M0_NAN, _F32_NAN_BITS, bits).astype(np.uint32)
    return bits.view(np.float32)


def scale_value(scale_u8: Any) -> np.ndarray:
    """fp32 2^(e-127) for E8M0 bytes e (e=0 -> the subnormal 2^-127, 255 -> NaN)."""
    e = np.asarray(scale_u8, dtype=np.uint8).astype(np.uint32)
    bits = np.where(e == 0, _HALF_SUBNORMAL_MANT, e << 23)
    bits = np.where(e == E8M0_NAN, _F32_NAN_BITS, bits).astype(np.uint32)
    return bits.view(np.float32)


def encode(y_f32: Any, elem: str = "e4m3") -> np.ndarray:
    """uint8 element codes of fp32 values: RN (ties to even) into the element format with saturation to
    +-max (Inf -> +-max), NaN -> 0x7F, signed zeros and subnormal codes kept (SEMANTICS 1.4).

    ml_dtypes rounds fp32 -> fp8 to nearest even in one step but overflows to NaN/Inf instead of
    saturating and writes its own NaN bytes, hence the clip before and the NaN fix after.
    """
    fmt = ELEM_FORMATS[elem]
    y = np.asarray(y_f32, dtype=np.float32)
    lim = np.float32(fmt.max)
    clipped = np.clip(y, -lim, lim)  # NaN passes through clip unchanged
    with np.errstate(invalid="ignore"):  # NaN -> fp8 is fixed up below
        codes = clipped.astype(_numpy_elem_dtype(elem)).view(np.uint8)
    nan = np.isnan(y)
    if nan.any():
        codes = np.where(nan, np.uint8(NAN_CODE), codes)
    return codes


# ----------------------------------------------------------------------------------------------
# quantize


def _block_view(x32: np.ndarray, axis: int) -> np.ndarray:
    """x as (pre, L/32, 32, post): a view for C-contiguous x."""
    shape = x32.shape
    pre = int(np.prod(shape[:axis], dtype=np.int64))
    post = int(np.prod(shape[axis + 1:], dtype=np.int64))
    return x32.reshape(pre, shape[axis] // BLOCK_SIZE, BLOCK_SIZE, post)


def _quantize_axis(x32: np.ndarray, axis: int, fmt: ElemFormat, scale_mode: str, nonfinite: str,
                   scale_layout: str) -> MXTensor:
    blocks = _block_view(x32, axis)
    # One scratch buffer serves first as |x| bits, then as y: fewer fresh 4-byte arrays to fault in.
    scratch = np.empty(blocks.shape, np.int32)
    abs_bits = np.bitwise_and(blocks.view(np.int32), np.int32(_F32_ABS_MASK), out=scratch)
    raw_max = abs_bits.max(axis=2)  # |x| bits order like |x|; NaN bits exceed Inf's, flagging NaN blocks too

    has_nan = raw_max > _F32_EXP_MASK
    any_nonfinite = bool((raw_max >= _F32_EXP_MASK).any())
    amax_bits = raw_max.copy()
    if has_nan.any():
        # amax ignores NaN (SEMANTICS 1.1 step 1): redo the max for the NaN blocks only, NaNs zeroed.
        p, b, q = np.nonzero(has_nan)
        sub = abs_bits[p, b, :, q]  # (k, 32)
        amax_bits[p, b, q] = np.where(sub > _F32_EXP_MASK, 0, sub).max(axis=1)
    amax = amax_bits.view(np.float32)
    inf_blocks = amax_bits == _F32_EXP_MASK

    scale = scale_bytes(amax, fmt.name, scale_mode)
    if nonfinite == "saturate":
        scale = np.where(inf_blocks, np.uint8(E8M0_MAX_FINITE), scale)
    else:  # nan_block: any NaN or Inf -> byte 255, and s_inv = NaN makes every code of the block NaN
        scale = np.where(raw_max >= _F32_EXP_MASK, np.uint8(E8M0_NAN), scale)
    scale = scale.astype(np.uint8)

    # y = RN_f32(x * s_inv): one multiply by an exact power of two
    y = np.multiply(blocks, scale_multiplier(scale)[:, :, None, :], out=scratch.view(np.float32))
    # Element codes as `encode` makes them, with two passes skipped when they cannot matter: rceil keeps
    # every finite y below the format's overflow threshold (SEMANTICS 1.1; tested as "rceil never
    # saturates"), so only Inf blocks and the other scale modes need the clip; NaN codes exist only when
    # some block holds a NaN or Inf.
    if scale_mode != "rceil" or inf_blocks.any():
        np.clip(y, np.float32(-fmt.max), np.float32(fmt.max), out=y)
    with np.errstate(invalid="ignore"):  # NaN -> fp8: fixed below
        codes = y.astype(_numpy_elem_dtype(fmt.name)).view(np.uint8)
    if any_nonfinite:
        # after the clip, a code whose magnitude exceeds the largest finite code's is ml_dtypes' NaN
        codes = np.where((codes & 0x7F) > _max_finite_code(fmt.name), np.uint8(NAN_CODE), codes)
    codes = codes.reshape(x32.shape)

    compact_shape = list(x32.shape)
    compact_shape[axis] //= BLOCK_SIZE
    t = MXTensor(codes.view(_numpy_elem_dtype(fmt.name)), scale.reshape(compact_shape), axis, fmt.name)
    if scale_layout == "swizzled":
        from .swizzle import swizzle_scales

        t = swizzle_scales(t)
    return t


def mxfp8_quantize(x, axis: AxisArg = -1, elem: str = "e4m3", scale_mode: str = "rceil",
                   nonfinite: str = "saturate", scale_layout: str = "compact"):
    """Quantize x (float32 / bfloat16 / float16 NumPy array) to MXFP8 blocked along `axis`.

    Returns an MXTensor (data: ml_dtypes float8 codes with x's shape; scale: uint8 E8M0 bytes, compact
    or swizzled). A tuple `axis` such as (-1, 0) returns a tuple of MXTensors, one per axis in the given
    order, each computed from the original values. See the module docstring for the open choices.
    """
    validate_mxfp8_quantize(x, axis, elem, scale_mode, nonfinite, scale_layout)
    x32 = np.ascontiguousarray(x).astype(np.float32, copy=False)  # widening is exact
    axes, as_tuple = normalize_axes(axis, x32.ndim)
    fmt = ELEM_FORMATS[elem]
    outs = tuple(_quantize_axis(x32, a, fmt, scale_mode, nonfinite, scale_layout) for a in axes)
    return outs if as_tuple else outs[0]


# ----------------------------------------------------------------------------------------------
# dequantize


def mxfp8_dequantize(t: MXTensor, out_dtype: str = "float32") -> np.ndarray:
    """x = RN_out(decode(code) * 2^(e-127)) with the product in fp32 (SEMANTICS 2).

    Scale 255 makes the whole block NaN; scale 0 means 2^-127. Swizzled scales are unswizzled first.
    Products beyond fp32 range become +-Inf (module docstring). Every NaN is written as the positive
    quiet NaN (fp32 0x7FC00000, bf16 0x7FC0) so outputs compare as bytes across backends.
    """
    validate_mxfp8_dequantize(t, out_dtype)
    if t.scale_layout == "swizzled":
        from .swizzle import unswizzle_scales

        t = unswizzle_scales(t)
    data = np.ascontiguousarray(t.data)
    values = data.astype(np.float32)  # every e4m3/e5m2 code is exact in fp32
    blocks = _block_view(values, t.axis)
    scale = np.asarray(t.scale).reshape(blocks.shape[0], blocks.shape[1], blocks.shape[3])
    with np.errstate(over="ignore"):  # beyond fp32 max is +-Inf by definition (module docstring)
        out = (blocks * scale_value(scale)[:, :, None, :]).reshape(data.shape)
    nan = np.isnan(out)
    if nan.any():  # one NaN bit pattern whatever the hardware propagates (CPU keeps payloads, GPUs don't)
        out[nan] = np.float32(np.nan)
    return out.astype(_out_numpy_dtype(out_dtype), copy=False)
