"""Profiling cases for the two open performance questions of the 2026-11-30 H200 runs (BENCHMARKS.md).

    python tools/profile_cases.py mla_q [--tokens 4096]      # a few fused-op launches, for ncu
    python tools/profile_cases.py host [--tokens 1024]       # where a Triton quantize call's host time goes
    python tools/profile_cases.py mla_q_parts [--tokens 4096,16384]  # the fused op's time by epilogue part
    python tools/profile_cases.py cudnn_host                 # the cudnn attention wrapper's host time by step
    python tools/profile_cases.py attn_dequant [--tokens 4096]  # MXFP8 attention's k, v pre-pass: two kernels
    python tools/profile_cases.py mla_q_by_k [--tokens 16384]   # Gluon fused op vs K (MLA_Q_BY_K=64,256,1536)
    python tools/profile_cases.py attn_fwd_configs [--tokens 4096]  # attention forward per tile config vs cuDNN
    python tools/profile_cases.py gemm_gluon [--tokens 4096]     # MXFP8 GEMM routes per Gluon config vs cuBLAS
    python tools/profile_cases.py gemm_gluon_launch              # three Gluon GEMM launches, for ncu

mla_q: the fused Q up-projection (bf16 projection, DeepSeek-V3 widths) warmed up, then 3 launches:
run under `ncu --kernel-name regex:_mla_q_fwd --launch-skip 2 --launch-count 1` (tools/gpu_profile.sh)
to see whether the epilogue or the main loop holds the tile (the kernel takes 2.2x the cuBLAS GEMM).

host: below T = 8192 the Triton quantize times stop scaling with T (0.24 ms at T = 1024 where a copy
takes 0.03 ms). This prints the host time per call (perf_counter around N enqueued calls), the GPU
time per call (CUDA events around the same N calls), and a cProfile of the calls by cumulative time,
so the Python frames that cost the time (ours, dispatch's, Triton's launcher) have names.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def mla_q(tokens: int) -> None:
    import dispatch

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, 1536, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(128 * 192, 1536, device="cuda", generator=g) / 40).to(torch.bfloat16)
    angle = torch.rand(tokens, 64, device="cuda", generator=g)
    cos, sin = torch.cos(angle), torch.sin(angle)
    for _ in range(3):  # compile + autotune, then the launches ncu looks at
        dispatch.run("mla_q_uproj_rope_quant", x, w, cos, sin, backend="triton")
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("mla_q_profile")  # ncu --nvtx-include "mla_q_profile/": not the autotuner's launches
    for _ in range(3):
        dispatch.run("mla_q_uproj_rope_quant", x, w, cos, sin, backend="triton")
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    print(f"mla_q: T={tokens} launched")


def mla_q_parts(token_list) -> None:
    """The fused forward (TMA variant) per autotune config with the epilogue cut down to its parts
    (backends.triton.mla_q.EPILOGUE_PARTS: the main loop alone, the GEMM's own bf16 store, rowwise only,
    columnwise only, full), against torch.matmul (cuBLAS) on the same shapes, do_bench medians."""
    import triton

    import dispatch
    from backends.triton import mla_q as tq

    def ms(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    for tokens in token_list:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(tokens, 1536, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(128 * 192, 1536, device="cuda", generator=g) / 40).to(torch.bfloat16)
        angle = torch.rand(tokens, 64, device="cuda", generator=g)
        cos, sin = torch.cos(angle), torch.sin(angle)
        gemm = ms(lambda: torch.matmul(x, w.t()))
        tuned = ms(lambda: dispatch.run("mla_q_uproj_rope_quant", x, w, cos, sin, backend="triton"))
        tma = ms(lambda: tq.mla_q_forward_launch(x, w, cos, sin, variant="tma"))
        print(f"T={tokens}: Triton TMA kernel, autotuned {tma:.3f} ms ({tma / gemm:.2f}x)")
        tuner = tq._fwd_tma_tuned[False]
        chosen = next(iter(tuner.cache.values()), None) if getattr(tuner, "cache", None) else None
        print(f"T={tokens}: cuBLAS bf16 GEMM {gemm:.3f} ms; autotuned fused op {tuned:.3f} ms "
              f"({tuned / gemm:.2f}x); chosen: {chosen}")
        picked = os.environ.get("PARTS_CONFIGS")  # indices into the TMA config list, e.g. "1,6,7"
        parts_wanted = os.environ.get("PARTS", ",".join(tq.EPILOGUE_PARTS)).split(",")
        configs = tq._fwd_configs(False, tma=True)
        for i, cfg in enumerate(configs):
            if picked and str(i) not in picked.split(","):
                continue
            pinned = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            if cfg.maxnreg:
                pinned["maxnreg"] = cfg.maxnreg
            parts = {}
            for part in parts_wanted:
                try:
                    parts[part] = ms(lambda: tq.mla_q_forward_launch(x, w, cos, sin, config=pinned, variant="tma",
                                                                     epilogue=part))
                except Exception as exc:  # noqa: BLE001 - a config that does not fit is a result
                    print(f"  {cfg}: {part} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            print(f"  [{i}] BM{cfg.kwargs['BLOCK_M']} BK{cfg.kwargs['BLOCK_K']} w{cfg.num_warps} s{cfg.num_stages} "
                  f"maxnreg {cfg.maxnreg}: " + "  ".join(f"{p} {t:.3f} ({t / gemm:.2f}x)" for p, t in parts.items()))


def mla_q_by_k(tokens: int = 16384) -> None:
    """The Gluon fused forward (the warp-specialized kernels, per config) against cuBLAS, as K shrinks from DeepSeek's 1536 to 64: at K = 64 the main loop is one step, so the time is the
    epilogue's (plus launch and tails), which says whether the epilogue or the main loop sets the
    pace of the ping-pong kernel."""
    import triton

    from backends.triton import mla_q_gluon as qg

    def ms(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    heads = 128
    g = torch.Generator(device="cuda").manual_seed(0)
    angle = torch.rand(tokens, 64, device="cuda", generator=g)
    cos, sin = torch.cos(angle), torch.sin(angle)
    outs = (torch.empty(tokens, heads, 192, dtype=torch.uint8, device="cuda"),
            torch.empty(tokens, heads, 6, dtype=torch.uint8, device="cuda"),
            torch.empty(tokens, heads, 192, dtype=torch.uint8, device="cuda"),
            torch.empty(tokens // 32, heads, 192, dtype=torch.uint8, device="cuda"))
    for k in [int(v) for v in os.environ.get("MLA_Q_BY_K", "64,256,1536").split(",")]:
        x = torch.randn(tokens, k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(heads * 192, k, device="cuda", generator=g) / 40).to(torch.bfloat16)
        gemm = ms(lambda: torch.matmul(x, w.t()))
        row = {}
        for variant, table in (("gluon_ws", qg.WS_CONFIGS), ("gluon_ws128", qg.WS128_CONFIGS)):
            for cfg in table:
                tag = f"BK{cfg['BLOCK_K']} S{cfg['STAGES']} G{cfg['GROUP_M']}"
                row[f"{variant} {tag}"] = ms(lambda: qg.launch(x, w, cos, sin, *outs, config=cfg, variant=variant))
        print(f"T={tokens} K={k}: cuBLAS {gemm:.4f} ms; " + "; ".join(f"{n} {t:.4f} ({t / gemm:.2f}x)" for n, t in row.items()))


def _attention_inputs(seq: int):
    """B=1, H=128 bf16 q, k, v (seeded) and their MXFP8 forms (q, k blocked along D, v along S)."""
    from backends.torch.quantize import mxfp8_quantize

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, seq, 128, 192, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(1, seq, 128, 192, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(1, seq, 128, 128, device="cuda", generator=g).to(torch.bfloat16)
    quant = dict(elem="e4m3", scale_mode="rceil", nonfinite="saturate", scale_layout="compact")
    return (q, k, v, mxfp8_quantize(q, axis=3, **quant), mxfp8_quantize(k, axis=3, **quant),
            mxfp8_quantize(v, axis=1, **quant))


def attn_dequant(seq: int = 4096) -> None:
    """MXFP8 attention forward's k, v pre-pass at B=1, H=128: the attention file's flat dequantize
    kernel against the quantize file's tiled (autotuned) one, each alone and inside the whole
    forward, with a device-to-device copy of the same bytes as the bandwidth yardstick."""
    import triton

    from backends.triton import attention as ta
    from backends.triton.quantize import mxfp8_dequantize

    def ms(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100)

    q, k, v, q_mx, k_mx, v_mx = _attention_inputs(seq)
    tiled = lambda t: mxfp8_dequantize(t, "bfloat16")  # noqa: E731
    flat = lambda t: ta._dequantize_mx(t)[0]  # noqa: E731
    for name, t in (("k", k_mx), ("v", v_mx)):
        same = torch.equal(flat(t).view(torch.int16), tiled(t).view(torch.int16))
        nbytes = t.data.numel() * 3 // 2  # a copy reads and writes 1.5 bytes an element: 3 in all, as dequantize
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        t_copy, t_flat, t_tiled = ms(lambda: dst.copy_(src)), ms(lambda: flat(t)), ms(lambda: tiled(t))
        print(f"{name} {tuple(t.data.shape)}: copy of the same bytes {t_copy:.4f} ms, flat {t_flat:.4f} ms, "
              f"tiled {t_tiled:.4f} ms; bytes equal {same}")
    t_bf16 = ms(lambda: ta._forward(q, k, v, True, None, "bshd", None, None))
    times = {}
    for mode in ta.FWD_MX_DEQUANT_MODES:
        fwd = lambda: ta._forward(q_mx, k_mx, v_mx, True, None, "bshd", None, None, mx_dequant=mode)  # noqa: E731
        fwd()
        times[mode] = ms(fwd)
    # the bf16 kernel on the dequantized values alone (fp8-valued bf16: the data-dependent part)
    qd, kd, vd = (flat(t) for t in (q_mx, k_mx, v_mx))
    t_dq = ms(lambda: ta._forward(qd, kd, vd, True, None, "bshd", None, None))
    print(f"fwd S={seq}: bf16 {t_bf16:.4f} ms; bf16 kernel on the dequantized values {t_dq:.4f} ms; mxfp8 "
          + ", ".join(f"{m} {t:.4f} ms" for m, t in times.items()))


def attn_fwd_configs(seq: int = 4096) -> None:
    """The Triton attention forward (B=1, H=128, causal, bf16 and MXFP8 inputs) with each tile
    configuration forced in turn, with and without the whole-key-block load path (FWD_EVEN_KV),
    against torch's cuDNN forward with lse timed in the same rounds. Registers / shared memory per
    configuration decide how many programs share an SM (two 64-row programs overlap one's softmax
    with the other's tensor-core work), which is what the sweep is for."""
    import triton

    from backends.triton import attention as ta

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import benchlib

    q, k, v, q_mx, k_mx, v_mx = _attention_inputs(seq)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    cudnn = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(  # noqa: E731
        qt, kt, vt, None, True, 0.0, True, False, scale=None)
    ref_o, _ = ta._forward(q, k, v, True, None, "bshd", None, None)
    kernel = ta._mla_fwd_kernel
    shipped = list(kernel.configs)
    candidates = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 8, 3),
                  (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (64, 32, 4, 4)]
    rows = []
    try:
        for even in (True, False):
            ta.FWD_EVEN_KV = even
            for bm, bn, w, st in candidates:
                kernel.configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)]
                kernel.cache.clear()
                fwd = lambda: ta._forward(q, k, v, True, None, "bshd", None, None)  # noqa: E731
                fwd_mx = lambda: ta._forward(q_mx, k_mx, v_mx, True, None, "bshd", None, None)  # noqa: E731
                o, _ = fwd()
                fwd_mx()
                same = torch.equal(o.view(torch.int16), ref_o.view(torch.int16))
                t = benchlib.interleaved_ms({"cudnn": cudnn, "bf16": fwd, "mxfp8": fwd_mx})
                rows.append((even, bm, bn, w, st, t, same))
                print(f"even_kv={int(even)} {bm}x{bn} w{w} s{st}: cudnn {t['cudnn']:.4f} bf16 {t['bf16']:.4f} "
                      f"({t['cudnn'] / t['bf16']:.3f}x) mxfp8 {t['mxfp8']:.4f} ({t['cudnn'] / t['mxfp8']:.3f}x) "
                      f"o bytes equal to shipped default: {same}", flush=True)
    finally:
        kernel.configs = shipped
        kernel.cache.clear()
        ta.FWD_EVEN_KV = True
    best = max(rows, key=lambda r: r[5]["cudnn"] / r[5]["bf16"])
    print(f"best bf16: even_kv={int(best[0])} {best[1]}x{best[2]} w{best[3]} s{best[4]} "
          f"{best[5]['cudnn'] / best[5]['bf16']:.3f}x cuDNN")


def cudnn_host(calls: int = 200) -> None:
    """Host microseconds per step of a cudnn forward cache hit (B1 S128 H8 causal): each step alone in
    a loop of `calls`, best of 5, so the wrapper's share can be cut where it is spent."""
    from backends.cudnn import _common
    from backends.cudnn import attention as att

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 128, 8, 192, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(1, 128, 8, 192, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(1, 128, 8, 128, device="cuda", generator=g).to(torch.bfloat16)
    o, lse = att.mla_attention(q, k, v, causal=True)
    key = next(key for key in att._graphs if key[0] == "fwd")
    entry = att._graphs[key]
    dev = q.device
    steps = {
        "whole call": lambda: att.mla_attention(q, k, v, causal=True),
        "graph.execute (ordered)": lambda: entry.graph.execute((q, k, v, o, lse), ws, handle=handle, tensor_uids=entry.uids),
        "torch.empty o": lambda: torch.empty((1, 128, 8, 128), dtype=torch.bfloat16, device=dev),
        "torch.empty lse": lambda: torch.empty((1, 8, 128), dtype=torch.float32, device=dev),
        "torch.empty o (device index int)": lambda: torch.empty((1, 128, 8, 128), dtype=torch.bfloat16, device=0),
        "_seq_lengths x2": lambda: (att._seq_lengths(q, "bshd"), att._seq_lengths(k, "bshd")),
        "_aligned_all": lambda: att._aligned_all(q, k, v),
        "key tuple": lambda: ("fwd", "bshd", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), True,
                              0.07, False, q.get_device()),
        "_cached hit": lambda: att._cached(key, None),
        "5 x _bind": lambda: (att._bind(q, "bshd"), att._bind(k, "bshd"), att._bind(v, "bshd"), att._bind(o, "bshd"),
                              att._bind_stats(lse)),
        "_common.launch": lambda: _common.launch(dev, entry.workspace),
        "current_stream_handle": lambda: _common.current_stream_handle(dev),
        "q.data_ptr() % 16": lambda: q.data_ptr() % 16,
    }
    handle, ws = _common.launch(dev, entry.workspace)
    for name, fn in steps.items():
        fn()
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        print(f"{name:36s} {best:7.2f} us")


def host(tokens: int, calls: int = 200) -> None:
    import dispatch
    from backends.triton import quantize as tq

    x = torch.randn(tokens, 24576, device="cuda").to(torch.bfloat16)
    cases = {
        "triton quantize dual, direct": lambda: tq.mxfp8_quantize(x, axis=(-1, 0)),
        "triton quantize dual, dispatch.run": lambda: dispatch.run("mxfp8_quantize", x, axis=(-1, 0), backend="triton"),
        "triton quantize row, direct": lambda: tq.mxfp8_quantize(x, axis=-1),
        "torch copy_": lambda: torch.empty_like(x).copy_(x),
    }
    for name, fn in cases.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(calls):
            fn()
        t_host = (time.perf_counter() - t0) / calls * 1e6
        stop.record()
        stop.synchronize()
        t_gpu = start.elapsed_time(stop) / calls * 1e3
        print(f"{name:40s} host {t_host:8.1f} us/call   GPU span {t_gpu:8.1f} us/call")
    prof = cProfile.Profile()
    fn = cases["triton quantize dual, direct"]
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
    print(out.getvalue())


def _gemm_inputs(tokens: int, generator):
    """bf16 x [tokens, 1536] and w [24576, 1536] (seeded) and their e4m3 MXTensors, blocked along K."""
    from backends.torch import quantize as tq

    quant = dict(elem="e4m3", scale_mode="rceil", nonfinite="saturate", scale_layout="compact")
    x = torch.randn(tokens, 1536, generator=generator).to(torch.bfloat16).cuda()
    w = (torch.randn(24576, 1536, generator=generator) * 0.02).to(torch.bfloat16).cuda()
    return x, w, tq.mxfp8_quantize(x, axis=1, **quant), tq.mxfp8_quantize(w, axis=1, **quant)


def _in_turns(fns, ms, label, width, base_over_this=False):
    """Time fns (name -> callable, "cuBLAS bf16" among them) in turns, 3 rounds; print each one's middle
    round against cuBLAS's (cuBLAS / this, or this / cuBLAS)."""
    times = {name: [] for name in fns}
    for _ in range(3):
        for name, fn in fns.items():
            times[name].append(ms(fn))
    base = sorted(times["cuBLAS bf16"])[1]
    for name, ts in times.items():
        t = sorted(ts)[1]
        ratio = f"cuBLAS/this {base / t:.3f}" if base_over_this else f"this/cuBLAS {t / base:.3f}"
        print(f"{label} {name:{width}s} {t:.4f} ms  {ratio}  rounds {', '.join(f'{v:.4f}' for v in ts)}")


def gemm_gluon(tokens: int = 4096) -> None:
    """The MXFP8 GEMM [tokens x 1536] x [24576 x 1536]: the Gluon route (per config) and its kernel
    alone, the bf16 route, and the bf16 cuBLAS GEMM, timed in turns (3 rounds, medians of do_bench);
    first the Gluon route's output against the bf16 route's (both fp32 sums of the same exact
    products) and the guard flag on this data."""
    import triton

    from backends.torch import quantize as tq
    from backends.triton import gemm as tg
    from backends.triton import gemm_gluon as gg
    from backends.triton.quantize import dequantize_bf16_flat

    def ms(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    g = torch.Generator(device="cpu").manual_seed(0)
    x, w, a, b = _gemm_inputs(tokens, g)
    n = w.shape[0]
    ref = tg.mxfp8_gemm_tensors(a, b, torch.empty(tokens, n, dtype=torch.bfloat16, device="cuda"), variant="bf16")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    lo, hi = tg.BF16_SAFE_SCALE_BYTES["e4m3"]
    a16 = dequantize_bf16_flat(a, guard=(flag, lo, hi))
    out = torch.empty(tokens, n, dtype=torch.bfloat16, device="cuda")
    for cfg in gg.CONFIGS:
        out.view(torch.int16).fill_(-1)  # poison: an unwritten element stays NaN
        flag.zero_()
        tg.gluon_gemm_kernel(a16, b, out, flag, cfg)
        torch.cuda.synchronize()
        d = (out.float() - ref.float()).abs()
        print(f"check {cfg}: flag {int(flag.item())}, NaN {int(torch.isnan(out).sum())}, "
              f"max|gluon - bf16 route| {float(d.max()):.3e} (max|ref| {float(ref.float().abs().max()):.3e}), "
              f"bytes differing {int((out.view(torch.int16) != ref.view(torch.int16)).sum())} of {out.numel()}")
    bs = tq.mxfp8_quantize(w, axis=1, elem="e4m3", scale_mode="rceil", nonfinite="saturate", scale_layout="swizzled")
    got = tg.mxfp8_gemm_tensors(a, bs, torch.empty_like(out), variant="gluon")
    print(f"check route, b scales swizzled: max|gluon - bf16 route| {float((got.float() - ref.float()).abs().max()):.3e}")
    xb, wb, _, _ = _gemm_inputs(tokens, g)
    fns = {"cuBLAS bf16": lambda: torch.matmul(xb, wb.t()),
           "bf16 route": lambda: tg.mxfp8_gemm_tensors(a, b, out, variant="bf16"),
           "gluon route": lambda: tg.mxfp8_gemm_tensors(a, b, out, variant="gluon"),
           "a16 pass": lambda: dequantize_bf16_flat(a, guard=(flag, lo, hi))}
    for cfg in gg.CONFIGS:
        tag = " ".join(f"{k}={v}" for k, v in cfg.items())
        fns[f"gluon kernel {tag}"] = lambda c=cfg: tg.gluon_gemm_kernel(a16, b, out, flag, c)
    _in_turns(fns, ms, f"T={tokens}", width=46, base_over_this=True)


def gemm_gluon_launch(tokens: int = 4096) -> None:
    """Three launches of the Gluon MXFP8 GEMM kernel alone ([tokens x 1536] x [24576 x 1536]), for ncu
    (`--kernel-name regex:_mxfp8_gemm_gluon --launch-skip 2 --launch-count 1`)."""
    from backends.triton import gemm as tg
    from backends.triton.quantize import dequantize_bf16_flat

    _, _, a, b = _gemm_inputs(tokens, torch.Generator(device="cpu").manual_seed(0))
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    a16 = dequantize_bf16_flat(a, guard=(flag, *tg.BF16_SAFE_SCALE_BYTES["e4m3"]))
    out = torch.empty(tokens, b.data.shape[0], dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        tg.gluon_gemm_kernel(a16, b, out, flag)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", choices=["mla_q", "host", "mla_q_parts", "cudnn_host", "attn_dequant", "mla_q_by_k",
                                       "attn_fwd_configs", "gemm_gluon", "gemm_gluon_launch"])
    ap.add_argument("--tokens", type=str, help="token count (mla_q_parts: a comma list)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_cases: needs a CUDA device")
    if args.case == "mla_q":
        mla_q(int(args.tokens or 4096))
    elif args.case == "cudnn_host":
        cudnn_host()
    elif args.case == "mla_q_by_k":
        mla_q_by_k(int(args.tokens or 16384))
    elif args.case == "gemm_gluon_launch":
        gemm_gluon_launch(int(args.tokens or 4096))
    elif args.case == "gemm_gluon":
        gemm_gluon(int(args.tokens or 4096))
    elif args.case == "attn_fwd_configs":
        attn_fwd_configs(int(args.tokens or 4096))
    elif args.case == "attn_dequant":
        attn_dequant(int(args.tokens or 4096))
    elif args.case == "mla_q_parts":
        mla_q_parts([int(t) for t in (args.tokens or "4096,16384").split(",")])
    else:
        host(int(args.tokens or 1024))


if __name__ == "__main__":
    main()
