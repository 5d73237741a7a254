"""torch.library.opcheck on every mxmla custom op (schema, fake tensor, autograd registration, AOT
dispatch with static and dynamic shapes), small shapes on CPU with the torch backend."""
from __future__ import annotations

import pytest
import torch

import dispatch
import dispatch.autograd as mxag

H = 1


def _tables(rows, gen):
    angles = torch.rand(rows, 64, generator=gen, dtype=torch.float64) * 6.0
    return angles.cos().float(), angles.sin().float()


def _mx_slots(x, axis, requires_grad):
    """(proxy, uint8 codes, scales, format) of x quantized along axis, the way the wrappers pass them."""
    t = dispatch.run("mxfp8_quantize", x, axis=axis)
    proxy = mxag.grad_proxy(x.shape, x.dtype, x.device).requires_grad_(requires_grad)
    return [proxy, t.data.view(torch.uint8), t.scale, f"{t.elem}/{t.scale_layout}/{t.axis}"]


def _plain_slots(x):
    return [x, None, None, ""]


def _cases():
    gen = torch.Generator().manual_seed(0)
    tokens, k = 32, 64
    cos, sin = _tables(tokens, gen)
    x = torch.randn(tokens, k, generator=gen)
    xb = x.bfloat16()
    w = (torch.randn(H * 192, k, generator=gen) * 0.1).bfloat16()
    dq = torch.randn(tokens, H, 192, generator=gen).bfloat16()
    q = torch.randn(1, tokens, H, 192, generator=gen).bfloat16()
    kk = torch.randn(1, tokens, H, 192, generator=gen).bfloat16()
    v = torch.randn(1, tokens, H, 128, generator=gen).bfloat16()
    o, lse = dispatch.run("mla_attention", q, kk, v, causal=True)
    cu = torch.tensor([0, 12, 32], dtype=torch.int32)
    rg = lambda t: t.clone().requires_grad_()  # noqa: E731
    cases = {
        "mxfp8_quantize": (rg(x), [1, 0], "e4m3", "rceil", "saturate", "compact", None),
        "mxfp8_dequantize": (*_mx_slots(x, 1, True)[:4], "bfloat16", None),
        "rope": (rg(dq), cos, sin, "mla", "thd", cu, None, None, 1, 0, None, None),
        "rope_backward": (dq, cos, sin, "mla", "thd", cu, None, None, 1, 0, "float32", None),
        "mla_q_uproj_rope_quant/bf16": (*_plain_slots(rg(xb)), *_plain_slots(rg(w)), cos, sin,
                                        None, None, "", None, None, "", False, None),
        "mla_q_uproj_rope_quant/mxfp8": (*_mx_slots(xb, 1, True), *_mx_slots(w, 1, True), cos, sin,
                                         *_mx_slots(xb, 0, False)[1:], *_mx_slots(w, 0, False)[1:], True, None),
        "mla_q_uproj_rope_quant_backward": (dq, *_plain_slots(xb), *_plain_slots(w), cos, sin, False, None),
        "rmsnorm_mxfp8": (rg(x), rg(torch.rand(k, generator=gen) + 0.5), 1e-6, False, "e4m3", None),
        "rmsnorm_backward": (x, xb, torch.rand(k, generator=gen) + 0.5, torch.rand(tokens, generator=gen) + 0.5, True,
                             None),
        "mla_attention/bf16": (*_plain_slots(rg(q)), *_plain_slots(rg(kk)), *_plain_slots(rg(v)), True, None,
                               "bshd", None, None, None),
        "mla_attention/mxfp8": (*_mx_slots(q, 3, True), *_mx_slots(kk, 3, True), *_mx_slots(v, 1, True), False,
                                0.1, "bshd", None, None, None),
        "mla_kv_mxfp8/no_rope": (rg(kk[..., :128]), rg(kk[..., 128:]), rg(v), None, None, "bshd", None),
        "mla_kv_mxfp8/rope": (rg(kk[..., :128]), rg(kk[..., 128:]), rg(v), cos, sin, "bshd", None),
        "mla_kv_mxfp8_pe_backward/rope": (kk, cos, sin, "bshd", False, "bfloat16", None),
        "mla_kv_mxfp8_pe_backward/shared_fp32": (kk, None, None, "bshd", True, "float32", None),
        "mla_kv_mxfp8_pe_backward/alias": (kk, None, None, "bshd", False, "bfloat16", None),
        "mla_attention_backward": (o, *_plain_slots(q), *_plain_slots(kk), *_plain_slots(v), o, lse, True, None,
                                   "bshd", None, None, None),
    }
    return cases


CASES = _cases()


def test_every_op_has_a_case():
    assert {name.split("/")[0] for name in CASES} == set(mxag.OPS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck(name):
    op = mxag.OPS[name.split("/")[0]]
    torch.library.opcheck(op, CASES[name])
