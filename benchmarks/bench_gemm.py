"""MXFP8 GEMM (a [M, K], b [N, K] e4m3 MXTensors blocked along K, bf16 out): triton (the pointer block kernel,
autotuned, the "bf16" route: guarded dequantize to bf16 + one bf16 cuBLAS GEMM, and the "gluon"
route: a dequantized to bf16, b's codes widened in a Gluon GEMM's registers; sm100:
tl.dot_scaled) vs the bf16 GEMM of the same shape (torch.matmul, cuBLAS) vs
torch._scaled_mm with per-tensor fp8 scales (cuBLAS fp8: the hardware's fp8 rate without block scales,
an extra reference) vs the torch backend's mxfp8_gemm (dequantize + fp32 matmul).

    python benchmarks/bench_gemm.py [--quick] [--tokens 1024,...] [--json PATH]    # on the GPU
    python benchmarks/bench_gemm.py --smoke                    # tiny shapes, CPU interpreter OK

Target (issue): [4096 x 1536] x [24576 x 1536] faster than the bf16 cuBLAS GEMM. See the cost model in
backends/triton/gemm.py for why an exact block-32 MX GEMM on Hopper is bound by its per-block rescale at
about the bf16 tensor-core peak. Times: medians of triton.testing.do_bench(warmup=25, rep=100); at
M = 4096 the codes are 6.3 MB (a) + 37.7 MB (b) and the bf16 output 201 MB, well beyond L2.
The last table: op, shape, impl, ms, TFLOP/s (2MNK), ratio = bf16 GEMM ms / impl
ms (> 1: faster than cuBLAS bf16), and max |impl - triton| / max |triton| as a sanity column.
--tokens sets M (the token rows of a [M, 1536] x [24576, 1536] GEMM); --no-compile is accepted (no
torch.compile baseline here).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchlib  # noqa: E402


ARGS = benchlib.parse_script_args(__doc__, "M = 4096 only", "M of a [M, 1536] against b [24576, 1536]")
import torch  # noqa: E402

import backends  # noqa: E402

backends.load()
from backends.torch import gemm as torch_gemm  # noqa: E402
from backends.torch import quantize as torch_quantize  # noqa: E402
from backends.triton import gemm as triton_gemm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QUANT = dict(elem="e4m3", scale_mode="rceil", nonfinite="saturate", scale_layout="compact")
bench_ms, first_call_s = benchlib.bench_ms, benchlib.first_call_s
REC = benchlib.Recorder("gemm", ARGS)
VS = "bf16 cuBLAS"  # ratio = the bf16 GEMM's ms / impl ms at the same shape (> 1: faster)


def rel_diff(got, ref) -> float:
    g, r = got.float(), ref.float()
    return float((g - r).abs().max() / r.abs().max().clamp_min(1e-30))


def shapes():
    if ARGS.smoke:
        return [(t, 96, 128) for t in ARGS.tokens] if ARGS.tokens else [(64, 96, 128)]
    if ARGS.tokens:
        return [(t, 24576, 1536) for t in ARGS.tokens]
    if ARGS.quick:
        return [(4096, 24576, 1536)]
    return [(4096, 24576, 1536), (16384, 24576, 1536), (4096, 4096, 4096)]


def measure():
    REC.load_peaks()
    for M, N, K in shapes():
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(DEVICE)
        w = (torch.randn(N, K, generator=g) * 0.02).to(torch.bfloat16).to(DEVICE)
        a = torch_quantize.mxfp8_quantize(x, axis=1, **QUANT)
        b = torch_quantize.mxfp8_quantize(w, axis=1, **QUANT)
        flops = 2.0 * M * N * K
        mx_bytes = (M + N) * K + (M + N) * K // 32 + 2 * M * N  # codes + scales in, bf16 out
        common = dict(shape=f"{M}x{K} @ {N}x{K}", family=f"N{N} K{K}", tokens=M, flops=flops)

        bf16_ms = bench_ms(lambda: torch.matmul(x, w.t()))
        REC.row(op="gemm", impl="torch.matmul bf16 (cuBLAS)", ms=bf16_ms, tflops=flops / bf16_ms / 1e9, ratio=1.0,
                vs=VS, bytes=2 * (M + N) * K + 2 * M * N, **common)

        def add(impl, ms, nbytes, **kw):
            REC.row(op="gemm", impl=impl, ms=ms, tflops=flops / ms / 1e9, ratio=bf16_ms / ms, vs=VS, bytes=nbytes,
                    **common, **kw)

        ref = None
        variants = ["dot_scaled"] if triton_gemm.use_dot_scaled(a.data.device) else ["bf16", "pointer"]
        if DEVICE == "cuda" and not triton_gemm.gluon_reasons(a, b):
            variants.insert(1, "gluon")
        for variant in variants:
            out = torch.empty(M, N, dtype=torch.bfloat16, device=DEVICE)
            fn = lambda v=variant, o=out: triton_gemm.mxfp8_gemm_tensors(a, b, o, variant=v)  # noqa: E731
            secs = first_call_s(fn)
            tuner = {"pointer": triton_gemm._gemm_sm90,
                     "dot_scaled": triton_gemm._gemm_sm100, "bf16": None, "gluon": None}[variant]
            REC.note(f"triton mxfp8_gemm [{variant}] {common['shape']}: first call {secs:.2f} s; "
                     f"pick {getattr(tuner, 'best_config', None) or '(fixed config)'}")
            got = fn()
            ref = got.clone() if ref is None else ref
            add(f"triton mxfp8 [{variant}]", bench_ms(fn), mx_bytes, diff=rel_diff(got, ref))
            del out, got
            if variant == "gluon":  # its kernel alone (a dequantized beforehand)
                from backends.triton.quantize import dequantize_bf16_flat

                flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
                a16 = dequantize_bf16_flat(a, guard=(flag, *triton_gemm.BF16_SAFE_SCALE_BYTES["e4m3"]))
                out = torch.empty(M, N, dtype=torch.bfloat16, device=DEVICE)
                add("triton mxfp8 [gluon]: its GEMM kernel alone",
                    bench_ms(lambda: triton_gemm.gluon_gemm_kernel(a16, b, out, flag)), M * K * 2 + N * K + 2 * M * N)
                del a16, out
            if variant == "bf16":  # its parts: the two guarded dequantize passes alone
                from backends.triton.quantize import dequantize_bf16_flat

                flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
                lo, hi = triton_gemm.BF16_SAFE_SCALE_BYTES["e4m3"]
                deq = lambda: (dequantize_bf16_flat(a, guard=(flag, lo, hi)),  # noqa: E731
                               dequantize_bf16_flat(b, guard=(flag, lo, hi)))
                a16, b16 = deq()
                add("triton mxfp8 [bf16]: its 2 dequantize passes", bench_ms(deq), (M + N) * K * 3 + (M + N) * K // 32,
                    note=f"guard flag {int(flag.item())}")
                # cuBLAS's speed depends on the data (power: fp8-valued bf16 operands toggle fewer bits
                # than random bf16), so also the bf16 GEMM on the route's own dequantized operands
                add("torch.matmul bf16 of the dequantized operands", bench_ms(lambda: torch.matmul(a16, b16.t())),
                    2 * (M + N) * K + 2 * M * N)
                del a16, b16

        # The target's pair (the default route against the bf16 GEMM) timed in turns, 3 rounds: the bf16
        # GEMM alone read 0.404-0.461 ms across one session's runs (different machines, clocks), so a
        # ratio of two readings minutes apart carries that drift.
        default = triton_gemm.gemm_variant(a, b)
        out = torch.empty(M, N, dtype=torch.bfloat16, device=DEVICE)
        pair = benchlib.interleaved_ms({"gemm": lambda: torch.matmul(x, w.t()),
                                        "mx": lambda: triton_gemm.mxfp8_gemm_tensors(a, b, out)})
        REC.row(op="gemm", impl=f"triton mxfp8 [{default}] (in turns with the bf16 GEMM: {pair['gemm']:.4f} ms)",
                ms=pair["mx"], tflops=flops / pair["mx"] / 1e9, ratio=pair["gemm"] / pair["mx"], vs=VS,
                bytes=mx_bytes, **common)
        del out

        if DEVICE == "cuda" and hasattr(torch, "_scaled_mm"):
            try:
                xf = x.to(torch.float8_e4m3fn)
                wf = w.mul(32).to(torch.float8_e4m3fn)
                one = torch.ones((), device=DEVICE)
                inv = torch.full((), 1 / 32, device=DEVICE)
                fn = lambda: torch._scaled_mm(xf, wf.t(), scale_a=one, scale_b=inv, out_dtype=torch.bfloat16)  # noqa: E731
                got = fn()
                add("torch._scaled_mm fp8 per-tensor", bench_ms(fn), (M + N) * K + 2 * M * N, diff=rel_diff(got, ref))
                del got, xf, wf
            except Exception as exc:  # noqa: BLE001
                REC.note(f"torch._scaled_mm {common['shape']}: failed ({type(exc).__name__}: {exc})")

        if M <= 4096:
            try:
                fn = lambda: torch_gemm.mxfp8_gemm(a, b, "bfloat16")  # noqa: E731
                got = fn()
                add("torch backend mxfp8_gemm", bench_ms(fn), mx_bytes, diff=rel_diff(got, ref))
                del got
            except Exception as exc:  # noqa: BLE001
                REC.note(f"torch backend {common['shape']}: failed ({type(exc).__name__}: {exc})")
        del x, w, a, b, ref
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def main():
    REC.run(measure)
    REC.finish([("op", "op", 5, ""), ("shape", "shape", 26, ""), ("impl", "impl", 34, ""), benchlib.MS,
                benchlib.TFLOPS, ("ratio", "vs bf16", 8, ".3f"), benchlib.OF_ROOF, ("diff", "rel diff", 9, ".2e")])


if __name__ == "__main__":
    main()
