"""mla_q_uproj_rope_quant (+ backward) on every backend present.

Bytes on exact-arithmetic inputs (SEMANTICS 6: products and partial sums exact in fp32); on random
inputs the bound SEMANTICS 6 states: rare one-code / one-scale-step flips (upstream <= 1e-4 of code
bytes; a small test gets 1e-3), each flipped value within one e4m3 step of the spec's.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import spec
from tests.conformance.conftest import run_on
from tests.test_mla_q import exact_case, mx_rowwise, random_operands, tables
from tests.util import BF16, assert_bytes_equal

torch = pytest.importorskip("torch")
from backends.convert import to_numpy, to_torch  # noqa: E402  (needs torch)
from spec.mxtensor import MXTensor  # noqa: E402

D = 192


def _seed(*parts) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def _dev(args, device):
    return [to_torch(a, device) for a in args]


def _check_mx_bytes(got, want, what):
    assert isinstance(got, MXTensor) and isinstance(got.data, torch.Tensor), what
    assert (got.axis, got.elem, got.scale_layout) == (want.axis, want.elem, want.scale_layout), what
    assert_bytes_equal(got.data, want.data, f"{what} data")
    assert_bytes_equal(got.scale, want.scale, f"{what} scale")


def _forward(target, x, w, cos, sin):
    got = run_on(target, "mla_q_uproj_rope_quant", *_dev((x, w, cos, sin), target[1]))
    assert isinstance(got, tuple) and len(got) == 2
    assert all(t.data.device.type == target[1] for t in got)
    return got


def _mx_exact(x, w, hexp):
    return (mx_rowwise(x, np.zeros(x.shape[0], dtype=np.int64)),
            mx_rowwise(w / np.repeat(2.0 ** hexp, D)[:, None], np.repeat(hexp, D)))


@pytest.mark.parametrize("table_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["bf16", "mxfp8"])
def test_forward_exact_arithmetic_bytes(target, kind, table_dtype):
    rng = _seed("mla_q-exact", kind, table_dtype)
    x, w, cos, sin, _, _, hexp = exact_case(rng, tokens=64, k=256, heads=3)
    cos, sin = cos.astype(table_dtype), sin.astype(table_dtype)
    x, w = (x.astype(BF16), w.astype(BF16)) if kind == "bf16" else _mx_exact(x, w, hexp)
    want = spec.mla_q_uproj_rope_quant(x, w, cos, sin)
    got = _forward(target, x, w, cos, sin)
    _check_mx_bytes(got[0], want[0], "q_row")
    _check_mx_bytes(got[1], want[1], "q_col")


def test_forward_exact_small_integers_dense(target):
    # dense small integers: x in [-3, 3], w in [-3, 3] * 2^-4, K = 128 -> |q| <= 1152 * 2^-4 on a 2^-4
    # grid: exact in fp32 in any order; bf16 staging and RoPE then round identically everywhere.
    rng = _seed("mla_q-dense")
    x = rng.integers(-3, 4, size=(64, 128)).astype(BF16)
    w = (rng.integers(-3, 4, size=(2 * D, 128)) / 16).astype(BF16)
    cos, sin = tables(rng, 64)
    want = spec.mla_q_uproj_rope_quant(x, w, cos, sin)
    got = _forward(target, x, w, cos, sin)
    _check_mx_bytes(got[0], want[0], "q_row")
    _check_mx_bytes(got[1], want[1], "q_col")


def staging_flip_bound(x, w, cos, sin) -> np.ndarray:
    """float64 [T, H, 192]: how far one bf16-ulp flip of the staged q can move each value before
    quantization. The GEMM's summation order decides which side of a bf16 rounding boundary an
    accumulator lands on, and one ulp is at most 2^-7 of the value. No-RoPE features move by that
    much; a RoPE output mixes two staged inputs, e*c - o*s or o*c + e*s, so it moves by up to
    2^-7 (|e| |c| + |o| |s|), which under cancellation is far more than the output itself."""
    xd = spec.mxfp8_dequantize(x).astype(np.float64) if isinstance(x, MXTensor) else np.asarray(x, np.float64)
    wd = spec.mxfp8_dequantize(w).astype(np.float64) if isinstance(w, MXTensor) else np.asarray(w, np.float64)
    q = np.abs((xd @ wd.T).astype(np.float32).astype(BF16).astype(np.float64)).reshape(xd.shape[0], -1, D)
    c, s = (np.abs(np.asarray(t, np.float64))[:, None, :] for t in (cos, sin))
    even, odd = q[..., 128::2], q[..., 129::2]
    bound = 2.0 ** -7 * q
    bound[..., 128:160] = 2.0 ** -7 * (even * c[..., :32] + odd * s[..., :32])
    bound[..., 160:] = 2.0 ** -7 * (odd * c[..., 32:] + even * s[..., 32:])
    return bound


def assert_close_mx(got, want, flip, what):
    """SEMANTICS 6's random-input bound: <= 1e-3 of code bytes and of scale bytes differ, and every
    dequantized value within one e4m3 step of spec's (2^-3 relative, or one subnormal step 2^-9 *
    scale, taking the larger of the two values and of the two block scales, since a permitted scale
    flip gives the blocks different steps), plus `flip` (staging_flip_bound) for a bf16 staging flip."""
    g_codes, w_codes = to_numpy(got.data).view(np.uint8), want.data.view(np.uint8)
    g_scale, w_scale = to_numpy(got.scale), want.scale
    assert np.mean(g_codes != w_codes) <= 1e-3, f"{what}: {np.mean(g_codes != w_codes):.2e} of codes differ"
    assert np.mean(g_scale != w_scale) <= 1e-3, f"{what}: scales differ"
    gv = spec.mxfp8_dequantize(to_numpy(got)).astype(np.float64)
    wv = spec.mxfp8_dequantize(want).astype(np.float64)
    scales = np.maximum(spec.quantize.scale_value(g_scale).astype(np.float64),
                        spec.quantize.scale_value(w_scale).astype(np.float64))
    step = np.repeat(scales, 32, axis=want.axis) * 2.0 ** -9
    bound = 2.0 ** -3 * np.maximum(np.abs(gv), np.abs(wv)) + step + flip
    assert np.all(np.abs(gv - wv) <= bound), f"{what}: {np.count_nonzero(np.abs(gv - wv) > bound)} values out of bound"


@pytest.mark.parametrize("kind", ["bf16", "mxfp8"])
def test_forward_random_within_bound(target, kind):
    rng = _seed("mla_q-random", kind)
    x, w = random_operands(rng, 64, 1536, 4, mx=kind == "mxfp8", spread=3)  # K = q_lora_rank
    cos, sin = tables(rng, 64, BF16)
    want = spec.mla_q_uproj_rope_quant(x, w, cos, sin)
    got = _forward(target, x, w, cos, sin)
    flip = staging_flip_bound(x, w, cos, sin)
    assert_close_mx(got[0], want[0], flip, "q_row")
    assert_close_mx(got[1], want[1], flip, "q_col")


# ------------------------------------------------------------------------------------------------
# backward


def _backward(target, dq, x, w, cos, sin, quantize_grad):
    got = run_on(target, "mla_q_uproj_rope_quant_backward", *_dev((dq, x, w, cos, sin), target[1]),
                 quantize_grad=quantize_grad)
    assert isinstance(got, tuple) and len(got) == 2
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in got)
    return got


@pytest.mark.parametrize("quantize_grad", [False, True])
@pytest.mark.parametrize("kind", ["bf16", "mxfp8"])
def test_backward_exact_arithmetic_bytes(target, kind, quantize_grad):
    rng = _seed("mla_q-bwd-exact", kind, quantize_grad)
    x, w, cos, sin, _, _, hexp = exact_case(rng, tokens=64, k=64, heads=2)
    cos, sin = cos.astype(np.float32), sin.astype(np.float32)
    dq = rng.choice([0.0, 1.0, -1.0, 0.5], size=(64, 2, D), p=[0.85, 0.05, 0.05, 0.05]).astype(BF16)
    if kind == "bf16":
        args = (x.astype(BF16), w.astype(BF16))
    elif quantize_grad:  # MXFP8 copies blocked along T and N
        args = (spec.mxfp8_quantize(x.astype(BF16), axis=0), spec.mxfp8_quantize(w.astype(BF16), axis=0))
    else:  # the forward's operands, blocked along K
        args = _mx_exact(x, w, hexp)
    want = spec.mla_q_uproj_rope_quant_backward(dq, *args, cos, sin, quantize_grad)
    got = _backward(target, dq, *args, cos, sin, quantize_grad)
    assert_bytes_equal(got[0], want[0], "dx")
    assert_bytes_equal(got[1], want[1], "dw")


@pytest.mark.parametrize("quantize_grad", [False, True])
def test_backward_random_within_bound(target, quantize_grad):
    # got = RN_bf16(s), |s - exact| <= 2 C 2^-24 * (|g| @ |w|) for an fp32 sum over C terms in any
    # order (2x gamma_C margin): |got - want| <= ulp_bf16(want) + 2 C 2^-24 * mag.
    rng = _seed("mla_q-bwd-random", quantize_grad)
    tokens, k, heads = 64, 256, 2
    x, w = random_operands(rng, tokens, k, heads, mx=False, spread=3)
    cos, sin = tables(rng, tokens)
    dq = rng.standard_normal((tokens, heads, D)).astype(BF16)
    want = spec.mla_q_uproj_rope_quant_backward(dq, x, w, cos, sin, quantize_grad)
    got = _backward(target, dq, x, w, cos, sin, quantize_grad)
    g = spec.rope_backward(dq, cos, sin, style="mla", layout="thd", positions=np.arange(tokens),
                           out_dtype="float32").reshape(tokens, heads * D).astype(np.float64)
    ag, ax, aw = np.abs(g), np.abs(x.astype(np.float64)), np.abs(w.astype(np.float64))
    cases = (("dx", got[0], want[0], ag @ aw, heads * D), ("dw", got[1], want[1], ag.T @ ax, tokens))
    for name, gv, wv, mag, c in cases:
        gv, wv = to_numpy(gv).astype(np.float64), wv.astype(np.float64)
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(wv), 2.0 ** -126))) - 7)
        mag = mag * (1.25 if quantize_grad else 1.0)  # MXFP8 operands: |dq(v)| <= |v| (1 + 2^-3)
        assert np.all(np.abs(gv - wv) <= ulp + 2 * c * 2.0 ** -24 * mag), name
