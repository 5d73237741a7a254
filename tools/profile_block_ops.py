"""Host and GPU time of each op in the MXFP8 block's forward (B1 S4096, DeepSeek-V3 shapes): the autograd
op, the dispatch.run call and the backend call, so a host-bound forward shows which layer costs.

    python tools/profile_block_ops.py              # CUDA; prints one table
    python tools/profile_block_ops.py --cprofile   # and, per autograd op, its host time by function
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import dispatch  # noqa: E402
import dispatch.autograd as ag  # noqa: E402

dev = "cuda"
T, H, K, HID = 4096, 128, 1536, 7168
g = torch.Generator(device="cpu").manual_seed(0)
bf = torch.bfloat16
c_q = torch.randn(T, K, generator=g).to(bf).to(dev).requires_grad_(True)
gamma = torch.ones(K, device=dev, requires_grad=True)
w = (torch.randn(H * 192, K, generator=g) * 0.02).to(bf).to(dev).requires_grad_(True)
cos = torch.rand(T, 64, device=dev)
sin = torch.rand(T, 64, device=dev)
k = torch.randn(1, T, H, 192, generator=g).to(bf).to(dev).requires_grad_(True)
v = torch.randn(1, T, H, 128, generator=g).to(bf).to(dev).requires_grad_(True)
y_row, y_col, _ = ag.rmsnorm_mxfp8(c_q, gamma)
w_row, w_col = ag.mxfp8_quantize(w, axis=(1, 0))
q_row, _ = ag.mla_q_uproj_rope_quant(y_row, w_row, cos, sin, quantize_grad=True, x_t=y_col, w_n=w_col)
q4 = ag.reshape_mx(q_row, (1, T, H, 192))
k_mx = ag.mxfp8_quantize(k, axis=-1)
v_mx = ag.mxfp8_quantize(v, axis=1)
kd, vd, cd, yd, wd = k.detach(), v.detach(), c_q.detach(), y_row, w_row
kv_up = torch.randn(1, T, H, 256, generator=g).to(bf).to(dev).requires_grad_(True)
k_pe = torch.randn(1, T, 1, 64, generator=g).to(bf).to(dev).requires_grad_(True)
cases = {
    "rmsnorm_mxfp8 autograd": lambda: ag.rmsnorm_mxfp8(c_q, gamma),
    "rmsnorm_mxfp8 run": lambda: dispatch.run("rmsnorm_mxfp8", cd, gamma.detach()),
    "quantize w (1,0) autograd": lambda: ag.mxfp8_quantize(w, axis=(1, 0)),
    "quantize w (1,0) run": lambda: dispatch.run("mxfp8_quantize", w.detach(), axis=(1, 0)),
    "mla_q fused autograd": lambda: ag.mla_q_uproj_rope_quant(y_row, w_row, cos, sin, quantize_grad=True, x_t=y_col, w_n=w_col),
    "mla_q fused run": lambda: dispatch.run("mla_q_uproj_rope_quant", yd, wd, cos, sin),
    "quantize k autograd": lambda: ag.mxfp8_quantize(k, axis=-1),
    "quantize k run": lambda: dispatch.run("mxfp8_quantize", kd, axis=-1),
    "quantize v autograd": lambda: ag.mxfp8_quantize(v, axis=1),
    "mla_attention autograd": lambda: ag.mla_attention(q4, k_mx, v_mx, causal=True, layout="bshd"),
    "mla_attention run": lambda: dispatch.run("mla_attention", q4, k_mx, v_mx, causal=True, layout="bshd"),
    "rope k_pe autograd": lambda: ag.rope(kd[:, :, :1, 128:].contiguous(), cos, sin, layout="bshd"),
    "mla_kv_mxfp8 autograd": lambda: ag.mla_kv_mxfp8(kv_up[..., :128], k_pe, kv_up[..., 128:]),
    "mla_kv_mxfp8 +rope autograd": lambda: ag.mla_kv_mxfp8(kv_up[..., :128], k_pe, kv_up[..., 128:], cos=cos, sin=sin),
}
from dispatch.warmup import wait_background_compiles  # noqa: E402

for fn in cases.values():  # compile everything first: a gated fallback still compiling reads its flag on the host
    fn()
wait_background_compiles()
print(f"{'op':28} {'host us':>9} {'gpu ms':>8}")
for name, fn in cases.items():
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    n = 10
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    torch.cuda.synchronize()
    print(f"{name:28} {host:9.1f} {e0.elapsed_time(e1) / n:8.3f}", flush=True)

if "--cprofile" in sys.argv:
    import cProfile
    import pstats

    for name, fn in cases.items():
        if not name.endswith("autograd"):
            continue
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:22]
        print(f"== {name}: own host us per call (cProfile, 20 calls)")
        for (f, line, func), (_, nc, tt, _, _) in rows:
            print(f"   {tt / 20 * 1e6:8.1f} us  x{nc // 20:<3} {os.path.basename(f)}:{line} {func}")
