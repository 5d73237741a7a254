"""Where the GPU idles in back-to-back block steps (B1 S4096 by default): a torch.profiler trace of a
few steps issued without synchronisation, per path: the GPU's busy and idle time over the window, the
longest idle gaps (the kernels around each and the Python frames that issued the kernel ending it),
and every host-synchronising CUDA runtime call with the frames that made it.

    python tools/profile_block_gaps.py [--paths mxfp8,bf16,torch] [--steps 4] [--trace-dir DIR]
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import sys
import tempfile
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

SYNC_NAMES = ("Synchronize", "cudaMemcpy ", "cudaMemcpy\0", "cudaFree", "cudaMalloc", "cudaHostAlloc")


def _frames_at(py_events, tid, ts, ours=("mxmla", "backends", "dispatch", "examples", "bench_block")):
    """Innermost-last names of the python_function events on thread tid enclosing ts, our files only."""
    out = []
    for ev in py_events.get(tid, ()):
        if ev["ts"] <= ts <= ev["ts"] + ev.get("dur", 0):
            name = ev["name"]
            if any(o in name for o in ours):
                out.append(name.split("/")[-1])
    return out[-4:]


def analyse(trace: dict, top: int = 10) -> list:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    runtime = [e for e in events if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver"]
    by_corr = {e["args"].get("correlation"): e for e in runtime if "args" in e}
    py = defaultdict(list)
    for e in events:
        if e.get("cat") == "python_function":
            py[e["tid"]].append(e)
    for v in py.values():
        v.sort(key=lambda e: e["ts"])
    lines = []
    if not kernels:
        return ["no kernels in the trace"]
    start, end = kernels[0]["ts"], max(k["ts"] + k["dur"] for k in kernels)
    busy, cur_s, cur_e = 0.0, kernels[0]["ts"], kernels[0]["ts"] + kernels[0]["dur"]
    gaps = []
    prev = kernels[0]
    for k in kernels[1:]:
        ks, ke = k["ts"], k["ts"] + k["dur"]
        if ks > cur_e:
            busy += cur_e - cur_s
            gaps.append((ks - cur_e, prev, k))
            cur_s, cur_e = ks, ke
        else:
            cur_e = max(cur_e, ke)
        if ke >= cur_e:
            prev = k
    busy += cur_e - cur_s
    span = end - start
    lines.append(f"window {span / 1e3:.3f} ms, GPU busy {busy / 1e3:.3f} ms, idle {(span - busy) / 1e3:.3f} ms "
                 f"over {len(gaps)} gaps ({sum(1 for g in gaps if g[0] > 20)} over 20 us), {len(kernels)} kernels")
    gaps.sort(key=lambda g: -g[0])
    for dur, before, after in gaps[:top]:
        launch = by_corr.get(after.get("args", {}).get("correlation"))
        frames = _frames_at(py, launch["tid"], launch["ts"]) if launch else []
        lines.append(f"  gap {dur:8.1f} us  after {before['name'][:40]:40}  before {after['name'][:40]:40}  "
                     f"issued by {' > '.join(frames) or '?'}")
    syncs = defaultdict(lambda: [0, 0.0, None])
    for e in runtime:
        if any(s.strip("\0") in e["name"] for s in SYNC_NAMES) and "Async" not in e["name"] or \
                e["name"].startswith("cudaMemcpyAsync") and e.get("dur", 0) > 20:
            frames = tuple(_frames_at(py, e["tid"], e["ts"]))
            rec = syncs[(e["name"], frames)]
            rec[0] += 1
            rec[1] += e.get("dur", 0)
    for (name, frames), (n, dur, _) in sorted(syncs.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  host call {name:28} x{n:<3} {dur / 1e3:8.3f} ms  from {' > '.join(frames) or '?'}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default="mxfp8,bf16,torch")
    ap.add_argument("--shape", default="B1S4096")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--trace-dir", default=None, help="keep the gzipped chrome traces here")
    ap.add_argument("--smoke", action="store_true", help="the small config (runs on CPU; no kernels to analyse)")
    args = ap.parse_args()
    sys.argv = [sys.argv[0], "--quick"]
    import bench_block as bb

    b, s = bb.parse_shape(args.shape)
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for path in args.paths.split(","):
        bench = bb.Bench(bb.block_config(b, s, args.smoke), path)
        for _ in range(3):
            bench.step()
        try:
            from dispatch.warmup import wait_background_compiles
            wait_background_compiles()
        except ImportError:
            pass
        for _ in range(2):
            bench.step()
        sync()
        with profile(activities=acts, with_stack=True) as prof:
            for _ in range(args.steps):
                bench.step()
            sync()
        with tempfile.TemporaryDirectory() as tmp:
            p = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(p)
            with open(p) as f:
                trace = json.load(f)
            if args.trace_dir:
                os.makedirs(args.trace_dir, exist_ok=True)
                with gzip.open(os.path.join(args.trace_dir, f"gaps_{path}_{args.shape}.json.gz"), "wt") as f:
                    json.dump(trace, f)
        print(f"== {path} {args.shape}: {args.steps} steps back to back", flush=True)
        for line in analyse(trace):
            print(line, flush=True)
        del bench
    return 0


if __name__ == "__main__":
    sys.exit(main())
