"""The MXFP8 path under torch.compile (CPU, torch backend): the same fused work as eager, no graph breaks,
no `dispatch.run` inside a compiled step (backends resolved at trace time: dispatch.resolution), and
bytes equal to eager wherever the same kernels run in the same order.

- mla_kv_mxfp8: one custom op for k (k_pe's RoPE included) and v, and one for its backward, on every
  layout; codes, scales and gradients byte-equal to the eager node.
- resolution: a resolved choice is what dispatch.select picks; a bad argument raises at trace time with
  the validator's words.
"""
from __future__ import annotations

import pytest
import torch

import dispatch
import dispatch.autograd as mxag
import dispatch.resolution as resolution
from tests.util import assert_bytes_equal

LAYOUTS = {"bshd": ((1, 64, 2), 1, 2), "sbhd": ((64, 1, 2), 0, 2), "thd": ((64, 2), 0, 1)}


class DispatchCounter:
    """Counts dispatch.run / dispatch.select calls while entered."""

    def __init__(self, monkeypatch):
        self.calls = []
        real_run, real_select = dispatch.run, dispatch.select

        def run(op, *args, **kwargs):
            self.calls.append(("run", op))
            return real_run(op, *args, **kwargs)

        def select(op, *args, **kwargs):
            self.calls.append(("select", op))
            return real_select(op, *args, **kwargs)

        self._patch = [(dispatch, "run", run), (dispatch, "select", select)]
        self._monkeypatch = monkeypatch

    def __enter__(self):
        for owner, name, fn in self._patch:
            self._monkeypatch.setattr(owner, name, fn)
        return self

    def __exit__(self, *exc):
        self._monkeypatch.undo()
        return False


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def _kv_inputs(layout, shared, seed=3):
    lead, _, head = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(*lead, 256, generator=gen).bfloat16().requires_grad_(True)
    pe_lead = list(lead)
    if shared:
        pe_lead[head] = 1
    k_pe = torch.randn(*pe_lead, 64, generator=gen).bfloat16().requires_grad_(True)
    angles = torch.rand(lead[0] if layout != "bshd" else lead[1], 64, generator=gen, dtype=torch.float64) * 6
    gk = torch.randn(*lead, 192, generator=gen).bfloat16()
    gv = torch.randn(*lead, 128, generator=gen).bfloat16()
    return kv, k_pe, angles.cos().float(), angles.sin().float(), gk, gv


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shared", [True, False], ids=["shared_pe", "per_head_pe"])
def test_kv_compiled_one_op_bytes_equal_eager(layout, shared, monkeypatch):
    kv, k_pe, cos, sin, gk, gv = _kv_inputs(layout, shared)

    def f(kv, k_pe, cos, sin):
        k, v = mxag.mla_kv_mxfp8(kv[..., :128], k_pe, kv[..., 128:], layout=layout, cos=cos, sin=sin)
        return k.data.view(torch.uint8), k.scale, v.data.view(torch.uint8), v.scale, k.grad_proxy, v.grad_proxy

    def run(fn):
        kv.grad = k_pe.grad = None
        out = fn(kv, k_pe, cos, sin)
        torch.autograd.backward([out[4], out[5]], [gk, gv])
        return [_bits(t) for t in out[:4]] + [_bits(kv.grad), _bits(k_pe.grad)]

    torch._dynamo.reset()
    want = run(f)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    first = run(compiled)
    with DispatchCounter(monkeypatch) as counter:
        second = run(compiled)
    assert counter.calls == [], counter.calls
    for name, a, b, c in zip(("k codes", "k scales", "v codes", "v scales", "d kv", "d k_pe"), want, first, second):
        assert_bytes_equal(b, a, f"{name} (first compiled call)")
        assert_bytes_equal(c, a, f"{name} (second compiled call)")


def test_kv_compiled_graph_holds_the_ops():
    """The traced forward holds mla_kv_mxfp8 (no concatenation, no quantize) and the backward its op."""
    kv, k_pe, cos, sin, gk, gv = _kv_inputs("bshd", True)
    graphs = []

    def backend(gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        def keep(g, _):
            graphs.append(str(g.graph))
            return make_boxed_func(g.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

    def f(kv, k_pe):
        k, v = mxag.mla_kv_mxfp8(kv[..., :128], k_pe, kv[..., 128:], cos=cos, sin=sin)
        return k.grad_proxy.float().sum() + v.grad_proxy.float().sum()

    torch._dynamo.reset()
    torch.compile(f, fullgraph=True, backend=backend)(kv, k_pe).backward()
    forward, backward = graphs
    assert "mxmla.mla_kv_mxfp8.default" in forward
    assert "mxfp8_quantize" not in forward and "aten.cat" not in forward and "mxmla.rope" not in forward
    assert "mxmla.mla_kv_mxfp8_backward.default" in backward


def test_resolved_choice_is_dispatch_select():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 64, generator=gen)
    chosen = resolution.resolve("mxfp8_quantize", x, axis=(1, 0))
    assert chosen == "=" + dispatch.select("mxfp8_quantize", x, axis=(1, 0)) + ";"
    assert resolution.request_of(chosen) is None
    named = resolution.resolve("mxfp8_quantize", x, axis=-1, backend="spec")
    assert named == "=spec;spec" and resolution.request_of(named) == "spec"
    got = resolution.run("mxfp8_quantize", x, axis=-1, backend=chosen)
    want = dispatch.run("mxfp8_quantize", x, axis=-1)
    assert_bytes_equal(got.data, want.data, "codes")
    assert_bytes_equal(got.scale, want.scale, "scales")


def test_resolution_raises_the_validators_words_at_trace_time():
    kv = torch.randn(1, 64, 2, 256).bfloat16()
    bad_pe = torch.randn(1, 64, 3, 64).bfloat16()  # 3 heads against k_nope's 2

    def f(kv, k_pe):
        k, _ = mxag.mla_kv_mxfp8(kv[..., :128], k_pe, kv[..., 128:])
        return k.grad_proxy

    torch._dynamo.reset()
    with pytest.raises(Exception, match="k_pe"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(kv, bad_pe)
