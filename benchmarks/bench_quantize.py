"""MXFP8 quantize (e4m3, rceil, saturate): triton rowwise / columnwise / both in one pass, against a
device-to-device copy (the bandwidth roof), torch eager, torchao's MXFP8 casts (when torchao imports) and
torch.compile of the eager torch backend.

    python benchmarks/bench_quantize.py [--quick] [--sweep] [--tokens 1024,...] [--no-compile] [--json PATH]
    python benchmarks/bench_quantize.py --smoke            # tiny shapes, CPU interpreter OK

Headline: bf16 [16384, 24576] (DeepSeek-V3 q after the up-projection: T x H*192). --tokens sets the
rows T of that shape (e.g. 1024,2048,4096,8192,16384,32768). Targets: dual (axis=(-1, 0)) >= 90% of copy
bandwidth and >= 1.4x torch.compile producing both; rowwise >= compile.

- copy: dst.copy_(src) of an input-sized buffer; TB/s counts its read + write.
- an op's TB/s counts what it must move once (JSON: bytes): input read, each code array and each scale
  array written (dual bf16: 2 + 1 + 1 + 2/32 bytes per element). "ratio" (vs copy) = op TB/s / copy
  TB/s at the same shape, the roof fraction; "vs compile" = torch.compile time / this time, same op.
- peers: torch eager (row and dual; col too with --sweep), torchao (bf16 inputs, compact scales):
  triton_to_mxfp8_dim0 (row), triton_to_mxfp8_dim1 (col), both calls (dual), and its torch
  reference cast to_mx (row). torchao's triton rceil needs sm100 (a ue8m0 convert instruction): below
  sm100 its kernels run with floor scales ("[floor scales]": same bytes moved, other scale values, so
  same_frac < 1 is expected); to_mx always uses rceil. torch.compile of the eager backend (row,
  dual) and of torchao's to_mx (row) come last in each shape's loop, so a slow compile costs only its
  own rows.
- times: medians of triton.testing.do_bench(warmup=25, rep=100), which flushes L2 between runs. First
  call times (compile + autotune) are printed, and the autotuned tile. "same" says whether the impl's
  codes and scales equal triton's bytes (torchao: same_frac = the fraction of equal bytes, when not 1).
--sweep adds more shapes (DeepSeek-V3 K = 1536 / 7168 / 24576, other T), fp32 / fp16 inputs, swizzled
scales written directly and dequantize.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchlib  # noqa: E402


ARGS = benchlib.parse_script_args(__doc__, "the headline shape only", "rows T of x [T, 24576] bf16", flags=[("--sweep", "more shapes and dtypes, swizzled scales, dequantize")])
import torch  # noqa: E402

import triton  # noqa: E402

import backends  # noqa: E402

backends.load()
from backends.torch import quantize as torch_quantize  # noqa: E402
from backends.triton import quantize as triton_quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
AXES = {"row": -1, "col": 0, "dual": (-1, 0)}
HEAD_N = 24576
bench_ms, first_call_s = benchlib.bench_ms, benchlib.first_call_s
REC = benchlib.Recorder("quantize", ARGS)


def flat_outputs(out):
    """(data, scale, ...) tensors of one MXTensor or a tuple of them."""
    ts = out if isinstance(out, tuple) else (out,)
    return [v for t in ts for v in (t.data, t.scale)]


def same_bytes(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(u.view(torch.uint8), v.view(torch.uint8)) for u, v in zip(a, b))


def equal_fraction(got, want) -> float | None:
    """Fraction of equal bytes over matching tensors; a 2-D tensor whose transpose has the other's shape
    is compared transposed (torchao writes columnwise scales as [cols, rows/32])."""
    eq = tot = 0
    for a, b in zip(got, want):
        if a.shape != b.shape and a.dim() == 2 and a.t().shape == b.shape:
            a = a.t()
        if a.shape != b.shape:
            return None
        a8, b8 = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
        eq += int((a8 == b8).sum())
        tot += a8.numel()
    return eq / tot if tot else None


def op_bytes(x: torch.Tensor, which: str) -> int:
    n = x.numel()
    outs = 2 if which == "dual" else 1
    return n * x.element_size() + outs * (n + n // 32)


def compiled_quantize(axis, scale_layout):
    """torch.compile of the eager torch backend, returning plain tensors (data, scale per output)."""

    def fn(x):
        return tuple(flat_outputs(torch_quantize.mxfp8_quantize(x, axis=axis, scale_layout=scale_layout)))

    return benchlib.compile_static(fn)


def torchao_casts():
    """torchao's MXFP8 casts as {which: fn(x) -> [data, scale, ...]} plus a compile-able reference, or
    (None, reason) when torchao does not import. API of torchao.prototype.mx_formats (0.1x):
    kernels.triton_to_mxfp8_dim0(x, inner_block_size, scaling_mode) -> (codes [M, N], scales [M, N/32]),
    kernels.triton_to_mxfp8_dim1(...) -> (codes [M, N] as a transposed view, scales [N, M/32]),
    mx_tensor.to_mx(x, elem_dtype, block_size, ScaleCalculationMode) -> (scales, codes): torch ops."""
    try:
        import torchao
        from torchao.prototype.mx_formats import kernels as ao_kernels
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except Exception as exc:  # noqa: BLE001 - torchao is optional
        return None, f"torchao peers skipped: import failed ({type(exc).__name__}: {str(exc)[:160]})"

    # torchao's triton rceil scale is one PTX instruction (cvt.rp.satfinite.ue8m0x2.f32) that exists from
    # sm100 on; below that its kernels are timed with floor scales: the same traffic, other scale bytes.
    cuda_cc = torch.cuda.get_device_capability() if DEVICE == "cuda" else (0, 0)
    mode = "rceil" if cuda_cc >= (10, 0) else "floor"
    tag = "" if mode == "rceil" else " [floor scales]"

    def dim0(x):
        d, s = ao_kernels.triton_to_mxfp8_dim0(x, inner_block_size=32, scaling_mode=mode)
        return [d, s]

    def dim1(x):
        d, s = ao_kernels.triton_to_mxfp8_dim1(x, inner_block_size=32, scaling_mode=mode)
        return [d, s]

    def reference(x):
        s, d = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
        return [d, s.reshape(d.shape[0], -1)]

    peers = {
        "row": [("torchao triton_to_mxfp8_dim0" + tag, dim0), ("torchao to_mx (torch ops)", reference)],
        "col": [("torchao triton_to_mxfp8_dim1" + tag, dim1)],
        "dual": [("torchao dim0 + dim1 (two kernels)" + tag, lambda x: dim0(x) + dim1(x))],
    }
    note = f"torchao {getattr(torchao, '__version__', '?')}: triton casts with {mode} scales"
    if mode == "floor":
        note += " (its rceil needs sm100's ue8m0 convert)"
    return (peers, reference), note


def shapes_and_dtypes():
    """(rows T, columns, dtype) in the order measured (ascending T: a time cap keeps the small ones)."""
    if ARGS.smoke:
        if ARGS.tokens:
            return [(t, 96, torch.bfloat16) for t in ARGS.tokens]
        return [(64, 96, torch.bfloat16), (96, 160, torch.float32)]
    head = [(t, HEAD_N, torch.bfloat16) for t in (ARGS.tokens or [16384])]
    if ARGS.quick or not ARGS.sweep:
        return head
    extra = [(16384, 1536, torch.bfloat16), (65536, 1536, torch.bfloat16), (16384, 7168, torch.bfloat16),
             (4096, HEAD_N, torch.bfloat16), (16384, HEAD_N + 96, torch.bfloat16),
             (8192, HEAD_N, torch.float32), (16384, HEAD_N, torch.float16)]
    return head + [s for s in extra if s not in head]


def measure():
    REC.load_peaks()
    ao, ao_note = torchao_casts()
    REC.note(ao_note)
    layouts = ("compact", "swizzled") if (ARGS.sweep or ARGS.smoke) else ("compact",)
    for m, n, dtype in shapes_and_dtypes():
        g = torch.Generator(device="cpu").manual_seed(0)
        x = (torch.randn(m, n, generator=g) * torch.exp2(torch.randint(-8, 9, (m, 1), generator=g).float()))
        x = x.to(dtype).to(DEVICE)
        dname = str(dtype).replace("torch.", "")
        shape, family = f"[{m},{n}] {dname}", f"[T,{n}] {dname}"
        common = dict(shape=shape, family=family, tokens=m)

        dst = torch.empty_like(x)
        copy_ms = bench_ms(lambda: dst.copy_(x))
        copy_bytes = 2 * x.numel() * x.element_size()
        copy_tbps = copy_bytes / copy_ms / 1e9
        REC.row(op="copy", impl="torch copy_", ms=copy_ms, tbps=copy_tbps, ratio=1.0, vs="copy", bytes=copy_bytes,
                **common)
        del dst

        def add(op, impl, ms, nbytes, **kw):
            return REC.row(op=op, impl=impl, ms=ms, tbps=nbytes / ms / 1e9, ratio=nbytes / ms / 1e9 / copy_tbps,
                           vs="copy", bytes=nbytes, **common, **kw)

        deferred = []  # torch.compile baselines: measured after everything else of this shape
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
                REC.note(f"triton {op} {shape}: first call {secs:.2f} s (compile + autotune); tile {tile}")
                trow = add(op, "triton", ms, nbytes, same=True, note=tile)

                peers = []
                if which != "col" or ARGS.sweep or ARGS.smoke:  # the targets compare row and dual
                    peers.append(("torch eager", lambda axis=axis, layout=layout: flat_outputs(
                        torch_quantize.mxfp8_quantize(x, axis=axis, scale_layout=layout))))
                if ao is not None and layout == "compact" and dtype == torch.bfloat16:
                    peers += [(name, lambda fn=fn: fn(x)) for name, fn in ao[0][which]]
                for name, fn in peers:
                    try:
                        if name.startswith("torchao"):
                            REC.note(f"{name} {op} {shape}: first call {first_call_s(fn):.2f} s (compile + autotune)")
                        out = fn()
                        frac = equal_fraction(out, ref)
                        pms = bench_ms(fn)
                    except Exception as exc:  # noqa: BLE001 - report it, keep benchmarking
                        REC.note(f"{name} {op} {shape}: failed ({type(exc).__name__}: {str(exc)[:300]})")
                        continue
                    extra = {} if frac in (None, 1.0) else {"same_frac": frac}
                    add(op, name, pms, nbytes, same=frac == 1.0 if frac is not None else None, **extra)
                    del out
                del ref

                if DEVICE == "cuda" and not ARGS.no_compile and (which != "col" or ARGS.sweep):
                    deferred.append((op, "torch.compile(eager)", compiled_quantize(axis, layout), run_triton,
                                     nbytes, trow))
                    if ao is not None and which == "row" and layout == "compact" and dtype == torch.bfloat16:
                        deferred.append((op, "torch.compile(torchao to_mx)", benchlib.compile_static(ao[1]),
                                         run_triton, nbytes, None))
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()

        if ARGS.sweep or ARGS.smoke:  # dequantize: 1 code byte + 1/32 scale byte in, 4 or 2 bytes out
            for layout in layouts:
                t = triton_quantize.mxfp8_quantize(x, axis=-1, scale_layout=layout)
                for out_dtype, size in (("float32", 4), ("bfloat16", 2)):
                    op = f"dequantize {out_dtype}" + (" swz" if layout == "swizzled" else "")
                    nbytes = x.numel() * (1 + size) + x.numel() // 32
                    first_call_s(lambda: triton_quantize.mxfp8_dequantize(t, out_dtype))
                    add(op, "triton", bench_ms(lambda: triton_quantize.mxfp8_dequantize(t, out_dtype)), nbytes)
                    add(op, "torch eager", bench_ms(lambda: torch_quantize.mxfp8_dequantize(t, out_dtype)), nbytes)
                del t

        for op, name, fn, run_triton, nbytes, trow in deferred:
            try:
                secs = first_call_s(lambda: fn(x))
                REC.note(f"{name} {op} {shape}: first call {secs:.2f} s")
                frac = equal_fraction(list(fn(x)), flat_outputs(run_triton()))
                cms = bench_ms(lambda: fn(x))
            except Exception as exc:  # noqa: BLE001 - report it, keep benchmarking
                REC.note(f"{name} {op} {shape}: failed ({type(exc).__name__}: {str(exc)[:300]})")
                continue
            extra = {} if frac in (None, 1.0) else {"same_frac": frac}
            add(op, name, cms, nbytes, same=frac == 1.0 if frac is not None else None, **extra)
            if trow is not None:
                trow["vs_compile"] = cms / trow["ms"]
                REC.note(f"triton {op} {shape}: {trow['vs_compile']:.2f}x torch.compile")
        del x, deferred
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def main():
    REC.run(measure)
    REC.finish([("op", "op", 24, ""), ("shape", "shape", 24, ""), ("impl", "impl", 34, ""), benchlib.MS,
                benchlib.TBPS, ("ratio", "vs copy", 8, ".3f"), ("vs_compile", "vs compile", 10, ".2f"),
                benchlib.OF_ROOF, ("same", "same", 5, "")],
               extra=dict(versions=f"torch {torch.__version__}, triton {triton.__version__}"))


if __name__ == "__main__":
    main()
