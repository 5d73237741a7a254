"""Triton mla_q cases the shared conformance file does not reach: both forward kernels (TMA and pointer)
at pinned tiles (both RoPE de-interleave variants, token tails, K not a multiple of BLOCK_K, 32/64/128-row
tiles), strided / transposed x, swizzled MXFP8 scales, NaN / Inf inputs, the backward pre-pass outputs
(RoPE-backward g, the one-pass dual quantize, transposed columnwise copies, plain quantize of x / w),
and odd backward shapes. Outputs are allocated poisoned (0xFF), and whole buffers are compared.

Bytes against spec on exact-arithmetic inputs (SEMANTICS 6: every product and partial sum exact in fp32,
so any summation order gives spec's fp32 accumulator). Random inputs: the bound of SEMANTICS 6 as the
shared file states it -- at most 1e-3 of code bytes and of scale bytes differ from spec (a tensor-core
summation order moves the fp32 accumulator by ~1 ulp; after bf16 staging that flips a code only when
the value sits on a rounding boundary), and each dequantized value within one e4m3 step of spec's.
CUDA adds DeepSeek-V3 widths (H = 128, K = 1536).
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import spec
from tests.conformance.conftest import run_on
from tests.conformance.test_mla_q import assert_close_mx, staging_flip_bound
from tests.test_mla_q import exact_case, mx_rowwise, random_operands, tables
from tests.util import BF16, assert_bytes_equal, poisoned_empty, skip_without_triton_interpreter

torch = pytest.importorskip("torch")
pytest.importorskip("triton")  # every test here is of the Triton backend
from backends.convert import to_numpy, to_torch  # noqa: E402
from spec.mxtensor import MXTensor  # noqa: E402

D = 192
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy under the interpreter: NaN/Inf cases


@pytest.fixture
def mla(monkeypatch):
    """The Triton mla_q module with outputs allocated as 0xFF bytes (NaN / NaN codes / scale 255)."""
    import backends.triton.gemm as gemm_mod
    import backends.triton.mla_q as mod

    monkeypatch.setattr(mod, "_empty", poisoned_empty)
    monkeypatch.setattr(gemm_mod, "_empty", poisoned_empty)
    return mod


def _seed(*parts) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def _check_mx(got, want, what):
    assert isinstance(got, MXTensor)
    assert (got.axis, got.elem, got.scale_layout) == (want.axis, want.elem, want.scale_layout), what
    assert_bytes_equal(got.data, want.data, f"{what} data")
    assert_bytes_equal(got.scale, want.scale, f"{what} scale")


def _mx_exact(x, w, hexp):
    return (mx_rowwise(x, np.zeros(x.shape[0], dtype=np.int64)),
            mx_rowwise(w / np.repeat(2.0 ** hexp, D)[:, None], np.repeat(hexp, D)))


def _exact_inputs(rng, tokens, k, heads, kind, table_dtype=np.float32):
    x, w, cos, sin, _, _, hexp = exact_case(rng, tokens=tokens, k=k, heads=heads)
    cos, sin = cos.astype(table_dtype), sin.astype(table_dtype)
    if kind == "bf16":
        return x.astype(BF16), w.astype(BF16), cos, sin
    xm, wm = _mx_exact(x, w, hexp)
    if kind == "mxfp8-swizzled":
        xm, wm = spec.swizzle_scales(xm), spec.swizzle_scales(wm)
    return xm, wm, cos, sin


def _dev(args, device):
    return [to_torch(a, device) for a in args]


def _pinned(device, block_m, block_k, split, kind):
    """A fixed tile: small ones under the interpreter, the GPU's own shapes on CUDA."""
    if device == "cpu":
        return dict(BLOCK_M=block_m, BLOCK_K=block_k, GROUP_M=2, ROPE_SPLIT=split, num_warps=4, num_stages=1)
    warps = 8 if block_m == 128 else 4
    return dict(BLOCK_M=block_m, BLOCK_K=block_k, GROUP_M=8, ROPE_SPLIT=split, num_warps=warps, num_stages=3)


def _variant_or_skip(device, variant, kind="bf16"):
    """Skip a Gluon case ("gluon_ws", "gluon_ws128") where the Gluon kernels do not run (CPU / interpreter,
    not sm90). An MXFP8 projection runs them on its guarded bf16 dequantization."""
    if not variant.startswith("gluon"):
        return
    if device != "cuda":
        pytest.skip("the Gluon kernel runs on CUDA only (no interpreter)")
    import backends.triton.mla_q as mod

    probe = torch.zeros((64, 64), dtype=torch.bfloat16, device="cuda")
    reasons = mod.gluon_reasons(probe, probe)
    if reasons:
        pytest.skip("; ".join(reasons))


@pytest.mark.parametrize("shape", [(64, 64, 1), (128, 96, 3), (192, 1536, 4)], ids=lambda s: "T{}K{}H{}".format(*s))
def test_forward_gluon_tables_exact_bytes(triton_target, mla, shape):
    # The 64-token Gluon sm90 kernel: K tails (96 with 64-wide steps), several heads, fp32 and bf16
    # tables; every output buffer poisoned.
    device = triton_target[1]
    _variant_or_skip(device, "gluon_ws")
    tokens, k, heads = shape
    for table in (np.float32, BF16):
        x, w, cos, sin = _exact_inputs(_seed("fwd-gluon", shape, table.__name__), tokens, k, heads, "bf16", table)
        want = spec.mla_q_uproj_rope_quant(x, w, cos, sin)
        got = mla.mla_q_forward_launch(*_dev((x, w, cos, sin), device), variant="gluon_ws")
        _check_mx(got[0], want[0], f"q_row ({table.__name__} tables)")
        _check_mx(got[1], want[1], f"q_col ({table.__name__} tables)")


# (variant, its configs table in mla_q_gluon, shapes): fewer tiles than SMs, a few per program (one or
# several per warpgroup: the turn and, for ws128, shared-buffer barriers), K tails, and the DeepSeek
# width (T = 4096 x 128 heads) against the TMA kernel
_WS_CASES = [("gluon_ws", "WS_CONFIGS", s) for s in [(64, 64, 1), (128, 96, 3), (192, 1536, 4), (4096, 1536, 128)]]
_WS_CASES += [("gluon_ws128", "WS128_CONFIGS", s) for s in [(128, 64, 1), (256, 96, 3), (384, 1536, 4),
                                                            (4096, 1536, 128)]]


@pytest.mark.parametrize("variant,table,shape", _WS_CASES, ids=lambda c: c if isinstance(c, str) and c.startswith(
    "gluon") else ("T{}K{}H{}".format(*c) if isinstance(c, tuple) else None))
def test_forward_gluon_ws_exact_bytes(triton_target, mla, variant, table, shape):
    # The persistent warp-specialized kernels against spec (exact inputs: any summation order gives
    # spec's bytes), every config of the variant's table on the small shapes, its default on the wide one.
    device = triton_target[1]
    _variant_or_skip(device, variant)
    tokens, k, heads = shape
    x, w, cos, sin = _exact_inputs(_seed("fwd-" + variant.replace("_", "-"), shape), tokens, k, heads, "bf16")
    if tokens * heads > 4096:  # spec on the whole DeepSeek width is slow: compare with the TMA kernel
        want = mla.mla_q_forward_launch(*_dev((x, w, cos, sin), device), variant="tma",
                                        config=_pinned(device, 64, 64, True, "bf16"))
    else:
        want = spec.mla_q_uproj_rope_quant(x, w, cos, sin)
    import backends.triton.mla_q_gluon as qg

    configs = getattr(qg, table)
    for cfg in configs if tokens * heads <= 4096 else configs[:1]:
        got = mla.mla_q_forward_launch(*_dev((x, w, cos, sin), device), variant=variant, config=cfg)
        _check_mx(got[0], want[0], f"q_row {cfg}")
        _check_mx(got[1], want[1], f"q_col {cfg}")


def test_gluon_ws128_rejects_a_token_tail(triton_target, mla):
    device = triton_target[1]
    _variant_or_skip(device, "gluon_ws")
    x, w, cos, sin = _exact_inputs(_seed("fwd-gluon-ws128-tail"), 192, 64, 1, "bf16")
    with pytest.raises(ValueError, match="tokens % 128"):
        mla.mla_q_forward_launch(*_dev((x, w, cos, sin), device), variant="gluon_ws128")


# (T, K, H, BLOCK_M, BLOCK_K, ROPE_SPLIT): token tails (96 = 64 + 32), K tails (96 with 64-wide steps),
# 32-row tiles (one columnwise block per program), both RoPE variants.
_TILES = [
    (96, 96, 2, 64, 64, False),
    (96, 96, 2, 64, 64, True),
    (64, 64, 1, 32, 32, True),
    (128, 128, 3, 64, 32, False),
]


@pytest.mark.parametrize("variant", ["pointer", "tma"])
@pytest.mark.parametrize("kind", ["bf16", "mxfp8", "mxfp8-swizzled"])
@pytest.mark.parametrize("tile", _TILES, ids=lambda t: "T{}K{}H{}-bm{}bk{}-{}".format(*t[:5], "split" if t[5] else "perm"))
def test_forward_tiles_exact_bytes(triton_target, mla, tile, kind, variant):
    tokens, k, heads, block_m, block_k, split = tile
    device = triton_target[1]
    rng = _seed("fwd-tiles", tile, kind)
    x, w, cos, sin = _exact_inputs(rng, tokens, k, heads, kind, np.float32 if block_m != 32 else BF16)
    want = spec.mla_q_uproj_rope_quant(x, w, cos, sin)
    if kind != "bf16":
        block_k = max(block_k, 32)
    got = mla.mla_q_forward_launch(*_dev((x, w, cos, sin), device), config=_pinned(device, block_m, block_k, split, kind),
                                   variant=variant)
    _check_mx(got[0], want[0], "q_row")
    _check_mx(got[1], want[1], "q_col")


@pytest.mark.parametrize("layout", ["row-padded", "transposed"])
def test_forward_strided_x(triton_target, mla, layout):
    # x as a view: rows padded to K + 4 (8-byte row stride: not TMA-addressable -> pointer kernel), or
    # the transpose of a [K, T] tensor (unit stride along T). Tables as strided column views.
    device = triton_target[1]
    rng = _seed("fwd-strided", layout)
    x, w, cos, sin = _exact_inputs(rng, 64, 64, 2, "bf16")
    want = spec.mla_q_uproj_rope_quant(x, w, cos, sin)
    xt = to_torch(x, device)
    if layout == "row-padded":
        wide = torch.zeros((64, 68), dtype=torch.bfloat16, device=device)
        wide[:, :64] = xt
        xv = wide[:, :64]
    else:
        xv = xt.t().contiguous().t()
    cos_wide = torch.zeros((64, 128), dtype=torch.float32, device=device)
    cos_wide[:, 32:96] = to_torch(cos, device)
    got = run_on(triton_target, "mla_q_uproj_rope_quant", xv, to_torch(w, device), cos_wide[:, 32:96],
                 to_torch(sin, device))
    _check_mx(got[0], want[0], "q_row")
    _check_mx(got[1], want[1], "q_col")


@pytest.mark.parametrize("variant", ["pointer", "tma", "gluon_ws", "gluon_ws128"])
def test_forward_nonfinite_inputs(triton_target, mla, variant):
    # Rows of x holding NaN / +Inf / a huge finite value (q overflows to Inf after bf16 staging), a cos
    # entry NaN: NaN and Inf flow through the GEMM, the staging, RoPE (Inf - Inf, Inf * 0) and both
    # quantizations (NaN ignored in amax, Inf blocks -> scale 254, NaN codes 0x7F).
    device = triton_target[1]
    _variant_or_skip(device, variant)
    rng = _seed("fwd-nonfinite")
    x, w, cos, sin = _exact_inputs(rng, 128 if variant == "gluon_ws128" else 64, 64, 2, "bf16")
    x = x.astype(np.float32)
    x[3, 5] = np.nan
    x[7, :] = 0.0
    x[7, 9] = np.inf
    x[40, 2] = 3.0e38
    x = x.astype(BF16)
    cos = cos.copy()
    cos[50, 3] = np.nan
    want = spec.mla_q_uproj_rope_quant(x, w, cos, sin)
    cfg = None if variant.startswith("gluon") else _pinned(device, 64, 32, variant == "tma", "bf16")
    got = mla.mla_q_forward_launch(*_dev((x, w, cos, sin), device), config=cfg, variant=variant)
    _check_mx(got[0], want[0], "q_row")
    _check_mx(got[1], want[1], "q_col")


@pytest.mark.parametrize("variant", ["pointer", "tma", "gluon_ws", "gluon_ws128"])
@pytest.mark.parametrize("kind", ["bf16", "mxfp8"])
def test_forward_random_within_bound(triton_target, mla, kind, variant):
    device = triton_target[1]
    _variant_or_skip(device, variant, kind)
    rng = _seed("fwd-random", kind)
    tokens, k, heads = (64, 256, 2) if device == "cpu" else (256, 1536, 16)
    x, w = random_operands(rng, tokens, k, heads, mx=kind == "mxfp8", spread=3)
    cos, sin = tables(rng, tokens, BF16)
    want = spec.mla_q_uproj_rope_quant(x, w, cos, sin)
    cfg = _pinned(device, 64, 64, True, kind) if device == "cpu" else None
    got = mla.mla_q_forward_launch(*_dev((x, w, cos, sin), device), config=cfg, variant=variant)
    flip = staging_flip_bound(x, w, cos, sin)
    assert_close_mx(got[0], want[0], flip, "q_row")
    assert_close_mx(got[1], want[1], flip, "q_col")


@pytest.mark.gpu
def test_forward_deepseek_width_autotuned(triton_target):
    # H = 128 heads, K = 1536, T = 256 through the dispatcher (autotuned, default variant): exact inputs
    # give spec's bytes; random ones stay within the bound.
    if triton_target[1] != "cuda":
        pytest.skip("DeepSeek-V3 widths run on CUDA only")
    rng = _seed("fwd-deepseek")
    x, w, cos, sin = _exact_inputs(rng, 256, 1536, 128, "bf16")
    want = spec.mla_q_uproj_rope_quant(x, w, cos, sin)
    got = run_on(triton_target, "mla_q_uproj_rope_quant", *_dev((x, w, cos, sin), "cuda"))
    _check_mx(got[0], want[0], "q_row exact")
    _check_mx(got[1], want[1], "q_col exact")
    x, w = random_operands(rng, 256, 1536, 128, mx=False, spread=2)
    cos, sin = tables(rng, 256, np.float32)
    want = spec.mla_q_uproj_rope_quant(x, w, cos, sin)
    got = run_on(triton_target, "mla_q_uproj_rope_quant", *_dev((x, w, cos, sin), "cuda"))
    flip = staging_flip_bound(x, w, cos, sin)
    assert_close_mx(got[0], want[0], flip, "q_row random")
    assert_close_mx(got[1], want[1], flip, "q_col random")


# ------------------------------------------------------------------------------------------------
# backward


def _g32(dq, cos, sin):
    tokens = dq.shape[0]
    return spec.rope_backward(dq, cos, sin, style="mla", layout="thd", positions=np.arange(tokens),
                              out_dtype="float32").reshape(tokens, -1)


def test_backward_prepass_outputs_bytes(triton_target, mla):
    # The fused pre-pass alone: g = RN_bf16(RoPE backward) and, in one pass, g quantized along N and
    # along T (written transposed [N, T] with scales [N, T/32]); NaN / Inf / huge values included.
    device = triton_target[1]
    rng = _seed("prepass")
    tokens, heads = 96, 3
    dq = (rng.integers(-8, 9, size=(tokens, heads, D)) * 2.0 ** rng.integers(-20, 20, size=(tokens, heads, 1)))
    dq = dq.astype(np.float32)
    dq[5, 1, 130] = np.nan
    dq[6, 2, 10] = np.inf
    dq[9, 0, 170] = -3.0e38
    dq = dq.astype(BF16)
    cos, sin = tables(rng, tokens, np.float32)
    g32 = _g32(dq, cos, sin)
    want_row, want_col = spec.mxfp8_quantize(g32, axis=(1, 0))
    dq_t, cos_t, sin_t = _dev((dq, cos, sin), device)
    g, (rc, rs), (ct, cts) = mla._prep_launch(dq_t.reshape(tokens, -1), cos_t, sin_t, rope=True, write_bf16=True,
                                              row_q=True, col_q=True)
    g_want = g32.astype(BF16)
    nan = np.isnan(g_want.astype(np.float32))
    g_got = to_numpy(g)
    assert np.array_equal(np.isnan(g_got.astype(np.float32)), nan)  # NaN bits after arithmetic vary
    assert_bytes_equal(np.where(nan, 0, g_got), np.where(nan, 0, g_want), "g bf16")
    assert_bytes_equal(rc, want_row.data, "g_row codes")
    assert_bytes_equal(rs, want_row.scale, "g_row scales")
    assert_bytes_equal(ct, want_col.data.T, "g_col codes (transposed)")
    assert_bytes_equal(cts, want_col.scale.T, "g_col scales (transposed)")


@pytest.mark.parametrize("cols", [96, 160])
def test_backward_plain_quantize_along_rows(triton_target, mla, cols):
    # The pre-pass without RoPE quantizes bf16 x [T, K] / w [N, K] along axis 0 for the MXFP8 backward,
    # written transposed; K = 96 / 160 leaves a half-filled 64-column tile.
    device = triton_target[1]
    rng = _seed("plain", cols)
    x = (rng.standard_normal((64, cols)) * 2.0 ** rng.integers(-30, 30, size=(1, cols))).astype(BF16)
    want = spec.mxfp8_quantize(x, axis=0)
    _, _, (ct, cts) = mla._prep_launch(to_torch(x, device), col_q=True)
    assert_bytes_equal(ct, want.data.T, "codes")
    assert_bytes_equal(cts, want.scale.T, "scales")


@pytest.mark.parametrize("quantize_grad", [False, True])
@pytest.mark.parametrize("kind", ["bf16", "mxfp8"])
def test_backward_odd_shapes_exact_bytes(triton_target, mla, kind, quantize_grad):
    # T = 96 (a half-filled 64-token pre-pass tile), K = 96, H = 3; MXFP8 operands with swizzled scales.
    device = triton_target[1]
    rng = _seed("bwd-odd", kind, quantize_grad)
    tokens, k, heads = 96, 96, 3
    x, w, cos, sin, _, _, hexp = exact_case(rng, tokens=tokens, k=k, heads=heads)
    cos, sin = cos.astype(np.float32), sin.astype(np.float32)
    dq = rng.choice([0.0, 1.0, -1.0, 0.5], size=(tokens, heads, D), p=[0.85, 0.05, 0.05, 0.05]).astype(BF16)
    if kind == "bf16":
        args = (x.astype(BF16), w.astype(BF16))
    elif quantize_grad:
        args = (spec.swizzle_scales(spec.mxfp8_quantize(x.astype(BF16), axis=0)),
                spec.swizzle_scales(spec.mxfp8_quantize(w.astype(BF16), axis=0)))
    else:
        args = tuple(spec.swizzle_scales(t) for t in _mx_exact(x, w, hexp))
    want = spec.mla_q_uproj_rope_quant_backward(dq, *args, cos, sin, quantize_grad)
    got = mla.mla_q_backward_launch(*_dev((dq, *args, cos, sin), device), quantize_grad)
    assert_bytes_equal(got[0], want[0], "dx")
    assert_bytes_equal(got[1], want[1], "dw")


def test_gluon_variant_selection_off_gpu(monkeypatch):
    # Off an sm90 GPU the Gluon kernels are never chosen by auto, and naming one raises with its reasons
    # instead of running another kernel; an MXFP8 projection names its own reason. (CPU tensors: the
    # interpreter's choices.)
    skip_without_triton_interpreter()
    import backends.triton.mla_q as mod
    import dispatch

    x = torch.zeros((64, 64), dtype=torch.bfloat16)
    w = torch.zeros((192, 64), dtype=torch.bfloat16)
    cos = torch.zeros((64, 64))
    assert mod.forward_variant(x, w) == "tma"  # the interpreter runs the TMA kernel on addressable operands
    assert mod.forward_variant(x[:, ::2], w[:, ::2]) == "pointer"
    for variant in mod.GLUON_VARIANTS:
        with pytest.raises(dispatch.BackendUnavailable, match=f"triton:{variant}: the Gluon kernel runs on CUDA only"):
            dispatch.run("mla_q_uproj_rope_quant", x, w, cos, cos, backend="triton", variant=variant)
    xm = MXTensor(torch.zeros((64, 64), dtype=torch.float8_e4m3fn), torch.zeros((64, 2), dtype=torch.uint8), 1, "e4m3",
                  "compact")
    assert "CUDA only" in mod.gluon_reasons(xm, xm)[0]  # an MXFP8 projection runs them dequantized on CUDA
    assert "must both be bf16 or both MXTensors" in mod.gluon_reasons(xm, x)[0]
    with pytest.raises(ValueError, match="variant='gluon_ws' cannot run here"):
        mod.mla_q_forward_launch(x, w, cos, cos, variant="gluon_ws")


def test_named_tma_on_operands_tma_cannot_address_raises_never_pointer():
    skip_without_triton_interpreter()  # CPU tensors
    import backends.triton.mla_q as mod
    import dispatch

    x = torch.zeros((64, 128), dtype=torch.bfloat16)[:, ::2]  # row stride 256 bytes, but not unit last stride
    w = torch.zeros((192, 128), dtype=torch.bfloat16)[:, ::2]
    cos = torch.zeros((64, 64))
    with pytest.raises(dispatch.BackendUnavailable, match="triton:tma: x and w must be TMA-addressable"):
        dispatch.run("mla_q_uproj_rope_quant", x, w, cos, cos, backend="triton:tma")
    with pytest.raises(ValueError, match="variant='tma' cannot run here: x and w must be TMA-addressable"):
        mod.mla_q_forward_launch(x, w, cos, cos, variant="tma")
    assert dispatch.select("mla_q_uproj_rope_quant", x, w, cos, cos, backend="triton") == "triton:pointer"


def test_gluon_ws128_selection_and_arguments(monkeypatch):
    # auto on an sm90 GPU the Gluon kernels accept (mocked: no GPU here): the 128-token kernel when
    # T % 128 == 0, the 64-token one otherwise; naming gluon_ws128 with a token tail names its reason;
    # the Gluon launcher rejects an unknown variant and a token tail before any launch.
    import types

    import backends.triton.mla_q as mod

    monkeypatch.setattr(mod, "interpret_mode", lambda: False)
    monkeypatch.setattr(mod, "_tma_ok", lambda t: True)
    monkeypatch.setattr(mod, "gluon_reasons", lambda x, w: [])
    fake = lambda tokens: types.SimpleNamespace(shape=(tokens, 64), device=types.SimpleNamespace(type="cuda"))  # noqa: E731
    assert mod.forward_variant(fake(256), fake(192)) == "gluon_ws128"
    assert mod.forward_variant(fake(192), fake(192)) == "gluon_ws"
    assert mod.forward_variant_reasons("gluon_ws128", fake(256), fake(192)) == []
    assert mod.forward_variant_reasons("gluon_ws128", fake(192), fake(192)) == [
        "gluon_ws128 needs tokens % 128 == 0, got 192"]
    with pytest.raises(ValueError, match="variant: expected one of gluon_ws128, gluon_ws, tma, pointer"):
        mod.forward_variant_reasons("ws128", fake(256), fake(192))
    try:
        import backends.triton.mla_q_gluon as qg
    except ImportError as exc:  # a Triton without Gluon's Hopper API
        pytest.skip(f"Gluon unavailable: {exc}")
    w = torch.zeros((192, 64), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="variant: expected one of gluon_ws, gluon_ws128, got 'ws128'"):
        qg.launch(torch.zeros((128, 64), dtype=torch.bfloat16), w, *([None] * 6), variant="ws128")
    with pytest.raises(ValueError, match=r"x: variant 'gluon_ws128' needs tokens % 128 == 0, got 192"):
        qg.launch(torch.zeros((192, 64), dtype=torch.bfloat16), w, *([None] * 6), variant="gluon_ws128")
