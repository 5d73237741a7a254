"""The autograd wrappers validate the caller's arguments as `dispatch.run` does, before converting
them for the custom ops (bool("False") is True, int(1.7) is 1): the same TypeError / ValueError,
naming the argument."""
from __future__ import annotations

import pytest
import torch

import dispatch.autograd as mxag


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _attention(**kw):
    g = _gen(1)
    q = torch.randn(1, 4, 1, 192, generator=g)
    k = torch.randn(1, 4, 1, 192, generator=g)
    v = torch.randn(1, 4, 1, 128, generator=g)
    return mxag.mla_attention(q, k, v, **kw)


def _rmsnorm(**kw):
    g = _gen(2)
    return mxag.rmsnorm_mxfp8(torch.randn(32, 64, generator=g), torch.randn(64, generator=g), **kw)


def _quantize(**kw):
    return mxag.mxfp8_quantize(torch.randn(32, 64, generator=_gen(3)), **kw)


def _dequantize(**kw):
    return mxag.mxfp8_dequantize(_quantize(), **kw)


def _rope(**kw):
    g = _gen(4)
    x = torch.randn(8, 2, 64, generator=g)
    cos, sin = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)
    return mxag.rope(x, cos, sin, **kw)


def _mla_q(**kw):
    g = _gen(5)
    x = torch.randn(32, 64, generator=g).bfloat16()
    w = torch.randn(192, 64, generator=g).bfloat16()
    cos, sin = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
    return mxag.mla_q_uproj_rope_quant(x, w, cos, sin, **kw)


CASES = [
    (_attention, "causal", "False", TypeError),
    (_attention, "causal", 0, TypeError),
    (_attention, "softmax_scale", "0.1", TypeError),
    (_attention, "layout", "BSHD", ValueError),
    (_rmsnorm, "eps", "1e-6", TypeError),
    (_rmsnorm, "eps", -1.0, ValueError),
    (_rmsnorm, "zero_centered_gamma", 1, TypeError),
    (_rmsnorm, "elem", "e4m4", ValueError),
    (_quantize, "axis", 1.7, TypeError),
    (_quantize, "axis", (1.7, 0), TypeError),
    (_quantize, "axis", 2, ValueError),
    (_quantize, "scale_mode", "rceil ", ValueError),
    (_dequantize, "out_dtype", "float64", ValueError),
    (_rope, "cp_size", 1.0, TypeError),
    (_rope, "cp_rank", "0", TypeError),
    (_rope, "style", "gptj", ValueError),
    (_mla_q, "quantize_grad", 1, TypeError),
    (_rmsnorm, "backend", 1, TypeError),
    (_attention, "backend", ["torch"], TypeError),
]


@pytest.mark.parametrize("call, name, bad, error", CASES,
                         ids=[f"{c[0].__name__[1:]}-{c[1]}={c[2]!r}" for c in CASES])
def test_wrapper_rejects_what_dispatch_rejects(call, name, bad, error):
    with pytest.raises(error, match=f"^{name}: "):
        call(**{name: bad})


def test_valid_calls_still_run():
    o, lse = _attention(causal=True)
    assert o.shape == (1, 4, 1, 128)
    y_row, y_col, rstd = _rmsnorm(eps=1e-5, zero_centered_gamma=True)
    assert rstd.shape == (32,)
    assert _quantize(axis=(1, 0))[1].axis == 0
    assert _rope(cp_size=1, cp_rank=0).shape == (8, 2, 64)
