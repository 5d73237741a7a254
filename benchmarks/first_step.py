"""The first MXFP8 training step's wall time, in a fresh process with empty caches and in a second one.

    python benchmarks/first_step.py [--cases NAME,...] [--budget S] [--json PATH] [--breakdown]
    python benchmarks/first_step.py --smoke      # tiny sizes on the CPU: each step runs (no CUDA)

Cases (forward + backward, synchronized; the default runs all six, eager ones first):
  block               the DeepSeek-V3 MLA block of bench_block.py (examples/mla_block.py) on its mxfp8 path,
                      at B1 S4096, 128 heads
  hf                  transformers' DeepseekV3Attention (DeepSeek-V3 sizes) patched by dispatch's
                      patch_deepseek_v3 (mxfp8, an optimizer registered for its weight copies), at B1 S4096
  unrecorded          the block at a shape no table or list was recorded at: B1 S6144, 96 heads
  block-compile-bf16  bench_block's `compile` path: torch.compile of the pure-torch bf16 block (the
                      baseline a user compares against: what torch.compile costs without mxmla)
  block-compile       bench_block's `mxfp8-compile` path: torch.compile(fullgraph=True) of the mxfp8 block
  hf-compile          the hf case's patched layer under torch.compile(fullgraph=True), as hf_layer.py's
                      mxfp8_compile row compiles its layer

Each case runs twice, each time in a child process: first with TRITON_CACHE_DIR,
TORCHINDUCTOR_CACHE_DIR and MXMLA_CACHE_DIR pointed at new empty folders ("fresh"), then again
with the folders the first one filled ("second"). A child builds its module and inputs, synchronizes,
and times one step: what a training run waits for before its first step is done (its imports and
model construction are reported apart, as build s; a compiled case's build imports Inductor, as
torch.compile does at construction without fullgraph, so no compiled step pays that import). compile s:
of that step, the seconds torch.compile spent (dynamo, AOTAutograd and Inductor for the forward, and
the backward graph's compilation at the first backward), from torch._dynamo.utils.compilation_time_metrics: the frame
compilations ("_compile.compile_inner") plus the lazy backward compilations
("backward._backward_impl"), the two outermost timers (torch's own total_wall_time adds the same
two phases); "-" for the eager cases. The rest of a compiled step is what the eager step pays too
(mxmla's Triton kernels compiled and autotuned at their first call, the GPU work).
--breakdown prints where each fresh step's seconds go (each op's first call, Triton's compilations,
autotuning timings). One table at the end. --smoke runs the cases' steps at tiny sizes on the CPU
(mxmla's torch backend; the compiled mxfp8 cases with aot_eager; block-compile-bf16 only when named,
as its torch.compile on a CPU means Inductor's C++ toolchain): a check that each case runs, not a timing.

Time: on an H100 (656cd06) all six cases, fresh and second process each, took about 190 s: fresh steps
of 4-5 s (eager) and 8-11 s (compiled), second processes 0.3-2.2 s, each child some 7-14 s more to
import and build. --budget (default 540 s) bounds the whole run so the table prints inside a
600 s command: each child's limit is CHILD_TIMEOUT_S or what is left of the budget, and a case the
budget no longer reaches is reported as not run.
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
sys.path.insert(0, HERE)
import benchlib  # noqa: E402

# kind "block": bench_block.Bench on `path` (one of bench_block.PATHS); kind "hf": the patched layer
CASES = {
    "block": dict(kind="block", path="mxfp8", batch=1, seq=4096, heads=128, compiled=False,
                  label="block mxfp8 B1 S4096 H128"),
    "hf": dict(kind="hf", batch=1, seq=4096, heads=128, compiled=False,
               label="HF DeepseekV3Attention mxfp8 B1 S4096 H128"),
    "unrecorded": dict(kind="block", path="mxfp8", batch=1, seq=6144, heads=96, compiled=False,
                       label="block mxfp8 B1 S6144 H96"),
    "block-compile-bf16": dict(kind="block", path="compile", batch=1, seq=4096, heads=128, compiled=True,
                               label="block torch bf16 compiled B1 S4096 H128"),
    "block-compile": dict(kind="block", path="mxfp8-compile", batch=1, seq=4096, heads=128, compiled=True,
                          label="block mxfp8 compiled B1 S4096 H128"),
    "hf-compile": dict(kind="hf", batch=1, seq=4096, heads=128, compiled=True,
                       label="HF DeepseekV3Attention mxfp8 compiled B1 S4096 H128"),
}
DEFAULT_CASES = tuple(CASES)
SMOKE_CASES = tuple(c for c in CASES if c != "block-compile-bf16")
CHILD_TIMEOUT_S = 240  # one child; a hung step costs this much of the budget at most
BUDGET_S = 540  # the whole run, so that its table prints inside a 600 s command
MIN_CHILD_S = 10  # less budget than this left: the child is not started
# compilation_time_metrics' outermost timers (torch 2.11 and 2.13): a frame's compilation (dynamo,
# AOTAutograd, the forward's Inductor) and a backward graph's lazy compilation at its first backward.
# Every other key times a part of one of them, so only these two are added up.
COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def compile_seconds() -> dict:
    """{timer: seconds so far} of COMPILE_TIMERS in this process (0.0 where none ran)."""
    from torch._dynamo.utils import compilation_time_metrics

    return {k: float(sum(compilation_time_metrics.get(k, ()))) for k in COMPILE_TIMERS}


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _block_step(case, smoke: bool):
    """The step function of bench_block.py's Bench on the case's path, batch, sequence and heads (smoke:
    bench_block's small config at 64 tokens, mxmla's torch backend)."""
    import bench_block as bb

    if smoke:
        return bb.Bench(bb.block_config(1, 64, smoke=True), case["path"], backend="torch", device="cpu").step
    cfg = bb.mb.replace(bb.mb.CONFIGS["deepseek"], batch=case["batch"], seq=case["seq"], heads=case["heads"])
    return bb.Bench(cfg, case["path"]).step


def _hf_step(case, smoke: bool):
    """The step function of transformers' DeepseekV3Attention at DeepSeek-V3 sizes (hf_layer.py's config),
    patched to mxfp8 with an optimizer registered for its weight copies (as a training run does; a
    compiled forward then reads the copies), compiled as hf_layer.py's mxfp8_compile row when the case
    says so. smoke: hf_layer.py's tiny config at 64 tokens on the CPU, mxmla's torch backend, aot_eager."""
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    import hf_layer

    from dispatch.integrations.transformers import patch_state

    if smoke:
        device, batch, seq, backend, compile_backend = "cpu", 1, 64, "torch", "aot_eager"
        config = hf_layer._config(True, max_positions=seq)
    else:
        device, batch, seq, backend, compile_backend = "cuda", case["batch"], case["seq"], None, "inductor"
        config = hf_layer._config(False, num_attention_heads=case["heads"], num_key_value_heads=case["heads"],
                                  max_positions=seq)
    torch.manual_seed(0)
    attn = DeepseekV3Attention(config, layer_idx=0)
    with torch.no_grad():
        for p in attn.parameters():
            if p.dim() == 2:
                p.normal_(0.0, config.initializer_range)
    attn = attn.to(device=device, dtype=torch.bfloat16)
    optimizer = torch.optim.SGD(attn.parameters(), lr=hf_layer.UPDATE_LR)
    variant = "mxfp8_compile" if case["compiled"] else "mxfp8"
    attn = hf_layer._patch(attn, variant, backend, optimizer)
    call = hf_layer._layer_call(attn, variant, argparse.Namespace(compile_backend=compile_backend))
    rotary = DeepseekV3RotaryEmbedding(config).to(device)
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(batch, seq, config.hidden_size, generator=gen).to(device, torch.bfloat16)
    h.requires_grad_(True)
    grad = (torch.randn(h.shape, generator=gen) * 1e-3).to(device, torch.bfloat16)
    position_ids = torch.arange(seq, device=device)[None]
    cos_sin = rotary(h, position_ids)

    def step():
        out, _ = call(h, position_embeddings=cos_sin, attention_mask=None)
        out.backward(grad)
        state = patch_state(attn)
        # transformers' own attention ran (eager: counted per call; compiled: per trace): not the path
        # this measures; nor is a compiled graph that quantizes the weight in every forward
        wrong = dict(state.fallbacks)
        wrong.update({k: n for k, n in state.traced.items() if k != "served"})
        if state.quantized_in_graph:
            wrong["weight quantized in the graph"] = state.quantized_in_graph
        if wrong:
            raise RuntimeError(f"the patched layer did not run mxmla's mxfp8 path: {wrong}")

    return step


def child(name: str, breakdown: bool, smoke: bool = False) -> None:
    """One case's first step in this process: 'FIRST_STEP {json}' on stdout (and its breakdown)."""
    t0 = time.perf_counter()
    case = CASES[name]
    sys.path.insert(0, ROOT)
    if case["compiled"] and not smoke:
        # Inductor's import (its lowerings and kernel templates: seconds) belongs to build in every compiled
        # case: torch.compile makes it at construction without fullgraph (block-compile-bf16) and at the
        # first call with fullgraph=True (the mxfp8 cases), which would put it in their steps only
        import torch._inductor.compile_fx  # noqa: F401
    step = (_hf_step if case["kind"] == "hf" else _block_step)(case, smoke)
    _sync()
    t1 = time.perf_counter()
    costs = None
    if breakdown:
        from bench_block import FirstCallCosts

        costs = FirstCallCosts()
        costs.__enter__()
    before = compile_seconds()
    try:
        step()
        _sync()
    finally:
        if costs is not None:
            costs.__exit__(None, None, None)
    t2 = time.perf_counter()
    spent = {k: v - before[k] for k, v in compile_seconds().items()}
    print("FIRST_STEP " + json.dumps({"step_s": t2 - t1, "build_s": t1 - t0, "compile_s": sum(spent.values()),
                                      "compile_by_timer_s": spent}), flush=True)
    for line in costs.lines() if costs is not None else ():
        print("FIRST_PROFILE " + line, flush=True)


def run_case(name: str, breakdown: bool, deadline: float | None = None, smoke: bool = False) -> dict:
    """The case's fresh and second process (see the module docstring); `deadline` (time.perf_counter())
    shortens each child's limit to what is left of the run's budget."""
    out = {"case": name, "label": CASES[name]["label"], "compiled": CASES[name]["compiled"]}
    with tempfile.TemporaryDirectory(prefix="mxmla_first_step_") as cache:
        env = benchlib.empty_cache_env(cache)
        for which in ("fresh", "second"):
            limit = CHILD_TIMEOUT_S if deadline is None else min(CHILD_TIMEOUT_S, deadline - time.perf_counter())
            if limit < MIN_CHILD_S:
                out[f"{which}_error"] = "not run: the run's time budget (--budget) is spent"
                break
            cmd = [sys.executable, os.path.abspath(__file__), "--child", name]
            if breakdown and which == "fresh":
                cmd.append("--breakdown")
            if smoke:
                cmd.append("--smoke")
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
            except subprocess.TimeoutExpired:
                out[f"{which}_error"] = f"timed out after {limit:.0f} s"
                break
            out[f"{which}_process_s"] = time.perf_counter() - t0
            lines = proc.stdout.splitlines()
            rec = [ln for ln in lines if ln.startswith("FIRST_STEP ")]
            if proc.returncode or not rec:
                out[f"{which}_error"] = (proc.stderr or proc.stdout)[-1500:]
                break
            got = json.loads(rec[-1][len("FIRST_STEP "):])
            out[f"{which}_s"], out[f"{which}_build_s"] = got["step_s"], got["build_s"]
            out[f"{which}_compile_s"] = got["compile_s"]
            out[f"{which}_profile"] = [ln[len("FIRST_PROFILE "):] for ln in lines if ln.startswith("FIRST_PROFILE ")]
    return out


def table(rows) -> str:
    def cell(v, width):
        return f"{v:>{width}.1f}" if isinstance(v, float) else f"{'-':>{width}}"

    def compile_cell(r, which, width):  # an eager case compiles nothing: "-" rather than 0.0
        return cell(r.get(f"{which}_compile_s") if r.get("compiled") else None, width)

    lines = [f"{'path':52} {'fresh s':>8} {'compile s':>10} {'second process s':>17} {'2nd compile s':>14} "
             f"{'fresh build s':>14}"]
    for r in rows:
        lines.append(f"{r['label']:52} {cell(r.get('fresh_s'), 8)} {compile_cell(r, 'fresh', 10)} "
                     f"{cell(r.get('second_s'), 17)} {compile_cell(r, 'second', 14)} {cell(r.get('fresh_build_s'), 14)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=None, help=f"comma list of {', '.join(CASES)} (default: all; --smoke: "
                                                  f"{', '.join(SMOKE_CASES)})")
    ap.add_argument("--budget", type=float, default=BUDGET_S, metavar="S",
                    help=f"seconds for the whole run (default {BUDGET_S}); cases past it are not run")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--breakdown", action="store_true", help="where each fresh step's seconds go")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: each case's step runs")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.breakdown, args.smoke)
        return 0
    start = time.perf_counter()
    if args.cases is None:
        args.cases = ",".join(SMOKE_CASES if args.smoke else DEFAULT_CASES)
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in names if c not in CASES]
    if bad or not names:
        ap.error(f"--cases: expected names from {', '.join(CASES)}, got {args.cases!r}")
    if not args.budget > 0:
        ap.error(f"--budget: expected a positive number of seconds, got {args.budget}")
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print("first_step: needs a CUDA device (the MXFP8 path's kernels; --smoke runs tiny sizes on the CPU)")
        return 2
    device = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    print(f"device {device}; torch {torch.__version__}", flush=True)
    if args.smoke:
        print("smoke: tiny sizes (not the shapes the labels name); a check that each step runs", flush=True)
    rows = []
    for name in names:
        row = run_case(name, args.breakdown, deadline=start + args.budget, smoke=args.smoke)
        rows.append(row)
        for key in ("fresh_error", "second_error"):
            if row.get(key):
                print(f"{row['label']}: {key}:\n{row[key]}", flush=True)
        for ln in row.get("fresh_profile", ()):
            print(f"  [{name} fresh] {ln}", flush=True)
    print(table(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "rows": rows}, f, indent=1)
    return 1 if args.smoke and any(r.get("fresh_error") or r.get("second_error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
