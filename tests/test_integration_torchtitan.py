"""dispatch.integrations.torchtitan on tiny random-init TorchTitan DeepSeek-V3 models (CPU, no downloads).

Bounds (relative Frobenius error of the loss's gradients against stock TorchTitan in fp32):
- bf16 path: 2^-7 -- q, k, v and the attention's output each rounded once to bf16 (relative 2^-9 each,
  half an ulp of 2^-8), composed through a few products; the measured errors are about 3e-3.
- mxfp8 path: 2^-3. A gradient on the query path meets three independent e4m3 roundings (q in the
  forward; k and v; dq in the fused op's MXFP8 backward), each at most e4m3's half-ulp, 2^-4 relative,
  whose root-mean-square is 2^-4 / sqrt(3); three of them give about 2^-4 (the measured errors reach
  0.045 in one process and 0.067 under TP=2), and 2^-3 stays below their worst case 3 * 2^-4.
Losses: 2^-8 relative on both paths (the loss averages many tokens' errors).
"""
from __future__ import annotations

import copy
import inspect
import io
import logging
import weakref
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from tests import titan_compat

titan_compat.install()  # torch 2.11 lacks names torchtitan 0.3.0 imports: stand-ins before it is imported

try:  # any ImportError, not only an absent package (a torch older than the names stood in above)
    import torchtitan.models.deepseek_v3  # noqa: F401
except ImportError as _error:
    pytest.skip(f"needs an importable TorchTitan (pip install 'mxmla[torchtitan]'): {_error}",
                allow_module_level=True)

from dispatch.integrations import torchtitan as tt  # noqa: E402
from tests import titan_models as tm  # noqa: E402

from torchtitan.models.common.attention import (  # noqa: E402
    VarlenAttention,
    create_varlen_metadata_for_document,
    get_causal_mask_mod,
    get_sliding_window_mask_mod,
)
from torchtitan.models.common.rope import CosSinRoPE  # noqa: E402
from torchtitan.models.deepseek_v3.model import Attention  # noqa: E402
from torch.nn.attention.flex_attention import and_masks, create_block_mask  # noqa: E402
from torch.nn.attention.varlen import varlen_attn  # noqa: E402

GRAD_BOUND = {"bf16": 2.0 ** -7, "mxfp8": 2.0 ** -3}
LOSS_BOUND = 2.0 ** -8
B, S = 2, 64


def _pair(path, seed=0, **kw):
    """(stock, converted) models with the same initial parameters."""
    cfg = tm.deepseek_v3_config(**kw)
    stock = tm.build(copy.deepcopy(cfg), seed)
    converted = tm.build(tt.convert_deepseek_v3(copy.deepcopy(cfg), path=path), seed)
    return stock, converted


def _loss(model, tokens, positions, masks):
    logits = model(tokens, positions, masks)
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _compare(stock, converted, tokens, positions, masks, path):
    ls = _loss(stock, tokens, positions, masks)
    ls.backward()
    lc = _loss(converted, tokens, positions, masks)
    lc.backward()
    assert abs(lc.item() - ls.item()) <= LOSS_BOUND * abs(ls.item())
    for (name, p), (name_c, pc) in zip(stock.named_parameters(), converted.named_parameters()):
        assert name == name_c
        assert pc.grad is not None, name
        assert _rel(pc.grad, p.grad) <= GRAD_BOUND[path], (name, _rel(pc.grad, p.grad))


def _served(model):
    attn = [m for m in model.modules() if isinstance(m, tt.MXMLAAttention)]
    return sum(m.mxmla_served for m in attn), sum((m.mxmla_fallbacks for m in attn), start=Counter())


# ---- conversion -----------------------------------------------------------------------------------

def test_convert_replaces_every_attention_and_keeps_fields_params_and_state_dict():
    cfg = tm.deepseek_v3_config(layers=3)
    stock = tm.build(copy.deepcopy(cfg))
    fields = ("dim", "n_heads", "q_lora_rank", "kv_lora_rank", "mscale", "wq_b", "rope", "inner_attention")
    originals = [{f: getattr(layer.attention, f) for f in fields} for layer in cfg.layers]
    converted_cfg = tt.convert_deepseek_v3(cfg, path="bf16", backend="torch")
    for layer, original in zip(converted_cfg.layers, originals):
        attn = layer.attention
        assert type(attn) is tt.MXMLAAttention.Config and isinstance(attn, Attention.Config)
        assert (attn.path, attn.backend, attn.quantize_grad) == ("bf16", "torch", True)
        assert all(getattr(attn, f) is original[f] for f in fields)
    converted = tm.build(converted_cfg)
    assert all(isinstance(b.attention, tt.MXMLAAttention) for b in converted.layers.values())
    sd, sd_c = stock.state_dict(), converted.state_dict()
    assert list(sd) == list(sd_c)
    assert all(torch.equal(sd[k], sd_c[k]) for k in sd)
    converted.load_state_dict(sd)  # stock's checkpoints load as they are
    converted.layers["0"].attention._fsdp_probe = (weakref.ref(converted), None)  # as after an FSDP2 forward
    buffer = io.BytesIO()
    torch.save(converted, buffer)  # the whole module pickles (TorchTitan's checkpoints are state dicts)
    assert isinstance(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False), type(converted))


def test_converter_through_model_registry_and_override_entry():
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.deepseek_v3 import model_registry

    spec = model_registry("debugmodel", converters=[tt.MXMLAConverter.Config(path="bf16")], num_mtp_layers=1)
    layers = list(spec.model.layers) + list(spec.model.mtp_layers)
    assert layers and all(type(layer.attention) is tt.MXMLAAttention.Config for layer in layers)
    assert layers[0].attention.q_lora_rank == 0  # the debug model: wq, no q_lora
    cfg = tm.deepseek_v3_config()
    lines = apply_overrides(OverrideConfig(imports=[("dispatch.integrations.torchtitan.mxmla_attention",
                                                     {"path": "bf16"})]), cfg)
    assert len(lines) == 2
    assert all(type(layer.attention) is tt.MXMLAAttention.Config and layer.attention.path == "bf16"
               for layer in cfg.layers)


@pytest.mark.parametrize("change, message", [
    (dict(path="fp4"), "path"),
    (dict(backend="nope"), "backend: unknown backend 'nope'"),
])
def test_convert_rejects_bad_arguments(change, message):
    with pytest.raises(ValueError, match=message):
        tt.convert_deepseek_v3(tm.deepseek_v3_config(), **change)
    with pytest.raises(ValueError, match="MXMLAConverter.Config.path"):
        tt.MXMLAConverter.Config(path="fp4").build()
    with pytest.raises(ValueError, match="MXMLAConverter.Config.backend: unknown backend 'nope'"):
        tt.MXMLAConverter.Config(backend="nope").build()
    with pytest.raises(ValueError, match="no DeepSeek-V3 Attention.Config"):
        tt.convert_deepseek_v3(tm.deepseek_v3_config().layers[0].feed_forward)
    with pytest.raises(TypeError, match="model_config"):
        tt.convert_deepseek_v3(object())


@pytest.mark.parametrize("value", ["no", 1, 0, None, 1.0], ids=repr)
def test_quantize_grad_must_be_a_bool(value):
    """Every entry refuses a non-bool, naming the argument or config field, never coercing it."""
    want = rf"quantize_grad: expected a bool, got {type(value).__name__}"
    with pytest.raises(TypeError, match="^" + want):
        tt.convert_deepseek_v3(tm.deepseek_v3_config(), quantize_grad=value)
    with pytest.raises(TypeError, match="^" + want):
        tt.mxmla_attention(tm.deepseek_v3_config().layers[0].attention, quantize_grad=value)
    with pytest.raises(TypeError, match="^MXMLAConverter.Config." + want):
        tt.MXMLAConverter.Config(quantize_grad=value).build()
    cfg = tt.convert_deepseek_v3(tm.deepseek_v3_config(), path="bf16", quantize_grad=False).layers[0].attention
    assert type(cfg) is tt.MXMLAAttention.Config and cfg.quantize_grad is False
    cfg.quantize_grad = value  # a config edited after conversion
    with pytest.raises(TypeError, match="^MXMLAAttention.Config." + want):
        tt.MXMLAAttention(cfg)


def _edit(cfg, fn):
    for layer in cfg.layers:
        fn(layer.attention)
    return cfg


@pytest.mark.parametrize("edit, error, field", [
    (lambda a: setattr(a, "qk_nope_head_dim", 64), ValueError, "qk_nope_head_dim"),
    (lambda a: setattr(a, "v_head_dim", 64), ValueError, "v_head_dim"),
    (lambda a: setattr(a, "rope", CosSinRoPE.Config(dim=64, max_seq_len=128)), TypeError, "rope"),
    (lambda a: setattr(a.wq_b, "bias", True), ValueError, "wq_b.bias"),
    (lambda a: setattr(a.q_norm, "elementwise_affine", False), ValueError, "q_norm.elementwise_affine"),
])
def test_convert_raises_naming_the_field(edit, error, field):
    with pytest.raises(error, match=field) as info:
        tt.convert_deepseek_v3(_edit(tm.deepseek_v3_config(), edit), path="bf16")
    assert "layers.0.attention" in str(info.value)


def test_convert_mxfp8_needs_q_lora_and_dim_multiples_of_32():
    with pytest.raises(ValueError, match="q_lora_rank"):
        tt.convert_deepseek_v3(tm.deepseek_v3_config(q_lora_rank=48), path="mxfp8")
    with pytest.raises(ValueError, match=r"\.dim"):
        tt.convert_deepseek_v3(tm.deepseek_v3_config(q_lora_rank=0, dim=80), path="mxfp8")
    tt.convert_deepseek_v3(tm.deepseek_v3_config(q_lora_rank=48), path="bf16")  # bf16 has no such need


# ---- numerics against stock ----------------------------------------------------------------------

@pytest.mark.parametrize("path", ["bf16", "mxfp8"])
@pytest.mark.parametrize("q_lora_rank", [32, 0])
def test_loss_and_gradients_match_stock_causal(path, q_lora_rank):
    stock, converted = _pair(path, q_lora_rank=q_lora_rank)
    torch.manual_seed(1)
    tokens = torch.randint(0, 128, (B, S))
    positions = torch.arange(S).repeat(B, 1)
    _compare(stock, converted, tokens, positions, tm.causal_block_mask(B, S), path)
    served, fallbacks = _served(converted)
    assert served == 2 and not fallbacks


@pytest.mark.parametrize("path", ["bf16", "mxfp8"])
@pytest.mark.parametrize("masks", ["flex", "varlen"])
def test_packed_documents_match_stock(path, masks):
    inner = VarlenAttention.Config() if masks == "varlen" else None
    cfg = tm.deepseek_v3_config(inner_attention=inner)
    stock_cfg = tm.deepseek_v3_config()  # stock's reference evaluates either mask densely
    stock = tm.build(stock_cfg)
    converted = tm.build(tt.convert_deepseek_v3(cfg, path=path))
    torch.manual_seed(2)
    tokens = torch.randint(0, 128, (B, S))
    positions = tm.packed_positions(B, S, [20, 7, 37])
    if masks == "varlen":
        meta = create_varlen_metadata_for_document(positions)
        ls = _loss(stock, tokens, positions, meta)
        lc = _loss(converted, tokens, positions, meta)
    else:
        mask = tm.document_block_mask(positions)
        ls = _loss(stock, tokens, positions, mask)
        lc = _loss(converted, tokens, positions, mask)
    ls.backward()
    lc.backward()
    assert abs(lc.item() - ls.item()) <= LOSS_BOUND * abs(ls.item())
    for (name, p), pc in zip(stock.named_parameters(), converted.parameters()):
        assert _rel(pc.grad, p.grad) <= GRAD_BOUND[path], name
    served, fallbacks = _served(converted)
    assert served == 2 and not fallbacks


def test_document_cu_seqlens_cut_rows_and_documents():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]])
    cu = tt.document_cu_seqlens(positions, 2, 6)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 6, 8, 12]
    assert tt.document_cu_seqlens(positions, 2, 6) is cu  # one read per positions tensor in eager mode
    positions[1, 0] = 0  # an in-place edit is seen
    assert tt.document_cu_seqlens(positions, 2, 6).tolist() == [0, 3, 5, 6, 8, 12]
    positions[1, 1] = 0
    assert tt.document_cu_seqlens(positions, 2, 6).tolist() == [0, 3, 5, 6, 7, 8, 12]
    torch.library.opcheck(torch.ops.mxmla.titan_document_cu_seqlens, (positions, 2, 6))


@pytest.mark.parametrize("path", ["bf16", "mxfp8"])
def test_adamw_steps_track_stock(path):
    stock, converted = _pair(path, layers=1)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (stock, converted)]
    torch.manual_seed(3)
    seq = 32
    data = torch.randint(0, 128, (10, B, seq))
    positions = torch.arange(seq).repeat(B, 1)
    mask = tm.causal_block_mask(B, seq)
    losses = []
    for tokens in data:
        step = []
        for model, opt in zip((stock, converted), opts):
            opt.zero_grad()
            loss = _loss(model, tokens, positions, mask)
            loss.backward()
            opt.step()
            step.append(loss.item())
        losses.append(step)
    assert losses[-1][0] < losses[0][0]  # stock learns
    for s, c in losses:
        assert abs(c - s) <= 2.0 ** -6 * s, losses  # 2^-6: ten steps compound the per-step 2^-8


# ---- what runs stock ------------------------------------------------------------------------------

def _fallback_case(path, masks, positions, seq=S, inner=None, expect_raise=None, expect_match=None):
    cfg = tm.deepseek_v3_config(inner_attention=inner)
    stock = tm.build(copy.deepcopy(cfg))
    converted = tm.build(tt.convert_deepseek_v3(copy.deepcopy(cfg), path=path))
    tokens = torch.randint(0, 128, (B, seq))
    if expect_raise is not None:
        with pytest.raises(expect_raise, match=expect_match):
            converted(tokens, positions, masks)
        return converted
    with torch.no_grad():
        out_s = stock(tokens, positions, masks)
        out_c = converted(tokens, positions, masks)
    assert torch.equal(out_s, out_c)  # stock's forward, bit for bit
    return converted


@pytest.mark.parametrize("case", ["seq48", "sliding", "no_positions", "window", "none"])
def test_unservable_calls_run_stock_with_a_logged_reason(case, caplog):
    tt._logged.clear()
    positions = torch.arange(S).repeat(B, 1)
    with caplog.at_level(logging.WARNING, logger="mxmla.integrations"):
        if case == "seq48":
            seq = 48
            model = _fallback_case("mxfp8", tm.causal_block_mask(B, seq), torch.arange(seq).repeat(B, 1), seq)
            reason = "not a multiple of 32"
        elif case == "sliding":
            mods = and_masks(get_causal_mask_mod(), get_sliding_window_mask_mod(16))
            mask = create_block_mask(mods, B, None, S, S, device="cpu")
            model = _fallback_case("bf16", mask, positions)
            reason = "cannot map"
        elif case == "no_positions":
            model = _fallback_case("bf16", tm.document_block_mask(tm.packed_positions(B, S, [20])), None)
            reason = "without positions"
        elif case == "window":
            unbuilt = tt.unbuildable(VarlenAttention.Config(window_size=(16, 0)))
            if unbuilt is not None:  # test_builds_and_serves_varlen_without_stocks_kernel covers the converted side
                pytest.skip(f"stock's forward cannot run here: {unbuilt}")
            meta = create_varlen_metadata_for_document(positions)
            # stock's varlen_attn has no CPU kernel: its own error shows stock's forward ran. Torch 2.11's
            # varlen_attn takes no num_splits, which TorchTitan 0.3.0 passes it: that TypeError shows it too.
            old_varlen = "num_splits" not in inspect.signature(varlen_attn).parameters
            model = _fallback_case("bf16", meta, positions, inner=VarlenAttention.Config(window_size=(16, 0)),
                                   expect_raise=TypeError if old_varlen else (NotImplementedError, RuntimeError),
                                   expect_match="num_splits" if old_varlen else None)
            reason = "window_size"
        else:
            model = _fallback_case("bf16", None, positions, expect_raise=(AssertionError, TypeError))
            reason = "None"
    served, fallbacks = _served(model)
    # both layers fell back (one where stock's forward raised at the first layer)
    assert served == 0 and sum(fallbacks.values()) == (1 if case in ("window", "none") else 2)
    assert len(fallbacks) == 1 and reason in next(iter(fallbacks))
    logged = [r for r in caplog.records if r.name == "mxmla.integrations"]
    assert len(logged) == 1 and reason in logged[0].getMessage()  # once per reason, not per layer


def _without_stock_varlen_kernel(monkeypatch):
    """What TorchTitan's VarlenAttention meets on a Hopper GPU without FlashAttention 3, on any machine:
    it asks for "FA3" and activating it fails importing FA3's package."""
    import torchtitan.models.common.attention as attention
    import torchtitan.tools.utils as utils

    def activate(impl):
        raise ModuleNotFoundError("No module named 'flash_attn_interface'", name="flash_attn_interface")

    monkeypatch.setattr(utils, "get_cuda_flash_attention_impl", lambda: "FA3")
    monkeypatch.setattr(attention, "current_flash_attention_impl", lambda: None)
    monkeypatch.setattr(attention, "activate_flash_attention_impl", activate)


def test_builds_and_serves_varlen_without_stocks_kernel(monkeypatch, caplog):
    """Where stock's VarlenAttention cannot be built, the converted model builds (logged once, naming the
    package), serves VarlenMetadata exactly as where it can, and raises naming the package and the
    setting for a call it would hand to stock's forward."""
    cfg = tm.deepseek_v3_config(inner_attention=VarlenAttention.Config())
    served_cfg = tt.convert_deepseek_v3(copy.deepcopy(cfg), path="bf16")
    reference = tm.build(copy.deepcopy(served_cfg))  # as this machine builds it
    _without_stock_varlen_kernel(monkeypatch)
    assert "flash_attn_interface" in tt.unbuildable(VarlenAttention.Config())
    with pytest.raises(ModuleNotFoundError, match="flash_attn_interface"):
        tm.build(copy.deepcopy(cfg))  # stock cannot build
    tt._logged.clear()
    caplog.clear()  # where this machine lacks the package too, the reference build above logged already
    with caplog.at_level(logging.WARNING, logger="mxmla.integrations"):
        converted = tm.build(copy.deepcopy(served_cfg))
        windowed = tm.build(tt.convert_deepseek_v3(tm.deepseek_v3_config(
            inner_attention=VarlenAttention.Config(window_size=(16, 0))), path="bf16"))
    logged = [r.getMessage() for r in caplog.records if r.name == "mxmla.integrations"]
    assert len(logged) == 1 and "flash_attn_interface" in logged[0]  # once, not per layer or model
    attn = converted.layers["0"].attention
    assert isinstance(attn.inner_attention, VarlenAttention) and "flash_attn_interface" in attn.stock_unbuilt
    assert list(converted.state_dict()) == list(reference.state_dict())
    tokens = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(9))
    positions = tm.packed_positions(B, S, [20, 7, 37])
    meta = create_varlen_metadata_for_document(positions)
    with torch.no_grad():
        assert torch.equal(converted(tokens, positions, meta), reference(tokens, positions, meta))
    assert _served(converted) == (2, Counter())
    with pytest.raises(RuntimeError, match=r"window_size \(16, 0\).*'flash_attn_interface'"):
        windowed(tokens, positions, meta)
    with pytest.raises(RuntimeError, match=r"attention_masks: None.*'flash_attn_interface'"):
        converted(tokens, positions, None)
    assert _served(windowed) == (0, Counter())  # nothing ran stock's forward


def test_context_parallel_runs_stock():
    cfg = tm.deepseek_v3_config()
    converted = tm.build(tt.convert_deepseek_v3(cfg, path="bf16"))
    for block in converted.layers.values():
        block.attention._context_parallel = True
    tokens = torch.randint(0, 128, (B, S))
    with torch.no_grad():
        converted(tokens, torch.arange(S).repeat(B, 1), tm.causal_block_mask(B, S))
    served, fallbacks = _served(converted)
    assert served == 0 and "context parallelism" in next(iter(fallbacks))


# ---- compile per block, activation checkpointing --------------------------------------------------

def _grads(model, tokens, positions, masks):
    loss = _loss(model, tokens, positions, masks)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("path", ["bf16", "mxfp8"])
def test_compile_per_block_fullgraph_matches_eager_without_recompiles(path):
    """TorchTitan's apply_compile: every block compiled with fullgraph=True (aot_eager: dynamo and AOT
    autograd trace the block as on a GPU, without Inductor's CPU code generation)."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile

    cfg = tt.convert_deepseek_v3(tm.deepseek_v3_config(), path=path)
    eager, compiled = tm.build(copy.deepcopy(cfg)), tm.build(copy.deepcopy(cfg))
    apply_compile(compiled, compile_config=CompileConfig(enable=True, backend="aot_eager"),
                  parallel_dims=_single_dims())
    torch.manual_seed(4)
    tokens = torch.randint(0, 128, (B, S))
    cases = [(torch.arange(S).repeat(B, 1), tm.causal_block_mask(B, S))]
    positions = tm.packed_positions(B, S, [20, 7, 37])
    cases.append((positions, tm.document_block_mask(positions)))
    torch._dynamo.reset()
    try:
        for i, (pos, mask) in enumerate(cases * 2):
            if i == len(cases):
                torch.compiler.set_stance("fail_on_recompile")  # the second round reuses every graph
            for model in (eager, compiled):
                model.zero_grad()
            le, ge = _grads(eager, tokens, pos, mask)
            lc, gc = _grads(compiled, tokens, pos, mask)
            assert abs(lc.item() - le.item()) <= 1e-5 * abs(le.item())
            for name in ge:
                assert _rel(gc[name], ge[name]) <= 1e-5, name  # the same ops; fp32 reassociation only
    finally:
        torch.compiler.set_stance("default")
    served, fallbacks = _served(compiled)
    assert not fallbacks


@pytest.mark.parametrize("path", ["mxfp8"])
def test_compile_varlen_documents_of_varying_counts(path):
    """VarlenMetadata's cu_seq_q changes length with the number of documents: after dynamo's one
    recompile to a dynamic size, no recompile; the same gradients as eager."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile

    cfg = tt.convert_deepseek_v3(tm.deepseek_v3_config(inner_attention=VarlenAttention.Config()), path=path)
    eager, compiled = tm.build(copy.deepcopy(cfg)), tm.build(copy.deepcopy(cfg))
    apply_compile(compiled, compile_config=CompileConfig(enable=True, backend="aot_eager"),
                  parallel_dims=_single_dims())
    tokens = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(6))
    torch._dynamo.reset()
    try:
        for i, lengths in enumerate(([20, 7, 37], [64], [10, 10, 10, 34], [5, 59], [1, 63, 32])):
            if i == 2:
                torch.compiler.set_stance("fail_on_recompile")
            positions = tm.packed_positions(B, S, lengths)
            meta = create_varlen_metadata_for_document(positions)
            for model in (eager, compiled):
                model.zero_grad()
            le, ge = _grads(eager, tokens, positions, meta)
            lc, gc = _grads(compiled, tokens, positions, meta)
            assert abs(lc.item() - le.item()) <= 1e-5 * abs(le.item())
            assert all(_rel(gc[n], ge[n]) <= 1e-5 for n in ge)
    finally:
        torch.compiler.set_stance("default")


def _single_dims():
    from torchtitan.distributed import ParallelDims

    return ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)


def _count_attention_calls(monkeypatch):
    import dispatch

    calls = Counter()
    real = dispatch.run

    def counting(op, *args, **kwargs):
        calls[op] += 1
        return real(op, *args, **kwargs)

    monkeypatch.setattr(dispatch, "run", counting)
    return calls


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_gradients(policy, monkeypatch):
    from torchtitan.distributed.activation_checkpoint import FullAC

    cfg = tt.convert_deepseek_v3(tm.deepseek_v3_config(), path="mxfp8")
    plain, checkpointed = tm.build(copy.deepcopy(cfg)), tm.build(copy.deepcopy(cfg))
    ac = FullAC.Config() if policy == "full" else tt.MXMLASelectiveAC.Config()
    ac.build().apply(checkpointed)
    torch.manual_seed(5)
    tokens = torch.randint(0, 128, (B, S))
    positions = torch.arange(S).repeat(B, 1)
    mask = tm.causal_block_mask(B, S)
    lp, gp = _grads(plain, tokens, positions, mask)
    calls = _count_attention_calls(monkeypatch)
    lc, gc = _grads(checkpointed, tokens, positions, mask)
    gc = {name.replace("._checkpoint_wrapped_module", ""): g for name, g in gc.items()}
    assert lc.item() == lp.item() and gc.keys() == gp.keys()
    for name in gp:
        assert torch.equal(gc[name], gp[name]), name  # recomputation reproduces the forward exactly
    # full AC recomputes both layers' attention; selective AC saves it (mxmla_save_ops)
    assert calls["mla_attention"] == (4 if policy == "full" else 2)
    assert calls["mla_q_uproj_rope_quant"] == (4 if policy == "full" else 2)


def test_selective_ac_save_list_has_mxmla_ops():
    saved = tt.MXMLASelectiveAC.Config().build().get_save_ops()
    assert torch.ops.mxmla.mla_attention.default in saved
    assert torch.ops.mxmla.mla_q_uproj_rope_quant.default in saved
    assert torch.ops.aten.linear.default in saved  # TorchTitan's own list kept


# ---- FSDP2 on 2 gloo ranks -------------------------------------------------------------------------

def _fsdp_rank(rank, world, path, steps, micro):
    """fully_shard per block and at the root (bf16 params, fp32 reduce), as TorchTitan's FSDP2; each
    rank runs half of every microbatch; gradient accumulation over `micro` microbatches per step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import dispatch.weights as dw
    from tests import parallel_spawn

    torch.manual_seed(0)
    cfg = tt.convert_deepseek_v3(tm.deepseek_v3_config(), path=path)
    reference = tm.build(copy.deepcopy(cfg))  # one process, the whole batch, bf16 parameters
    for p in reference.parameters():  # parameters only: Module.to(dtype) would drop the complex RoPE cache's
        p.data = p.data.to(torch.bfloat16)  # imaginary part
    model = tm.build(copy.deepcopy(cfg))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # a CPU mesh: fully_shard's default mesh takes the accelerator where there is one and moves the shards there
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (as TorchTitan on gloo)

    quantized = []
    real_quantize = dw.MXFP8Weight.quantize.__func__

    def counting(cls, w, backend=None, rows=None):
        quantized.append(tuple(w.shape))
        return real_quantize(cls, w, backend, rows)

    dw.MXFP8Weight.quantize = classmethod(counting)
    stale = []

    def check_copy(module, args, out):  # the copy this forward used against a fresh quantization
        w = module.wq_b.weight
        entry = dw.cached_copy(w)
        if entry is not None:
            fresh = real_quantize(dw.MXFP8Weight, w)
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in
                       ((entry.row.data, fresh.row.data), (entry.row.scale, fresh.row.scale),
                        (entry.col.data, fresh.col.data), (entry.col.scale, fresh.col.scale)))
            stale.append(not same)

    for m in model.modules():
        if isinstance(m, tt.MXMLAAttention):
            m.register_forward_hook(check_copy)
    data = torch.randint(0, 128, (steps, micro, B, S), generator=torch.Generator().manual_seed(7))
    local = B // world
    ref_grads = {}
    for tokens in data[0]:  # step 0's microbatches in one process, the whole batch
        (_loss(reference, tokens, torch.arange(S).repeat(B, 1), tm.causal_block_mask(B, S)) / micro).backward()
    ref_grads = {n: p.grad.float() for n, p in reference.named_parameters()}
    positions = torch.arange(S).repeat(local, 1)
    mask = tm.causal_block_mask(local, S)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    results = {"losses": [], "quantized_per_step": []}
    for step in range(steps):
        before = len(quantized)
        for tokens in data[step]:
            loss = _loss(model, tokens[rank * local:(rank + 1) * local], positions, mask) / micro
            loss.backward()
            results["losses"].append(loss.item() * micro)
        if step == 0:
            grads = {n: p.grad.full_tensor().float() for n, p in model.named_parameters()}
            results["grad_errors"] = {n: _rel(grads[n], ref_grads[n]) for n in grads}
        opt.step()
        opt.zero_grad()
        results["quantized_per_step"].append(len(quantized) - before)
    model.load_state_dict(initial)  # a write outside the optimizer: the next forward's copy is still fresh
    _loss(model, data[0, 0, rank * local:(rank + 1) * local], positions, mask).backward()
    results["stale"] = stale
    return results


@pytest.mark.parametrize("path", ["bf16", "mxfp8"])
def test_fsdp2_two_ranks_match_one_process_and_copies_stay_fresh(path):
    from tests import parallel_spawn

    steps, micro = 3, 2
    per_rank = parallel_spawn.run_ranks(_fsdp_rank, 2, path, steps, micro, timeout=240)
    for results in per_rank:
        bad = {n: e for n, e in results["grad_errors"].items() if e > GRAD_BOUND["bf16"]}
        assert not bad, bad  # bf16 params on both sides: the bf16 bound
        if path == "mxfp8":  # every forward's copy equals a fresh quantization of the gathered weight
            assert len(results["stale"]) == 2 * (steps * micro + 1) and not any(results["stale"])
        # q's weight copy: once per layer per optimizer step, not per microbatch (the gathered weight
        # lands in new storage at every all-gather; the copy is keyed on the sharded parameter)
        if path == "mxfp8":
            assert results["quantized_per_step"] == [2] * steps, results["quantized_per_step"]


# ---- tensor parallelism on 2 gloo ranks -----------------------------------------------------------

def _tp_rank(rank, world, backend, path, sequence_parallel):
    """Stock and converted under TorchTitan's TP (Module.parallelize with the DeepSeek-V3 sharding
    configs: wq_b / wkv_b colwise, wo rowwise), the same inputs on both ranks."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    parallel_dims_module.device_type = "cpu"  # TorchTitan builds its meshes on "cuda" when it finds no GPU
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1, world_size=world,
                        spmd_backend=backend)
    dims.build_mesh()
    handed = []  # what the converted layers hand mla_attention as cu_seqlens
    real_attention = tt.mxag.mla_attention

    def recording(*args, **kwargs):
        handed.append(type(kwargs["cu_seqlens_q"]).__name__)
        return real_attention(*args, **kwargs)

    tt.mxag.mla_attention = recording
    cfg = tm.deepseek_v3_config(heads=4)
    models = []
    for c in (copy.deepcopy(cfg), tt.convert_deepseek_v3(copy.deepcopy(cfg), path=path)):
        set_deepseek_v3_sharding_config(c, enable_sp=sequence_parallel, enable_ep=False)
        if backend == "spmd_types":
            c.lm_head.sharding_config = None  # full logits on every rank, for the plain loss below
        model = tm.build(c)
        model.parallelize(dims)
        models.append(model)
    torch.manual_seed(1)
    tokens = torch.randint(0, 128, (B, S))
    positions = tm.packed_positions(B, S, [40, 24])
    mask = tm.document_block_mask(positions)
    losses = []
    for model in models:
        logits = model(tokens, positions, mask)
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        losses.append(loss.item())
    local = lambda g: g.to_local() if hasattr(g, "to_local") else g  # noqa: E731
    errors = {n: _rel(local(pc.grad), local(p.grad))
              for (n, p), pc in zip(models[0].named_parameters(), models[1].parameters())}
    attn = models[1].layers["0"].attention
    return {"losses": losses, "errors": errors, "served": attn.mxmla_served, "fallbacks": dict(attn.mxmla_fallbacks),
            "local_rows": tuple(local(attn.wq_b.weight).shape), "cu_seqlens": handed}


@pytest.mark.parametrize("backend, path, sequence_parallel", [
    ("spmd_types", "mxfp8", False), ("partial_dtensor", "mxfp8", False), ("partial_dtensor", "bf16", True)])
def test_tensor_parallel_two_ranks_matches_stock(backend, path, sequence_parallel):
    from tests import parallel_spawn

    per_rank = parallel_spawn.run_ranks(_tp_rank, 2, backend, path, sequence_parallel, timeout=240)
    for results in per_rank:
        stock, converted = results["losses"]
        assert abs(converted - stock) <= LOSS_BOUND * stock
        bad = {n: e for n, e in results["errors"].items() if e > GRAD_BOUND[path]}
        assert not bad, bad
        assert results["served"] == 1 and not results["fallbacks"]
        assert results["local_rows"] == (2 * 192, 32)  # each rank ran its own 2 of the 4 heads
        assert results["cu_seqlens"] == ["Tensor", "Tensor"]  # local cu_seqlens, never a DTensor


# ---- the GPU benchmark's smoke mode ---------------------------------------------------------------

def test_titan_block_benchmark_smoke(tmp_path):
    """benchmarks/titan_block.py --smoke: the whole script (compile per block, FSDP2 on one rank, the
    eager served check, training in turns, timing in turns) on tiny shapes on the CPU."""
    import json
    import os
    import subprocess
    import sys

    from tests.util import subprocess_env

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "titan_block.json"
    env = subprocess_env(repo)  # the PYTHONPATH set is kept: it may hold torchtitan
    proc = subprocess.run([sys.executable, os.path.join(repo, "benchmarks", "titan_block.py"), "--smoke", "--out",
                           str(out)], cwd=repo, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["check"] == {"served": 2, "fallbacks": {}}
    assert res["train"]["within_2pct"] and len(res["train"]["losses"]["mxfp8"]) == 3
    assert set(res["timing"]) == {"stock", "mxfp8"}
    assert "within 2 %: yes" in proc.stdout


def test_titan_block_documents_mask_is_torchtitans():
    """The GPU run's --mask documents: Decoder.get_attention_masks' BlockMask where torch takes its
    separate_full_blocks; on torch 2.11 (which lacks it) the tests' document_block_mask, which must build
    the same blocks (checked against TorchTitan's where both build)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import titan_block

    from torchtitan.models.common.attention import FlexAttention

    model = tm.build(tm.deepseek_v3_config(inner_attention=FlexAttention.Config()))
    positions = tm.packed_positions(B, 512, [300, 212, 64])
    mask, built_by = titan_block._mask(titan_block.parse_args(["--seq", "512", "--batch", str(B)]), model, positions)
    ours = tm.document_block_mask(positions)
    takes_it = "separate_full_blocks" in inspect.signature(create_block_mask).parameters
    assert built_by.startswith("Decoder.get_attention_masks" if takes_it else "tests.titan_models.document_block_mask")
    fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
              "full_q_num_blocks", "full_q_indices")
    assert mask.BLOCK_SIZE == ours.BLOCK_SIZE and mask.shape == ours.shape
    assert all(torch.equal(getattr(mask, f), getattr(ours, f)) for f in fields)
    assert ours.full_kv_num_blocks is not None and ours.full_kv_num_blocks.sum() > 0  # full blocks kept apart


def test_weights_adopt_makes_an_entry_current_for_new_storage():
    import dispatch.weights as dw

    w = torch.randn(64, 32)
    entry = dw.MXFP8Weight.quantize(w)
    moved = w.clone()  # the same values in new storage: the cache's own key would re-quantize
    assert dw.cached_copy(moved) is None
    dw.adopt(moved, entry)
    reused = dw.cached_copy(moved)
    assert reused is not None and reused.row.data is entry.row.data and reused.col.scale is entry.col.scale
    with pytest.raises(ValueError, match="entry"):
        dw.adopt(torch.randn(32, 64), entry)
    dw.invalidate(moved)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_activation_checkpointing_then_compile_as_torchtitan_orders_them(policy):
    """TorchTitan's parallelize order: activation checkpointing, then compile per block (fullgraph)."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.distributed.compile import apply_compile

    cfg = tt.convert_deepseek_v3(tm.deepseek_v3_config(), path="mxfp8")
    plain, wrapped = tm.build(copy.deepcopy(cfg)), tm.build(copy.deepcopy(cfg))
    (FullAC.Config() if policy == "full" else tt.MXMLASelectiveAC.Config()).build().apply(wrapped)
    apply_compile(wrapped, compile_config=CompileConfig(enable=True, backend="aot_eager"), parallel_dims=_single_dims())
    tokens = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(8))
    positions = torch.arange(S).repeat(B, 1)
    mask = tm.causal_block_mask(B, S)
    lp, gp = _grads(plain, tokens, positions, mask)
    lw, gw = _grads(wrapped, tokens, positions, mask)
    gw = {n.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""): g for n, g in gw.items()}
    assert abs(lw.item() - lp.item()) <= 1e-5 * abs(lp.item())
    assert all(_rel(gw[n], gp[n]) <= 1e-5 for n in gp)
