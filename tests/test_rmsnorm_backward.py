"""spec.rmsnorm.rmsnorm_backward: the documented fp32 order rebuilt independently (exact sums with Python
integers), exact sums rather than float sums, float64 bounds, output dtypes, non-finite values, errors.
Every backend against spec: tests/conformance/test_rmsnorm_backward.py."""
from __future__ import annotations

import numpy as np
import pytest

from spec.rmsnorm import rmsnorm_backward, rmsnorm_rstd
from tests.test_gemm import _low_exponent, _to_int, round_int_scaled
from tests.util import BF16, assert_bytes_equal, random_magnitudes

f32 = np.float32
U = 2.0 ** -24  # fp32 unit roundoff


def _sum_rounded_once(terms32) -> f32:
    """RN32 of the exact sum of fp32 terms, with Python integers."""
    t = np.asarray(terms32, np.float64)
    e0 = _low_exponent(t)
    return f32(round_int_scaled(sum(_to_int(v, e0) for v in t), e0, "float32"))


def documented(dy, x, gamma, rstd, zero_centered=False):
    """The docstring's steps 1-5 in fp32, without spec code: (dx fp32, dgamma fp32)."""
    x32, dy32 = np.asarray(x).astype(f32), np.asarray(dy).astype(f32)
    g = np.asarray(gamma).astype(f32) + (f32(1) if zero_centered else f32(0))
    xhat = x32 * rstd[:, None]
    dxhat = dy32 * g
    inv_d = f32(1) / f32(x32.shape[1])
    dgamma = np.array([_sum_rounded_once(col) for col in (dy32 * xhat).T], f32)
    c = np.array([_sum_rounded_once(row) for row in dxhat * xhat], f32) * inv_d
    return rstd[:, None] * (dxhat - xhat * c[:, None]), dgamma


def _inputs(rng, tokens, d, x_dtype=BF16, dy_dtype=BF16):
    x = random_magnitudes(rng, (tokens, d)).astype(x_dtype)
    dy = random_magnitudes(rng, (tokens, d)).astype(dy_dtype)
    gamma = (1 + 0.5 * rng.standard_normal(d)).astype(f32)
    return dy, x, gamma, rmsnorm_rstd(x.astype(f32), 1e-6)


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("tokens, d", [(5, 64), (33, 96), (3, 1536)])
def test_documented_order(tokens, d, zero_centered):
    rng = np.random.default_rng(40 + d)
    dy, x, gamma, rstd = _inputs(rng, tokens, d)
    dx, dgamma = rmsnorm_backward(dy, x, gamma, rstd, zero_centered)
    want_dx, want_dgamma = documented(dy, x, gamma, rstd, zero_centered)
    assert dx.dtype == BF16 and dgamma.dtype == np.float32
    assert_bytes_equal(dx, want_dx.astype(BF16), "dx")
    assert_bytes_equal(dgamma, want_dgamma, "dgamma")


def test_exact_sums_not_float_sums():
    # dgamma of column 0 sums one 2^40 and 95 of 2^10 (dy * xhat with xhat = 1): a sequential fp32 sum
    # drops every 2^10 (fp32's ulp at 2^40 is 2^17), the exact sum 2^40 + 95 * 2^10 rounds up to
    # 2^40 + 2^17.
    tokens, d = 96, 32
    x = np.ones((tokens, d), f32)
    dy = np.full((tokens, d), 2.0 ** 10, f32)
    dy[0] = 2.0 ** 40
    dx, dgamma = rmsnorm_backward(dy, x, np.ones(d, f32), np.ones(tokens, f32))
    assert np.all(dgamma == f32(2.0 ** 40 + 2.0 ** 17))
    # each row of dxhat * xhat is constant, so c = dy and dx = dy - c = 0 exactly
    assert np.all(dx == 0)


def test_closed_form_constant_rows():
    # x = 2, rstd = 1/2: xhat = 1; dy = 3, g = 2: dxhat = 6, c = 6, dx = 0; dgamma = T * 3.
    x = np.full((7, 64), 2.0, f32)
    dx, dgamma = rmsnorm_backward(np.full((7, 64), 3.0, f32), x, np.full(64, 2.0, f32), np.full(7, 0.5, f32))
    assert np.all(dx == 0) and np.all(dgamma == 21.0)


@pytest.mark.parametrize("zero_centered", [False, True])
def test_against_float64(zero_centered):
    """The float64 gradient of y = x * rstd * g with the same rstd. Bounds: xhat is within U relative,
    dxhat within 2U (g = RN32(gamma + 1) and the product); dgamma's terms within 2U and its exact sum
    rounds once: 3U * sum |dy * xhat|. With M = mean |dxhat * xhat|: the terms of c are within 4U, the
    sum, RN32(1/D) and the product add 3U: c within 7U * M; xhat * c then within 9U * |xhat| * M, the
    difference within 10U * A (A = |dxhat| + |xhat| * M), dx = RN32(rstd * it) within 11U * rstd * A.
    Stated bounds 4U and 16U."""
    rng = np.random.default_rng(41)
    dy, x, gamma, rstd = _inputs(rng, 50, 256, np.float32, np.float32)
    dx, dgamma = rmsnorm_backward(dy, x, gamma, rstd, zero_centered)
    r, x64, dy64 = rstd.astype(np.float64)[:, None], x.astype(np.float64), dy.astype(np.float64)
    g = gamma.astype(np.float64) + (1.0 if zero_centered else 0.0)
    xhat, dxhat = x64 * r, dy64 * g
    want_dgamma = (dy64 * xhat).sum(0)
    mean_abs = np.abs(dxhat * xhat).mean(1, keepdims=True)
    want_dx = r * (dxhat - xhat * (dxhat * xhat).mean(1, keepdims=True))
    assert np.all(np.abs(dgamma - want_dgamma) <= 4 * U * np.abs(dy64 * xhat).sum(0))
    assert np.all(np.abs(dx - want_dx) <= 16 * U * r * (np.abs(dxhat) + np.abs(xhat) * mean_abs))


def test_zero_centered_gamma_equals_shifted_gamma():
    rng = np.random.default_rng(42)
    dy, x, gamma, rstd = _inputs(rng, 9, 64)
    gamma = (0.1 * gamma).astype(f32)
    a = rmsnorm_backward(dy, x, gamma, rstd, True)
    b = rmsnorm_backward(dy, x, gamma + f32(1), rstd, False)
    assert_bytes_equal(a[0], b[0], "dx")
    assert_bytes_equal(a[1], b[1], "dgamma")


@pytest.mark.parametrize("x_dtype, dy_dtype, g_dtype", [(BF16, np.float32, BF16), (np.float16, BF16, np.float32),
                                                         (np.float32, np.float16, np.float16)])
def test_output_dtypes_round_once(x_dtype, dy_dtype, g_dtype):
    """dx in x's dtype and dgamma in gamma's, each one rounding of the fp32 result (widening x and gamma to
    fp32 changes no fp32 value)."""
    rng = np.random.default_rng(43)  # magnitudes inside fp16's range
    x = (rng.standard_normal((6, 64)) * 100).astype(x_dtype)
    dy = (rng.standard_normal((6, 64)) * 100).astype(dy_dtype)
    gamma = rng.standard_normal(64).astype(g_dtype)
    rstd = rmsnorm_rstd(x.astype(f32), 1e-6)
    dx, dgamma = rmsnorm_backward(dy, x, gamma, rstd)
    dx32, dgamma32 = rmsnorm_backward(dy, x.astype(f32), gamma.astype(f32), rstd)
    assert dx.dtype == x_dtype and dgamma.dtype == g_dtype
    assert_bytes_equal(dx, dx32.astype(x_dtype), "dx")
    assert_bytes_equal(dgamma, dgamma32.astype(g_dtype), "dgamma")


def test_empty_tokens():
    dx, dgamma = rmsnorm_backward(np.zeros((0, 64), BF16), np.zeros((0, 64), BF16), np.ones(64, f32),
                                  np.zeros(0, f32))
    assert dx.shape == (0, 64) and np.all(dgamma == 0)


def test_nonfinite_values():
    rng = np.random.default_rng(44)
    dy, x, gamma, rstd = _inputs(rng, 8, 64, np.float32, np.float32)
    dy[1, 3] = np.nan  # row 1's c is NaN, so is its dx; column 3's dgamma is NaN
    dy[2, 5] = np.inf  # dxhat Inf at (2, 5): c = +-Inf, dx row 2 non-finite; dgamma[5] = +-Inf
    x[4] = 0.0
    rstd[4] = np.inf  # 0 * Inf = NaN: row 4 and every dgamma NaN
    with np.errstate(all="ignore"):
        dx, dgamma = rmsnorm_backward(dy, x, gamma, rstd)
    assert np.all(np.isnan(dx[1])) and np.all(np.isnan(dx[4])) and np.all(np.isnan(dgamma))
    assert not np.isfinite(dx[2]).any()
    assert np.all(np.isfinite(np.delete(dx, [1, 2, 4], axis=0)))


def test_finite_sum_beyond_fp32_overflows():
    x = np.ones((4, 32), f32)
    dy = np.full((4, 32), 2.0 ** 127, f32)  # dgamma: 4 * 2^127 = 2^129 > fp32's max
    _, dgamma = rmsnorm_backward(dy, x, np.ones(32, f32), np.ones(4, f32))
    assert np.all(dgamma == np.inf)


def _ok():
    return dict(dy=np.ones((4, 64), BF16), x=np.ones((4, 64), BF16), gamma=np.ones(64, f32),
                rstd=np.ones(4, f32), zero_centered_gamma=False)


@pytest.mark.parametrize("change, exc, pattern", [
    (dict(dy=np.ones((4, 64), np.float64)), TypeError, r"^dy: expected dtype in"),
    (dict(dy=np.ones(64, BF16)), ValueError, r"^dy: expected 2 dimensions"),
    (dict(x=np.ones((4, 64), np.int32)), TypeError, r"^x: expected dtype in"),
    (dict(x=[[1.0] * 64] * 4), TypeError, r"^x: expected a NumPy array or torch tensor"),
    (dict(dy=np.ones((4, 32), BF16)), ValueError, r"^dy and x: expected equal shapes"),
    (dict(dy=np.ones((4, 0), BF16), x=np.ones((4, 0), BF16), gamma=np.ones(0, f32)), ValueError,
     r"^x: expected at least one column"),
    (dict(gamma=np.ones(32, f32)), ValueError, r"^gamma: expected size 64 at dim 0 \(D of x\)"),
    (dict(gamma=np.ones(64, np.int8)), TypeError, r"^gamma: expected dtype in"),
    (dict(rstd=np.ones(4, BF16)), TypeError, r"^rstd: expected dtype in \('float32',\)"),
    (dict(rstd=np.ones(5, f32)), ValueError, r"^rstd: expected size 4 at dim 0 \(T of x\)"),
    (dict(rstd=np.ones((4, 1), f32)), ValueError, r"^rstd: expected 1 dimensions"),
    (dict(zero_centered_gamma=1), TypeError, r"^zero_centered_gamma: expected a bool"),
], ids=["dy-dtype", "dy-ndim", "x-dtype", "x-list", "shapes", "x-no-columns", "gamma-size", "gamma-dtype",
        "rstd-dtype", "rstd-size", "rstd-ndim", "zero-centered-type"])
def test_errors(change, exc, pattern):
    args = _ok()
    args.update(change)
    with pytest.raises(exc, match=pattern):
        rmsnorm_backward(**args)


_SM90_COMPILE = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from backends.triton.rmsnorm_backward import _rmsnorm_backward_kernel as fn
types = {"gamma_ptr": "*fp32", "rstd_ptr": "*fp32", "partials_ptr": "*fp32", "T": "i32", "D": "i32",
         "stride_dy": "i32", "stride_x": "i32", "inv_d": "fp32", "tiles_per_program": "i32"}
for dtype, ptr in ((tl.bfloat16, "*bf16"), (tl.float32, "*fp32")):
    consts = {"ZERO_CENTERED": False, "DX_DTYPE": dtype, "BLOCK_T": 2, "BLOCK_D": 2048}
    sig = {n: "constexpr" if n in consts else types.get(n, ptr) for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "enable_fp_fusion": False})
    assert k.asm["cubin"] and "fma.rn.f32" not in k.asm["ptx"], dtype
print("ok")
"""


def test_triton_kernel_compiles_offline_for_sm90():
    """The kernel compiles to an sm90 cubin with the installed Triton (its offline compiler and bundled
    ptxas; no GPU), without fused multiply-adds (spec rounds each product). A child process: the
    interpreter, on in this session, would hand the compiler interpreted functions."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    from tests.util import subprocess_env

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in subprocess_env(root).items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True,
                          timeout=600, cwd=root)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
