"""Can the MXFP8 backward's pre-pass hide behind its cuBLAS GEMMs? The dequantized route's pieces
(the per-head pre-pass, cuBLAS dx and dw on its bf16 outputs) run serially, and in token chunks on two
streams: the pre-pass of chunk i + 1 on a side stream while dx of chunk i runs (a dx chunk fills fewer
tiles than the GPU has SMs), dw after the last chunk. Timed in turns with the two bf16 cuBLAS GEMMs
alone; dx / dw bytes compared with the serial order's.

    python tools/probe_bwd_overlap.py [--tokens 4096,16384] [--chunks 2,4]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import torch  # noqa: E402

import backends  # noqa: E402
import benchlib  # noqa: E402

backends.load()
from backends.triton.mla_q_prepass import prepass_dequantized  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--chunks", default="2,4")
    args = ap.parse_args()
    rows = []
    side = torch.cuda.Stream()
    for T in [int(t) for t in args.tokens.split(",")]:
        H, K = 128, 1536
        N = H * 192
        g = torch.Generator(device="cuda").manual_seed(T)
        x16 = torch.randn(T, K, device="cuda", generator=g).to(torch.bfloat16)
        w16 = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        dq2 = torch.randn(T, N, device="cuda", generator=g).to(torch.bfloat16)
        ang = torch.rand(T, 64, device="cuda", generator=g) * 6.283
        cos, sin = torch.cos(ang), torch.sin(ang)
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        grow = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
        gcol = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
        dx = torch.empty(T, K, device="cuda", dtype=torch.bfloat16)
        dw = torch.empty(N, K, device="cuda", dtype=torch.bfloat16)

        def pre(a, b):
            prepass_dequantized(dq2[a:b], cos[a:b], sin[a:b], flag, grow[a:b], gcol[a:b], True)

        def serial():
            pre(0, T)
            torch.mm(grow, w16, out=dx)
            torch.mm(gcol.t(), x16, out=dw)

        def chunked(n):
            # whole column blocks (32 tokens) per chunk: the column quantization must not be cut
            bounds = [min(T, (T * i // n + 31) // 32 * 32) for i in range(n + 1)]

            def run():
                main_s = torch.cuda.current_stream()
                pre(bounds[0], bounds[1])
                done = []
                for i in range(n):
                    if i + 1 < n:
                        ev = torch.cuda.Event()
                        ev.record(main_s)  # the previous pre-pass first: its chunk's dx waits on it
                        side.wait_event(ev)
                        with torch.cuda.stream(side):
                            pre(bounds[i + 1], bounds[i + 2])
                            e_next = torch.cuda.Event()
                            e_next.record(side)
                        done.append(e_next)
                    a, b = bounds[i], bounds[i + 1]
                    torch.mm(grow[a:b], w16, out=dx[a:b])
                    if i + 1 < n:
                        main_s.wait_event(done[-1])
                torch.mm(gcol.t(), x16, out=dw)
            return run

        def gemms():
            torch.mm(grow, w16, out=dx)
            torch.mm(gcol.t(), x16, out=dw)

        def pre_only():
            pre(0, T)

        serial()
        torch.cuda.synchronize()
        ref = (dx.clone(), dw.clone())
        fns = {"gemms": gemms, "pre": pre_only, "serial": serial}
        for n in [int(c) for c in args.chunks.split(",")]:
            fns[f"chunks{n}"] = chunked(n)
            dx.fill_(float("nan"))
            dw.fill_(float("nan"))
            fns[f"chunks{n}"]()
            torch.cuda.synchronize()
            eq = [float((a.view(torch.int16) == b.view(torch.int16)).float().mean()) for a, b in zip((dx, dw), ref)]
            rows.append((T, f"chunks{n}: bytes equal to serial dx {eq[0]:.6f} dw {eq[1]:.6f}", "", ""))
        t = benchlib.interleaved_ms(fns)
        for name, ms in t.items():
            rows.append((T, name, ms, ms / t["gemms"]))
        del x16, w16, dq2, grow, gcol, dx, dw
        torch.cuda.empty_cache()
    benchlib.print_ms_rows(rows, 60, "ratio to the two GEMMs")


if __name__ == "__main__":
    main()
