"""The cuDNN backend's MLA attention at DeepSeek-V3 sizes, on CUDA only (SEMANTICS 8 bounds).

tests/conformance/test_attention.py already runs every spec case on the cudnn-cuda target (bf16
forward/backward, all layouts, S_q != S_kv both ways, thd varlen with an empty sequence, MXFP8,
which skips on sm90 with the capability reason). This file adds what that one cannot afford on the
float64 reference or does not look at:

- B=1, S=4096, H=128, causal, bf16 (the DeepSeek-V3 prefill shape) in bshd, sbhd, thd and with
  q/k/v as strided views of fused projections. The reference is the torch backend in fp32 on the
  GPU (TF32 off), not the float64 spec: the spec would take minutes per case at this size. fp32
  accumulation keeps the reference within ~1e-6 relative of float64 (tests/conformance/
  test_attention.py runs the torch backend against spec), far inside the bounds used here.
- The graph cache (a second call builds nothing) and its host cost, and torch's current stream
  (work queued on a side stream is seen by cuDNN).

Bounds (SEMANTICS 8, as in test_attention.py): o and dq/dk/dv relative Frobenius error <= 1e-2,
lse absolute error <= 1e-3 on finite rows. Every test name ends in _cuda (tools/gpu_run.sh selects
`-k cuda`).
"""
from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from tests.conformance.conftest import run_on, skip_reason  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]

D_QK, D_V = 192, 128
BF16_BOUND = 1e-2
LSE_ABS_BOUND = 1e-3
TARGET = ("cudnn", "cuda")


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all(), "non-finite values in cudnn's output"
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def fp32_exact():
    """The fp32 reference must not use TF32."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _deepseek_inputs(layout: str, seed: int = 0, b: int = 1, s: int = 4096, h: int = 128):
    """bf16 q, k, v, do; magnitudes per head from soft to sharp softmax (q x 1/4 .. 4)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q_mag = 2.0 ** torch.randint(-2, 3, (h,), generator=gen, device="cuda").float()

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q = (randn(b, s, h, D_QK) * q_mag[:, None]).to(torch.bfloat16)
    kv = randn(b, s, h, D_QK + D_V).to(torch.bfloat16)
    do = (randn(b, s, h, D_V) * 0.5).to(torch.bfloat16)
    if layout == "bshd-strided":  # k, v as slices of one fused [B, S, H, 320] projection
        return q, kv[..., :D_QK], kv[..., D_QK:], do
    k, v = kv[..., :D_QK].contiguous(), kv[..., D_QK:].contiguous()
    if layout == "sbhd":
        return tuple(x.transpose(0, 1).contiguous() for x in (q, k, v, do))
    if layout == "thd":
        return tuple(x.reshape(b * s, h, x.shape[-1]).contiguous() for x in (q, k, v, do))
    return q, k, v, do


def _reference(q, k, v, do, causal, layout, kw):
    from backends.torch import attention as torch_attn

    o, lse = torch_attn.mla_attention(q, k, v, causal=causal, layout=layout, **kw)
    grads = torch_attn.mla_attention_backward(do, q, k, v, o, lse, causal=causal, layout=layout, **kw)
    return o, lse, grads


@pytest.mark.parametrize("layout", ["bshd", "sbhd", "thd", "bshd-strided"])
def test_deepseek_v3_prefill_cuda(layout, fp32_exact):
    """B=1, S=4096, H=128, causal; thd packs two sequences (1536 + 2560 tokens)."""
    q, k, v, do = _deepseek_inputs(layout)
    run_layout = "bshd" if layout == "bshd-strided" else layout
    kw = {}
    if layout == "thd":
        cu = torch.tensor([0, 1536, 4096], dtype=torch.int32, device="cuda")
        kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)
    o, lse = run_on(TARGET, "mla_attention", q, k, v, causal=True, layout=run_layout, **kw)
    o_ref, lse_ref, grads_ref = _reference(q, k, v, do, True, run_layout, kw)
    assert o.dtype == torch.bfloat16 and o.shape == o_ref.shape and lse.shape == lse_ref.shape
    err = _rel(o, o_ref)
    assert err <= BF16_BOUND, f"{layout}: o relative Frobenius error {err:.2e}"
    lse_err = (lse - lse_ref).abs().max().item()
    assert lse_err <= LSE_ABS_BOUND, f"{layout}: lse abs error {lse_err:.2e}"
    grads = run_on(TARGET, "mla_attention_backward", do, q, k, v, o_ref, lse_ref, causal=True, layout=run_layout,
                   **kw)
    for name, g, g_ref, like in zip(("dq", "dk", "dv"), grads, grads_ref, (q, k, v)):
        assert g.dtype == torch.bfloat16 and g.shape == like.shape
        err = _rel(g, g_ref)
        assert err <= BF16_BOUND, f"{layout}: {name} relative Frobenius error {err:.2e}"


def test_deepseek_v3_unequal_lengths_cuda(fp32_exact):
    """Chunked prefill: 1024 new queries against 4096 keys (bottom-right causal), and the reverse
    (S_q > S_kv: the first 1024 rows see no key and must be o = 0, lse = -inf, dq = 0)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    h = 128
    for s_q, s_kv in ((1024, 4096), (4096, 3072)):
        q = torch.randn(1, s_q, h, D_QK, device="cuda", generator=gen).to(torch.bfloat16)
        k = torch.randn(1, s_kv, h, D_QK, device="cuda", generator=gen).to(torch.bfloat16)
        v = torch.randn(1, s_kv, h, D_V, device="cuda", generator=gen).to(torch.bfloat16)
        do = torch.randn(1, s_q, h, D_V, device="cuda", generator=gen).to(torch.bfloat16)
        o, lse = run_on(TARGET, "mla_attention", q, k, v, causal=True)
        o_ref, lse_ref, grads_ref = _reference(q, k, v, do, True, "bshd", {})
        assert _rel(o, o_ref) <= BF16_BOUND
        finite = torch.isfinite(lse_ref)
        assert torch.equal(torch.isfinite(lse), finite)
        assert (lse[finite] - lse_ref[finite]).abs().max().item() <= LSE_ABS_BOUND
        grads = run_on(TARGET, "mla_attention_backward", do, q, k, v, o_ref, lse_ref, causal=True)
        for g, g_ref in zip(grads, grads_ref):
            assert _rel(g, g_ref) <= BF16_BOUND
        if s_q > s_kv:
            lead = s_q - s_kv
            assert bool((o[:, :lead] == 0).all()) and bool((grads[0][:, :lead] == 0).all())


def test_graph_cache_and_host_time_cuda():
    """A second call with the same geometry builds nothing; the host cost of a cache hit is printed
    (the 20 us budget is checked by benchmarks/bench_attention_cudnn.py; here only a loose bound
    that catches a rebuild per call)."""
    from backends.cudnn import attention as cudnn_attn

    q, k, v, do = _deepseek_inputs("bshd", seed=1, s=256, h=8)
    run_on(TARGET, "mla_attention", q, k, v, causal=True)
    built = cudnn_attn.build_count
    torch.cuda.synchronize()
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        cudnn_attn.mla_attention(q, k, v, causal=True)
    host_us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    assert cudnn_attn.build_count == built, "a cache hit rebuilt the graph"
    print(f"\ncudnn mla_attention cache hit: {host_us:.1f} us host per call (enqueue only, S=256 H=8)")
    assert host_us < 500


def test_current_stream_is_used_cuda():
    """Inputs written on a side stream right before the call: cuDNN must run after them on that stream."""
    q, k, v, _ = _deepseek_inputs("bshd", seed=2, s=512, h=8)
    o_ref, lse_ref = run_on(TARGET, "mla_attention", q, k, v, causal=True)
    q_late = torch.zeros_like(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the side stream busy so a wrong stream would read zeros
        q_late.copy_(q)
        o, lse = run_on(TARGET, "mla_attention", q_late, k, v, causal=True)
    side.synchronize()
    assert torch.equal(o.view(torch.int16), o_ref.view(torch.int16))
    assert torch.equal(lse, lse_ref)


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_plan_cache_loads_what_was_built_cuda(layout, tmp_path, monkeypatch):
    """Graphs built with an empty plan cache write their plans; after the in-memory graphs are dropped,
    the same calls load them from disk (nothing built) and give the forward's exact bytes; the
    backward's gradients are compared with the built graph's on the same inputs: byte-equal where the
    built graph repeats itself bit for bit, else within the bf16 bound (its dq accumulation order may
    vary between runs)."""
    reason = skip_reason(*TARGET)  # the backend's modules are called directly here, not through run_on
    if reason:
        pytest.skip(reason)
    from backends.cudnn import attention as cudnn_attn
    from backends.cudnn import plan_cache

    monkeypatch.setenv("MXMLA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MXMLA_CUDNN_PLAN_CACHE", "1")
    q, k, v, do = _deepseek_inputs(layout, seed=3, s=512, h=8)
    kw = {}
    if layout == "thd":
        kw = dict(cu_seqlens_q=torch.tensor([0, 200, 512], dtype=torch.int32, device="cuda"))
        kw["cu_seqlens_kv"] = kw["cu_seqlens_q"]
    cudnn_attn.clear_cache()
    stored = plan_cache.stored_count
    o1, lse1 = cudnn_attn.mla_attention(q, k, v, causal=True, layout=layout, **kw)
    g1 = cudnn_attn.mla_attention_backward(do, q, k, v, o1, lse1, causal=True, layout=layout, **kw)
    g1b = cudnn_attn.mla_attention_backward(do, q, k, v, o1, lse1, causal=True, layout=layout, **kw)
    assert plan_cache.stored_count == stored + 2, "forward and backward plans were not written"
    assert len(list((tmp_path / "cudnn").glob("*.plan"))) == 2
    cudnn_attn.clear_cache()
    loaded = plan_cache.loaded_count
    o2, lse2 = cudnn_attn.mla_attention(q, k, v, causal=True, layout=layout, **kw)
    g2 = cudnn_attn.mla_attention_backward(do, q, k, v, o2, lse2, causal=True, layout=layout, **kw)
    assert plan_cache.loaded_count == loaded + 2, "the plans on disk were not loaded"
    assert torch.equal(o1.view(torch.int16), o2.view(torch.int16))
    assert torch.equal(lse1.view(torch.int32), lse2.view(torch.int32))
    for a, b, again in zip(g1, g2, g1b):
        if torch.equal(a.view(torch.int16), again.view(torch.int16)):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        else:
            assert _rel(b, a) <= BF16_BOUND
    cudnn_attn.clear_cache()
