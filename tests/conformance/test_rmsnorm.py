"""rmsnorm_mxfp8 on every backend present.

rstd is bit-exact only up to the backend's reduction order and rsqrt (spec/rmsnorm.py): it is held to
|rstd - spec| <= (D + 12) * 2^-25 * |spec| (derivation in spec/rmsnorm.py). Given its own rstd, a
backend's y bytes are exact: they must equal spec.mxfp8_quantize(RN32(RN32(x * rstd) * g)) along both
axes. On exact inputs (rows of equal powers of two, eps = 0) rstd is exact everywhere and every
byte must equal spec's.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import spec
from tests.conformance.conftest import run_on
from tests.util import BF16, assert_bytes_equal, random_magnitudes

torch = pytest.importorskip("torch")
from backends.convert import to_numpy, to_torch  # noqa: E402  (needs torch)
from spec.mxtensor import MXTensor  # noqa: E402

f32 = np.float32


def _seed(*parts) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def _run(target, x, gamma, **kw):
    device = target[1]
    got = run_on(target, "rmsnorm_mxfp8", to_torch(x, device), to_torch(gamma, device), **kw)
    assert isinstance(got, tuple) and len(got) == 3
    y_row, y_col, rstd = got
    assert isinstance(y_row, MXTensor) and isinstance(y_col, MXTensor)
    assert rstd.dtype == torch.float32 and rstd.device.type == device and tuple(rstd.shape) == (x.shape[0],)
    return y_row, y_col, to_numpy(rstd)


def _check_own_quantization(y_row, y_col, x, gamma, rstd, zero_centered=False, elem="e4m3"):
    g = np.asarray(gamma).astype(f32)
    if zero_centered:
        g = g + f32(1)
    with np.errstate(all="ignore"):
        y = (np.asarray(x).astype(f32) * rstd[:, None]) * g[None, :]
    for got, axis in ((y_row, 1), (y_col, 0)):
        want = spec.mxfp8_quantize(y, axis=axis, elem=elem)
        assert (got.axis, got.elem, got.scale_layout) == (axis, elem, "compact")
        assert_bytes_equal(got.data, want.data, f"axis {axis} data")
        assert_bytes_equal(got.scale, want.scale, f"axis {axis} scale")


@pytest.mark.parametrize("d", [64, 96])
def test_exact_inputs_all_bytes(target, d):
    # rows of +-2^j, eps = 0: ss = D 4^j is exact in any order. D = 64: ms = 4^j and rstd = 2^-j are
    # exact too (the correctly rounded rsqrt of 4^j), so
    # every byte must match; D = 96: RN32(1/96) makes ms inexact and rsqrt approximations may differ
    # by an ulp, so only the own-rstd quantization is checked.
    rng = _seed("rms-exact", d)
    j = rng.integers(-6, 7, size=(64, 1))
    x = (np.where(rng.random((64, d)) < 0.5, -1.0, 1.0) * 2.0 ** j).astype(BF16)
    gamma = rng.choice([0.5, 1.0, -2.0, 3.0], size=d).astype(f32)
    want = spec.rmsnorm_mxfp8(x, gamma, eps=0.0)
    got = _run(target, x, gamma, eps=0.0)
    if d == 64:
        assert_bytes_equal(got[2], want[2], "rstd")
        for g, w, name in ((got[0], want[0], "y_row"), (got[1], want[1], "y_col")):
            assert_bytes_equal(g.data, w.data, name + " data")
            assert_bytes_equal(g.scale, w.scale, name + " scale")
    _check_own_quantization(got[0], got[1], x, gamma, got[2])


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("xdtype", [np.float32, BF16, np.float16])
@pytest.mark.parametrize("shape", [(64, 256)], ids=str)
def test_random_rstd_bound_and_own_bytes(target, shape, xdtype, zero_centered):
    rng = _seed("rms-random", shape, str(xdtype), zero_centered)
    x = random_magnitudes(rng, shape, f32)
    if xdtype is np.float16:
        x = rng.standard_normal(shape) * 100.0
    x = x.astype(xdtype)
    gamma = rng.standard_normal(shape[1]).astype(BF16)
    want = spec.rmsnorm_mxfp8(x, gamma, eps=1e-5, zero_centered_gamma=zero_centered)
    got = _run(target, x, gamma, eps=1e-5, zero_centered_gamma=zero_centered)
    d = shape[1]
    bound = (d + 12) * 2.0 ** -25 * np.abs(want[2].astype(np.float64))
    assert np.all(np.abs(got[2].astype(np.float64) - want[2]) <= bound)
    _check_own_quantization(got[0], got[1], x, gamma, got[2], zero_centered)


def test_deepseek_sized(target):
    # q_a_layernorm over q_lora_rank = 1536 features
    test_random_rstd_bound_and_own_bytes(target, (32, 1536), BF16, False)


def test_e5m2_and_nonfinite_rows(target):
    rng = _seed("rms-special")
    x = rng.standard_normal((32, 64)).astype(f32)
    x[0, 3], x[1, 5], x[2] = np.nan, np.inf, 0.0
    gamma = rng.standard_normal(64).astype(f32)
    want = spec.rmsnorm_mxfp8(x, gamma, eps=0.0, elem="e5m2")
    got = _run(target, x, gamma, eps=0.0, elem="e5m2")
    assert np.isnan(got[2][0]) and got[2][1] == 0 and got[2][2] == np.inf
    assert_bytes_equal(got[2][:3], want[2][:3], "non-finite rstd")
    _check_own_quantization(got[0], got[1], x, gamma, got[2], elem="e5m2")
