"""RMSNorm straight to MXFP8 (rowwise + columnwise e4m3, rstd), bf16 x [T, D] for DeepSeek-V3's
D = 1536 (q_a norm) and D = 7168 (hidden): triton (one kernel) vs torch eager vs torch.compile of the
eager op vs a copy of x (2 bytes read + 2 written per element: the same traffic as the op's
x read + two 1-byte code writes, so "vs copy" is the fraction of the bandwidth roof reached).
Its backward (`rmsnorm_backward`, bf16 dy and x in, bf16 dx and fp32 dgamma out: 6 bytes an element):
Triton's one-pass kernel (variant fused, called directly) vs the torch ops (eager, and torch.compile
of them); "vs copy" is again the fraction of copy bandwidth (the copy's time scaled to 6 bytes).

    python benchmarks/bench_rmsnorm.py [--quick] [--tokens 1024,...] [--no-compile] [--json PATH]   # GPU
    python benchmarks/bench_rmsnorm.py --smoke                     # tiny shapes, CPU interpreter OK

Times are medians of triton.testing.do_bench(warmup=25, rep=100) on inputs larger than L2 (60 MB).
Bytes per call: x, both code tensors, both scale tensors, gamma, rstd. First-call time (compile +
autotune) is reported. "same" says whether an impl's codes, scales and rstd equal triton's bytes.
--tokens sets T for both D (default: the pairs below); torch.compile runs last for each shape.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchlib  # noqa: E402


ARGS = benchlib.parse_script_args(__doc__, "one T per D; torch.compile included", "T of x [T, D], D = 1536 and 7168")
import torch  # noqa: E402

import backends  # noqa: E402

backends.load()
from backends.torch import rmsnorm as torch_rmsnorm  # noqa: E402
from backends.triton import rmsnorm as triton_rmsnorm  # noqa: E402
from backends.triton import rmsnorm_backward as triton_rmsnorm_backward  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
bench_ms, first_call_s = benchlib.bench_ms, benchlib.first_call_s
REC = benchlib.Recorder("rmsnorm", ARGS)


def outputs_equal(a, b) -> bool:
    (ar, ac, ars), (br, bc, brs) = a, b
    same = lambda u, v: torch.equal(u.view(torch.uint8), v.view(torch.uint8))  # noqa: E731
    return (same(ar.data, br.data) and same(ar.scale, br.scale) and same(ac.data, bc.data)
            and same(ac.scale, bc.scale) and torch.equal(ars.view(torch.int32), brs.view(torch.int32)))


def shapes():
    if ARGS.smoke:
        return [(t, 96) for t in ARGS.tokens] if ARGS.tokens else [(64, 96), (32, 160)]
    if ARGS.tokens:
        return [(t, d) for d in (1536, 7168) for t in ARGS.tokens]
    if ARGS.quick:
        return [(32768, 1536), (16384, 7168)]
    return [(32768, 1536), (65536, 1536), (8192, 7168), (16384, 7168)]


def measure():
    REC.load_peaks()
    for T, D in shapes():
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(T, D, generator=g).to(torch.bfloat16).to(DEVICE)
        gamma = (1 + 0.1 * torch.randn(D, generator=g)).to(torch.bfloat16).to(DEVICE)
        common = dict(shape=f"[{T},{D}] bf16", family=f"[T,{D}] bf16", tokens=T)
        nbytes = x.numel() * 2 + 2 * x.numel() + 2 * (x.numel() // 32) + D * 2 + T * 4

        out_copy = torch.empty_like(x)
        copy_ms = bench_ms(lambda: out_copy.copy_(x))
        REC.row(op="copy", impl="torch copy_", ms=copy_ms, tbps=4 * x.numel() / copy_ms / 1e9, ratio=1.0, vs="copy",
                bytes=4 * x.numel(), **common)
        del out_copy

        secs = first_call_s(lambda: triton_rmsnorm.rmsnorm_mxfp8(x, gamma))
        REC.note(f"triton rmsnorm_mxfp8 {common['shape']}: first call {secs:.2f} s (compile + autotune)")
        ref = triton_rmsnorm.rmsnorm_mxfp8(x, gamma)
        ms = bench_ms(lambda: triton_rmsnorm.rmsnorm_mxfp8(x, gamma))
        best = getattr(triton_rmsnorm._rmsnorm_tuned, "best_config", None)
        REC.row(op="rmsnorm_mxfp8", impl="triton", ms=ms, tbps=nbytes / ms / 1e9, ratio=copy_ms / ms, vs="copy",
                bytes=nbytes, same=True, note=str(best) if best is not None and DEVICE == "cuda" else "", **common)

        baselines = [("torch eager", torch_rmsnorm.rmsnorm_mxfp8)]
        if DEVICE == "cuda" and not ARGS.no_compile:  # last: a slow compile costs only its own row
            baselines.append(("torch.compile(eager)", benchlib.compile_static(torch_rmsnorm.rmsnorm_mxfp8)))
        for name, fn in baselines:
            try:
                if name.startswith("torch.compile"):
                    secs = first_call_s(lambda: fn(x, gamma))
                    REC.note(f"{name} {common['shape']}: first call {secs:.2f} s")
                same = outputs_equal(fn(x, gamma), ref)
                ms = bench_ms(lambda: fn(x, gamma))
            except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
                REC.note(f"{name} {common['shape']}: failed ({type(exc).__name__}: {str(exc)[:200]})")
                continue
            REC.row(op="rmsnorm_mxfp8", impl=name, ms=ms, tbps=nbytes / ms / 1e9, ratio=copy_ms / ms, vs="copy",
                    bytes=nbytes, same=same, **common)
        measure_backward(x, gamma, ref[2], copy_ms, common)
        del x, ref
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def measure_backward(x, gamma, rstd, copy_ms, common):
    T, D = x.shape
    dy = torch.randn(T, D, generator=torch.Generator(device="cpu").manual_seed(1)).to(torch.bfloat16).to(DEVICE)
    gamma32 = gamma.float()
    nbytes = 6 * x.numel() + D * 4 + T * 4
    roof_ms = copy_ms * nbytes / (4 * x.numel())
    impls = [("triton fused", lambda: triton_rmsnorm_backward.rmsnorm_backward(dy, x, gamma32, rstd)),
             ("torch eager", lambda: torch_rmsnorm.rmsnorm_backward(dy, x, gamma32, rstd))]
    if DEVICE == "cuda" and not ARGS.no_compile:
        compiled = benchlib.compile_static(torch_rmsnorm.rmsnorm_backward)
        impls.append(("torch.compile(eager)", lambda: compiled(dy, x, gamma32, rstd)))
    ref = None
    for name, fn in impls:
        try:
            secs = first_call_s(fn)
            out = fn()
            same = ref is None or (torch.equal(out[0].view(torch.int16), ref[0].view(torch.int16))
                                   and torch.equal(out[1].view(torch.int32), ref[1].view(torch.int32)))
            ref = out if ref is None else ref
            ms = bench_ms(fn)
        except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
            REC.note(f"rmsnorm_backward {name} {common['shape']}: failed ({type(exc).__name__}: {str(exc)[:200]})")
            continue
        REC.note(f"rmsnorm_backward {name} {common['shape']}: first call {secs:.2f} s")
        REC.row(op="rmsnorm_backward", impl=name, ms=ms, tbps=nbytes / ms / 1e9, ratio=roof_ms / ms, vs="copy",
                bytes=nbytes, same=same, **common)


def main():
    REC.run(measure)
    REC.finish([("op", "op", 16, ""), ("shape", "shape", 20, ""), ("impl", "impl", 22, ""), benchlib.MS,
                benchlib.TBPS, ("ratio", "vs copy", 8, ".3f"), benchlib.OF_ROOF, ("same", "same", 5, "")])


if __name__ == "__main__":
    main()
