"""RMSNorm straight to MXFP8 (rowwise + columnwise e4m3, rstd), bf16 x [T, D] for DeepSeek-V3's
D = 1536 (q_a norm) and D = 7168 (hidden): triton (one kernel) vs torch eager vs torch.compile of the
eager op vs a copy of x (2 bytes read + 2 written per element: the same traffic as the op's
x read + two 1-byte code writes, so "vs copy" is the fraction of the bandwidth roof reached).

    python benchmarks/bench_rmsnorm.py [--quick] [--json PATH]     # on the GPU
    python benchmarks/bench_rmsnorm.py --smoke                     # tiny shapes, CPU interpreter OK

Times are medians of triton.testing.do_bench(warmup=25, rep=100) on inputs larger than L2 (60 MB).
Bytes per call: x, both code tensors, both scale tensors, gamma, rstd. First-call time (compile +
autotune) is reported. "same" says whether an impl's codes, scales and rstd equal triton's bytes.
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
    ap.add_argument("--quick", action="store_true", help="one T per D; torch.compile included")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--json", help="also write the rows as JSON here")
    return ap.parse_args()


ARGS = parse_args()
import torch  # noqa: E402

if ARGS.smoke and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import backends  # noqa: E402

backends.load()
from backends.torch import rmsnorm as torch_rmsnorm  # noqa: E402
from backends.triton import rmsnorm as triton_rmsnorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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


def outputs_equal(a, b) -> bool:
    (ar, ac, ars), (br, bc, brs) = a, b
    same = lambda u, v: torch.equal(u.view(torch.uint8), v.view(torch.uint8))  # noqa: E731
    return (same(ar.data, br.data) and same(ar.scale, br.scale) and same(ac.data, bc.data)
            and same(ac.scale, bc.scale) and torch.equal(ars.view(torch.int32), brs.view(torch.int32)))


def main():
    if ARGS.smoke:
        shapes = [(64, 96), (32, 160)]
    elif ARGS.quick:
        shapes = [(32768, 1536), (16384, 7168)]
    else:
        shapes = [(32768, 1536), (65536, 1536), (8192, 7168), (16384, 7168)]

    rows, notes = [], []
    for T, D in shapes:
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(T, D, generator=g).to(torch.bfloat16).to(DEVICE)
        gamma = (1 + 0.1 * torch.randn(D, generator=g)).to(torch.bfloat16).to(DEVICE)
        shape = f"[{T},{D}] bf16"
        nbytes = x.numel() * 2 + 2 * x.numel() + 2 * (x.numel() // 32) + D * 2 + T * 4

        out_copy = torch.empty_like(x)
        copy_ms = bench_ms(lambda: out_copy.copy_(x))
        rows.append(dict(op="copy", shape=shape, impl="torch copy_", ms=copy_ms,
                         tbps=4 * x.numel() / copy_ms / 1e9, ratio=1.0, vs="copy"))

        secs = first_call_s(lambda: triton_rmsnorm.rmsnorm_mxfp8(x, gamma))
        notes.append(f"triton rmsnorm_mxfp8 {shape}: first call {secs:.2f} s (compile + autotune)")
        ref = triton_rmsnorm.rmsnorm_mxfp8(x, gamma)
        ms = bench_ms(lambda: triton_rmsnorm.rmsnorm_mxfp8(x, gamma))
        best = getattr(triton_rmsnorm._rmsnorm_tuned, "best_config", None)
        rows.append(dict(op="rmsnorm_mxfp8", shape=shape, impl="triton", ms=ms, tbps=nbytes / ms / 1e9,
                         ratio=copy_ms / ms, vs="copy", same=True,
                         note=str(best) if best is not None and DEVICE == "cuda" else ""))

        baselines = [("torch eager", torch_rmsnorm.rmsnorm_mxfp8)]
        if DEVICE == "cuda":
            baselines.append(("torch.compile(eager)", torch.compile(torch_rmsnorm.rmsnorm_mxfp8, dynamic=False)))
        for name, fn in baselines:
            try:
                if name.startswith("torch.compile"):
                    secs = first_call_s(lambda: fn(x, gamma))
                    notes.append(f"{name} {shape}: first call {secs:.2f} s")
                same = outputs_equal(fn(x, gamma), ref)
                ms = bench_ms(lambda: fn(x, gamma))
            except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
                notes.append(f"{name} {shape}: failed ({type(exc).__name__}: {str(exc)[:200]})")
                continue
            rows.append(dict(op="rmsnorm_mxfp8", shape=shape, impl=name, ms=ms, tbps=nbytes / ms / 1e9,
                             ratio=copy_ms / ms, vs="copy", same=same))
        del x, out_copy, ref
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    for note in notes:
        print(note)
    print()
    print(f"{'op':14} {'shape':20} {'impl':22} {'ms':>9} {'TB/s':>7} {'vs copy':>8} same")
    for r in rows:
        print(f"{r['op']:14} {r['shape']:20} {r['impl']:22} {r['ms']:9.4f} {r['tbps']:7.3f} "
              f"{r['ratio']:8.3f} {r.get('same', '')}")
    if ARGS.json:
        for r in rows:
            r["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
        with open(ARGS.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
