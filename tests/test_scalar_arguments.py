"""Scalar arguments keep their type through dispatch: True == 1 == 1.0 in Python, so a cached selection
keyed on the value alone would let `eps=True` through after a call with `eps=1.0`. Every backend
raises the validator's TypeError, whatever ran before."""
from __future__ import annotations

import pytest
import torch

import dispatch
from dispatch.signature import call_signature


def _rmsnorm_args():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(32, 64, generator=g), torch.randn(64, generator=g)), {}


def _attention_args():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 1, 192, generator=g)
    k = torch.randn(1, 4, 1, 192, generator=g)
    v = torch.randn(1, 4, 1, 128, generator=g)
    return (q, k, v), {}


def _mla_q_backward_args():
    g = torch.Generator().manual_seed(3)
    t, k_dim, heads = 32, 64, 1
    dq = torch.randn(t, heads, 192, generator=g).bfloat16()
    x = torch.randn(t, k_dim, generator=g).bfloat16()
    w = torch.randn(heads * 192, k_dim, generator=g).bfloat16()
    cos = torch.randn(t, 64, generator=g)
    return (dq, x, w, cos, cos.clone()), {}


# (op, argument builder, keyword, accepted value, a value equal to it of the wrong type)
CASES = [
    ("rmsnorm_mxfp8", _rmsnorm_args, "eps", 1.0, True),
    ("rmsnorm_mxfp8", _rmsnorm_args, "zero_centered_gamma", True, 1),
    ("rmsnorm_mxfp8", _rmsnorm_args, "zero_centered_gamma", False, 0.0),
    ("mla_attention", _attention_args, "causal", True, 1),
    ("mla_attention", _attention_args, "softmax_scale", 1.0, True),
    ("mla_q_uproj_rope_quant_backward", _mla_q_backward_args, "quantize_grad", False, 0),
]


@pytest.mark.parametrize("op, build, name, good, bad", CASES, ids=[f"{c[0]}-{c[2]}={c[4]!r}" for c in CASES])
def test_equal_scalar_of_another_type_is_validated_after_a_cached_call(op, build, name, good, bad):
    dispatch.clear_cache()
    args, kw = build()
    dispatch.run(op, *args, backend="torch", **{name: good})  # fills the selection cache
    with pytest.raises(TypeError, match=f"^{name}: expected"):
        dispatch.run(op, *args, backend="torch", **{name: bad})
    with pytest.raises(TypeError, match=f"^{name}: expected"):  # and from a cold cache
        dispatch.clear_cache()
        dispatch.run(op, *args, backend="torch", **{name: bad})


def test_signature_tells_equal_scalars_of_different_types_apart():
    sigs = {call_signature((), {"eps": v}) for v in (1, 1.0, True)}
    assert len(sigs) == 3
    assert call_signature(((1, 0),), {}) != call_signature(((True, False),), {})
    assert call_signature((), {"eps": 1.0}) == call_signature((), {"eps": 1.0})


@pytest.mark.parametrize("bad", ["1e-6", None, True, [1e-6]])
def test_rmsnorm_eps_must_be_a_real_number(bad):
    args, _ = _rmsnorm_args()
    with pytest.raises(TypeError, match="^eps: expected a real number"):
        dispatch.run("rmsnorm_mxfp8", *args, eps=bad, backend="torch")


def test_signature_holds_the_data_pointer_alignment():
    # TMA variants need 16-byte aligned bases: a view one element in must not reuse an aligned call's choice
    base = torch.zeros(64, 64, dtype=torch.bfloat16)
    aligned, shifted = base[:, :32], base[:, 1:33]
    assert aligned.stride() == shifted.stride() and aligned.shape == shifted.shape
    assert call_signature((aligned,), {}) != call_signature((shifted,), {})
