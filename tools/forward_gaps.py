"""Where a synchronized block step leaves the GPU idle: one profiled step per path (torch.profiler, CPU
and CUDA), the step's kernels in GPU order, and for each the idle time before it and the host op that
launched it (the innermost mxmla / aten op around its launch). Printed per path: the forward's and the
backward's GPU busy and idle time, then the idle time summed by launching op, largest first.

    python tools/forward_gaps.py [--paths mxfp8,bf16,torch] [--shape B1S4096] [--top 25] [--smoke]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import bench_block as bb  # noqa: E402


def _events(prof):
    """(kernels [(start, end, name, correlation)], host ops [(start, end, name)], runtime launches
    {correlation: start}) in microseconds, from the profiler's Chrome trace."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    kernels, cpu, launches = [], [], {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X":
            continue
        cat, start, end = ev.get("cat", ""), float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0))
        corr = ev.get("args", {}).get("correlation")
        if cat in ("kernel", "gpu_memset", "gpu_memcpy"):
            kernels.append((start, end, ev["name"], corr))
        elif cat == "cuda_runtime" or cat == "cuda_driver":
            if corr is not None:
                launches[corr] = start
        elif cat in ("cpu_op", "user_annotation", "python_function"):
            cpu.append((start, end, ev["name"]))
    return sorted(kernels), sorted(cpu), launches


def _owner(cpu, at):
    """The innermost named host op (not an allocation) whose range holds host time `at`."""
    best = None
    for start, end, name in cpu:
        if start > at:
            break
        if end >= at and not name.startswith(("aten::empty", "aten::zeros")) and name != "step":
            if best is None or start >= best[0]:
                best = (start, end, name)
    return best[2] if best else "?"


def analyse(bench, top):
    cuda = torch.cuda.is_available()
    for _ in range(3):
        bench.step()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        with record_function("step"):
            bench.step()
        if cuda:
            torch.cuda.synchronize()
    kernels, cpu, launches = _events(prof)
    backward_at = min((s for s, _, n in cpu if n.startswith("autograd::engine")), default=float("inf"))
    idle = collections.Counter()
    busy, gaps = collections.Counter(), collections.Counter()
    prev_end = None
    for start, end, name, corr in kernels:
        at = launches.get(corr)
        phase = "bwd" if at is not None and at >= backward_at else "fwd"
        if prev_end is not None and start > prev_end:
            gap = start - prev_end
            gaps[phase] += gap
            idle[(phase, _owner(cpu, at) if at is not None else "?", name[:70])] += gap
        busy[phase] += end - start
        prev_end = end if prev_end is None else max(prev_end, end)
    for phase in ("fwd", "bwd"):
        print(f"  {phase}: GPU busy {busy[phase] / 1e3:.2f} ms, idle before its kernels {gaps[phase] / 1e3:.2f} ms")
    for (phase, op, kernel), us in idle.most_common(top):
        print(f"  {phase} {us:8.1f} us idle before  {kernel:70s}  launched in {op}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--paths", default="mxfp8,bf16,torch")
    ap.add_argument("--shape", default="B1S4096")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU (no kernels: checks the script)")
    args = ap.parse_args()
    b, s = (2, 128) if args.smoke else bb.parse_shape(args.shape)
    for path in args.paths.split(","):
        bench = bb.Bench(bb.block_config(b, s, args.smoke), path)
        print(f"== {path} {'B2S128 (smoke)' if args.smoke else args.shape}")
        analyse(bench, args.top)
        del bench
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
