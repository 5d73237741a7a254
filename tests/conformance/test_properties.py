"""Property-based conformance (hypothesis): every op on every backend this machine has, against spec, on
drawn shapes, strides, dtypes, choices and special values.

Bounded for CI: derandomized (the same examples every run), a few examples per op and backend, tiny
shapes (the Triton backend runs in its interpreter on CPU); about a minute on two CPU cores. Bytes
wherever spec is bit-exact for the drawn inputs:
- quantize, dequantize, swizzle, unswizzle, RoPE: always (specials included);
- the GEMM and the fused mla_q forward / backward: on small-integer codes with power-of-two scales,
  where every product and partial sum is exact, so any summation order gives spec's bytes;
- RMSNorm: the quantization of the backend's own rstd (rsqrt may differ by an ulp), with rstd within
  (D + 12) * 2^-25 relative, the bound tests/conformance/test_rmsnorm.py derives;
- attention (float64 reference, one rounding): relative Frobenius error <= 1e-2, the contract's bf16
  bound (tests/conformance/test_attention.py); gradients relative to max(||reference||, ||do||).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spec
from spec.constants import NONFINITE_POLICIES, ROPE_STYLES, SCALE_MODES
from tests.conformance.conftest import run_on
from tests.test_gemm import small_int_operand
from tests.util import BF16, assert_bytes_equal, special_values_f32

torch = pytest.importorskip("torch")
from backends.convert import to_numpy, to_torch  # noqa: E402

HEAD = 192
CPU_TARGETS = [("torch", "cpu"), ("triton", "cpu")]
FLOATS = {"float32": np.float32, "bfloat16": BF16, "float16": np.float16}


def _bounded(n):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


@pytest.fixture(params=CPU_TARGETS + [("torch", "cuda"), ("triton", "cuda"), ("cudnn", "cuda")],
                ids=lambda t: f"{t[0]}-{t[1]}")
def target(request):
    from tests.conformance.conftest import skip_reason

    reason = skip_reason(*request.param)
    if reason:
        pytest.skip(reason)
    return request.param


def _values(rng, shape, dtype, specials):
    """Normal data at a drawn magnitude per row, plus (optionally) special values at random places."""
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-20, 21, size=shape[:-1] + (1,))
    x = x.astype(np.float32)
    if specials and x.size:
        sv = special_values_f32()
        where = rng.random(shape) < 0.1
        x[where] = rng.choice(sv, size=int(where.sum()))
    with np.errstate(over="ignore"):
        return x.astype(FLOATS[dtype])


def _strided(t, how):
    """The same values as torch tensor t in another memory layout (backends must honour strides)."""
    if how == "transposed" and t.dim() == 2:
        return t.t().contiguous().t()
    if how == "sliced":
        wide = torch.empty(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype, device=t.device)
        wide[..., 1::2] = t
        return wide[..., 1::2]
    return t


def _check_mx(got, want, what):
    assert (got.axis, got.elem, got.scale_layout) == (want.axis, want.elem, want.scale_layout), what
    assert_bytes_equal(got.data, want.data, f"{what} data")
    assert_bytes_equal(got.scale, want.scale, f"{what} scale")


# --------------------------------------------------------------------------------------------------
# quantize / dequantize / swizzle: bytes, specials included
# --------------------------------------------------------------------------------------------------
quantize_case = st.fixed_dictionaries({
    "rows": st.sampled_from([1, 3, 32, 40]), "blocks": st.integers(1, 3), "dtype": st.sampled_from(list(FLOATS)),
    "axis": st.sampled_from([-1, 0, (1, 0)]), "elem": st.sampled_from(["e4m3", "e5m2"]),
    "scale_mode": st.sampled_from(SCALE_MODES), "nonfinite": st.sampled_from(NONFINITE_POLICIES),
    "scale_layout": st.sampled_from(["compact", "swizzled"]), "layout": st.sampled_from(["plain", "transposed", "sliced"]),
    "specials": st.booleans(), "seed": st.integers(0, 2**31),
})


@_bounded(25)
@given(case=quantize_case)
def test_quantize_dequantize_swizzle_bytes(target, case):
    rng = np.random.default_rng(case["seed"])
    rows = case["rows"] if case["axis"] == -1 else 32 * max(1, case["rows"] // 32)
    x = _values(rng, (rows, 32 * case["blocks"]), case["dtype"], case["specials"])
    kw = {k: case[k] for k in ("axis", "elem", "scale_mode", "nonfinite", "scale_layout")}
    want = spec.mxfp8_quantize(x, **kw)
    got = run_on(target, "mxfp8_quantize", _strided(to_torch(x, target[1]), case["layout"]), **kw)
    wants, gots = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    for g, w in zip(gots, wants):
        _check_mx(g, w, f"quantize {case}")
        out_dtype = "bfloat16" if case["seed"] % 2 else "float32"
        assert_bytes_equal(run_on(target, "mxfp8_dequantize", g, out_dtype=out_dtype),
                           spec.mxfp8_dequantize(w, out_dtype), "dequantize")
        if w.scale_layout == "swizzled":
            _check_mx(run_on(target, "unswizzle_scales", g), spec.unswizzle_scales(w), "unswizzle")
        else:
            _check_mx(run_on(target, "swizzle_scales", g), spec.swizzle_scales(w), "swizzle")


# --------------------------------------------------------------------------------------------------
# RoPE forward and backward: bytes
# --------------------------------------------------------------------------------------------------
rope_case = st.fixed_dictionaries({
    "tokens": st.integers(1, 12), "heads": st.integers(1, 3), "keep": st.sampled_from([0, 8, 32]),
    "rope_dim": st.sampled_from([2, 8, 32]), "style": st.sampled_from(ROPE_STYLES),
    "dtype": st.sampled_from(list(FLOATS)), "table": st.sampled_from(["float32", "bfloat16"]),
    "out_dtype": st.sampled_from([None, "float32", "bfloat16"]), "index": st.sampled_from(["none", "positions", "cu"]),
    "backward": st.booleans(), "sliced": st.booleans(), "specials": st.booleans(), "seed": st.integers(0, 2**31),
})


@_bounded(30)
@given(case=rope_case)
def test_rope_bytes(target, case):
    rng = np.random.default_rng(case["seed"])
    t, h, r = case["tokens"], case["heads"], case["rope_dim"]
    x = _values(rng, (t, h, case["keep"] + r), case["dtype"], case["specials"])
    rows = t + 4
    cos = np.cos(rng.uniform(-4, 4, (rows, r))).astype(FLOATS[case["table"]])
    sin = np.sin(rng.uniform(-4, 4, (rows, r))).astype(FLOATS[case["table"]])
    kw = {"style": case["style"], "out_dtype": case["out_dtype"]}
    if case["index"] == "positions":
        kw["positions"] = rng.integers(0, rows, size=t).astype(np.int32)
    elif case["index"] == "cu":
        cut = int(rng.integers(0, t + 1))
        kw["cu_seqlens"] = np.array([0, cut, t], dtype=np.int32)
    op = "rope_backward" if case["backward"] else "rope"
    want = getattr(spec, op)(x, cos, sin, **kw)
    dev = target[1]
    tkw = {k: (to_torch(v, dev) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    xt = to_torch(x, dev)
    if case["sliced"]:
        xt = _strided(xt, "sliced")
    got = run_on(target, op, xt, to_torch(cos, dev), to_torch(sin, dev), **tkw)
    assert_bytes_equal(got, want, f"{op} {case}")


# --------------------------------------------------------------------------------------------------
# GEMM and the fused mla_q op: bytes on exact-arithmetic inputs
# --------------------------------------------------------------------------------------------------
gemm_case = st.fixed_dictionaries({
    "m": st.integers(1, 40), "n": st.integers(1, 40), "kb": st.integers(1, 3),
    "b_elem": st.sampled_from(["e4m3", "e5m2"]), "out_dtype": st.sampled_from(["float32", "bfloat16"]),
    "swizzled": st.booleans(), "seed": st.integers(0, 2**31),
})


@_bounded(15)
@given(case=gemm_case)
def test_gemm_exact_bytes(target, case):
    rng = np.random.default_rng(case["seed"])
    a = small_int_operand(rng, case["m"], 32 * case["kb"])
    b = small_int_operand(rng, case["n"], 32 * case["kb"], elem=case["b_elem"])
    want = spec.mxfp8_gemm(a, b, case["out_dtype"])
    if case["swizzled"]:
        a, b = spec.swizzle_scales(a), spec.swizzle_scales(b)
    dev = target[1]
    got = run_on(target, "mxfp8_gemm", to_torch(a, dev), to_torch(b, dev), out_dtype=case["out_dtype"])
    assert_bytes_equal(got, want, f"gemm {case}")


def _small_ints(rng, shape, scale):
    return (rng.integers(-3, 4, size=shape) * scale).astype(BF16)


mla_q_case = st.fixed_dictionaries({
    "tokens": st.sampled_from([32, 64]), "k": st.sampled_from([32, 64]), "heads": st.integers(1, 2),
    "table": st.sampled_from(["float32", "bfloat16"]), "backward": st.booleans(), "seed": st.integers(0, 2**31),
})


@_bounded(8)
@given(case=mla_q_case)
def test_mla_q_exact_bytes(target, case):
    # x, w, dq: integers in [-3, 3] (w, dq scaled by 2^-4): every product and partial sum of the
    # projection and of both backward GEMMs is exact in fp32, in any order.
    rng = np.random.default_rng(case["seed"])
    t, k, h = case["tokens"], case["k"], case["heads"]
    x = _small_ints(rng, (t, k), 1.0)
    w = _small_ints(rng, (h * HEAD, k), 2.0 ** -4)
    cos = np.cos(rng.uniform(-4, 4, (t, 64))).astype(FLOATS[case["table"]])
    sin = np.sin(rng.uniform(-4, 4, (t, 64))).astype(FLOATS[case["table"]])
    dev = target[1]
    args = [to_torch(a, dev) for a in (x, w, cos, sin)]
    if case["backward"]:
        dq = _small_ints(rng, (t, h, HEAD), 2.0 ** -4)
        want = spec.mla_q_uproj_rope_quant_backward(dq, x, w, cos, sin)
        got = run_on(target, "mla_q_uproj_rope_quant_backward", to_torch(dq, dev), *args)
        assert_bytes_equal(got[0], want[0], "dx")
        assert_bytes_equal(got[1], want[1], "dw")
    else:
        want = spec.mla_q_uproj_rope_quant(x, w, cos, sin)
        got = run_on(target, "mla_q_uproj_rope_quant", *args)
        _check_mx(got[0], want[0], "q_row")
        _check_mx(got[1], want[1], "q_col")


# --------------------------------------------------------------------------------------------------
# RMSNorm: the quantization of the backend's rstd, bytes; rstd within the derived bound
# --------------------------------------------------------------------------------------------------
rms_case = st.fixed_dictionaries({
    "rows": st.sampled_from([32, 64]), "d": st.sampled_from([32, 64, 96]), "dtype": st.sampled_from(list(FLOATS)),
    "zero_centered": st.booleans(), "elem": st.sampled_from(["e4m3", "e5m2"]), "seed": st.integers(0, 2**31),
})


@_bounded(12)
@given(case=rms_case)
def test_rmsnorm_own_rstd_bytes(target, case):
    rng = np.random.default_rng(case["seed"])
    x = (rng.standard_normal((case["rows"], case["d"])) * 2.0 ** rng.integers(-8, 9, size=(case["rows"], 1)))
    x = x.astype(FLOATS[case["dtype"]])
    gamma = rng.standard_normal(case["d"]).astype(BF16)
    kw = dict(eps=1e-5, zero_centered_gamma=case["zero_centered"], elem=case["elem"])
    want = spec.rmsnorm_mxfp8(x, gamma, **kw)
    dev = target[1]
    y_row, y_col, rstd = run_on(target, "rmsnorm_mxfp8", to_torch(x, dev), to_torch(gamma, dev), **kw)
    rstd = to_numpy(rstd)
    bound = (case["d"] + 12) * 2.0 ** -25 * np.abs(want[2].astype(np.float64))
    assert np.all(np.abs(rstd.astype(np.float64) - want[2]) <= bound)
    g = gamma.astype(np.float32) + (np.float32(1) if case["zero_centered"] else np.float32(0))
    y = (x.astype(np.float32) * rstd[:, None]) * g[None, :]
    for got, axis in ((y_row, 1), (y_col, 0)):
        _check_mx(got, spec.mxfp8_quantize(y, axis=axis, elem=case["elem"]), f"y axis {axis}")


# --------------------------------------------------------------------------------------------------
# attention: the bf16 bound
# --------------------------------------------------------------------------------------------------
attention_case = st.fixed_dictionaries({
    "b": st.integers(1, 2), "s_q": st.integers(1, 12), "s_kv": st.integers(1, 12), "h": st.integers(1, 2),
    "causal": st.booleans(), "layout": st.sampled_from(["bshd", "sbhd"]), "backward": st.booleans(),
    "seed": st.integers(0, 2**31),
})


def _rel_fro(got, want, floor=0.0):
    """||got - want|| / max(||want||, floor): floor keeps a reference that cancels to 0 (one key: P = 1,
    so dS = P (dP - D) = 0) from turning the kernel's fp32 rounding residue into an infinite error."""
    got, want = to_numpy(got).astype(np.float64), np.asarray(want).astype(np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), floor, 1e-30))


@_bounded(10)
@given(case=attention_case)
def test_attention_within_bf16_bound(target, case):
    rng = np.random.default_rng(case["seed"])
    b, sq, skv, h = case["b"], case["s_q"], case["s_kv"], case["h"]

    def make(s, d):
        x = rng.standard_normal((b, s, h, d)).astype(BF16)
        return x if case["layout"] == "bshd" else np.ascontiguousarray(x.transpose(1, 0, 2, 3))

    q, k, v = make(sq, 192), make(skv, 192), make(skv, 128)
    kw = dict(causal=case["causal"], layout=case["layout"])
    dev = target[1]
    tq, tk, tv = (to_torch(a, dev) for a in (q, k, v))
    want_o, want_lse = spec.mla_attention(q, k, v, **kw)
    got_o, got_lse = run_on(target, "mla_attention", tq, tk, tv, **kw)
    assert _rel_fro(got_o, want_o) <= 1e-2
    finite = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(to_numpy(got_lse)), finite)
    assert np.all(np.abs(to_numpy(got_lse)[finite] - want_lse[finite]) <= 1e-2 * np.maximum(1, np.abs(want_lse[finite])))
    if case["backward"]:
        do = rng.standard_normal(want_o.shape).astype(BF16)
        o = want_o.astype(BF16)
        want = spec.mla_attention_backward(do, q, k, v, o, want_lse, **kw)
        got = run_on(target, "mla_attention_backward", to_torch(do, dev), tq, tk, tv, to_torch(o, dev),
                     to_torch(want_lse, dev), **kw)
        floor = float(np.linalg.norm(do.astype(np.float64)))
        for g, w, name in zip(got, want, ("dq", "dk", "dv")):
            assert _rel_fro(g, w, floor) <= 1e-2, name
