#!/usr/bin/env python
"""TorchTitan's DeepSeek-V3 converted to mxmla's MXFP8 path against stock (bf16, FlexAttention).

Not one of `mxmla bench`'s bench_*.py scripts: it needs the optional `[torchtitan]` extra.

    python benchmarks/titan_block.py --out OUT_DIR             # CUDA: timing, memory, 200 training steps
    python benchmarks/titan_block.py --smoke                   # tiny, CPU, seconds (tests run this)

Model: TorchTitan's DeepSeekV3Model with --layers blocks (default 3) at DeepSeek-V3's attention sizes
(dim 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128 + qk_rope 64, v 128, yarn RoPE
as the 671B flavor's, mscale 1.0), dense MLPs of --ffn (default 2048) instead of MoE, vocabulary
--vocab (default 8192), TorchTitan's own initialisation. Two models from the same initial weights:
stock (FlexAttention, TorchTitan's default) and `convert_deepseek_v3(config, path="mxfp8")`. Each is
set up as TorchTitan's parallelize does at world size 1: every block compiled with fullgraph=True
(apply_compile, Inductor), then FSDP2 (fully_shard per block and at the root, bf16 parameters, fp32
reduction) on a one-rank process group; AdamW on the fp32 master weights.

Data: B x S tokens (--batch 1 --seq 4096) from a fixed random first-order Markov chain (hf_layer.py's
MarkovData: learnable, with a known entropy floor), positions 0..S-1, next-token cross-entropy. Mask
(--mask): "documents" (default) is the BlockMask `Decoder.get_attention_masks` builds for these
positions (causal AND packed documents, one document per row: mxmla's thd path, with the documents'
cu_seqlens read from the device once per layer under compile, and the Triton attention's own read of
the longest sequence); "causal" is TorchTitan's causal mask alone (mxmla's bshd path, no host read).

Measured, the two models taking turns (--rounds rounds of --iters steps each; a step is forward,
backward and the optimizer step, timed with CUDA events; median over all timed steps after the first
round's warm-up): step time, and the peak memory of a step (torch.cuda.max_memory_allocated during it
minus what was allocated before it: activations and temporaries, the models' states excluded).
Training (--steps, default 200): both models step through the same batches in turns, AdamW lr 3e-4
with 20 warm-up steps and gradient clipping at 1; the final loss (mean of the last 10 steps) of the
converted model must be within 2 % of stock's. Before compiling, one eager forward of the converted
model checks that every layer is served by mxmla (no fallback).

JSON goes to --out (a folder: titan_block.json inside it; or a file path). The table is printed last.

Torch 2.11: TorchTitan 0.3.0 imports names that torch 2.12 added; tests/titan_compat.py stands in for
those that this run only imports (never calls), before TorchTitan is imported, and says so on stderr and
in the JSON's torch_stand_ins (empty on a torch that has them). Decoder.get_attention_masks passes
create_block_mask a separate_full_blocks that 2.11 lacks: there the documents mask is the same BlockMask
built by the tests' document_block_mask (the JSON's mask_built_by says which).
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MODELS = ("stock", "mxfp8")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder (titan_block.json inside) or .json path for the results")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (aot_eager, a dense stock mask)")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=2048, help="dense MLP hidden size")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=200, help="training steps per model (0: none)")
    ap.add_argument("--rounds", type=int, default=4, help="timing rounds (the first is warm-up)")
    ap.add_argument("--iters", type=int, default=5, help="timed steps per model per round")
    ap.add_argument("--backend", default=None, help="mxmla backend for every op (default: automatic)")
    ap.add_argument("--mask", choices=("documents", "causal"), default="documents",
                    help="documents: the BlockMask TorchTitan builds (causal AND packed documents, here one "
                         "per row; mxmla's thd path); causal: the causal mask alone (mxmla's bshd path)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.batch, args.seq, args.ffn, args.vocab = 2, 2, 64, 64, 128
        args.steps, args.rounds, args.iters = min(args.steps, 3), 2, 1
    return args


def model_config(args):
    """(stock config, converted config) for the run's shapes."""
    from tests.titan_models import deepseek_v3_config, rope_config

    from dispatch.integrations.torchtitan import convert_deepseek_v3

    if args.smoke:  # FlexAttention has no CPU backward: stock gets the tests' dense evaluation of its mask
        cfg = deepseek_v3_config(layers=args.layers, ffn=args.ffn, vocab=args.vocab)
    else:
        from torchtitan.models.common.attention import FlexAttention

        cfg = deepseek_v3_config(dim=7168, heads=128, q_lora_rank=1536, kv_lora_rank=512, layers=args.layers,
                                 ffn=args.ffn, vocab=args.vocab, mscale=1.0, inner_attention=FlexAttention.Config(),
                                 rope=rope_config(max_seq_len=4096 * 4, original_seq_len=4096))
    converted = convert_deepseek_v3(copy.deepcopy(cfg), path="mxfp8", backend=args.backend)
    return cfg, converted


def build(cfg, device, smoke: bool):
    """A model as TorchTitan's parallelize sets it up at world size 1: blocks compiled, then FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchtitan.config import CompileConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.compile import apply_compile

    torch.manual_seed(0)
    with torch.device(device):
        model = cfg.build()
    model.init_states(buffer_device=device)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    apply_compile(model, compile_config=CompileConfig(enable=True, backend="aot_eager" if smoke else "inductor"),
                  parallel_dims=dims)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # the run's device: fully_shard's default mesh takes the accelerator where there is one (--smoke is CPU)
    mesh = init_device_mesh(torch.device(device).type, (1,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if smoke:
        model.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def served_eagerly(converted_cfg, inputs, device) -> dict:
    """One eager forward of an unparallelized converted model: {served, fallbacks} per layer."""
    torch.manual_seed(0)
    with torch.device(device):
        model = converted_cfg.build()
    model.init_states(buffer_device=device)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    with torch.no_grad():
        model(*inputs)
    layers = [b.attention for b in model.layers.values()]
    return {"served": sum(a.mxmla_served for a in layers),
            "fallbacks": {k: v for a in layers for k, v in a.mxmla_fallbacks.items()}}


def step_fn(model, opt, inputs, labels, clip: bool):
    def step():
        logits = model(*inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def time_steps(steps: dict, args, cuda: bool) -> dict:
    """{model: {"ms": median step ms, "peak_gib": step peak minus the memory before it}}, in turns."""
    times = {name: [] for name in steps}
    peaks = {name: [] for name in steps}
    for r in range(args.rounds):
        for name, step in steps.items():
            if cuda:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            for _ in range(args.iters):
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    step()
                    end.record()
                    end.synchronize()
                    ms = start.elapsed_time(end)
                else:
                    t0 = time.perf_counter()
                    step()
                    ms = (time.perf_counter() - t0) * 1e3
                if r:  # the first round warms up (compilation, autotuning, allocator)
                    times[name].append(ms)
            if cuda and r:
                peaks[name].append((torch.cuda.max_memory_allocated() - base) / 2 ** 30)
    return {name: {"ms": statistics.median(times[name]), "peak_gib": max(peaks[name]) if peaks[name] else None}
            for name in steps}


def run(args) -> dict:
    from hf_layer import MarkovData

    from tests import titan_compat

    stand_ins = titan_compat.install()  # before TorchTitan is imported: torch 2.11 lacks names it imports
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if not dist.is_initialized():  # FSDP2 needs a process group, as TorchTitan at world size 1
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    stock_cfg, converted_cfg = model_config(args)
    positions = torch.arange(args.seq, device=device).repeat(args.batch, 1)
    data = MarkovData(args.vocab)
    res = {"device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
           "torch": torch.__version__, "torch_stand_ins": stand_ins, "smoke": args.smoke, "args": vars(args)}

    models = {"stock": build(stock_cfg, device, args.smoke), "mxfp8": build(converted_cfg, device, args.smoke)}
    mask, res["mask_built_by"] = _mask(args, models["stock"], positions)
    res["check"] = served_eagerly(converted_cfg, (data.batch(0, args.batch, args.seq).to(device), positions, mask),
                                  device)
    opts = {n: torch.optim.AdamW(m.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)
            for n, m in models.items()}

    if args.steps:
        scheds = {n: torch.optim.lr_scheduler.LambdaLR(o, lambda i: min(1.0, (i + 1) / 20)) for n, o in opts.items()}
        losses = {n: [] for n in models}
        t0 = time.perf_counter()
        for s in range(args.steps):
            tokens = data.batch(1000 + s, args.batch, args.seq + 1).to(device)
            inputs, labels = (tokens[:, :-1], positions, mask), tokens[:, 1:]
            for name, model in models.items():
                losses[name].append(float(step_fn(model, opts[name], inputs, labels, clip=True)().detach()))
                scheds[name].step()
        tail = max(1, min(10, args.steps))
        final = {n: sum(v[-tail:]) / tail for n, v in losses.items()}
        rel = (final["mxfp8"] - final["stock"]) / final["stock"]
        res["train"] = {"losses": losses, "final_loss": final, "final_rel_diff": rel,
                        "max_step_rel_diff": max(abs(a - b) / b for a, b in zip(losses["mxfp8"], losses["stock"])),
                        "within_2pct": abs(rel) <= 0.02, "entropy_floor": data.entropy,
                        "seconds": time.perf_counter() - t0}

    tokens = data.batch(0, args.batch, args.seq + 1).to(device)
    inputs, labels = (tokens[:, :-1], positions, mask), tokens[:, 1:]
    steps = {n: step_fn(m, opts[n], inputs, labels, clip=False) for n, m in models.items()}
    res["timing"] = time_steps(steps, args, cuda)
    return res


def _mask(args, model, positions):
    """(mask, what built it): TorchTitan's own mask for these positions, or its causal mask alone (--mask);
    built uncompiled on the CPU (--smoke).

    Torch 2.11's create_block_mask has no separate_full_blocks, which Decoder.get_attention_masks passes
    (True outside TorchTitan's batch-invariant mode). 2.11 always keeps the full blocks apart, so there the
    tests' document_block_mask builds the same BlockMask (the same mask_mods and block size), uncompiled."""
    import inspect

    from torch.nn.attention.flex_attention import create_block_mask

    from tests import titan_models

    if args.smoke:
        return ((titan_models.document_block_mask(positions), "tests.titan_models.document_block_mask")
                if args.mask == "documents" else
                (titan_models.causal_block_mask(args.batch, args.seq), "tests.titan_models.causal_block_mask"))
    if args.mask == "documents":
        if "separate_full_blocks" in inspect.signature(create_block_mask).parameters:
            return model.get_attention_masks(positions), "Decoder.get_attention_masks"
        print(f"titan_block: torch {torch.__version__}'s create_block_mask has no separate_full_blocks, which "
              "Decoder.get_attention_masks passes; the same mask by tests.titan_models.document_block_mask",
              file=sys.stderr)
        block_size = model.config.first_attention.inner_attention.block_size
        return (titan_models.document_block_mask(positions, block_size),
                "tests.titan_models.document_block_mask (torch lacks separate_full_blocks)")
    from torchtitan.models.common.attention import create_attention_mask, get_causal_mask_mod

    return (create_attention_mask(get_causal_mask_mod(), args.batch, None, args.seq, args.seq,
                                  device=positions.device), "create_attention_mask(get_causal_mask_mod())")


def table(res: dict) -> str:
    a = res["args"]
    lines = [f"TorchTitan DeepSeek-V3, {a['layers']} blocks (dim {'7168' if not res['smoke'] else 'tiny'}, "
             f"dense MLP {a['ffn']}), B{a['batch']} S{a['seq']}, {a['mask']} mask, compiled per block + FSDP2 "
             f"bf16, {res['device']}",
             f"  mxmla served {res['check']['served']} layers eagerly; fallbacks: {res['check']['fallbacks'] or 'none'}",
             f"  {'model':8} {'step ms':>9} {'vs stock':>9} {'step peak GiB':>14}"]
    t = res["timing"]
    for name in MODELS:
        peak = t[name]["peak_gib"]
        lines.append(f"  {name:8} {t[name]['ms']:9.2f} {t['stock']['ms'] / t[name]['ms']:8.3f}x "
                     f"{'n/a' if peak is None else f'{peak:.2f}':>14}")
    tr = res.get("train")
    if tr:
        lines.append(f"  training {a['steps']} steps (entropy floor {tr['entropy_floor']:.3f}): final loss stock "
                     f"{tr['final_loss']['stock']:.4f}, mxfp8 {tr['final_loss']['mxfp8']:.4f} "
                     f"({tr['final_rel_diff']:+.2%}; largest step difference {tr['max_step_rel_diff']:.2%}); "
                     f"within 2 %: {'yes' if tr['within_2pct'] else 'NO'}")
    return "\n".join(lines)


def _out_path(out: str) -> str:
    if out.endswith(".json"):
        return out
    os.makedirs(out, exist_ok=True)
    return os.path.join(out, "titan_block.json")


def main(argv=None) -> int:
    args = parse_args(argv)
    res = run(args)
    if args.out:
        with open(_out_path(args.out), "w") as f:
            json.dump(res, f, indent=1)
    print(table(res))
    if dist.is_initialized():
        dist.destroy_process_group()
    ok = not res["check"]["fallbacks"] and res.get("train", {}).get("within_2pct", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
