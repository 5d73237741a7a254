"""The DeepSeek-V3 MLA attention block (examples/mla_block.py: hidden 7168, 128 heads, q_lora 1536,
kv_lora 512, head dims 128 + 64 / 128), forward + backward, on every path a user would pick:

  mxfp8    every mxmla op on its MXFP8 path (rmsnorm_mxfp8, the fused Q up-projection + RoPE + quantize
           with the MXFP8 backward, MXFP8 k / v, mla_attention on MXFP8 inputs), through dispatch
  bf16     the same block in bf16 through mxmla (bf16 GEMM, rope, mla_attention)
  torch    pure torch bf16: matmuls, RoPE in torch, F.scaled_dot_product_attention (its fastest backend)
  compile  torch.compile of the pure-torch block
  mxfp8-compile  torch.compile(fullgraph=True) of the mxfp8 block: the same custom ops (RMSNorm + fused Q
           up-projection as one op, k and v as one op, attention), backends resolved at trace time, W_UQ's
           persistent MXFP8 copies read as graph inputs (refreshed in place after each step)
  bf16-compile   torch.compile(fullgraph=True) of the bf16 block
  mxfp8-cudagraph, compile-cudagraph   the same compiles with mode="reduce-overhead" (CUDA graphs: the
           step's kernels replayed without host issue cost)

    python benchmarks/bench_block.py [--quick] [--shapes B1S4096,B2S4096,B1S16384] [--paths ...] [--json PATH]
    python benchmarks/bench_block.py --smoke          # tiny config on CPU (torch backend), seconds
    python benchmarks/bench_block.py --smoke --paths mxfp8,mxfp8-compile,bf16-compile   # compiled with aot_eager

A step is forward + backward of the block with its input already on the GPU (h [B*S, 7168] bf16 with
requires_grad, a fixed random output gradient), the weights' gradients set to None before each step
and every weight's version counter bumped after it (what an optimizer step does: a per-step weight
cache must re-quantize); on the mxfp8 path the step ends with the refresh of W_UQ's persistent MXFP8
copies that `WeightCopies.refresh_after` does after an optimizer step (timed in the step, in bwd ms;
the next forward reads the copies). Per shape and path:
- step ms: median of CUDA-event step times, the paths taking turns (--rounds rounds of --steps steps
  each, after warm-up), so clock drift weighs on all paths alike; fwd / bwd ms likewise, from events
  around the forward; each step is synchronized, so a forward bound by its host issue time shows;
- b2b ms: per-step time of --steps steps issued back to back without synchronizing (events around
  them, median over the rounds, in the same turns): a training loop that does not read a value back
  every step, where the host issues the next forward while the GPU runs the previous backward;
- activation GiB: memory allocated at the end of the forward minus before it (what the backward keeps);
  peak GiB: the step's peak allocation minus the memory before it (activations + gradients + workspace);
- host ms: wall time the host takes to issue one step; gpu-bound ms: the step timed with the host kept
  ahead (a sleep kernel queued first), i.e. its GPU work alone; step ms above it is host-issue cost;
- a GPU-time table of the step's kernels (torch.profiler, one profiled step after the timed ones);
- first step: the first step's wall time in a fresh process with empty Triton, Inductor and mxmla
  (cuDNN plan) caches, and again in a second process sharing those caches (--first-step; a child
  process per path).
"""
from __future__ import annotations

import argparse
import json
import cProfile
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
import benchlib  # noqa: E402

PATHS = ("mxfp8", "bf16", "torch", "compile", "mxfp8-compile", "bf16-compile", "mxfp8-cudagraph", "compile-cudagraph")
BLOCK_PATH = {"compile": "torch", "mxfp8-compile": "mxfp8", "bf16-compile": "bf16",  # compiled path -> block
              "mxfp8-cudagraph": "mxfp8", "compile-cudagraph": "torch"}
CUDAGRAPH_PATHS = ("mxfp8-cudagraph", "compile-cudagraph")
DEFAULT_SHAPES = ("B1S4096", "B2S4096", "B1S16384")


def parse_shape(text: str):
    t = text.strip().upper()
    try:
        b, s = t[1:].split("S")
        if not t.startswith("B"):
            raise ValueError
        b, s = int(b), int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes: expected entries like B1S4096, got {text!r}") from None
    if b <= 0 or s <= 0 or s % 128:
        raise argparse.ArgumentTypeError(f"--shapes: B and S positive, S a multiple of 128, got {text!r}")
    return b, s


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="B1 S4096 only, fewer steps")
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU (torch backend)")
    ap.add_argument("--shapes", default=None, help=f"comma list (default {','.join(DEFAULT_SHAPES)})")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma list of {', '.join(PATHS)}")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per path per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds in which the paths take turns")
    ap.add_argument("--first-step", action="store_true", help="also time the first step in fresh processes")
    ap.add_argument("--first-step-only", action="store_true", help="only the first-step times (no timed steps)")
    ap.add_argument("--first-cprofile", type=int, default=0, metavar="N",
                    help="with --first-step(-only): a third process (caches filled) runs the first step under "
                         "cProfile and reports its N costliest functions (own and cumulative time)")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-kernel GPU-time tables")
    ap.add_argument("--kernel-top", type=int, default=14, metavar="N",
                    help="kernels listed per path in the GPU-time tables (their total counts every kernel)")
    ap.add_argument("--launchers", type=int, default=0, metavar="N",
                    help="also the N eager torch ops whose kernels take most GPU time per path, with their "
                         "input shapes and the mxmla custom op they ran inside (what Inductor did not fuse)")
    ap.add_argument("--host-profile", action="store_true", help="also a host-time table by op per path")
    ap.add_argument("--backend", default=None, help="backend for every mxmla op (default: automatic)")
    benchlib.add_common_args(ap, tokens_axis=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one first step, JSON to stdout
    args = ap.parse_args(argv)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in PATHS]
    if bad or not paths:
        ap.error(f"--paths: expected names from {', '.join(PATHS)}, got {args.paths!r}")
    if args.no_compile or (args.smoke and args.paths == ",".join(PATHS)):
        # --smoke: torch.compile on a CPU means a C++ toolchain and minutes (name the paths to run them)
        paths = [p for p in paths if p not in BLOCK_PATH]
    args.paths = paths
    if args.shapes:
        args.shape_list = [parse_shape(s) for s in args.shapes.split(",") if s.strip()]
    elif args.smoke:
        args.shape_list = [(2, 128)]
    elif args.quick:
        args.shape_list = [parse_shape("B1S4096")]
    else:
        args.shape_list = [parse_shape(s) for s in DEFAULT_SHAPES]
    if args.smoke:
        args.steps, args.rounds = 1, 1
    return args


ARGS = parse_args() if __name__ == "__main__" else None

import torch  # noqa: E402

import examples.mla_block as mb  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GIB = float(1 << 30)


def block_config(b: int, s: int, smoke: bool):
    base = mb.CONFIGS["small" if smoke else "deepseek"]
    return mb.replace(base, batch=b, seq=s)


class Bench:
    """One path's block, inputs and step function, on `device` (default: this machine's DEVICE; a caller
    whose process group serves another device, e.g. gloo's CPU on a GPU machine, names it)."""

    def __init__(self, cfg, path: str, backend=None, seed: int = 0, device=None):
        self.device = torch.device(DEVICE if device is None else device)
        block_path = BLOCK_PATH.get(path, path)
        self.block = mb.MLABlock(cfg, block_path, quantize_grad=True, backend=backend).reset_parameters(seed).to(self.device)
        self.cudagraph = path in CUDAGRAPH_PATHS and self.device.type == "cuda"
        if path == "compile":
            self.forward = torch.compile(self.block)
        elif self.cudagraph:
            self.forward = torch.compile(self.block, fullgraph=block_path != "torch", mode="reduce-overhead")
        elif path in BLOCK_PATH:
            # the mxmla blocks in one graph (fullgraph: a graph break raises); on a CPU (--smoke) without
            # Inductor's C++ toolchain: AOTAutograd's graphs run eagerly
            self.forward = torch.compile(self.block, fullgraph=True,
                                         backend="inductor" if self.device.type == "cuda" else "aot_eager")
        else:
            self.forward = self.block
        gen = torch.Generator().manual_seed(seed + 7)
        self.h = (torch.randn(cfg.tokens, cfg.hidden, generator=gen)).to(torch.bfloat16).to(self.device).requires_grad_(True)
        self.dout = (torch.randn(cfg.tokens, cfg.hidden, generator=gen) * 1e-3).to(torch.bfloat16).to(self.device)
        self.cos, self.sin = mb.rope_tables(cfg, self.device)
        self.params = list(self.block.parameters())
        self.bump = getattr(torch.autograd.graph, "increment_version", None)
        self.requantize = self.block.requantize_weights if block_path == "mxfp8" else None

    def step(self, events=None):
        for p in self.params:
            p.grad = None
        self.h.grad = None
        if self.cudagraph:  # the previous step's graph outputs are dead: replay may reuse their memory
            torch.compiler.cudagraph_mark_step_begin()
        if events:
            events[0].record()
        out = self.forward(self.h, self.cos, self.sin)
        if events:
            events[1].record()
        out.backward(self.dout)
        if self.bump is not None:  # an optimizer step would change every weight: per-step caches refresh
            for p in self.params:
                self.bump(p)
        if self.requantize is not None:  # the mxfp8 path's weight copies, refreshed as refresh_after's step hook does
            self.requantize()
        if events:
            events[2].record()
        return out

    def memory(self):
        """(activation GiB, peak GiB) of one step: see the module docstring."""
        if DEVICE != "cuda":
            return None, None
        for p in self.params:
            p.grad = None
        self.h.grad = None
        if self.cudagraph:
            torch.compiler.cudagraph_mark_step_begin()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = self.forward(self.h, self.cos, self.sin)
        torch.cuda.synchronize()
        act = torch.cuda.memory_allocated() - base
        out.backward(self.dout)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        return act / GIB, peak / GIB


def timed_steps(bench: Bench, n: int):
    """[(step ms, fwd ms, bwd ms)] of n steps (CUDA events; wall clock on CPU)."""
    out = []
    for _ in range(n):
        if DEVICE == "cuda":
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            bench.step(ev)
            torch.cuda.synchronize()
            out.append((ev[0].elapsed_time(ev[2]), ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])))
        else:
            t0 = time.perf_counter()
            bench.step()
            out.append(((time.perf_counter() - t0) * 1e3, None, None))
    return out


def back_to_back_ms(bench: Bench, n: int) -> float:
    """Mean ms per step of n steps issued with no synchronisation between them (CUDA events around all
    n; wall clock on CPU): the rate of a training loop that does not read a value back every step, where
    the host issues step i+1's forward while the GPU still runs step i's backward, so a forward bound by
    its host issue time is hidden behind the previous backward's GPU work."""
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        for _ in range(n):
            bench.step()
        return (time.perf_counter() - t0) * 1e3 / n
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        bench.step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def host_ms(bench: Bench, n: int = 3) -> float:
    """Median wall ms the host spends issuing one step (the GPU idle before it): above the step's GPU
    time, the path is bound by its Python / launch overhead."""
    out = []
    for _ in range(n):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        bench.step()
        out.append((time.perf_counter() - t0) * 1e3)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    return statistics.median(out)


def gpu_bound_ms(bench: Bench, n: int = 3):
    """(step, fwd, bwd) median ms with the host kept ahead of the GPU: a sleep kernel queued before the
    step lets the host issue all of it first, so the events time the step's GPU work alone. Its gap to
    the plain step is what the host's issue rate costs (None on CPU)."""
    if DEVICE != "cuda":
        return None, None, None
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        torch.cuda._sleep(SLEEP_CYCLES)
        bench.step(ev)
        torch.cuda.synchronize()
        out.append((ev[0].elapsed_time(ev[2]), ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])))
    return tuple(statistics.median(v[i] for v in out) for i in range(3))


# ~60 ms at the H200's 1.98 GHz: longer than any path's host issue time of one step
SLEEP_CYCLES = 120_000_000


def host_table(bench: Bench, top: int = 18, cumulative: bool = False):
    """[(function, own host ms, calls)] of one forward (cProfile: Python-level, where the host time of a
    path's forward goes; the forward issues the most small launches). cumulative: the project's own
    functions by time including their callees instead (which layer of an op costs)."""
    for p in bench.params:
        p.grad = None
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    out = bench.forward(bench.h, bench.cos, bench.sin)
    prof.disable()
    del out
    stats = pstats.Stats(prof).stats
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ours = tuple(os.path.join(root, d) for d in ("backends", "dispatch", "spec"))
    rows = [(f"{os.path.basename(f)}:{line} {name}", (ct if cumulative else tt) * 1e3, nc)
            for (f, line, name), (cc, nc, tt, ct, _) in stats.items() if not cumulative or f.startswith(ours)]
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def kernel_table(bench: Bench, top: int = 14):
    """[(kernel name, GPU ms per step, share)] from torch.profiler over one step."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if DEVICE == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        bench.step()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0)
        if DEVICE != "cuda":
            t = ev.self_cpu_time_total
        if t > 0:
            rows.append((ev.key, t / 1e3))
    rows.sort(key=lambda r: -r[1])
    total = sum(t for _, t in rows) or 1.0
    return [(name, ms, ms / total) for name, ms in rows[:top]], total


def launcher_table(bench: Bench, top: int = 20):
    """[(GPU ms per step, eager op, its input shapes, enclosing mxmla custom op or "")]: the kernels each
    eager torch op launched itself (not its callees'), summed per (op, shapes, custom op). Inductor's and
    mxmla's Triton kernels are launched from Python, not by a torch op, so they are not in it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        bench.step()
        torch.cuda.synchronize()
    sums = {}
    for ev in prof.events():
        ms = sum(k.duration for k in getattr(ev, "kernels", [])) / 1e3
        if ms <= 0 or not ev.name.startswith("aten::"):
            continue
        owner, parent = "", ev.cpu_parent
        while parent is not None and not owner:
            owner = parent.name if parent.name.startswith("mxmla::") else ""
            parent = parent.cpu_parent
        key = (ev.name, str([list(x) for x in ev.input_shapes if x]), owner)
        sums[key] = sums.get(key, 0.0) + ms
    rows = sorted(((ms,) + key for key, ms in sums.items()), reverse=True)
    return rows[:top]


def child_first_step(args) -> None:
    """One first step of one path in this (fresh) process: JSON {"first_step_s", "build_s"} on stdout."""
    (b, s), path = args.shape_list[0], args.paths[0]
    t0 = time.perf_counter()
    bench = Bench(block_config(b, s, args.smoke), path, args.backend)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    prof = None
    if args.first_cprofile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    with FirstCallCosts() as costs:
        bench.step()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    t2 = time.perf_counter()
    if prof is not None:
        prof.disable()
    print("FIRST_STEP " + json.dumps({"first_step_s": t2 - t1, "build_s": t1 - t0}), flush=True)
    for line in costs.lines() + (cprofile_lines(prof, args.first_cprofile) if prof is not None else []):
        print("FIRST_PROFILE " + line, flush=True)


def cprofile_lines(prof, top: int):
    """The `top` functions of a cProfile run by own time and by time with callees (seconds, calls)."""
    import pstats

    stats = pstats.Stats(prof).stats
    out = []
    for title, col in (("cProfile, own time", 2), ("cProfile, with callees", 3)):
        out.append(f"{title}:")
        for (f, line, func), row in sorted(stats.items(), key=lambda kv: -kv[1][col])[:top]:
            where = f"{os.path.basename(os.path.dirname(f))}/{os.path.basename(f)}:{line}" if line else f
            out.append(f"   {row[col]:7.3f} s {row[1]:6d}x  {where} {func}"[:160])
    return out


def _autotuned_name(tuner) -> str:
    from backends.triton.pretuned import _base_function

    return getattr(_base_function(tuner), "__name__", "?")


class FirstCallCosts:
    """Where a first step's seconds go: each dispatched op's first call (synchronized, wall), and inside
    them Triton's compilations and autotuning runs by kernel (JITFunction._do_compile and
    Autotuner._bench wrapped while this is entered; a Triton without them reports ops only)."""

    def __init__(self):
        self.ops, self.compiles, self.benches = {}, {}, {}
        self._undo = []

    def _wrap(self, owner, name, table, label):
        real = getattr(owner, name, None)
        if real is None:
            return

        def timed(obj, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(obj, *args, **kwargs)
            finally:
                key = label(obj)
                n, sec = table.get(key, (0, 0.0))
                table[key] = (n + 1, sec + time.perf_counter() - t0)

        setattr(owner, name, timed)
        self._undo.append((owner, name, real))

    def __enter__(self):
        import dispatch

        try:
            from triton.runtime import autotuner, jit
            self._wrap(jit.JITFunction, "_do_compile", self.compiles, lambda f: getattr(f, "__name__", "?"))
            self._wrap(autotuner.Autotuner, "_bench", self.benches, _autotuned_name)
        except ImportError:
            pass
        real_run = dispatch.run

        def run(op, *args, **kwargs):
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                return real_run(op, *args, **kwargs)
            finally:
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                n, sec = self.ops.get(op, (0, 0.0))
                self.ops[op] = (n + 1, sec + time.perf_counter() - t0)

        dispatch.run = run
        self._undo.append((dispatch, "run", real_run))
        return self

    def __exit__(self, *exc):
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)
        return False

    def lines(self):
        out = []
        for title, table in (("op (dispatch.run, synced)", self.ops), ("compile", self.compiles),
                             ("autotune timing", self.benches)):
            total = sum(sec for _, sec in table.values())
            out.append(f"{title}: {total:.2f} s")
            for key, (n, sec) in sorted(table.items(), key=lambda kv: -kv[1][1])[:12]:
                out.append(f"   {sec:7.2f} s {n:4d}x  {key}")
        return out


def first_steps(shape, path, backend, smoke, cprofile: int = 0) -> dict:
    """First-step seconds in a fresh process (empty Triton, Inductor and mxmla caches) and a second one; with
    `cprofile`, a third process's first step under cProfile (its profile only: cProfile slows it)."""
    b, s = shape
    out = {}
    with tempfile.TemporaryDirectory(prefix="mxmla_first_step_") as cache:
        env = benchlib.empty_cache_env(cache)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--shapes", f"B{b}S{s}", "--paths", path]
        if smoke:
            cmd.append("--smoke")
        if backend:
            cmd += ["--backend", backend]
        for key in ("fresh", "second") + (("profiled",) if cprofile else ()):
            t0 = time.perf_counter()
            run = cmd + (["--first-cprofile", str(cprofile)] if key == "profiled" else [])
            proc = subprocess.run(run, env=env, capture_output=True, text=True, timeout=900)
            wall = time.perf_counter() - t0
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("FIRST_STEP ")]
            if proc.returncode or not line:
                out[key] = None
                out[f"{key}_error"] = (proc.stderr or proc.stdout)[-400:]
                continue
            rec = json.loads(line[-1][len("FIRST_STEP "):])
            out[key] = rec["first_step_s"]
            out[f"{key}_profile"] = [ln[len("FIRST_PROFILE "):] for ln in proc.stdout.splitlines()
                                     if ln.startswith("FIRST_PROFILE ")]
            out[f"{key}_process_s"] = wall
    return out


def measure_first_steps(rec: benchlib.Recorder, args) -> None:
    for b, s in args.shape_list:
        for path in args.paths:
            fs = first_steps((b, s), path, args.backend, args.smoke, args.first_cprofile)
            rec.row(op="mla_block first step", shape=f"B{b} S{s}", impl=path, path=path, tokens=b * s,
                    first_step_fresh_s=fs.get("fresh"), first_step_second_s=fs.get("second"),
                    fresh_process_s=fs.get("fresh_process_s"), second_process_s=fs.get("second_process_s"))
            for key in ("fresh_error", "second_error", "profiled_error"):
                if fs.get(key):
                    rec.note(f"B{b} S{s} {path} first step ({key}): {fs[key]}")
            for key in ("fresh", "second", "profiled"):
                if fs.get(f"{key}_profile"):
                    rec.note(f"B{b} S{s} {path} first step, {key} process: where its seconds go")
                    for ln in fs[f"{key}_profile"]:
                        rec.note("   " + ln)


def measure(rec: benchlib.Recorder, args) -> None:
    if args.first_step_only:
        measure_first_steps(rec, args)
        return
    for b, s in args.shape_list:
        cfg = block_config(b, s, args.smoke)
        label = f"B{b} S{s}"
        # Each shape's compiled paths compile afresh: without a reset every path and shape recompiles
        # the same forward code (sizes turn dynamic, then dynamo's recompile limit sends the later
        # ones to eager), which would time something else than a user's one-shape compile.
        torch._dynamo.reset()
        benches = {}
        for path in args.paths:
            try:
                benches[path] = Bench(cfg, path, args.backend)
                t0 = time.perf_counter()
                for _ in range(1 if args.smoke else 3):  # warm-up: compile, autotune, graph caches
                    benches[path].step()
                benchlib.wait_background_compiles()
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                rec.note(f"{label} {path}: warm-up {time.perf_counter() - t0:.1f} s")
            except Exception as exc:  # noqa: BLE001 - report and go on with the other paths
                rec.note(f"{label} {path}: failed ({type(exc).__name__}: {str(exc)[:300]})")
                benches.pop(path, None)
        times = {p: [] for p in benches}
        b2b = {p: [] for p in benches}
        for _ in range(args.rounds):
            for path, bench in benches.items():
                times[path] += timed_steps(bench, args.steps)
                b2b[path].append(back_to_back_ms(bench, args.steps))
        med = {p: [statistics.median(v[i] for v in ts) if ts[0][i] is not None else None for i in range(3)]
               for p, ts in times.items()}
        ref = med.get("torch", [None])[0]
        bf16 = med.get("bf16", [None])[0]
        b2b_med = {p: statistics.median(v) for p, v in b2b.items()}
        b2b_ref, b2b_bf16 = b2b_med.get("torch"), b2b_med.get("bf16")
        for path, bench in benches.items():
            act, peak = bench.memory()
            issue_ms = host_ms(bench)
            gpu_step, gpu_fwd, gpu_bwd = gpu_bound_ms(bench)
            row = dict(op="mla_block", shape=label, impl=path, path=path, tokens=cfg.tokens, ms=med[path][0],
                       step_ms=med[path][0], fwd_ms=med[path][1], bwd_ms=med[path][2],
                       ratio=(med[path][0] / ref) if ref else None, vs="torch",
                       vs_bf16=(med[path][0] / bf16) if bf16 else None, peak_act_gib=act, peak_gib=peak,
                       host_ms=issue_ms, gpu_bound_ms=gpu_step, gpu_bound_fwd_ms=gpu_fwd, gpu_bound_bwd_ms=gpu_bwd,
                       b2b_ms=b2b_med[path], b2b_ratio=(b2b_med[path] / b2b_ref) if b2b_ref else None,
                       b2b_vs_bf16=(b2b_med[path] / b2b_bf16) if b2b_bf16 else None,
                       family="DeepSeek-V3 MLA block fwd+bwd")
            if args.first_step:
                fs = first_steps((b, s), path, args.backend, args.smoke)
                row.update(first_step_fresh_s=fs.get("fresh"), first_step_second_s=fs.get("second"))
                for key in ("fresh_error", "second_error"):
                    if fs.get(key):
                        rec.note(f"{label} {path} first step ({key}): {fs[key]}")
            rec.row(**row)
            if not args.no_profile:
                table, total = kernel_table(bench, top=args.kernel_top)
                rec.note(f"{label} {path}: GPU time by kernel, one step ({total:.3f} ms of kernels)")
                for name, ms, share in table:
                    rec.note(f"    {ms:8.3f} ms {share * 100:5.1f} %  {name[:110]}")
            if args.launchers and DEVICE == "cuda":
                rec.note(f"{label} {path}: GPU time by the eager torch op that launched it, one step")
                try:
                    launchers = launcher_table(bench, top=args.launchers)
                except Exception as error:  # noqa: BLE001 -- a diagnostic table: the timings above stand
                    rec.note(f"    not made: {type(error).__name__}: {error}")
                    launchers = []
                for ms, op, shapes, owner in launchers:
                    rec.note(f"    {ms:8.3f} ms  {op} {shapes[:70]}{'  in ' + owner if owner else ''}")
            if args.host_profile:
                rec.note(f"{label} {path}: host time of one forward by function (step issue {issue_ms:.2f} ms)")
                for name, ms, count in host_table(bench):
                    rec.note(f"    {ms:8.3f} ms x{count:<5d} {name[:100]}")
                rec.note(f"{label} {path}: the project's functions in one forward, host ms with callees")
                for name, ms, count in host_table(bench, top=30, cumulative=True):
                    rec.note(f"    {ms:8.3f} ms x{count:<5d} {name[:100]}")
        del benches
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


COLUMNS = [("shape", "shape", 10, ""), ("path", "path", 13, ""), ("step_ms", "step ms", 9, ".3f"),
           ("fwd_ms", "fwd ms", 8, ".3f"), ("bwd_ms", "bwd ms", 8, ".3f"), ("ratio", "vs torch", 8, ".3f"),
           ("vs_bf16", "vs bf16", 8, ".3f"), ("b2b_ms", "b2b ms", 8, ".3f"), ("b2b_ratio", "b2b/torch", 9, ".3f"), ("b2b_vs_bf16", "b2b/bf16", 8, ".3f"),
           ("host_ms", "host ms", 8, ".2f"), ("gpu_bound_ms", "gpu-bound", 9, ".2f"), ("peak_act_gib", "act GiB", 8, ".3f"), ("peak_gib", "peak GiB", 9, ".3f"),
           ("first_step_fresh_s", "1st fresh s", 11, ".1f"), ("first_step_second_s", "1st 2nd s", 9, ".1f"),
           ("fresh_process_s", "fresh proc s", 12, ".1f")]


def main(args) -> None:
    if args.child:
        child_first_step(args)
        return
    if not args.smoke and DEVICE != "cuda":
        raise SystemExit("bench_block: needs a CUDA device (use --smoke for the tiny CPU run)")
    rec = benchlib.Recorder("block", args)
    rec.note(f"device {benchlib.device_name()}; torch {torch.__version__}; paths {', '.join(args.paths)}")
    rec.run(measure, rec, args)
    rec.finish(COLUMNS)


if __name__ == "__main__":
    main(ARGS)
