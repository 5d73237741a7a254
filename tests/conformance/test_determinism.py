"""Determinism: two runs of each op on the same input give identical bytes (every output, every
backend present; the CUDA targets skip without a GPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.convert import to_torch
from spec.mxtensor import MXTensor
from tests.conformance.conftest import run_on
from tests.util import BF16, as_bytes, random_magnitudes


def _flat_outputs(out):
    if isinstance(out, MXTensor):
        return [out.data, out.scale]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat_outputs(o)]
    return [out]


def _calls(device):
    """(op, args, kwargs) for every op, small DeepSeek-shaped, seeded, several magnitudes."""
    import spec

    rng = np.random.default_rng(7)
    T, H, K = 64, 2, 128

    def t(a):
        return to_torch(a, device)

    x = random_magnitudes(rng, (T, K), BF16)
    mx = spec.mxfp8_quantize(random_magnitudes(rng, (T, K)), axis=-1)
    mx_b = spec.mxfp8_quantize(random_magnitudes(rng, (96, K)), axis=-1)
    cos = rng.standard_normal((T, 64)).astype(np.float32)
    sin = rng.standard_normal((T, 64)).astype(np.float32)
    xr = random_magnitudes(rng, (T, H, 192), BF16)
    w = random_magnitudes(rng, (H * 192, K), BF16)
    q = (rng.standard_normal((1, 48, H, 192)) * 0.5).astype(BF16)
    k = (rng.standard_normal((1, 48, H, 192)) * 0.5).astype(BF16)
    v = rng.standard_normal((1, 48, H, 128)).astype(BF16)
    o, lse = spec.mla_attention(q, k, v, causal=True)
    do = rng.standard_normal((1, 48, H, 128)).astype(BF16)
    kv = t(random_magnitudes(rng, (1, T, H, 256), BF16))
    k_pe = random_magnitudes(rng, (1, T, 1, 64), BF16)
    return [
        ("mxfp8_quantize", (t(x),), {"axis": (-1, 0)}),
        ("mxfp8_dequantize", (t(mx),), {}),
        ("swizzle_scales", (t(mx),), {}),
        ("unswizzle_scales", (t(spec.swizzle_scales(mx)),), {}),
        ("rope", (t(xr), t(cos), t(sin)), {"layout": "thd"}),
        ("rope_backward", (t(xr), t(cos), t(sin)), {"layout": "thd"}),
        ("mxfp8_gemm", (t(mx), t(mx_b)), {}),
        ("mla_q_uproj_rope_quant", (t(x), t(w), t(cos), t(sin)), {}),
        ("mla_q_uproj_rope_quant_backward", (t(xr), t(x), t(w), t(cos), t(sin)), {}),
        ("rmsnorm_mxfp8", (t(x), t(rng.standard_normal(K).astype(np.float32))), {}),
        ("rmsnorm_backward", (t(xr.reshape(-1, K)[:T]), t(x), t(rng.standard_normal(K).astype(np.float32)),
                              t(rng.random(T).astype(np.float32) + 0.5)), {}),
        ("mla_kv_quantize", (kv[..., :128], t(k_pe), kv[..., 128:]), {"layout": "bshd"}),
        ("mla_attention", (t(q), t(k), t(v)), {"causal": True}),
        ("mla_attention_backward", (t(do), t(q), t(k), t(v), t(o), t(lse)), {"causal": True}),
    ]


OPS = [c[0] for c in _calls("cpu")]


@pytest.mark.parametrize("op", OPS)
def test_two_runs_identical_bytes(target, op):
    backend, device = target
    if backend == "triton" and device == "cpu":
        pytest.skip("the interpreter is deterministic by construction; determinism matters on the GPU")
    _, args, kwargs = next(c for c in _calls(device) if c[0] == op)
    first = _flat_outputs(run_on(target, op, *args, **kwargs))
    if device == "cuda":
        torch.cuda.synchronize()
    second = _flat_outputs(run_on(target, op, *args, **kwargs))
    assert len(first) == len(second)
    for i, (a, b) in enumerate(zip(first, second)):
        assert np.array_equal(as_bytes(a), as_bytes(b)), f"{op} on {backend}-{device}: output {i} differs between runs"
