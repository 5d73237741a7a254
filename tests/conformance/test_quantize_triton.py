"""Triton MXFP8 quantize / dequantize / swizzle: what the shared conformance tests do not reach.

- axis=(-1, 0) / (0, -1) run as ONE kernel pass (counted) and match spec byte for byte;
- scales written directly in the swizzled layout, the whole buffer (padding included) compared, with
  every output buffer poisoned (0xFF) before the kernels run so an unwritten byte fails;
- every autotune tile config (forced), masked and unmasked shapes, N-D and middle axes;
- special-value blocks (all-NaN, +-Inf, subnormals, +-0, 448 / 449 / 480) next to finite tiles, which
  take the kernel's other path; every bf16 bit pattern; random fp32 bit patterns;
- on CUDA, DeepSeek-V3 sizes and the hardware fp8 conversion against the integer-bit encoder.
CPU runs go through Triton's interpreter, so shapes stay tiny there. On CUDA most calls are small
enough (< 4M elements) that the kernels run one tile config without autotuning, so each distinct
variant costs one compile (~1 s); test_every_tile_config compiles ~40 more.
"""
from __future__ import annotations

import contextlib
import zlib

import ml_dtypes
import numpy as np
import pytest

import spec
from spec.mxtensor import MXTensor
from tests.conformance.conftest import skip_reason
from tests.util import BF16, assert_bytes_equal, random_magnitudes, special_values_f32

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import backends  # noqa: E402
from backends.convert import to_numpy, to_torch  # noqa: E402

backends.load()
tq = pytest.importorskip("backends.triton.quantize")
tsw = pytest.importorskip("backends.triton.swizzle")

DEVICES = ("cpu", "cuda")
ALL_MODES = [(e, m, n) for e in ("e4m3", "e5m2") for m in ("rceil", "floor", "ceil", "even")
             for n in ("saturate", "nan_block")]


@pytest.fixture(params=DEVICES, ids=[f"triton-{d}" for d in DEVICES])
def device(request):
    reason = skip_reason("triton", request.param)
    if reason:
        pytest.skip(reason)
    return request.param


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(tsw, "POISON_OUTPUTS", True)


def _rng(*parts) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def _check(got, want, what):
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            _check(g, w, f"{what}[{i}]")
        return
    assert (got.axis, got.elem, got.scale_layout) == (want.axis, want.elem, want.scale_layout), what
    assert tuple(got.scale.shape) == tuple(want.scale.shape), what
    assert_bytes_equal(got.scale, want.scale, f"{what} scale")  # swizzled: padding bytes too
    assert_bytes_equal(got.data, want.data, f"{what} data")


def _quantize_both(x_np, device, what="", **kw):
    want = spec.mxfp8_quantize(x_np, **kw)
    got = tq.mxfp8_quantize(to_torch(x_np, device), **kw)
    _check(got, want, what or str(kw))
    return got, want


@contextlib.contextmanager
def _count_launches(monkeypatch):
    calls = []
    real = tq._launch_quantize

    def counting(x3, row, col, *args):
        calls.append((row is not None, col is not None))
        return real(x3, row, col, *args)

    monkeypatch.setattr(tq, "_launch_quantize", counting)
    yield calls
    monkeypatch.setattr(tq, "_launch_quantize", real)


def _special_tile_matrix(rows: int, cols: int, rng) -> np.ndarray:
    """fp32 [rows, cols]: normal data, with the first 32x32 tile holding one special block per row and
    per column pattern, so the remaining tiles stay finite (they take the kernel's fast path)."""
    x = random_magnitudes(rng, (rows, cols), np.float32)
    t = x[:32, :32]  # row r is a row block, column c a column block
    t[0] = np.nan  # all-NaN row block
    t[1, 5] = np.inf
    t[2, 7] = -np.inf
    t[3] = 0.0
    t[4] = -0.0
    t[5] = np.float32(2.0 ** -149) * np.arange(1, 33, dtype=np.float32)  # fp32 subnormals
    t[6] = np.float32(2.0 ** -133) * np.arange(1, 33, dtype=np.float32)  # bf16-subnormal magnitudes
    t[7] = 448.0
    t[8] = 1.0
    t[8, 3] = 449.0
    t[9] = 1.0
    t[9, 0] = 480.0
    t[9, 1] = -480.0
    t[10, :] = -1.0
    t[10, 4] = np.nan
    t[11] = np.float32(np.finfo(np.float32).max)
    t[12] = 1.0
    t[12, 9] = np.inf
    t[12, 10] = np.nan
    sv = special_values_f32()
    rows_sv = (sv.size + 31) // 32
    block = t[13:13 + rows_sv].copy()  # t is a strided view: fill a copy, then write it back
    block.reshape(-1)[: sv.size] = sv
    t[13:13 + rows_sv] = block
    # a second tile with a lone NaN and a lone Inf (column blocks through finite rows)
    if rows >= 64 and cols >= 64:
        x[40, 40] = np.nan
        x[50, 33] = -np.inf
    return x


# --------------------------------------------------------------------------------------------------
# one-pass dual quantize
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [(-1, 0), (0, -1)])
@pytest.mark.parametrize("in_dtype", ["float32", "bfloat16", "float16"])
def test_dual_is_one_pass(device, monkeypatch, axis, in_dtype):
    np_dtype = {"float32": np.float32, "bfloat16": BF16, "float16": np.float16}[in_dtype]
    x = random_magnitudes(_rng("dual", axis, in_dtype), (96, 160), np.float32)
    if in_dtype == "float16":
        x = np.clip(x, -60000, 60000)
    x = x.astype(np_dtype)
    with _count_launches(monkeypatch) as calls:
        _quantize_both(x, device, axis=axis)
    assert calls == [(True, True)], f"expected one launch writing both outputs, got {calls}"


def test_nd_dual_is_one_pass(device, monkeypatch):
    # [T, H, D] blocked along D (rowwise) and T (columnwise): the fused MLA layout, also swizzled
    x = random_magnitudes(_rng("nd"), (64, 3, 64), np.float32)
    for layout in ("compact", "swizzled"):
        with _count_launches(monkeypatch) as calls:
            _quantize_both(x, device, axis=(-1, 0), scale_layout=layout)
        assert calls == [(True, True)]
    # other tuples: one pass per axis, still byte-equal
    y = random_magnitudes(_rng("nd3"), (32, 32, 64), np.float32)
    with _count_launches(monkeypatch) as calls:
        _quantize_both(y, device, axis=(1, 0, 2), scale_layout="swizzled")
    assert sorted(calls) == [(False, True), (True, True)]


@pytest.mark.parametrize("tile", tq.config_space(), ids=lambda t: "x".join(map(str, t)))
def test_every_tile_config(device, tile):
    # shapes: one divisible by every tile (no masks), one masked in both dims, rows not a multiple
    # of 32 for the row-only kernel
    rng = _rng("tile", tile)
    shapes = [(128, 256), (96, 160)] if device == "cuda" else [(64, 128), (96, 96)]
    with tq.forced_config(*tile):
        for shape in shapes:
            x = _special_tile_matrix(*shape, rng)
            for layout in ("compact", "swizzled"):
                _quantize_both(x, device, what=f"{tile} {shape} {layout}", axis=(-1, 0), scale_layout=layout)
        _quantize_both(random_magnitudes(rng, (7, 96), np.float32), device, axis=-1, scale_layout="swizzled")
        _quantize_both(random_magnitudes(rng, (64, 40), np.float32), device, axis=0, scale_layout="swizzled")
        if device == "cuda":  # every config also for the dequantize kernel (row -> fp32, col -> bf16)
            t = spec.mxfp8_quantize(_special_tile_matrix(96, 160, rng), axis=(-1, 0), scale_layout="swizzled")
            for one, out_dtype in zip(t, ("float32", "bfloat16")):
                got = tq.mxfp8_dequantize(to_torch(one, device), out_dtype)
                with np.errstate(over="ignore", invalid="ignore"):
                    want = spec.mxfp8_dequantize(one, out_dtype)
                assert_bytes_equal(got, want, f"dequant {tile}")


# --------------------------------------------------------------------------------------------------
# special values
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("elem,scale_mode,nonfinite", ALL_MODES, ids=["-".join(m) for m in ALL_MODES])
def test_special_blocks_all_modes(device, elem, scale_mode, nonfinite):
    x = _special_tile_matrix(64, 64, _rng("special"))
    _quantize_both(x, device, axis=(-1, 0), elem=elem, scale_mode=scale_mode, nonfinite=nonfinite)


def test_byte_table(device):
    """SEMANTICS 1.4's table, independent of spec: e4m3, rceil, saturate, row blocks."""
    rows = {
        "448": ([448.0] + [1.0] * 31, 0x7F, None),
        "449": ([449.0] + [1.0] * 31, 0x80, None),
        "zero": ([0.0] * 32, 0x00, [0x00] * 32),
        "nan": ([np.nan] * 32, 0x00, [0x7F] * 32),
        "inf": ([np.inf] + [1.0] * 31, 0xFE, [0x7E] + [0x00] * 31),
        "tiny": ([2.0 ** -149] + [0.0] * 31, 0x00, None),
        "negzero": ([-0.0] * 32, 0x00, [0x80] * 32),
    }
    x = np.array([v for v, _, _ in rows.values()], dtype=np.float32)
    t = tq.mxfp8_quantize(to_torch(x, device), axis=-1)
    data, scale = to_numpy(t.data).view(np.uint8), to_numpy(t.scale)
    for i, (name, (_, want_scale, want_codes)) in enumerate(rows.items()):
        assert scale[i, 0] == want_scale, name
        if want_codes is not None:
            assert data[i].tolist() == want_codes, name


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_every_bf16_bit_pattern(device, elem):
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    x = bits.view(BF16).reshape(512, 128)
    for nonfinite in ("saturate", "nan_block"):
        _quantize_both(x, device, axis=(-1, 0), elem=elem, nonfinite=nonfinite)
    # shuffled, so blocks mix magnitudes (scale chosen by a large element, small ones underflow)
    shuffled = x.reshape(-1)[_rng("bits", elem).permutation(65536)].reshape(512, 128)
    _quantize_both(shuffled, device, axis=(-1, 0), elem=elem)


@pytest.mark.parametrize("scale_mode", ["rceil", "even"])
def test_random_fp32_bit_patterns(device, scale_mode):
    rng = _rng("f32bits", scale_mode)
    n = (256, 256) if device == "cuda" else (64, 128)
    bits = rng.integers(0, 2 ** 32, size=n, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = np.where(np.isnan(x) & (rng.random(n) < 0.9), np.float32(1.0), x)  # keep most blocks NaN-free
    for elem in ("e4m3", "e5m2"):
        _quantize_both(x, device, axis=(-1, 0), elem=elem, scale_mode=scale_mode)


# --------------------------------------------------------------------------------------------------
# swizzled scales written directly, layouts, odd shapes
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,axis", [
    ((96, 160), (-1, 0)),  # both scale matrices padded, padding written by the extended grid
    ((128, 128), (-1, 0)),  # no padding
    ((32, 3, 64), (-1, 0)),  # N-D dual: row scale padding not reachable -> zero-initialised buffer
    ((2, 64, 40), 1),  # middle axis, P = 2 batches
    ((5, 3, 64), -1),
    ((64,), 0),
    ((32, 320), 0),
], ids=str)
def test_swizzled_direct(device, shape, axis):
    x = random_magnitudes(_rng("swz", shape, axis), shape, np.float32)
    for elem in ("e4m3", "e5m2"):
        got, want = _quantize_both(x, device, axis=axis, elem=elem, scale_layout="swizzled")
        # and the swizzled result unswizzles (triton kernel) to the compact spec scales
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert_bytes_equal(tsw.unswizzle_scales(g).scale, spec.unswizzle_scales(w).scale, "unswizzle")


@pytest.mark.parametrize("shape,axis", [((64, 96), -1), ((64, 96), 0), ((300, 64), -1), ((2, 64, 5), 1),
                                        ((32, 3, 64), 0), ((32, 3, 64), 2)], ids=str)
def test_swizzle_kernels(device, shape, axis):
    t = spec.mxfp8_quantize(random_magnitudes(_rng("sk", shape), shape, np.float32), axis=axis)
    s = spec.swizzle_scales(t)
    assert_bytes_equal(tsw.swizzle_scales(to_torch(t, device)).scale, s.scale, "swizzle")
    assert_bytes_equal(tsw.unswizzle_scales(to_torch(s, device)).scale, t.scale, "unswizzle")
    same = to_torch(s, device)
    assert tsw.swizzle_scales(same) is same and tsw.unswizzle_scales(to_torch(t, device)).scale_layout == "compact"


def test_empty_and_tiny(device):
    for shape, axis in (((0, 64), (-1, 0)), ((0, 32), -1), ((1, 32), -1), ((32, 1), 0)):
        x = np.zeros(shape, np.float32)
        for layout in ("compact", "swizzled"):
            _quantize_both(x, device, axis=axis, scale_layout=layout)


# --------------------------------------------------------------------------------------------------
# dequantize
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,axis", [((96, 160), -1), ((96, 160), 0), ((2, 64, 5), 1), ((7, 64), -1)], ids=str)
@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_dequantize(device, shape, axis, elem):
    rng = _rng("dq", shape, axis, elem)
    x = random_magnitudes(rng, shape, np.float32)
    flat = x.reshape(-1)
    sv = special_values_f32()
    flat[rng.choice(flat.size, size=sv.size, replace=False)] = sv
    for nonfinite in ("saturate", "nan_block"):
        for layout in ("compact", "swizzled"):
            t = spec.mxfp8_quantize(x, axis=axis, elem=elem, nonfinite=nonfinite, scale_layout=layout)
            for out_dtype in ("float32", "bfloat16"):
                got = tq.mxfp8_dequantize(to_torch(t, device), out_dtype)
                with np.errstate(over="ignore", invalid="ignore"):
                    want = spec.mxfp8_dequantize(t, out_dtype)
                assert_bytes_equal(got, want, f"{nonfinite} {layout} {out_dtype}")


def test_dequantize_every_code_and_scale_byte(device):
    # rows: the 256 codes; 32 columns per block; blocks carry scale bytes 0..255 (8 per row tile)
    codes = np.tile(np.arange(256, dtype=np.uint8)[:, None], (1, 32 * 8))
    for elem, dt in (("e4m3", "float8_e4m3fn"), ("e5m2", "float8_e5m2")):
        data = codes.view(getattr(ml_dtypes, dt))
        scale = (np.arange(256 * 8) % 256).astype(np.uint8).reshape(256, 8)
        t = MXTensor(data, scale, 1, elem)
        for out_dtype in ("float32", "bfloat16"):
            with np.errstate(over="ignore", invalid="ignore"):
                want = spec.mxfp8_dequantize(t, out_dtype)
            assert_bytes_equal(tq.mxfp8_dequantize(to_torch(t, device), out_dtype), want, f"{elem} {out_dtype}")


def _assert_bf16_bytes_nan_positions(got, want, what):
    g = to_numpy(got).view(np.uint16)
    w = want.view(np.uint16)
    g_nan = (g & 0x7FFF) > 0x7F80
    w_nan = (w & 0x7FFF) > 0x7F80
    assert np.array_equal(g_nan, w_nan), f"{what}: NaN positions differ"
    assert_bytes_equal(np.where(g_nan, 0, g), np.where(w_nan, 0, w), what)


@pytest.mark.parametrize("layout", ["compact", "swizzled"])
def test_dequantize_bf16_flat_every_code_and_scale_byte(device, layout):
    # The flat bf16 pass (attention's pre-pass, the GEMM's bf16 route): every code under every scale
    # byte, rowwise and columnwise, compact and swizzled scales. Bytes equal spec's bf16 dequantize,
    # NaN compared by position: on the GPU a NaN lane keeps the hardware's NaN bits (its callers never
    # return them: attention's NaN stays NaN, the GEMM route's guard hands NaN to the exact fallback).
    from backends.triton.quantize import dequantize_bf16_flat

    codes = np.tile(np.arange(256, dtype=np.uint8)[:, None], (1, 32 * 8))
    for elem, dt in (("e4m3", "float8_e4m3fn"), ("e5m2", "float8_e5m2")):
        data = codes.view(getattr(ml_dtypes, dt))
        row = MXTensor(data, (np.arange(256 * 8) % 256).astype(np.uint8).reshape(256, 8), 1, elem)
        col = MXTensor(np.ascontiguousarray(data.T), (np.arange(8 * 256) % 256).astype(np.uint8).reshape(8, 256), 0,
                       elem)
        for t, what in ((row, "rowwise"), (col, "columnwise")):
            if layout == "swizzled":
                t = spec.swizzle_scales(t)
            with np.errstate(over="ignore", invalid="ignore"):
                want = spec.mxfp8_dequantize(t, "bfloat16")
            _assert_bf16_bytes_nan_positions(dequantize_bf16_flat(to_torch(t, device)), want, f"{elem} {what} {layout}")


def _random_mx(rng, shape, axis, elem, layout="compact"):
    """Every code byte (NaN codes included) under random scale bytes, 0, 1, 254 and 255 among them."""
    dt = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[elem]
    codes = rng.integers(0, 256, size=shape, dtype=np.uint8).view(dt)
    sshape = list(shape)
    sshape[axis] //= 32
    scales = rng.integers(0, 256, size=sshape, dtype=np.uint8)
    scales.reshape(-1)[:4] = (0, 1, 254, 255)
    t = MXTensor(codes, scales, axis, elem)
    return spec.swizzle_scales(t) if layout == "swizzled" else t


@pytest.mark.parametrize("count", [2, 3, 4])
def test_dequantize_bf16_flat_many_matches_one_by_one(device, count):
    # One launch per three tensors: the bytes of dequantize_bf16_flat for each tensor (rowwise, a
    # middle axis as attention's v, columnwise, swizzled), spec's values with NaN compared by position,
    # and the shared guard flag raised exactly when one of the one-by-one guards is.
    from backends.triton.quantize import dequantize_bf16_flat, dequantize_bf16_flat_many

    rng = _rng("flat_many", count)
    specs = [((2, 64, 3, 32), 3, "e4m3", "compact"), ((2, 64, 3, 32), 1, "e5m2", "compact"),
             ((96, 64), 0, "e4m3", "compact"), ((64, 96), 1, "e4m3", "swizzled")][:count]
    mx = [_random_mx(rng, *s) for s in specs]
    ts = [to_torch(t, device) for t in mx]
    for ranges, what in ((None, "unguarded"), ([(0, 255)] * count, "guard never raised"),
                         ([(10, 246)] * count, "guard raised"), ([(0, 255)] * (count - 1) + [(10, 246)], "last")):
        guard = None
        if ranges is not None:
            flag = torch.zeros(1, dtype=torch.int32, device=device)
            guard = (flag, ranges)
        got = dequantize_bf16_flat_many(ts, guard=guard)
        assert len(got) == count
        want_flag = 0
        for i, (t, g) in enumerate(zip(ts, got)):
            one_flag = torch.zeros(1, dtype=torch.int32, device=device)
            one = dequantize_bf16_flat(t, guard=None if ranges is None else (one_flag, *ranges[i]))
            want_flag |= int(one_flag.item())
            assert g.dtype == torch.bfloat16 and tuple(g.shape) == tuple(t.data.shape)
            assert_bytes_equal(to_numpy(g).view(np.uint16), to_numpy(one).view(np.uint16), f"{what} tensor {i}")
            with np.errstate(over="ignore", invalid="ignore"):
                ref = spec.mxfp8_dequantize(mx[i], "bfloat16")
            _assert_bf16_bytes_nan_positions(g, ref, f"{what} tensor {i} vs spec")
        if ranges is not None:
            assert int(flag.item()) == want_flag, f"{what}: flag {int(flag.item())}, one by one {want_flag}"


def test_dequantize_bf16_flat_rows_wider_than_a_block(device):
    # Rows a multiple of the pass's block (v along S with heads x 128 = 2048 here): the row width is a
    # runtime value (one compiled kernel for every head count), each block inside one row. Bytes equal
    # spec's, alone and in the three-tensor launch beside a constexpr-width tensor.
    from backends.triton.quantize import _FLAT_BLOCK, dequantize_bf16_flat, dequantize_bf16_flat_many

    rng = _rng("flat_wide_rows")
    v = _random_mx(rng, (1, 64, 2 * _FLAT_BLOCK // 128, 128), 1, "e4m3")  # inner = 2 blocks
    k = _random_mx(rng, (1, 64, 2, 192), 3, "e5m2")  # inner 1: the constexpr form
    want_v = spec.mxfp8_dequantize(v, "bfloat16")
    want_k = spec.mxfp8_dequantize(k, "bfloat16")
    with np.errstate(over="ignore", invalid="ignore"):
        _assert_bf16_bytes_nan_positions(dequantize_bf16_flat(to_torch(v, device)), want_v, "v alone")
        got_k, got_v = dequantize_bf16_flat_many([to_torch(k, device), to_torch(v, device)])
        _assert_bf16_bytes_nan_positions(got_v, want_v, "v beside k")
        _assert_bf16_bytes_nan_positions(got_k, want_k, "k beside v")


def test_dequantize_bf16_flat_many_rejects_mismatched_ranges():
    from backends.triton.quantize import dequantize_bf16_flat_many

    t = to_torch(_random_mx(_rng("ranges"), (32, 32), 1, "e4m3"), "cpu")
    with pytest.raises(ValueError, match="guard: expected 2"):
        dequantize_bf16_flat_many([t, t], guard=(torch.zeros(1, dtype=torch.int32), [(0, 255)]))


# --------------------------------------------------------------------------------------------------
# CUDA only: DeepSeek-V3 sizes, hardware fp8 conversion vs the integer-bit encoder
# --------------------------------------------------------------------------------------------------
def test_deepseek_shapes_cuda(device):
    if device != "cuda":
        pytest.skip("DeepSeek-V3 sizes run on CUDA only")
    rng = _rng("dsv3")
    x = random_magnitudes(rng, (2048, 1536), np.float32).astype(BF16)  # q_lora activations
    for layout in ("compact", "swizzled"):
        _quantize_both(x, device, axis=(-1, 0), scale_layout=layout)
        _quantize_both(x, device, axis=-1, scale_layout=layout)
    q = random_magnitudes(rng, (256, 128, 192), np.float32)  # [T, H, 192] fused-op layout
    _quantize_both(q, device, axis=(-1, 0))
    _quantize_both(q, device, axis=(-1, 0), scale_layout="swizzled")
    w = random_magnitudes(rng, (128 * 192, 1536), np.float32).astype(BF16)  # weight [N, K]
    _quantize_both(w, device, axis=-1, scale_layout="swizzled")


def test_hw_cvt_matches_bit_encoder_cuda(device, monkeypatch):
    if device != "cuda":
        pytest.skip("the hardware conversion exists on CUDA only")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("hardware fp32 -> fp8 conversion is used from sm90 on")
    bits = np.random.default_rng(7).integers(0, 2 ** 32, size=(1024, 1024), dtype=np.uint64).astype(np.uint32)
    x = to_torch(bits.view(np.float32), device)
    outs = {}
    for soft in ("0", "1"):
        monkeypatch.setenv("MXMLA_TRITON_SOFT_FP8", soft)
        for elem in ("e4m3", "e5m2"):
            for mode in ("rceil", "floor"):
                outs[soft, elem, mode] = tq.mxfp8_quantize(x, axis=(-1, 0), elem=elem, scale_mode=mode)
    for (soft, elem, mode), got in outs.items():
        if soft == "1":
            for g, h in zip(got, outs["0", elem, mode]):
                assert_bytes_equal(g.data, h.data, f"{elem} {mode} data hw vs bits")
                assert_bytes_equal(g.scale, h.scale, f"{elem} {mode} scale hw vs bits")


# --------------------------------------------------------------------------------------------------
# strided inputs read in place (single axis): slices of a wider last axis
# --------------------------------------------------------------------------------------------------
def _strided_case(rng, wide_shape, in_dtype):
    x = random_magnitudes(rng, wide_shape, np.float32)
    flat = x.reshape(-1)
    sv = special_values_f32()
    flat[: sv.size] = sv  # special values in the first rows' blocks
    flat[200:232] = np.nan  # an all-NaN block (row mode) ...
    if x.shape[-1] >= 64:
        x[..., 1, 32:64] = 0.0  # ... and all-zero blocks
    return x.astype({"float32": np.float32, "bfloat16": BF16}[in_dtype])


@pytest.mark.parametrize("in_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["k_nope", "v_rows", "v_cols", "mid_axis"])
def test_strided_single_axis_in_place(device, monkeypatch, case, in_dtype):
    """A slice of a [B, S, H, 256] projection, quantized along D (rows) or S (columns), is read in place
    (no contiguous copy: the launch gets a geometry) and gives spec's bytes for the sliced values."""
    wide = _strided_case(_rng("strided", case, in_dtype), (2, 64, 3, 256), in_dtype)
    xt = to_torch(wide, device)
    sl = {"k_nope": (slice(None), slice(None), slice(None), slice(0, 128)),
          "v_rows": (slice(None), slice(None), slice(None), slice(128, 256)),
          "v_cols": (slice(None), slice(None), slice(None), slice(128, 256)),
          "mid_axis": (slice(None), slice(None), slice(None), slice(64, 192))}[case]
    axis = {"k_nope": -1, "v_rows": -1, "v_cols": 1, "mid_axis": 1}[case]
    view = xt[sl]
    assert not view.is_contiguous()
    geometries = []
    real = tq._launch_quantize

    def spy(x3, row, col, elem, scale_mode, nonfinite, geometry=None):
        geometries.append(geometry)
        return real(x3, row, col, elem, scale_mode, nonfinite, geometry)

    monkeypatch.setattr(tq, "_launch_quantize", spy)
    for elem, mode, nonfinite in (("e4m3", "rceil", "saturate"), ("e5m2", "floor", "nan_block")):
        got = tq.mxfp8_quantize(view, axis=axis, elem=elem, scale_mode=mode, nonfinite=nonfinite)
        want = spec.mxfp8_quantize(np.ascontiguousarray(wide[sl]), axis=axis, elem=elem, scale_mode=mode,
                                   nonfinite=nonfinite)
        _check(got, want, f"{case} {elem} {mode} {nonfinite}")
    assert all(g is not None for g in geometries), geometries


def test_strided_geometry_rules():
    """What is read in place and what is copied first."""
    wide = torch.zeros(2, 64, 3, 256)
    g = tq._strided_geometry
    assert g(wide[..., :128], 3) == (1, 2 * 64 * 3, 128, 0, 256, 0, 0)
    assert g(wide[..., 128:], 1) == (2, 64, 3 * 128, 64 * 3 * 256, 3 * 256, 256, 128)
    assert g(wide[:, :, 0], 1) == (2, 64, 256, 64 * 3 * 256, 3 * 256, 0, 0)
    assert g(wide.transpose(1, 2)[..., :128], 3) is None          # rows not one strided axis
    assert g(wide[..., ::2], 3) is None                            # last axis not contiguous
    assert g(torch.zeros(4, 64, 1, 64).expand(4, 64, 3, 64), 3) is None  # broadcast heads under rows
    assert g(torch.zeros(2, 64, 3, 4, 64)[..., :32], 1) is None    # more than one axis above D
    assert g(torch.zeros(64, 3, 48)[..., :40], 0) is None          # D not whole blocks


def test_strided_swizzled_and_pairs_copy(device, monkeypatch):
    """Swizzled scales and axis tuples go through a contiguous copy (geometry None), bytes unchanged."""
    wide = _strided_case(_rng("strided-copy"), (64, 2, 256), "bfloat16")
    view = to_torch(wide, device)[..., :128]
    for kw in (dict(axis=-1, scale_layout="swizzled"), dict(axis=(-1, 0))):
        with _count_launches(monkeypatch) as calls:
            got = tq.mxfp8_quantize(view, **kw)
        want = spec.mxfp8_quantize(np.ascontiguousarray(wide[..., :128]), **kw)
        _check(got, want, str(kw))
        assert calls
