"""Plumbing shared by the bench_*.py scripts (imported as `benchlib`: a script's own folder is first on
sys.path): the flags every script takes, rows printed the moment they are measured, a JSON that a time
cap's SIGINT still writes, token lists, and the roofline: the measured copy bandwidth and bf16 cuBLAS
rate that turn an op's bytes or FLOPs into the shortest time the machine allows.

Row keys (benchmarks/summarize.py prints them, docs/BENCHMARKING.md explains them):
  op, shape, impl, ms, tbps, tflops, ratio, vs, note   what summarize.py has always read
  tokens        the token count of the row (T, rows, S or M; None where the op has no token axis)
  roofline_ms   max(bytes / copy bandwidth, flops / bf16 cuBLAS rate), from the keys below
  bytes, flops  what the op must move / compute once (the roofline counts these)
  family        the shape without its token count: the plots draw one figure per (bench, op, family)
  device        where it ran
and any key of one script (same, err, ...).

Nothing here imports torch or triton at import time: a script must pick TRITON_INTERPRET first.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import time

ROW_PREFIX = "BENCH_ROW "  # the runner (run_all.py) collects these lines even when no JSON gets written
SWEEP_TOKENS = (1024, 2048, 4096, 8192, 16384, 32768)
PEAKS_ENV = "MXMLA_BENCH_PEAKS"  # path of a JSON with {"peaks": {...}} (bench_roofline.py writes one)


def parse_tokens(text: str) -> list[int]:
    """'1024,4096' -> [1024, 4096]; 'sweep' -> 1024 .. 32768."""
    if text.strip().lower() == "sweep":
        return list(SWEEP_TOKENS)
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens: expected a comma list of integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"--tokens: expected positive integers, got {text!r}")
    return values


def add_common_args(ap: argparse.ArgumentParser, tokens_axis: str | None) -> None:
    """--tokens, --no-compile, --json (every script takes all three; --tokens is ignored, with a note,
    where the script has no token axis)."""
    what = f"the token axis here is {tokens_axis}" if tokens_axis else "this script has no token axis: ignored"
    ap.add_argument("--tokens", type=parse_tokens, default=None,
                    help=f"comma list of token counts, or 'sweep' (= {','.join(map(str, SWEEP_TOKENS))}); {what}")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    ap.add_argument("--json", help="write the rows as JSON here (also after a SIGINT)")


def parse_script_args(doc: str, quick_help: str, tokens_axis: str | None, flags=()) -> argparse.Namespace:
    """The command line of a bench_<op>.py script: --quick, --smoke, the common flags and the script's
    own store-true `flags` ((name, help) pairs). --smoke without CUDA selects the Triton interpreter,
    which must happen before triton is imported, hence here."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=quick_help)
    for name, help_text in flags:
        ap.add_argument(name, action="store_true", help=help_text)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU under TRITON_INTERPRET=1")
    add_common_args(ap, tokens_axis=tokens_axis)
    args = ap.parse_args()
    if args.smoke and not on_cuda():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return args


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------

def on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def bench_ms(fn) -> float:
    """Median ms of triton.testing.do_bench(warmup=25, rep=100) on CUDA (it flushes L2 between runs);
    on CPU (smoke) one timed call, only to show the table works."""
    if on_cuda():
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def interleaved_ms(fns: dict, rounds: int = 3, bench=None) -> dict:
    """{name: ms}: the median over `rounds` of each function's `bench` median (default bench_ms), the
    functions taking turns in every round, so clock and thermal drift during a script weigh on all of
    them alike (one torch cuDNN reading moved by 11 % between two points of one earlier script). For
    timings that a target compares."""
    bench = bench or bench_ms
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench(fn))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def print_ms_rows(rows, width: int = 70, ratio_label: str = "ratio") -> None:
    """Print (tokens, what, ms or "", ratio or "") rows as a fixed-width table (the GPU probes' last
    output)."""
    print(f"\n{'T':>6} | {'what':<{width}} | {'ms':>8} | {ratio_label}")
    for tokens, what, ms, ratio in rows:
        ms_s = f"{ms:8.4f}" if ms != "" else " " * 8
        r_s = f"{ratio:.3f}" if ratio != "" else ""
        print(f"{tokens:>6} | {what:<{width}} | {ms_s} | {r_s}")


def compile_static(fn):
    """torch.compile(fn, dynamic=False) for a baseline, with Dynamo's recompile limits raised first: a
    token sweep compiles one graph per shape and variant for the same code objects, and past the
    default limit (8) Dynamo silently runs eager (a 2026-11-30 H200 sweep timed "torch.compile" at
    eager speed from T = 16384 on because of it)."""
    import torch
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 1024))
    return torch.compile(fn, dynamic=False)


def first_call_s(fn) -> float:
    """Wall time of one call including compile / autotune and the compilations it started in the
    background (the exact fallbacks'), synchronised on CUDA: the timed calls after it then run as
    every later call does."""
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    wait_background_compiles()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def empty_cache_env(folder: str) -> dict:
    """os.environ with Triton's, Inductor's and mxmla's caches in `folder` (new and empty for a first
    step's fresh process; the same folder again, then filled, for its second)."""
    return dict(os.environ, TRITON_CACHE_DIR=os.path.join(folder, "triton"),
                TORCHINDUCTOR_CACHE_DIR=os.path.join(folder, "inductor"), MXMLA_CACHE_DIR=os.path.join(folder, "mxmla"))


def wait_background_compiles() -> None:
    from dispatch.warmup import wait_background_compiles as wait

    wait()


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter)"


# --------------------------------------------------------------------------------------------------
# Roofline
# --------------------------------------------------------------------------------------------------

def measure_peaks(record=None) -> dict:
    """Copy bandwidth (TB/s, bytes read + written by dst.copy_(src)) and bf16 matmul rate (TFLOP/s,
    best of a square 8192^3 and DeepSeek's 16384 x 24576 x 1536). On CUDA 512 MiB buffers, far beyond
    L2; on CPU small ones (numbers only to exercise the code). `record(impl, shape, ms, **kw)` is
    called for each measurement."""
    import torch

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    copy_elems = (256 << 20) if cuda else (1 << 20)  # bf16 elements: 512 MiB / 2 MiB
    src = torch.ones(copy_elems, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    ms = _best_ms(lambda: dst.copy_(src), cuda)
    nbytes = 2 * src.numel() * src.element_size()
    copy_tbps = nbytes / ms / 1e9
    if record:
        record(impl="torch copy_ (device to device)", shape=f"{src.numel() * 2 >> 20} MiB bf16", ms=ms,
               tbps=copy_tbps, bytes=nbytes)
    del src, dst
    shapes = ((8192, 8192, 8192), (16384, 24576, 1536)) if cuda else ((256, 256, 256),)
    rates = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=dev).to(torch.bfloat16)
        b = torch.randn(n, k, device=dev).to(torch.bfloat16)
        ms = _best_ms(lambda: torch.matmul(a, b.t()), cuda)
        flops = 2.0 * m * n * k
        rates.append(flops / ms / 1e9)
        if record:
            record(impl="torch.matmul bf16 (cuBLAS)", shape=f"{m}x{k} @ {n}x{k}", ms=ms, tflops=rates[-1], flops=flops)
        del a, b
    if cuda:
        torch.cuda.empty_cache()
    return dict(copy_tbps=copy_tbps, bf16_tflops=max(rates), device=device_name(),
                how="copy of 512 MiB; best bf16 matmul of 8192^3 and 16384x24576x1536" if cuda
                else "CPU smoke: tiny buffers, meaningless numbers")


def _best_ms(fn, cuda: bool) -> float:
    if cuda:
        return bench_ms(fn)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def load_peaks_file(path: str) -> dict | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    peaks = data.get("peaks") if isinstance(data, dict) else None
    ok = isinstance(peaks, dict) and all(isinstance(peaks.get(k), (int, float)) and peaks[k] > 0
                                         for k in ("copy_tbps", "bf16_tflops"))
    return peaks if ok else None


def roofline_ms(peaks: dict | None, nbytes=None, flops=None) -> float | None:
    """The shortest time the machine allows: max(bytes / copy bandwidth, flops / bf16 matmul rate),
    over the terms that are known; None when neither is."""
    if not peaks:
        return None
    terms = []
    if nbytes:
        terms.append(nbytes / peaks["copy_tbps"] / 1e9)
    if flops:
        terms.append(flops / peaks["bf16_tflops"] / 1e9)
    return max(terms) if terms else None


# --------------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------------

def _plain(v):
    """JSON-safe scalars (torch / numpy numbers become Python ones, NaN / inf become None)."""
    if hasattr(v, "item") and callable(v.item):
        try:
            v = v.item()
        except (TypeError, ValueError, RuntimeError):
            return str(v)
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return str(v)


class Recorder:
    """Rows and notes of one script. `row()` prints each row as one `BENCH_ROW {json}` line at once
    (flushed), so a run killed later still leaves them in its log; `run(measure)` turns a SIGINT (the
    runner's time cap, or `timeout -s INT`) into a note, and `finish()` prints the table and writes
    the JSON either way."""

    def __init__(self, bench: str, args, device: str | None = None):
        self.bench = bench
        self.args = args
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.peaks: dict | None = None
        self.interrupted = False
        self._device = device  # None: asked of torch at the first row

    # -- measuring ---------------------------------------------------------------------------------
    def load_peaks(self) -> None:
        """Peaks from $MXMLA_BENCH_PEAKS (the runner's bench_roofline.json) or measured here."""
        path = os.environ.get(PEAKS_ENV)
        if path:
            self.peaks = load_peaks_file(path)
            if self.peaks:
                return
            self.note(f"{PEAKS_ENV}={path}: no usable peaks in it; measuring here")
        try:
            self.peaks = measure_peaks()
        except Exception as exc:  # noqa: BLE001 - without peaks the rows just lack roofline_ms
            self.note(f"roofline peaks not measured ({type(exc).__name__}: {str(exc)[:200]})")
            return
        self.note(f"roofline: copy {self.peaks['copy_tbps']:.3f} TB/s, bf16 matmul {self.peaks['bf16_tflops']:.1f} "
                  f"TFLOP/s ({self.peaks['how']})")

    def row(self, **row) -> dict:
        if self._device is None:
            try:
                self._device = device_name()
            except Exception:  # noqa: BLE001
                self._device = "unknown"
        row.setdefault("tokens", None)
        if row.get("roofline_ms") is None and row.get("ms"):
            roof = roofline_ms(self.peaks, row.get("bytes"), row.get("flops"))
            if roof is not None:
                row["roofline_ms"] = roof
        row.setdefault("device", self._device)
        row = {k: _plain(v) for k, v in row.items()}
        self.rows.append(row)  # kept before it is printed: a SIGINT right after the print loses nothing
        print(ROW_PREFIX + json.dumps(row), flush=True)
        return row

    def note(self, text: str) -> None:
        print(text, flush=True)
        self.notes.append(text)

    def run(self, measure, *args, **kwargs) -> None:
        # a process started from a background job (`cmd &` in a script, nohup) inherits SIGINT ignored,
        # and Python then raises no KeyboardInterrupt: a time cap's SIGINT would go unheard
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            measure(*args, **kwargs)
        except KeyboardInterrupt:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second SIGINT must not lose the JSON
            self.interrupted = True
            self.note("interrupted (SIGINT, e.g. a time cap): the rows are the ones measured before it")

    # -- reporting ---------------------------------------------------------------------------------
    def finish(self, columns, extra=None) -> None:
        """Print the table (columns: (key or row -> value, header, width, format spec or "" for text)),
        then write --json."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print()
        print(" ".join(f"{h:>{w}}" if f else f"{h:{w}}" for _, h, w, f in columns).rstrip())
        for r in self.rows:
            cells = []
            for key, _, w, f in columns:
                v = key(r) if callable(key) else r.get(key)
                if v is None or v == "":
                    cells.append(" " * w)
                elif f and isinstance(v, (int, float)) and not isinstance(v, bool):
                    cells.append(f"{v:{w}{f}}")
                else:
                    cells.append(f"{str(v):{w}}")
            print(" ".join(cells).rstrip())
        sys.stdout.flush()
        path = getattr(self.args, "json", None)
        if path:
            data = dict(bench=self.bench, rows=self.rows, notes=self.notes, peaks=self.peaks,
                        interrupted=self.interrupted, **(extra or {}))
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                json.dump(_plain(data), f, indent=1)
            os.replace(tmp, path)


# Columns most scripts print (key, header, width, format spec or "" for text).
MS = ("ms", "ms", 10, ".4f")
TBPS = ("tbps", "TB/s", 7, ".3f")
TFLOPS = ("tflops", "TFLOP/s", 8, ".1f")
RATIO = ("ratio", "ratio", 7, ".3f")
ROOF = ("roofline_ms", "roof ms", 9, ".4f")
OF_ROOF = (lambda r: r["roofline_ms"] / r["ms"] if r.get("roofline_ms") and r.get("ms") else None, "of roof", 7, ".3f")
