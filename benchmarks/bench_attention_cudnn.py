"""The cuDNN backend's MLA attention (graph SDPA) against torch's own cuDNN SDPA, plus host overhead.

    python benchmarks/bench_attention_cudnn.py [--quick] [--tokens 1024,...] [--json PATH]   # on the GPU
    python benchmarks/bench_attention_cudnn.py --smoke     # CPU: says why nothing is timed; GPU: S=256

Device rows (op fwd / bwd): backends.cudnn.attention on bf16 bshd inputs vs
torch.nn.functional.scaled_dot_product_attention under sdpa_kernel(SDPBackend.CUDNN_ATTENTION) on
[B, H, S, D] views of the same tensors (backward: torch.autograd.grad of that output, graph kept).
Target: within 5 % of torch's time (ratio = torch ms / ours ms >= 0.95). If torch refuses
d_qk 192 with d_v 128, it is retried with v zero-padded to 192 ("v->192": more work than ours, noted).
Shapes: B=1 S=4096 H=128 causal (--quick: only this), plus non-causal, S=8192 causal and thd 2x2048;
--tokens sets S (B=1, H=128, causal, bshd, one case per S). --no-compile is accepted (nothing compiles).
Times: medians of triton.testing.do_bench(warmup=25, rep=100) (CUDA events when triton is absent).
FLOPs: forward 2*B*H*S_q*S_kv*(192+128), backward 2*B*H*S_q*S_kv*(3*192+2*128), causal half.
err: relative Frobenius error of our o / gradients against torch's (a fast wrong result shows).

Host rows (op host): a graph-cache hit's host time per call, GPU work excluded: after a warm-up and
a sync, N calls are enqueued and timed with perf_counter around the enqueue loop only (N small
enough that CUDA's launch queue never fills). Measured for the whole call, for this backend's share
alone (graph.execute replaced by a no-op), and through dispatch.run, for both operand binding modes
(attention.BIND "view" and "ptr"); budget 20 us (ratio = 20 / us). Also noted: first-call (graph
build) time, and the plan cuDNN picked.

MXFP8 rows (B=1 S=4096 H=128 causal): the backend on MXFP8 q, k, v -- natively on compute capability
10.x with cuDNN >= 9.21, on sm90 by an exact bf16 dequantization into its bf16 graph -- against torch's
cuDNN SDPA on bf16 tensors of the same shapes, interleaved; where the backend refuses, its reasons.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import benchlib  # noqa: E402

D_QK, D_V = 192, 128
HOST_BUDGET_US = 20.0
DEVICE_TARGET = 0.95


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only B=1 S=4096 H=128 causal (+ host overhead)")
    ap.add_argument("--smoke", action="store_true", help="CPU: report why nothing runs; CUDA: one small shape")
    benchlib.add_common_args(ap, tokens_axis="S (B=1, H=128, causal, bshd)")
    return ap.parse_args()


def bench_ms(fn) -> float:
    try:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    except ImportError:
        for _ in range(5):
            fn()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        return sorted(times)[len(times) // 2]


def first_call_s(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def flops(b, s_q, s_kv, h, causal, op):
    pairs = b * h * s_q * s_kv * (0.5 if causal else 1.0)
    return pairs * (2 * (D_QK + D_V) if op == "fwd" else 2 * (3 * D_QK + 2 * D_V))


def traffic(b, s, h, op, mx=False):
    """Bytes moved once: fwd q, k, v in, o out; bwd q, k, v, o, do in, dq, dk, dv out; lse (fp32).
    MXFP8 forward inputs: 1-byte codes + 1/32 scale bytes."""
    tokens = b * s * h
    if op == "fwd":
        return int(tokens * ((2 * D_QK + D_V) * (1 + 1 / 32 if mx else 2) + 2 * D_V + 4))
    return int(tokens * 2 * (4 * D_QK + 4 * D_V) + tokens * 4)


def make_inputs(b, s, h, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((b, s, h, D_QK), (b, s, h, D_QK), (b, s, h, D_V), (b, s, h, D_V))
    return [torch.randn(*sh, device="cuda", generator=g).to(torch.bfloat16) for sh in shapes]


# --------------------------------------------------------------------------------------------------
# torch's cuDNN SDPA
# --------------------------------------------------------------------------------------------------

def torch_cudnn_sdpa(q, k, v, causal, scale, pad_v):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if pad_v:
        vt = F.pad(vt, (0, D_QK - D_V))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
    return o[..., :D_V] if pad_v else o


def torch_cudnn_train_fwd(q, k, v, causal, scale, pad_v):
    """torch's cuDNN forward as training runs it: o *and* the logsumexp, the work our backend does on
    every call (spec's forward returns lse). F.scaled_dot_product_attention on inputs that need no
    grad skips the statistics, a cheaper kernel, so it is timed separately as the inference row."""
    import torch.nn.functional as F

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if pad_v:
        vt = F.pad(vt, (0, D_QK - D_V))
    o = torch.ops.aten._scaled_dot_product_cudnn_attention(qt, kt, vt, None, True, 0.0, causal, False, scale=scale)[0]
    return o[..., :D_V] if pad_v else o


def torch_baseline(q, k, v, do, causal, scale, note, shape):
    """{'label', 'fwd_fn', 'fwd_infer_fn', 'o', 'bwd': (ms, grads)} or {} when torch refuses."""
    for pad_v in (False, True):
        label = "torch sdpa cudnn" + (" v->192" if pad_v else "")
        try:
            o = torch_cudnn_train_fwd(q, k, v, causal, scale, pad_v)
        except Exception as exc:  # noqa: BLE001 - a refusal is a result
            note(f"{label} {shape}: not accepted ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
            continue
        out = {"label": label, "o": o.transpose(1, 2),
               "fwd_fn": lambda: torch_cudnn_train_fwd(q, k, v, causal, scale, pad_v),
               "fwd_infer_fn": lambda: torch_cudnn_sdpa(q, k, v, causal, scale, pad_v)}
        try:
            qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
            og = torch_cudnn_sdpa(qg, kg, vg, causal, scale, pad_v)
            dot = do.transpose(1, 2)
            grads = torch.autograd.grad(og, (qg, kg, vg), dot, retain_graph=True)
            out["bwd_fn"] = lambda: torch.autograd.grad(og, (qg, kg, vg), dot, retain_graph=True)
            out["grads"] = grads
        except Exception as exc:  # noqa: BLE001
            note(f"{label} bwd {shape}: failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
        return out
    return {}


# --------------------------------------------------------------------------------------------------
# Host overhead of a cache hit
# --------------------------------------------------------------------------------------------------

def host_us(fn, calls=100, repeats=7) -> float:
    """Best per-call enqueue time over `repeats` loops of `calls` calls (GPU work not waited for)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def host_rows(att, rec, b, s, h, causal, calls):
    import dispatch

    q, k, v, do = make_inputs(b, s, h, seed=1)
    shape = f"B{b} S{s} H{h}{' causal' if causal else ''}"
    o, lse = att.mla_attention(q, k, v, causal=causal)
    cases = {
        "fwd": (lambda: att.mla_attention(q, k, v, causal=causal),
                lambda: dispatch.run("mla_attention", q, k, v, causal=causal, backend="cudnn")),
        "bwd": (lambda: att.mla_attention_backward(do, q, k, v, o, lse, causal=causal),
                lambda: dispatch.run("mla_attention_backward", do, q, k, v, o, lse, causal=causal, backend="cudnn")),
    }
    # The same library in torch's hands: its cuDNN SDPA (C++ frontend, graph cache in C++) per call.
    scale = 1.0 / math.sqrt(D_QK)
    for direction, impl, fn in (
            ("fwd", "torch aten cudnn attention with lse (reference)",
             lambda: torch_cudnn_train_fwd(q, k, v, causal, scale, False)),
            ("fwd", "torch F.sdpa cudnn, no lse (reference)", lambda: torch_cudnn_sdpa(q, k, v, causal, scale, False))):
        try:
            us = host_us(fn, calls)
        except Exception as exc:  # noqa: BLE001
            rec.note(f"host torch {direction} {shape}: failed ({type(exc).__name__})")
            continue
        rec.row(op="host", shape=f"{direction} {shape}", impl=impl, ms=us / 1e3,
                tflops=None, ratio=HOST_BUDGET_US / us, vs=f"budget {HOST_BUDGET_US:.0f} us",
                note=f"{us:.1f} us per call, {calls} calls enqueued")
    # The frontend's own floor: graph.execute alone on prepared buffers, in its two calling forms.
    try:
        from backends.cudnn import _common

        key = next(key for key in att._graphs if key[0] == "fwd" and key[2] == q.shape)
        entry = att._graphs[key]
        o_buf = torch.empty(o.shape, dtype=o.dtype, device=o.device)
        lse_buf = torch.empty(lse.shape, dtype=lse.dtype, device=lse.device)
        buffers = (q, k, v, o_buf, lse_buf)
        handle, ws = _common.launch(q.device, entry.workspace)
        as_dict = dict(zip(entry.uids, buffers))
        forms = (("ordered (buffers, tensor_uids)",
                  lambda: entry.graph.execute(buffers, ws, handle=handle, tensor_uids=entry.uids)),
                 ("dict {uid: tensor}", lambda: entry.graph.execute(as_dict, ws, handle=handle)),
                 ("dict {uid: data_ptr}",
                  lambda: entry.graph.execute({u: t.data_ptr() for u, t in as_dict.items()}, ws, handle=handle)))
        for form, fn in forms:
            try:
                us = host_us(fn, calls)
            except Exception as exc:  # noqa: BLE001
                rec.note(f"host execute {form} {shape}: failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
                continue
            rec.row(op="host", shape=f"fwd {shape}", impl=f"frontend graph.execute only, {form}", ms=us / 1e3,
                    tflops=None, ratio=HOST_BUDGET_US / us, vs=f"budget {HOST_BUDGET_US:.0f} us",
                    note=f"{us:.1f} us per call, {calls} calls enqueued")
    except StopIteration:
        rec.note(f"host execute {shape}: no forward graph cached")
    saved_bind = att.BIND
    try:
        for mode in ("view", "ptr"):
            att.BIND = mode
            for direction, (direct, routed) in cases.items():
                try:
                    direct(), routed()  # builds (first time) and selects; everything after is a cache hit
                    built = att.build_count
                    whole = host_us(direct, calls)
                    via_dispatch = host_us(routed, calls)
                except Exception as exc:  # noqa: BLE001 - a binding mode the frontend refuses is a result
                    rec.note(f"host {direction} {shape} bind={mode}: failed ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:200]})")
                    continue
                assert att.build_count == built, "cache hit rebuilt a graph"
                entries = list(att._graphs.values())
                real = [e.graph.execute for e in entries]
                for e in entries:  # this backend's share alone: the library call made a no-op
                    e.graph.execute = lambda *a, **kw: None
                try:
                    ours = host_us(direct, calls)
                finally:
                    for e, fn in zip(entries, real):
                        e.graph.execute = fn
                for impl, us in ((f"cudnn call, bind={mode}", whole), (f"cudnn via dispatch.run, bind={mode}", via_dispatch),
                                 (f"cudnn wrapper only (execute no-op), bind={mode}", ours)):
                    rec.row(op="host", shape=f"{direction} {shape}", impl=impl, ms=us / 1e3, tflops=None,
                            ratio=HOST_BUDGET_US / us, vs=f"budget {HOST_BUDGET_US:.0f} us",
                            note=f"{us:.1f} us per call, {calls} calls enqueued")
    finally:
        att.BIND = saved_bind


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------

def plan_name(att, key_prefix):
    for key, entry in att._graphs.items():
        if key[0] == key_prefix:
            try:
                g = entry.graph
                return str(g.get_plan_name_at_index(getattr(g, "_plan_index", 0)))
            except Exception as exc:  # noqa: BLE001
                return f"(plan name unavailable: {type(exc).__name__})"
    return "(no graph)"


def main():
    args = parse_args()
    rec = benchlib.Recorder("attention_cudnn", args)
    columns = [("op", "op", 4, ""), ("shape", "shape", 34, ""), ("impl", "impl", 44, ""), benchlib.MS,
               benchlib.TFLOPS, ("ratio", "ratio", 7, ".3f"), ("vs", "vs", 22, ""), benchlib.OF_ROOF,
               ("note", "note", 10, "")]
    if not torch.cuda.is_available():
        rec.note("bench_attention_cudnn: no CUDA device here; nothing to time (the backend runs on CUDA only)")
        rec.row(op="skip", shape="", impl="cudnn", ms=None, note="no CUDA device")
        rec.finish(columns)
        return

    import backends

    backends.load()
    info = backends.backend_infos().get("cudnn")
    if info is None or not info.available:
        why = "; ".join(info.reasons) if info else "not registered"
        rec.note(f"bench_attention_cudnn: cudnn backend unavailable: {why}")
        rec.row(op="skip", shape="", impl="cudnn", ms=None, note=why)
        rec.finish(columns)
        return
    rec.run(measure, args, rec, info)
    rec.finish(columns)


def measure(args, rec, info):
    from backends.cudnn import _common
    from backends.cudnn import attention as att

    rec.load_peaks()
    cc = torch.cuda.get_device_capability()
    rec.note(f"device {torch.cuda.get_device_name()} (cc {cc[0]}.{cc[1]}), frontend {info.version}, "
             f"cuDNN {_common.version_text(_common.backend_version())}, torch {torch.__version__}")

    if args.tokens:
        cases = [("bshd", 1, s, 8 if args.smoke else 128, True) for s in args.tokens]
    elif args.smoke:
        cases = [("bshd", 1, 256, 8, True)]
    else:
        cases = [("bshd", 1, 4096, 128, True)]
        if not args.quick:
            cases += [("bshd", 1, 4096, 128, False), ("bshd", 1, 8192, 128, True), ("thd", 2, 2048, 128, True)]
    scale = 1.0 / math.sqrt(D_QK)
    for layout, b, s, h, causal in cases:
        shape = f"{layout} B{b} S{s} H{h}{' causal' if causal else ''}"
        family = f"{layout} B{b} H{h}{' causal' if causal else ''}"
        q, k, v, do = make_inputs(b, s, h)
        base = torch_baseline(q, k, v, do, causal, scale, rec.note, shape)
        kw = {}
        if layout == "thd":
            q, k, v, do = (x.reshape(b * s, h, x.shape[-1]) for x in (q, k, v, do))
            cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device="cuda")
            kw = dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
        reasons = att.attention_reasons(q, k, v, causal=causal, **kw)
        if reasons:
            rec.note(f"cudnn {shape}: not accepted: {'; '.join(reasons)}")
            continue
        fwd = lambda: att.mla_attention(q, k, v, causal=causal, **kw)  # noqa: E731
        rec.note(f"cudnn fwd {shape}: first call {first_call_s(fwd):.2f} s (graph build + plan), "
                 f"plan {plan_name(att, 'fwd_thd' if layout == 'thd' else 'fwd')}")
        o, lse = fwd()
        bwd = lambda: att.mla_attention_backward(do, q, k, v, o, lse, causal=causal, **kw)  # noqa: E731
        rec.note(f"cudnn bwd {shape}: first call {first_call_s(bwd):.2f} s, "
                 f"plan {plan_name(att, 'bwd_thd' if layout == 'thd' else 'bwd')}")
        grads = bwd()
        fns = {"fwd": fwd, "bwd": bwd}
        if base:
            fns.update(torch_fwd=base["fwd_fn"], torch_fwd_infer=base["fwd_infer_fn"])
            if "bwd_fn" in base:
                fns["torch_bwd"] = base["bwd_fn"]
        ms = benchlib.interleaved_ms(fns, rounds=3 if args.quick else 5, bench=bench_ms)
        fl_fwd = flops(b, s, s, h, causal, "fwd")
        for op, out, ref_out, torch_key in (("fwd", (o,), (base.get("o"),), "torch_fwd"),
                                            ("bwd", grads, base.get("grads"), "torch_bwd")):
            ref_ms = ms.get(torch_key)
            err = None
            if ref_out is not None and ref_out[0] is not None:
                err = max(rel_err(a.reshape(r.shape), r) for a, r in zip(out, ref_out))
            fl = flops(b, s, s, h, causal, op)
            common = dict(shape=shape, family=family, tokens=s, flops=fl, bytes=traffic(b, s, h, op))
            vs = f"{base['label']} (training fwd, with lse)" if op == "fwd" and base else base.get("label")
            rec.row(op=op, impl="cudnn (ours)", ms=ms[op], tflops=fl / ms[op] / 1e9,
                    ratio=(ref_ms / ms[op]) if ref_ms else None, vs=vs if ref_ms else None, err=err,
                    note=f"target ratio >= {DEVICE_TARGET}; interleaved medians", **common)
            if ref_ms:
                rec.row(op=op, impl=base["label"] + (" (with lse)" if op == "fwd" else ""), ms=ref_ms,
                        tflops=fl / ref_ms / 1e9, ratio=1.0, vs=vs, note="baseline", **common)
        if "torch_fwd_infer" in ms:
            t = ms["torch_fwd_infer"]
            rec.row(op="fwd", impl=base["label"] + " (inference: no lse)", ms=t, tflops=fl_fwd / t / 1e9,
                    ratio=t / ms["fwd"], vs="cudnn (ours), which always writes lse", shape=shape, family=family,
                    tokens=s, flops=fl_fwd, bytes=traffic(b, s, h, "fwd"),
                    note="cheaper kernel: no statistics; not the comparison the target is about")
        del q, k, v, do, o, lse, grads, base
        torch.cuda.empty_cache()

    # MXFP8: only where the backend takes it
    from backends.torch.quantize import mxfp8_quantize

    b, s, h = (1, 256, 8) if args.smoke else (1, 4096, 128)
    q, k, v, do = make_inputs(b, s, h, seed=3)
    q_mx, k_mx = (mxfp8_quantize(x, axis=-1) for x in (q, k))
    v_mx = mxfp8_quantize(v, axis=1)
    reasons = att.attention_reasons(q_mx, k_mx, v_mx, causal=True)
    if reasons:
        rec.note(f"cudnn MXFP8 B{b} S{s} H{h} causal: not accepted here: {'; '.join(reasons)}")
    else:
        shape = f"bshd B{b} S{s} H{h} causal mxfp8"
        common = dict(shape=shape, family=f"bshd B{b} H{h} causal mxfp8", tokens=s)
        fwd = lambda: att.mla_attention(q_mx, k_mx, v_mx, causal=True)  # noqa: E731
        rec.note(f"cudnn fwd {shape}: first call {first_call_s(fwd):.2f} s")
        o, lse = fwd()
        bwd = lambda: att.mla_attention_backward(do, q_mx, k_mx, v_mx, o, lse, causal=True)  # noqa: E731
        rec.note(f"cudnn bwd {shape}: first call {first_call_s(bwd):.2f} s")
        # the baseline: torch's cuDNN SDPA on bf16 tensors of the same shapes (what a bf16 model runs)
        base = torch_baseline(q, k, v, do, True, 1.0 / math.sqrt(D_QK), rec.note, shape)
        fns = {"fwd": fwd, "bwd": bwd}
        if base:
            fns["torch_fwd"] = base["fwd_fn"]
            if "bwd_fn" in base:
                fns["torch_bwd"] = base["bwd_fn"]
        ms = benchlib.interleaved_ms(fns, rounds=3 if args.quick else 5, bench=bench_ms)
        for op, note in (("fwd", "MXFP8 q, k, v in (sm90: exact bf16 dequantization, then the bf16 graph)"),
                         ("bwd", "bf16 gradients; sm90: dequantized operands, the bf16 graph")):
            fl = flops(b, s, s, h, True, op)
            ref = ms.get(f"torch_{op}")
            rec.row(op=op, impl="cudnn mxfp8 (ours)", ms=ms[op], tflops=fl / ms[op] / 1e9, flops=fl,
                    bytes=traffic(b, s, h, op, mx=op == "fwd"), ratio=(ref / ms[op]) if ref else None,
                    vs=(base["label"] + " on bf16") if ref else None, note=note, **common)
            if ref:
                rec.row(op=op, impl=base["label"] + " bf16", ms=ref, tflops=fl / ref / 1e9, ratio=1.0,
                        vs=base["label"], note="baseline", **common)
    del q, k, v, do, q_mx, k_mx, v_mx
    torch.cuda.empty_cache()

    # Host overhead of a cache hit: the DeepSeek shape (few calls) and a tiny one (many calls).
    if not args.smoke:
        host_rows(att, rec, 1, 4096, 128, True, calls=20)
    host_rows(att, rec, 1, 128, 8, True, calls=100)


if __name__ == "__main__":
    main()
