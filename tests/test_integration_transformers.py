"""patch_deepseek_v3 on tiny random-init HF DeepseekV3 models (CPU, torch backend, nothing downloaded).

The configs keep DeepSeek-V3's head dims (qk_nope 128 + qk_rope 64, v 128) with hidden 256, 2 heads,
q_lora 64, kv_lora 64, 2 dense layers and a vocabulary of 128. initializer_range 0.1: HF's default 0.02
makes the attention scores so small that attention is nearly uniform and RoPE hardly matters; at 0.1
the scaled scores have an RMS just under 1 (checked in `test_reference_scores_are_order_one`), and a
wrong RoPE style or softmax scale moves the attention outputs past twice the mxfp8 bound
(`test_bounds_see_a_wrong_rope_style_and_scale`).

Error bounds (relative Frobenius norm of the difference to the unpatched model, which runs in fp32),
first order, independent rounding errors adding in quadrature:
- bf16 path: every bf16 rounding is at most 2^-8 relative (half an ulp of an 8-bit significand).
  Per layer the path rounds the Q GEMM's input and weight, q, k, v and o (6); over 2 layers
  eps_bf16 = sqrt(12) * 2^-8 = 0.0135. The backward adds the bf16 dq, dk, dv, do (4 per layer):
  eps_bf16_grad = sqrt(20) * 2^-8 = 0.0175.
- mxfp8 path: every e4m3 quantization is at most 2^-4 relative (half an ulp of a 4-bit significand,
  for values within e4m3's normal range of their block's scale). Per layer the path quantizes y =
  RMSNorm(c_q), w_q_b, q, k, v (5) and rounds o to bf16 (negligible next to 2^-4); over 2 layers
  eps_mx = sqrt(10) * 2^-4 = 0.198. The MXFP8 backward quantizes the fused op's incoming gradient
  twice more per layer: eps_mx_grad = sqrt(14) * 2^-4 = 0.234.
- Why the softmax adds no factor: a relative score error e changes the softmax weights by about
  e * (s - mean s), so the attention output's error from q and k is at most their rounding times the
  scores' spread, which is <= 1 here (RMS of the scaled scores < 1, asserted).
Logits and each layer's attention output: rel error <= eps. Gradients: cosine >= sqrt(1 - eps_grad^2)
(a vector within eps of another is within that angle) and | |g| / |g_ref| - 1 | <= eps_grad.
Training: 20 AdamW steps, each loss within eps (relative) of the unpatched model's loss at that step.

transformers is not in the `.[test]` extra (`pip install transformers` took 100 s in a fresh venv
here): without it this file skips.
"""
from __future__ import annotations

import copy
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf  # noqa: E402

import dispatch  # noqa: E402
from dispatch.integrations.transformers import patch_deepseek_v3, patch_state, unpatch_deepseek_v3  # noqa: E402
from tests.util import assert_bytes_equal  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EPS_BF16, EPS_BF16_GRAD = math.sqrt(12) * 2 ** -8, math.sqrt(20) * 2 ** -8
EPS_MX, EPS_MX_GRAD = math.sqrt(10) * 2 ** -4, math.sqrt(14) * 2 ** -4
EPS = {"bf16": EPS_BF16, "mxfp8": EPS_MX}
EPS_GRAD = {"bf16": EPS_BF16_GRAD, "mxfp8": EPS_MX_GRAD}
ATTN_WEIGHTS = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                "o_proj")
BATCH, SEQ, VOCAB = 2, 64, 128


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on the shared 2-core CI machine a 2-thread op waits for its slower half
    whenever the other core is busy, which made these small ops 10-20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_config(**overrides) -> DeepseekV3Config:
    kw = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=2, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=128,
              qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=4, n_group=1, topk_group=1,
              num_experts_per_tok=2, first_k_dense_replace=2, max_position_embeddings=512, use_cache=False,
              initializer_range=0.1)
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def tiny_model(seed=0, dtype=torch.float32, attn_implementation="sdpa", **overrides):
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM._from_config(tiny_config(**overrides), attn_implementation=attn_implementation)
    return model.to(dtype)


def token_ids(seed=1, batch=BATCH, seq=SEQ):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def patched(model, path, **kw):
    return patch_deepseek_v3(copy.deepcopy(model), path=path, backend="torch", **kw)


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


def attention_outputs(model, ids, **kw):
    """Logits and every DeepseekV3Attention's output, in layer order."""
    outs = []
    hooks = [m.register_forward_hook(lambda mod, args, out: outs.append(out[0].detach()))
             for m in model.modules() if isinstance(m, hf.DeepseekV3Attention)]
    try:
        return logits(model, ids, **kw), outs
    finally:
        for h in hooks:
            h.remove()


def assert_served(model, calls=None):
    state = patch_state(model)
    assert not state.fallbacks, f"unexpected fallbacks: {dict(state.fallbacks)}"
    assert state.served >= (calls or 1)


# --------------------------------------------------------------------------------------------------
# RoPE mapping: HF's formulas against mxmla's styles, bit for bit in fp32
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("interleave, style", [(True, "mla"), (False, "neox")])
def test_hf_rope_is_the_mxmla_style_bitwise_in_fp32(interleave, style):
    """HF rounds q*cos, q*sin and their sum each once in fp32 (eager, no FMA), as spec.rope does."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(BATCH, 2, SEQ, 64, generator=gen) * torch.exp2(torch.randint(-8, 9, (BATCH, 2, SEQ, 1),
                                                                                generator=gen).float())
    k = torch.randn(BATCH, 1, SEQ, 64, generator=gen)
    rotary = hf.DeepseekV3RotaryEmbedding(tiny_config())
    position_ids = torch.arange(SEQ)[None].expand(BATCH, SEQ) + torch.tensor([[0], [300]])
    cos, sin = rotary(q, position_ids)                                    # [B, S, 64] cat([f, f])
    apply = hf.apply_rotary_pos_emb_interleave if interleave else hf.apply_rotary_pos_emb
    want_q, want_k = apply(q, k, cos, sin)
    cos_t, sin_t = cos.reshape(-1, 64), sin.reshape(-1, 64)
    for x, want in ((q, want_q), (k, want_k)):
        tokens = x.transpose(1, 2).reshape(BATCH * SEQ, x.shape[1], 64)  # [T, H, 64], row t = token t
        got = dispatch.run("rope", tokens, cos_t, sin_t, style=style, layout="thd", backend="torch")
        assert_bytes_equal(got, want.transpose(1, 2).reshape(BATCH * SEQ, x.shape[1], 64), f"{style} rope")


# --------------------------------------------------------------------------------------------------
# Logits and attention outputs against the unpatched model
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["bf16", "mxfp8"])
@pytest.mark.parametrize("interleave", [True, False])
def test_logits_match_unpatched(path, interleave):
    ref = tiny_model(rope_interleave=interleave).eval()
    ids = token_ids()
    want, want_attn = attention_outputs(ref, ids)
    model = patched(ref, path)
    got, got_attn = attention_outputs(model, ids)
    assert_served(model, calls=2)
    assert rel(got, want) <= EPS[path]
    for i, (g, w) in enumerate(zip(got_attn, want_attn)):
        assert rel(g, w) <= EPS[path], f"layer {i} attention output"


def test_reference_scores_are_order_one():
    """The premise of the bounds: the unpatched model's scaled attention scores have RMS <= 1."""
    ref = tiny_model().eval()
    sdpa = hf.ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)
    rms = []

    def spy(module, q, k, v, mask, scaling, **kw):
        rms.append(float(((q.float() @ k.float().transpose(-1, -2)) * scaling).square().mean().sqrt()))
        return sdpa(module, q, k, v, mask, scaling=scaling, **kw)

    hf.ALL_ATTENTION_FUNCTIONS["sdpa"] = spy
    try:
        logits(ref, token_ids())
    finally:
        hf.ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    assert len(rms) == 2 and max(rms) <= 1.0 and min(rms) > 0.5, rms


def test_bounds_see_a_wrong_rope_style_and_scale():
    """The tests above would fail if the style or the softmax scale were wrong: swapping them moves
    the attention outputs by far more than the mxfp8 bound."""
    ids = token_ids()
    ref = tiny_model(rope_interleave=True).eval()
    _, want = attention_outputs(ref, ids)
    other = tiny_model(rope_interleave=False).eval()  # same weights (same seed), the other style
    _, swapped = attention_outputs(other, ids)
    assert rel(swapped[0], want[0]) > 2 * EPS_MX
    scaled = copy.deepcopy(ref)
    for m in scaled.modules():  # the factor yarn's mscale^2 (factor 40) applies: forgetting it is this error
        if isinstance(m, hf.DeepseekV3Attention):
            m.scaling *= (0.1 * math.log(40.0) + 1.0) ** 2
    _, rescaled = attention_outputs(scaled, ids)
    assert rel(rescaled[0], want[0]) > 2 * EPS_MX


@pytest.mark.parametrize("path", ["bf16", "mxfp8"])
def test_yarn_mscale_reaches_the_softmax_scale(path, monkeypatch):
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0}
    ref = tiny_model(rope_parameters=rope).eval()
    attn = ref.model.layers[0].self_attn
    mscale = 0.1 * math.log(40.0) + 1.0
    assert attn.scaling == pytest.approx(192 ** -0.5 * mscale ** 2)
    ids = token_ids()
    want = logits(ref, ids)
    model = patched(ref, path)
    scales = []
    real_run = dispatch.run

    def spy(op, *args, **kw):
        if op == "mla_attention":
            scales.append(kw["softmax_scale"])
        return real_run(op, *args, **kw)

    monkeypatch.setattr(dispatch, "run", spy)
    got = logits(model, ids)
    assert scales and all(s == attn.scaling for s in scales)
    assert rel(got, want) <= EPS[path]


@pytest.mark.parametrize("path", ["bf16", "mxfp8"])
def test_position_ids_with_offsets(path):
    ref = tiny_model().eval()
    ids = token_ids()
    position_ids = torch.arange(SEQ)[None].expand(BATCH, SEQ) + torch.tensor([[17], [250]])
    want = logits(ref, ids, position_ids=position_ids)
    model = patched(ref, path)
    got = logits(model, ids, position_ids=position_ids)
    assert_served(model)
    assert rel(got, want) <= EPS[path]


@pytest.mark.parametrize("path", ["bf16", "mxfp8"])
def test_per_token_cos_sin_reach_the_attention(path):
    """RoPE is relative, so a constant offset changes only round-off; HF reads any other jump in
    position_ids as packed sequences (next test). The attention module itself takes per-token cos /
    sin: with a stride of 2 in the second sequence its output changes, patched and unpatched alike."""
    ref = tiny_model().eval()
    model = patched(ref, path)
    h = torch.randn(BATCH, SEQ, 256, generator=torch.Generator().manual_seed(6))
    position_ids = torch.stack([torch.arange(SEQ) + 17, 2 * torch.arange(SEQ) + 250])
    pe = model.model.rotary_emb(h, position_ids)
    pe_default = model.model.rotary_emb(h, torch.arange(SEQ)[None])
    with torch.no_grad():
        got = model.model.layers[0].self_attn(h, position_embeddings=pe, attention_mask=None)[0]
        want = ref.model.layers[0].self_attn(h, position_embeddings=pe, attention_mask=None)[0]
        default = ref.model.layers[0].self_attn(h, position_embeddings=pe_default, attention_mask=None)[0]
    assert_served(model)
    assert rel(got, want) <= EPS[path]
    assert rel(default[1], want[1]) > 2 * EPS[path]


def test_packed_position_ids_fall_back(caplog):
    """position_ids restarting inside a row are packed sequences to HF (a block-diagonal mask)."""
    ref = tiny_model().eval()
    position_ids = torch.cat([torch.arange(SEQ // 2), torch.arange(SEQ // 2)])[None].expand(BATCH, SEQ)
    _falls_back(ref, patched(ref, "bf16"), caplog, "not the plain causal mask", position_ids=position_ids)


@pytest.mark.parametrize("path", ["bf16", "mxfp8"])
def test_bf16_weights(path):
    """A bf16 model: the unpatched model rounds its RoPE and attention in bf16 too; the bound holds."""
    ref = tiny_model(dtype=torch.bfloat16).eval()
    ids = token_ids()
    want = tiny_model().eval()  # the same weights in fp32: the reference for both bf16 models
    want_logits = logits(want, ids)
    model = patched(ref, path)
    got = logits(model, ids)
    assert got.dtype == torch.bfloat16
    assert_served(model)
    hf_bf16_err = rel(logits(ref, ids), want_logits)
    assert rel(got, want_logits) <= EPS[path] + hf_bf16_err


@pytest.mark.parametrize("path", ["bf16", "mxfp8"])
def test_q_lora_rank_none_uses_q_proj(path):
    ref = tiny_model(q_lora_rank=None).eval()
    ids = token_ids()
    want = logits(ref, ids)
    model = patched(ref, path)
    got = logits(model, ids)
    assert_served(model)
    assert rel(got, want) <= EPS[path]


def test_eager_float_causal_mask_and_bool_causal_mask_are_served():
    ref = tiny_model(attn_implementation="eager").eval()
    ids = token_ids()
    want = logits(ref, ids)
    model = patched(ref, "bf16")
    got = logits(model, ids)  # HF's eager path passes a float 0 / finfo.min causal mask
    assert_served(model, calls=2)
    assert rel(got, want) <= EPS_BF16
    # a bool lower-triangle mask (sdpa's convention: True attends) handed to the attention module
    ref = tiny_model().eval()
    model = patched(ref, "bf16")
    attn = model.model.layers[0].self_attn
    h = torch.randn(BATCH, SEQ, 256, generator=torch.Generator().manual_seed(3))
    cos, sin = model.model.rotary_emb(h, torch.arange(SEQ)[None])
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None, None].expand(BATCH, 1, SEQ, SEQ)
    with torch.no_grad():
        out, weights = attn(h, position_embeddings=(cos, sin), attention_mask=mask)
        ref_out, _ = ref.model.layers[0].self_attn(h, position_embeddings=(cos, sin), attention_mask=mask)
    assert weights is None and not patch_state(model).fallbacks
    assert rel(out, ref_out) <= EPS_BF16


# --------------------------------------------------------------------------------------------------
# Gradients and training
# --------------------------------------------------------------------------------------------------

def _loss(model, ids):
    out = model(ids).logits
    return torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


@pytest.mark.parametrize("path", ["bf16", "mxfp8"])
def test_gradients_of_every_attention_weight(path):
    ref = tiny_model().train()
    model = patched(ref, path).train()
    ids = token_ids()
    _loss(ref, ids).backward()
    _loss(model, ids).backward()
    assert_served(model)
    eps = EPS_GRAD[path]
    min_cos = math.sqrt(1 - eps ** 2)
    named = dict(model.named_parameters())
    checked = 0
    for name, p_ref in ref.named_parameters():
        if ".self_attn." not in name:
            continue
        assert name.split(".self_attn.")[1].split(".")[0] in ATTN_WEIGHTS
        g, g_ref = named[name].grad.double().flatten(), p_ref.grad.double().flatten()
        cos = float(torch.nn.functional.cosine_similarity(g, g_ref, dim=0))
        assert cos >= min_cos, f"{name}: cosine {cos:.5f} < {min_cos:.5f}"
        assert abs(float(g.norm() / g_ref.norm()) - 1) <= eps, f"{name}: norm ratio"
        checked += 1
    assert checked == 2 * len(ATTN_WEIGHTS)


def _train(model, steps, seed=4):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    losses = []
    for step in range(steps):
        ids = token_ids(seed=seed * 1000 + step)
        loss = _loss(model, ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("path", ["bf16", "mxfp8"])
def test_twenty_adamw_steps_track_the_unpatched_losses(path):
    ref = tiny_model().train()
    model = patched(ref, path).train()
    want = _train(ref, 20)
    got = _train(model, 20)
    assert_served(model, calls=40)
    assert want[-1] < want[0]  # it learns something
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= EPS[path] * w, f"step {step}: loss {g} vs unpatched {w}"


# --------------------------------------------------------------------------------------------------
# What the path cannot serve: HF's forward, with a logged reason
# --------------------------------------------------------------------------------------------------

def _falls_back(ref, model, caplog, fragment, **kw):
    ids = kw.pop("ids", token_ids())
    caplog.set_level(logging.WARNING, logger="mxmla.integrations")
    got = logits(model, ids, **kw)
    want = logits(ref, ids, **kw)
    assert_bytes_equal(got, want, "HF's own forward ran")  # the whole forward fell back
    state = patch_state(model)
    assert state.served == 0 and any(fragment in r for r in state.fallbacks), dict(state.fallbacks)
    assert any(fragment in rec.getMessage() for rec in caplog.records if rec.name == "mxmla.integrations")


def test_padding_mask_falls_back(caplog):
    ref = tiny_model().eval()
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, :5] = 0
    _falls_back(ref, patched(ref, "mxfp8"), caplog, "attention_mask: not the plain causal mask",
                attention_mask=mask)


def test_all_ones_mask_is_served():
    ref = tiny_model().eval()
    model = patched(ref, "bf16")
    ids = token_ids()
    ones = torch.ones(BATCH, SEQ, dtype=torch.long)
    assert rel(logits(model, ids, attention_mask=ones), logits(ref, ids, attention_mask=ones)) <= EPS_BF16
    assert_served(model)


def test_sequence_length_not_a_multiple_of_32_falls_back_on_mxfp8(caplog):
    ref = tiny_model().eval()
    _falls_back(ref, patched(ref, "mxfp8"), caplog, "not a multiple of 32", ids=token_ids(seq=40))


def test_attention_dropout_in_training_falls_back(caplog):
    ref = tiny_model(attention_dropout=0.1)
    model = patched(ref, "bf16").train()
    caplog.set_level(logging.WARNING, logger="mxmla.integrations")
    _loss(model, token_ids()).backward()
    assert any("attention_dropout" in r for r in patch_state(model).fallbacks)
    model.eval()
    logits(model, token_ids())  # dropout is off in eval: served
    assert patch_state(model).served == 2


def test_kv_cache_prefill_is_served_and_decoding_falls_back(caplog):
    """Prefill with use_cache=True runs mxmla and writes HF's latents to the cache; the decode step
    (one token, cache holding the prefix) runs HF's forward. fp32 model, bf16 path: layer 0's latents
    come from HF's modules on the same input, and the k_rot RoPE is bitwise HF's (test above), so its
    cache entries are equal bytes; layer 1's input carries layer 0's attention round-off."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if "cache" not in CausalLMOutputWithPast.__dataclass_fields__:  # the forward argument is `cache` too
        pytest.skip(f"transformers {transformers.__version__}: its outputs name the cache past_key_values "
                    "(this test uses the `cache` names of >= 5.24)")
    caplog.set_level(logging.WARNING, logger="mxmla.integrations")
    ref = tiny_model().eval()
    model = patched(ref, "bf16")
    ids = token_ids()
    with torch.no_grad():
        out_ref = ref(ids, use_cache=True)
        out = model(ids, use_cache=True)
    assert patch_state(model).served == 2 and not patch_state(model).fallbacks
    (first, second), (first_ref, second_ref) = out.cache.layers, out_ref.cache.layers
    assert_bytes_equal(first.keys, first_ref.keys, "layer 0 cached kv_nope latents")
    assert_bytes_equal(first.values, first_ref.values, "layer 0 cached roped k_rot")
    assert rel(second.keys, second_ref.keys) <= EPS_BF16 and rel(second.values, second_ref.values) <= EPS_BF16
    nxt = token_ids(seed=5, seq=1)
    same_cache = copy.deepcopy(out.cache)
    with torch.no_grad():
        step_ref = ref(nxt, cache=same_cache, use_cache=True).logits
        step = model(nxt, cache=out.cache, use_cache=True).logits
    assert_bytes_equal(step, step_ref, "decode step (HF's forward on equal caches)")
    assert any("already holds 64 tokens" in r for r in patch_state(model).fallbacks)
    assert any("already holds 64 tokens" in rec.getMessage() for rec in caplog.records)


def test_generate_runs_patched_prefill_and_hf_decoding():
    ref = tiny_model(use_cache=True).eval()
    model = patched(ref, "mxfp8")
    with torch.no_grad():
        out = model.generate(token_ids(batch=1), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, SEQ + 3)
    state = patch_state(model)
    assert state.served == 2 and sum(state.fallbacks.values()) == 2 * 2  # decode steps 2 and 3 (S = 1)


# --------------------------------------------------------------------------------------------------
# Patch-time errors, undo, and the optional dependency
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("qk_nope_head_dim", 64), ("qk_rope_head_dim", 32), ("v_head_dim", 64)])
def test_other_head_dims_raise_naming_the_config_field(field, value):
    ref = tiny_model(**{field: value})
    with pytest.raises(ValueError, match=f"config.{field}"):
        patch_deepseek_v3(ref, path="bf16")


@pytest.mark.parametrize("value", ["no", 1, 0, None, 1.0], ids=repr)
def test_quantize_grad_must_be_a_bool(value):
    model = tiny_model()
    with pytest.raises(TypeError, match=rf"^quantize_grad: expected a bool, got {type(value).__name__}"):
        patch_deepseek_v3(model, quantize_grad=value)
    assert patch_state(patch_deepseek_v3(model, quantize_grad=False)).quantize_grad is False  # nothing was patched


def test_patch_time_errors():
    with pytest.raises(ValueError, match="config.q_lora_rank"):
        patch_deepseek_v3(tiny_model(q_lora_rank=48), path="mxfp8")
    with pytest.raises(ValueError, match="path: expected one of"):
        patch_deepseek_v3(tiny_model(), path="fp8")
    with pytest.raises(ValueError, match="backend: unknown backend 'nope'"):
        patch_deepseek_v3(tiny_model(), backend="nope")
    with pytest.raises(ValueError, match="model: no transformers DeepseekV3Attention"):
        patch_deepseek_v3(torch.nn.Linear(4, 4))
    model = patch_deepseek_v3(tiny_model(), path="bf16")
    with pytest.raises(ValueError, match="model: already patched"):
        patch_deepseek_v3(model)
    with pytest.raises(ValueError, match="model: not patched"):
        unpatch_deepseek_v3(tiny_model())


def test_unpatch_restores_hf_forward_bitwise():
    ref = tiny_model().eval()
    model = patched(ref, "mxfp8")
    ids = token_ids()
    assert not torch.equal(logits(model, ids), logits(ref, ids))
    unpatch_deepseek_v3(model)
    assert patch_state(model) is None
    assert all("forward" not in m.__dict__ for m in model.modules() if isinstance(m, hf.DeepseekV3Attention))
    assert_bytes_equal(logits(model, ids), logits(ref, ids), "unpatched logits")
    patch_deepseek_v3(model, path="bf16")  # patchable again
    assert patch_state(model).path == "bf16"


def test_state_dict_keys_unchanged_by_the_patch():
    ref = tiny_model()
    model = patched(ref, "mxfp8")
    assert list(model.state_dict()) == list(ref.state_dict())


def test_import_dispatch_without_transformers():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'transformers' or name.startswith('transformers.'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import dispatch, dispatch.nn, dispatch.weights, dispatch.integrations\n"
        "import dispatch.integrations.transformers as t\n"
        "try:\n"
        "    t.patch_deepseek_v3(object())\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'mxmla[hf]'" in out.stdout


def quantize_spy(monkeypatch, shape) -> list:
    """The list dispatch.run's mxfp8_quantize calls on a tensor of `shape` (q_b_proj's weight) are
    appended to, from now on."""
    calls = []
    real_run = dispatch.run

    def spy(op, *args, **kw):
        if op == "mxfp8_quantize" and tuple(args[0].shape) == tuple(shape):
            calls.append(op)
        return real_run(op, *args, **kw)

    monkeypatch.setattr(dispatch, "run", spy)
    return calls


def test_mxfp8_path_quantizes_q_b_proj_once_per_step(monkeypatch):
    """Patching makes each layer's copies of q_b_proj's weight; then two micro-batches and an optimizer
    step, twice: the weight is quantized again once per layer per step (at the next step's first
    forward, eager mode finding the weight changed)."""
    ref = tiny_model()
    calls = quantize_spy(monkeypatch, ref.model.layers[0].self_attn.q_b_proj.weight.shape)
    model = patched(ref, "mxfp8").train()
    assert len(calls) == 2  # 2 layers, at patch time
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        for micro in range(2):
            _loss(model, token_ids(seed=10 + 2 * step + micro)).backward()
        opt.step()
        opt.zero_grad()
    assert len(calls) == 2 + 2 * 1  # the second step's forwards: once per layer


def test_mxfp8_q_is_an_mxtensor_reaching_mla_attention(monkeypatch):
    seen = []
    real_run = dispatch.run

    def spy(op, *args, **kw):
        if op == "mla_attention":
            seen.append(tuple(type(a).__name__ for a in args[:3]))
        return real_run(op, *args, **kw)

    monkeypatch.setattr(dispatch, "run", spy)
    logits(patched(tiny_model(), "mxfp8").eval(), token_ids())
    assert seen and all(s == ("MXTensor",) * 3 for s in seen)



def test_triton_interpreter_mxfp8_path_small():
    """The Triton kernels (interpreted on the CPU) behind the patch: one forward + backward at B1 S32,
    logits and every attention gradient within the mxfp8 bounds of the unpatched model."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test")
    ref = tiny_model().train()
    model = patch_deepseek_v3(copy.deepcopy(ref), path="mxfp8", backend="triton").train()
    ids = token_ids(batch=1, seq=32)
    loss_ref, loss = _loss(ref, ids), _loss(model, ids)
    loss_ref.backward()
    loss.backward()
    assert_served(model)
    assert abs(float(loss.detach()) - float(loss_ref.detach())) <= EPS_MX * float(loss_ref.detach())
    named = dict(model.named_parameters())
    for name, p_ref in ref.named_parameters():
        if ".self_attn." in name:
            g, g_ref = named[name].grad.double().flatten(), p_ref.grad.double().flatten()
            cos = float(torch.nn.functional.cosine_similarity(g, g_ref, dim=0))
            assert cos >= math.sqrt(1 - EPS_MX_GRAD ** 2), f"{name}: cosine {cos:.5f}"


def test_gradient_checkpointing_recomputes_through_the_patch(monkeypatch):
    """HF's activation checkpointing re-runs each decoder layer in the backward, patched forward
    included; the recomputation is deterministic on the CPU, so the gradients are equal bytes, and
    the forward and the recomputation both read the copies made at patch time (no quantization)."""
    ref = tiny_model()
    plain = patched(ref, "mxfp8").train()
    ckpt = patched(ref, "mxfp8").train()
    if hasattr(ckpt, "activation_checkpointing_enable"):
        ckpt.activation_checkpointing_enable({"use_reentrant": False})
    else:
        ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = token_ids()
    _loss(plain, ids).backward()
    calls = quantize_spy(monkeypatch, (2 * 192, 64))
    _loss(ckpt, ids).backward()
    assert patch_state(ckpt).served == 4  # 2 layers, forward and recomputation
    assert calls == []
    for (name, p), (_, q) in zip(plain.named_parameters(), ckpt.named_parameters()):
        if ".self_attn." in name:
            assert_bytes_equal(q.grad, p.grad, name)
