"""MXFP8 quantize (e4m3, rceil, saturate): triton rowwise / columnwise / both in one pass, against a
device-to-device copy (the bandwidth roof), torch eager and torch.compile of the eager torch backend.

    python benchmarks/bench_quantize.py [--quick] [--sweep] [--json PATH]   # on the GPU
    python benchmarks/bench_quantize.py --smoke                             # tiny shapes, CPU interpreter OK

Headline: bf16 [16384, 24576] (DeepSeek-V3 q after the up-projection: T x H*192). Targets: dual
(axis=(-1, 0)) >= 90% of copy bandwidth and >= 1.4x torch.compile producing both; rowwise >= compile.

- copy: dst.copy_(src) of an input-sized buffer; TB/s counts its read + write.
- an op's TB/s counts what it must move once: input read, each code array and each scale array written
  (dual bf16: 2 + 1 + 1 + 2/32 bytes per element). "vs copy" (JSON: ratio) = op TB/s / copy TB/s,
  the roof fraction; "vs compile" = torch.compile time / this time for the same op.
- baselines (torch eager, torch.compile of it) run for row and dual, the two ops with targets (col
  too with --sweep).
- times: medians of triton.testing.do_bench(warmup=25, rep=100), which flushes L2 between runs; inputs
  are larger than L2 (60 MB). First-call times (compile + autotune) are printed, and the autotuned
  tile. "same" says whether the impl's codes and scales equal triton's bytes.
--sweep adds more shapes (DeepSeek-V3 K = 1536 / 7168 / 24576, other T), fp32 / fp16 inputs, swizzled
scales written directly and dequantize.
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
    ap.add_argument("--quick", action="store_true", help="the headline shape only")
    ap.add_argument("--sweep", action="store_true", help="more shapes and dtypes, swizzled scales, dequantize")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    ap.add_argument("--json", help="also write the rows as JSON here")
    return ap.parse_args()


ARGS = parse_args()
import torch  # noqa: E402

if ARGS.smoke and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

import backends  # noqa: E402

backends.load()
from backends.torch import quantize as torch_quantize  # noqa: E402
from backends.triton import quantize as triton_quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
AXES = {"row": -1, "col": 0, "dual": (-1, 0)}


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


def flat_outputs(out):
    """(data, scale, ...) tensors of one MXTensor or a tuple of them."""
    ts = out if isinstance(out, tuple) else (out,)
    return [v for t in ts for v in (t.data, t.scale)]


def same_bytes(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(u.view(torch.uint8), v.view(torch.uint8)) for u, v in zip(a, b))


def op_bytes(x: torch.Tensor, which: str) -> int:
    n = x.numel()
    outs = 2 if which == "dual" else 1
    return n * x.element_size() + outs * (n + n // 32)


def compiled_quantize(axis, scale_layout):
    """torch.compile of the eager torch backend, returning plain tensors (data, scale per output)."""

    def fn(x):
        return tuple(flat_outputs(torch_quantize.mxfp8_quantize(x, axis=axis, scale_layout=scale_layout)))

    return torch.compile(fn, dynamic=False)


def shapes_and_dtypes():
    if ARGS.smoke:
        return [((64, 96), torch.bfloat16), ((96, 160), torch.float32)]
    head = [((16384, 24576), torch.bfloat16)]
    if ARGS.quick or not ARGS.sweep:
        return head
    return head + [((16384, 1536), torch.bfloat16), ((65536, 1536), torch.bfloat16), ((16384, 7168), torch.bfloat16),
                   ((4096, 24576), torch.bfloat16), ((16384, 24576 + 96), torch.bfloat16),
                   ((8192, 24576), torch.float32), ((16384, 24576), torch.float16)]


def main():
    rows, notes = [], []
    layouts = ("compact", "swizzled") if (ARGS.sweep or ARGS.smoke) else ("compact",)
    for (m, n), dtype in shapes_and_dtypes():
        g = torch.Generator(device="cpu").manual_seed(0)
        x = (torch.randn(m, n, generator=g) * torch.exp2(torch.randint(-8, 9, (m, 1), generator=g).float()))
        x = x.to(dtype).to(DEVICE)
        shape = f"[{m},{n}] {str(dtype).replace('torch.', '')}"

        dst = torch.empty_like(x)
        copy_ms = bench_ms(lambda: dst.copy_(x))
        copy_tbps = 2 * x.numel() * x.element_size() / copy_ms / 1e9
        rows.append(dict(op="copy", shape=shape, impl="torch copy_", ms=copy_ms, tbps=copy_tbps, ratio=1.0, vs="copy"))
        del dst

        for layout in layouts:
            for which in ("row", "col", "dual"):
                axis = AXES[which]
                op = f"quantize {which}" + (" swz" if layout == "swizzled" else "")
                nbytes = op_bytes(x, which)

                def run_triton(axis=axis, layout=layout):
                    return triton_quantize.mxfp8_quantize(x, axis=axis, scale_layout=layout)

                secs = first_call_s(run_triton)
                ref = flat_outputs(run_triton())
                ms = bench_ms(run_triton)
                best = getattr(triton_quantize._quantize_tuned, "best_config", None) if DEVICE == "cuda" else None
                tile = (f"BM={best.kwargs['BM']} BN={best.kwargs['BN']} warps={best.num_warps} maxnreg={best.maxnreg}"
                        if best is not None else f"{triton_quantize._INTERPRET_CONFIG} (interpreter)")
                notes.append(f"triton {op} {shape}: first call {secs:.2f} s (compile + autotune); tile {tile}")
                trow = dict(op=op, shape=shape, impl="triton", ms=ms, tbps=nbytes / ms / 1e9,
                            ratio=nbytes / ms / 1e9 / copy_tbps, vs="copy", same=True, note=tile)
                rows.append(trow)

                baselines = []
                if which != "col" or ARGS.sweep or ARGS.smoke:  # the targets compare row and dual
                    baselines.append(("torch eager", lambda axis=axis, layout=layout: flat_outputs(
                        torch_quantize.mxfp8_quantize(x, axis=axis, scale_layout=layout))))
                if DEVICE == "cuda" and not ARGS.no_compile and (which != "col" or ARGS.sweep):
                    baselines.append(("torch.compile(eager)", compiled_quantize(axis, layout)))
                for name, fn in baselines:
                    try:
                        if name.startswith("torch.compile"):
                            secs = first_call_s(lambda: fn(x))
                            notes.append(f"{name} {op} {shape}: first call {secs:.2f} s")
                            out = list(fn(x))
                            bms = bench_ms(lambda: fn(x))
                        else:
                            out = fn()
                            bms = bench_ms(fn)
                    except Exception as exc:  # noqa: BLE001 - report it, keep benchmarking
                        notes.append(f"{name} {op} {shape}: failed ({type(exc).__name__}: {str(exc)[:300]})")
                        continue
                    rows.append(dict(op=op, shape=shape, impl=name, ms=bms, tbps=nbytes / bms / 1e9,
                                     ratio=nbytes / bms / 1e9 / copy_tbps, vs="copy", same=same_bytes(out, ref)))
                    if name.startswith("torch.compile"):
                        trow["vs_compile"] = bms / ms
                    del out
                del ref
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()

        if ARGS.sweep or ARGS.smoke:  # dequantize: 1 code byte + 1/32 scale byte in, 4 or 2 bytes out
            for layout in layouts:
                t = triton_quantize.mxfp8_quantize(x, axis=-1, scale_layout=layout)
                for out_dtype, size in (("float32", 4), ("bfloat16", 2)):
                    op = f"dequantize {out_dtype}" + (" swz" if layout == "swizzled" else "")
                    nbytes = x.numel() * (1 + size) + x.numel() // 32
                    first_call_s(lambda: triton_quantize.mxfp8_dequantize(t, out_dtype))
                    ms = bench_ms(lambda: triton_quantize.mxfp8_dequantize(t, out_dtype))
                    rows.append(dict(op=op, shape=shape, impl="triton", ms=ms, tbps=nbytes / ms / 1e9,
                                     ratio=nbytes / ms / 1e9 / copy_tbps, vs="copy"))
                    ms = bench_ms(lambda: torch_quantize.mxfp8_dequantize(t, out_dtype))
                    rows.append(dict(op=op, shape=shape, impl="torch eager", ms=ms, tbps=nbytes / ms / 1e9,
                                     ratio=nbytes / ms / 1e9 / copy_tbps, vs="copy"))
                del t
        del x
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    for note in notes:
        print(note)
    print()
    print(f"{'op':24} {'shape':24} {'impl':22} {'ms':>9} {'TB/s':>7} {'vs copy':>8} {'vs compile':>10} same")
    for r in rows:
        vc = f"{r['vs_compile']:10.2f}" if "vs_compile" in r else " " * 10
        print(f"{r['op']:24} {r['shape']:24} {r['impl']:22} {r['ms']:9.4f} {r['tbps']:7.3f} "
              f"{r['ratio']:8.3f} {vc} {r.get('same', '')}")
    if ARGS.json:
        device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
        rows[0]["note"] = f"{device}, torch {torch.__version__}, triton {triton.__version__}"
        with open(ARGS.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
