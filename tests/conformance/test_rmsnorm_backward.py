"""rmsnorm_backward on every backend present, against spec with stated bounds.

Where the bounds come from (spec/rmsnorm.py docstring): a backend's elementwise steps are spec's (one
fp32 RN each, no FMA, the same rstd), so only its sums differ. u = 2^-24.
- Any-order fp32 summation of n terms t is within (n - 1) u sum|t| of the exact sum; spec rounds the
  exact sum once (u |sum|). So two fp32 sums differ by at most n u sum|t| (the factor 1.001 below covers
  the second-order (1 + u)^k terms).
- dgamma (n = T terms p = RN32(dy * xhat)): E_g = 1.001 T u sum_t |p|.
- c (n = D terms q = RN32(dxhat * xhat), then times RN32(1/D), or divided by D, one RN): the sums
  differ by D u Q (Q = sum_d |q|); scaled by 1/D, with the reciprocal's and both final roundings
  (<= 4 u Q / D): dc = 1.001 u Q (D + 4) / D.
- dx in fp32: xhat * c moves by |xhat| dc and its rounding may go either way (2u |xhat c|), the
  difference likewise (2u (|dxhat| + |xhat c|)), and the product by rstd (2u |dx|):
  E = 1.001 (|rstd| (|xhat| dc + 2u |dxhat| + 4u |xhat c|) + 2u |dx|).
- Rounding to the output dtype moves each side by at most half an ulp, at most the unit roundoff
  r_o relative (bf16 2^-8, fp16 2^-11), so |got - spec| <= 2 r_o |spec fp32| + E (1 + r_o): one ulp of
  the output dtype plus the fp32 term. Below the normal range the rounding is absolute: 2^-120 covers
  fp32 and bf16 subnormals (and a GPU flushing them), 2^-24 fp16's.
Spec's fp32 results come from spec itself with x and gamma widened to fp32 (exact; the output dtypes
only round). Outputs are allocated poisoned (0xFF) so an element a backend forgets to write fails.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import spec
from spec.rmsnorm import rmsnorm_rstd
from tests.conformance.conftest import run_on
from tests.util import BF16, assert_bytes_equal, random_magnitudes

torch = pytest.importorskip("torch")
from backends.convert import to_numpy, to_torch  # noqa: E402  (needs torch)

f32 = np.float32
U = 2.0 ** -24
_ROUNDING = {np.dtype(f32): (0.0, 2.0 ** -120), np.dtype(BF16): (2.0 ** -8, 2.0 ** -120),
             np.dtype(np.float16): (2.0 ** -11, 2.0 ** -24)}  # (unit roundoff, absolute floor)


def _seed(*parts) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def _bounds(dy, x, gamma, rstd, zero_centered):
    """(E for dx, E_g for dgamma): the module docstring's fp32 bounds, from float64 magnitudes."""
    x32, dy32 = np.asarray(x).astype(f32), np.asarray(dy).astype(f32)
    g = np.asarray(gamma).astype(f32) + (f32(1) if zero_centered else f32(0))
    with np.errstate(all="ignore"):
        xhat = (x32 * rstd[:, None]).astype(np.float64)
        dxhat = (dy32 * g).astype(np.float64)
        q = np.abs(dxhat * xhat)
        d = x32.shape[1]
        dc = 1.001 * U * q.sum(1, keepdims=True) * (d + 4) / d
        c = np.abs((dxhat * xhat).sum(1, keepdims=True)) / d * 1.001
        dx_spec = spec.rmsnorm_backward(dy, x32, g, rstd)[0].astype(np.float64)
        r = np.abs(rstd.astype(np.float64))[:, None]
        e_dx = 1.001 * (r * (np.abs(xhat) * dc + 2 * U * np.abs(dxhat) + 4 * U * np.abs(xhat) * c)
                        + 2 * U * np.abs(dx_spec))
        e_g = 1.001 * x32.shape[0] * U * np.abs(dy32.astype(np.float64) * xhat).sum(0)
    return e_dx, e_g


def _assert_within(got, want_out, want32, err32, what):
    """got and spec's output (same dtype) within one output ulp of spec's fp32 value plus err32 (module
    docstring); non-finite values of spec must be matched in kind (NaN, or the same infinity)."""
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want_out).astype(np.float64)
    unit, floor = _ROUNDING[np.asarray(want_out).dtype]
    finite = np.isfinite(want)
    assert np.array_equal(np.isnan(got), np.isnan(want)), f"{what}: NaN positions differ"
    assert np.array_equal(got[np.isinf(want)], want[np.isinf(want)]), f"{what}: infinities differ"
    with np.errstate(all="ignore"):
        bound = 2 * unit * np.abs(want32) + err32 * (1 + unit) + floor
        err = np.abs(got - want)
    bad = finite & ~(err <= bound)
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} outside the bound; first at {np.argwhere(bad)[0]}: "
                           f"got {got[bad][0]!r}, spec {want[bad][0]!r}, bound {bound[bad][0]!r}")


def _check(target, dy, x, gamma, rstd, zero_centered=False, x_torch=None, dy_torch=None, what=""):
    device = target[1]
    dyt = to_torch(dy, device) if dy_torch is None else dy_torch
    xt = to_torch(x, device) if x_torch is None else x_torch
    dx, dgamma = run_on(target, "rmsnorm_backward", dyt, xt, to_torch(gamma, device), to_torch(rstd, device),
                        zero_centered)
    assert dx.dtype == xt.dtype and dgamma.dtype == to_torch(gamma, "cpu").dtype
    assert dx.device.type == device and tuple(dx.shape) == x.shape and tuple(dgamma.shape) == gamma.shape
    s_dx, s_dgamma = spec.rmsnorm_backward(dy, x, gamma, rstd, zero_centered)
    s_dx32, s_dgamma32 = spec.rmsnorm_backward(dy, np.asarray(x).astype(f32), np.asarray(gamma).astype(f32),
                                               rstd, zero_centered)
    e_dx, e_g = _bounds(dy, x, gamma, rstd, zero_centered)
    _assert_within(to_numpy(dx), s_dx, s_dx32, e_dx, f"dx {what}")
    _assert_within(to_numpy(dgamma), s_dgamma, s_dgamma32, e_g, f"dgamma {what}")
    return dx, dgamma


def _inputs(rng, tokens, d, x_dtype=BF16, dy_dtype=BF16, g_dtype=f32):
    """x and dy at several magnitudes (rows 2^-30 .. 2^30; 2^-4 .. 2^7 for an fp16 x, whose dx must stay
    inside fp16's range), gamma near 1, the forward's rstd."""
    if x_dtype is np.float16:
        x = (rng.standard_normal((tokens, d)) * 2.0 ** rng.integers(-4, 8, (tokens, 1))).astype(np.float16)
        dy = (rng.standard_normal((tokens, d)) * 2.0 ** rng.integers(-4, 8, (tokens, 1))).astype(dy_dtype)
    else:
        x = random_magnitudes(rng, (tokens, d), x_dtype)
        dy = random_magnitudes(rng, (tokens, d), dy_dtype)
    gamma = (1 + 0.5 * rng.standard_normal(d)).astype(g_dtype)
    return dy, x, gamma, rmsnorm_rstd(x.astype(f32), 1e-6)


@pytest.mark.parametrize("dy_dtype", [BF16, f32], ids=["dy_bf16", "dy_f32"])
@pytest.mark.parametrize("x_dtype, g_dtype", [(BF16, f32), (f32, BF16), (np.float16, f32)],
                         ids=["x_bf16", "x_f32", "x_f16"])
@pytest.mark.parametrize("d", [64, 512, 1536])
def test_random(target, poisoned_torch_empty, d, x_dtype, g_dtype, dy_dtype):
    tokens = 67  # odd: no row block divides it
    rng = _seed("rms-bwd", d, str(np.dtype(x_dtype)), str(np.dtype(g_dtype)), str(np.dtype(dy_dtype)))
    _check(target, *_inputs(rng, tokens, d, x_dtype, dy_dtype, g_dtype), what=f"D={d}")


@pytest.mark.parametrize("tokens", [1, 33, 200])
def test_zero_centered_and_token_counts(target, poisoned_torch_empty, tokens):
    rng = _seed("rms-bwd-zc", tokens)
    dy, x, gamma, rstd = _inputs(rng, tokens, 512)
    _check(target, dy, x, (0.1 * gamma).astype(f32), rstd, True, what=f"T={tokens}")


def test_no_tokens(target, poisoned_torch_empty):
    dy, x, gamma, rstd = _inputs(_seed("rms-bwd-empty"), 0, 64)
    dx, dgamma = _check(target, dy, x, gamma, rstd)
    assert np.all(to_numpy(dgamma) == 0)


def test_special_values(target, poisoned_torch_empty):
    """Zeros, all-zero rows of x (rstd = 1/sqrt(eps)) and of dy, large and tiny rows."""
    rng = _seed("rms-bwd-special")
    tokens, d = 41, 512
    x = rng.standard_normal((tokens, d)).astype(f32)
    dy = rng.standard_normal((tokens, d)).astype(f32)
    x[::3, ::7] = 0.0
    dy[1::4, ::5] = 0.0
    x[2] = 0.0
    dy[5] = 0.0
    x[7] *= f32(1e15)
    dy[8] *= f32(1e30)
    x[9] *= f32(1e-30)
    dy[10] *= f32(1e-30)
    x, dy = x.astype(BF16), dy.astype(BF16)
    gamma = rng.standard_normal(d).astype(BF16)
    _check(target, dy, x, gamma, rmsnorm_rstd(x.astype(f32), 1e-6))


def test_nan_propagates(target, poisoned_torch_empty):
    """A NaN in dy makes its row's dx and its column's dgamma NaN (any summation order)."""
    dy, x, gamma, rstd = _inputs(_seed("rms-bwd-nan"), 20, 64, f32, f32)
    dy[3, 9] = np.nan
    dx, dgamma = _check(target, dy, x, gamma, rstd)
    assert np.all(np.isnan(to_numpy(dx)[3])) and np.isnan(to_numpy(dgamma)[9])


def test_strided_rows(target, poisoned_torch_empty):
    """x and dy as column slices of wider tensors (row stride > D)."""
    device = target[1]
    dy, x, gamma, rstd = _inputs(_seed("rms-bwd-strided"), 19, 96)
    wide_x = to_torch(np.concatenate([x, x[:, :32]], axis=1), device)[:, :96]
    wide_dy = to_torch(np.concatenate([dy[:, :32], dy], axis=1), device)[:, 32:]
    assert wide_x.stride() == (128, 1) and wide_dy.stride() == (128, 1)
    _check(target, dy, x, gamma, rstd, x_torch=wide_x, dy_torch=wide_dy)


def test_two_runs_identical_bytes(target):
    device = target[1]
    dy, x, gamma, rstd = (to_torch(a, device) for a in _inputs(_seed("rms-bwd-determinism"), 300, 1536))
    first = run_on(target, "rmsnorm_backward", dy, x, gamma, rstd)
    second = run_on(target, "rmsnorm_backward", dy, x, gamma, rstd)
    for a, b, name in zip(first, second, ("dx", "dgamma")):
        assert_bytes_equal(a, b, f"{name} of two runs")


# --------------------------------------------------------------------------------------------------
# the Triton kernel's launch and capability check
# --------------------------------------------------------------------------------------------------

def test_interpreter_configs_cover_row_tails():
    """The shapes above reach, on the CPU interpreter, programs of several tiles, a last tile cut by T
    and programs whose tiles lie past T (their dgamma partial rows must still be written: zeros)."""
    pytest.importorskip("triton")
    from backends.triton.rmsnorm_backward import launch_config

    cpu = torch.device("cpu")
    cfg = launch_config(200, 64, cpu)  # test_zero_centered_and_token_counts' T = 200 at D = 64 tiles
    assert (cfg["BLOCK_T"], cfg["BLOCK_D"], cfg["programs"], cfg["tiles_per_program"]) == (32, 64, 3, 3)
    assert 200 % 32 and cfg["programs"] * cfg["tiles_per_program"] * 32 - 200 > 32
    cfg = launch_config(67, 1536, cpu)  # test_random at D = 1536: one row block of 2 rows, 34 tiles
    assert (cfg["BLOCK_T"], cfg["BLOCK_D"], cfg["programs"], cfg["tiles_per_program"]) == (2, 2048, 3, 12)


def test_triton_reasons(triton_target):
    """The kernel ("fused") refuses rows wider than one tile or with strided columns, with the reason
    (never copied); asked for triton alone, such a call goes to the "composed" variant instead."""
    import dispatch

    device = triton_target[1]
    wide = torch.zeros(2, 8224, dtype=torch.bfloat16, device=device)
    wide_args = (wide, wide, torch.ones(8224, device=device), torch.ones(2, device=device))
    with pytest.raises(dispatch.BackendUnavailable, match="wider than one tile"):
        dispatch.run("rmsnorm_backward", *wide_args, backend="triton:fused")
    x_t = torch.zeros(64, 4, dtype=torch.bfloat16, device=device).t()
    strided_args = (x_t.contiguous(), x_t, torch.ones(64, device=device), torch.ones(4, device=device))
    with pytest.raises(dispatch.BackendUnavailable, match=r"x: rows are not contiguous"):
        dispatch.run("rmsnorm_backward", *strided_args, backend="triton:fused")
    for args in (wide_args, strided_args):
        assert dispatch.select("rmsnorm_backward", *args, backend="triton") == "triton:composed"
