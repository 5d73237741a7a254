"""The fast routes of the Triton mla_q op and their exact fallbacks, against spec's bytes.

- MXFP8 backward ("dequantized" route): the pre-pass writes the bf16 dequantization of both
  quantizations of g, two bf16 GEMMs follow, and a device-side guard sends the op to the exact path
  (gated pre-pass writing codes + exact block GEMMs). Checked: the guard stays down on an all-zero token
  row (rceil scale byte 0 over zero codes: exact in bf16), and goes up -- with spec's bytes from the
  fallback -- for a gradient past the bf16-safe scale range, a NaN gradient and an MXFP8 weight whose
  scale bytes leave that range; bf16 and MXFP8 x / w; a K-major (transposed) weight copy.
- The flat dequantize's guard exempts zero codes and flags a nonzero code under an unsafe scale byte.
- MXFP8 forward's exact fallback (the gated pointer kernel behind the dequantized Gluon route): a no-op
  while the flag is down, spec's bytes when it is up (the Gluon kernels themselves run on CUDA only).
Outputs are poisoned (0xFF) so an unwritten byte fails; inputs are exact-arithmetic (any fp32 summation
order gives spec's sum) so the comparisons are bytes.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import spec
from tests.test_mla_q import exact_case
from tests.util import BF16, assert_bytes_equal, poisoned_empty

torch = pytest.importorskip("torch")
from backends.convert import to_torch  # noqa: E402
from spec.mxtensor import MXTensor  # noqa: E402

D = 192
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture
def mla(monkeypatch, triton_target):
    import backends.triton.gemm as gemm_mod
    import backends.triton.mla_q as mod

    monkeypatch.setattr(mod, "_empty", poisoned_empty)
    monkeypatch.setattr(gemm_mod, "_empty", poisoned_empty)
    return mod, triton_target[1]


@pytest.fixture
def flags(monkeypatch):
    """Records the guard flag's value at each exact-fallback launch of the backward (a host read, test only)."""
    import backends.triton.mla_q as mod

    seen = []
    real = mod.exact_fallback

    def spy(a, b, out, flag):
        seen.append(int(flag.item()))
        return real(a, b, out, flag)

    monkeypatch.setattr(mod, "exact_fallback", spy)
    return seen


def _rng(*parts):
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def _case(tag, tokens=64, k=64, heads=2):
    rng = _rng(tag)
    x, w, cos, sin, _, _, _ = exact_case(rng, tokens=tokens, k=k, heads=heads)
    dq = rng.choice([0.0, 1.0, -1.0, 0.5], size=(tokens, heads, D), p=[0.7, 0.1, 0.1, 0.1])
    dq[0] = 0.0  # a fully masked query row: its gradient is zero
    return x.astype(BF16), w.astype(BF16), cos.astype(np.float32), sin.astype(np.float32), dq


def _run_backward(mod, device, dq, x, w, cos, sin):
    args = [to_torch(a, device) for a in (dq.astype(BF16), x, w, cos, sin)]
    return mod.mla_q_backward_launch(*args, quantize_grad=True)


def _check(got, want):
    assert_bytes_equal(got[0], want[0], "dx")
    assert_bytes_equal(got[1], want[1], "dw")


@pytest.mark.parametrize("kind", ["bf16", "mxfp8"])
def test_backward_zero_rows_stay_on_the_fast_path(mla, flags, kind):
    mod, device = mla
    x, w, cos, sin, dq = _case("zero-rows")
    if kind == "mxfp8":
        x, w = spec.mxfp8_quantize(x, axis=0), spec.mxfp8_quantize(w, axis=0)
    want = spec.mla_q_uproj_rope_quant_backward(dq.astype(BF16), x, w, cos, sin, True)
    _check(_run_backward(mod, device, dq, x, w, cos, sin), want)
    assert flags == [0, 0], "an all-zero block (scale byte 0, zero codes) must not raise the guard"


@pytest.mark.parametrize("case", ["inf", "tiny", "nan"])
def test_backward_guard_falls_back_to_spec_bytes(mla, flags, case):
    # inf: an Inf gradient (amax Inf: scale byte 254 > 246; bf16 gradients never reach it otherwise);
    # tiny: blocks of 2^-110 (rceil byte 9 < 10 over nonzero codes);
    # nan: a NaN gradient (its block's amax ignores it; its code is NaN, the value not finite)
    mod, device = mla
    x, w, cos, sin, dq = _case("guard-" + case)
    if case == "tiny":  # whole row and column blocks (a lone tiny value would round to code 0)
        # and nothing else, so that every fp32 sum stays exact (a tiny term beside +-1 ones would be
        # lost by any fp32 accumulation but not by spec's exact sum)
        dq[:] = 0.0
        dq[:, 1, :32] = 2.0 ** -110 * np.sign(_rng("tiny-signs").standard_normal((64, 32)))
        # w times 2^6 keeps the exact GEMM's scale products normal in fp32 (2^(9-127) * 2^(e_w-127)):
        # Triton's interpreter loses subnormal scale products (its exact kernel then returns 0)
        w = (w.astype(np.float32) * 64.0).astype(BF16)
    else:
        dq[5, 1, 7] = {"inf": np.inf, "nan": np.nan}[case]
    want = spec.mla_q_uproj_rope_quant_backward(dq.astype(BF16), x, w, cos, sin, True)
    got = _run_backward(mod, device, dq, x, w, cos, sin)
    assert flags == [1, 1]
    if case == "nan" and device == "cpu":
        # under Triton's interpreter the exact block GEMM turns NaN codes into finite sums (observed: the
        # mxfp8_gemm route gives the same wrong bytes), so bytes are compared on CUDA only
        return
    _check(got, want)


def test_backward_unsafe_mx_weight_and_k_major_copy(mla, flags):
    # w's columnwise MXFP8 copy with a block at 2^-122 (scale byte 7): the guard sends the op to the exact
    # path; the same weight held K-major (codes [K, N] contiguous, as the weight cache stores it) gives
    # the same bytes, and so does a safe K-major copy on the fast path.
    mod, device = mla
    x, w, cos, sin, dq = _case("unsafe-w")
    w = w.astype(np.float32)
    w[:32, 3] = w[:32, 3] * 2.0 ** -120
    w[32:, 3] = 0.0  # dx[:, 3] then sums tiny terms only: exact in fp32, as spec's sum
    w = w.astype(BF16)
    xm, wm = spec.mxfp8_quantize(x, axis=0), spec.mxfp8_quantize(w, axis=0)
    want = spec.mla_q_uproj_rope_quant_backward(dq.astype(BF16), xm, wm, cos, sin, True)
    args = [to_torch(a, device) for a in (dq.astype(BF16), xm, wm, cos, sin)]
    _check(mod.mla_q_backward_launch(*args, quantize_grad=True), want)
    wt = args[2]
    k_major = MXTensor(wt.data.t().contiguous().t(), wt.scale.t().contiguous().t(), 0, "e4m3", "compact")
    assert not k_major.data.is_contiguous() and k_major.data.t().is_contiguous()
    _check(mod.mla_q_backward_launch(args[0], args[1], k_major, args[3], args[4], quantize_grad=True), want)
    assert flags == [1, 1, 1, 1]


def test_flat_dequantize_guard_exempts_zero_codes(triton_target):
    from backends.triton.quantize import dequantize_bf16_flat

    device = triton_target[1]
    codes = torch.zeros((4, 64), dtype=torch.uint8)
    codes[2, 40] = 0x38  # 1.0 in e4m3
    scales = torch.full((4, 2), 127, dtype=torch.uint8)
    scales[0, 0] = 0    # all-zero block under byte 0: exact zeros
    scales[1, 1] = 255  # all-zero block under the NaN byte: 0 * NaN is not finite -> flagged below
    t = lambda sc: MXTensor(codes.view(torch.float8_e4m3fn).to(device), sc.to(device), 1, "e4m3", "compact")  # noqa: E731
    ok = scales.clone()
    ok[1, 1] = 127
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    dequantize_bf16_flat(t(ok), guard=(flag, 10, 246))
    assert int(flag.item()) == 0
    dequantize_bf16_flat(t(scales), guard=(flag, 10, 246))
    assert int(flag.item()) == 1
    bad = ok.clone()
    bad[2, 1] = 5  # a nonzero code under byte 5
    flag.zero_()
    dequantize_bf16_flat(t(bad), guard=(flag, 10, 246))
    assert int(flag.item()) == 1


@pytest.mark.parametrize("raised", [False, True])
def test_forward_gated_fallback(mla, raised):
    mod, device = mla
    rng = _rng("fwd-gate")
    x, w, cos, sin, _, _, hexp = exact_case(rng, tokens=64, k=64, heads=2)
    xm = spec.mxfp8_quantize(x.astype(BF16), axis=1)
    wm = spec.mxfp8_quantize(w.astype(BF16), axis=1)
    cos, sin = cos.astype(np.float32), sin.astype(np.float32)
    want = spec.mla_q_uproj_rope_quant(xm, wm, cos, sin)
    xt, wt, ct, st = (to_torch(a, device) for a in (xm, wm, cos, sin))
    outs = (poisoned_empty((64, 2, D), torch.float8_e4m3fn, device), poisoned_empty((64, 2, 6), torch.uint8, device),
            poisoned_empty((64, 2, D), torch.float8_e4m3fn, device), poisoned_empty((2, 2, D), torch.uint8, device))
    flag = torch.full((1,), int(raised), dtype=torch.int32, device=device)
    cfg = mod._interpret_config() if device == "cpu" else dict(mod._FWD_DEFAULT[True])
    cfg["ROPE_SPLIT"] = True
    mod._launch_triton(xt, wt, ct, st, outs, cfg, "pointer", "full", gate=flag)
    if raised:
        assert_bytes_equal(outs[0], want[0].data, "q_row codes")
        assert_bytes_equal(outs[1], want[0].scale, "q_row scales")
        assert_bytes_equal(outs[2], want[1].data, "q_col codes")
        assert_bytes_equal(outs[3], want[1].scale, "q_col scales")
    else:
        assert all(bool((o.view(torch.uint8) == 0xFF).all()) for o in outs), "a gated launch wrote output"
