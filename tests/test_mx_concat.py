"""dispatch.autograd.cat_mx / expand_mx: MLA's key built from the codes (k = [k_nope | k_pe broadcast over
heads]) is byte-equal to quantizing the bf16 concatenation, and its gradient reaches k_nope and k_pe as
torch.cat / expand's would (exactly: the straight-through gradients are the same tensors, split)."""
from __future__ import annotations

import pytest
import torch

import dispatch.autograd as mxag
from spec.mxtensor import MXTensor
from tests.util import assert_bytes_equal, skip_without_triton_interpreter


def _inputs(gen, scale=1.0):
    kv = (torch.randn(2, 64, 3, 256, generator=gen) * scale).bfloat16()
    kv[0, 0, 0, :32] = float("nan")             # an all-NaN block
    kv[0, 1, 1, :32] = 0.0                      # an all-zero block
    kv[1, 2, 2, 5] = float("inf")
    kv[1, 3, 0, 7] = 2.0 ** -133                # bf16 subnormal
    kv[1, 3, 0, 8] = 448.0 * (1 - 2 ** -8)      # one ulp under a power-of-two boundary region
    k_pe = (torch.randn(2, 64, 1, 64, generator=gen) * scale).bfloat16()
    k_pe[0, 4, 0, 0] = -0.0
    return kv.requires_grad_(True), k_pe.requires_grad_(True)


@pytest.mark.parametrize("scale", [2.0 ** -20, 1.0, 2.0 ** 20])
@pytest.mark.parametrize("backend", ["torch", "triton", "triton-cuda"])
def test_key_from_codes_equals_quantized_cat(scale, backend, monkeypatch):
    device = "cpu"
    if backend == "triton":
        skip_without_triton_interpreter()
    elif backend == "triton-cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        backend, device = "triton", "cuda"
    gen = torch.Generator().manual_seed(11)
    kv, k_pe = (t.detach().to(device).requires_grad_(True) for t in _inputs(gen, scale))
    k_nope = kv[..., :128]  # a strided slice (the triton backend reads it in place)
    want = mxag.mxfp8_quantize(torch.cat([k_nope, k_pe.expand(2, 64, 3, 64)], dim=-1), axis=-1, backend=backend)
    got = mxag.cat_mx([mxag.mxfp8_quantize(k_nope, axis=-1, backend=backend),
                       mxag.expand_mx(mxag.mxfp8_quantize(k_pe, axis=-1, backend=backend), (2, 64, 3, 64))], dim=-1)
    assert isinstance(got, mxag.TrackedMXTensor) and got.data.is_contiguous()
    assert (got.axis, got.elem, got.scale_layout, got.shape) == (want.axis, want.elem, want.scale_layout, want.shape)
    assert_bytes_equal(got.data, want.data, "codes")
    assert_bytes_equal(got.scale, want.scale, "scales")


def test_gradient_split_back():
    gen = torch.Generator().manual_seed(12)
    kv, k_pe = _inputs(gen)
    g = torch.randn(2, 64, 3, 192, generator=gen).bfloat16()

    def grads(build):
        kv.grad = k_pe.grad = None
        k = build()
        y = mxag.mxfp8_dequantize(k, out_dtype="bfloat16", backend="torch")
        y.backward(g)
        return kv.grad.clone(), k_pe.grad.clone()

    ref = grads(lambda: mxag.mxfp8_quantize(torch.cat([kv[..., :128], k_pe.expand(2, 64, 3, 64)], -1),
                                            axis=-1, backend="torch"))
    got = grads(lambda: mxag.cat_mx([mxag.mxfp8_quantize(kv[..., :128], axis=-1, backend="torch"),
                                     mxag.expand_mx(mxag.mxfp8_quantize(k_pe, axis=-1, backend="torch"),
                                                    (2, 64, 3, 64))], -1))
    for a, b, name in zip(got, ref, ("kv", "k_pe")):
        # same straight-through gradient, summed over the broadcast heads in the same order (fp32 accumulate
        # of 3 bf16 terms then one rounding, both ways): bitwise
        assert_bytes_equal(a, b, name)
    assert got[0][..., 128:].abs().max() == 0  # v's half of kv receives nothing from k


def test_untracked_and_mixed():
    gen = torch.Generator().manual_seed(13)
    a = mxag.mxfp8_quantize(torch.randn(4, 64, generator=gen), axis=-1, backend="torch")
    plain = MXTensor(a.data.clone(), a.scale.clone(), 1, "e4m3", "compact")
    out = mxag.cat_mx([plain, plain], dim=1)
    assert type(out) is MXTensor and out.shape == (4, 128)
    x = torch.randn(4, 64, generator=gen, requires_grad=True)
    mixed = mxag.cat_mx([mxag.mxfp8_quantize(x, axis=-1, backend="torch"), plain], dim=0)
    assert isinstance(mixed, mxag.TrackedMXTensor) and mixed.shape == (8, 64)
    mxag.mxfp8_dequantize(mixed, backend="torch").sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_bad_inputs_raise():
    gen = torch.Generator().manual_seed(14)
    a = mxag.mxfp8_quantize(torch.randn(4, 64, generator=gen), axis=-1, backend="torch")
    b = mxag.mxfp8_quantize(torch.randn(32, 64, generator=gen), axis=0, backend="torch")
    e5 = mxag.mxfp8_quantize(torch.randn(4, 64, generator=gen), axis=-1, elem="e5m2", backend="torch")
    with pytest.raises(TypeError, match="tensors"):
        mxag.cat_mx([a, torch.zeros(4, 64)], dim=1)
    with pytest.raises(TypeError, match="tensors"):
        mxag.cat_mx([], dim=0)
    with pytest.raises(ValueError, match=r"tensors\[1\].*axis 0"):
        mxag.cat_mx([a, b], dim=0)
    with pytest.raises(ValueError, match=r"tensors\[1\].*elem"):
        mxag.cat_mx([a, e5], dim=1)
    with pytest.raises(ValueError, match="dim"):
        mxag.cat_mx([a, a], dim=2)
    with pytest.raises(ValueError, match="dim"):
        mxag.cat_mx([a, a], dim=True)
    c = mxag.mxfp8_quantize(torch.randn(8, 64, generator=gen), axis=-1, backend="torch")
    with pytest.raises(ValueError, match="outside dim"):
        mxag.cat_mx([a, c], dim=1)
    with pytest.raises(ValueError, match="expand_mx"):
        mxag.expand_mx(a, (4, 128))
    with pytest.raises(ValueError, match="expand_mx"):
        mxag.expand_mx(a, (2, 4, 64))
