"""The MXFP8 backward's routes on the GPU, in turns with the two bf16 cuBLAS GEMMs of the same shapes:
"dequantized" (pre-pass + cuBLAS) and "fused" (mla_q_grad_gluon.py), for the block's operand form
(x's columnwise MXFP8 copy, w's K-major columnwise copy), plus each fused GEMM kernel alone against
its cuBLAS GEMM. Bytes of the two routes compared (fraction equal; max |diff| in bf16 ulps).

    python tools/profile_fused_bwd.py [--tokens 4096,16384] [--heads 128] [--k 1536]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import torch  # noqa: E402

import backends  # noqa: E402
import benchlib  # noqa: E402

backends.load()
from backends.triton import mla_q as Q  # noqa: E402
from backends.triton import mla_q_grad_gluon as G  # noqa: E402
from backends.triton import mla_q_grad_operands as OPS  # noqa: E402
from backends.triton import quantize as TQ  # noqa: E402
from backends.triton.gemm import BF16_SAFE_SCALE_BYTES  # noqa: E402
from spec.mxtensor import MXTensor  # noqa: E402

SAFE = BF16_SAFE_SCALE_BYTES["e4m3"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--k", type=int, default=1536)
    args = ap.parse_args()
    rows = []

    def add(row):  # printed at once too: a hang later in the run (a timeout) keeps what was measured
        rows.append(row)
        print("row:", " | ".join(str(v) for v in row), flush=True)

    for T in [int(t) for t in args.tokens.split(",")]:
        H, K = args.heads, args.k
        N = H * 192
        g = torch.Generator(device="cuda").manual_seed(T)
        x = torch.randn(T, K, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        dq = torch.randn(T, H, 192, device="cuda", generator=g).to(torch.bfloat16)
        ang = torch.rand(T, 64, device="cuda", generator=g) * 6.283
        cos, sin = torch.cos(ang), torch.sin(ang)
        x_t = TQ.mxfp8_quantize(x, axis=0, elem="e4m3", scale_mode="rceil", nonfinite="saturate", scale_layout="compact")
        w_n = TQ.mxfp8_quantize(w, axis=0, elem="e4m3", scale_mode="rceil", nonfinite="saturate", scale_layout="compact")
        w_n = MXTensor(w_n.data.t().contiguous().t(), w_n.scale.t().contiguous().t(), 0, "e4m3", "compact")
        dq2 = dq.view(T, N)
        deq = lambda: Q.mla_q_backward_launch(dq, x_t, w_n, cos, sin, True, route="dequantized")  # noqa: E731
        fused = lambda: Q.mla_q_backward_launch(dq, x_t, w_n, cos, sin, True, route="fused")  # noqa: E731
        t0 = time.time()
        a = fused()
        torch.cuda.synchronize()
        first = time.time() - t0
        b = deq()
        for name, got, want in zip(("dx", "dw"), a, b):
            d = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
            add((T, f"bytes {name}: equal {float((d == 0).float().mean()):.6f}, max {int(d.max())} ulp, "
                            f"finite {bool(torch.isfinite(got).all())}", "", ""))
        gemms = lambda: (torch.matmul(dq2, w), torch.matmul(dq2.t(), x))  # noqa: E731
        t = benchlib.interleaved_ms({"gemms": gemms, "dequantized": deq, "fused": fused})
        add((T, f"route dequantized (first call fused {first:.1f} s)", t["dequantized"], t["dequantized"] / t["gemms"]))
        add((T, "route fused", t["fused"], t["fused"] / t["gemms"]))
        add((T, "two bf16 cuBLAS GEMMs", t["gemms"], 1.0))
        # the kernels alone
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        w16p = OPS.contraction_bf16(w_n, flag, SAFE, True, True)
        x16t = OPS.contraction_bf16(x_t, flag, SAFE, False, True)
        dx = torch.empty(T, K, device="cuda", dtype=torch.bfloat16)
        dw = torch.empty(N, K, device="cuda", dtype=torch.bfloat16)
        kdx = lambda: G.launch(G.FORM_DX, dq2, w16p, cos, sin, dx, flag, SAFE)  # noqa: E731
        kdw = lambda: G.launch(G.FORM_DW, dq2, x16t, cos, sin, dw, flag, SAFE)  # noqa: E731
        ops_w = lambda: OPS.contraction_bf16(w_n, flag, SAFE, True, True)  # noqa: E731
        ops_x = lambda: OPS.contraction_bf16(x_t, flag, SAFE, False, True)  # noqa: E731
        gdx = lambda: torch.matmul(dq2, w)  # noqa: E731
        gdw = lambda: torch.matmul(dq2.t(), x)  # noqa: E731
        kboth = lambda: G.launch_pair(dq2, w16p, x16t, cos, sin, dx, dw, flag, SAFE)  # noqa: E731
        t = benchlib.interleaved_ms({"gemms": gemms, "kboth": kboth, "gdx": gdx, "kdx": kdx, "gdw": gdw, "kdw": kdw,
                                     "opw": ops_w, "opx": ops_x})
        add((T, "fused dx + dw, one launch / the two cuBLAS GEMMs", t["kboth"], t["kboth"] / t["gemms"]))
        # where the kernel's time goes: the same launch without the quantization (1) or the RoPE (2)
        var = {f"p{p}": (lambda p=p: G.launch_pair(dq2, w16p, x16t, cos, sin, dx, dw, flag, SAFE,
                                                   config=dict(STAGES=3, PROFILE=p))) for p in (1, 2)}
        var["b0"] = lambda: G.launch_pair(dq2, w16p, x16t, cos, sin, dx, dw, flag, SAFE, config=dict(STAGES=3, BITS=0))
        for name in list(var):
            try:
                var[name]()
            except Exception as exc:  # a timing-only variant the installed Triton cannot compile
                print(f"variant {name} skipped: {type(exc).__name__}: {str(exc)[-200:]}")
                del var[name]
        t2 = benchlib.interleaved_ms({"gemms": gemms, "kboth": kboth, **var})
        add((T, "  same, full (this round)", t2["kboth"], t2["kboth"] / t2["gemms"]))
        if "b0" in t2:
            add((T, "  same, fp32 conversions for every chunk (BITS=0)", t2["b0"], t2["b0"] / t2["gemms"]))
        for key, what in (("p1", "g's bf16 values straight to the MMA (timing only)"),
                          ("p2", "quantized without RoPE (timing only)")):
            if key in t2:
                add((T, "  same, " + what, t2[key], t2[key] / t2["gemms"]))
        add((T, "fused dx kernel / cuBLAS dx GEMM", t["kdx"], t["kdx"] / t["gdx"]))
        add((T, "fused dw kernel / cuBLAS dw GEMM", t["kdw"], t["kdw"] / t["gdw"]))
        add((T, "w operand pass (permuted, K-major)", t["opw"], ""))
        add((T, "x operand pass (K-major)", t["opx"], ""))
        add((T, f"flag after the kernels: {int(flag.item())}", "", ""))
        del x, w, dq, x_t, w_n, dq2, w16p, x16t, dx, dw, a, b
        torch.cuda.empty_cache()
    benchlib.print_ms_rows(rows, 70, "ratio")


if __name__ == "__main__":
    main()
