"""dispatch.nn: MLAQProjection / mla_q_projection and MLAAttention on CPU (torch backend)."""
from __future__ import annotations

import math

import pytest
import torch

import dispatch
import dispatch.autograd as mxag
import dispatch.nn as mxnn
from spec.mxtensor import MXTensor
from tests.util import assert_bytes_equal

B, S, K, H = 2, 32, 64, 2
T, N = B * S, H * 192


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops on a shared 2-core machine: one thread avoids waiting on a busy core
    yield
    torch.set_num_threads(threads)


def _tables(gen, rows=S):
    """cos / sin rows in HF's cat([f, f]) layout from random positions and frequencies."""
    angles = torch.rand(rows, 32, generator=gen, dtype=torch.float64) * 20.0
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def _module(path, style="mla", seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = mxnn.MLAQProjection(K, H, path=path, rope_style=style, backend="torch", dtype=dtype)
    with torch.no_grad():
        m.weight.normal_(0.0, K ** -0.5)
        m.norm_weight.uniform_(0.5, 1.5)
    return m


def _inputs(gen, dtype=torch.bfloat16):
    x = (torch.randn(B, S, K, generator=gen) * torch.exp2(torch.randint(-6, 7, (B, S, 1), generator=gen).float()))
    cos, sin = _tables(gen)
    return x.to(dtype), cos[None], sin[None]  # cos / sin [1, S, 64]: broadcast over the batch


def _unfused_mxfp8_q(m, x, cos, sin, style):
    """The fused op's definition (spec/mla_q.py) written out with the original (unreordered) weight and
    `style` RoPE: exact GEMM of the MXFP8 operands rounded to fp32 then bf16, RoPE in fp32, quantize."""
    y_row, _, _ = dispatch.run("rmsnorm_mxfp8", x.reshape(T, K), m.norm_weight.detach(), eps=m.eps, backend="torch")
    w_row = dispatch.run("mxfp8_quantize", m.weight.detach().bfloat16(), axis=1, backend="torch")
    acc = dispatch.run("mxfp8_gemm", y_row, w_row, out_dtype="float32", backend="torch")
    q = acc.bfloat16().view(T, H, 192)
    rows = cos.expand(B, S, 64).reshape(T, 64), sin.expand(B, S, 64).reshape(T, 64)
    q32 = dispatch.run("rope", q, *rows, style=style, layout="thd", out_dtype="float32", backend="torch")
    return dispatch.run("mxfp8_quantize", q32, axis=-1, backend="torch")


@pytest.mark.parametrize("style", ["mla", "neox"])
def test_mxfp8_q_equals_the_unfused_definition_bytewise(style):
    """For neox the fused (mla-style) kernel runs on the reordered weight; its output is neox RoPE of
    the original q byte for byte (each output feature is the same dot product, only moved)."""
    gen = torch.Generator().manual_seed(1)
    m = _module("mxfp8", style)
    x, cos, sin = _inputs(gen)
    q = m(x, cos, sin)
    assert isinstance(q, MXTensor) and q.shape == (B, S, H, 192) and q.axis == 3
    want = _unfused_mxfp8_q(m, x, cos, sin, style)
    assert_bytes_equal(q.data.reshape(T, H, 192), want.data, f"{style} q codes")
    assert_bytes_equal(q.scale.reshape(T, H, 6), want.scale, f"{style} q scales")


def test_neox_rows_pair_the_halves():
    rows = mxnn.neox_rows(2)
    assert rows.shape == (384,) and torch.equal(torch.sort(rows).values, torch.arange(384))
    head = rows[:192]
    assert torch.equal(head[:128], torch.arange(128))
    assert torch.equal(head[128::2], torch.arange(128, 160)) and torch.equal(head[129::2], torch.arange(160, 192))
    assert torch.equal(rows[192:], head + 192)
    assert mxnn.neox_rows(2) is rows  # one tensor per (heads, device): the weight cache keys on it


@pytest.mark.parametrize("style", ["mla", "neox"])
def test_bf16_q_is_rmsnorm_gemm_rope(style):
    gen = torch.Generator().manual_seed(2)
    m = _module("bf16", style)
    x, cos, sin = _inputs(gen)
    q = m(x, cos, sin)
    assert q.dtype == torch.bfloat16 and q.shape == (B, S, H, 192)
    h = mxnn.rms_norm(x.reshape(T, K), m.norm_weight.detach(), m.eps)
    lin = torch.nn.functional.linear(h.bfloat16(), m.weight.detach().bfloat16()).view(T, H, 192)
    rows = cos.expand(B, S, 64).reshape(T, 64), sin.expand(B, S, 64).reshape(T, 64)
    want = dispatch.run("rope", lin, *rows, style=style, layout="thd", backend="torch")
    assert_bytes_equal(q.reshape(T, H, 192), want, "bf16 q")


@pytest.mark.parametrize("style", ["mla", "neox"])
def test_mxfp8_gradients_track_the_bf16_path(style):
    """Gradients of weight, norm_weight and x through the fused op against the bf16 path: e4m3
    quantization of y, w, q and (MXFP8 backward) g twice, each <= 2^-4 relative, independent:
    relative error <= sqrt(5) * 2^-4 = 0.14 on each gradient."""
    gen = torch.Generator().manual_seed(3)
    x, cos, sin = _inputs(gen)
    r = torch.randn(B, S, H, 192, generator=gen)
    grads = {}
    for path in ("bf16", "mxfp8"):
        m = _module(path, style)
        xi = x.float().requires_grad_(True)
        q = m(xi, cos, sin)
        qf = mxag.mxfp8_dequantize(q) if isinstance(q, MXTensor) else q.float()
        (qf * r).sum().backward()
        grads[path] = (m.weight.grad, m.norm_weight.grad, xi.grad)
    bound = math.sqrt(5) * 2 ** -4
    for name, got, want in zip(("weight", "norm_weight", "x"), grads["mxfp8"], grads["bf16"]):
        err = float((got.double() - want.double()).norm() / want.double().norm())
        assert 0 < err <= bound, f"{style} {name}: {err:.4f} > {bound:.4f}"
        assert got.dtype == torch.float32


def test_mxfp8_without_norm_quantizes_the_input():
    gen = torch.Generator().manual_seed(4)
    x, cos, sin = _inputs(gen)
    w = torch.randn(N, K, generator=gen) * K ** -0.5
    q = mxnn.mla_q_projection(x, w, cos, sin, path="mxfp8", backend="torch")
    x_row = dispatch.run("mxfp8_quantize", x.reshape(T, K), axis=1, backend="torch")
    w_row = dispatch.run("mxfp8_quantize", w.bfloat16(), axis=1, backend="torch")
    rows = cos.expand(B, S, 64).reshape(T, 64), sin.expand(B, S, 64).reshape(T, 64)
    want, _ = dispatch.run("mla_q_uproj_rope_quant", x_row, w_row, *rows, backend="torch")
    assert_bytes_equal(q.data.reshape(T, H, 192), want.data, "q codes from the quantized input")


def test_from_linear_shares_the_parameters():
    lin = torch.nn.Linear(K, N, bias=False)

    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(K))
            self.variance_epsilon = 1e-5

    norm = Norm()
    m = mxnn.MLAQProjection.from_linear(lin, norm=norm, path="bf16")
    assert m.weight is lin.weight and m.norm_weight is norm.weight and m.eps == 1e-5
    assert (m.in_features, m.num_heads) == (K, H)
    plain = mxnn.MLAQProjection.from_linear(lin)
    assert plain.norm_weight is None and [n for n, _ in plain.named_parameters()] == ["weight"]
    with pytest.raises(ValueError, match="linear: the fused Q path has no bias"):
        mxnn.MLAQProjection.from_linear(torch.nn.Linear(K, N))


def test_attention_module_quantizes_plain_operands_as_the_kernels_want():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(B, S, H, 192, generator=gen).bfloat16()
    k = torch.randn(B, S, H, 192, generator=gen).bfloat16()
    v = torch.randn(B, S, H, 128, generator=gen).bfloat16()
    attn = mxnn.MLAAttention(causal=True, softmax_scale=0.1, path="mxfp8", backend="torch")
    o, lse = attn(q, k, v)
    want = dispatch.run("mla_attention", dispatch.run("mxfp8_quantize", q, axis=-1, backend="torch"),
                        dispatch.run("mxfp8_quantize", k, axis=-1, backend="torch"),
                        dispatch.run("mxfp8_quantize", v, axis=1, backend="torch"), causal=True,
                        softmax_scale=0.1, layout="bshd", backend="torch")
    assert_bytes_equal(o, want[0], "o")
    assert_bytes_equal(lse, want[1], "lse")
    o_bf16, _ = mxnn.MLAAttention(causal=False, path="bf16", backend="torch")(q, k, v, causal=True)
    want_bf16 = dispatch.run("mla_attention", q, k, v, causal=True, layout="bshd", backend="torch")[0]
    assert_bytes_equal(o_bf16, want_bf16, "bf16 o with the per-call causal override")


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(path="fp8"), ValueError, "path: expected one of"),
    (dict(rope_style="gptj"), ValueError, "rope_style: expected one of"),
])
def test_bad_choices_name_the_argument(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        mxnn.MLAQProjection(K, H, **kwargs)


def test_bad_shapes_name_the_argument():
    gen = torch.Generator().manual_seed(6)
    x, cos, sin = _inputs(gen)
    w = torch.randn(N, K, generator=gen)
    with pytest.raises(ValueError, match="weight: expected \\[H \\* 192, K\\]"):
        mxnn.mla_q_projection(x, w[:100], cos, sin)
    with pytest.raises(ValueError, match="weight: expected K = x.shape\\[-1\\]"):
        mxnn.mla_q_projection(x[..., :32], w, cos, sin)
    with pytest.raises(ValueError, match="cos: shape"):
        mxnn.mla_q_projection(x, w, cos[:, :5], sin)
    with pytest.raises(ValueError, match="x: the mxfp8 path needs the token count"):
        mxnn.mla_q_projection(x[:, :20], w, cos[:, :20], sin[:, :20], path="mxfp8")
    with pytest.raises(ValueError, match="norm_weight: expected shape"):
        mxnn.mla_q_projection(x, w, cos, sin, norm_weight=torch.ones(3))
