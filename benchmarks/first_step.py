"""The first MXFP8 training step's wall time, in a fresh process with empty caches and in a second one.

    python benchmarks/first_step.py [--cases block,hf,unrecorded] [--json PATH] [--breakdown]

Cases (forward + backward, MXFP8 path, synchronized):
  block       the DeepSeek-V3 MLA block of bench_block.py (examples/mla_block.py) at B1 S4096, 128 heads
  hf          transformers' DeepseekV3Attention (DeepSeek-V3 sizes) patched by dispatch's
              patch_deepseek_v3, at B1 S4096
  unrecorded  the block at a shape no table or list was recorded at: B1 S6144, 96 heads

Each case runs twice, each time in a child process: first with TRITON_CACHE_DIR,
TORCHINDUCTOR_CACHE_DIR and MXMLA_CACHE_DIR pointed at new empty folders ("fresh"), then again
with the folders the first one filled ("second"). A child builds its module and inputs, synchronizes,
and times one step: what a training run waits for before its first step is done (its imports and
model construction are reported apart, as build s). --breakdown prints where each fresh step's
seconds go (each op's first call, Triton's compilations, autotuning timings). One table at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CASES = {
    "block": dict(kind="block", batch=1, seq=4096, heads=128, label="block mxfp8 B1 S4096 H128"),
    "hf": dict(kind="hf", batch=1, seq=4096, heads=128, label="HF DeepseekV3Attention mxfp8 B1 S4096 H128"),
    "unrecorded": dict(kind="block", batch=1, seq=6144, heads=96, label="block mxfp8 B1 S6144 H96"),
}
CHILD_TIMEOUT_S = 240  # three cases, two processes each, fit one 600 s command unless a step hangs


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _block_step(case):
    """The step function of bench_block.py's Bench at the case's batch, sequence and heads."""
    sys.path.insert(0, HERE)
    import bench_block as bb

    cfg = bb.mb.replace(bb.mb.CONFIGS["deepseek"], batch=case["batch"], seq=case["seq"], heads=case["heads"])
    bench = bb.Bench(cfg, "mxfp8")
    return bench.step


def _hf_step(case):
    """The step function of transformers' DeepseekV3Attention at DeepSeek-V3 sizes, patched to mxfp8."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from dispatch.integrations.transformers import patch_deepseek_v3

    config = DeepseekV3Config(hidden_size=7168, num_attention_heads=case["heads"], num_key_value_heads=case["heads"],
                              q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                              v_head_dim=128, rope_interleave=True, use_cache=False,
                              max_position_embeddings=max(4096, case["seq"]))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    attn = DeepseekV3Attention(config, layer_idx=0)
    with torch.no_grad():
        for p in attn.parameters():
            if p.dim() == 2:
                p.normal_(0.0, config.initializer_range)
    attn = patch_deepseek_v3(attn.to(device="cuda", dtype=torch.bfloat16), path="mxfp8")
    rotary = DeepseekV3RotaryEmbedding(config).to("cuda")
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(case["batch"], case["seq"], config.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    h.requires_grad_(True)
    grad = (torch.randn(h.shape, generator=gen) * 1e-3).to("cuda", torch.bfloat16)
    position_ids = torch.arange(case["seq"], device="cuda")[None]
    cos_sin = rotary(h, position_ids)

    from dispatch.integrations.transformers import patch_state

    def step():
        out, _ = attn(h, position_embeddings=cos_sin, attention_mask=None)
        out.backward(grad)
        fallbacks = dict(patch_state(attn).fallbacks)
        if fallbacks:  # transformers' own attention ran: not the path this measures
            raise RuntimeError(f"the patched layer fell back to transformers' attention: {fallbacks}")

    return step


def child(name: str, breakdown: bool) -> None:
    """One case's first step in this process: 'FIRST_STEP {json}' on stdout (and its breakdown)."""
    t0 = time.perf_counter()
    case = CASES[name]
    sys.path.insert(0, ROOT)
    step = (_hf_step if case["kind"] == "hf" else _block_step)(case)
    _sync()
    t1 = time.perf_counter()
    costs = None
    if breakdown:
        sys.path.insert(0, HERE)
        from bench_block import FirstCallCosts

        costs = FirstCallCosts()
        costs.__enter__()
    try:
        step()
        _sync()
    finally:
        if costs is not None:
            costs.__exit__(None, None, None)
    t2 = time.perf_counter()
    print("FIRST_STEP " + json.dumps({"step_s": t2 - t1, "build_s": t1 - t0}), flush=True)
    for line in costs.lines() if costs is not None else ():
        print("FIRST_PROFILE " + line, flush=True)


def run_case(name: str, breakdown: bool) -> dict:
    out = {"case": name, "label": CASES[name]["label"]}
    with tempfile.TemporaryDirectory(prefix="mxmla_first_step_") as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(cache, "triton"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"), MXMLA_CACHE_DIR=os.path.join(cache, "mxmla"))
        for which in ("fresh", "second"):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", name]
            if breakdown and which == "fresh":
                cmd.append("--breakdown")
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                out[f"{which}_error"] = f"timed out after {CHILD_TIMEOUT_S} s"
                break
            out[f"{which}_process_s"] = time.perf_counter() - t0
            lines = proc.stdout.splitlines()
            rec = [ln for ln in lines if ln.startswith("FIRST_STEP ")]
            if proc.returncode or not rec:
                out[f"{which}_error"] = (proc.stderr or proc.stdout)[-1500:]
                break
            got = json.loads(rec[-1][len("FIRST_STEP "):])
            out[f"{which}_s"], out[f"{which}_build_s"] = got["step_s"], got["build_s"]
            out[f"{which}_profile"] = [ln[len("FIRST_PROFILE "):] for ln in lines if ln.startswith("FIRST_PROFILE ")]
    return out


def table(rows) -> str:
    def cell(v, width):
        return f"{v:>{width}.1f}" if isinstance(v, float) else f"{'-':>{width}}"

    lines = [f"{'path':46} {'fresh s':>8} {'second process s':>17} {'fresh build s':>14}"]
    for r in rows:
        lines.append(f"{r['label']:46} {cell(r.get('fresh_s'), 8)} {cell(r.get('second_s'), 17)} "
                     f"{cell(r.get('fresh_build_s'), 14)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--breakdown", action="store_true", help="where each fresh step's seconds go")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.breakdown)
        return 0
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in names if c not in CASES]
    if bad or not names:
        ap.error(f"--cases: expected names from {', '.join(CASES)}, got {args.cases!r}")
    import torch

    if not torch.cuda.is_available():
        print("first_step: needs a CUDA device (the MXFP8 path's kernels)")
        return 2
    print(f"device {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    rows = []
    for name in names:
        row = run_case(name, args.breakdown)
        rows.append(row)
        for key in ("fresh_error", "second_error"):
            if row.get(key):
                print(f"{row['label']}: {key}:\n{row[key]}", flush=True)
        for ln in row.get("fresh_profile", ()):
            print(f"  [{name} fresh] {ln}", flush=True)
    print(table(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
