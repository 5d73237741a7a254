"""DeepSeek-V3 full sizes on CUDA: the Triton kernels at the shapes the model runs.

tokens 4096 and 16384, 128 heads x 192, K = q_lora_rank 1536, attention B=1 S=4096 H=128 causal.

How a full-size result is tied to spec without running spec on 10^11 multiply-adds:
- bit-exact ops compare the *whole* Triton output with the torch backend on the same GPU, byte for byte
  (the torch backend is itself byte-equal to spec: the rest of tests/conformance shows it at smaller
  shapes, special values included), and a leading *slice* of the output with spec run on the matching
  slice of the input. Slices are chosen so that every MXFP8 block inside them is complete: rows
  (tokens) are independent, rowwise blocks live inside one head, columnwise blocks are 32 tokens.
- the fused op and the GEMM use exact-arithmetic operands (small integers times powers of two, every
  partial sum exact in fp32), where SEMANTICS 6 makes the bytes independent of summation order.
- attention (tolerance op) compares 4 of the 128 heads with spec's float64 attention, all 4096 tokens,
  with the bounds of tests/conformance/test_attention.py (heads are independent).
Every buffer the Triton backend allocates starts as 0xFF bytes (NaN / NaN codes / scale 255: the
`poisoned_outputs` fixture), and the comparisons cover whole outputs, so an unwritten element fails.
"""
from __future__ import annotations

import numpy as np
import pytest

import spec
from tests.util import assert_bytes_equal, poisoned_empty

torch = pytest.importorskip("torch")
from backends.convert import to_numpy  # noqa: E402
from spec.mxtensor import MXTensor  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: full DeepSeek-V3 sizes run on the GPU only"),
]

HEADS, D, K, ROPE = 128, 192, 1536, 64
N = HEADS * D  # 24576
TOKENS = [4096, 16384]
SLICE_T, SLICE_H, QSLICE_N = 256, 8, 4096  # spec runs on x[:256], heads [:8], quantize columns [:4096]
DEV = "cuda"  # tools: a CPU dry run of this file's plumbing patches DEV, sizes and the backend


class _PoisonedTorch:
    """torch for a backend module, except that empty / empty_like return 0xFF-filled buffers."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        return _poison(torch.empty(*args, **kwargs))

    @staticmethod
    def empty_like(x, **kwargs):
        return _poison(torch.empty_like(x, **kwargs))


def _poison(t):
    if t.is_contiguous():
        t.view(torch.uint8).fill_(0xFF)
    elif t.is_floating_point():  # empty_like of a strided input keeps its strides
        t.fill_(float("nan"))
    return t


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    import backends.triton.attention as attention
    import backends.triton.gemm as gemm
    import backends.triton.mla_q as mla_q
    import backends.triton.rope as rope
    import backends.triton.swizzle as swizzle

    monkeypatch.setattr(swizzle, "POISON_OUTPUTS", True)  # quantize / dequantize outputs
    monkeypatch.setattr(mla_q, "_empty", poisoned_empty)
    monkeypatch.setattr(gemm, "_empty", poisoned_empty)
    for module in (rope, attention):
        monkeypatch.setattr(module, "torch", _PoisonedTorch())


def _run(op, *args, backend="triton", **kw):
    import dispatch

    return dispatch.run(op, *args, backend=backend, **kw)


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def _mx_equal(got: MXTensor, want: MXTensor, what: str):
    assert (got.axis, got.elem, got.scale_layout) == (want.axis, want.elem, want.scale_layout), what
    assert_bytes_equal(got.scale, want.scale, f"{what} scale")
    assert_bytes_equal(got.data, want.data, f"{what} data")


def _special_rows(x: torch.Tensor) -> torch.Tensor:
    """Plant special values into the first rows (inside the slice spec also sees): +-0, an all-zero and
    an all-NaN block, +-Inf, NaN, the bf16 max, a subnormal, values one ulp off a power of two."""
    x = x.clone()
    x[0, :32] = 0.0
    x[0, 32] = -0.0
    x[1, :32] = float("nan")
    x[2, 5], x[2, 40], x[2, 77] = float("inf"), float("-inf"), float("nan")
    x[3, 0] = torch.finfo(torch.bfloat16).max
    x[3, 33] = torch.finfo(torch.bfloat16).tiny / 4  # bf16 subnormal
    x[4, 64], x[4, 65] = 1.0 + 2.0 ** -7, 1.0 - 2.0 ** -8  # bf16 ulps either side of 1
    x[4, 66], x[4, 67] = 448.0 + 2.0 ** 1, 256.0 - 1.0  # just past the e4m3 max, just under 2^8
    x[5:37, 100] = 448.0  # a column block at the e4m3 max
    return x


def _magnitudes(shape, seed) -> torch.Tensor:
    """bf16 normal data with every row scaled by 2^e, e in [-30, 30]."""
    g = _gen(seed)
    x = torch.randn(*shape, device=DEV, generator=g)
    e = torch.randint(-30, 31, (shape[0],) + (1,) * (len(shape) - 1), device=DEV, generator=g)
    return (x * torch.exp2(e.float())).to(torch.bfloat16)


# --------------------------------------------------------------------------------------------------
# quantize bf16 [T, 24576], rowwise and columnwise in one pass
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["compact", "swizzled"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_quantize_dual_full(tokens, layout):
    x = _special_rows(_magnitudes((tokens, N), seed=tokens))
    got = _run("mxfp8_quantize", x, axis=(-1, 0), scale_layout=layout)
    want = _run("mxfp8_quantize", x, axis=(-1, 0), scale_layout=layout, backend="torch")
    for i, name in enumerate(("rowwise", "columnwise")):
        _mx_equal(got[i], want[i], f"{name} {layout} vs torch")
    if layout == "compact":
        ref = spec.mxfp8_quantize(to_numpy(x[:SLICE_T, :QSLICE_N]), axis=(-1, 0))
        row, col = got
        assert_bytes_equal(row.data[:SLICE_T, :QSLICE_N], ref[0].data, "rowwise data vs spec (slice)")
        assert_bytes_equal(row.scale[:SLICE_T, :QSLICE_N // 32], ref[0].scale, "rowwise scale vs spec (slice)")
        assert_bytes_equal(col.data[:SLICE_T, :QSLICE_N], ref[1].data, "columnwise data vs spec (slice)")
        assert_bytes_equal(col.scale[:SLICE_T // 32, :QSLICE_N], ref[1].scale, "columnwise scale vs spec (slice)")


# --------------------------------------------------------------------------------------------------
# the fused Q up-projection, bf16 and MXFP8 projections
# --------------------------------------------------------------------------------------------------

def _exact_bf16_operands(tokens, seed):
    """x [T, 1536], w [24576, 1536]: integers in [-4, 4] times 2^e (e per token row / per head); every
    dot product is an integer multiple of 2^(e_x + e_w) below 2^24 in magnitude: exact in fp32."""
    g = _gen(seed)
    x = torch.randint(-4, 5, (tokens, K), device=DEV, generator=g).float()
    x = x * torch.exp2(torch.randint(-2, 3, (tokens, 1), device=DEV, generator=g).float())
    w = torch.randint(-4, 5, (N, K), device=DEV, generator=g).float()
    w = w * torch.exp2(torch.randint(-3, 4, (HEADS, 1), device=DEV, generator=g).float()).repeat_interleave(D, 0)
    return x.to(torch.bfloat16), w.to(torch.bfloat16)


def _exact_mx_operand(rows, seed):
    """MXFP8 [rows, 1536] along K: e4m3 codes in [-4, 4], block scales 2^-1..2^1: a dot product's terms
    span 6 binades above 4-bit integers over 1536 terms, < 2^22: exact in fp32."""
    g = _gen(seed)
    codes = torch.randint(-4, 5, (rows, K), device=DEV, generator=g).float().to(torch.float8_e4m3fn)
    scale = (127 + torch.randint(-1, 2, (rows, K // 32), device=DEV, generator=g)).to(torch.uint8)
    return MXTensor(codes, scale, 1, "e4m3")


def _tables(tokens, seed):
    g = _gen(seed)
    angle = torch.rand(tokens, ROPE, device=DEV, generator=g) * 8 - 4
    angle[:, ROPE // 2:] *= 1.37  # halves differ
    return torch.cos(angle), torch.sin(angle)


def _slice_mx(t: MXTensor, rows: int, heads: int, columnwise: bool) -> MXTensor:
    data = t.data[:rows, :heads]
    scale = t.scale[:rows // 32, :heads] if columnwise else t.scale[:rows, :heads]
    return MXTensor(data, scale, t.axis, t.elem)


@pytest.mark.parametrize("kind", ["bf16", "mxfp8"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_mla_q_forward_full(tokens, kind):
    if kind == "bf16":
        x, w = _exact_bf16_operands(tokens, seed=tokens)
    else:
        x, w = _exact_mx_operand(tokens, seed=tokens), _exact_mx_operand(N, seed=tokens + 1)
    cos, sin = _tables(tokens, seed=7)
    got = _run("mla_q_uproj_rope_quant", x, w, cos, sin)
    want = _run("mla_q_uproj_rope_quant", x, w, cos, sin, backend="torch")
    _mx_equal(got[0], want[0], f"q_row {kind} T={tokens} vs torch")
    _mx_equal(got[1], want[1], f"q_col {kind} T={tokens} vs torch")
    # spec on the first 256 tokens and 8 heads
    if kind == "bf16":
        xs, ws = to_numpy(x[:SLICE_T]), to_numpy(w[:SLICE_H * D])
    else:
        xs = to_numpy(MXTensor(x.data[:SLICE_T], x.scale[:SLICE_T], 1, "e4m3"))
        ws = to_numpy(MXTensor(w.data[:SLICE_H * D], w.scale[:SLICE_H * D], 1, "e4m3"))
    ref = spec.mla_q_uproj_rope_quant(xs, ws, to_numpy(cos[:SLICE_T]), to_numpy(sin[:SLICE_T]))
    _mx_equal(_slice_mx(got[0], SLICE_T, SLICE_H, False), ref[0], "q_row vs spec (slice)")
    _mx_equal(_slice_mx(got[1], SLICE_T, SLICE_H, True), ref[1], "q_col vs spec (slice)")


# Backward: dx, dw are bf16 GEMM results of random gradients, so the backends differ by summation
# order. Bound: each result is its fp32 accumulator rounded to bf16 (half an ulp, 2^-9 relative), the
# two accumulators agree to ~1e-6 relative, so two backends differ by <= 2^-8 per element; relative
# Frobenius error <= 2^-8 (asserted), against the torch backend on the full shape.
BWD_BOUND = 2.0 ** -8


@pytest.mark.parametrize("tokens", TOKENS)
def test_mla_q_backward_full(tokens):
    x, w = (t.float() for t in _exact_bf16_operands(tokens, seed=tokens))
    x, w = (x * 2 ** -4).to(torch.bfloat16), (w * 2 ** -4).to(torch.bfloat16)
    cos, sin = _tables(tokens, seed=9)
    dq = _magnitudes((tokens, HEADS, D), seed=tokens + 5).float()
    dq = (dq / dq.abs().amax(dim=(1, 2), keepdim=True).clamp_min(1e-30)).to(torch.bfloat16)
    got = _run("mla_q_uproj_rope_quant_backward", dq, x, w, cos, sin)
    want = _run("mla_q_uproj_rope_quant_backward", dq, x, w, cos, sin, backend="torch")
    for name, a, b in zip(("dx", "dw"), got, want):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err <= BWD_BOUND, (name, err)


# --------------------------------------------------------------------------------------------------
# MXFP8 GEMM [4096 x 1536] x [24576 x 1536]
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_mxfp8_gemm_full(out_dtype):
    a, b = _exact_mx_operand(4096, seed=11), _exact_mx_operand(N, seed=12)
    got = _run("mxfp8_gemm", a, b, out_dtype)
    want = _run("mxfp8_gemm", a, b, out_dtype, backend="torch")
    assert_bytes_equal(got, want, "gemm vs torch")
    a_s = to_numpy(MXTensor(a.data[:128], a.scale[:128], 1, "e4m3"))
    b_s = to_numpy(MXTensor(b.data[:2048], b.scale[:2048], 1, "e4m3"))
    assert_bytes_equal(got[:128, :2048], spec.mxfp8_gemm(a_s, b_s, out_dtype), "gemm vs spec (slice)")


# --------------------------------------------------------------------------------------------------
# RoPE [T, 128, 192]: covered at 4096 by test_rope_triton.py; 16384 here (forward and backward)
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["rope", "rope_backward"])
def test_rope_16384(op):
    tokens = 16384
    x = _magnitudes((tokens, HEADS, D), seed=21)
    cos, sin = _tables(32768, seed=22)
    cu = torch.tensor([0, 3000, 3001, 9000, tokens], dtype=torch.int32, device=DEV)
    start = torch.tensor([0, 12000, 7, 100], dtype=torch.int32, device=DEV)
    for out_dtype in (None, "float32"):
        kw = dict(style="mla", cu_seqlens=cu, start_positions=start, out_dtype=out_dtype)
        got = _run(op, x, cos, sin, **kw)
        want = _run(op, x, cos, sin, backend="torch", **kw)
        assert_bytes_equal(got, want, f"{op} out={out_dtype} vs torch")
    # spec: the first sequence's first 256 tokens (positions 0..255), all heads
    ref = getattr(spec, op)(to_numpy(x[:SLICE_T]), to_numpy(cos), to_numpy(sin), style="mla",
                            positions=np.arange(SLICE_T), out_dtype="float32")
    got = _run(op, x, cos, sin, style="mla", cu_seqlens=cu, start_positions=start, out_dtype="float32")
    assert_bytes_equal(got[:SLICE_T], ref, f"{op} vs spec (slice)")


# --------------------------------------------------------------------------------------------------
# attention B=1 S=4096 H=128 causal, bf16 and MXFP8 inputs; 4 heads against spec
# --------------------------------------------------------------------------------------------------

BF16_BOUND, MX_BOUND, LSE_ABS_BOUND = 1e-2, 5e-2, 1e-3  # tests/conformance/test_attention.py states them
SPEC_HEADS = 4
ATT_S = 4096


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


@pytest.mark.parametrize("mx", [False, True], ids=["bf16", "mxfp8"])
def test_attention_full(mx):
    s = ATT_S
    g = _gen(31)
    q, k, v, do = (torch.randn(1, s, HEADS, d, device=DEV, generator=g).to(torch.bfloat16)
                   for d in (D, D, 128, 128))
    if mx:
        q, k = (_run("mxfp8_quantize", t, axis=-1, backend="torch") for t in (q, k))
        v = _run("mxfp8_quantize", v, axis=1, backend="torch")
    o, lse = _run("mla_attention", q, k, v, causal=True)
    assert o.shape == (1, s, HEADS, 128) and lse.shape == (1, HEADS, s)
    grads = _run("mla_attention_backward", do, q, k, v, o, lse, causal=True)

    def heads(t, n=SPEC_HEADS):
        if isinstance(t, MXTensor):  # q, k blocked along D; v along S: slicing heads keeps whole blocks
            return to_numpy(MXTensor(t.data[:, :, :n], t.scale[:, :, :n], t.axis, t.elem))
        return to_numpy(t[:, :, :n])

    q_s, k_s, v_s = heads(q), heads(k), heads(v)
    o_ref, lse_ref = spec.mla_attention(q_s, k_s, v_s, causal=True)
    bound = MX_BOUND if mx else BF16_BOUND
    assert _rel(to_numpy(o[:, :, :SPEC_HEADS]).astype(np.float64), o_ref.astype(np.float64)) <= bound
    assert np.abs(to_numpy(lse[:, :SPEC_HEADS]) - lse_ref).max() <= LSE_ABS_BOUND
    want = spec.mla_attention_backward(heads(do), q_s, k_s, v_s, heads(o), to_numpy(lse[:, :SPEC_HEADS]), causal=True)
    for name, got_g, ref_g in zip(("dq", "dk", "dv"), grads, want):
        assert got_g.dtype == torch.bfloat16
        err = _rel(to_numpy(got_g[:, :, :SPEC_HEADS]).astype(np.float64), ref_g.astype(np.float64))
        assert err <= bound, (name, err)
