"""RoPE (DeepSeek-V3 MLA query, [T, 128, 192] bf16, rope_dim 64): triton vs torch eager vs
torch.compile of the eager op vs a plain copy of x (the bandwidth roof of an out-of-place op).

    python benchmarks/bench_rope.py [--quick] [--tokens 1024,...] [--no-compile] [--json PATH]   # on the GPU
    python benchmarks/bench_rope.py --smoke                     # tiny shapes, CPU interpreter OK

Times are medians of triton.testing.do_bench(warmup=25, rep=100) on inputs larger than L2. Bytes
counted per call: read x, write out (same dtype), plus the cos/sin rows and cu_seqlens (tiny).
The last table is: op, shape, impl, ms, TB/s, ratio to the copy (copy ms / impl ms). First-call
time (compile + autotune) of each triton op is reported too. Every impl's output is compared to
triton's bytes ("same" column) so a fast wrong baseline shows. --tokens sets T (default 4096, 16384 and,
without --quick, 32768); torch.compile runs last for each T (with --quick only at the largest T).
"""
from __future__ import annotations

import os
import sys

# Make the repository importable when run as a script, and pick the interpreter before triton loads.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchlib  # noqa: E402


ARGS = benchlib.parse_script_args(__doc__, "T in 4096, 16384; torch.compile only at 16384", "T of x [T, 128, 192]")
import torch  # noqa: E402

import backends  # noqa: E402

backends.load()
from backends.torch import rope as torch_rope  # noqa: E402
from backends.triton import rope as triton_rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
bench_ms, first_call_s = benchlib.bench_ms, benchlib.first_call_s
REC = benchlib.Recorder("rope", ARGS)


def make_inputs(T, H, D, R, n_seqs=4):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(T, H, D, generator=g).to(torch.bfloat16).to(DEVICE)
    cos = (torch.rand(T, R, generator=g) * 2 - 1).to(DEVICE)
    sin = (torch.rand(T, R, generator=g) * 2 - 1).to(DEVICE)
    bounds = torch.linspace(0, T, n_seqs + 1).round().to(torch.int32)
    return x, cos, sin, bounds.to(DEVICE)


def measure():
    H, D, R = 128, 192, 64
    if ARGS.smoke:
        H, tokens = 4, ARGS.tokens or [64]
    else:
        tokens = ARGS.tokens or ([4096, 16384] if ARGS.quick else [4096, 16384, 32768])
    REC.load_peaks()
    for T in tokens:
        x, cos, sin, cu = make_inputs(T, H, D, R)
        kw = dict(style="mla", layout="thd", cu_seqlens=cu)
        nbytes = 2 * x.numel() * x.element_size() + 2 * T * R * 4 + cu.numel() * 4
        common = dict(shape=f"[{T},{H},{D}] bf16 r{R}", family=f"[T,{H},{D}] bf16 r{R}", tokens=T)

        out_copy = torch.empty_like(x)
        copy_ms = bench_ms(lambda: out_copy.copy_(x))
        copy_bytes = 2 * x.numel() * x.element_size()
        REC.row(op="copy", impl="torch copy_", ms=copy_ms, tbps=copy_bytes / copy_ms / 1e9, ratio=1.0, vs="copy",
                bytes=copy_bytes, **common)
        del out_copy

        ref = {}
        for op in ("rope", "rope_backward"):
            fn = getattr(triton_rope, op)
            secs = first_call_s(lambda: fn(x, cos, sin, **kw))
            REC.note(f"{op} {common['shape']}: first call {secs:.2f} s (compile + autotune)")
            ref[op] = fn(x, cos, sin, **kw)
            ms = bench_ms(lambda: fn(x, cos, sin, **kw))
            REC.row(op=op, impl="triton", ms=ms, tbps=nbytes / ms / 1e9, ratio=copy_ms / ms, vs="copy",
                    bytes=nbytes, same=True, **common)

        baselines = [("torch eager", torch_rope.rope, "rope"),
                     ("torch eager", torch_rope.rope_backward, "rope_backward")]
        if DEVICE == "cuda" and not ARGS.no_compile and not (ARGS.quick and T != tokens[-1]):
            try:  # last: a slow compile costs only its own row
                baselines.append(("torch.compile(eager)", benchlib.compile_static(torch_rope.rope), "rope"))
            except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
                REC.note(f"torch.compile unavailable: {exc}")
        for name, fn, op in baselines:
            try:
                if name.startswith("torch.compile"):
                    secs = first_call_s(lambda: fn(x, cos, sin, **kw))
                    REC.note(f"{name} {op} {common['shape']}: first call {secs:.2f} s")
                got = fn(x, cos, sin, **kw)
                same = bool(torch.equal(got.view(torch.int16), ref[op].view(torch.int16)))
                del got
                ms = bench_ms(lambda: fn(x, cos, sin, **kw))
            except Exception as exc:  # noqa: BLE001
                REC.note(f"{name} {op} {common['shape']}: failed ({type(exc).__name__}: {str(exc)[:300]})")
                continue
            REC.row(op=op, impl=name, ms=ms, tbps=nbytes / ms / 1e9, ratio=copy_ms / ms, vs="copy", bytes=nbytes,
                    same=same, **common)
        del x, ref
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def main():
    REC.run(measure)
    REC.finish([("op", "op", 14, ""), ("shape", "shape", 26, ""), ("impl", "impl", 22, ""), benchlib.MS,
                benchlib.TBPS, ("ratio", "vs copy", 8, ".3f"), benchlib.OF_ROOF, ("same", "same", 5, "")])


if __name__ == "__main__":
    main()
