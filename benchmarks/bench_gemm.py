"""MXFP8 GEMM (a [M, K], b [N, K] e4m3 MXTensors blocked along K, bf16 out): triton (sm90 TMA and pointer
kernels, autotuned; sm100: tl.dot_scaled) vs the bf16 GEMM of the same shape (torch.matmul, cuBLAS) vs
torch._scaled_mm with per-tensor fp8 scales (cuBLAS fp8: the hardware's fp8 rate without block scales,
an extra reference) vs the torch backend's mxfp8_gemm (dequantize + fp32 matmul).

    python benchmarks/bench_gemm.py [--quick] [--json PATH]    # on the GPU
    python benchmarks/bench_gemm.py --smoke                    # tiny shapes, CPU interpreter OK

Target (issue): [4096 x 1536] x [24576 x 1536] faster than the bf16 cuBLAS GEMM. See the cost model in
backends/triton/gemm.py for why an exact block-32 MX GEMM on Hopper is bound by its per-block rescale at
about the bf16 tensor-core peak. Times: medians of triton.testing.do_bench(warmup=25, rep=100); at
M = 4096 the codes are 6.3 MB (a) + 37.7 MB (b) and the bf16 output 201 MB, well beyond L2.
The last table: op, shape, impl, ms, TFLOP/s (2MNK), ratio = bf16 GEMM ms / impl
ms (> 1: faster than cuBLAS bf16), and max |impl - triton| / max |triton| as a sanity column.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="M = 4096 only")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--json", help="also write the rows as JSON here")
    return ap.parse_args()


ARGS = parse_args()
import torch  # noqa: E402

if ARGS.smoke and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import backends  # noqa: E402

backends.load()
from backends.torch import gemm as torch_gemm  # noqa: E402
from backends.torch import quantize as torch_quantize  # noqa: E402
from backends.triton import gemm as triton_gemm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QUANT = dict(elem="e4m3", scale_mode="rceil", nonfinite="saturate", scale_layout="compact")


def bench_ms(fn) -> float:
    if DEVICE == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    start = time.perf_counter()
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


def rel_diff(got, ref) -> float:
    g, r = got.float(), ref.float()
    return float((g - r).abs().max() / r.abs().max().clamp_min(1e-30))


def main():
    if ARGS.smoke:
        shapes = [(64, 96, 128)]
    elif ARGS.quick:
        shapes = [(4096, 24576, 1536)]
    else:
        shapes = [(4096, 24576, 1536), (16384, 24576, 1536), (4096, 4096, 4096)]

    rows, notes = [], []
    for M, N, K in shapes:
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(DEVICE)
        w = (torch.randn(N, K, generator=g) * 0.02).to(torch.bfloat16).to(DEVICE)
        a = torch_quantize.mxfp8_quantize(x, axis=1, **QUANT)
        b = torch_quantize.mxfp8_quantize(w, axis=1, **QUANT)
        flops = 2.0 * M * N * K
        shape = f"{M}x{K} @ {N}x{K}"

        bf16_ms = bench_ms(lambda: torch.matmul(x, w.t()))
        rows.append(dict(op="gemm", shape=shape, impl="torch.matmul bf16 (cuBLAS)", ms=bf16_ms,
                         tflops=flops / bf16_ms / 1e9, ratio=1.0))

        ref = None
        variants = ["dot_scaled"] if triton_gemm.use_dot_scaled(a.data.device) else ["tma", "pointer"]
        for variant in variants:
            out = torch.empty(M, N, dtype=torch.bfloat16, device=DEVICE)
            fn = lambda v=variant, o=out: triton_gemm.mxfp8_gemm_tensors(a, b, o, variant=v)  # noqa: E731
            secs = first_call_s(fn)
            tuner = {"tma": triton_gemm._gemm_tma, "pointer": triton_gemm._gemm_sm90,
                     "dot_scaled": triton_gemm._gemm_sm100}[variant]
            notes.append(f"triton mxfp8_gemm [{variant}] {shape}: first call {secs:.2f} s; "
                         f"pick {getattr(tuner, 'best_config', None) or '(fixed config)'}")
            got = fn()
            ref = got.clone() if ref is None else ref
            ms = bench_ms(fn)
            rows.append(dict(op="gemm", shape=shape, impl=f"triton mxfp8 [{variant}]", ms=ms,
                             tflops=flops / ms / 1e9, ratio=bf16_ms / ms, diff=rel_diff(got, ref)))

        if DEVICE == "cuda" and hasattr(torch, "_scaled_mm"):
            try:
                xf = x.to(torch.float8_e4m3fn)
                wf = w.mul(32).to(torch.float8_e4m3fn)
                one = torch.ones((), device=DEVICE)
                inv = torch.full((), 1 / 32, device=DEVICE)
                fn = lambda: torch._scaled_mm(xf, wf.t(), scale_a=one, scale_b=inv, out_dtype=torch.bfloat16)  # noqa: E731
                got = fn()
                ms = bench_ms(fn)
                rows.append(dict(op="gemm", shape=shape, impl="torch._scaled_mm fp8 per-tensor", ms=ms,
                                 tflops=flops / ms / 1e9, ratio=bf16_ms / ms, diff=rel_diff(got, ref)))
            except Exception as exc:  # noqa: BLE001
                notes.append(f"torch._scaled_mm {shape}: failed ({type(exc).__name__}: {exc})")

        if M <= 4096:
            try:
                fn = lambda: torch_gemm.mxfp8_gemm(a, b, "bfloat16")  # noqa: E731
                got = fn()
                ms = bench_ms(fn)
                rows.append(dict(op="gemm", shape=shape, impl="torch backend mxfp8_gemm", ms=ms,
                                 tflops=flops / ms / 1e9, ratio=bf16_ms / ms, diff=rel_diff(got, ref)))
            except Exception as exc:  # noqa: BLE001
                notes.append(f"torch backend {shape}: failed ({type(exc).__name__}: {exc})")
        del x, w, a, b, ref
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    for note in notes:
        print(note)
    print()
    print(f"{'op':5} {'shape':26} {'impl':34} {'ms':>9} {'TFLOP/s':>8} {'vs bf16':>8} {'rel diff':>9}")
    for r in rows:
        diff = f"{r['diff']:9.2e}" if "diff" in r else ""
        print(f"{r['op']:5} {r['shape']:26} {r['impl']:34} {r['ms']:9.4f} {r['tflops']:8.1f} {r['ratio']:8.3f} {diff}")
    if ARGS.json:
        for r in rows:
            r["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
        with open(ARGS.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
