"""dispatch.autograd on CPU: gradients of every autograd op, backend plumbing, torch.compile, the example.

Two kinds of check per op:
- plumbing, byte-exact: the gradient equals what the op's backward (spec backend, or the torch
  formula for RMSNorm) returns for the same dL/d(output), so the custom op hands the right tensors,
  options and backend to the backward;
- semantics, with a stated bound: the gradient against an independent float64 torch autograd of the
  straight-through surrogate (the op without its quantizers), or an identity that must hold.
opcheck runs in tests/test_autograd_opcheck.py (it is the slow part).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dispatch
import dispatch.autograd as mxag
from backends.torch.rmsnorm import rmsnorm_backward as torch_rmsnorm_backward
from spec.mxtensor import MXTensor
from tests.util import assert_bytes_equal, skip_without_triton_interpreter

ROOT = Path(__file__).resolve().parents[1]
H = 2  # heads in the small shapes (the head dims 192 / 128 are fixed by the ops)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative Frobenius error, in float64."""
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).norm() / e.norm().clamp_min(1e-300))


def bf16_exact(shape, gen) -> torch.Tensor:
    """fp32 values exactly representable in bf16 (so a cast to a bf16 gradient proxy is lossless)."""
    return torch.randn(shape, generator=gen).bfloat16().float()


def rope_tables(rows: int, gen, dtype=torch.float32):
    """cos/sin rows whose two halves differ (a symmetric table would hide a half swap)."""
    angles = torch.rand(rows, 64, generator=gen, dtype=torch.float64) * 6.0
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_mla_f64(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """float64 mla-style RoPE of the last 64 features of [T, H, D] q, per-token tables [T, 64]."""
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    rot = q[..., -64:]
    even, odd = rot[..., 0::2], rot[..., 1::2]
    left = even * c[..., :32] - odd * s[..., :32]
    right = odd * c[..., 32:] + even * s[..., 32:]
    return torch.cat([q[..., :-64], left, right], dim=-1)


def rmsnorm_f64(x: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-6, zero_centered: bool = False):
    g = gamma + 1.0 if zero_centered else gamma
    return x * torch.rsqrt(x.square().mean(dim=1, keepdim=True) + eps) * g


def attention_f64(q, k, v, causal: bool, scale: float):
    """float64 softmax attention of bshd [B, S, H, D] tensors, bottom-right causal mask."""
    qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    s = qh @ kh.transpose(-1, -2) * scale
    if causal:
        s_q, s_kv = s.shape[-2], s.shape[-1]
        i = torch.arange(s_q)[:, None]
        j = torch.arange(s_kv)[None, :]
        s = s.masked_fill(j > i + (s_kv - s_q), float("-inf"))
    return (torch.softmax(s, dim=-1) @ vh).permute(0, 2, 1, 3)


def untracked(t) -> MXTensor:
    """The plain MXTensor of a TrackedMXTensor (what the backward ops receive)."""
    return MXTensor(t.data, t.scale, t.axis, t.elem, t.scale_layout)


# --------------------------------------------------------------------------------------------------
# mxfp8_quantize / mxfp8_dequantize: straight-through
# --------------------------------------------------------------------------------------------------

def test_quantize_bytes_and_straight_through_gradient():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 96, generator=gen).requires_grad_()
    row, col = mxag.mxfp8_quantize(x, axis=(1, 0))
    want_row, want_col = dispatch.run("mxfp8_quantize", x.detach(), axis=(1, 0), backend="spec")
    for got, want, what in ((row, want_row, "row"), (col, want_col, "col")):
        assert (got.axis, got.elem, got.scale_layout) == (want.axis, want.elem, want.scale_layout)
        assert_bytes_equal(got.data, want.data, f"{what} codes")
        assert_bytes_equal(got.scale, want.scale, f"{what} scales")
    assert row.grad_proxy is col.grad_proxy and row.grad_proxy.stride() == (0, 0)
    g_row, g_col = bf16_exact(x.shape, gen), bf16_exact(x.shape, gen)
    loss = (mxag.mxfp8_dequantize(row) * g_row).sum() + (mxag.mxfp8_dequantize(col, "bfloat16").float() * g_col).sum()
    loss.backward()
    # identity gradient: both uses of the one proxy add up, in x's dtype (fp32 sums of bf16 values: exact)
    assert torch.equal(x.grad, g_row + g_col)


def test_untracked_mxtensor_is_a_constant():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(32, 64, generator=gen)
    plain = dispatch.run("mxfp8_quantize", x, axis=-1)
    assert not mxag.mxfp8_dequantize(plain).requires_grad


# --------------------------------------------------------------------------------------------------
# rope
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("style", ["mla", "neox", "interleaved"])
def test_rope_gradient_is_the_transpose(style):
    """Plumbing: dx is spec's rope_backward of dL/dout (bytes). Semantics: rope is linear, so
    <rope(x), G> = <x, dx> up to fp32 rounding (each output and gradient element is within 2^-23
    relative of its exact value: bound 1e-6 relative to sum |x| |dx|)."""
    gen = torch.Generator().manual_seed(3)
    tokens = 96
    cu = torch.tensor([0, 40, 96], dtype=torch.int32)
    start = torch.tensor([3, 7], dtype=torch.int64)
    cos, sin = rope_tables(128, gen)
    x = torch.randn(tokens, H, 192, generator=gen).requires_grad_()
    out = mxag.rope(x, cos, sin, style=style, layout="thd", cu_seqlens=cu, start_positions=start)
    want = dispatch.run("rope", x.detach(), cos, sin, style=style, layout="thd", cu_seqlens=cu,
                        start_positions=start, backend="spec")
    assert_bytes_equal(out, want, "rope forward")
    g = torch.randn(out.shape, generator=gen)
    (out * g).sum().backward()
    want_dx = dispatch.run("rope_backward", g, cos, sin, style=style, layout="thd", cu_seqlens=cu,
                           start_positions=start, out_dtype="float32", backend="spec")
    assert_bytes_equal(x.grad, want_dx, "dx")
    lhs = (out.detach().double() * g.double()).sum()
    rhs = (x.detach().double() * x.grad.double()).sum()
    scale = (x.detach().double().abs() * x.grad.double().abs()).sum()
    assert abs(float(lhs - rhs)) <= 1e-6 * float(scale)


def test_rope_bf16_gradient_dtype_and_out_dtype():
    """dx comes back in x's dtype even when the output dtype differs (out_dtype='float32')."""
    gen = torch.Generator().manual_seed(4)
    cos, sin = rope_tables(64, gen)
    x = torch.randn(2, 64, H, 192, generator=gen).bfloat16().requires_grad_()
    out = mxag.rope(x, cos, sin, layout="bshd", out_dtype="float32")
    assert out.dtype == torch.float32
    g = torch.randn(out.shape, generator=gen)
    (out * g).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    want = dispatch.run("rope_backward", g, cos, sin, layout="bshd", out_dtype="bfloat16", backend="spec")
    assert_bytes_equal(x.grad, want, "dx")


def test_rope_of_a_strided_slice_is_not_copied_and_matches():
    """k_pe sliced from the kv projection (row stride 576, as the MLA block passes it) goes to the backend
    as it is: same output and gradient bytes as the contiguous copy, and the slice's own gradient."""
    gen = torch.Generator().manual_seed(6)
    cos, sin = rope_tables(64, gen)
    kv = (torch.randn(2 * 64, 576, generator=gen) * 3).bfloat16().requires_grad_()
    k_pe = kv[:, 512:].reshape(2, 64, 1, 64)
    assert not k_pe.is_contiguous()
    seen = []
    real = dispatch.run

    def spy(op, *args, **kwargs):
        if op == "rope":
            seen.append(args[0].stride())
        return real(op, *args, **kwargs)

    dispatch.run = spy
    try:
        out = mxag.rope(k_pe, cos, sin, layout="bshd", backend="torch")
    finally:
        dispatch.run = real
    assert seen == [k_pe.stride()], "the strided slice reached the backend as a copy"
    want = dispatch.run("rope", k_pe.detach().contiguous(), cos, sin, layout="bshd", backend="spec")
    assert_bytes_equal(out, want, "out")
    g = torch.randn(out.shape, generator=gen).bfloat16()
    (out.float() * g.float()).sum().backward()
    want_dx = dispatch.run("rope_backward", g, cos, sin, layout="bshd", backend="spec")
    assert_bytes_equal(kv.grad[:, 512:].reshape(2, 64, 1, 64), want_dx, "dx")
    assert not kv.grad[:, :512].any()


# --------------------------------------------------------------------------------------------------
# mla_q_uproj_rope_quant
# --------------------------------------------------------------------------------------------------

def _mla_q_inputs(gen, tokens=64, k=64, heads=H):
    x = (torch.randn(tokens, k, generator=gen)).bfloat16()
    w = (torch.randn(heads * 192, k, generator=gen) * 0.125).bfloat16()
    cos, sin = rope_tables(tokens, gen)
    return x, w, cos, sin


def test_mla_q_bf16_gradients():
    gen = torch.Generator().manual_seed(5)
    x, w, cos, sin = _mla_q_inputs(gen)
    x.requires_grad_(), w.requires_grad_()
    q_row, q_col = mxag.mla_q_uproj_rope_quant(x, w, cos, sin)
    want_row, want_col = dispatch.run("mla_q_uproj_rope_quant", x.detach(), w.detach(), cos, sin, backend="spec")
    assert_bytes_equal(q_row.data, want_row.data, "q_row codes")
    assert_bytes_equal(q_col.scale, want_col.scale, "q_col scales")
    g = bf16_exact(q_row.shape, gen)
    (mxag.mxfp8_dequantize(q_row) * g).sum().backward()

    # plumbing: the gradient at the proxy is g (bf16-exact), handed to the op's backward
    want_dx, want_dw = dispatch.run("mla_q_uproj_rope_quant_backward", g.bfloat16(), x.detach(), w.detach(),
                                    cos, sin, backend="spec")
    assert_bytes_equal(x.grad, want_dx, "dx")
    assert_bytes_equal(w.grad, want_dw, "dw")

    # semantics: float64 autograd of q = rope(x @ w^T) (no quantizer). Bound 1e-2: the op stages g to
    # bf16 after the RoPE transpose and rounds dx, dw to bf16 (2^-9 relative each), and the forward's
    # bf16 staging does not enter the gradient of a linear map.
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    q64 = rope_mla_f64((x64 @ w64.T).view(x.shape[0], H, 192), cos, sin)
    (q64 * g.double()).sum().backward()
    assert rel_err(x.grad, x64.grad) <= 1e-2
    assert rel_err(w.grad, w64.grad) <= 1e-2


def test_mla_q_row_and_col_share_the_gradient():
    """q_row and q_col are one q quantized twice: a loss on either gives the same gradient."""
    gen = torch.Generator().manual_seed(6)
    x, w, cos, sin = _mla_q_inputs(gen)
    g = bf16_exact((x.shape[0], H, 192), gen)
    grads = []
    for which in (0, 1):
        xl = x.clone().requires_grad_()
        out = mxag.mla_q_uproj_rope_quant(xl, w, cos, sin)[which]
        (mxag.mxfp8_dequantize(out) * g).sum().backward()
        grads.append(xl.grad)
    assert_bytes_equal(grads[0], grads[1], "dx via q_row vs q_col")


@pytest.mark.parametrize("quantize_grad", [False, True])
def test_mxfp8_chain_rmsnorm_quantize_mla_q(quantize_grad):
    """c_q -> rmsnorm_mxfp8 -> fused op with an MXFP8 weight (bf16 master, straight-through).

    Plumbing (bytes): w's gradient is the op's backward dw of dL/dq; c_q's and gamma's are
    rmsnorm_backward of the op's backward dx. Semantics: float64 autograd of the unquantized chain.
    Bounds: e4m3 rounds each operand to within 2^-4 relative (about 2^-4/sqrt(3) = 3.6% rms), and the
    forward's quantized y, w and (quantize_grad) the quantized g and transposed operands enter the
    gradients linearly: 0.08 (16-bit backward) and 0.12 (MXFP8 backward), about three times the error
    measured at this size (0.026 / 0.037)."""
    gen = torch.Generator().manual_seed(7)
    tokens, k = 64, 64
    c_q = torch.randn(tokens, k, generator=gen).requires_grad_()
    gamma = (1.0 + 0.1 * torch.randn(k, generator=gen)).requires_grad_()
    w_master = (torch.randn(H * 192, k, generator=gen) * 0.125).requires_grad_()
    cos, sin = rope_tables(tokens, gen)

    y_row, y_col, rstd = mxag.rmsnorm_mxfp8(c_q, gamma)
    assert not rstd.requires_grad
    w_row, w_col = mxag.mxfp8_quantize(w_master.bfloat16(), axis=(1, 0))
    q_row, _ = mxag.mla_q_uproj_rope_quant(y_row, w_row, cos, sin, quantize_grad=quantize_grad,
                                           x_t=y_col, w_n=w_col)
    g = bf16_exact(q_row.shape, gen)
    (mxag.mxfp8_dequantize(q_row) * g).sum().backward()

    x_arg, w_arg = (y_col, w_col) if quantize_grad else (y_row, w_row)
    want_dx, want_dw = dispatch.run("mla_q_uproj_rope_quant_backward", g.bfloat16(), untracked(x_arg), untracked(w_arg),
                                    cos, sin, quantize_grad=quantize_grad, backend="spec")
    assert_bytes_equal(w_master.grad, want_dw.float(), "dw")
    want_dc, want_dgamma = mxag.rmsnorm_backward(want_dx.float(), c_q.detach(), gamma.detach(), rstd)
    assert_bytes_equal(c_q.grad, want_dc, "d c_q")
    assert_bytes_equal(gamma.grad, want_dgamma, "d gamma")

    c64, g64, w64 = (t.detach().double().requires_grad_() for t in (c_q, gamma, w_master))
    q64 = rope_mla_f64((rmsnorm_f64(c64, g64) @ w64.T).view(tokens, H, 192), cos, sin)
    (q64 * g.double()).sum().backward()
    bound = 0.12 if quantize_grad else 0.08
    for got, want, what in ((c_q.grad, c64.grad, "c_q"), (gamma.grad, g64.grad, "gamma"),
                            (w_master.grad, w64.grad, "w")):
        err = rel_err(got, want)
        assert err <= bound, f"{what}: relative error {err:.3g} > {bound}"


def test_mla_q_mxfp8_backward_needs_the_transposed_copies():
    gen = torch.Generator().manual_seed(8)
    x, w, cos, sin = _mla_q_inputs(gen)
    x_row = mxag.mxfp8_quantize(x, axis=1)
    w_row = mxag.mxfp8_quantize(w, axis=1)
    with pytest.raises(ValueError, match="x_t"):
        mxag.mla_q_uproj_rope_quant(x_row, w_row, cos, sin, quantize_grad=True)


def test_mla_q_mxfp8_backward_from_bf16_operands():
    """quantize_grad=True with bf16 x and w: the backend quantizes them along T and N itself."""
    gen = torch.Generator().manual_seed(9)
    x, w, cos, sin = _mla_q_inputs(gen)
    x.requires_grad_(), w.requires_grad_()
    q_row, _ = mxag.mla_q_uproj_rope_quant(x, w, cos, sin, quantize_grad=True)
    g = bf16_exact(q_row.shape, gen)
    (mxag.mxfp8_dequantize(q_row) * g).sum().backward()
    want_dx, want_dw = dispatch.run("mla_q_uproj_rope_quant_backward", g.bfloat16(), x.detach(), w.detach(),
                                    cos, sin, quantize_grad=True, backend="spec")
    assert_bytes_equal(x.grad, want_dx, "dx")
    assert_bytes_equal(w.grad, want_dw, "dw")


# --------------------------------------------------------------------------------------------------
# rmsnorm_mxfp8
# --------------------------------------------------------------------------------------------------

class _RMSNormF64(torch.autograd.Function):
    """float64 y = x * rstd * g whose backward is the torch backend's rmsnorm_backward (under test; the op
    takes float32 / bfloat16 / float16, and this function alone also computes in float64)."""

    @staticmethod
    def forward(ctx, x, gamma, zero_centered):
        rstd = torch.rsqrt(x.square().mean(dim=1) + 1e-6)
        ctx.save_for_backward(x, gamma, rstd)
        ctx.zero_centered = zero_centered
        g = gamma + 1.0 if zero_centered else gamma
        return x * rstd[:, None] * g

    @staticmethod
    def backward(ctx, dy):
        x, gamma, rstd = ctx.saved_tensors
        dx, dgamma = torch_rmsnorm_backward(dy, x, gamma, rstd, ctx.zero_centered)
        return dx, dgamma, None


@pytest.mark.parametrize("zero_centered", [False, True])
def test_rmsnorm_backward_finite_differences(zero_centered):
    """The hand-written RMSNorm backward against central finite differences in float64 (gradcheck:
    eps 1e-6, atol 1e-5, rtol 1e-3)."""
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(6, 32, generator=gen, dtype=torch.float64).requires_grad_()
    offset = 0.0 if zero_centered else 1.0
    gamma = (torch.randn(32, generator=gen, dtype=torch.float64) * 0.5 + offset).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: _RMSNormF64.apply(a, b, zero_centered), (x, gamma))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_op_gradients(dtype):
    """Plumbing (bytes): the op's dx, dgamma are rmsnorm_backward of dL/dy at the forward's rstd.
    Semantics: float64 autograd of y = RMSNorm(x) (no quantizer): the fp32 arithmetic keeps the
    gradients within 1e-5 relative (a few fp32 roundings per element; bf16 inputs are exact in fp32
    and their gradients round once more to bf16: 1e-2)."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(64, 96, generator=gen).to(dtype).requires_grad_()
    gamma = (1.0 + 0.2 * torch.randn(96, generator=gen)).to(dtype).requires_grad_()
    y_row, y_col, rstd = mxag.rmsnorm_mxfp8(x, gamma)
    want = dispatch.run("rmsnorm_mxfp8", x.detach(), gamma.detach(), backend="spec")
    assert_bytes_equal(y_row.data, want[0].data, "y_row codes")
    assert_bytes_equal(y_col.scale, want[1].scale, "y_col scales")
    assert_bytes_equal(rstd, want[2], "rstd")
    g1, g2 = bf16_exact(x.shape, gen), bf16_exact(x.shape, gen)
    ((mxag.mxfp8_dequantize(y_row) * g1).sum() + (mxag.mxfp8_dequantize(y_col) * g2).sum()).backward()
    dy = g1 + g2
    want_dx, want_dgamma = mxag.rmsnorm_backward(dy, x.detach(), gamma.detach(), rstd)
    assert_bytes_equal(x.grad, want_dx, "dx")
    assert_bytes_equal(gamma.grad, want_dgamma, "dgamma")
    x64, gamma64 = x.detach().double().requires_grad_(), gamma.detach().double().requires_grad_()
    (rmsnorm_f64(x64, gamma64) * dy.double()).sum().backward()
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(x.grad, x64.grad) <= bound
    assert rel_err(gamma.grad, gamma64.grad) <= bound


# --------------------------------------------------------------------------------------------------
# mla_attention
# --------------------------------------------------------------------------------------------------

def _attention_leaves(gen, batch=2, seq=64, seq_kv=64):
    q = torch.randn(batch, seq, H, 192, generator=gen).bfloat16().requires_grad_()
    k = torch.randn(batch, seq_kv, H, 192, generator=gen).bfloat16().requires_grad_()
    v = torch.randn(batch, seq_kv, H, 128, generator=gen).bfloat16().requires_grad_()
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("operands", ["bf16", "mxfp8", "mixed"])
def test_attention_gradients(causal, operands):
    """Against float64 autograd of softmax attention on the (dequantized) operands. Bound 1e-2
    relative Frobenius: SEMANTICS 8's bf16 bound; it holds for MXFP8 operands too because the
    gradient is w.r.t. the dequantized values and the torch backend does not quantize P."""
    gen = torch.Generator().manual_seed(12)
    q, k, v = _attention_leaves(gen)
    q_in, k_in, v_in = q, k, v
    if operands in ("mxfp8", "mixed"):
        q_in = mxag.mxfp8_quantize(q, axis=-1)
        v_in = mxag.mxfp8_quantize(v, axis=1)  # bshd: blocked along S
        if operands == "mxfp8":
            k_in = mxag.mxfp8_quantize(k, axis=-1)
    o, lse = mxag.mla_attention(q_in, k_in, v_in, causal=causal)
    assert o.requires_grad and not lse.requires_grad
    g = torch.randn(o.shape, generator=gen)
    (o.float() * g).sum().backward()

    deq = lambda t: mxag.mxfp8_dequantize(t).detach() if isinstance(t, MXTensor) else t.detach()  # noqa: E731
    ref = [deq(t).double().requires_grad_() for t in (q_in, k_in, v_in)]
    o64 = attention_f64(*ref, causal, 1.0 / math.sqrt(192))
    assert rel_err(o, o64) <= 1e-2
    (o64 * g.double()).sum().backward()
    for got, want, what in zip((q.grad, k.grad, v.grad), (r.grad for r in ref), "qkv"):
        err = rel_err(got, want)
        assert err <= 1e-2, f"d{what}: relative error {err:.3g}"


def test_attention_thd_matches_bshd():
    """thd with two equal-length sequences is the bshd batch of two: same o and gradients."""
    gen = torch.Generator().manual_seed(13)
    q, k, v = _attention_leaves(gen, batch=2, seq=32, seq_kv=32)
    g = torch.randn(2, 32, H, 128, generator=gen).bfloat16()
    o, _ = mxag.mla_attention(q, k, v, causal=True, layout="bshd")
    (o.float() * g.float()).sum().backward()
    grads_bshd = [t.grad for t in (q, k, v)]
    leaves = [t.detach().reshape(64, *t.shape[2:]).requires_grad_() for t in (q, k, v)]
    cu = torch.tensor([0, 32, 64], dtype=torch.int32)
    o_thd, lse = mxag.mla_attention(*leaves, causal=True, layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert lse.shape == (H, 64)
    (o_thd.float() * g.reshape(64, H, 128).float()).sum().backward()
    assert_bytes_equal(o_thd, o.reshape(64, H, 128), "o")
    for got, want, what in zip((t.grad for t in leaves), grads_bshd, "qkv"):
        assert_bytes_equal(got, want.reshape(got.shape), f"d{what}")


# --------------------------------------------------------------------------------------------------
# backend choice holds for forward and backward
# --------------------------------------------------------------------------------------------------

def test_backend_argument_reaches_every_forward_and_backward(monkeypatch):
    calls = []
    real_run = dispatch.run

    def recording_run(op, *args, backend=None, **kwargs):
        calls.append((op, backend, dispatch.select(op, *args, backend=backend, **kwargs)))
        return real_run(op, *args, backend=backend, **kwargs)

    monkeypatch.setattr(dispatch, "run", recording_run)
    gen = torch.Generator().manual_seed(14)
    x, w, cos, sin = _mla_q_inputs(gen, tokens=32)
    x.requires_grad_()
    xr = x.detach().float().reshape(32, 1, 64).requires_grad_()
    q_row, _ = mxag.mla_q_uproj_rope_quant(x, w, cos, sin, backend="spec")
    o, _ = mxag.mla_attention(mxag.reshape_mx(q_row, (1, 32, H, 192)),
                              torch.randn(1, 32, H, 192).bfloat16(), torch.randn(1, 32, H, 128).bfloat16(),
                              backend="spec")
    k_pe = mxag.rope(xr, cos, sin, positions=torch.arange(32), backend="spec")
    (o.float().sum() + k_pe.sum()).backward()
    ops = {op for op, _, _ in calls}
    assert {"mla_q_uproj_rope_quant", "mla_q_uproj_rope_quant_backward", "mla_attention",
            "mla_attention_backward", "rope", "rope_backward"} <= ops
    assert all(backend == "spec" and chosen == "spec" for _, backend, chosen in calls), calls

    # backend=None: MXMLA_BACKEND is read when each op runs, forward and backward alike
    calls.clear()
    monkeypatch.setenv("MXMLA_BACKEND", "spec")
    xr.grad = None
    mxag.rope(xr, cos, sin, positions=torch.arange(32)).sum().backward()
    assert [(op, chosen) for op, _, chosen in calls] == [("rope", "spec"), ("rope_backward", "spec")]


# --------------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------------

def _mx_chain(c_q, gamma, w, k, v, cos, sin):
    y_row, y_col, _ = mxag.rmsnorm_mxfp8(c_q, gamma)
    w_row, w_col = mxag.mxfp8_quantize(w.bfloat16(), axis=(1, 0))
    q_row, _ = mxag.mla_q_uproj_rope_quant(y_row, w_row, cos, sin, quantize_grad=True, x_t=y_col, w_n=w_col)
    q = mxag.reshape_mx(q_row, (1, c_q.shape[0], w.shape[0] // 192, 192))
    o, _ = mxag.mla_attention(q, mxag.mxfp8_quantize(k, axis=-1), mxag.mxfp8_quantize(v, axis=1), causal=True)
    return o.float().square().mean()


def _bf16_chain(x, w, k_pe, cos_table, sin_table, k_nope, v):
    tokens = x.shape[0]
    q = (x @ w.T).view(1, tokens, w.shape[0] // 192, 192)
    q = mxag.rope(q, cos_table, sin_table, layout="bshd")
    k_pe = mxag.rope(k_pe, cos_table, sin_table, layout="bshd")
    k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
    o, _ = mxag.mla_attention(q, k, v, causal=True)
    return o.float().square().mean()


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]


def _chain_inputs(path, gen, tokens, cos, sin):
    """(chain, its inputs) for the "mxfp8" or "bf16" chain, drawn from `gen`."""
    if path == "mxfp8":
        return _mx_chain, [torch.randn(tokens, 64, generator=gen), 1.0 + 0.1 * torch.randn(64, generator=gen),
                           torch.randn(H * 192, 64, generator=gen) * 0.1,
                           torch.randn(1, tokens, H, 192, generator=gen).bfloat16(),
                           torch.randn(1, tokens, H, 128, generator=gen).bfloat16(), cos, sin]
    return _bf16_chain, [torch.randn(tokens, 64, generator=gen).bfloat16(),
                         (torch.randn(H * 192, 64, generator=gen) * 0.1).bfloat16(),
                         torch.randn(1, tokens, 1, 64, generator=gen).bfloat16(), cos, sin,
                         torch.randn(1, tokens, H, 128, generator=gen).bfloat16(),
                         torch.randn(1, tokens, H, 128, generator=gen).bfloat16()]


@pytest.mark.parametrize("path", ["mxfp8", "bf16"])
def test_torch_compile_fullgraph_matches_eager(path):
    """fullgraph=True fails on any graph break; the custom ops run the same kernels compiled or not,
    so loss and gradients are bitwise equal (aot_eager: compile time small on CPU)."""
    gen = torch.Generator().manual_seed(15)
    tokens = 32
    cos, sin = rope_tables(tokens, gen)
    fn, inputs = _chain_inputs(path, gen, tokens, cos, sin)
    differentiable = [i for i, t in enumerate(inputs) if t is not cos and t is not sin]

    def run(f):
        leaves = _leaves(*inputs)
        for i, t in enumerate(leaves):
            t.requires_grad_(i in differentiable)
        loss = f(*leaves)
        loss.backward()
        return loss.detach(), [leaves[i].grad for i in differentiable]

    torch._dynamo.reset()
    eager_loss, eager_grads = run(fn)
    compiled_loss, compiled_grads = run(torch.compile(fn, fullgraph=True, backend="aot_eager"))
    assert_bytes_equal(compiled_loss, eager_loss, "loss")
    for got, want in zip(compiled_grads, eager_grads):
        assert_bytes_equal(got, want, "grad")


# --------------------------------------------------------------------------------------------------
# the example
# --------------------------------------------------------------------------------------------------

def test_example_three_cpu_steps_command_line(tmp_path):
    """The documented command, as a user runs it (mxfp8 path, the default)."""
    out = tmp_path / "run.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MXMLA_BACKEND", None)
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "mla_block.py"), "--device", "cpu", "--steps", "3",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["path"] == "mxfp8" and len(result["losses"]) == 3
    assert all(math.isfinite(v) for v in result["losses"])
    assert result["backends"]["mla_q_uproj_rope_quant"] == "torch"


def test_example_paths_agree_in_process(tmp_path, monkeypatch):
    """bf16 and pure-torch paths from one init on one batch: the first losses agree to 1e-4 relative
    (measured 1e-7: the same bf16 math, RoPE and attention in fp32 either way); the plot is a PNG."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import mla_block

    losses = {}
    for path in ("bf16", "torch"):
        out = tmp_path / f"{path}.json"
        assert mla_block.main(["--device", "cpu", "--steps", "2", "--path", path, "--json", str(out),
                               "--plot", str(tmp_path / f"{path}.png")]) == 0
        losses[path] = json.loads(out.read_text())["losses"]
        assert (tmp_path / f"{path}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert abs(losses["bf16"][0] - losses["torch"][0]) <= 1e-4 * losses["torch"][0]


# --------------------------------------------------------------------------------------------------
# the Triton backend under autograd (interpreter on CPU)
# --------------------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check through the Triton interpreter (CUDA runs test_autograd_cuda.py)")
@pytest.mark.parametrize("path", ["mxfp8", "bf16"])
def test_triton_interpreter_gradients_match_torch(path):
    """backend='triton' for every forward and backward gives the torch backend's gradients: the
    custom ops hand the Triton kernels operands they accept. Bound 5e-2 relative Frobenius
    (SEMANTICS 8's MXFP8 attention bound; the rest is bf16 rounding); measured 1.3e-2 / 4e-3."""
    skip_without_triton_interpreter()
    gen = torch.Generator().manual_seed(16)
    tokens = 32
    cos, sin = rope_tables(tokens, gen)
    fn, inputs = _chain_inputs(path, gen, tokens, cos, sin)
    grads = {}
    for backend in ("torch", "triton"):
        leaves = _leaves(*inputs)
        for t, original in zip(leaves, inputs):
            t.requires_grad_(original is not cos and original is not sin)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MXMLA_BACKEND", backend)
            fn(*leaves).backward()
        grads[backend] = [t.grad for t in leaves if t.grad is not None]
    assert len(grads["torch"]) == len(grads["triton"]) == len(inputs) - 2
    for i, (got, want) in enumerate(zip(grads["triton"], grads["torch"])):
        err = rel_err(got, want)
        assert err <= 5e-2, f"input {i}: triton vs torch relative error {err:.3g}"
