"""Fused MLA Q up-projection + RoPE + dual MXFP8 quantize (DeepSeek-V3: x [T, 1536] bf16, w [128*192, 1536]
bf16, cos/sin [T, 64]): triton (the Gluon sm90 kernel, and the TMA and pointer kernels, each autotuned) vs the bf16 GEMM alone
(torch.matmul, cuBLAS) vs the unfused chain in torch eager and under torch.compile
(torch.matmul -> backends.torch.rope -> backends.torch.quantize along (-1, 0)). Also the 16-bit
backward (triton pre-pass + cuBLAS GEMMs vs the torch eager composition) and, with --mx, the MXFP8
projection variant.

    python benchmarks/bench_mla_q.py [--quick] [--mx] [--tokens 1024,...] [--no-compile] [--json PATH]  # GPU
    python benchmarks/bench_mla_q.py --smoke                            # tiny shapes, CPU interpreter OK

Targets (issue): fused <= 1.15x the time of the bf16 GEMM alone, and >= 1.5x faster than torch.compile
of the unfused chain, at T = 4096 and 16384. Times are medians of triton.testing.do_bench(warmup=25,
rep=100); inputs exceed L2 (w alone is 75 MB). TFLOP/s counts the GEMM's 2*T*N*K. The last table is:
op, shape, impl, ms, TFLOP/s, ratio to the bf16 GEMM (impl ms / gemm ms: the issue's 1.15x figure),
and "same" = fraction of code bytes equal to the triton output (the GEMM's summation order may flip
rare codes; SEMANTICS 6). First-call times (compile + autotune) and the autotuner's pick are printed.
--tokens sets T (default 4096, 16384, and 32768 without --quick); for each T the torch.compile baseline
runs last, after the backward and MXFP8 rows, so a slow compile costs only its own row.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchlib  # noqa: E402


ARGS = benchlib.parse_script_args(__doc__, "T in 4096, 16384 only; no backward", "T of x [T, 1536]", flags=[("--mx", "also the MXFP8-projection variant")])
import torch  # noqa: E402

import backends  # noqa: E402

backends.load()
from backends.torch import quantize as torch_quantize  # noqa: E402
from backends.torch import rope as torch_rope  # noqa: E402
from backends.triton import mla_q as triton_mla_q  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D = 192
QUANT = dict(elem="e4m3", scale_mode="rceil", nonfinite="saturate", scale_layout="compact")
bench_ms, first_call_s = benchlib.bench_ms, benchlib.first_call_s
REC = benchlib.Recorder("mla_q", ARGS)
VS = "gemm time"  # ratio = impl ms / the bf16 GEMM's ms at the same T (lower is better)


def unfused_chain(x, w, cos, sin):
    """What a framework does without the fused kernel: cuBLAS bf16 GEMM (fp32 accumulate, one RN to
    bf16 = the staging), the eager RoPE op into fp32, the eager dual quantize."""
    tokens, heads = x.shape[0], w.shape[0] // D
    q = torch.matmul(x, w.t()).view(tokens, heads, D)
    pos = torch.arange(tokens, device=x.device)
    q32 = torch_rope.rope(q, cos, sin, style="mla", layout="thd", positions=pos, out_dtype="float32")
    return torch_quantize.mxfp8_quantize(q32, axis=(-1, 0), **QUANT)


def unfused_backward(dq, x, w, cos, sin):
    tokens = x.shape[0]
    pos = torch.arange(tokens, device=x.device)
    g = torch_rope.rope_backward(dq, cos, sin, style="mla", layout="thd", positions=pos,
                                 out_dtype="bfloat16").reshape(tokens, -1)
    return torch.matmul(g, w), torch.matmul(g.t(), x)


def same_fraction(got, want) -> float:
    """Fraction of equal code bytes over both outputs (data and scales)."""
    eq = tot = 0
    for g, w in zip(got, want):
        for a, b in ((g.data, w.data), (g.scale, w.scale)):
            a8, b8 = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
            eq += int((a8 == b8).sum())
            tot += a8.numel()
    return eq / tot


def make_inputs(tokens, k, heads, mx=False):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(heads * D, k, generator=g) * 0.02).to(torch.bfloat16).to(DEVICE)
    angle = torch.rand(tokens, 64, generator=g) * 6.28
    cos, sin = torch.cos(angle).to(DEVICE), torch.sin(angle).to(DEVICE)
    if mx:
        x = torch_quantize.mxfp8_quantize(x, axis=1, **QUANT)
        w = torch_quantize.mxfp8_quantize(w, axis=1, **QUANT)
    return x, w, cos, sin


def best_config(tuner) -> str:
    cfg = getattr(tuner, "best_config", None)
    return str(cfg) if cfg is not None else "(fixed config)"


def main():
    K, H = 1536, 128
    if ARGS.smoke:
        tokens, K, H = ARGS.tokens or [64], 64, 2
    else:
        tokens = ARGS.tokens or ([4096, 16384] if ARGS.quick else [4096, 16384, 32768])
    REC.run(measure, tokens, K, H)
    REC.finish([("op", "op", 7, ""), ("shape", "shape", 18, ""), ("impl", "impl", 36, ""), benchlib.MS,
                benchlib.TFLOPS, ("ratio", "vs gemm", 8, ".3f"), benchlib.OF_ROOF, ("same", "same", 8, ".6f")])


def measure_mx_backward(T, K, H, x, w, xm, wm, cos, sin, flops, common):
    """The MXFP8 backward (quantize_grad=True) against the two bf16 GEMMs of the same shapes, in turns,
    for the operand forms the block passes: bf16 x / w, and the forward's columnwise MXFP8 copies (w's
    row-major, and K-major as a per-step weight cache keeps it); then the pre-pass alone against a copy
    of dq (bytes: dq read, the two bf16 dequantized tensors written)."""
    dq = torch.randn(T, H, D, device=DEVICE).to(torch.bfloat16)
    dq2 = dq.view(T, -1)
    x_t = triton_quantize_axis0(x)
    w_n = triton_quantize_axis0(w)
    w_n_kmajor = type(w_n)(w_n.data.t().contiguous().t(), w_n.scale.t().contiguous().t(), 0, "e4m3", "compact")
    gemms = lambda: (torch.matmul(dq2, w), torch.matmul(dq2.t(), x))  # noqa: E731
    forms = {"bf16 x, w": (x, w), "MXFP8 x_t, w_n": (x_t, w_n), "MXFP8 x_t, K-major w_n": (x_t, w_n_kmajor)}
    for name, (xa, wa) in forms.items():
        fn = lambda xa=xa, wa=wa: triton_mla_q.mla_q_backward_launch(dq, xa, wa, cos, sin, True)  # noqa: E731
        secs = first_call_s(fn)
        pair = benchlib.interleaved_ms({"gemms": gemms, "bwd": fn})
        REC.row(op="bwd-mx", impl=f"triton MXFP8 backward (dequantized), {name} (first call {secs:.2f} s; in turns "
                f"with the two GEMMs: {pair['gemms']:.4f} ms)", ms=pair["bwd"], tflops=2 * flops / pair["bwd"] / 1e9,
                ratio=pair["bwd"] / pair["gemms"], vs="2 bf16 GEMMs", flops=2 * flops, **common)
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    prep = lambda: triton_mla_q._prep_launch(dq2, cos, sin, rope=True, row_dq=True, col_dq=True, flag=flag)  # noqa: E731
    out = torch.empty_like(dq2)
    times = benchlib.interleaved_ms({"copy": lambda: out.copy_(dq2), "prep": prep})
    nbytes = dq2.numel() * 6
    REC.row(op="bwd-prep", impl="RoPE backward + both quantizations, dequantized bf16 out", ms=times["prep"],
            tbps=nbytes / times["prep"] / 1e9, ratio=(nbytes / times["prep"]) / (4 * dq2.numel() / times["copy"]),
            vs="copy bandwidth", bytes=nbytes, **common)
    del dq, dq2, x_t, w_n, w_n_kmajor, out


def triton_quantize_axis0(t):
    from backends.triton import quantize as triton_quantize

    return triton_quantize.mxfp8_quantize(t, axis=0)


def measure(tokens, K, H):
    REC.load_peaks()
    for T in tokens:
        x, w, cos, sin = make_inputs(T, K, H)
        N = H * D
        flops = 2.0 * T * N * K
        shape = f"T{T} K{K} H{H}"
        common = dict(shape=shape, family=f"K{K} H{H}", tokens=T)
        rope_bytes = 2 * T * 64 * 4
        # what the fused op must move once: x, w, cos/sin in; two code arrays and their scales out
        fwd_bytes = 2 * T * K + 2 * N * K + rope_bytes + 2 * (T * N + T * N // 32)

        gemm_ms = bench_ms(lambda: torch.matmul(x, w.t()))
        REC.row(op="fwd", impl="torch.matmul bf16 (GEMM only)", ms=gemm_ms, tflops=flops / gemm_ms / 1e9, ratio=1.0,
                vs=VS, flops=flops, bytes=2 * T * K + 2 * N * K + 2 * T * N, **common)

        def fwd_row(impl, ms, **kw):
            return REC.row(op="fwd", impl=impl, ms=ms, tflops=flops / ms / 1e9, ratio=ms / gemm_ms, vs=VS,
                           flops=flops, bytes=fwd_bytes, **common, **kw)

        ref = None
        for variant in ("gluon_ws", "gluon_ws128", "tma", "pointer"):
            if variant.startswith("gluon") and triton_mla_q.gluon_reasons(x, w):
                REC.note(f"triton fwd [gluon] {shape}: not run ({'; '.join(triton_mla_q.gluon_reasons(x, w))})")
                continue
            if variant == "gluon_ws128" and T % 128:
                continue
            if variant == "tma" and (DEVICE != "cuda" or torch.cuda.get_device_capability() < (9, 0)):
                if not ARGS.smoke:
                    continue
            fn = lambda v=variant: triton_mla_q.mla_q_forward_launch(x, w, cos, sin, variant=v)  # noqa: E731
            secs = first_call_s(fn)
            if variant.startswith("gluon"):
                REC.note(f"triton fwd [{variant}] {shape}: first call {secs:.2f} s (compile; fixed config)")
            else:
                tuner = triton_mla_q._fwd_tma_tuned[False] if variant == "tma" else triton_mla_q._fwd_tuned[False]
                REC.note(f"triton fwd [{variant}] {shape}: first call {secs:.2f} s (compile + autotune); "
                         f"pick {best_config(tuner)}")
            out = fn()
            if ref is None:
                ref = out
            fwd_row(f"triton fused [{variant}]", bench_ms(fn), same=same_fraction(out, ref))
            del out

        # The target's pair (the default fused forward against the GEMM) timed in turns, 3 rounds: the
        # GEMM alone read 1.74-1.90 ms at T = 16384 across the runs of one machine, so a ratio of two
        # readings minutes apart carries that drift.
        default = triton_mla_q.forward_variant(x, w)
        pair = benchlib.interleaved_ms({
            "gemm": lambda: torch.matmul(x, w.t()),
            "fused": lambda: triton_mla_q.mla_q_forward_launch(x, w, cos, sin, variant=default)})
        REC.row(op="fwd", impl=f"triton fused [{default}] (in turns with the GEMM: {pair['gemm']:.4f} ms)",
                ms=pair["fused"], tflops=flops / pair["fused"] / 1e9, ratio=pair["fused"] / pair["gemm"], vs=VS,
                flops=flops, bytes=fwd_bytes, **common)

        def run_baseline(name, fn):
            try:
                if name.startswith("torch.compile"):
                    secs = first_call_s(lambda: fn(x, w, cos, sin))
                    REC.note(f"{name} {shape}: first call {secs:.2f} s")
                out = fn(x, w, cos, sin)
                same = same_fraction(out, ref)
                del out
                ms = bench_ms(lambda: fn(x, w, cos, sin))
            except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
                REC.note(f"{name} {shape}: failed ({type(exc).__name__}: {str(exc)[:300]})")
                return
            fwd_row(name, ms, same=same)

        run_baseline("torch eager unfused", unfused_chain)

        if not ARGS.quick:
            dq = torch.randn(T, H, D, device=DEVICE).to(torch.bfloat16)
            # dq, x, w, cos/sin in; dx [T, K] and dw [N, K] bf16 out
            bwd_bytes = 2 * T * N + 2 * (2 * T * K + 2 * N * K) + rope_bytes
            bwd_gemm_ms = bench_ms(lambda: (torch.matmul(dq.view(T, -1), w), torch.matmul(dq.view(T, -1).t(), x)))
            REC.row(op="bwd", impl="torch.matmul bf16 x2 (GEMMs only)", ms=bwd_gemm_ms,
                    tflops=2 * flops / bwd_gemm_ms / 1e9, ratio=1.0, vs=VS, flops=2 * flops, bytes=bwd_bytes,
                    **common)
            for name, fn in (("triton pre-pass + cuBLAS",
                              lambda: triton_mla_q.mla_q_backward_launch(dq, x, w, cos, sin, False)),
                             ("torch eager unfused", lambda: unfused_backward(dq, x, w, cos, sin))):
                ms = bench_ms(fn)
                REC.row(op="bwd", impl=name, ms=ms, tflops=2 * flops / ms / 1e9, ratio=ms / bwd_gemm_ms, vs=VS,
                        flops=2 * flops, bytes=bwd_bytes, **common)
            del dq

        if ARGS.mx or ARGS.smoke:
            xm, wm, _, _ = make_inputs(T, K, H, mx=True)
            mx_bytes = fwd_bytes - (T * K + N * K) + (T * K + N * K) // 32  # 1-byte codes + scales in
            mx_default = triton_mla_q.forward_variant(xm, wm)
            fn = lambda: triton_mla_q.mla_q_forward_launch(xm, wm, cos, sin, variant=mx_default)  # noqa: E731
            secs = first_call_s(fn)
            REC.note(f"triton fwd MXFP8 [{mx_default}] {shape}: first call {secs:.2f} s")
            pair = benchlib.interleaved_ms({"gemm": lambda: torch.matmul(x, w.t()), "fused": fn})
            REC.row(op="fwd-mx", impl=f"triton fused MXFP8 [{mx_default}] (in turns with the GEMM: "
                    f"{pair['gemm']:.4f} ms)", ms=pair["fused"], tflops=flops / pair["fused"] / 1e9,
                    ratio=pair["fused"] / pair["gemm"], vs=VS, flops=flops, bytes=mx_bytes, **common)
            measure_mx_backward(T, K, H, x, w, xm, wm, cos, sin, flops, common)
            for variant in ("gluon_ws128", "tma", "pointer"):  # the others, not in turns
                if variant == mx_default or triton_mla_q.forward_variant_reasons(variant, xm, wm):
                    continue
                fn = lambda v=variant: triton_mla_q.mla_q_forward_launch(xm, wm, cos, sin, variant=v)  # noqa: E731
                secs = first_call_s(fn)
                REC.note(f"triton fwd MXFP8 [{variant}] {shape}: first call {secs:.2f} s")
                ms = bench_ms(fn)
                REC.row(op="fwd-mx", impl=f"triton fused MXFP8 [{variant}]", ms=ms, tflops=flops / ms / 1e9,
                        ratio=ms / gemm_ms, vs=VS, flops=flops, bytes=mx_bytes, **common)
            del xm, wm

        if DEVICE == "cuda" and not ARGS.no_compile:  # last: a slow compile costs only its own row
            run_baseline("torch.compile unfused", benchlib.compile_static(unfused_chain))
        del ref, x, w, cos, sin
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
