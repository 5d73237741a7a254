"""dispatch.nn: MLAQProjection / mla_q_projection and MLAAttention on CPU (torch backend)."""
from __future__ import annotations

import math
import os

import pytest
import torch

import dispatch
import dispatch.autograd as mxag
import dispatch.nn as mxnn
import dispatch.weights as mxw
from spec.mxtensor import MXTensor
from tests.util import assert_bytes_equal, skip_without_triton_interpreter

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
    with pytest.raises(ValueError, match=rf"^x: expected {K} features in the last dim .*got shape \(2, 32, 32\)"):
        mxnn.mla_q_projection(x[..., :32], w, cos, sin)
    with pytest.raises(ValueError, match="cos: shape"):
        mxnn.mla_q_projection(x, w, cos[:, :5], sin)
    with pytest.raises(ValueError, match="x: the mxfp8 path needs the token count"):
        mxnn.mla_q_projection(x[:, :20], w, cos[:, :20], sin[:, :20], path="mxfp8")
    with pytest.raises(ValueError, match="norm_weight: expected shape"):
        mxnn.mla_q_projection(x, w, cos, sin, norm_weight=torch.ones(3))


def test_module_input_of_the_wrong_width_names_x():
    gen = torch.Generator().manual_seed(6)
    x, cos, sin = _inputs(gen)
    with pytest.raises(ValueError, match=rf"^x: expected {K} features in the last dim \(weight's K: the module's "
                                         rf"in_features\), got shape \(2, 32, {K + 32}\)"):
        mxnn.MLAQProjection(K, H)(torch.cat([x, x[..., :32]], -1), cos, sin)


@pytest.mark.parametrize("layout, shape", [("bshd", (1, 50, 2)), ("sbhd", (50, 1, 2)), ("thd", (50, 2))])
def test_attention_sequence_not_whole_blocks_names_v(layout, shape):
    """Path mxfp8 quantizes v along the sequence axis: an S that is no multiple of 32 names v (q and k,
    blocked along D = 192, are fine), and says what S must be."""
    q, k, v = torch.randn(*shape, 192), torch.randn(*shape, 192), torch.randn(*shape, 128)
    axis = 1 if layout == "bshd" else 0
    cu = torch.tensor([0, 50], dtype=torch.int32) if layout == "thd" else None
    with pytest.raises(ValueError, match=rf"^v: path 'mxfp8' quantizes v in blocks of 32 along the sequence axis "
                                         rf"\(dim {axis}\), expected S a multiple of 32, got S = 50"):
        mxnn.MLAAttention(layout=layout, path="mxfp8", backend="torch")(q, k, v, cu, cu)
    with pytest.raises(ValueError, match=r"^k: path 'mxfp8' quantizes k in blocks of 32 along the head dim, "
                                         r"expected D a multiple of 32, got D = 100"):
        mxnn.MLAAttention(layout=layout, path="mxfp8", backend="torch")(q, k[..., :100], v, cu, cu)


# --------------------------------------------------------------------------------------------------
# the mxfp8 path with RMSNorm as one autograd node (dispatch.q_path) against the composition
# --------------------------------------------------------------------------------------------------

_TRITON = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()


def _composition(x, w, cos, sin, norm_weight, eps, style, backend):
    """mla_q_projection's mxfp8 path as the three autograd wrappers (rmsnorm_mxfp8, quantized_weight,
    mla_q_uproj_rope_quant with the MXFP8 backward): what the one node must reproduce."""
    lead, heads = tuple(x.shape[:-1]), w.shape[0] // 192
    rows = mxnn.neox_rows(heads, w.device) if style == "neox" else None
    y_row, y_col, _ = mxag.rmsnorm_mxfp8(x.reshape(-1, x.shape[-1]), norm_weight, eps=eps, backend=backend)
    w_row, w_col = mxw.quantized_weight(w, backend=backend, rows=rows)
    q_row, _ = mxag.mla_q_uproj_rope_quant(y_row, w_row, cos, sin, quantize_grad=True, x_t=y_col, w_n=w_col,
                                           backend=backend)
    return mxag.reshape_mx(q_row, lead + (heads, 192))


def _special_x(gen, dtype):
    """[B, S, K]: rows at magnitudes 2^-20 .. 2^20, an all-zero row, +-0 and subnormals, and large
    entries (2^60; 2^100, whose square overflows the fp32 sum of squares)."""
    x = torch.randn(T, K, generator=gen) * torch.exp2(torch.randint(-20, 21, (T, 1), generator=gen).float())
    x[5] = 0.0
    x[9, :6] = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 2.0 ** -140, 1.0])
    x[13, :3] = torch.tensor([2.0 ** 60, -(2.0 ** 60), 3.0])
    x[17, 0] = 2.0 ** 100
    return x.to(dtype).reshape(B, S, K)


def _node_case(x_dtype, w_dtype, style, backend, heads=H, seed=0, device="cpu"):
    """(q codes, q scales, x grad, norm_weight grad, weight grad) of mla_q_projection (the node) and of
    the composition, from the same inputs and the same (non-contiguous, bf16) gradient at q."""
    gen = torch.Generator().manual_seed(seed)
    x = _special_x(gen, x_dtype)
    w = torch.nn.Parameter((torch.randn(heads * 192, K, generator=gen) * K ** -0.5).to(w_dtype))
    gamma = torch.nn.Parameter(torch.rand(K, generator=gen) + 0.5)
    with torch.no_grad():
        gamma[:2] = torch.tensor([0.0, -1.0])
    cos, sin = _tables(gen)
    cos_t, sin_t = cos.repeat(B, 1), sin.repeat(B, 1)  # per-token rows [T, 64]
    dq = (torch.randn(heads, B, S, 192, generator=gen)
          * torch.exp2(torch.randint(-8, 9, (heads, B, S, 1), generator=gen).float())).bfloat16().permute(1, 2, 0, 3)
    if device != "cpu":
        x, cos, sin, cos_t, sin_t, dq = (t.to(device) for t in (x, cos, sin, cos_t, sin_t, dq))
        w = torch.nn.Parameter(w.detach().to(device))
        gamma = torch.nn.Parameter(gamma.detach().to(device))
    out = []
    for fn in ("node", "composition"):
        xi = x.clone().requires_grad_(True)
        gamma.grad = w.grad = None
        if fn == "node":
            q = mxnn.mla_q_projection(xi, w, cos[None], sin[None], norm_weight=gamma, eps=1e-6, rope_style=style,
                                      backend=backend)
        else:
            q = _composition(xi, w, cos_t, sin_t, gamma, 1e-6, style, backend)
        assert isinstance(q, mxag.TrackedMXTensor) and q.shape == (B, S, heads, 192)
        assert (q.axis, q.elem, q.scale_layout, q.grad_proxy.dtype) == (3, "e4m3", "compact", torch.bfloat16)
        q.grad_proxy.backward(dq)
        out.append((q.data, q.scale, xi.grad, gamma.grad, w.grad))
    return out


def _assert_same(node, composition, what):
    names = ("q codes", "q scales", "x grad", "norm_weight grad", "weight grad")
    for name, got, want in zip(names, node, composition):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{what} {name}: {got.dtype} {got.shape}"
        assert_bytes_equal(got, want, f"{what} {name}")  # bytes: NaN-safe torch.equal


def _node_backward_names(q):
    """Type names of the backward nodes between q's proxy and the leaves."""
    names, todo, seen = set(), [q.grad_proxy.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("style", ["mla", "neox"])
def test_q_node_equals_the_composition_torch(x_dtype, w_dtype, style):
    """One node: the composition's forward bytes and gradients of x, norm_weight and weight (fp32 and
    bf16 master weights; neox reorders the weight's rows and scatters its gradient back)."""
    node, composition = _node_case(x_dtype, w_dtype, style, "torch", seed=10)
    _assert_same(node, composition, f"{x_dtype} {w_dtype} {style}")
    assert torch.isfinite(node[2].float()).all() and node[4].abs().sum() > 0  # the case is not degenerate


@pytest.mark.skipif(not _TRITON, reason="CPU check through the Triton interpreter")
@pytest.mark.parametrize("x_dtype, w_dtype, style", [(torch.bfloat16, torch.float32, "mla"),
                                                     (torch.float32, torch.bfloat16, "neox")])
def test_q_node_equals_the_composition_triton(x_dtype, w_dtype, style):
    skip_without_triton_interpreter()
    node, composition = _node_case(x_dtype, w_dtype, style, "triton", heads=1, seed=11)
    _assert_same(node, composition, f"triton {x_dtype} {w_dtype} {style}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("x_dtype, w_dtype, style", [(torch.bfloat16, torch.float32, "mla"),
                                                     (torch.float32, torch.bfloat16, "neox")])
def test_q_node_equals_the_composition_triton_cuda(x_dtype, w_dtype, style):
    node, composition = _node_case(x_dtype, w_dtype, style, "triton", seed=13, device="cuda")
    _assert_same(node, composition, f"triton cuda {x_dtype} {w_dtype} {style}")


def test_q_node_is_one_graph_node():
    gen = torch.Generator().manual_seed(12)
    m = _module("mxfp8")
    x, cos, sin = _inputs(gen)
    names = _node_backward_names(m(x.requires_grad_(True), cos, sin))
    assert "_RMSNormMLAQBackward" in names
    assert not names & {"_EagerOpBackward", "_EagerWeightProxyBackward"}, names


def test_q_node_requantizes_a_weight_changed_in_place(monkeypatch):
    """The node reads the module's persistent copies (WeightCopies): made at construction, refreshed
    in place when the weight was written (its version counter) before the next forward, reused while
    it is unchanged, and after refresh_weight_copies()."""
    quantized = []
    real_run = dispatch.run

    def run(op, *args, **kwargs):
        if op == "mxfp8_quantize" and tuple(args[0].shape) == (N, K):
            quantized.append(op)
        return real_run(op, *args, **kwargs)

    monkeypatch.setattr(dispatch, "run", run)
    gen = torch.Generator().manual_seed(13)
    m = _module("mxfp8")  # construction quantizes; _module's init writes the weight in place
    assert len(quantized) == 1
    x, cos, sin = _inputs(gen)
    buffers = [b.data_ptr() for b in m.weight_copies.buffers()]

    def fresh():  # the uncached quantize of the weight as it is now
        w_row = real_run("mxfp8_quantize", m.weight.detach().bfloat16(), axis=1, backend="torch")
        rows = cos.expand(B, S, 64).reshape(T, 64), sin.expand(B, S, 64).reshape(T, 64)
        y_row, _, _ = real_run("rmsnorm_mxfp8", x.reshape(T, K), m.norm_weight.detach(), eps=m.eps, backend="torch")
        return real_run("mla_q_uproj_rope_quant", y_row, w_row, *rows, backend="torch")[0]

    first = m(x, cos, sin)
    m(x, cos, sin)
    assert len(quantized) == 2
    assert_bytes_equal(first.data.reshape(T, H, 192), fresh().data, "q before the write")
    with torch.no_grad():
        m.weight.mul_(-0.5)
    second = m(x, cos, sin)
    assert len(quantized) == 3
    assert_bytes_equal(second.data.reshape(T, H, 192), fresh().data, "q after the in-place write")
    m.refresh_weight_copies()
    m(x, cos, sin)
    assert len(quantized) == 4
    assert [b.data_ptr() for b in m.weight_copies.buffers()] == buffers  # refreshed in place


class _Subclass(torch.Tensor):
    pass


@pytest.mark.parametrize("case", ["quantize_grad=False", "no norm", "tensor subclass", "torch.compile"])
def test_q_node_only_for_plain_eager_calls_with_norm_and_mxfp8_backward(case, monkeypatch):
    """Everything else takes the composition; a tensor subclass or a compiled call gets the node's bytes."""
    calls = []
    real = mxnn.rmsnorm_mla_q
    monkeypatch.setattr(mxnn, "rmsnorm_mla_q", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(14)
    x, cos, sin = _inputs(gen)
    w = torch.nn.Parameter(torch.randn(N, K, generator=gen) * K ** -0.5)
    gamma = torch.nn.Parameter(torch.rand(K, generator=gen) + 0.5)
    kwargs = dict(norm_weight=gamma, backend="torch")
    node = mxnn.mla_q_projection(x, w, cos, sin, **kwargs)
    assert len(calls) == 1
    if case == "quantize_grad=False":
        mxnn.mla_q_projection(x, w, cos, sin, quantize_grad=False, **kwargs)
    elif case == "no norm":
        mxnn.mla_q_projection(x, w, cos, sin, backend="torch")
    elif case == "tensor subclass":
        q = mxnn.mla_q_projection(x.as_subclass(_Subclass), w, cos, sin, **kwargs)
        assert_bytes_equal(q.data.view(torch.uint8).as_subclass(torch.Tensor), node.data.view(torch.uint8), case)
    else:
        compiled = torch.compile(lambda *a, **k: mxag.mxfp8_dequantize(mxnn.mla_q_projection(*a, **k)),
                                 backend="eager")
        assert_bytes_equal(compiled(x, w, cos, sin, **kwargs), mxag.mxfp8_dequantize(node), case)
    assert len(calls) == 1, f"{case}: the node ran"


NOT_BOOLS = ["no", 1, 0, None, 1.0]  # truthy or falsy, never a bool: refused, not coerced


@pytest.mark.parametrize("value", NOT_BOOLS, ids=repr)
@pytest.mark.parametrize("path", ["mxfp8", "bf16"])
def test_quantize_grad_must_be_a_bool(value, path):
    gen = torch.Generator().manual_seed(16)
    m = _module(path)
    x, cos, sin = _inputs(gen)
    with pytest.raises(TypeError, match=rf"^quantize_grad: expected a bool, got {type(value).__name__}"):
        mxnn.MLAQProjection(m.in_features, m.num_heads, path=path, quantize_grad=value)
    with pytest.raises(TypeError, match=rf"^quantize_grad: expected a bool, got {type(value).__name__}"):
        mxnn.mla_q_projection(x, m.weight, cos, sin, norm_weight=m.norm_weight, path=path, quantize_grad=value,
                              backend="torch")
    assert mxnn.MLAQProjection(m.in_features, m.num_heads, path=path, quantize_grad=False).quantize_grad is False


def test_q_node_argument_errors_name_the_argument():
    gen = torch.Generator().manual_seed(15)
    m = _module("mxfp8")
    x, cos, sin = _inputs(gen)
    with pytest.raises(TypeError, match="eps"):
        mxnn.mla_q_projection(x, m.weight, cos, sin, norm_weight=m.norm_weight, eps="1e-6", backend="torch")
    with pytest.raises(TypeError, match="quantize_grad"):
        mxnn.mla_q_projection(x, m.weight, cos, sin, norm_weight=m.norm_weight, quantize_grad=1, backend="torch")
    # the fused op's arguments are validated by dispatch.run inside the node, with the composition's message
    errors = []
    for fn in ("node", "composition"):
        with pytest.raises((TypeError, ValueError)) as info:
            if fn == "node":
                mxnn.mla_q_projection(x, m.weight, cos.double(), sin.double(), norm_weight=m.norm_weight,
                                      backend="torch")
            else:
                rows = cos.double().expand(B, S, 64).reshape(T, 64), sin.double().expand(B, S, 64).reshape(T, 64)
                _composition(x, m.weight, *rows, m.norm_weight, m.eps, "mla", "torch")
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1] and "cos" in errors[0][1], errors
