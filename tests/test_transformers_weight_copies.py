"""The mxfp8 path's persistent copies of q_b_proj's weight in a model patched by `patch_deepseek_v3`
(CPU, torch backend, tests/test_integration_transformers.tiny_model: DeepSeek-V3's head dims, 2 dense
layers), and the kv op that rotates k_pe itself.

Each patched layer holds `mxmla_q_weight_copies` (dispatch.weights.WeightCopies). Checked here: the
copies equal a fresh quantization of the current weight byte for byte after every optimizer step
(gradient accumulation: several forwards a step; compiled with aot_eager, fullgraph, so no Python check
runs in the forward), are refreshed once per step in place (same buffers), follow `.to(dtype)` and
`load_state_dict`, stay out of the state dict, go with `unpatch_deepseek_v3`; without an optimizer
registered a compiled graph quantizes the weight itself (and logs it once) rather than read copies
it cannot know are fresh. tests/test_compile_transformers.py compares the compiled losses and gradients
with eager mode's. Also: k_pe rotated inside the kv op (the same bytes as rope then the op), and the
float32 tables the patch widens HF's cos / sin to giving the bytes of the bf16 ones.
"""
from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers", reason="the HF integration needs transformers")
import torch._dynamo  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import dispatch  # noqa: E402
import dispatch.autograd as mxag  # noqa: E402
from dispatch.nn import mla_q_projection  # noqa: E402
from dispatch.integrations.transformers import patch_deepseek_v3, patch_state, unpatch_deepseek_v3  # noqa: E402
from dispatch.weights import MXFP8Weight  # noqa: E402
from tests.test_compile_transformers import fresh_dynamo  # noqa: E402, F401 (autouse fixture)
from tests.test_integration_transformers import _loss, logits, patched, quantize_spy, tiny_model, token_ids  # noqa: E402
from tests.util import assert_bytes_equal  # noqa: E402

LAYERS = 2


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _attns(model):
    return [layer.self_attn for layer in model.model.layers]


def _assert_fresh(model, what):
    """Every layer's copies hold the bytes of quantizing its q_b_proj weight now."""
    for i, attn in enumerate(_attns(model)):
        fresh = MXFP8Weight.quantize(attn.q_b_proj.weight, backend="torch")
        entry = attn.mxmla_q_weight_copies.traced()
        for got, want, name in ((entry.row.data, fresh.row.data, "row codes"), (entry.row.scale, fresh.row.scale,
                                "row scales"), (entry.col.data, fresh.col.data, "col codes"),
                                (entry.col.scale, fresh.col.scale, "col scales")):
            assert_bytes_equal(_bits(got), _bits(want), f"{what}: layer {i} {name}")


def test_compiled_copies_are_fresh_after_every_step_with_accumulation():
    """Compiled per layer (aot_eager, fullgraph) with the optimizer registered: 3 steps of 2 forwards
    each; after every step the copies equal a fresh quantization, refreshed once per step in the same
    buffers, and the graph never quantizes the weight."""
    model = patch_deepseek_v3(tiny_model().train(), path="mxfp8", backend="torch")
    state = patch_state(model)
    copies = state.weight_copies
    assert len(copies) == LAYERS and all(c.made for c in copies)
    buffers = [[b.data_ptr() for b in c.buffers()] for c in copies]
    start = [c.refreshes for c in copies]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    state.refresh_after(opt)
    counter = CompileCounterWithBackend("aot_eager")
    for layer in model.model.layers:
        layer.compile(backend=counter, fullgraph=True)
    _assert_fresh(model, "at patch time")
    for step in range(3):
        for micro in range(2):
            _loss(model, token_ids(seed=20 + 2 * step + micro)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _assert_fresh(model, f"after step {step}")
        assert [c.refreshes - s for c, s in zip(copies, start)] == [step + 1] * LAYERS
    assert [[b.data_ptr() for b in c.buffers()] for c in copies] == buffers
    assert counter.frame_count == LAYERS and not counters["graph_break"]
    ops = {str(n.target) for g in counter.graphs for n in g.graph.nodes}
    assert "mxmla.rmsnorm_mla_q.default" in ops and "mxmla.mxfp8_quantize.default" not in ops, ops
    assert state.traced == {"served": LAYERS} and state.quantized_in_graph == 0


def test_eager_with_the_optimizer_hook_quantizes_once_per_step_in_the_hook(monkeypatch):
    """Eager mode, registered through patch_deepseek_v3(optimizer=...): each step quantizes each layer's
    weight once, in the step's hook, and the forwards find the copies fresh (the optimizer-step clock
    advances before the step, so the hook's copies count as made after it). Without the hook (or with
    its handle removed) the first forward after each step refreshes them instead: the same bytes."""
    ref = tiny_model()
    calls = quantize_spy(monkeypatch, ref.model.layers[0].self_attn.q_b_proj.weight.shape)

    def run(hook):
        model = patched(ref, "mxfp8").train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if hook == "patch":
            model = patch_deepseek_v3(unpatch_deepseek_v3(model), path="mxfp8", backend="torch", optimizer=opt)
        elif hook == "removed":
            patch_state(model).refresh_after(opt).remove()
        assert patch_state(model).optimizer_hooks == (hook == "patch")
        seen = []
        for step in range(2):
            calls.clear()
            for micro in range(2):
                _loss(model, token_ids(seed=30 + 2 * step + micro)).backward()
            in_forwards = len(calls)
            opt.step()
            opt.zero_grad()
            seen.append((in_forwards, len(calls) - in_forwards))
            if hook == "patch":  # without the hook the copies are refreshed at the next forward
                _assert_fresh(model, f"after step {step}")
        return model, seen

    hooked, seen = run("patch")
    assert seen == [(0, LAYERS), (0, LAYERS)]  # (in the forwards, in the step) per step
    unhooked, seen = run("removed")
    assert seen == [(0, 0), (LAYERS, 0)]
    for (name, p), (_, q) in zip(hooked.named_parameters(), unhooked.named_parameters()):
        assert_bytes_equal(p, q, name)


def test_copies_follow_to_and_load_state_dict_and_stay_out_of_the_state_dict():
    ref = tiny_model()
    model = patched(ref, "mxfp8")
    assert model.state_dict().keys() == ref.state_dict().keys()
    model.to(torch.bfloat16)  # the weight's bf16 cast is now the weight itself: same bytes here
    _assert_fresh(model, "after .to(bfloat16)")
    other = tiny_model(seed=5).to(torch.bfloat16)
    model.load_state_dict(other.state_dict())
    _assert_fresh(model, "after load_state_dict")
    model.model.layers[1].load_state_dict(tiny_model(seed=6).to(torch.bfloat16).model.layers[1].state_dict())
    _assert_fresh(model, "after a layer's load_state_dict")
    attn = _attns(model)[0]
    with torch.no_grad():
        attn.q_b_proj.weight.mul_(2)  # an edit outside any optimizer: refresh_weight_copies
    patch_state(model).refresh_weight_copies()
    _assert_fresh(model, "after refresh_weight_copies")
    unpatch_deepseek_v3(model)
    assert not any("mxmla" in name for name, _ in model.named_modules())
    assert not patch_state(patched(ref, "bf16")).weight_copies


def test_compiled_without_an_optimizer_quantizes_in_the_graph_and_says_so(caplog):
    model = patch_deepseek_v3(tiny_model().eval(), path="mxfp8", backend="torch")
    counter = CompileCounterWithBackend("aot_eager")
    call = torch.compile(model, backend=counter, fullgraph=True)
    with caplog.at_level(logging.WARNING, logger="mxmla.integrations"), torch.no_grad():
        got = call(token_ids()).logits
        call(token_ids())
    assert patch_state(model).quantized_in_graph == LAYERS
    assert sum("quantizes q_b_proj's weight in every forward" in r.getMessage() for r in caplog.records) == 1
    ops = {str(n.target) for g in counter.graphs for n in g.graph.nodes}
    assert "mxmla.mxfp8_quantize.default" in ops
    with torch.no_grad():
        assert_bytes_equal(got, model(token_ids()).logits, "logits against eager (copies)")
    with pytest.raises(TypeError, match="optimizer"):
        patch_state(model).refresh_after(object())
    with pytest.raises(TypeError, match="optimizer"):
        patch_deepseek_v3(tiny_model(), path="mxfp8", optimizer="adam")
    other = torch.optim.SGD(model.model.embed_tokens.parameters(), lr=1.0)
    with pytest.raises(ValueError, match="optimizer: does not update the query weight of DeepseekV3Attention layer 0"):
        patch_state(model).refresh_after(other)
    assert patch_state(model).optimizer_hooks == 0


def test_k_pe_rotated_inside_the_kv_op(monkeypatch):
    """With cos / sin shared by the batch (no position_ids: HF's [1, S, 64]) the mxfp8 path runs no rope
    op for k_pe: the kv op rotates it. Position ids given per sequence ([B, S, 64] tables) take rope
    then the op; the logits are the same bytes."""
    ref = tiny_model()
    model = patched(ref, "mxfp8").eval()
    ops = []
    real_run = dispatch.run

    def spy(op, *args, **kw):
        ops.append((op, kw.get("cos") is not None))
        return real_run(op, *args, **kw)

    monkeypatch.setattr(dispatch, "run", spy)
    ids = token_ids()
    with torch.no_grad():
        fused = logits(model, ids)
        assert ("mla_kv_quantize", True) in ops and not any(op == "rope" for op, _ in ops)
        ops.clear()
        positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        unfused = logits(model, ids, position_ids=positions)
        assert ("mla_kv_quantize", False) in ops and any(op == "rope" for op, _ in ops)
    assert_bytes_equal(fused, unfused, "logits")


def test_float32_tables_give_the_bytes_of_bf16_tables():
    """The patch widens HF's cos / sin to float32 (the block's tables, so the two share compiled kernels):
    the query path, the kv op (k_pe rotated inside) and rope, forward and backward, give the same
    bytes from the widened tables as from HF's bf16 ones (mxmla rotates in fp32 either way)."""
    gen = torch.Generator().manual_seed(7)
    angles = torch.rand(64, 64, generator=gen, dtype=torch.float64) * 40
    c16, s16 = angles.cos().bfloat16(), angles.sin().bfloat16()
    x = torch.randn(64, 64, generator=gen).bfloat16()
    w = (torch.randn(2 * 192, 64, generator=gen) * 0.1).bfloat16()
    gamma = (torch.rand(64, generator=gen) + 0.5).bfloat16()
    kv = torch.randn(1, 64, 2, 256, generator=gen).bfloat16()
    k_pe = torch.randn(1, 64, 1, 64, generator=gen).bfloat16()
    outs = []
    for cos, sin in ((c16, s16), (c16.float(), s16.float())):
        pe = k_pe.clone().requires_grad_(True)
        q = mla_q_projection(x, w, cos, sin, norm_weight=gamma, backend="torch")
        k, v = mxag.mla_kv_mxfp8(kv[..., :128], pe, kv[..., 128:], layout="bshd", cos=cos, sin=sin, backend="torch")
        r = mxag.rope(pe, cos, sin, layout="bshd", backend="torch")
        r.backward(torch.ones_like(r))
        outs.append([q.data, q.scale, k.data, k.scale, v.data, v.scale, r, pe.grad])
    for i, (a, b) in enumerate(zip(*outs)):
        assert_bytes_equal(_bits(b), _bits(a), f"output {i}")


def test_a_step_whose_hook_cannot_refresh_sends_compiled_forwards_to_the_graphs_quantization(monkeypatch):
    """The optimizer's hook finds the weight unquantizable here (as FSDP2's sharded DTensor parameter
    is at the step): the copies are marked unrefreshed, and the next compiled forward recompiles once
    and quantizes the updated weight in its graph -- the bytes eager mode gives after refreshing --
    instead of reading the stale copies."""
    from dispatch.integrations import transformers as integration

    model = patch_deepseek_v3(tiny_model().train(), path="mxfp8", backend="torch")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = patch_state(model)
    state.refresh_after(opt)
    counter = CompileCounterWithBackend("aot_eager")
    call = torch.compile(model, backend=counter, fullgraph=True)
    ids = token_ids()
    _loss(call, ids).backward()
    monkeypatch.setattr(integration._QueryWeightCopies, "refresh_if_ready", lambda self, w, rows=None: False)
    opt.step()
    opt.zero_grad()
    monkeypatch.undo()
    assert all(c.unrefreshed for c in state.weight_copies)
    assert counter.frame_count == 1 and state.quantized_in_graph == 0
    got = call(ids).logits.detach()  # grad mode as traced: only the copies' state can recompile
    assert counter.frame_count == 2 and state.quantized_in_graph == LAYERS
    want = model(ids).logits.detach()  # eager: refreshes the copies from the updated weight first
    assert_bytes_equal(got, want, "logits after the step")
    assert not any(c.unrefreshed for c in state.weight_copies)
