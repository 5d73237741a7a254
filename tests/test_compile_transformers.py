"""torch.compile of an HF DeepseekV3ForCausalLM patched by `patch_deepseek_v3` (CPU, torch backend).

The model is tests/test_integration_transformers.tiny_model (DeepSeek-V3's head dims, 2 dense layers)
trained 10 AdamW steps at B1 S64, compiled with fullgraph=True per decoder layer (TorchTitan's way)
and as a whole model, on both paths, against the same patched model run eagerly. Each case asserts:
0 graph breaks, one frame per compiled module and no recompile after the first step
(`error_on_recompile` from step 2 on), every layer traced through mxmla (`patch_state(model).traced`)
with mxmla's custom ops in the captured graph, and no eager counter moved by the compiled calls.
The mxfp8 path runs twice: with the optimizer registered for the weight copies (`refresh_after`; the
graph reads the copies and holds no `mxfp8_quantize`: every MXFP8 operand comes from a fused op) and
without (the graph quantizes q_b_proj's weight itself, one `mxfp8_quantize` per layer).

Bounds against the eager patched model:
- aot_eager: equal bytes, every loss and every gradient at every step. The compiled graph runs the
  same ATen kernels and the same custom ops in the same order as eager mode; AdamW runs eagerly on
  equal gradients, so the weights stay equal too.
- inductor: it fuses the HF modules' fp32 elementwise ops and reductions and may reorder the sums,
  so a value that eager mode rounds to bf16 (2^-8 relative) or e4m3 (2^-4) can round the other way.
  At step 0 (equal weights) every gradient is within EPS_GRAD (relative Frobenius norm, the first-
  order bounds of test_integration_transformers for the path's roundings against exact arithmetic),
  and every step's loss within EPS (relative). Later gradients are taken at weights that already
  differ (the updates carry the step-0 differences forward), so only the losses are compared there.
"""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers", reason="the HF integration needs transformers")
import torch._dynamo  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from dispatch.integrations.transformers import patch_deepseek_v3, patch_state  # noqa: E402
from tests.test_integration_transformers import EPS, EPS_GRAD, rel, tiny_model, token_ids  # noqa: E402

STEPS, BATCH, SEQ = 10, 1, 64
LAYERS = 2


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """One intra-op thread (the shared 2-core machine) and a clean dynamo state per case."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


def _batch(step):
    return token_ids(seed=100 + step, batch=BATCH, seq=SEQ)


def _train(model, call, on_step=None, hooked=False):
    """STEPS AdamW steps; per step the loss and every gradient (cloned before the update). hooked: the
    optimizer refreshes the mxfp8 path's weight copies after each step (`refresh_after`)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    if hooked:
        patch_state(model).refresh_after(opt)
    record = []
    for step in range(STEPS):
        ids = _batch(step)
        logits = call(ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        record.append((loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                if p.grad is not None}))
        opt.step()
        if on_step is not None:
            on_step(step)
    return record


_eager_runs = {}


def _eager(path):
    """The eager patched model's record (computed once per path for the module)."""
    if path not in _eager_runs:
        model = patch_deepseek_v3(tiny_model().train(), path=path, backend="torch")
        _eager_runs[path] = _train(model, model)
        assert patch_state(model).served == LAYERS * STEPS and not patch_state(model).fallbacks
    return _eager_runs[path]


def _compiled(model, scope, backend):
    """(callable, counter): the model with fullgraph compiles per decoder layer or as a whole."""
    counter = CompileCounterWithBackend(backend)
    if scope == "layer":
        for layer in model.model.layers:
            layer.compile(backend=counter, fullgraph=True)
        return model, counter
    return torch.compile(model, backend=counter, fullgraph=True), counter


def _mxmla_ops(counter):
    return {str(n.target) for g in counter.graphs for n in g.graph.nodes if str(n.target).startswith("mxmla.")}


def _train_compiled(path, scope, backend, hooked=False):
    model = patch_deepseek_v3(tiny_model().train(), path=path, backend="torch")
    call, counter = _compiled(model, scope, backend)
    frames = LAYERS if scope == "layer" else 1

    def after(step):
        if step == 0:
            assert counter.frame_count == frames, f"{counter.frame_count} frames compiled in the first step"
            torch._dynamo.config.error_on_recompile = True  # any later recompile raises

    with torch._dynamo.config.patch(error_on_recompile=False):
        record = _train(model, call, after, hooked)
    assert counter.frame_count == frames
    assert not counters["graph_break"], dict(counters["graph_break"])
    state = patch_state(model)
    assert state.traced == {"served": LAYERS}, dict(state.traced)
    assert state.served == 0 and not state.fallbacks  # eager counters: untouched by compiled calls
    ops = _mxmla_ops(counter)
    want_ops = {"mxmla.mla_attention.default"}
    if path == "bf16":
        want_ops |= {"mxmla.rope.default"}
    elif hooked:  # the query path is one op reading the copies; k_pe's RoPE runs inside the kv op
        want_ops |= {"mxmla.rmsnorm_mla_q.default", "mxmla.mla_kv_mxfp8.default"}
        assert state.quantized_in_graph == 0
    else:  # no optimizer refreshes the copies: the graph quantizes q_b_proj's weight itself
        want_ops |= {"mxmla.mla_q_uproj_rope_quant.default", "mxmla.rmsnorm_mxfp8.default",
                     "mxmla.mxfp8_quantize.default", "mxmla.mla_kv_mxfp8.default"}
        assert state.quantized_in_graph == LAYERS
    assert want_ops <= ops, ops
    if path == "mxfp8":
        assert "mxmla.rope.default" not in ops, ops
    if hooked:  # nothing in the graph quantizes a weight (q is the fused op's, k and v the kv op's)
        assert "mxmla.mxfp8_quantize.default" not in ops, ops
    return record


@pytest.mark.parametrize("scope", ["layer", "model"])
@pytest.mark.parametrize("path, hooked", [("bf16", False), ("mxfp8", False), ("mxfp8", True)],
                         ids=["bf16", "mxfp8", "mxfp8-copies"])
def test_aot_eager_fullgraph_equals_eager_bytes(path, hooked, scope):
    got, want = _train_compiled(path, scope, "aot_eager", hooked), _eager(path)
    for step, ((loss, grads), (want_loss, want_grads)) in enumerate(zip(got, want)):
        assert torch.equal(loss, want_loss), f"step {step}: loss {float(loss)} vs eager {float(want_loss)}"
        assert grads.keys() == want_grads.keys()
        for name, g in grads.items():
            assert torch.equal(g, want_grads[name]), f"step {step}: {name} gradient differs from eager"


@pytest.mark.parametrize("path, scope", [("mxfp8", "layer")])
def test_inductor_fullgraph_within_rounding_of_eager(path, scope):
    got, want = _train_compiled(path, scope, "inductor", hooked=True), _eager(path)
    for step, ((loss, grads), (want_loss, want_grads)) in enumerate(zip(got, want)):
        assert abs(float(loss) - float(want_loss)) <= EPS[path] * float(want_loss), f"step {step}: loss"
        if step == 0:
            for name, g in grads.items():
                assert rel(g, want_grads[name]) <= EPS_GRAD[path], f"{name}: step-0 gradient"


def test_a_mask_from_user_inputs_falls_back_to_hf_inside_the_graph():
    """position_ids given: HF builds a 4-D mask that may hold packed sequences, and under compile its
    values are not read; HF's forward serves the layer, compiled into the same graph without breaks,
    and matches eager HF (the unpatched model) bytes for bytes under aot_eager."""
    ref = tiny_model().eval()
    model = patch_deepseek_v3(copy.deepcopy(ref), path="bf16", backend="torch")
    call, counter = _compiled(model, "model", "aot_eager")
    ids = _batch(0)
    position_ids = torch.arange(SEQ)[None]
    with torch.no_grad():
        got = call(ids, position_ids=position_ids).logits
        want = ref(ids, position_ids=position_ids).logits
        eager_patched = model(ids, position_ids=position_ids).logits  # eager: reads the mask, serves it
    assert counter.frame_count == 1 and not counters["graph_break"]
    (reason, traces), = patch_state(model).traced.items()
    assert traces == LAYERS and "under torch.compile" in reason, reason
    assert patch_state(model).served == LAYERS and not patch_state(model).fallbacks
    assert torch.equal(got, want)
    assert not torch.equal(eager_patched, want)


def test_eager_counters_still_count_around_compiled_calls():
    model = patch_deepseek_v3(tiny_model().eval(), path="bf16", backend="torch")
    call, _ = _compiled(model, "model", "aot_eager")
    with torch.no_grad():
        for _ in range(3):
            call(_batch(0))
        assert patch_state(model).served == 0 and patch_state(model).traced == {"served": LAYERS}
        model(_batch(0))  # the model itself runs eagerly: counted per call
    assert patch_state(model).served == LAYERS


def test_a_copied_patch_state_counts_its_own_traces():
    model = patch_deepseek_v3(tiny_model(), path="bf16", backend="torch")
    twin = copy.deepcopy(model)
    patch_state(twin)._trace_marker(0, None)  # what dynamo runs while tracing a served layer
    assert patch_state(twin).traced == {"served": 1} and not patch_state(model).traced
