"""Host time of the building blocks an mxmla op is made of, on this machine (CUDA): what a launch, an
allocation, a view, an autograd Function and the dispatch layers each cost, so a host-bound forward can
be costed line by line.

    python tools/host_costs.py          # one table, microseconds per call (median of 7 runs of 200 calls)
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import dispatch  # noqa: E402
import dispatch.autograd as ag  # noqa: E402
from backends.triton import _common  # noqa: E402
from spec.mxtensor import MXTensor  # noqa: E402


@triton.jit
def _nop(x_ptr, n, A: tl.constexpr):
    pass


@triton.jit
def _nop16(p0, p1, p2, p3, p4, p5, p6, p7, n0, n1, n2, n3, n4, n5, n6, n7, A: tl.constexpr):
    pass


class _Id(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


class _Six(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        outs = tuple(x.view_as(x) for _ in range(6))
        ctx.mark_non_differentiable(*outs[1:])
        return outs

    @staticmethod
    def backward(ctx, g, *rest):
        return g


_Q = ("e4m3", "rceil", "saturate", "compact", None)


def per_call_us(fn, n=200, reps=7) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    dev = "cuda"
    x = torch.randn(4096, 1536, device=dev, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    small = torch.zeros(1, device=dev)
    ptrs = [torch.empty(1024, device=dev) for _ in range(8)]
    k = torch.randn(1, 4096, 128, 256, device=dev, dtype=torch.bfloat16)
    k_nope, v = k[..., :128], k[..., 128:]
    k_pe = torch.randn(1, 4096, 1, 64, device=dev, dtype=torch.bfloat16)
    kg, k_pe_g = k.clone().requires_grad_(True), k_pe.clone().requires_grad_(True)
    row = dispatch.run("mxfp8_quantize", x, axis=-1)
    gamma = torch.ones(1536, device=dev)
    cos = torch.rand(4096, 64, device=dev)
    sin = torch.rand(4096, 64, device=dev)
    cases = {
        "torch.empty 6 MB": lambda: torch.empty(4096, 1536, device=dev, dtype=torch.bfloat16),
        "x.view(torch.uint8)": lambda: x.view(torch.uint8),
        "x.contiguous() (already)": lambda: x.contiguous(),
        "x.expand / reshape view": lambda: x.reshape(1, 4096, 1536),
        "small.clone() (a copy kernel)": lambda: small.clone(),
        "torch.cat 2 small": lambda: torch.cat([small, small]),
        "MXTensor(...) construct": lambda: MXTensor(row.data, row.scale, 1, "e4m3", "compact"),
        "autograd.Function 1 out": lambda: _Id.apply(xg),
        "autograd.Function 6 outs": lambda: _Six.apply(xg),
        "triton nop kernel[grid]": lambda: _nop[(1,)](small, 1, A=1),
        "fast_launch nop 2 args": lambda: _common.fast_launch(_nop, (1,), small, 1, A=1),
        "fast_launch nop 16 args": lambda: _common.fast_launch(_nop16, (1,), *ptrs, *range(8), A=1),
        "call_signature 4 args": lambda: __import__("dispatch.signature").signature.call_signature(
            (x, gamma, cos, sin), {"eps": 1e-6, "backend": None}),
        "dispatch.validate rmsnorm": lambda: dispatch.validate("rmsnorm_mxfp8", x, gamma, eps=1e-6),
        "run quantize x row": lambda: dispatch.run("mxfp8_quantize", x, axis=-1),
        "run quantize k_nope row (strided)": lambda: dispatch.run("mxfp8_quantize", k_nope, axis=-1),
        "run quantize v col (strided)": lambda: dispatch.run("mxfp8_quantize", v, axis=1),
        "quantize op body (no autograd)": lambda: ag._quantize_op._init_fn(x, [-1], *_Q),
        "_EagerOp.apply quantize (grad in)": lambda: ag._EagerOp.apply(ag._quantize_op, xg, [-1], *_Q),
        "autograd quantize x row (no grad in)": lambda: ag.mxfp8_quantize(x, axis=-1),
        "autograd quantize x row": lambda: ag.mxfp8_quantize(xg, axis=-1),
        "run rmsnorm_mxfp8": lambda: dispatch.run("rmsnorm_mxfp8", x, gamma),
        "autograd rmsnorm_mxfp8": lambda: ag.rmsnorm_mxfp8(xg, gamma),
        "run rope k_pe": lambda: dispatch.run("rope", k_pe, cos, sin, layout="bshd"),
        "autograd mla_kv_mxfp8": lambda: ag.mla_kv_mxfp8(k_nope, k_pe, v),
        "autograd mla_kv_mxfp8 (grad in)": lambda: ag.mla_kv_mxfp8(kg[..., :128], k_pe_g, kg[..., 128:]),
    }
    print(f"{'building block':36} {'host us/call':>12}")
    for name, fn in cases.items():
        try:
            us = per_call_us(fn)
        except Exception as exc:  # noqa: BLE001 - a row that cannot run here says why and the rest go on
            print(f"{name:36} {'error':>12}  {type(exc).__name__}: {exc}"[:160])
            continue
        print(f"{name:36} {us:12.1f}", flush=True)


if __name__ == "__main__":
    main()
