#!/usr/bin/env python
"""HF transformers' DeepSeek-V3 decoder layer, patched by mxmla (mxfp8, bf16) against unpatched (sdpa).

Not one of `mxmla bench`'s bench_*.py scripts: it needs the optional `[hf]` extra (transformers).

    python benchmarks/hf_layer.py --out OUT_DIR                  # layer timing + memory (CUDA)
    python benchmarks/hf_layer.py --reduce-overhead --out OUT_DIR  # plus CUDA-graph compile rows
    python benchmarks/hf_layer.py --train 200 --out OUT_DIR      # plus 200 training steps, 2 layers
    python benchmarks/hf_layer.py --smoke --train 5              # tiny, CPU (compile rows: aot_eager)

Layer (timing): one `DeepseekV3DecoderLayer` with DeepSeek-V3's attention (hidden 7168, 128 heads,
q_lora_rank 1536, kv_lora_rank 512, qk_nope 128 + qk_rope 64, v 128, rope_interleave=True), random
init (HF's own init, initializer_range 0.02), bf16 weights. Layer 0 is dense
(first_k_dense_replace=1): a `DeepseekV3MLP` of intermediate size 2048 (--intermediate) instead of
DeepSeek-V3's 18432 dense / MoE layers, so that the attention, the part mxmla changes, is most of
the layer's time. Input [B=1, S=4096, 7168] bf16 (--batch, --seq), cos / sin from HF's rotary
embedding, mask None (sdpa: causal). One step is a training step of the layer: forward, backward
(dL/dout a fixed random tensor; gradients of the input and of every weight), and an optimizer step
updating every weight in place (torch.optim.SGD, lr 1e-7, foreach: p -= 1e-7 * grad). The mxfp8 rows
register that optimizer for the patched layer's weight copies (`patch_deepseek_v3(..., optimizer=)`), as
a training loop does: each step re-quantizes q_b_proj's weight into the copies once, inside the timed
step (the optimizer's step hook), and the forward (eager or compiled) reads them.
Rows, timed in turns in one process: unpatched (HF's sdpa attention), mxfp8 and bf16 (patched),
each eager and under torch.compile of the layer (`_compile` rows: fullgraph=True, --compile-backend,
default inductor; the weight update stays eager), plus `_compile_ro` rows (mode="reduce-overhead",
CUDA graphs) with --reduce-overhead. Each row runs --warmup steps (the first one compiles; its
output and input gradient are compared with unpatched eager's, all weights still equal), then
--rounds rounds of --iters steps back to back (CUDA events between steps, one synchronize per
round); the median of all timed steps is reported. A recompile after the warm-up raises.
Peak memory: torch.cuda.max_memory_allocated during one step, minus what was allocated before it
(weights, input).

Training (--train N): a 2-layer `DeepseekV3ForCausalLM` (hidden 1024, 8 heads, q_lora 512, kv_lora
256, the real head dims, dense MLPs of 2816, vocabulary 4096, fp32 weights), AdamW lr 1e-3 with 20
warm-up steps and gradient clipping at 1, batch 4 x 1024 tokens from a fixed random first-order
Markov chain over the vocabulary (each token has 8 likely successors: learnable, with a known entropy
floor), the same seed and data for every variant. Reported: each variant's loss curve, the
relative difference of the final loss (mean of the last 10 steps) to unpatched, which must be
within 2 %, and the largest per-step relative difference.

JSON goes to --out (a folder: hf_layer.json inside it; or a file path). The table is printed last.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import torch  # noqa: E402
import torch._dynamo  # noqa: E402

VARIANTS = ("unpatched", "bf16", "mxfp8")
# Layer timing rows: each path eager and compiled (the "_compile_ro" rows only with --reduce-overhead)
LAYER_VARIANTS = ("unpatched", "unpatched_compile", "mxfp8", "mxfp8_compile", "bf16", "bf16_compile")
REDUCE_OVERHEAD_VARIANTS = ("unpatched_compile_ro", "mxfp8_compile_ro", "bf16_compile_ro")
UPDATE_LR = 1e-7  # the optimizer step writes every weight; it barely moves them (bf16 weights ~0.02)

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder (hf_layer.json inside) or .json path for the results")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (torch backend)")
    ap.add_argument("--train", type=int, default=0, metavar="STEPS", help="also train a 2-layer model this many steps")
    ap.add_argument("--no-layer", action="store_true", help="skip the layer timing")
    ap.add_argument("--seq", type=int, default=None, help="layer timing: sequence length (default 4096; smoke 64)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--intermediate", type=int, default=None, help="dense MLP size of the timed layer (default 2048)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5, help="timed calls per variant per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default=None, help="mxmla backend (default: automatic; smoke: torch)")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend of the _compile rows "
                    "(default inductor; smoke: aot_eager)")
    ap.add_argument("--reduce-overhead", action="store_true", help="also the mode=\"reduce-overhead\" rows (CUDA)")
    args = ap.parse_args(argv)
    args.compile_backend = args.compile_backend or ("aot_eager" if args.smoke else "inductor")
    if args.smoke:
        args.backend = args.backend or "torch"
        args.seq = args.seq or 64
        args.intermediate = args.intermediate or 256
        args.warmup, args.iters, args.rounds = min(args.warmup, 1), min(args.iters, 2), min(args.rounds, 2)
    args.seq = args.seq or 4096
    args.intermediate = args.intermediate or 2048
    return args


def _config(smoke: bool, **kw):
    from transformers import DeepseekV3Config

    if smoke:
        base = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=64, kv_lora_rank=64,
                    vocab_size=128)
    else:
        base = dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                    kv_lora_rank=512, vocab_size=129280)
    base.update(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True, n_routed_experts=4,
                n_group=1, topk_group=1, num_experts_per_tok=2, moe_intermediate_size=64, use_cache=False,
                max_position_embeddings=max(4096, kw.pop("max_positions", 0)))
    base.update(kw)
    config = DeepseekV3Config(**base)
    config._attn_implementation = "sdpa"
    return config


def _patch(module, variant, backend, optimizer):
    """module patched for the variant's path; `optimizer` (the one updating module's weights) refreshes
    the mxfp8 path's weight copies after each of its steps, as a training loop registers it."""
    from dispatch.integrations.transformers import patch_deepseek_v3

    path = variant.split("_")[0]
    if path == "unpatched":
        return module
    return patch_deepseek_v3(module, path=path, backend=backend, optimizer=optimizer if path == "mxfp8" else None)


# --------------------------------------------------------------------------------------------------
# Layer timing
# --------------------------------------------------------------------------------------------------

def _steps_ms(step, n: int, cuda: bool) -> list:
    """n steps back to back: ms of each, from CUDA events between the steps (one synchronize at the
    end) or the host clock on the CPU."""
    if cuda:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        events[0].record()
        for i in range(n):
            step()
            events[i + 1].record()
        events[-1].synchronize()
        return [events[i].elapsed_time(events[i + 1]) for i in range(n)]
    marks = [time.perf_counter()]
    for _ in range(n):
        step()
        marks.append(time.perf_counter())
    return [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]


def _layer_call(layer, variant, args):
    """The layer itself (eager rows) or its torch.compile (fullgraph; "_ro": reduce-overhead)."""
    if "_compile" not in variant:
        return layer
    mode = "reduce-overhead" if variant.endswith("_ro") else None
    return torch.compile(layer, backend=args.compile_backend, mode=mode, fullgraph=True, dynamic=False)


def bench_layer(args, device) -> dict:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RotaryEmbedding

    from dispatch.integrations.transformers import patch_state

    cuda = device.type == "cuda"
    dtype = torch.bfloat16
    variants = LAYER_VARIANTS + (REDUCE_OVERHEAD_VARIANTS if args.reduce_overhead and cuda else ())
    config = _config(args.smoke, intermediate_size=args.intermediate, first_k_dense_replace=1,
                     max_positions=args.seq)
    torch.manual_seed(0)
    base = DeepseekV3DecoderLayer(config, layer_idx=0)
    with torch.no_grad():  # HF's _init_weights: normal(0, initializer_range) for Linear, ones for norms
        for name, p in base.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, config.initializer_range)
    base = base.to(device=device, dtype=dtype)
    rotary = DeepseekV3RotaryEmbedding(config).to(device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    h = torch.randn(args.batch, args.seq, config.hidden_size, generator=gen).to(device, dtype)
    grad_out = torch.randn(h.shape, generator=gen).to(device, dtype)
    position_ids = torch.arange(args.seq, device=device)[None]
    cos, sin = rotary(h, position_ids)
    layers, opts = {}, {}
    for v in variants:
        layer = copy.deepcopy(base)
        opts[v] = torch.optim.SGD(layer.parameters(), lr=UPDATE_LR, foreach=True)
        layers[v] = _patch(layer, v, args.backend, opts[v])
    del base
    calls = {v: _layer_call(layers[v], v, args) for v in variants}
    inputs = {v: h.clone().requires_grad_(True) for v in variants}
    first = {}  # each row's first output and input gradient, all weights still equal

    def step(variant):
        if variant.endswith("_ro"):
            torch.compiler.cudagraph_mark_step_begin()
        x = inputs[variant]
        out = calls[variant](x, attention_mask=None, position_ids=position_ids, position_embeddings=(cos, sin))
        out.backward(grad_out)
        if variant not in first:
            first[variant] = (out.detach().float(), x.grad.float())
        opts[variant].step()  # mxfp8: its hook refreshes the weight copies (part of the step)
        opts[variant].zero_grad(set_to_none=True)
        x.grad = None

    times = {v: [] for v in variants}
    first_call_s, errors = {}, {}
    for v in variants:  # warm-up: compiles, fills the weight caches
        t0 = time.perf_counter()
        try:
            step(v)
            if cuda:
                torch.cuda.synchronize()
        except Exception as e:  # an optional CUDA-graph row that cannot run is reported, not fatal
            if not v.endswith("_ro"):
                raise
            errors[v] = f"{type(e).__name__}: {e}"
            continue
        first_call_s[v] = time.perf_counter() - t0
        for _ in range(args.warmup - 1):
            step(v)
    variants = tuple(v for v in variants if v not in errors)
    with torch._dynamo.config.patch(error_on_recompile=True):  # a recompile would be timed: raise instead
        for _ in range(args.rounds):
            for v in variants:
                times[v].extend(_steps_ms(lambda: step(v), args.iters, cuda))
        peak = {}
        for v in variants:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step(v)
                torch.cuda.synchronize()
                peak[v] = (torch.cuda.max_memory_allocated() - before) / 2 ** 30
            else:
                step(v)
                peak[v] = None
    ref_out, ref_grad = first["unpatched"]
    rel = {v: float((first[v][0] - ref_out).norm() / ref_out.norm()) for v in variants}
    grad_cos = {v: float(torch.nn.functional.cosine_similarity(first[v][1].flatten(), ref_grad.flatten(), dim=0))
                for v in variants}
    fallbacks = {v: dict(patch_state(layers[v]).fallbacks) for v in variants if not v.startswith("unpatched")}
    traced = {v: dict(patch_state(layers[v]).traced) for v in variants
              if not v.startswith("unpatched") and "_compile" in v}
    # compiled traces that quantize q_b_proj's weight in the graph (0: they read the refreshed copies)
    quantized_in_graph = {v: patch_state(layers[v]).quantized_in_graph for v in traced}
    med = {v: statistics.median(times[v]) for v in variants}
    return {
        "shape": {"batch": args.batch, "seq": args.seq, "hidden": config.hidden_size,
                  "heads": config.num_attention_heads, "q_lora_rank": config.q_lora_rank,
                  "kv_lora_rank": config.kv_lora_rank, "mlp": f"dense DeepseekV3MLP, intermediate {args.intermediate}",
                  "dtype": "bfloat16"},
        "step": f"forward + backward + optimizer step (SGD lr {UPDATE_LR}; mxfp8: weight copies refreshed in it)",
        "compile_backend": args.compile_backend, "variants": list(variants), "errors": errors,
        "ms_median": med, "ms_all": times, "first_call_s": first_call_s, "peak_gib": peak,
        "speedup_vs_unpatched": {v: med["unpatched"] / med[v] for v in variants},
        "out_rel_err_vs_unpatched": rel, "input_grad_cosine_vs_unpatched": grad_cos, "fallbacks": fallbacks,
        "traced": traced, "quantized_in_graph": quantized_in_graph,
    }


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------

class MarkovData:
    """Batches from a fixed random first-order Markov chain: each token has `fanout` successors with
    Dirichlet-ish weights. The entropy rate is the loss floor a perfect model reaches."""

    def __init__(self, vocab: int, fanout: int = 8, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.next_tokens = torch.randint(0, vocab, (vocab, fanout), generator=gen)
        w = torch.rand(vocab, fanout, generator=gen) + 0.1
        self.probs = w / w.sum(-1, keepdim=True)
        self.vocab, self.seed = vocab, seed
        p = self.probs
        self.entropy = float(-(p * p.log()).sum(-1).mean())  # per token, nats (successor sets may collide)

    def batch(self, step: int, batch: int, seq: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.empty(batch, seq, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab, (batch,), generator=gen)
        for t in range(1, seq):
            choice = torch.multinomial(self.probs[tokens[:, t - 1]], 1, generator=gen)[:, 0]
            tokens[:, t] = self.next_tokens[tokens[:, t - 1], choice]
        return tokens


def train(args, device) -> dict:
    from transformers import DeepseekV3ForCausalLM

    if args.smoke:
        config = _config(True, num_hidden_layers=2, intermediate_size=256, first_k_dense_replace=2,
                         initializer_range=0.1)
        batch, seq = 2, 64
    else:
        config = _config(False, hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=512,
                         kv_lora_rank=256, vocab_size=4096, num_hidden_layers=2, intermediate_size=2816,
                         first_k_dense_replace=2)
        batch, seq = 4, 1024
    data = MarkovData(config.vocab_size)
    batches = [data.batch(s, batch, seq) for s in range(args.train)]
    result = {"config": {"hidden": config.hidden_size, "heads": config.num_attention_heads,
                         "q_lora_rank": config.q_lora_rank, "kv_lora_rank": config.kv_lora_rank, "layers": 2,
                         "vocab": config.vocab_size, "batch": batch, "seq": seq, "dtype": "float32",
                         "mlp": f"dense, intermediate {config.intermediate_size}"},
              "entropy_floor": data.entropy, "losses": {}, "seconds": {}}
    for variant in VARIANTS:
        torch.manual_seed(0)
        model = DeepseekV3ForCausalLM._from_config(config, attn_implementation="sdpa").to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
        model = _patch(model, variant, args.backend, opt).train()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 20))
        losses = []
        t0 = time.perf_counter()
        for step in range(args.train):
            ids = batches[step].to(device)
            loss = model(ids, labels=ids).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
        result["losses"][variant] = losses
        result["seconds"][variant] = time.perf_counter() - t0
        del model, opt
    tail = max(1, min(10, args.train))
    final = {v: sum(result["losses"][v][-tail:]) / tail for v in VARIANTS}
    ref = result["losses"]["unpatched"]
    result["final_loss"] = final
    result["final_rel_diff"] = {v: (final[v] - final["unpatched"]) / final["unpatched"] for v in VARIANTS}
    result["max_step_rel_diff"] = {v: max(abs(a - b) / b for a, b in zip(result["losses"][v], ref)) for v in VARIANTS}
    result["within_2pct"] = all(abs(d) <= 0.02 for d in result["final_rel_diff"].values())
    return result


# --------------------------------------------------------------------------------------------------

def _table(res: dict) -> str:
    lines = []
    layer = res.get("layer")
    if layer:
        s = layer["shape"]
        lines.append(f"DeepseekV3DecoderLayer fwd+bwd+update step, B{s['batch']} S{s['seq']} hidden {s['hidden']} "
                     f"H{s['heads']} ({s['mlp']}), {res['device']}, compile backend {layer['compile_backend']}")
        lines.append(f"  {'variant':20} {'ms':>9} {'vs sdpa':>8} {'peak GiB':>9} {'out rel err':>12} {'first s':>8}")
        for v in layer["variants"]:
            peak = layer["peak_gib"][v]
            lines.append(f"  {v:20} {layer['ms_median'][v]:9.2f} {layer['speedup_vs_unpatched'][v]:7.3f}x "
                         f"{'n/a' if peak is None else f'{peak:.2f}':>9} {layer['out_rel_err_vs_unpatched'][v]:12.2e} "
                         f"{layer['first_call_s'][v]:8.1f}")
        lines.append("  (_compile: torch.compile of the layer, fullgraph; _ro: mode=\"reduce-overhead\"; "
                     "first s: the first step, compile included)")
        if any(layer["fallbacks"].values()):
            lines.append(f"  FALLBACKS: {layer['fallbacks']}")
        if any(t != {"served": 1} for t in layer["traced"].values()):
            lines.append(f"  COMPILED NOT SERVED ONCE: {layer['traced']}")
        for v, e in layer["errors"].items():
            lines.append(f"  {v} did not run: {e}")
    tr = res.get("train")
    if tr:
        c = tr["config"]
        lines.append(f"training {len(tr['losses']['unpatched'])} steps, 2 layers hidden {c['hidden']} H{c['heads']}, "
                     f"{c['batch']}x{c['seq']} tokens (entropy floor {tr['entropy_floor']:.3f})")
        lines.append(f"  {'variant':10} {'first':>8} {'final':>8} {'final vs sdpa':>14} {'max step diff':>14} {'s':>7}")
        for v in VARIANTS:
            losses = tr["losses"][v]
            lines.append(f"  {v:10} {losses[0]:8.4f} {tr['final_loss'][v]:8.4f} {tr['final_rel_diff'][v]:+13.2%} "
                         f"{tr['max_step_rel_diff'][v]:13.2%} {tr['seconds'][v]:7.1f}")
        lines.append(f"  final losses within 2 % of unpatched: {'yes' if tr['within_2pct'] else 'NO'}")
    return "\n".join(lines)


def _out_path(out: str) -> str:
    if out.endswith(".json"):
        return out
    os.makedirs(out, exist_ok=True)
    return os.path.join(out, "hf_layer.json")


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        torch.set_num_threads(1)  # tiny ops: a second thread mostly waits (and CI's cores are shared)
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "transformers": transformers.__version__, "backend": args.backend,
           "smoke": args.smoke, "args": vars(args)}
    if not args.no_layer:
        res["layer"] = bench_layer(args, device)
    if args.train:
        res["train"] = train(args, device)
    if args.out:
        with open(_out_path(args.out), "w") as f:
            json.dump(res, f, indent=1)
    print(_table(res))
    ok = not res.get("train") or res["train"]["within_2pct"] or args.smoke
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
