"""The fast routes of the Triton mla_q op and their exact fallbacks, against spec's bytes.

- MXFP8 backward ("dequantized" route): the pre-pass writes the bf16 dequantization of both
  quantizations of g, two bf16 GEMMs follow, and a device-side guard sends the op to the exact path
  (gated pre-pass writing codes + exact block GEMMs). Checked: the guard stays down on an all-zero token
  row (rceil scale byte 0 over zero codes: exact in bf16), and goes up -- with spec's bytes from the
  fallback -- for a gradient past the bf16-safe scale range, a NaN gradient and an MXFP8 weight whose
  scale bytes leave that range; bf16 and MXFP8 x / w; a K-major (transposed) weight copy.
- The backward pre-pass's bf16 outputs byte-equal to spec's dequantization of both quantizations of g
  (specials, tiny scales, RoPE; both pre-pass kernels) and its guard, down at the tie that rounds to
  the zero code under an unsafe scale byte and up one ulp above; its rounding to the e4m3 grid (_mxfp8.e4m3_value) bit-equal
  to encode-then-decode and to ml_dtypes' saturating cast on random fp32 bit patterns and every tie.
- The flat dequantize's guard exempts zero codes and flags a nonzero code under an unsafe scale byte.
- MXFP8 forward's exact fallback (the gated pointer kernel behind the dequantized Gluon route): a no-op
  while the flag is down, spec's bytes when it is up (the Gluon kernels themselves run on CUDA only).
Outputs are poisoned (0xFF) so an unwritten byte fails; inputs are exact-arithmetic (any fp32 summation
order gives spec's sum) so the comparisons are bytes.
"""
from __future__ import annotations

import numpy as np
import pytest

import spec
from tests.conformance.mla_q_backward_cases import D, backward_case, case_rng, check_dx_dw
from tests.test_mla_q import exact_case
from tests.util import BF16, assert_bytes_equal, poisoned_empty, random_magnitudes

torch = pytest.importorskip("torch")
pytest.importorskip("triton")  # every test here is of the Triton backend
from backends.convert import to_torch  # noqa: E402
from spec.mxtensor import MXTensor  # noqa: E402

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


def _run_backward(mod, device, dq, x, w, cos, sin):
    args = [to_torch(a, device) for a in (dq.astype(BF16), x, w, cos, sin)]
    return mod.mla_q_backward_launch(*args, quantize_grad=True)


@pytest.mark.parametrize("kind", ["bf16", "mxfp8"])
def test_backward_zero_rows_stay_on_the_fast_path(mla, flags, kind):
    mod, device = mla
    x, w, cos, sin, dq = backward_case("zero-rows")
    if kind == "mxfp8":
        x, w = spec.mxfp8_quantize(x, axis=0), spec.mxfp8_quantize(w, axis=0)
    want = spec.mla_q_uproj_rope_quant_backward(dq.astype(BF16), x, w, cos, sin, True)
    check_dx_dw(_run_backward(mod, device, dq, x, w, cos, sin), want)
    assert flags == [0, 0], "an all-zero block (scale byte 0, zero codes) must not raise the guard"


@pytest.mark.parametrize("case", ["inf", "tiny", "nan"])
def test_backward_guard_falls_back_to_spec_bytes(mla, flags, case):
    # inf: an Inf gradient (amax Inf: scale byte 254 > 246; bf16 gradients never reach it otherwise);
    # tiny: blocks of 2^-110 (rceil byte 9 < 10 over nonzero codes);
    # nan: a NaN gradient (its block's amax ignores it; its code is NaN, the value not finite)
    mod, device = mla
    x, w, cos, sin, dq = backward_case("guard-" + case)
    if case == "tiny":  # whole row and column blocks (a lone tiny value would round to code 0)
        # and nothing else, so that every fp32 sum stays exact (a tiny term beside +-1 ones would be
        # lost by any fp32 accumulation but not by spec's exact sum)
        dq[:] = 0.0
        dq[:, 1, :32] = 2.0 ** -110 * np.sign(case_rng("tiny-signs").standard_normal((64, 32)))
        # w times 2^6 keeps the exact GEMM's scale products normal in fp32 (2^(9-127) * 2^(e_w-127)):
        # Triton's interpreter loses subnormal scale products (its exact kernel then returns 0)
        w = (w.astype(np.float32) * 64.0).astype(BF16)
    else:
        dq[5, 1, 7] = {"inf": np.inf, "nan": np.nan}[case]
    want = spec.mla_q_uproj_rope_quant_backward(dq.astype(BF16), x, w, cos, sin, True)
    got = _run_backward(mod, device, dq, x, w, cos, sin)
    assert flags == [1, 1]
    if case == "nan" and device == "cpu":
        # under Triton's interpreter the exact block GEMM turns NaN codes into finite sums, so bytes are
        # compared on CUDA only
        return
    check_dx_dw(got, want)


@pytest.mark.parametrize("kept", ["0", "1"])
def test_backward_unsafe_mx_weight_and_k_major_copy(mla, flags, monkeypatch, kept):
    # w's columnwise MXFP8 copy with a block at 2^-122 (scale byte 7): the guard sends the op to the exact
    # path; the same weight held K-major (codes [K, N] contiguous, as the weight cache stores it) gives
    # the same bytes, and so does a safe K-major copy on the fast path.
    mod, device = mla
    monkeypatch.setenv("MXMLA_TRITON_WEIGHT_BF16", kept)
    mod.clear_weight_bf16()
    x, w, cos, sin, dq = backward_case("unsafe-w")
    w = w.astype(np.float32)
    w[:32, 3] = w[:32, 3] * 2.0 ** -120
    w[32:, 3] = 0.0  # dx[:, 3] then sums tiny terms only: exact in fp32, as spec's sum
    w = w.astype(BF16)
    xm, wm = spec.mxfp8_quantize(x, axis=0), spec.mxfp8_quantize(w, axis=0)
    want = spec.mla_q_uproj_rope_quant_backward(dq.astype(BF16), xm, wm, cos, sin, True)
    args = [to_torch(a, device) for a in (dq.astype(BF16), xm, wm, cos, sin)]
    check_dx_dw(mod.mla_q_backward_launch(*args, quantize_grad=True), want)
    wt = args[2]
    k_major = MXTensor(wt.data.t().contiguous().t(), wt.scale.t().contiguous().t(), 0, "e4m3", "compact")
    assert not k_major.data.is_contiguous() and k_major.data.t().is_contiguous()
    check_dx_dw(mod.mla_q_backward_launch(args[0], args[1], k_major, args[3], args[4], quantize_grad=True), want)
    assert flags == [1, 1, 1, 1]
    # the same weight MXTensors again: with kept copies (kept="1") their dequantizations and the guard's
    # verdict on them come from the copies (the exact path still runs)
    check_dx_dw(mod.mla_q_backward_launch(*args, quantize_grad=True), want)
    check_dx_dw(mod.mla_q_backward_launch(args[0], args[1], k_major, args[3], args[4], quantize_grad=True), want)
    assert flags == [1] * 8


def _mx_weight(device, tag="kept"):
    w = case_rng(tag).standard_normal((384, 64)).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block (scale byte 0)
    return to_torch(spec.mxfp8_quantize(w.astype(BF16), axis=1), device)


def test_weight_bf16_kept_per_weight_and_remade_when_written(mla, monkeypatch):
    from backends.triton.quantize import dequantize_bf16_flat

    mod, device = mla
    monkeypatch.setenv("MXMLA_TRITON_WEIGHT_BF16", "1")
    mod.clear_weight_bf16()
    w = _mx_weight(device)
    w16, flag, _ = mod._weight_bf16(w)
    fresh = lambda t: dequantize_bf16_flat(t, guard=(torch.zeros(1, dtype=torch.int32, device=device), 10, 246))  # noqa: E731
    assert_bytes_equal(w16.view(torch.int16).cpu(), fresh(w).view(torch.int16).cpu(), "kept copy")
    assert int(flag.item()) == 0
    # the same codes seen through new views (as the autograd layer hands them) find the kept copy; the flag
    # is a fresh tensor each call (the op's kernels raise it)
    again = MXTensor(w.data.view(torch.uint8).view(torch.float8_e4m3fn), w.scale, 1, "e4m3", "compact")
    w16b, flag_b, _ = mod._weight_bf16(again)
    assert w16b is w16 and flag_b is not flag
    # codes written in place: remade, with the new values
    w.data.view(torch.uint8)[5, 3] ^= 0x08
    w16c, _, _ = mod._weight_bf16(w)
    assert w16c is not w16
    assert_bytes_equal(w16c.view(torch.int16).cpu(), fresh(w).view(torch.int16).cpu(), "after a codes write")
    # a scale byte written in place (now outside the bf16-safe range over nonzero codes): remade, flag up
    w.scale[7, 1] = 3
    w16d, flag_d, _ = mod._weight_bf16(w)
    assert w16d is not w16c and int(flag_d.item()) == 1
    # switched off: dequantized on every call
    monkeypatch.setenv("MXMLA_TRITON_WEIGHT_BF16", "0")
    assert mod._weight_bf16(w)[0] is not mod._weight_bf16(w)[0]


@pytest.mark.parametrize("kept", ["0", "1"])
def test_weight_bf16_dequantizes_also_on_the_same_flag(mla, monkeypatch, kept):
    # x rides along in w's launch (a miss) or in its own (a kept hit): the bytes of its own guarded flat
    # pass either way, and an x scale byte outside the bf16-safe range raises the flag w's call returns
    from backends.triton.quantize import dequantize_bf16_flat

    mod, device = mla
    monkeypatch.setenv("MXMLA_TRITON_WEIGHT_BF16", kept)
    mod.clear_weight_bf16()
    w = _mx_weight(device, "also")
    rng = np.random.default_rng(5)
    x = to_torch(spec.mxfp8_quantize(random_magnitudes(rng, (64, 256)).astype(BF16), axis=1), device)
    fresh = lambda t: dequantize_bf16_flat(t, guard=(torch.zeros(1, dtype=torch.int32, device=device), 10, 246))  # noqa: E731
    for call in ("first", "second"):
        w16, flag, (x16,) = mod._weight_bf16(w, also=(x,))
        assert_bytes_equal(w16.view(torch.int16).cpu(), fresh(w).view(torch.int16).cpu(), f"{call}: w")
        assert_bytes_equal(x16.view(torch.int16).cpu(), fresh(x).view(torch.int16).cpu(), f"{call}: x")
        assert int(flag.item()) == 0, call
    bad = MXTensor(x.data, x.scale.clone(), 1, "e4m3", "compact")
    bad.scale[0, 0] = 2
    bad.data.view(torch.uint8)[0, 0] = 0x38  # a nonzero code under the unsafe byte
    _, flag, _ = mod._weight_bf16(w, also=(bad,))
    assert int(flag.item()) == 1


def test_weight_bf16_does_not_keep_codes_alive(mla, monkeypatch):
    import gc

    mod, device = mla
    monkeypatch.setenv("MXMLA_TRITON_WEIGHT_BF16", "1")
    mod.clear_weight_bf16()
    w = _mx_weight(device, "alive")
    mod._weight_bf16(w)
    (key,) = mod._WEIGHT_BF16
    del w
    gc.collect()
    assert key.expired(), "a kept copy must not keep the codes' memory"
    mod._weight_bf16(_mx_weight(device, "next"))  # a miss drops the entries of codes that are gone
    assert key not in mod._WEIGHT_BF16 and len(mod._WEIGHT_BF16) == 1


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
    rng = case_rng("fwd-gate")
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


def _prepass_input(tag, rows=64, cols=384):
    """bf16 [rows, cols]: row blocks at magnitudes 2^-30..2^30, special values scattered, an all-zero and
    an all-NaN block each way, a block one ulp off powers of two, and blocks at tiny (bf16-unsafe) scales."""
    from tests.util import special_values_f32

    rng = case_rng("prepass", tag)
    v = rng.standard_normal((rows, cols)) * 2.0 ** rng.integers(-30, 31, size=(rows, 1))
    sv = special_values_f32()
    sv = sv[np.isfinite(sv.astype(BF16).astype(np.float32)) | np.isnan(sv)]  # fp32-only extremes become Inf in bf16
    at = rng.choice(rows * cols, size=3 * sv.size, replace=False)
    v.reshape(-1)[at] = np.resize(sv, at.size)
    v[3, 64:96] = 0.0                       # an all-zero row block
    v[32:64, 130] = 0.0                     # an all-zero column block
    v[7, 96:128] = np.nan                   # an all-NaN row block
    v[10, 160:192] = np.float32(2.0) ** rng.integers(-8, 9, 32) * (1 - 2.0 ** -8)  # one bf16 ulp below 2^k
    return v.astype(BF16)


@pytest.mark.parametrize("rope,kernel", [(False, "general"), (True, "general"), (True, (32, 4, 2, False)),
                                         (True, (64, 1, 2, True)), (True, (32, 1, 2, True))])
@pytest.mark.parametrize("case", ["finite", "specials", "tiny"])
def test_prepass_dequantized_bytes_and_guard(mla, monkeypatch, case, rope, kernel):
    # the pre-pass's bf16 outputs are the exact dequantization of spec's row- and column-blocked MXFP8 of
    # g (RoPE backward applied when rope) wherever the guard stays down; the flag is up iff some block
    # has a nonzero code under a scale byte outside BF16_SAFE_SCALE_BYTES or some value is NaN. With RoPE
    # the backward's per-head kernel (mla_q_prepass) runs it unless kernel is "general"; its tiles
    # (tokens, heads, warps, grid order) here leave a ragged last token tile (96 tokens) or heads past H
    # (2 of 4), or neither
    import backends.triton.mla_q_prepass as prepass

    mod, device = mla
    if kernel == "general":
        monkeypatch.setattr(mod, "PREPASS_HEADS_KERNEL", False)
    else:
        monkeypatch.setattr(prepass, "TILE", prepass.Tile(*kernel))
    rows, cols = 96, 384  # cols = 2 heads of 192
    if case == "finite":
        src = (case_rng("finite").standard_normal((rows, cols)) * 2.0 ** case_rng("fm").integers(-20, 21, (rows, 1))).astype(BF16)
    elif case == "specials":
        src = _prepass_input("specials", rows=rows)
    else:
        src = (case_rng("tiny").standard_normal((rows, cols)) * 2.0 ** -121).astype(BF16)
    cos = case_rng("cos").uniform(-1, 1, (rows, 64)).astype(np.float32)
    sin = case_rng("sin").uniform(-1, 1, (rows, 64)).astype(np.float32)
    if rope:  # the mla RoPE backward of each head's last 64 features (halves in, interleaved pairs out)
        g = src.astype(np.float32).reshape(rows, 2, 192).copy()
        gl, gr = g[..., 128:160], g[..., 160:192]
        ev = np.float32(gl * cos[:, None, :32]) + np.float32(gr * sin[:, None, 32:])
        od = np.float32(gr * cos[:, None, 32:]) - np.float32(gl * sin[:, None, :32])
        g[..., 128::2], g[..., 129::2] = ev, od
        g = g.reshape(rows, cols)
    else:
        g = src.astype(np.float32)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    st = to_torch(src, device)
    got_r, got_c = mod._prep_launch(st, to_torch(cos, device) if rope else None, to_torch(sin, device) if rope else None,
                                    rope=rope, row_dq=True, col_dq=True, flag=flag)
    unsafe = False
    lo, hi = mod.BF16_SAFE_SCALE_BYTES["e4m3"]
    for axis, got in ((1, got_r), (0, got_c)):
        q = spec.mxfp8_quantize(g, axis=axis)
        want = spec.mxfp8_dequantize(q, out_dtype="bfloat16")
        codes = q.data.view(np.uint8) & 0x7F
        sc = np.repeat(q.scale, 32, axis=axis).astype(np.int32)
        bad = (((sc < lo) | (sc > hi)) & (codes != 0)) | np.isnan(g)
        unsafe |= bool(bad.any())
        # every element outside a flagged block is the exact dequantization (flagged blocks' values are
        # replaced by the exact path)
        blk = bad.reshape(rows, cols // 32, 32).any(axis=2).repeat(32, axis=1) if axis == 1 else \
            bad.reshape(rows // 32, 32, cols).any(axis=1).repeat(32, axis=0)
        keep = ~blk
        got_np = got.cpu().view(torch.int16).numpy()
        assert np.array_equal(got_np[keep], want.view(np.int16)[keep]), f"axis {axis}: dequantized bytes differ"
        if not blk.any():
            assert_bytes_equal(got.cpu(), want, f"axis {axis} dequantized")
    assert int(flag.item()) == int(unsafe), f"guard {int(flag.item())}, expected {int(unsafe)}"
    assert unsafe == (case != "finite")


@pytest.mark.parametrize("tile", [(16, 1, 2, True), (48, 1, 2, True), (32, 0, 2, True)])
def test_prepass_per_head_tile_checked(mla, tile):
    import backends.triton.mla_q_prepass as prepass

    mod, device = mla
    g = torch.zeros((32, 192), dtype=torch.bfloat16, device=device)
    trig = torch.zeros((32, 64), dtype=torch.float32, device=device)
    out = torch.empty_like(g)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="tile: expected tokens a power of two"):
        prepass.prepass_dequantized(g, trig, trig, flag, out, out.clone(), False, prepass.Tile(*tile))


def test_prepass_per_head_kernel_strided_gradient(mla):
    # the per-head kernel reads g through its strides: a view with padded rows (row stride 2 x 192 + 64)
    # and one with the feature axis strided give the contiguous copy's bytes and guard
    mod, device = mla
    rows, cols = 64, 2 * 192
    g = (case_rng("strided").standard_normal((rows, cols)) * 2.0 ** case_rng("sm").integers(-12, 13, (rows, 1))).astype(BF16)
    cos = to_torch(case_rng("cos2").uniform(-1, 1, (rows, 64)).astype(np.float32), device)
    sin = to_torch(case_rng("sin2").uniform(-1, 1, (rows, 64)).astype(np.float32), device)
    dense = to_torch(g, device)
    padded = torch.zeros((rows, cols + 64), dtype=torch.bfloat16, device=device)
    padded[:, :cols] = dense
    spread = torch.zeros((rows, cols, 2), dtype=torch.bfloat16, device=device)
    spread[:, :, 0] = dense
    outs = []
    for src in (dense, padded[:, :cols], spread[:, :, 0]):
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        outs.append((mod._prep_launch(src, cos, sin, rope=True, row_dq=True, col_dq=True, flag=flag), int(flag.item())))
    (want_r, want_c), want_flag = outs[0]
    for (got_r, got_c), got_flag in outs[1:]:
        assert got_flag == want_flag == 0
        assert_bytes_equal(got_r.cpu(), want_r.cpu(), "row dequantized")
        assert_bytes_equal(got_c.cpu(), want_c.cpu(), "col dequantized")


@pytest.mark.parametrize("kernel", ["general", "per-head"])
@pytest.mark.parametrize("above", [False, True])
def test_prepass_guard_at_the_smallest_code(mla, monkeypatch, kernel, above):
    # The guard's edge: a RoPE block (scale byte 0) whose largest |g| * 2^127 is exactly 2^-10, half of
    # e4m3's smallest subnormal, rounds to code 0 (the tie goes to the even code): zero codes under an
    # unsafe scale byte are exact, so the flag stays down and every output is +0. One fp32 ulp of cos
    # above (g = 2^-137 * (1 + 2^-7)) the code is 2^-9, nonzero under byte 0: the flag goes up.
    mod, device = mla
    if kernel == "general":
        monkeypatch.setattr(mod, "PREPASS_HEADS_KERNEL", False)
    rows, cols = 64, 2 * 192
    src = np.zeros((rows, cols), dtype=np.float32)
    src[:, 128:160] = 2.0 ** -133  # gL of head 0: bf16's smallest subnormal; gR stays 0
    src[:, 192 + 128:192 + 160] = 2.0 ** -133
    cos = np.full((rows, 64), 2.0 ** -4 * (1 + 2.0 ** -7 if above else 1.0), dtype=np.float32)
    sin = np.zeros((rows, 64), dtype=np.float32)
    # the RoPE backward gives d_even = gL * cos = 2^-137 (x (1 + 2^-7)), exact in fp32, d_odd = +0
    assert spec.mxfp8_quantize(np.float32(2.0 ** -137) * np.ones((1, 32), np.float32), axis=1).scale[0, 0] == 0
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    got_r, got_c = mod._prep_launch(to_torch(src.astype(BF16), device), to_torch(cos, device), to_torch(sin, device),
                                    rope=True, row_dq=True, col_dq=True, flag=flag)
    assert int(flag.item()) == int(above), f"guard {int(flag.item())}, expected {int(above)}"
    if not above:
        for name, got in (("row", got_r), ("col", got_c)):
            assert_bytes_equal(got.cpu(), np.zeros((rows, cols), dtype=BF16), f"{name} dequantized")


try:
    import triton
    import triton.language as tl

    from backends.triton._mxfp8 import decode_e4m3, e4m3_value, encode_e4m3_bits

    @triton.jit
    def _e4m3_value_kernel(y_ptr, fast_ptr, slow_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        y = tl.load(y_ptr + offs, mask=mask, other=0.0)
        tl.store(fast_ptr + offs, e4m3_value(y), mask=mask)
        tl.store(slow_ptr + offs, decode_e4m3(encode_e4m3_bits(y)), mask=mask)
except ImportError:  # pragma: no cover - the fixture skips without Triton
    _e4m3_value_kernel = None


def _e4m3_inputs():
    """fp32 inputs for e4m3_value: random bit patterns (every exponent, NaN and Inf included), normal draws
    at several magnitudes, every rounding tie and its neighbours in each e4m3 binade (normal and
    subnormal), the saturation edge, signed zeros."""
    rng = case_rng("e4m3-value")
    bits = rng.integers(0, 2 ** 32, size=60_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    draws = (rng.standard_normal(20_000) * 2.0 ** rng.integers(-12, 10, 20_000)).astype(np.float32)
    ties = []
    for e in range(-9, 9):  # quantum 2^(e-3) above 2^-6, 2^-9 below
        q = 2.0 ** max(e - 3, -9)
        for k in range(0, 16):
            t = np.float32((k + 0.5) * q + 2.0 ** e) if e >= -6 else np.float32((k + 0.5) * 2.0 ** -9)
            ties += [t, np.nextafter(t, np.float32(0)), np.nextafter(t, np.float32(np.inf))]
    edge = np.array([448, 449, 463.99, 464, 464.01, 480, 512, 1e30, np.inf, np.nan, 0.0, 2.0 ** -10, 2.0 ** -11,
                     3 * 2.0 ** -11, 2.0 ** -149, 2.0 ** -126], np.float32)
    v = np.concatenate([bits, draws, np.array(ties, np.float32), edge])
    return np.concatenate([v, -v]).astype(np.float32)


def test_e4m3_value_is_encode_then_decode(triton_target):
    # the pre-pass's one-add rounding to the e4m3 grid against the codec it replaces (encode on the bits,
    # then decode), and against ml_dtypes' saturating cast: the same fp32 bits, NaN for NaN
    import ml_dtypes

    device = triton_target[1]
    y = _e4m3_inputs()
    yt = to_torch(y, device)
    fast, slow = torch.empty_like(yt), torch.empty_like(yt)
    _e4m3_value_kernel[(triton.cdiv(y.size, 1024),)](yt, fast, slow, y.size, BLOCK=1024)
    fast, slow = fast.cpu().numpy(), slow.cpu().numpy()
    with np.errstate(invalid="ignore"):
        ref = np.clip(np.nan_to_num(y, nan=0.0, posinf=448.0, neginf=-448.0), -448.0, 448.0)
    ref = ref.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    ref[np.isnan(y)] = np.nan
    for name, got in (("encode_e4m3_bits + decode_e4m3", slow), ("ml_dtypes", ref)):
        same = (fast.view(np.uint32) == got.view(np.uint32)) | (np.isnan(fast) & np.isnan(got))
        assert same.all(), f"e4m3_value differs from {name} at {y[~same][:5]}: {fast[~same][:5]} vs {got[~same][:5]}"
