"""mxfp8_gemm on every backend present: bytes on exact-arithmetic inputs, a stated bound on random ones."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import spec
from tests.conformance.conftest import run_on
from tests.test_gemm import mx, small_int_operand
from tests.util import BF16, assert_bytes_equal

torch = pytest.importorskip("torch")
from backends.convert import to_numpy, to_torch  # noqa: E402  (needs torch)

OUT_DTYPES = ("float32", "bfloat16")


def _seed(*parts) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def _run(target, a, b, out_dtype):
    device = target[1]
    got = run_on(target, "mxfp8_gemm", to_torch(a, device), to_torch(b, device), out_dtype=out_dtype)
    assert isinstance(got, torch.Tensor) and got.device.type == device
    assert got.dtype == getattr(torch, out_dtype) and tuple(got.shape) == (a.shape[0], b.shape[0])
    return got


def _swizzled(t):
    return spec.swizzle_scales(t)


@pytest.mark.parametrize("layout", ["compact", "swizzled"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("shape", [(32, 64, 256), (130, 96, 64), (1, 7, 1536)], ids=str)
def test_exact_arithmetic_bytes(target, shape, out_dtype, layout):
    # small-integer codes and scales 2^-2..2^2: every product and partial sum is exact in fp32, so
    # any summation order gives the spec's bytes (bf16 outputs include round-half-even ties).
    m, n, k = shape
    rng = _seed("gemm", shape, out_dtype)
    a = small_int_operand(rng, m, k)
    b = small_int_operand(rng, n, k, elem="e5m2" if m == 130 else "e4m3")
    want = spec.mxfp8_gemm(a, b, out_dtype)
    if layout == "swizzled":
        a, b = _swizzled(a), _swizzled(b)
    assert_bytes_equal(_run(target, a, b, out_dtype), want, f"{shape} {out_dtype} {layout}")


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_specials_bytes(target, out_dtype):
    z = [0.0] * 31
    # rows: NaN scale block; e5m2 +Inf code (Inf * 0 = NaN); -0 codes (exact zero -> +0); huge
    # (-> +-Inf); finite. (A product below fp32's range is spec-only: spec rounds the exact tiny sum
    # and keeps its sign, fp32 hardware accumulates +0 + -0 = +0 -- tests/test_gemm.py covers it.)
    a = mx([[1.0] + z, [np.inf] + z, [-0.0] * 32, [448.0] + z, [2.0] + z],
           [[255], [127], [127], [254], [127]], elem="e5m2")
    b = mx([[1.0] + z, [0.0] + z, [-448.0] + z, [3.0] + z], [[127], [127], [254], [120]])
    want = spec.mxfp8_gemm(a, b, out_dtype)
    assert_bytes_equal(_run(target, a, b, out_dtype), want, "specials")


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("elems", [("e4m3", "e4m3"), ("e5m2", "e4m3")])
def test_random_within_bound(target, out_dtype, elems):
    # Bound: got = RN_out(s) with |s - exact| <= 2 K 2^-24 * sum|p| (fp32 accumulation in any order,
    # gamma_K with a 2x margin; float64 on CPU is far inside it), and RN_out moves each side by at most
    # half an ulp: |got - want| <= ulp_out(want) + 2 K 2^-24 (|a| @ |b|^T).
    rng = _seed("gemm-random", out_dtype, elems)
    m, n, k = 64, 96, 512
    x = rng.standard_normal((m, k)) * 2.0 ** rng.integers(-8, 9, size=(m, 1))
    y = rng.standard_normal((n, k)) * 2.0 ** rng.integers(-8, 9, size=(1, k))
    a = spec.mxfp8_quantize(x.astype(np.float32), elem=elems[0])
    b = spec.mxfp8_quantize(y.astype(np.float32), elem=elems[1])
    want = spec.mxfp8_gemm(a, b, out_dtype).astype(np.float64)
    got = to_numpy(_run(target, a, b, out_dtype)).astype(np.float64)
    da, db = np.abs(spec.mxfp8_dequantize(a).astype(np.float64)), np.abs(spec.mxfp8_dequantize(b).astype(np.float64))
    mbits = 24 if out_dtype == "float32" else 8
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 2.0 ** -126))) - (mbits - 1))
    bound = ulp + 2 * k * 2.0 ** -24 * (da @ db.T)
    assert np.all(np.abs(got - want) <= bound)
    if target == ("torch", "cpu"):  # float64 sums: the spec's bytes on this data
        assert_bytes_equal(got.astype(np.float32 if out_dtype == "float32" else BF16), want.astype(
            np.float32 if out_dtype == "float32" else BF16), "torch cpu")
