"""RoPE (DeepSeek-V3 MLA query, [T, 128, 192] bf16, rope_dim 64): triton vs torch eager vs
torch.compile of the eager op vs a plain copy of x (the bandwidth roof of an out-of-place op).

    python benchmarks/bench_rope.py [--quick] [--json PATH]     # on the GPU
    python benchmarks/bench_rope.py --smoke                     # tiny shapes, CPU interpreter OK

Times are medians of triton.testing.do_bench(warmup=25, rep=100) on inputs larger than L2. Bytes
counted per call: read x, write out (same dtype), plus the cos/sin rows and cu_seqlens (tiny).
The last table is: op, shape, impl, ms, TB/s, ratio to the copy (copy ms / impl ms). First-call
time (compile + autotune) of each triton op is reported too. Every impl's output is compared to
triton's bytes ("same" column) so a fast wrong baseline shows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Make the repository importable when run as a script, and pick the interpreter before triton loads.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="T in 4096, 16384; torch.compile only at 16384")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--json", help="also write the rows as JSON here")
    return ap.parse_args()


ARGS = parse_args()
import torch  # noqa: E402

if ARGS.smoke and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import backends  # noqa: E402
import dispatch  # noqa: E402

backends.load()
from backends.torch import rope as torch_rope  # noqa: E402
from backends.triton import rope as triton_rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def bench_ms(fn) -> float:
    if DEVICE == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    start = time.perf_counter()  # smoke: one timed call, only to show the table works
    fn()
    return (time.perf_counter() - start) * 1e3


def first_call_s(fn) -> float:
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def make_inputs(T, H, D, R, n_seqs=4):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(T, H, D, generator=g).to(torch.bfloat16).to(DEVICE)
    cos = (torch.rand(T, R, generator=g) * 2 - 1).to(DEVICE)
    sin = (torch.rand(T, R, generator=g) * 2 - 1).to(DEVICE)
    bounds = torch.linspace(0, T, n_seqs + 1).round().to(torch.int32)
    return x, cos, sin, bounds.to(DEVICE)


def main():
    H, D, R = 128, 192, 64
    if ARGS.smoke:
        shapes = [(64, 4)]
        H = 4
    elif ARGS.quick:
        shapes = [(4096, H), (16384, H)]
    else:
        shapes = [(4096, H), (16384, H), (32768, H)]

    rows, compile_notes = [], []
    for T, H in shapes:
        x, cos, sin, cu = make_inputs(T, H, D, R)
        kw = dict(style="mla", layout="thd", cu_seqlens=cu)
        nbytes = 2 * x.numel() * x.element_size() + 2 * T * R * 4 + cu.numel() * 4
        shape = f"[{T},{H},{D}] bf16 r{R}"

        out_copy = torch.empty_like(x)
        copy_ms = bench_ms(lambda: out_copy.copy_(x))
        rows.append(dict(op="copy", shape=shape, impl="torch copy_", ms=copy_ms,
                         tbps=2 * x.numel() * x.element_size() / copy_ms / 1e9, ratio=1.0, vs="copy"))

        ref = {}
        for op in ("rope", "rope_backward"):
            fn = getattr(triton_rope, op)
            secs = first_call_s(lambda: fn(x, cos, sin, **kw))
            compile_notes.append(f"{op} {shape}: first call {secs:.2f} s (compile + autotune)")
            ref[op] = fn(x, cos, sin, **kw)
            ms = bench_ms(lambda: fn(x, cos, sin, **kw))
            rows.append(dict(op=op, shape=shape, impl="triton", ms=ms, tbps=nbytes / ms / 1e9,
                             ratio=copy_ms / ms, vs="copy", same=True))

        baselines = [("torch eager", torch_rope.rope, "rope"),
                     ("torch eager", torch_rope.rope_backward, "rope_backward")]
        if DEVICE == "cuda" and not (ARGS.quick and T != shapes[-1][0]):
            try:
                compiled = torch.compile(torch_rope.rope, dynamic=False)
                baselines.append(("torch.compile(eager)", compiled, "rope"))
            except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
                compile_notes.append(f"torch.compile unavailable: {exc}")
        for name, fn, op in baselines:
            try:
                if name.startswith("torch.compile"):
                    secs = first_call_s(lambda: fn(x, cos, sin, **kw))
                    compile_notes.append(f"{name} {op} {shape}: first call {secs:.2f} s")
                got = fn(x, cos, sin, **kw)
                same = bool(torch.equal(got.view(torch.int16), ref[op].view(torch.int16)))
                ms = bench_ms(lambda: fn(x, cos, sin, **kw))
            except Exception as exc:  # noqa: BLE001
                compile_notes.append(f"{name} {op} {shape}: failed ({type(exc).__name__}: {exc})")
                continue
            rows.append(dict(op=op, shape=shape, impl=name, ms=ms, tbps=nbytes / ms / 1e9,
                             ratio=copy_ms / ms, vs="copy", same=same))
        del x, out_copy, ref
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    for note in compile_notes:
        print(note)
    print()
    print(f"{'op':14} {'shape':26} {'impl':22} {'ms':>9} {'TB/s':>7} {'vs copy':>8} same")
    for r in rows:
        print(f"{r['op']:14} {r['shape']:26} {r['impl']:22} {r['ms']:9.4f} {r['tbps']:7.3f} "
              f"{r['ratio']:8.3f} {r.get('same', '')}")
    if ARGS.json:
        for r in rows:
            r["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
        with open(ARGS.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
