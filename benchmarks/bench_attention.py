"""MLA attention (DeepSeek-V3 heads: q/k 192, v 128), forward and backward, bf16 and MXFP8 inputs:
triton vs torch SDPA's cuDNN / flash / memory-efficient backends on the same inputs.

    python benchmarks/bench_attention.py [--quick] [--tokens 1024,...] [--json PATH]    # on the GPU
    python benchmarks/bench_attention.py --smoke                    # tiny shapes, CPU interpreter OK

Shapes: B=1, S=4096, H=128 causal (the target shape; --quick runs only this one), plus S=4096
non-causal and S=8192 causal; --tokens sets S (B=1, H=128, causal, one case per S). Inputs are bshd
(q 201 MB at the target shape: larger than L2). --no-compile is accepted (no torch.compile here).
Times are medians of triton.testing.do_bench(warmup=25, rep=100).

FLOPs: forward 2*B*H*S_q*S_kv*(192 + 128), backward 2*B*H*S_q*S_kv*(3*192 + 2*128) (the five
matmuls: S = q k^T, dP = do v^T, dv = P^T do, dq = dS k, dk = dS^T q); causal counts half. The same
count is used for every implementation, so TFLOP/s ratios are time ratios. (Triton's backward
recomputes S and dP in its separate dq kernel: it executes 38 % more FLOPs than it is credited.)

Baselines: torch.nn.functional.scaled_dot_product_attention under sdpa_kernel(CUDNN_ATTENTION),
(FLASH_ATTENTION), (EFFICIENT_ATTENTION), given [B, H, S, D] views of the same bshd tensors. A
backend that refuses q/k 192 with v 128 is reported with its reason and then retried with v
zero-padded to 192 ("v->192"; the time includes the padded work, the FLOPs credited stay MLA's).
The forward targets are taken against torch's cuDNN forward *with* the logsumexp
(aten._scaled_dot_product_cudnn_attention, compute_log_sumexp=True: what training runs and what the
Triton kernel writes), timed in turns with the Triton forward (medians of 3 interleaved rounds); the
F.sdpa rows above it run without gradients and so without statistics.
MXFP8 rows are compared with the bf16 cuDNN time on the dequantized inputs (same values).
The backward baselines time torch.autograd.grad of the SDPA output (forward graph kept).

Also printed: first-call time of each triton op (compile + autotune), the autotuner's time for every
config (so one run on the H200 shows the whole tuning space), and the relative Frobenius error of
every output against the first baseline that ran ("err"), so a fast wrong result shows.
"""
from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchlib  # noqa: E402


ARGS = benchlib.parse_script_args(__doc__, "only B=1 S=4096 H=128 causal", "S (B=1, H=128, causal)")
import torch  # noqa: E402

import backends  # noqa: E402

backends.load()
from backends.triton import attention as tri  # noqa: E402
from spec.mxtensor import MXTensor  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D_QK, D_V = 192, 128
TARGETS = {("fwd", "bf16"): 0.85, ("fwd", "mxfp8"): 0.75, ("bwd", "bf16"): 0.70}
bench_ms = benchlib.bench_ms
REC = benchlib.Recorder("attention", ARGS)


def first_call_s(fn) -> float:
    for kernel in (tri._mla_fwd_kernel, tri._mla_bwd_dkdv_kernel, tri._mla_bwd_dq_kernel):
        kernel.configs_timings = {}  # so tuning_notes shows only what this call tuned
    return benchlib.first_call_s(fn)


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------

def quantize_mx(x: torch.Tensor, axis: int) -> MXTensor:
    """e4m3 MXFP8 with the rceil scale rule of SEMANTICS 1.1 (torch ops; for benchmark inputs)."""
    xm = x.float().movedim(axis, -1)
    blocks = xm.reshape(*xm.shape[:-1], xm.shape[-1] // 32, 32)
    amax = blocks.abs().amax(-1)
    p = amax * torch.tensor(1.0 / 448.0, dtype=torch.float32)  # RN_f32(1/448) = 0x3B124925
    bits = p.view(torch.int32)
    e_field, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    e = torch.where(mant > 0, e_field + 1, e_field).clamp(0, 254)
    e = torch.where((e_field == 0) & (mant <= 0x400000), e_field, e)
    s_inv = torch.where(e == 0, torch.full_like(e, 0x7F000000), (254 - e) << 23).view(torch.float32)  # 2^(127-e)
    codes = (blocks * s_inv[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    codes = codes.reshape(xm.shape).movedim(-1, axis).contiguous()
    scale = e.to(torch.uint8).movedim(-1, axis).contiguous()
    return MXTensor(codes, scale, axis % x.ndim, "e4m3", "compact")


def make_inputs(b, s, h):
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(b, s, h, D_QK, generator=g).to(torch.bfloat16).to(DEVICE)
    k = torch.randn(b, s, h, D_QK, generator=g).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(b, s, h, D_V, generator=g).to(torch.bfloat16).to(DEVICE)
    do = torch.randn(b, s, h, D_V, generator=g).to(torch.bfloat16).to(DEVICE)
    return q, k, v, do


def flops(b, s, h, causal, direction):
    pairs = b * h * s * s * (0.5 if causal else 1.0)
    per_pair = 2 * (D_QK + D_V) if direction == "fwd" else 2 * (3 * D_QK + 2 * D_V)
    return pairs * per_pair


def traffic(b, s, h, direction, tag):
    """Bytes the op must move once. fwd: q, k, v in, o out (bf16; MXFP8 inputs: 1-byte codes + 1/32
    scale bytes); bwd: q, k, v, o, do in, dq, dk, dv out (bf16); lse (fp32) either way."""
    tokens = b * s * h
    in_size = 1 + 1 / 32 if tag.startswith("mxfp8") and direction == "fwd" else 2
    if direction == "fwd":
        return int(tokens * ((2 * D_QK + D_V) * in_size + 2 * D_V + 4))
    return int(tokens * 2 * (2 * D_QK + 3 * D_V + 2 * D_QK + D_V) + tokens * 4)


def case_keys(b, s, h, causal, direction, tag):
    """The row keys every attention row shares: shape, tokens, family, flops, bytes."""
    shape = f"B{b} S{s} H{h}{' causal' if causal else ''}"
    return dict(shape=shape, tokens=s, family=f"B{b} H{h}{' causal' if causal else ''} {tag.split()[0]}",
                flops=flops(b, s, h, causal, direction), bytes=traffic(b, s, h, direction, tag))


# --------------------------------------------------------------------------------------------------
# Baselines: torch SDPA
# --------------------------------------------------------------------------------------------------

def sdpa_backends():
    from torch.nn.attention import SDPBackend

    if DEVICE != "cuda":
        return [("sdpa math", SDPBackend.MATH)]
    return [("sdpa cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa flash", SDPBackend.FLASH_ATTENTION),
            ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION)]


def sdpa_call(backend, q, k, v, causal, scale, pad_v):
    """SDPA on [B, H, S, D] views of bshd tensors; with pad_v, v is zero-padded to 192 features and
    the output cut back to 128."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if pad_v:
        vt = F.pad(vt, (0, D_QK - D_V))
    with sdpa_kernel(backend):
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
    return o[..., :D_V] if pad_v else o


def cudnn_with_lse(q, k, v, causal, scale):
    """torch's cuDNN attention forward computing the logsumexp, or None where torch lacks it."""
    if DEVICE != "cuda":
        return None
    op = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    call = lambda: op(qt, kt, vt, None, True, 0.0, causal, False, scale=scale)  # noqa: E731
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - a refusal is a result
        REC.note(f"aten cudnn attention with lse: not accepted ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
        return None
    return call


def run_baselines(b, s, h, causal, q, k, v, do, scale, tag):
    """Forward and backward of every SDPA backend; returns {(name, direction): (ms, output)}."""
    results = {}
    for name, backend in sdpa_backends():
        for pad_v in (False, True):
            label = name + (" v->192" if pad_v else "")
            keys = case_keys(b, s, h, causal, "fwd", tag)
            try:
                o = sdpa_call(backend, q, k, v, causal, scale, pad_v)
                ms = bench_ms(lambda: sdpa_call(backend, q, k, v, causal, scale, pad_v))
            except Exception as exc:  # noqa: BLE001 - a refusal is a result
                REC.note(f"{label} fwd {keys['shape']}: not accepted ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:160]})")
                continue
            results[(name, "fwd")] = (ms, o.transpose(1, 2))
            cudnn = results.get(("sdpa cudnn", "fwd"), (None,))[0]
            REC.row(op="fwd", inputs=tag, impl=label, ms=ms, tflops=keys["flops"] / ms / 1e9,
                    ratio=cudnn / ms if cudnn else None, vs="sdpa cudnn" if cudnn else None, **keys)
            keys = case_keys(b, s, h, causal, "bwd", tag)
            try:
                qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
                og = sdpa_call(backend, qg, kg, vg, causal, scale, pad_v)
                dot = do.transpose(1, 2)
                grads = torch.autograd.grad(og, (qg, kg, vg), dot, retain_graph=True)
                ms = bench_ms(lambda: torch.autograd.grad(og, (qg, kg, vg), dot, retain_graph=True))
                results[(name, "bwd")] = (ms, grads)
                cudnn = results.get(("sdpa cudnn", "bwd"), (None,))[0]
                REC.row(op="bwd", inputs=tag, impl=label, ms=ms, tflops=keys["flops"] / ms / 1e9,
                        ratio=cudnn / ms if cudnn else None, vs="sdpa cudnn" if cudnn else None, **keys)
                del og, grads, qg, kg, vg
            except Exception as exc:  # noqa: BLE001
                REC.note(f"{label} bwd {keys['shape']}: failed ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:160]})")
            break  # the unpadded call worked (or the padded one did): no need for the next variant
    return results


# --------------------------------------------------------------------------------------------------
# Triton
# --------------------------------------------------------------------------------------------------

def tuning_notes(kernel, what):
    """The autotuner's per-config times of its last tuning run, best first."""
    timings = getattr(kernel, "configs_timings", None) or {}
    lines = []
    for cfg, t in sorted(timings.items(), key=lambda kv: (kv[1][0] if isinstance(kv[1], (list, tuple)) else kv[1])):
        t0 = t[0] if isinstance(t, (list, tuple)) else t
        lines.append(f"  {what}: {cfg.kwargs} warps={cfg.num_warps} stages={cfg.num_stages}: {t0:.4f} ms")
    best = getattr(kernel, "best_config", None)
    if best is not None:
        lines.insert(0, f"  {what}: chosen {best.kwargs} warps={best.num_warps} stages={best.num_stages}")
    return lines


def wgmma_report():
    """For every compiled variant of the attention kernels: HGMMA count and how many of them are
    followed by a wait (WARPGROUP.DEPBAR). A wait after nearly every HGMMA means ptxas serialised the
    kernel's wgmma (warning C7515), which costs a large part of the tensor-core throughput."""
    lines = []
    for kernel in (tri._mla_fwd_kernel, tri._mla_bwd_dkdv_kernel, tri._mla_bwd_dq_kernel):
        fn = kernel.fn
        caches = getattr(fn, "device_caches", None) or {}
        for entry in caches.values():
            kernel_cache = entry[0] if isinstance(entry, tuple) else entry
            for compiled in list(kernel_cache.values()):
                try:
                    sass = compiled.asm["sass"]
                except Exception as exc:  # noqa: BLE001 - diagnostics only
                    lines.append(f"  {fn.__name__}: SASS unavailable ({type(exc).__name__})")
                    break
                n_mma = sass.count("HGMMA")
                n_wait = sass.count("WARPGROUP.DEPBAR")
                flag = "SERIALISED?" if n_mma and n_wait >= 0.75 * n_mma else "ok"
                lines.append(f"  {fn.__name__}: {n_mma} HGMMA, {n_wait} waits, "
                             f"{getattr(compiled, 'n_regs', '?')} regs, {getattr(compiled, 'n_spills', '?')} spills: {flag}")
    return lines


def cases():
    h = 2 if ARGS.smoke else 128
    if ARGS.tokens:
        return [(1, t, h, True) for t in ARGS.tokens]
    if ARGS.smoke:
        return [(1, 64, 2, True)]
    if ARGS.quick:
        return [(1, 4096, 128, True)]
    return [(1, 4096, 128, True), (1, 4096, 128, False), (1, 8192, 128, True)]


def measure():
    REC.load_peaks()
    scale = 1.0 / math.sqrt(D_QK)
    for b, s, h, causal in cases():
        shape = f"B{b} S{s} H{h}{' causal' if causal else ''}"
        q, k, v, do = make_inputs(b, s, h)
        q_mx, k_mx, v_mx = quantize_mx(q, -1), quantize_mx(k, -1), quantize_mx(v, 1)
        q_dq, k_dq, v_dq = tri._dequantize_mx(q_mx, k_mx, v_mx)

        base = run_baselines(b, s, h, causal, q, k, v, do, scale, "bf16")
        base_mx = run_baselines(b, s, h, causal, q_dq, k_dq, v_dq, do, scale, "mxfp8 (dequantized)")
        ref_fwd = next((base[(n, "fwd")][1] for n, _ in sdpa_backends() if (n, "fwd") in base), None)
        ref_bwd = next((base[(n, "bwd")][1] for n, _ in sdpa_backends() if (n, "bwd") in base), None)
        ref_fwd_mx = next((base_mx[(n, "fwd")][1] for n, _ in sdpa_backends() if (n, "fwd") in base_mx), None)
        cudnn = {d: base.get(("sdpa cudnn", d), (None,))[0] for d in ("fwd", "bwd")}
        cudnn_mx = base_mx.get(("sdpa cudnn", "fwd"), (None,))[0]
        best = {d: min((ms for (n, dd), (ms, _) in base.items() if dd == d), default=None) for d in ("fwd", "bwd")}

        def add_row(op, tag, impl, ms, out, ref, vs_ms, target_key=None):
            err = None
            if ref is not None:
                both = list(zip(out, ref)) if isinstance(out, tuple) else [(out, ref)]
                err = max(rel_err(a, r) for a, r in both)
            keys = case_keys(b, s, h, causal, op, tag)
            REC.row(op=op, inputs=tag, impl=impl, ms=ms, tflops=keys["flops"] / ms / 1e9,
                    ratio=(vs_ms / ms) if vs_ms else None, vs="sdpa cudnn" if vs_ms else None,
                    vs_cudnn=(vs_ms / ms) if vs_ms else None, err=err,
                    vs_best=(best[op] / ms) if best[op] else None,
                    target=TARGETS.get(target_key) if target_key else None, **keys)

        # Forward, bf16.
        fwd = lambda: tri.mla_attention(q, k, v, causal=causal)  # noqa: E731
        REC.note(f"triton fwd bf16 {shape}: first call {first_call_s(fwd):.1f} s (compile + autotune)")
        for line in tuning_notes(tri._mla_fwd_kernel, "fwd bf16"):
            REC.note(line)
        o, lse = fwd()
        # The forward target compares like with like: torch's cuDNN forward *with* the logsumexp (what
        # training runs and what this kernel writes), timed in turns with ours (interleaved medians:
        # F.sdpa's no-grad cuDNN call read 1.16 and 1.28 ms in one earlier run).
        lse_fwd = cudnn_with_lse(q, k, v, causal, scale)
        if lse_fwd is not None:
            t = benchlib.interleaved_ms({"triton": fwd, "cudnn": lse_fwd})
            cudnn["fwd"] = t["cudnn"]
            keys = case_keys(b, s, h, causal, "fwd", "bf16")
            REC.row(op="fwd", inputs="bf16", impl="sdpa cudnn with lse (aten)", ms=t["cudnn"],
                    tflops=keys["flops"] / t["cudnn"] / 1e9, ratio=1.0, vs="sdpa cudnn with lse",
                    note="forward target baseline; interleaved with triton", **keys)
            add_row("fwd", "bf16", "triton", t["triton"], o, ref_fwd, cudnn["fwd"], ("fwd", "bf16"))
        else:
            add_row("fwd", "bf16", "triton", bench_ms(fwd), o, ref_fwd, cudnn["fwd"], ("fwd", "bf16"))

        # Forward, MXFP8, both dequantize placements.
        for mode in tri.FWD_MX_DEQUANT_MODES:
            fwd_mx = lambda: tri._forward(q_mx, k_mx, v_mx, causal, None, "bshd", None, None, mx_dequant=mode)  # noqa: E731
            REC.note(f"triton fwd mxfp8 ({mode}) {shape}: first call {first_call_s(fwd_mx):.1f} s")
            for line in tuning_notes(tri._mla_fwd_kernel, f"fwd mxfp8 {mode}"):
                REC.note(line)
            o_mx, _ = fwd_mx()
            impl = {"load": "triton (dequant in load)", "predequant": "triton (k,v predequant)",
                    "predequant_qkv": "triton (q,k,v predequant)"}[mode]
            add_row("fwd", "mxfp8", impl, bench_ms(fwd_mx), o_mx, ref_fwd_mx,
                    cudnn["fwd"] if lse_fwd is not None else (cudnn_mx or cudnn["fwd"]), ("fwd", "mxfp8"))

        # Backward, bf16 (the forward's own o and lse).
        bwd = lambda: tri.mla_attention_backward(do, q, k, v, o, lse, causal=causal)  # noqa: E731
        REC.note(f"triton bwd bf16 {shape}: first call {first_call_s(bwd):.1f} s (compile + autotune)")
        for line in tuning_notes(tri._mla_bwd_dkdv_kernel, "bwd dkdv") + tuning_notes(tri._mla_bwd_dq_kernel, "bwd dq"):
            REC.note(line)
        grads = bwd()
        add_row("bwd", "bf16", "triton", bench_ms(bwd), grads, ref_bwd, cudnn["bwd"], ("bwd", "bf16"))

        # Backward, bf16, dq by atomics from the dkdv kernel (opt-in; not deterministic).
        bwd_at = lambda: tri._backward(do, q, k, v, o, lse, causal, None, "bshd", None, None, dq_mode="atomic")  # noqa: E731
        REC.note(f"triton bwd bf16 atomic-dq {shape}: first call {first_call_s(bwd_at):.1f} s")
        for line in tuning_notes(tri._mla_bwd_dkdv_kernel, "bwd dkdv atomic-dq"):
            REC.note(line)
        add_row("bwd", "bf16", "triton (atomic dq)", bench_ms(bwd_at), bwd_at(), ref_bwd, cudnn["bwd"])

        # Backward, MXFP8 operands (dequantized once, then the bf16 kernels).
        bwd_mx = lambda: tri.mla_attention_backward(do, q_mx, k_mx, v_mx, o_mx, lse, causal=causal)  # noqa: E731
        first_call_s(bwd_mx)
        add_row("bwd", "mxfp8", "triton (predequant)", bench_ms(bwd_mx), bwd_mx(), None, cudnn["bwd"])

        del q, k, v, do, q_mx, k_mx, v_mx, q_dq, k_dq, v_dq, base, base_mx, o, lse, grads
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    if DEVICE == "cuda":
        REC.note("compiled kernels (sass):")
        for line in wgmma_report():
            REC.note(line)


def main():
    REC.run(measure)
    REC.finish([("op", "op", 4, ""), ("inputs", "inputs", 20, ""), ("shape", "shape", 22, ""), ("impl", "impl", 26, ""),
                benchlib.MS, benchlib.TFLOPS, ("vs_cudnn", "vs cudnn", 9, ".3f"), ("target", "target", 7, ".2f"),
                ("err", "err", 8, ".1e"), ("vs_best", "vs best sdpa", 12, ".3f"), benchlib.OF_ROOF])


if __name__ == "__main__":
    main()
