"""The MXFP8 path under torch.compile (CPU, torch backend): the same fused work as eager, no graph breaks,
no `dispatch.run` inside a compiled step (backends resolved at trace time: dispatch.resolution), and
bytes equal to eager wherever the same kernels run in the same order.

- mla_kv_mxfp8: one custom op for k (k_pe's RoPE included) and v, and one for its backward, on every
  layout; codes, scales and gradients byte-equal to the eager node.
- resolution: a resolved choice is what dispatch.select picks; a bad argument raises at trace time with
  the validator's words.
- rmsnorm_mxfp8: its backward is the op rmsnorm_backward, resolved at trace time (torch, and Triton
  under the interpreter), gradients byte-equal to eager.
"""
from __future__ import annotations

import pytest
import torch

import dispatch
import dispatch.autograd as mxag
import dispatch.resolution as resolution
from tests.util import assert_bytes_equal, skip_without_triton_interpreter

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
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


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
    """The traced forward holds mla_kv_mxfp8 (no concatenation, no quantize); the backward its op for
    k_pe's gradient, k_nope's and v's left as slices for the compiler to fuse."""
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
    assert "mxmla.mla_kv_mxfp8_pe_backward.default" in backward
    # k_nope's and v's gradients are slices in the graph, not copies out of the op
    assert "aten.clone" not in backward and "aten.copy" not in backward


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


def test_resolution_is_marked_constant_as_torch_marks_it():
    """resolve_described carries torch.compiler.assume_constant_result's mark, set without importing
    dynamo: the torch decorator, applied to a fresh function, sets exactly that mark and nothing else
    (a torch that marks differently fails here, not silently in a trace)."""

    def probe():
        return None

    before = dict(vars(probe))
    torch.compiler.assume_constant_result(probe)
    added = {k: v for k, v in vars(probe).items() if k not in before}
    assert added == {"_dynamo_marked_constant": True}
    assert all(getattr(resolution.resolve_described, k, None) == v for k, v in added.items())


def test_resolution_raises_the_validators_words_at_trace_time():
    kv = torch.randn(1, 64, 2, 256).bfloat16()
    bad_pe = torch.randn(1, 64, 3, 64).bfloat16()  # 3 heads against k_nope's 2

    def f(kv, k_pe):
        k, _ = mxag.mla_kv_mxfp8(kv[..., :128], k_pe, kv[..., 128:])
        return k.grad_proxy

    torch._dynamo.reset()
    with pytest.raises(Exception, match="k_pe"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(kv, bad_pe)


# --------------------------------------------------------------------------------------------------
# MLAQProjection, MLAAttention and the example block, compiled whole
# --------------------------------------------------------------------------------------------------

def _graphs_backend(graphs):
    """An aot_eager-like backend that keeps the forward and backward graphs' text."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    def backend(gm, example_inputs):
        def keep(g, _):
            graphs.append(str(g.graph))
            return make_boxed_func(g.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

    return backend


def _q_inputs(seed=5, k=64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 32, k, generator=gen).requires_grad_(True)
    angles = torch.rand(32, 64, generator=gen, dtype=torch.float64) * 6
    g = torch.randn(2, 32, 2, 192, generator=gen).bfloat16()
    return x, angles.cos().float(), angles.sin().float(), g


@pytest.mark.parametrize("rope_style", ["mla", "neox"])
def test_q_projection_compiled_one_op_reads_the_copies(rope_style, monkeypatch):
    """MLAQProjection compiled (fullgraph): RMSNorm + the fused up-projection as one custom op, the
    weight's persistent copies as graph inputs (no quantize in the graph), bytes and gradients equal
    to eager, no dispatch.run in a compiled call."""
    from dispatch.nn import MLAQProjection

    torch.manual_seed(0)
    m = MLAQProjection(64, 2, rope_style=rope_style)
    with torch.no_grad():
        m.norm_weight.uniform_(0.5, 1.5)
    x, cos, sin, g = _q_inputs()

    def run(f):
        m.zero_grad(set_to_none=True)
        x.grad = None
        q = f(x, cos, sin)
        q.grad_proxy.backward(g)
        return [_bits(q.data), _bits(q.scale), _bits(x.grad), _bits(m.weight.grad), _bits(m.norm_weight.grad)]

    want = run(m)
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend=_graphs_backend(graphs))
    first = run(compiled)
    with DispatchCounter(monkeypatch) as counter:
        second = run(compiled)
    assert counter.calls == []
    for name, a, b, c in zip(("q codes", "q scales", "dx", "dw", "dgamma"), want, first, second):
        assert_bytes_equal(b, a, name)
        assert_bytes_equal(c, a, name)
    forward, backward = graphs
    assert "mxmla.rmsnorm_mla_q.default" in forward and "mxfp8_quantize" not in forward
    assert "mxmla.rmsnorm_mla_q_backward.default" in backward


@pytest.mark.parametrize("backend", [None, "triton"])
def test_rmsnorm_compiled_backward_is_the_op(backend, monkeypatch):
    """rmsnorm_mxfp8 compiled (fullgraph): its backward is the custom op mxmla::rmsnorm_backward with the
    backend resolved at trace time (no dispatch.run in a compiled call), gradients byte-equal to eager."""
    if backend == "triton":
        skip_without_triton_interpreter()
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(64, 96, generator=gen).bfloat16().requires_grad_(True)
    gamma = (1 + 0.1 * torch.randn(96, generator=gen)).requires_grad_(True)
    g1, g2 = torch.randn(64, 96, generator=gen), torch.randn(64, 96, generator=gen)

    def f(x, gamma):
        y_row, y_col, _ = mxag.rmsnorm_mxfp8(x, gamma, backend=backend)
        return (mxag.mxfp8_dequantize(y_row) * g1).sum() + (mxag.mxfp8_dequantize(y_col) * g2).sum()

    def run(fn):
        x.grad = gamma.grad = None
        fn(x, gamma).backward()
        return [_bits(x.grad), _bits(gamma.grad)]

    want = run(f)
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=_graphs_backend(graphs))
    run(compiled)
    with DispatchCounter(monkeypatch) as counter:
        got = run(compiled)
    assert counter.calls == []
    for name, a, b in zip(("dx", "dgamma"), want, got):
        assert_bytes_equal(b, a, name)
    call = next(line for line in graphs[1].splitlines() if "mxmla.rmsnorm_backward.default" in line)
    # the CPU's automatic choice is torch; Triton's kernel is its "fused" variant
    resolved = f"={'triton:fused' if backend == 'triton' else 'torch'};{backend or ''}"
    assert call.endswith(f", {resolved}), kwargs = {{}})"), call


def test_attention_module_compiled_no_dispatch(monkeypatch):
    from dispatch.nn import MLAAttention

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 64, 2, 192, generator=gen).bfloat16().requires_grad_(True)
    k = torch.randn(1, 64, 2, 192, generator=gen).bfloat16().requires_grad_(True)
    v = torch.randn(1, 64, 2, 128, generator=gen).bfloat16().requires_grad_(True)
    do = torch.randn(1, 64, 2, 128, generator=gen).bfloat16()
    attn = MLAAttention(causal=True)

    def run(f):
        for t in (q, k, v):
            t.grad = None
        o, _ = f(q, k, v)
        o.backward(do)
        return [_bits(o), _bits(q.grad), _bits(k.grad), _bits(v.grad)]

    want = run(attn)
    torch._dynamo.reset()
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    run(compiled)
    with DispatchCounter(monkeypatch) as counter:
        got = run(compiled)
    assert counter.calls == []
    for name, a, b in zip(("o", "dq", "dk", "dv"), want, got):
        assert_bytes_equal(b, a, name)


def _block(path, seed=0):
    import examples.mla_block as mb

    cfg = mb.replace(mb.CONFIGS["small"], batch=1, seq=64)
    return mb, cfg, mb.MLABlock(cfg, path).reset_parameters(seed)


def _train(mb, cfg, model, forward, steps, accumulate=1, after_step=None):
    """steps optimizer steps of `accumulate` forward + backward each; returns per-step losses (bytes),
    the final parameters and what after_step returned after each step."""
    task = mb.CopyTask(cfg, 0, "cpu")
    cos, sin = mb.rope_tables(cfg, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.refresh_after(opt)
    losses, seen = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for micro in range(accumulate):
            h, target = task.batch(step * accumulate + micro)
            loss = mb.normalized_mse(forward(h, cos, sin), target)
            loss.backward()
            losses.append(_bits(loss))
        opt.step()
        if after_step is not None:
            seen.append(after_step())
    return losses, [_bits(p) for p in model.parameters()], seen


@pytest.mark.parametrize("path", ["mxfp8", "bf16"])
def test_block_compiled_trains_like_eager(path, monkeypatch):
    """The example block compiled with fullgraph=True (aot_eager): three optimizer steps with the
    weight update give the eager run's losses and parameters byte for byte, without a recompile, and
    a compiled step (forward + backward) runs no dispatch.run."""
    mb, cfg, eager_model = _block(path)
    want_losses, want_params, _ = _train(mb, cfg, eager_model, eager_model, 3)
    _, _, model = _block(path)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got_losses, got_params, _ = _train(mb, cfg, model, compiled, 3)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    for i, (a, b) in enumerate(zip(want_losses, got_losses)):
        assert_bytes_equal(b, a, f"loss {i}")
    for i, (a, b) in enumerate(zip(want_params, got_params)):
        assert_bytes_equal(b, a, f"parameter {i}")
    task = mb.CopyTask(cfg, 0, "cpu")
    cos, sin = mb.rope_tables(cfg, "cpu")
    h, target = task.batch(0)
    with DispatchCounter(monkeypatch) as counter:
        mb.normalized_mse(compiled(h, cos, sin), target).backward()
    assert counter.calls == [], counter.calls


def test_attention_backward_dequantizes_apart_for_a_bf16_twin(monkeypatch):
    """Where the resolved attention backward declares a bf16 twin (cuDNN's sm90 route; stood in for
    here by the torch backend, whose MXFP8 attention equals its bf16 one on the exact bf16
    dequantizations of normal-range codes), the compiled backward dequantizes q, k and v as graph
    nodes of their own and calls the twin on bf16 operands: the eager run's bytes, three optimizer
    steps, and no dequantization where no twin is declared."""
    mb, cfg, eager_model = _block("mxfp8")
    want_losses, want_params, _ = _train(mb, cfg, eager_model, eager_model, 3)
    for twin in (False, True):
        if twin:
            monkeypatch.setattr(resolution, "bf16_twin",
                                lambda op, choice: choice if resolution.is_resolved(choice) else None)
        _, _, model = _block("mxfp8")
        graphs = []
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend=_graphs_backend(graphs))
        got_losses, got_params, _ = _train(mb, cfg, model, compiled, 3)
        for i, (a, b) in enumerate(zip(want_losses, got_losses)):
            assert_bytes_equal(b, a, f"loss {i}")
        for i, (a, b) in enumerate(zip(want_params, got_params)):
            assert_bytes_equal(b, a, f"parameter {i}")
        backward = graphs[1]
        assert backward.count("mxmla.mxfp8_dequantize.default") == (3 if twin else 0), backward


@pytest.mark.parametrize("path", ["mxfp8", "bf16"])
def test_block_compiled_at_changing_shapes_matches_eager(path):
    """torch.compile (default dynamic=None) marks sizes dynamic once they change (here: one block per shape,
    one forward code object); the trace-time backend
    choice then specializes them (a choice can depend on a size), so each new shape compiles once
    (fullgraph, no error) and every step's output and input gradient equal eager's bytes."""
    import examples.mla_block as mb

    torch._dynamo.reset()
    small = mb.CONFIGS["small"]
    for batch, seq in ((1, 64), (2, 64), (1, 96), (1, 128)):
        cfg = mb.replace(small, batch=batch, seq=seq)  # the block is built per shape (its forward reads cfg)
        model = mb.MLABlock(cfg, path).reset_parameters(0)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        cos, sin = mb.rope_tables(cfg, "cpu")
        h, _ = mb.CopyTask(cfg, 0, "cpu").batch(0)
        outs = []
        for fn in (model, compiled):
            x = h.clone().requires_grad_(True)
            out = fn(x, cos, sin)
            out.float().square().mean().backward()
            outs.append((out.detach(), x.grad))
            model.zero_grad(set_to_none=True)
        for name, want, got in zip(("output", "input gradient"), outs[0], outs[1]):
            assert_bytes_equal(got, want, f"B{batch} S{seq} {name}")


def test_block_weight_copies_refreshed_in_place_once_per_step():
    """Compiled mxfp8 block with gradient accumulation (2 forwards a step): one refresh per optimizer
    step, into the same buffers, and after every step the copies equal a fresh quantization of the
    updated weight (the compiled graph never quantizes it)."""
    from dispatch.weights import MXFP8Weight

    mb, cfg, model = _block("mxfp8")
    copies = model.uq_copies
    buffers = [b.data_ptr() for b in copies.buffers()]
    start = copies.refreshes
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")

    def check():
        fresh = MXFP8Weight.quantize(model.w_uq)
        entry = copies.traced()
        for got, want, name in ((entry.row.data, fresh.row.data, "row codes"), (entry.row.scale, fresh.row.scale,
                                "row scales"), (entry.col.data, fresh.col.data, "col codes"),
                                (entry.col.scale, fresh.col.scale, "col scales")):
            assert_bytes_equal(_bits(got), _bits(want), name)
        return copies.refreshes

    _, _, seen = _train(mb, cfg, model, compiled, 3, accumulate=2, after_step=check)
    assert seen == [start + 1, start + 2, start + 3]
    assert [b.data_ptr() for b in copies.buffers()] == buffers


def test_copies_never_made_raise_at_trace_time():
    from dispatch.weights import WeightCopies

    copies = WeightCopies((64, 64))

    def f(x):
        return copies.traced().row.data.view(torch.uint8).float().sum() + x

    torch._dynamo.reset()
    with pytest.raises(Exception, match="never made"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(torch.zeros(()))


def test_opcheck_rmsnorm_mla_q():
    """torch.library.opcheck of the query path's custom ops (schema, fake tensors, autograd, AOT)."""
    from dispatch.q_path import _rmsnorm_mla_q_backward_op, _rmsnorm_mla_q_op
    from dispatch.weights import MXFP8Weight

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(32, 64, generator=gen).requires_grad_(True)
    gamma = (torch.rand(64, generator=gen) + 0.5).requires_grad_(True)
    w = (torch.randn(192, 64, generator=gen) * 0.1).requires_grad_(True)
    entry = MXFP8Weight.quantize(w)
    col_t = (entry.col.data.view(torch.uint8).t().contiguous(), entry.col.scale.t().contiguous())
    angles = torch.rand(32, 64, generator=gen, dtype=torch.float64) * 6
    cos, sin = angles.cos().float(), angles.sin().float()
    args = (x, gamma, w, entry.row.data.view(torch.uint8), entry.row.scale, *col_t, cos, sin, None, 1e-6, None, None)
    torch.library.opcheck(_rmsnorm_mla_q_op, args)
    _, _, _, rstd, y_codes, y_scales = _rmsnorm_mla_q_op(*args)
    dq = torch.randn(32, 1, 192, generator=gen).bfloat16()
    torch.library.opcheck(_rmsnorm_mla_q_backward_op, (dq, x.detach(), gamma.detach(), rstd, y_codes, y_scales, *col_t,
                                                       cos, sin, None, None))


# --------------------------------------------------------------------------------------------------
# CUDA graphs (GPU only)
# --------------------------------------------------------------------------------------------------

def test_may_keep_only_on_the_default_stream_outside_capture(monkeypatch):
    """backends.kept.may_keep on a CUDA device (torch.cuda's stream queries stood in for): a tensor may
    be kept on the default stream, not on a side stream (CUDA-graph trees' warm-up and capture, whose
    allocations go to the graph's pool), nor while a graph is captured; off CUDA always."""
    from backends import kept

    state = {"stream": "default", "capturing": False}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["stream"])
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: "default")
    assert kept.may_keep("cuda:0") and kept.may_keep(torch.device("cpu"))
    state["stream"] = "side"
    assert not kept.may_keep("cuda:0") and kept.may_keep("cpu")
    state["stream"], state["capturing"] = "default", True
    assert not kept.may_keep(torch.device("cuda", 0))


def _module_tensors():
    """{id: tensor} of every tensor reachable from the module-level state of backends.*, dispatch.* and
    examples.* (dicts, sequences, sets, weak dictionaries, thread-locals, and objects of those
    packages and of spec, a few levels deep): where a cache keeps what it made."""
    import sys
    import threading
    import weakref

    found, seen = {}, set()
    packages = ("backends", "dispatch", "examples", "spec")

    def walk(obj, depth):
        if id(obj) in seen or depth > 6:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found[id(obj)] = obj
        elif isinstance(obj, (dict, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)):
            for key, value in list(obj.items()):
                walk(key, depth + 1)
                walk(value, depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for item in list(obj):
                walk(item, depth + 1)
        elif isinstance(obj, threading.local) or type(obj).__module__.split(".")[0] in packages:
            for value in list(getattr(obj, "__dict__", {}).values()):
                walk(value, depth + 1)
            for name in getattr(type(obj), "__slots__", ()):
                walk(getattr(obj, name, None), depth + 1)

    for name, module in list(sys.modules.items()):
        if module is not None and name.split(".")[0] in packages:
            for value in list(vars(module).values()):
                if not isinstance(value, type(sys)) and not callable(value) or isinstance(value, torch.Tensor):
                    walk(value, 0)
    return found


@pytest.mark.parametrize("path", ["mxfp8", "bf16"])
def test_block_compiled_step_keeps_nothing_it_made_in_a_graph_pool(path, monkeypatch):
    """The example block's compiled step (forward and backward, fullgraph, aot_eager) on the Triton
    backend (interpreter), run as inside CUDA-graph trees' warm-up (backends.kept.may_keep says no, as
    on their side stream): afterwards no module-level state of backends / dispatch / examples holds a
    tensor it did not hold before. On a GPU such a tensor sits in the graph's private pool and the
    trees refuse it ("tensor(s) in the cudagraph pool not tracked as outputs"):
    test_block_cuda_graphs_bytes_equal_cuda is the real check. The known caches are emptied after a
    first step (tracing and running), so the step has to make again what they would keep."""
    from tests.util import skip_without_triton_interpreter

    skip_without_triton_interpreter()
    from backends import kept
    from backends.triton import _common as triton_common
    from backends.triton import mla_q as triton_mla_q

    import examples.mla_block as mb

    monkeypatch.setenv("MXMLA_TRITON_WEIGHT_BF16", "1")  # its cache in play too
    cfg = mb.replace(mb.CONFIGS["small"], batch=1, seq=64)
    model = mb.MLABlock(cfg, path, backend="triton").reset_parameters(0)
    task = mb.CopyTask(cfg, 0, "cpu")
    cos, sin = mb.rope_tables(cfg, "cpu")
    h, target = task.batch(0)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    mb.normalized_mse(compiled(h, cos, sin), target).backward()  # traced and run, as before a graph is recorded
    for owner, name in ((triton_common, "_PLACEHOLDERS"), (triton_mla_q, "_WEIGHT_BF16"), (mxag, "_ZEROS")):
        monkeypatch.setattr(owner, name, {})
    before = _module_tensors()
    monkeypatch.setattr(kept, "may_keep", lambda device: False)
    mb.normalized_mse(compiled(h, cos, sin), target).backward()
    gained = [t for i, t in _module_tensors().items() if i not in before]
    assert not gained, [(tuple(t.shape), t.dtype) for t in gained]


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["mxfp8", "bf16"])
def test_block_cuda_graphs_bytes_equal_cuda(path, monkeypatch):
    """CUDA graphs on the example block, four optimizer steps each (forward, backward, AdamW, the weight
    copies refreshed in place after each step): the "cudagraphs" backend (AOTAutograd's graphs, eager
    kernels, captured) gives eager's losses and parameters byte for byte, and mode="reduce-overhead"
    (Inductor, captured) gives Inductor's without CUDA graphs byte for byte (Inductor's fused torch ops
    round differently from eager's, so those two are compared with each other). Capture fails on any
    host read of a device value on the captured path, and the graph trees refuse a tensor left alive in
    their pool (a cache filled inside the warm-up: the caches are emptied before each graphed run)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    import torch._inductor.config as inductor_config

    import examples.mla_block as mb

    # a tensor left in a graph's pool is then reported with the stack that allocated it
    monkeypatch.setattr(inductor_config.triton, "cudagraph_trees_history_recording", True)
    cfg = mb.replace(mb.CONFIGS["small"], batch=1, seq=128, heads=4)

    def train(**compile_args):
        torch._dynamo.reset()
        if compile_args.get("backend") == "cudagraphs" or compile_args.get("mode") == "reduce-overhead":
            # the kept tensors made afresh, inside the graph trees' warm-up, as in a fresh process
            # (backends.kept: they must not stay in the graph's pool)
            from backends.cudnn import _common as cudnn_common
            from backends.triton import _common as triton_common
            from backends.triton import mla_q as triton_mla_q

            for owner, name in ((triton_common, "_PLACEHOLDERS"), (triton_mla_q, "_WEIGHT_BF16"), (mxag, "_ZEROS")):
                monkeypatch.setattr(owner, name, {})
            cudnn_common.reset_handles()
        model = mb.MLABlock(cfg, path).reset_parameters(0).to("cuda")
        forward = torch.compile(model, fullgraph=True, **compile_args) if compile_args else model
        task = mb.CopyTask(cfg, 0, "cuda")
        cos, sin = mb.rope_tables(cfg, "cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model.refresh_after(opt)
        losses = []
        for step in range(4):
            torch.compiler.cudagraph_mark_step_begin()
            h, target = task.batch(step)
            opt.zero_grad(set_to_none=True)
            loss = mb.normalized_mse(forward(h, cos, sin), target)
            loss.backward()
            opt.step()
            losses.append(_bits(loss).clone())
        torch.cuda.synchronize()
        return losses, [_bits(p).clone() for p in model.parameters()]

    def same(a, b, what):
        for i, (x, y) in enumerate(zip(a[0], b[0])):
            assert_bytes_equal(y.cpu(), x.cpu(), f"{what}: loss {i}")
        for i, (x, y) in enumerate(zip(a[1], b[1])):
            assert_bytes_equal(y.cpu(), x.cpu(), f"{what}: parameter {i}")

    same(train(), train(backend="cudagraphs"), "eager vs cudagraphs")
    same(train(backend="inductor"), train(mode="reduce-overhead"), "inductor vs reduce-overhead")
