"""Where a compiled block path's first step spends its time in a process whose caches are filled.

    python3 benchmarks/first_step_profile.py [mxfp8-compile,compile]

Per path (bench_block.py's paths, B1 S4096, DeepSeek-V3 sizes, CUDA), three processes share empty Triton,
Inductor and mxmla caches: the first fills them; the second prints its forward / backward / weight-refresh seconds,
torch.compile's timers (torch._dynamo.utils.compilation_time_metrics) and dynamo's per-function tracing
table (TORCH_COMPILE_DYNAMO_PROFILER=1); the third runs the step under cProfile and prints its costliest
functions (cProfile slows it: read its shares, not its seconds).
"""
import io
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import benchlib  # noqa: E402


def child(path: str, profile: bool) -> None:
    sys.path.insert(0, ROOT)
    import cProfile
    import pstats

    import torch
    from torch._dynamo.utils import compilation_time_metrics

    import torch._inductor.compile_fx  # noqa: F401 (as first_step.py's build: no step pays Inductor's import)

    import bench_block as bb

    cfg = bb.mb.replace(bb.mb.CONFIGS["deepseek"], batch=1, seq=4096, heads=128)
    bench = bb.Bench(cfg, path)
    torch.cuda.synchronize()
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    out = bench.forward(bench.h, bench.cos, bench.sin)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    out.backward(bench.dout)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    if bench.requantize is not None:  # the weight copies' refresh that ends bench_block's step
        bench.requantize()
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    if prof:
        prof.disable()
    print(f"RESULT {path} prof={profile} fwd {t1 - t0:.3f} bwd {t2 - t1:.3f} requant {t3 - t2:.3f} total {t3 - t0:.3f}")
    for key, secs in sorted(compilation_time_metrics.items(), key=lambda kv: -sum(kv[1]))[:22]:
        print(f"  {sum(secs):7.3f} {len(secs):3d} {key}")
    if prof:
        for order, n in (("cumulative", 70), ("tottime", 25)):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(order).print_stats(n)
            print("\n".join(line[:190] for line in text.getvalue().splitlines() if "importlib._bootstrap" not in line))


def main(paths) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("first_step_profile.py times CUDA steps: no CUDA device here")
    for path in paths:
        with tempfile.TemporaryDirectory(prefix="mxmla_first_step_profile_") as cache:
            env = benchlib.empty_cache_env(cache)
            for run, profile, dynamo_table in (("fresh", False, False), ("second", False, True), ("third", True, False)):
                run_env = dict(env, TORCH_COMPILE_DYNAMO_PROFILER="1") if dynamo_table else env
                t0 = time.perf_counter()
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", path, str(int(profile))],
                                      env=run_env, capture_output=True, text=True)
                print(f"== {path} {run}: rc {proc.returncode}, {time.perf_counter() - t0:.1f} s process")
                lines = proc.stdout.splitlines()
                print("\n".join(l for l in lines if l.startswith("RESULT")) if run == "fresh" else "\n".join(lines))
                if proc.returncode:
                    print(proc.stderr[-1500:])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3] == "1")
    else:
        main((sys.argv[1] if len(sys.argv) > 1 else "mxfp8-compile,compile").split(","))
