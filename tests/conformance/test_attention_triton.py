"""Triton MLA attention: what tests/conformance/test_attention.py does not reach.

- The MXFP8 -> bf16 pre-pass (backward operands, forward "predequant") is byte-equal to
  spec.mxfp8_dequantize(out_dtype="bfloat16") (NaN blocks compared as NaN positions: the GPU writes
  its own NaN bits).
- MXFP8 variants: e5m2 elements, mixed MXFP8 / bf16 operands, the three forward dequantize placements, a NaN
  scale block.
- Strided operands (q, k, v sliced out of one packed buffer; only the feature stride is 1).
- Extreme shapes: one query, one key, varlen with a sequence that has keys but no queries (its dk, dv
  must be 0), a sequence with neither.
- Every output buffer is poisoned (NaN) before the kernels run, so an unwritten element fails.

Bounds (SEMANTICS 8 and tests/conformance/test_attention.py): o and gradients by relative Frobenius
error <= 1e-2 for bf16; lse absolute <= 1e-3 on finite rows, -inf rows exact. MXFP8 inputs are held to
the same 1e-2 (not the contract's 5e-2): this backend dequantizes exactly and keeps P in bf16, as on
the bf16 path (it does not quantize P to e4m3 like cuDNN), so its error is the bf16 path's error.

CPU runs go through Triton's interpreter; shapes stay tiny (S <= 96, H <= 2). The CUDA-only test at
the end runs DeepSeek-V3 sizes against the torch backend (fp32).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import spec
from spec.attention import SEQ_AXIS
from tests.conformance.conftest import run_on, skip_reason
from tests.conformance.test_attention import (
    BF16_BOUND,
    LSE_ABS_BOUND,
    check_backward,
    check_forward,
    make_inputs,
)
from tests.util import BF16, random_magnitudes

torch = pytest.importorskip("torch")
pytest.importorskip("triton")  # every test here is of the Triton backend
from backends.convert import to_numpy, to_torch  # noqa: E402

D_QK, D_V = 192, 128


@pytest.fixture
def target():
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    reason = skip_reason("triton", device)
    if reason:
        pytest.skip(reason)
    return "triton", device


class _PoisonedTorch:
    """torch, except that empty / empty_like return NaN-filled float buffers (the backend's view of
    torch only: triton and the tests keep the real module)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.dtype.is_floating_point else t

    @staticmethod
    def empty_like(x, **kwargs):
        t = torch.empty_like(x, **kwargs)
        return t.fill_(float("nan")) if t.dtype.is_floating_point else t


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Every buffer the backend allocates with torch.empty(_like) starts as NaN."""
    from backends.triton import attention as attn

    monkeypatch.setattr(attn, "torch", _PoisonedTorch())
    yield


def _kw(causal, layout, cu_q=None, cu_kv=None, device="cpu", **extra):
    kw = dict(causal=causal, layout=layout, **extra)
    if layout == "thd":
        kw["cu_seqlens_q"] = cu_q
        kw["cu_seqlens_kv"] = cu_kv
    return kw


def _torch_kw(kw, device):
    return {k: to_torch(v, device) if isinstance(v, np.ndarray) else v for k, v in kw.items()}


def _forward_and_backward(target, q, k, v, do, layout, kw, bound=BF16_BOUND, what=""):
    """Run forward and backward on the target against spec; returns the triton outputs."""
    _, device = target
    want = spec.mla_attention(q, k, v, **kw)
    args = to_torch([q, k, v], device)
    got = run_on(target, "mla_attention", *args, **_torch_kw(kw, device))
    check_forward(got, want, bound, what, layout)
    want_g = spec.mla_attention_backward(do, q, k, v, *want, **kw)
    got_g = run_on(target, "mla_attention_backward", to_torch(do, device), *args,
                   *to_torch(list(want), device), **_torch_kw(kw, device))
    check_backward(got_g, want_g, bound, what)
    return got, got_g


# --------------------------------------------------------------------------------------------------
# MXFP8 -> bf16 pre-pass
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape,axis", [((2, 64, 2, 192), 3), ((2, 64, 2, 128), 1), ((64, 2, 2, 128), 0),
                                        ((96, 2, 128), 0), ((96, 2, 192), 2)])
def test_dequantize_prepass_bytes(target, elem, shape, axis):
    from backends.triton.attention import _dequantize_mx

    _, device = target
    rng = np.random.default_rng(11)
    x = random_magnitudes(rng, shape)
    t = spec.mxfp8_quantize(x, axis=axis, elem=elem)
    # Extreme scale bytes: 0 (2^-127: values below bf16's normal range, rounded once), 1, 254, 255 (NaN).
    scale = t.scale.copy()
    flat = scale.reshape(-1)
    flat[:4] = [0, 1, 254, 255]
    t = t.replace(scale=scale)
    want = spec.mxfp8_dequantize(t, out_dtype="bfloat16")
    (got,) = _dequantize_mx(to_torch(t, device))
    got = to_numpy(got)
    nan_want, nan_got = np.isnan(want.astype(np.float32)), np.isnan(got.astype(np.float32))
    assert np.array_equal(nan_want, nan_got), "NaN positions differ"
    assert np.array_equal(got.view(np.uint16)[~nan_got], want.view(np.uint16)[~nan_want]), "bf16 bytes differ"


# --------------------------------------------------------------------------------------------------
# MXFP8 variants
# --------------------------------------------------------------------------------------------------

def test_mxfp8_e5m2(target):
    q, k, v, do = make_inputs(21, 1, 64, 64, 2, "bshd")
    q_mx = spec.mxfp8_quantize(q, axis=-1, elem="e5m2")
    k_mx = spec.mxfp8_quantize(k, axis=-1, elem="e5m2")
    v_mx = spec.mxfp8_quantize(v, axis=SEQ_AXIS["bshd"], elem="e5m2")
    _forward_and_backward(target, q_mx, k_mx, v_mx, do, "bshd", _kw(True, "bshd"), what="e5m2")


@pytest.mark.parametrize("which", ["q", "kv"])
def test_mxfp8_mixed_with_bf16(target, which):
    q, k, v, do = make_inputs(22, 2, 40, 64, 2, "sbhd")
    if which == "q":
        q = spec.mxfp8_quantize(q, axis=-1)
    else:
        k = spec.mxfp8_quantize(k, axis=-1, scale_layout="swizzled")
        v = spec.mxfp8_quantize(v, axis=SEQ_AXIS["sbhd"], scale_layout="swizzled")
    _forward_and_backward(target, q, k, v, do, "sbhd", _kw(True, "sbhd"), what=f"mixed {which}")


@pytest.mark.parametrize("mode", ["load", "predequant", "predequant_qkv"])
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_mxfp8_forward_modes(target, layout, mode, monkeypatch):
    # Every placement of the MXFP8 dequantize (the default is predequant_qkv; the shared suite covers it)
    from backends.triton import attention as attn

    monkeypatch.setattr(attn, "FWD_MX_DEQUANT", mode)
    _, device = target
    q, k, v, _ = make_inputs(23, 2, 32, 64, 2, layout)
    q_mx, k_mx = spec.mxfp8_quantize(q, axis=-1), spec.mxfp8_quantize(k, axis=-1)
    v_mx = spec.mxfp8_quantize(v, axis=SEQ_AXIS[layout])
    cu_q = np.array([0, 32, 64], np.int32)
    cu_kv = np.array([0, 64, 128], np.int32)
    kw = _kw(True, layout, cu_q, cu_kv)
    want = spec.mla_attention(q_mx, k_mx, v_mx, **kw)
    got = run_on(target, "mla_attention", *to_torch([q_mx, k_mx, v_mx], device), **_torch_kw(kw, device))
    check_forward(got, want, BF16_BOUND, f"{mode} {layout}", layout)


def test_forward_mode_typo_raises():
    # A dequantize placement outside the three names the choices instead of running one of them.
    from backends.triton import attention as attn

    with pytest.raises(ValueError, match="expected one of load, predequant, predequant_qkv, got 'predequant_kv'"):
        attn._forward(None, None, None, True, None, "bshd", None, None, mx_dequant="predequant_kv")


def test_mxfp8_nan_scale_block(target):
    """Scale byte 255 makes a block NaN: the rows it reaches are NaN, as in spec; the rest are exact."""
    _, device = target
    q, k, v, _ = make_inputs(24, 1, 32, 32, 2, "bshd")
    q_mx = spec.mxfp8_quantize(q, axis=-1)
    scale = q_mx.scale.copy()
    scale[0, 5, 1, 2] = 255  # query 5 of head 1, features 64..95
    q_mx = q_mx.replace(scale=scale)
    k_mx = spec.mxfp8_quantize(k, axis=-1)
    want_o, want_lse = spec.mla_attention(q_mx, k_mx, v)
    o, lse = run_on(target, "mla_attention", *to_torch([q_mx, k_mx, v], device))
    o, lse = to_numpy(o).astype(np.float32), to_numpy(lse)
    assert np.array_equal(np.isnan(o), np.isnan(want_o.astype(np.float32)))
    assert np.array_equal(np.isnan(lse), np.isnan(want_lse))
    assert np.isnan(o[0, 5, 1]).all() and not np.isnan(o[0, :, 0]).any()
    ok = ~np.isnan(want_lse)
    assert np.max(np.abs(lse[ok] - want_lse[ok])) <= LSE_ABS_BOUND


# --------------------------------------------------------------------------------------------------
# Strides and shapes
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["bshd", "sbhd", "thd"])
def test_strided_operands(target, layout):
    """q, k, v are views into one packed [.., H, 192 + 192 + 128] buffer: token and head strides are
    the packed buffer's, the feature stride is 1."""
    _, device = target
    q, k, v, do = make_inputs(25, 2, 48, 48, 2, layout)
    packed = np.concatenate([q, k, v], axis=-1)
    p = to_torch(packed, device)
    q_t, k_t, v_t = p[..., :D_QK], p[..., D_QK:2 * D_QK], p[..., 2 * D_QK:]
    assert not q_t.is_contiguous()
    cu = np.array([0, 48, 96], np.int32)
    kw = _kw(True, layout, cu, cu)
    want = spec.mla_attention(q, k, v, **kw)
    got = run_on(target, "mla_attention", q_t, k_t, v_t, **_torch_kw(kw, device))
    check_forward(got, want, BF16_BOUND, f"strided {layout}", layout)
    want_g = spec.mla_attention_backward(do, q, k, v, *want, **kw)
    got_g = run_on(target, "mla_attention_backward", to_torch(do, device), q_t, k_t, v_t,
                   *to_torch(list(want), device), **_torch_kw(kw, device))
    check_backward(got_g, want_g, BF16_BOUND, f"strided {layout}")


@pytest.mark.parametrize("s_q,s_kv,causal", [(1, 64, True), (1, 64, False), (64, 2, True), (3, 5, True)])
def test_tiny_sequences(target, s_q, s_kv, causal):
    q, k, v, do = make_inputs(26, 1, s_q, s_kv, 2, "bshd")
    _forward_and_backward(target, q, k, v, do, "bshd", _kw(causal, "bshd"), what=f"{s_q}x{s_kv}")


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_empty_sequences(target, causal):
    """Sequence 1 has keys but no queries (its dk, dv are 0), sequence 2 has neither, sequence 3
    has queries but no keys (o = 0, lse = -inf, dq = 0)."""
    _, device = target
    rng = np.random.default_rng(27)
    h = 2
    cu_q = np.array([0, 33, 33, 33, 40, 70], np.int32)
    cu_kv = np.array([0, 20, 45, 45, 45, 96], np.int32)
    q = (rng.standard_normal((70, h, D_QK)) * 2).astype(BF16)
    k = rng.standard_normal((96, h, D_QK)).astype(BF16)
    v = rng.standard_normal((96, h, D_V)).astype(BF16)
    do = rng.standard_normal((70, h, D_V)).astype(BF16)
    kw = _kw(causal, "thd", cu_q, cu_kv)
    got, got_g = _forward_and_backward(target, q, k, v, do, "thd", kw, what="varlen-empty")
    assert np.all(to_numpy(got[0])[33:40] == 0)
    assert np.all(np.isneginf(to_numpy(got[1])[:, 33:40]))
    dq, dk, dv = (to_numpy(g).astype(np.float32) for g in got_g)
    assert np.all(dq[33:40] == 0)
    assert np.all(dk[20:45] == 0) and np.all(dv[20:45] == 0)


def test_gpu_tile_configs(target, monkeypatch):
    """Every autotune config the GPU may pick, forced one at a time (the interpreter otherwise runs
    only its own small tiles): the masking stages depend on BLOCK_M / BLOCK_N."""
    from backends.triton import attention as attn

    kernels = (attn._mla_fwd_kernel, attn._mla_bwd_dkdv_kernel, attn._mla_bwd_dq_kernel)
    config_lists = (attn._fwd_configs(False), attn._dkdv_configs(False), attn._dq_configs(False))
    for kernel in kernels:
        monkeypatch.setattr(kernel, "configs", kernel.configs)
        monkeypatch.setattr(kernel, "cache", {})
    q, k, v, do = make_inputs(29, 1, 77, 140, 1, "bshd")
    for i in range(max(len(c) for c in config_lists)):
        for kernel, configs in zip(kernels, config_lists):
            kernel.configs = [configs[i % len(configs)]]
            kernel.cache = {}
        what = " / ".join(str(c[i % len(c)].kwargs) for c in config_lists)
        _forward_and_backward(target, q, k, v, do, "bshd", _kw(True, "bshd"), what=what)


@pytest.mark.parametrize("layout,causal", [("bshd", True), ("thd", False)])
def test_backward_atomic_dq(target, layout, causal, monkeypatch):
    """The opt-in BWD_DQ = "atomic" path (dq summed by atomics in the dkdv kernel)."""
    from backends.triton import attention as attn

    monkeypatch.setattr(attn, "BWD_DQ", "atomic")
    q, k, v, do = make_inputs(28, 2, 40, 56, 2, layout)
    kw = _kw(causal, layout, np.array([0, 40, 80], np.int32), np.array([0, 56, 112], np.int32))
    _forward_and_backward(target, q, k, v, do, layout, kw, what=f"atomic dq {layout}")


# --------------------------------------------------------------------------------------------------
# DeepSeek-V3 sizes (CUDA only)
# --------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("mx", [False, True])
def test_deepseek_sizes_cuda(target, mx):
    _, device = target
    if device != "cuda":
        pytest.skip("CUDA only: too large for the interpreter")
    from backends.torch import attention as torch_attn

    b, s, h = 1, 1024, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, h, D_QK, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(b, s, h, D_QK, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(b, s, h, D_V, device="cuda", generator=gen).to(torch.bfloat16)
    do = torch.randn(b, s, h, D_V, device="cuda", generator=gen).to(torch.bfloat16)
    if mx:
        q, k, v = (to_torch(spec.mxfp8_quantize(to_numpy(x), axis=a), "cuda")
                   for x, a in ((q, -1), (k, -1), (v, 1)))
    o, lse = run_on(target, "mla_attention", q, k, v, causal=True)
    o_ref, lse_ref = torch_attn.mla_attention(q, k, v, causal=True)
    err = ((o.float() - o_ref.float()).norm() / o_ref.float().norm()).item()
    assert err <= BF16_BOUND, err
    assert (lse - lse_ref).abs().max().item() <= LSE_ABS_BOUND
    grads = run_on(target, "mla_attention_backward", do, q, k, v, o_ref, lse_ref, causal=True)
    grads_ref = torch_attn.mla_attention_backward(do, q, k, v, o_ref, lse_ref, causal=True)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        err = ((g.float() - g_ref.float()).norm() / g_ref.float().norm()).item()
        assert err <= BF16_BOUND, (name, err)
