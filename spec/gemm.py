"""MXFP8 GEMM (SEMANTICS.md section 5): `out[m, n] = RN_out(sum_k dq(a)[m, k] * dq(b)[n, k])`.

The sum is the *exact* real sum; it is rounded once, to nearest even, into `out_dtype`.

How the exact sum is obtained (`exact_matmul_rounded`, shared with spec.mla_q and spec.rmsnorm)
- Operands are widened to float64 exactly. An MXFP8 element is decode(code) * 2^(e-127): the code has
  at most 4 significant bits (e4m3; 3 for e5m2) and the E8M0 scale is a power of two, so every
  dequantized value has <= 4 significant bits and every product of two has <= 8. Magnitudes: e4m3
  values lie in [2^-9, 448], e5m2 in [2^-16, 57344], scales in [2^-127, 2^127], so a product lies in
  [2^-286, 2^286], far inside float64's normal range [2^-1022, 2^1024]. Every product is exact.
  (bf16 x bf16 products have 16 bits, fp32 x bf16 32, fp32 x fp32 48: all exact in float64's 53.)
- The float64 *sum* is exact when all partial sums fit 53 bits: if every product is a multiple of
  2^q and sum_k |p_k| < 2^(q+53), every partial sum, in any order or blocking, is a multiple of 2^q
  below 2^(q+53) and so representable. With 8-bit products this holds whenever the products of one
  dot product span fewer than 53 - 8 - log2(K) binades: 29 binades for K = 2^16, 34 for K = 1536.
  That covers same-scale blocks and the small-integer-times-power-of-two inputs of the byte tests,
  but not two blocks whose scales differ by 2^40 -- MX scales may differ by up to 2^254 -- so the
  spec does not *assume* it. Per output element it uses the first of:
  1. the exactness certificate above (q from each row's smallest nonzero magnitude and the operand's
     significant bits, sum |p| from |a| @ |b|^T),
  2. an error bound: BLAS's float64 result s satisfies |s - exact| <= (2K + 4) * 2^-53 * sum |p|
     (twice the classical gamma_K bound, covering FMA or not and the rounding of s +- bound); when
     both ends of that interval round to the same out_dtype bytes, so does the exact sum (RN is
     monotone), and that is the answer;
  3. otherwise (a sum within ~K ulps64 of a rounding boundary, or an exact tie the certificate could
     not see), per element: math.fsum (correctly rounded float64 sum) and the sign of the residual
     (fsum of the products minus that sum), giving the sum rounded *to odd* in float64.
  Rounding to odd at 53 bits and then to nearest at 24 (fp32) is correct rounding (53 >= 24 + 2);
  for bf16 the value goes to odd at fp32 first, then to nearest bf16. A plain float64 -> bf16 cast is
  wrong: ml_dtypes and torch go through fp32 and round twice.

Choices SEMANTICS.md leaves open (tested in tests/test_gemm.py)
- An exact zero sum is +0.0 (an accumulator that starts at +0); a nonzero sum that underflows keeps
  its sign (RN of a tiny negative value is -0.0). Products below fp32's range (|p| < 2^-149, only with
  scale bytes near 0) are outside what fp32 hardware reproduces: its products flush to +-0 and the
  accumulator ends +0, so conformance tests keep such cases to spec tests.
- Non-finite values (scale byte 255 -> NaN block; e5m2 Inf codes) follow IEEE: the output is NaN if
  any product is NaN (a NaN operand, or Inf * 0) or the products hold both +Inf and -Inf, else +-Inf
  if any product is infinite. Every NaN is written as the positive quiet NaN (fp32 0x7FC00000, bf16
  0x7FC0). A finite exact sum beyond out_dtype's range rounds to +-Inf (IEEE RN overflow).
- Swizzled scales are accepted (unswizzled first); `a` and `b` may differ in elem (e4m3 x e5m2).
- Dequantized values are widened straight to float64 (not through spec.quantize's fp32 dequantize,
  which overflows to Inf for scale bytes near 254 with large codes).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .lazy_ml_dtypes import ml_dtypes
from . import checks
from .constants import E8M0_BIAS, E8M0_NAN, ELEM_FORMATS, OUT_DTYPES
from .mxtensor import MXTensor

__all__ = ["mxfp8_gemm", "validate_mxfp8_gemm", "dequantize_f64", "exact_matmul_rounded",
           "exact_rowsum_rounded", "round_f64_to", "round_to_odd_f32"]

_NO_BITS = 1 << 20  # quantum exponent of a row with no nonzero entry: anything is exact
MX_SIG_BITS = 4  # significant bits of a dequantized e4m3 (e5m2: 3) value


# ----------------------------------------------------------------------------------------------
# validators


def require_mxtensor_operand(name: str, t: Any, axis: int, axis_label: str) -> None:
    """t is an MXTensor of 2 dimensions blocked along `axis`, with data/scale dtypes matching its elem."""
    if not isinstance(t, MXTensor):
        raise TypeError(f"{name}: expected an MXTensor, got {type(t).__name__}")
    if t.ndim != 2:
        raise ValueError(f"{name}: expected 2 dimensions, got shape {t.shape}")
    want = ELEM_FORMATS[t.elem].numpy_dtype_name
    if checks.dtype_name(t.data) != want:
        raise TypeError(f"{name}: expected data dtype {want} for elem {t.elem!r}, got {checks.dtype_name(t.data)}")
    if checks.dtype_name(t.scale) != "uint8":
        raise TypeError(f"{name}: expected scale dtype uint8, got {checks.dtype_name(t.scale)}")
    if t.axis != axis:
        raise ValueError(f"{name}: expected an MXTensor blocked along {axis_label} (axis {axis}), got axis {t.axis}")


def validate_mxfp8_gemm(a, b, out_dtype="bfloat16"):
    """Raise TypeError/ValueError naming the first bad argument of `mxfp8_gemm`."""
    require_mxtensor_operand("a", a, 1, "K")
    require_mxtensor_operand("b", b, 1, "K")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a and b: expected equal K (dim 1), got a {a.shape} and b {b.shape}")
    checks.require_choice("out_dtype", out_dtype, OUT_DTYPES)


# ----------------------------------------------------------------------------------------------
# exact widening and rounding helpers (public to spec's other modules)


def dequantize_f64(t: MXTensor) -> np.ndarray:
    """Exact float64 values decode(code) * 2^(e-127) of an MXTensor (NumPy arrays), any axis/layout.

    Scale byte 255 makes its block NaN, byte 0 means 2^-127; NaN codes stay NaN, e5m2 Inf codes Inf.
    """
    if t.scale_layout == "swizzled":
        from .swizzle import unswizzle_scales

        t = unswizzle_scales(t)
    codes = np.asarray(t.data).astype(np.float64)  # every fp8 code is exact in float64
    e = np.asarray(t.scale).astype(np.int64)
    factor = np.ldexp(1.0, e - E8M0_BIAS)
    factor = np.where(e == E8M0_NAN, np.nan, factor)
    factor = np.repeat(factor, codes.shape[t.axis] // factor.shape[t.axis], axis=t.axis)
    with np.errstate(invalid="ignore"):  # Inf code * NaN scale
        return codes * factor  # code (<= 4 bits) * power of two: exact


def round_to_odd_f32(x64: np.ndarray) -> np.ndarray:
    """float64 -> float32 rounded to odd: truncate toward zero, then set the last bit if inexact.

    Followed by RN into any format with <= 22 significand bits (bf16: 8) this is one correct RN of x64.
    Values beyond fp32 range become fp32 max (odd), which every narrower format rounds to Inf.
    """
    x64 = np.asarray(x64, dtype=np.float64)
    with np.errstate(over="ignore"):
        f = x64.astype(np.float32)
    back = f.astype(np.float64)
    inexact = np.isfinite(x64) & (back != x64)
    away = inexact & (np.abs(back) > np.abs(x64))  # RN went away from zero: step back toward zero
    f = np.where(away, np.nextafter(f, np.float32(0)), f)
    return (f.view(np.uint32) | inexact.astype(np.uint32)).view(np.float32)


def round_f64_to(x64: np.ndarray, out_dtype: str) -> np.ndarray:
    """One RN-even rounding of float64 values into out_dtype ("float32" or "bfloat16"), NaN canonical.

    Correct for x64 exact, or x64 = the exact value rounded to odd at 53 bits.
    """
    x64 = np.asarray(x64, dtype=np.float64)
    if out_dtype == "float32":
        with np.errstate(over="ignore"):
            out = x64.astype(np.float32)  # C double -> float: one RN
    else:
        out = round_to_odd_f32(x64).astype(ml_dtypes.bfloat16)
    nan = np.isnan(out)
    if nan.any():
        out[nan] = out.dtype.type(np.nan)  # positive quiet NaN
    return out


def _quantum_exponent(a: np.ndarray, sig_bits: int) -> np.ndarray:
    """Per row of a [M, K] float64 whose entries have <= sig_bits significant bits: an exponent q with
    every entry a multiple of 2^q. The smallest nonzero |entry| is >= 2^floor(log2 of it), so every
    entry's last bit is >= 2^(that - sig_bits + 1). _NO_BITS for a row of zeros."""
    mag = np.abs(a)
    smallest = np.where(mag > 0, mag, np.inf).min(axis=1) if a.shape[1] else np.full(a.shape[0], np.inf)
    none = ~np.isfinite(smallest)
    exp = np.frexp(np.where(none, 1.0, smallest))[1] - 1  # floor(log2 smallest)
    return np.where(none, _NO_BITS, exp - sig_bits + 1).astype(np.int64)


def _nonfinite_sums(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IEEE outcome of sum_k a[m,k]*b[n,k] where some product is non-finite: NaN/+Inf/-Inf, else 0.

    Counting with 0/1 matmuls keeps it order-free: NaN if a NaN operand meets anything, or Inf meets
    0, or both infinite signs occur.
    """
    f = lambda m: m.astype(np.float64)  # noqa: E731  (0/1 indicator matrices; counts are exact)
    a_nan, b_nan = np.isnan(a), np.isnan(b)
    a_pinf, a_ninf, b_pinf, b_ninf = a == np.inf, a == -np.inf, b == np.inf, b == -np.inf
    a_pos, a_neg, b_pos, b_neg = a > 0, a < 0, b > 0, b < 0
    a_zero, b_zero = a == 0, b == 0
    nan = a_nan.any(1)[:, None] | b_nan.any(1)[None, :]
    nan = nan | ((f(a_pinf | a_ninf) @ f(b_zero).T) > 0) | ((f(a_zero) @ f(b_pinf | b_ninf).T) > 0)
    pos = f(a_pinf) @ f(b_pos).T + f(a_ninf) @ f(b_neg).T + f(a_pos) @ f(b_pinf).T + f(a_neg) @ f(b_ninf).T
    neg = f(a_pinf) @ f(b_neg).T + f(a_ninf) @ f(b_pos).T + f(a_pos) @ f(b_ninf).T + f(a_neg) @ f(b_pinf).T
    nan = nan | ((pos > 0) & (neg > 0))
    out = np.where(pos > 0, np.inf, np.where(neg > 0, -np.inf, 0.0))
    return np.where(nan, np.nan, out)


def _odd_sum(products: np.ndarray) -> float:
    """The exact sum of float64 `products` rounded to odd at 53 bits (exact when representable)."""
    p = products.tolist()
    s = math.fsum(p)  # correctly rounded (Shewchuk); products are finite and far from overflow
    p.append(-s)
    r = math.fsum(p)  # RN of the residual: same sign as the exact residual, 0 only when exact
    if r == 0.0:
        return s + 0.0  # exact zero -> +0.0
    bits = np.array(s, dtype=np.float64).view(np.int64)
    if bits & 1:
        return s
    return float(np.nextafter(s, math.copysign(math.inf, r)))


def _round_sums(s: np.ndarray, abs_sum: np.ndarray, q: np.ndarray, k: int, out_dtype: str,
                terms) -> np.ndarray:
    """RN_out of exact sums of k finite float64 terms, given s (the float64 sum in any order, error
    <= gamma_k * sum |t|), abs_sum (sum |t|, computed likewise), q (every term a multiple of 2^q) and
    terms(*index) -> the terms of one sum, for the rare exact fallback. Steps 1-3 of the docstring."""
    # 1. certificate: all partial sums exact.
    limit = np.ldexp(1.0 - 2.0 ** -20, np.minimum(q + 53, 1000))  # slack covers abs_sum's rounding
    exact = abs_sum < limit
    out = round_f64_to(np.where(exact & (s == 0), 0.0, s), out_dtype)  # exact zero -> +0.0

    # 2. error bound: both ends of the interval round alike.
    todo = ~exact
    if todo.any():
        bound = abs_sum[todo] * ((2 * k + 4) * 2.0 ** -53)
        lo = round_f64_to(s[todo] - bound, out_dtype)
        hi = round_f64_to(s[todo] + bound, out_dtype)
        uint = f"u{out.dtype.itemsize}"
        same = lo.view(uint) == hi.view(uint)
        idx = np.nonzero(todo)
        out[tuple(i[same] for i in idx)] = lo[same]
        # 3. exact per-element fallback.
        for where in zip(*(i[~same] for i in idx)):
            out[where] = round_f64_to(np.array(_odd_sum(terms(*where))), out_dtype)
    return out


def exact_rowsum_rounded(terms64: np.ndarray, out_dtype: str, sig_bits: int = 53) -> np.ndarray:
    """RN_out(exact sum over the last axis) of finite float64 terms [M, K] with <= sig_bits significant
    bits each (same method as exact_matmul_rounded). Returns [M] of out_dtype."""
    t = np.ascontiguousarray(terms64, dtype=np.float64)
    q = _quantum_exponent(t, sig_bits)
    return _round_sums(t.sum(axis=1), np.abs(t).sum(axis=1), q, t.shape[1], out_dtype, lambda m: t[m])


def exact_matmul_rounded(a64: np.ndarray, b64: np.ndarray, out_dtype: str, a_bits: int = 53,
                         b_bits: int = 53) -> np.ndarray:
    """RN_out(exact sum_k a64[m,k] * b64[n,k]) for float64 a64 [M, K], b64 [N, K] whose pairwise
    products are exact in float64 (a_bits + b_bits <= 53 significant bits, exponents far from
    float64's limits). a_bits / b_bits bound the significant bits of each operand's entries (4 for
    MXFP8, 8 for bf16, 24 for fp32); they only sharpen the exactness certificate, never the result.
    Method in the module docstring. Returns [M, N] of out_dtype."""
    a64 = np.ascontiguousarray(a64, dtype=np.float64)
    b64 = np.ascontiguousarray(b64, dtype=np.float64)
    k = a64.shape[1]
    a_fin, b_fin = np.isfinite(a64), np.isfinite(b64)
    clean_a = np.where(a_fin, a64, 0.0)
    clean_b = np.where(b_fin, b64, 0.0)
    s = clean_a @ clean_b.T
    abs_sum = np.abs(clean_a) @ np.abs(clean_b).T  # >= true sum |p| * (1 - K 2^-53)

    q = _quantum_exponent(clean_a, a_bits)[:, None] + _quantum_exponent(clean_b, b_bits)[None, :]
    out = _round_sums(s, abs_sum, q, k, out_dtype, lambda m, n: clean_a[m] * clean_b[n])

    if not (a_fin.all() and b_fin.all()):
        rows = ~a_fin.all(1)
        cols = ~b_fin.all(1)
        special = np.zeros(out.shape, dtype=bool)
        special[rows, :] = True
        special[:, cols] = True
        nf = _nonfinite_sums(a64, b64)
        if special.any():  # every product in these rows/columns is non-finite, so is the sum
            out[special] = round_f64_to(nf[special], out_dtype)
    return out


# ----------------------------------------------------------------------------------------------
# the op


def mxfp8_gemm(a: MXTensor, b: MXTensor, out_dtype: str = "bfloat16") -> np.ndarray:
    """out [M, N] = RN_out(exact sum_k dq(a)[m, k] * dq(b)[n, k]) for MXTensors a [M, K], b [N, K]
    blocked along K (compact or swizzled scales); out_dtype "bfloat16" (default) or "float32".

    float64 is wide enough for every product (8 significant bits, magnitudes within 2^+-286); the sum
    is made exact as the module docstring explains (fast path: float64 BLAS with an exactness
    certificate / error bound; rare elements near a rounding boundary: exact summation).
    """
    validate_mxfp8_gemm(a, b, out_dtype)
    return exact_matmul_rounded(dequantize_f64(a), dequantize_f64(b), out_dtype, MX_SIG_BITS, MX_SIG_BITS)
