"""RMSNorm straight to MXFP8 (SEMANTICS.md section 7), NumPy + ml_dtypes.

`rmsnorm_mxfp8(x, gamma, eps=1e-6, zero_centered_gamma=False, elem="e4m3") -> (y_row, y_col, rstd)`
for x [T, D] (float32 / bfloat16 / float16), gamma [D] (same dtype choices), D and T multiples of 32.

Operation order (every step is fp32 with one RN-even rounding, no FMA), per row t:
1. x is widened to fp32 exactly.
2. ss    = RN32(sum_k x[t,k]^2)          -- the *exact* sum of the squares, rounded once (the squares
                                             are exact in float64; the sum is made exact by
                                             spec.gemm.exact_rowsum_rounded). Overflow -> +Inf.
3. ms    = RN32(ss * RN32(1/D))           -- multiply by the fp32 reciprocal, as GPU kernels do.
4. v     = RN32(ms + RN32(eps))
5. rstd  = RN32(1/sqrt(v))                -- correctly rounded. Computed as float64 1/sqrt(v) then
                                             rounded to fp32; checked exhaustively over every fp32
                                             significand (v in [1, 4); other binades scale by 4^k
                                             exactly) to equal the correctly rounded value.
6. g     = gamma widened (zero_centered_gamma: g = RN32(gamma + 1)).
7. y     = RN32(RN32(x * rstd) * g)       -- x times rstd first, then gamma (TE's order).
8. y_row = mxfp8_quantize(y, axis=-1), y_col = mxfp8_quantize(y, axis=0): elem as given, rceil,
           saturate, compact scales, both from the fp32 y (no bf16 round trip).
Returns (y_row, y_col, rstd) with rstd fp32 [T].

What a GPU backend can match (SEMANTICS is silent; this is the contract for backends):
- Steps 6-8 are bit-exact given rstd: y and its bytes follow from rstd, x and gamma alone.
- Steps 2-5 are not: a GPU reduces the squares in fp32 in its own tree order (relative error of ss
  <= (D-1) * 2^-24 in the worst case, ~sqrt(D) * 2^-24 typically), may contract step 3/4 into an FMA
  and uses an approximate rsqrt (CUDA rsqrtf: <= 2 ulp). rstd is therefore bit-exact only up to
  that. Backends are held to |rstd - spec| <= (D + 12) * 2^-25 * |spec|: any-order fp32 summation
  of D positive terms is within (D - 1) * 2^-24 relative, steps 3 and 4 add 2^-24 each, the square
  root halves the relative error, and rsqrtf (2 ulp) plus the final rounding add <= 5 * 2^-24 --
  (D + 1)/2 + 5 <= (D + 12)/2 units of 2^-24. Their y bytes must equal quantize(RN32(RN32(x *
  backend_rstd) * g)): the tests rebuild y from the backend's own rstd.
- The eager torch backend on CPU computes step 2 with a float64 sum (exact for the data in the
  tests; otherwise within one fp32 rounding) and steps 3-8 exactly as above.

Non-finite and edge values (IEEE arithmetic, no special cases): a NaN in a row makes ss, rstd and
the row's y NaN (code 0x7F); an Inf makes ss = Inf, rstd = 0, y = Inf * 0 = NaN at the Inf and +-0
elsewhere. A finite row whose ss overflows fp32 likewise gets rstd = 0 and y = +-0. A NaN rstd is
written as the positive quiet NaN 0x7FC00000 (NaN payloads after arithmetic differ between CPUs and
GPUs). eps = 0 with an
all-zero row gives v = 0, rstd = +Inf and y = 0 * Inf = NaN. eps must be a finite number >= 0.

`rmsnorm_backward(dy, x, gamma, rstd, zero_centered_gamma=False) -> (dx, dgamma)`: the gradients of
y = x * rstd * g (rstd taken as given, the forward's) for dL/dy `dy` [T, D]; x and dy float32 / bfloat16
/ float16 of one shape (any T, D >= 1), gamma [D], rstd fp32 [T]. Per element, each step one fp32 RN,
no FMA, and each sum the exact sum rounded once to fp32:
1. xhat = RN32(x * rstd[t]);  g = gamma widened (zero_centered_gamma: RN32(gamma + 1));
2. dxhat = RN32(dy * g);
3. dgamma[d] = RN32(exact sum_t RN32(dy * xhat)), rounded once more to gamma's dtype;
4. c[t] = RN32(RN32(exact sum_d RN32(dxhat * xhat)) * RN32(1/D))   -- the mean, as rstd's step 3;
5. dx = RN32(rstd[t] * RN32(dxhat - RN32(xhat * c[t]))), rounded once more to x's dtype.
What a backend can match: every step is exact given the sums, so a backend differs from spec only by
its summation order in steps 3 and 4 (plus, for a backend that divides by D, one rounding in step 4):
any-order fp32 summation of n terms is within (n - 1) * 2^-24 * sum |terms| of the exact sum.
tests/conformance/test_rmsnorm_backward.py derives the resulting bounds on dx and dgamma.
Non-finite values follow IEEE arithmetic (a sum holding a NaN, or both infinities, is NaN; an exact
sum beyond fp32's range rounds to +-Inf); NaN bit patterns are not fixed.
"""
from __future__ import annotations

import numpy as np

from . import checks
from .constants import BLOCK_SIZE, ELEM_FORMATS, FLOAT_DTYPES
from .gemm import exact_rowsum_rounded
from .quantize import mxfp8_quantize

__all__ = ["rmsnorm_mxfp8", "validate_rmsnorm_mxfp8", "rmsnorm_rstd", "rmsnorm_apply", "rmsnorm_backward",
           "validate_rmsnorm_backward"]


def validate_rmsnorm_mxfp8(x, gamma, eps=1e-6, zero_centered_gamma=False, elem="e4m3"):
    """Raise TypeError/ValueError naming the first bad argument of `rmsnorm_mxfp8`."""
    checks.require_dtype("x", x, FLOAT_DTYPES)
    checks.require_ndim("x", x, (2,))
    checks.require_multiple("x", x.shape[1], BLOCK_SIZE, "dim 1 (D, blocked rowwise)")
    checks.require_multiple("x", x.shape[0], BLOCK_SIZE, "dim 0 (T, blocked columnwise)")
    checks.require_dtype("gamma", gamma, FLOAT_DTYPES)
    checks.require_ndim("gamma", gamma, (1,))
    checks.require_dim("gamma", gamma, 0, x.shape[1], "D of x")
    checks.require_real("eps", eps)
    if not (np.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")
    checks.require_bool("zero_centered_gamma", zero_centered_gamma)
    checks.require_choice("elem", elem, tuple(ELEM_FORMATS))


def rmsnorm_rstd(x32: np.ndarray, eps: float) -> np.ndarray:
    """Steps 2-5: fp32 rstd [T] of fp32 x [T, D]."""
    d = x32.shape[1]
    sq = x32.astype(np.float64) ** 2  # exact: 48 significant bits
    finite = np.isfinite(sq).all(axis=1)
    with np.errstate(over="ignore"):
        ss = exact_rowsum_rounded(np.where(np.isfinite(sq), sq, 0.0), "float32", 48)
        # rows holding Inf/NaN: the IEEE sum (NaN if any NaN, else +Inf)
        ss = np.where(finite, ss, sq.sum(axis=1).astype(np.float32))
    inv_d = np.float32(1.0) / np.float32(d)  # RN32(1/D)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        ms = ss * inv_d
        v = ms + np.float32(eps)
        rstd = (1.0 / np.sqrt(v.astype(np.float64))).astype(np.float32)
    return np.where(np.isnan(rstd), np.float32(np.nan), rstd)  # NaN written as 0x7FC00000


def rmsnorm_apply(x32: np.ndarray, gamma, rstd: np.ndarray, zero_centered_gamma: bool) -> np.ndarray:
    """Steps 6-7: fp32 y [T, D] from fp32 x, gamma (any float dtype) and fp32 rstd [T]."""
    g = np.asarray(gamma).astype(np.float32)
    if zero_centered_gamma:
        g = g + np.float32(1.0)
    with np.errstate(over="ignore", invalid="ignore"):
        return (x32 * rstd[:, None]) * g[None, :]


def rmsnorm_mxfp8(x, gamma, eps=1e-6, zero_centered_gamma=False, elem="e4m3"):
    """RMSNorm of x [T, D] with gamma [D], quantized rowwise and columnwise to MXFP8 from fp32.

    Returns (y_row: MXTensor blocked on axis 1, y_col: MXTensor blocked on axis 0, rstd: fp32 [T]).
    Exact operation order and what backends can match: module docstring.
    """
    validate_rmsnorm_mxfp8(x, gamma, eps, zero_centered_gamma, elem)
    x32 = np.asarray(x).astype(np.float32)
    rstd = rmsnorm_rstd(x32, eps)
    y = rmsnorm_apply(x32, gamma, rstd, bool(zero_centered_gamma))
    y_row, y_col = mxfp8_quantize(y, axis=(-1, 0), elem=elem, scale_mode="rceil", nonfinite="saturate",
                                  scale_layout="compact")
    return y_row, y_col, rstd


def validate_rmsnorm_backward(dy, x, gamma, rstd, zero_centered_gamma=False):
    """Raise TypeError/ValueError naming the first bad argument of `rmsnorm_backward`."""
    checks.require_dtype("dy", dy, FLOAT_DTYPES)
    checks.require_ndim("dy", dy, (2,))
    checks.require_dtype("x", x, FLOAT_DTYPES)
    checks.require_ndim("x", x, (2,))
    checks.require_same_shape("dy", dy, "x", x)
    if x.shape[1] < 1:
        raise ValueError(f"x: expected at least one column (D >= 1), got shape {tuple(x.shape)}")
    checks.require_dtype("gamma", gamma, FLOAT_DTYPES)
    checks.require_ndim("gamma", gamma, (1,))
    checks.require_dim("gamma", gamma, 0, x.shape[1], "D of x")
    checks.require_dtype("rstd", rstd, ("float32",))
    checks.require_ndim("rstd", rstd, (1,))
    checks.require_dim("rstd", rstd, 0, x.shape[0], "T of x")
    checks.require_bool("zero_centered_gamma", zero_centered_gamma)


def _rowsums_rounded_once(terms: np.ndarray) -> np.ndarray:
    """RN32 of the exact sum of each row of fp32 terms [M, K]; a row holding Inf or NaN gets the IEEE
    sum (NaN for a NaN or for both infinities, else that infinity; a float64 sum of fp32 values cannot
    overflow, so its order does not matter)."""
    t64 = terms.astype(np.float64)
    finite = np.isfinite(t64)
    with np.errstate(over="ignore"):
        exact = exact_rowsum_rounded(np.where(finite, t64, 0.0), "float32", 24)
    return np.where(finite.all(axis=1), exact, t64.sum(axis=1).astype(np.float32))


def rmsnorm_backward(dy, x, gamma, rstd, zero_centered_gamma=False):
    """(dx in x's dtype [T, D], dgamma in gamma's dtype [D]) of RMSNorm for dL/dy `dy`, with the
    forward's rstd. Operation order and what backends can match: module docstring."""
    validate_rmsnorm_backward(dy, x, gamma, rstd, zero_centered_gamma)
    x32 = np.asarray(x).astype(np.float32)
    dy32 = np.asarray(dy).astype(np.float32)
    r = np.asarray(rstd)[:, None]
    g = np.asarray(gamma).astype(np.float32)
    if zero_centered_gamma:
        g = g + np.float32(1.0)
    inv_d = np.float32(1.0) / np.float32(x32.shape[1])
    with np.errstate(over="ignore", invalid="ignore"):
        xhat = x32 * r
        dxhat = dy32 * g[None, :]
        dgamma = _rowsums_rounded_once((dy32 * xhat).T)
        c = _rowsums_rounded_once(dxhat * xhat) * inv_d
        dx = r * (dxhat - xhat * c[:, None])
        return dx.astype(np.asarray(x).dtype), dgamma.astype(np.asarray(gamma).dtype)
