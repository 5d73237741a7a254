"""Where a synchronized block step's forward waits for its host: per source line of MLABlock.forward,
the host time the line took to issue and how far the GPU had got when the host reached it.

One synchronized step per path (the same step bench_block times). At every line of the forward the
host's clock is read and a CUDA event recorded: 'host' is the wall time since the step started,
'gpu' the event's time on the GPU's clock since the step's first event. A line whose gpu time trails
its host time by little found the GPU idle (the GPU waited for the host: host-bound); a growing lead
of host over gpu is queued work. Line events come from sys.monitoring (Python >= 3.12: only the
forward's own code object is instrumented, so callees run at full speed); older Pythons fall back
to a local trace function (slower; the --smoke run on CPU uses it).

    python tools/forward_lines.py [--paths mxfp8,bf16] [--shape B1S4096] [--steps 3] [--smoke]
"""
from __future__ import annotations

import argparse
import linecache
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import bench_block as bb  # noqa: E402


class LineClock:
    """Records (line number, host seconds, CUDA event or None) at each line event of one code object."""

    def __init__(self, code, cuda: bool):
        self.code, self.cuda, self.marks = code, cuda, []
        self._tool = None

    def _mark(self, line: int) -> None:
        ev = None
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        self.marks.append((line, time.perf_counter(), ev))

    def __enter__(self):
        self.marks = []
        mon = getattr(sys, "monitoring", None)
        if mon is not None:
            for tool in range(mon.PROFILER_ID, 6):
                if mon.get_tool(tool) is None:
                    self._tool = tool
                    break
        if self._tool is not None:
            mon.use_tool_id(self._tool, "mxmla.forward_lines")
            mon.register_callback(self._tool, mon.events.LINE, lambda code, line: self._mark(line))
            mon.set_local_events(self._tool, self.code, mon.events.LINE)
        else:
            def local(frame, event, arg):
                if event == "line":
                    self._mark(frame.f_lineno)
                return local

            def tracer(frame, event, arg):
                return local if frame.f_code is self.code else None

            self._old = sys.gettrace()
            sys.settrace(tracer)
        return self

    def __exit__(self, *exc):
        if self._tool is not None:
            mon = sys.monitoring
            mon.set_local_events(self._tool, self.code, 0)
            mon.register_callback(self._tool, mon.events.LINE, None)
            mon.free_tool_id(self._tool)
            self._tool = None
        else:
            sys.settrace(self._old)
        self._mark(-1)  # the forward's end


def one_step(bench, clock: LineClock, cuda: bool):
    """[(line, host ms, gpu ms)] of one synchronized step's forward, plus the step's end."""
    for p in bench.params:
        p.grad = None
    bench.h.grad = None
    if cuda:
        torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True) if cuda else None
    t0 = time.perf_counter()
    if cuda:
        start.record()
    with clock:
        out = bench.forward(bench.h, bench.cos, bench.sin)
    out.backward(bench.dout)
    if bench.requantize is not None:
        bench.requantize()
    t_end = time.perf_counter()
    end = None
    if cuda:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        torch.cuda.synchronize()
    rows = [(line, (t - t0) * 1e3, start.elapsed_time(ev) if cuda else None) for line, t, ev in clock.marks]
    rows.append((-2, (t_end - t0) * 1e3, start.elapsed_time(end) if cuda else None))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default="mxfp8,bf16")
    ap.add_argument("--shape", default="B1S4096")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per path (median per line)")
    ap.add_argument("--smoke", action="store_true", help="small config on the CPU")
    args = ap.parse_args(argv)
    cuda = bb.DEVICE == "cuda" and not args.smoke
    b, s = bb.parse_shape(args.shape)
    source = bb.mb.__file__
    for path in args.paths.split(","):
        bench = bb.Bench(bb.block_config(b, s, args.smoke), path)
        for _ in range(3):
            bench.step()
        if cuda:
            from dispatch.warmup import wait_background_compiles

            wait_background_compiles()
            torch.cuda.synchronize()
        clock = LineClock(type(bench.block).forward.__code__, cuda)
        runs = [one_step(bench, clock, cuda) for _ in range(args.steps)]
        n = min(len(r) for r in runs)
        print(f"\n{path} {args.shape}: per line of MLABlock.forward, median of {args.steps} synchronized steps")
        print(f"{'line':>5} {'issue us':>9} {'host ms':>8} {'gpu ms':>8}  source   (host / gpu: when the line began)")
        for i in range(n):
            line = runs[0][i][0]
            host = statistics.median(r[i][1] for r in runs)
            gpu = statistics.median(r[i][2] for r in runs) if cuda else float("nan")
            took = statistics.median(r[i + 1][1] - r[i][1] for r in runs) * 1e3 if i + 1 < n else float("nan")
            text = ("(backward + re-quantize issue)" if line == -1 else "(step end; gpu: last kernel done)"
                    if line == -2 else linecache.getline(source, line).strip()[:90])
            print(f"{line if line > 0 else '':>5} {took:9.1f} {host:8.3f} {gpu:8.3f}  {text}")

if __name__ == "__main__":
    main()
