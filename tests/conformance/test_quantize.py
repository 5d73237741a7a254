"""mxfp8_quantize / mxfp8_dequantize on every backend present, byte-equal to spec."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import spec
from spec.constants import NONFINITE_POLICIES, SCALE_MODES
from tests.conformance.conftest import run_on
from tests.util import BF16, F8E4M3, F8E5M2, assert_bytes_equal, random_magnitudes, special_values_f32

torch = pytest.importorskip("torch")
from backends.convert import to_torch  # noqa: E402  (needs torch)
from spec.mxtensor import MXTensor  # noqa: E402

ELEMS = ("e4m3", "e5m2")
IN_DTYPES = {"float32": np.float32, "bfloat16": BF16, "float16": np.float16}


def _seed(*parts) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def _with_specials(x: np.ndarray, rng) -> np.ndarray:
    """x with the special values scattered over a few blocks (the rest stays finite, normal data)."""
    flat = x.reshape(-1).copy()
    with np.errstate(over="ignore"):  # fp16: large specials become Inf
        vals = special_values_f32().astype(x.dtype)
    pos = rng.choice(flat.size, size=vals.size, replace=False)
    flat[pos] = vals
    return flat.reshape(x.shape)


def _check_mx(got, want, what):
    assert isinstance(got, MXTensor), what
    assert got.axis == want.axis and got.elem == want.elem and got.scale_layout == want.scale_layout, what
    assert isinstance(got.data, torch.Tensor) and got.data.dtype == getattr(torch, str(want.data.dtype)), what
    assert got.scale.dtype == torch.uint8, what
    assert_bytes_equal(got.data, want.data, f"{what} data")
    assert_bytes_equal(got.scale, want.scale, f"{what} scale")


def _compare(target, x, what="", **kw):
    device = target[1]
    want = spec.mxfp8_quantize(x, **kw)
    got = run_on(target, "mxfp8_quantize", to_torch(x, device), **kw)
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.data.device.type == device
            _check_mx(g, w, f"{what} [{i}]")
    else:
        assert got.data.device.type == device
        _check_mx(got, want, what)
    return got, want


# Scaled-down DeepSeek-V3 MLA shapes: x [T, q_lora 1536], q [T, H, 192], weight [N, K]; row counts that
# are not multiples of 128 (and, rowwise only, not of 32).
SHAPES = [
    ((256, 1536), (-1, 0)),
    ((96, 8, 192), (-1, 0)),
    ((160, 512), (-1, 0)),
    ((37, 192), -1),
    ((3, 5, 64), -1),
]


@pytest.mark.parametrize("shape,axis", SHAPES, ids=[str(s) for s, _ in SHAPES])
@pytest.mark.parametrize("in_dtype", list(IN_DTYPES))
def test_shapes_dtypes(target, shape, axis, in_dtype):
    rng = _seed(shape, in_dtype)
    with np.errstate(over="ignore"):
        x = random_magnitudes(rng, shape, IN_DTYPES[in_dtype])
    x = _with_specials(x, rng)
    _compare(target, x, f"{shape} {in_dtype}", axis=axis)


@pytest.mark.parametrize("nonfinite", NONFINITE_POLICIES)
@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("elem", ELEMS)
def test_modes(target, elem, scale_mode, nonfinite):
    rng = _seed(elem, scale_mode, nonfinite)
    x = _with_specials(random_magnitudes(rng, (96, 256)), rng)
    # whole-block special cases: all-NaN, all-zero, -0.0, one Inf, fp32 subnormals
    x[0, :32] = np.nan
    x[1, :32] = 0.0
    x[2, :32] = -0.0
    x[3, 32:64] = 1.0
    x[3, 40] = np.inf
    x[4, :32] = np.float32(2.0 ** -140)
    _compare(target, x, f"{elem} {scale_mode} {nonfinite}", axis=(-1, 0), elem=elem,
             scale_mode=scale_mode, nonfinite=nonfinite)


@pytest.mark.parametrize("axis", [0, 1, 2, -1, (2, 0), (0, 2, 1)], ids=str)
def test_axes_3d(target, axis):
    rng = _seed("axes", axis)
    x = _with_specials(random_magnitudes(rng, (64, 32, 96)), rng)
    _compare(target, x, f"axis {axis}", axis=axis)


@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("shape,axis", [((256, 1536), (-1, 0)), ((160, 7, 192), (2, 0)), ((96, 64), 0)], ids=str)
def test_swizzled_output(target, shape, axis, elem):
    rng = _seed("swz", shape, elem)
    x = _with_specials(random_magnitudes(rng, shape, BF16), rng)
    _compare(target, x, f"swizzled {shape}", axis=axis, elem=elem, scale_layout="swizzled")


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scale_layout", ["compact", "swizzled"])
@pytest.mark.parametrize("elem", ELEMS)
def test_dequantize(target, elem, scale_layout, out_dtype):
    device = target[1]
    rng = _seed("dq", elem, scale_layout, out_dtype)
    x = _with_specials(random_magnitudes(rng, (160, 7, 192)), rng)
    for axis in (2, 0):
        t = spec.mxfp8_quantize(x, axis=axis, elem=elem, scale_layout=scale_layout, nonfinite="nan_block")
        want = spec.mxfp8_dequantize(t, out_dtype)
        got = run_on(target, "mxfp8_dequantize", to_torch(t, device), out_dtype=out_dtype)
        assert isinstance(got, torch.Tensor) and got.device.type == device
        assert_bytes_equal(got, want, f"dequantize axis={axis}")


@pytest.mark.parametrize("elem", ELEMS)
def test_dequantize_every_code_and_scale(target, elem):
    # all 256 codes under scales 0, 1, 119, 127, 135, 200, 246, 253, 254, 255 (overflow to Inf, 2^-127,
    # subnormal products, NaN scale), both output dtypes
    device = target[1]
    scales = np.array([0, 1, 119, 127, 135, 200, 246, 253, 254, 255], np.uint8)
    codes = np.tile(np.arange(256, dtype=np.uint8), (scales.size, 1))
    dtype = F8E4M3 if elem == "e4m3" else F8E5M2
    t = MXTensor(codes.view(dtype), np.repeat(scales[:, None], 8, axis=1), 1, elem)
    for out_dtype in ("float32", "bfloat16"):
        want = spec.mxfp8_dequantize(t, out_dtype)
        got = run_on(target, "mxfp8_dequantize", to_torch(t, device), out_dtype=out_dtype)
        assert_bytes_equal(got, want, f"every code {out_dtype}")


def test_errors_match_spec(target):
    device = target[1]
    bad = [
        (dict(x=torch.zeros(4, 33, device=device)), ValueError, "x:"),
        (dict(x=torch.zeros(4, 64, dtype=torch.int32, device=device)), TypeError, "x:"),
        (dict(x=torch.zeros(4, 64, device=device), scale_mode="nearest"), ValueError, "scale_mode:"),
    ]
    for kw, exc, prefix in bad:
        x = kw.pop("x")
        with pytest.raises(exc, match=f"^{prefix}"):
            run_on(target, "mxfp8_quantize", x, **kw)
