"""mla_attention / mla_attention_backward on every backend against spec (SEMANTICS.md section 8).

Shapes are DeepSeek-V3's MLA heads (192 / 192 / 128) with B, S, H scaled down (B 1..2, S 64..256,
H 4..8), causal and not, odd sequence lengths, S_q != S_kv both ways, all three layouts.

Bounds (spec is the float64 reference rounded once to bf16 / fp32):
- o, bf16 inputs: relative Frobenius error <= 1e-2. A backend accumulating in fp32 is off by fp32
  rounding (~1e-6 relative) plus its own bf16 rounding of o (2^-9 relative per element); 1e-2 also
  leaves room for tensor-core kernels that keep P in bf16 before the P v product (2^-9 per term).
- lse: absolute error <= 1e-3 on finite rows. lse = max + log(sum), so its error is the absolute error
  of the fp32 scores: a 192-term fp32 dot product is off by ~ 192 * 2^-24 * sum|q_i k_i| * scale,
  about 1e-5 for the score magnitudes here (|S| <~ 50); 1e-3 covers any fp32-accumulating kernel.
  Fully masked rows must be exactly -inf, and their o exactly 0.
- MXFP8 inputs: <= 5e-2, the contract's bound, sized for cuDNN, which quantizes P to e4m3 with a
  fixed x16 scale before P v. The torch backend dequantizes exactly and keeps P in fp32, so it is held
  to the bf16 bound 1e-2.
- Backward dq, dk, dv: the same family (1e-2 bf16, 5e-2 MXFP8 except torch 1e-2) in relative
  Frobenius error. Every backend gets spec's o and lse, so only the backward itself is judged.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import spec
from spec.attention import SEQ_AXIS
from tests.conformance.conftest import run_on
from tests.util import BF16

torch = pytest.importorskip("torch")
from backends.convert import to_numpy, to_torch  # noqa: E402  (needs torch)

D_QK, D_V = 192, 128
BF16_BOUND = 1e-2
MX_BOUND = 5e-2
LSE_ABS_BOUND = 1e-3


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------

def _from_bshd(x, layout):
    if layout == "bshd":
        return np.ascontiguousarray(x)
    if layout == "sbhd":
        return np.ascontiguousarray(np.swapaxes(x, 0, 1))
    return np.ascontiguousarray(x.reshape(-1, *x.shape[2:]))  # thd: batch folded into tokens


def make_inputs(seed, b, s_q, s_kv, h, layout):
    """bf16 q, k, v in `layout` (thd: [B*S, H, D] of B equal-length sequences, unless the case gives
    its own cu_seqlens). Per-head magnitudes: q 1/4 .. 8 (soft to sharp softmax), v 2^-6 .. 2^6.
    Special rows: query 0 of head 0 is zero (uniform weights over the keys it sees); key 1 of head 1
    equals key 0 (tied scores); v of head 0 holds bf16 subnormals and -0.0 in its last features."""
    rng = np.random.default_rng(seed)
    q_mag = rng.choice([0.25, 1.0, 2.0, 8.0], size=h)
    q = rng.standard_normal((b, s_q, h, D_QK)) * q_mag[None, None, :, None]
    k = rng.standard_normal((b, s_kv, h, D_QK))
    v = rng.standard_normal((b, s_kv, h, D_V)) * 2.0 ** rng.integers(-6, 7, size=h)[None, None, :, None]
    q[:, 0, 0] = 0.0
    k[:, 1, 1 % h] = k[:, 0, 1 % h]
    tiny = float(ml_dtypes.finfo(BF16).smallest_subnormal)
    v[:, :, 0, -3:] = rng.integers(-100, 100, size=(b, s_kv, 3)) * tiny
    v[:, ::5, 0, -4] = -0.0
    do = rng.standard_normal((b, s_q, h, D_V)) * 0.5
    return [_from_bshd(x.astype(BF16), layout) for x in (q, k, v, do)]


def quantize_inputs(q, k, v, layout, swizzle_k=False):
    """MXFP8 e4m3 operands: q, k blocked along D, v along the sequence axis (spec.mxfp8_quantize)."""
    q_mx = spec.mxfp8_quantize(q, axis=-1)
    k_mx = spec.mxfp8_quantize(k, axis=-1, scale_layout="swizzled" if swizzle_k else "compact")
    v_mx = spec.mxfp8_quantize(v, axis=SEQ_AXIS[layout])
    return q_mx, k_mx, v_mx


def rel_fro(actual, expected):
    a = np.asarray(to_numpy(actual)).astype(np.float64)
    e = np.asarray(expected).astype(np.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    assert np.all(np.isfinite(a)), "non-finite values in the backend's output"
    return float(np.linalg.norm(a - e) / np.linalg.norm(e))


def check_forward(got, want, bound, what, layout):
    o, lse = got
    o_ref, lse_ref = want
    assert str(o.dtype) == "torch.bfloat16" and str(lse.dtype) == "torch.float32", (o.dtype, lse.dtype)
    err = rel_fro(o, o_ref)
    assert err <= bound, f"{what}: o relative Frobenius error {err:.2e} > {bound}"
    lse_np = to_numpy(lse)
    assert lse_np.shape == lse_ref.shape
    masked = lse_ref == -np.inf
    assert np.array_equal(lse_np == -np.inf, masked), f"{what}: fully masked rows differ"
    lse_err = float(np.max(np.abs(lse_np[~masked].astype(np.float64) - lse_ref[~masked]), initial=0.0))
    assert lse_err <= LSE_ABS_BOUND, f"{what}: lse abs error {lse_err:.2e} > {LSE_ABS_BOUND}"
    # o of a fully masked row is exactly 0: view o with lse's leading axes ([B,H,S] or thd [H,T]).
    perm = {"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3), "thd": (1, 0, 2)}[layout]
    o_rows = np.transpose(to_numpy(o).astype(np.float64), perm)
    assert np.all(o_rows[masked] == 0), f"{what}: fully masked rows of o are not 0"


def check_backward(got, want, bound, what):
    for name, g, g_ref in zip(("dq", "dk", "dv"), got, want):
        assert str(g.dtype) == "torch.bfloat16", (name, g.dtype)
        err = rel_fro(g, g_ref)
        assert err <= bound, f"{what}: {name} relative Frobenius error {err:.2e} > {bound}"


def mx_bound(target):
    backend, _ = target
    return BF16_BOUND if backend == "torch" else MX_BOUND


# --------------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------------

# (id, B, S_q, S_kv, H, causal, layout)
CASES = [
    ("bshd-64-h8", 1, 64, 64, 8, False, "bshd"),
    ("bshd-odd-causal", 2, 100, 100, 4, True, "bshd"),
    ("sbhd-sq<skv-causal", 2, 77, 130, 4, True, "sbhd"),
    ("bshd-sq>skv-causal", 1, 130, 77, 4, True, "bshd"),  # rows 0..52 fully masked
    ("sbhd-256", 1, 256, 256, 4, False, "sbhd"),
    ("thd-2x97-causal", 2, 97, 97, 4, True, "thd"),
]


def _kwargs(causal, layout, b, s_q, s_kv):
    kw = dict(causal=causal, layout=layout)
    if layout == "thd":
        kw["cu_seqlens_q"] = np.arange(0, b * s_q + 1, s_q, dtype=np.int32)
        kw["cu_seqlens_kv"] = np.arange(0, b * s_kv + 1, s_kv, dtype=np.int32)
    return kw


def _torch_kwargs(kw, device):
    return {k: to_torch(v, device) if isinstance(v, np.ndarray) else v for k, v in kw.items()}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_bf16(target, case):
    _, b, s_q, s_kv, h, causal, layout = case
    _, device = target
    q, k, v, _ = make_inputs(1, b, s_q, s_kv, h, layout)
    kw = _kwargs(causal, layout, b, s_q, s_kv)
    want = spec.mla_attention(q, k, v, **kw)
    got = run_on(target, "mla_attention", *to_torch([q, k, v], device), **_torch_kwargs(kw, device))
    check_forward(got, want, BF16_BOUND, case[0], layout)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_backward_bf16(target, case):
    _, b, s_q, s_kv, h, causal, layout = case
    _, device = target
    q, k, v, do = make_inputs(2, b, s_q, s_kv, h, layout)
    kw = _kwargs(causal, layout, b, s_q, s_kv)
    o, lse = spec.mla_attention(q, k, v, **kw)
    want = spec.mla_attention_backward(do, q, k, v, o, lse, **kw)
    got = run_on(target, "mla_attention_backward", *to_torch([do, q, k, v, o, lse], device),
                 **_torch_kwargs(kw, device))
    check_backward(got, want, BF16_BOUND, case[0])


def test_forward_softmax_scale(target):
    _, device = target
    q, k, v, _ = make_inputs(3, 1, 65, 90, 4, "bshd")
    want = spec.mla_attention(q, k, v, causal=True, softmax_scale=0.3)
    got = run_on(target, "mla_attention", *to_torch([q, k, v], device), causal=True, softmax_scale=0.3)
    check_forward(got, want, BF16_BOUND, "softmax_scale=0.3", "bshd")


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_thd(target, causal):
    """Unequal sequences, S_q != S_kv per sequence, one sequence with no keys (fully masked rows)."""
    _, device = target
    rng = np.random.default_rng(4)
    h = 4
    cu_q = np.array([0, 45, 128, 131, 200], dtype=np.int32)
    cu_kv = np.array([0, 60, 130, 130, 256], dtype=np.int32)
    q = (rng.standard_normal((200, h, D_QK)) * 2).astype(BF16)
    k = rng.standard_normal((256, h, D_QK)).astype(BF16)
    v = rng.standard_normal((256, h, D_V)).astype(BF16)
    do = rng.standard_normal((200, h, D_V)).astype(BF16)
    kw = dict(causal=causal, layout="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    want = spec.mla_attention(q, k, v, **kw)
    got = run_on(target, "mla_attention", *to_torch([q, k, v], device), **_torch_kwargs(kw, device))
    check_forward(got, want, BF16_BOUND, "varlen", "thd")
    assert np.all(to_numpy(got[0])[128:131] == 0)
    want_g = spec.mla_attention_backward(do, q, k, v, *want, **kw)
    got_g = run_on(target, "mla_attention_backward", *to_torch([do, q, k, v, *want], device),
                   **_torch_kwargs(kw, device))
    check_backward(got_g, want_g, BF16_BOUND, "varlen")


# MXFP8 cases: S_kv a multiple of 32 (v is blocked along S); S_q odd is fine (q is blocked along D).
MX_CASES = [
    ("bshd", 2, 75, 96, 4, True, "bshd", False),
    ("sbhd-swizzled-k", 1, 160, 160, 8, False, "sbhd", True),
    ("thd", 2, 64, 64, 4, True, "thd", False),
]


@pytest.mark.parametrize("case", MX_CASES, ids=[c[0] for c in MX_CASES])
def test_mxfp8_inputs(target, case):
    _, b, s_q, s_kv, h, causal, layout, swizzle_k = case
    _, device = target
    q, k, v, do = make_inputs(5, b, s_q, s_kv, h, layout)
    q_mx, k_mx, v_mx = quantize_inputs(q, k, v, layout, swizzle_k)
    kw = _kwargs(causal, layout, b, s_q, s_kv)
    want = spec.mla_attention(q_mx, k_mx, v_mx, **kw)
    mx_torch = to_torch([q_mx, k_mx, v_mx], device)
    got = run_on(target, "mla_attention", *mx_torch, **_torch_kwargs(kw, device))
    check_forward(got, want, mx_bound(target), f"mxfp8 {case[0]}", layout)
    want_g = spec.mla_attention_backward(do, q_mx, k_mx, v_mx, *want, **kw)
    got_g = run_on(target, "mla_attention_backward", to_torch(do, device), *mx_torch,
                   *to_torch(list(want), device), **_torch_kwargs(kw, device))
    check_backward(got_g, want_g, mx_bound(target), f"mxfp8 {case[0]}")


def test_validation_runs_before_the_backend(target):
    """The dispatcher runs spec's validators on torch arguments, so every backend fails the same way.
    (It checks shapes, dtypes and choices; the values of cu_seqlens are checked by spec only.)"""
    _, device = target
    q, k, v, _ = make_inputs(6, 1, 64, 64, 4, "thd")
    bad_cu = to_torch(np.array([0, 30, 40, 64], dtype=np.int64), device)
    with pytest.raises(TypeError, match="^cu_seqlens_q:"):
        run_on(target, "mla_attention", *to_torch([q, k, v], device), layout="thd",
               cu_seqlens_q=bad_cu, cu_seqlens_kv=to_torch(np.array([0, 64], np.int32), device))
    with pytest.raises(ValueError, match="^v:"):
        run_on(target, "mla_attention", *to_torch([q, k, q], device), layout="thd",
               cu_seqlens_q=bad_cu, cu_seqlens_kv=bad_cu)
