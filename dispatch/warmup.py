"""Compile and tune the MLA query path's kernels ahead of a training run.

    import dispatch.warmup
    dispatch.warmup.mla_block(tokens=4096, batch=1, heads=128)          # before the first step
    $ mxmla warmup --batch 1 --seq 4096 --heads 128 --path mxfp8

One forward + backward of the query path and the attention core at the given shape (random data,
DeepSeek-V3's head dims), through the same `dispatch.nn` modules a model uses: the fused Q
up-projection with RMSNorm (path mxfp8: MXFP8 projection, per-step quantized weight, MXFP8
backward; path bf16: GEMM + RoPE), k / v prepared for that path, and `mla_attention`. Every kernel
these calls launch is compiled (into Triton's on-disk cache, where a second process finds it), with
the tiles a training step will take (heuristic ones; timed per shape bucket only under
MXMLA_TRITON_AUTOTUNE=1: backends/triton/tile_choice.py). The cuDNN graphs are built in this process
only (they are not kept on disk), so a model's own first step still builds those.

The kernels depend on the token count, heads and q_lora rank (and the sequence length for
attention), not on the values: warm up with the shapes (per rank, after sharding) that training uses.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from .autograd import reshape_mx
from .nn import MLAAttention, MLAQProjection, PATHS

_QK_ROPE, _QK_NOPE, _V = 64, 128, 128


def mla_block(tokens: int = 4096, *, batch: int = 1, heads: int = 128, q_lora: int = 1536, path: str = "mxfp8",
              backend: Optional[str] = None, device="cuda", seed: int = 0) -> float:
    """Run the query path and attention once forward and backward at [batch, tokens] (module docstring);
    returns the seconds it took (synchronized)."""
    for name, value in (("tokens", tokens), ("batch", batch), ("heads", heads), ("q_lora", q_lora)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
    device = torch.device(device)
    t0 = time.perf_counter()
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen) * scale).to(device)

    proj = MLAQProjection(q_lora, heads, path=path, backend=backend, device=device)
    attn = MLAAttention(causal=True, layout="bshd", path=path, backend=backend)
    c_q = randn(batch * tokens, q_lora).to(torch.bfloat16).requires_grad_(True)
    pos = torch.arange(tokens, dtype=torch.float64)[:, None]
    inv = 10000.0 ** (-torch.arange(0, _QK_ROPE, 2, dtype=torch.float64) / _QK_ROPE)
    ang = torch.cat([pos * inv, pos * inv], dim=-1).repeat(batch, 1)
    cos, sin = ang.cos().float().to(device), ang.sin().float().to(device)
    k = randn(batch, tokens, heads, _QK_NOPE + _QK_ROPE).to(torch.bfloat16).requires_grad_(True)
    v = randn(batch, tokens, heads, _V).to(torch.bfloat16).requires_grad_(True)
    q = proj(c_q, cos, sin)
    shape = (batch, tokens, heads, _QK_NOPE + _QK_ROPE)
    q = q.reshape(shape) if isinstance(q, torch.Tensor) else reshape_mx(q, shape)
    o, _ = attn(q, k, v)
    o.backward(randn(*o.shape, scale=1e-3).to(o.dtype))
    wait_background_compiles()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def wait_background_compiles() -> None:
    """Return once nothing compiles in the background: the exact-fallback kernels compile there at
    their first call (the triton backend's launch_gated), and a warm-up -- or a benchmark's first call
    before timing -- waits for them."""
    try:
        from backends.triton import wait_background_compiles as wait
    except ImportError:  # no triton: nothing compiles in the background
        return
    wait()

