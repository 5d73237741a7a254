"""The fused forward's MXFP8-projection kernel on sm90 (variant gluon_mx, mla_q_mx_gluon.py): bytes
against spec on exact-arithmetic inputs (every product and partial sum exact in fp32, so any summation
order gives spec's bytes), with the guard checked down -- the kernel itself wrote them, not the exact
fallback -- for compact and swizzled scales, e4m3 and e5m2 weights, every config, K tails and tile
counts below, at and above the SM count; random inputs within the shared bound (SEMANTICS 6); the
DeepSeek-V3 width against the dequantized route; scale bytes outside the bf16-safe range and
non-finite values through the gated fallback. Outputs are allocated poisoned (0xFF). Where the Gluon
kernels cannot run (CPU, not sm90) only the reasons and the selection are tested (capability mocked).
"""
from __future__ import annotations

import types

import numpy as np
import pytest

import spec
from tests.conformance.test_mla_q import assert_close_mx, staging_flip_bound
from tests.conformance.test_mla_q_triton import _check_mx, _dev, _exact_inputs, _seed, _variant_or_skip
from tests.test_mla_q import random_operands, tables
from tests.util import BF16, poisoned_empty

torch = pytest.importorskip("torch")
from spec.mxtensor import MXTensor  # noqa: E402

D = 192


@pytest.fixture
def mla(monkeypatch):
    import backends.triton.gemm as gemm_mod
    import backends.triton.mla_q as mod

    monkeypatch.setattr(mod, "_empty", poisoned_empty)
    monkeypatch.setattr(gemm_mod, "_empty", poisoned_empty)
    return mod


def _kernel_alone(mod, x, w, cos, sin, config=None):
    """The gluon_mx kernel without the gated fallback: (q_row, q_col, guard flag)."""
    import backends.triton.mla_q_mx_gluon as qm

    tokens, heads = x.data.shape[0], w.data.shape[0] // D
    dev = x.data.device
    outs = [poisoned_empty(s, dt, dev) for s, dt in (((tokens, heads, D), torch.float8_e4m3fn),
                                                     ((tokens, heads, D // 32), torch.uint8),
                                                     ((tokens, heads, D), torch.float8_e4m3fn),
                                                     ((tokens // 32, heads, D), torch.uint8))]
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    x16 = mod._mx_bf16(x, flag)
    ws, swr, swc, groups, swz = mod._scale_args(w)
    qm.launch(x16, w.data.view(torch.uint8), ws, (swr, swc), groups, swz, w.elem == "e5m2",
              mod.BF16_SAFE_SCALE_BYTES[w.elem], cos.contiguous(), sin.contiguous(), outs[0].view(torch.uint8),
              outs[1], outs[2].view(torch.uint8), outs[3], flag, config=config)
    return (MXTensor(outs[0], outs[1], 2, "e4m3", "compact"), MXTensor(outs[2], outs[3], 0, "e4m3", "compact"),
            int(flag.item()))


def _e5m2_weight(w: MXTensor) -> MXTensor:
    """The same weight values as e5m2 codes (exact: the exact case's entries are 0, +-1, +-2 times a power
    of two), with the scale bytes the spec's quantizer picks."""
    values = spec.mxfp8_dequantize(w).astype(np.float32)
    return spec.mxfp8_quantize(values.astype(BF16), axis=1, elem="e5m2")


# (tokens, K, heads): one tile; K tails (96: two 64-steps, three 32-steps); six heads (a 128-feature tile
# holding the ends of two heads); more tiles than a program runs at once, several per program
_SHAPES = [(256, 64, 2), (256, 96, 2), (256, 160, 6), (512, 1536, 4), (1024, 320, 64)]


@pytest.mark.parametrize("kind", ["mxfp8", "mxfp8-swizzled"])
@pytest.mark.parametrize("shape", _SHAPES, ids=lambda s: "T{}K{}H{}".format(*s))
def test_gluon_mx_exact_bytes(triton_target, mla, shape, kind):
    device = triton_target[1]
    _variant_or_skip(device, "gluon_mx")
    tokens, k, heads = shape
    x, w, cos, sin = _exact_inputs(_seed("fwd-gluon-mx", shape, kind), tokens, k, heads, kind)
    want = spec.mla_q_uproj_rope_quant(x, w, cos, sin)
    import backends.triton.mla_q_mx_gluon as qm

    dx, dw, dcos, dsin = _dev((x, w, cos, sin), device)
    for cfg in qm.CONFIGS:
        q_row, q_col, flag = _kernel_alone(mla, dx, dw, dcos, dsin, cfg)
        assert flag == 0, f"guard raised on in-range inputs {cfg}"
        _check_mx(q_row, want[0], f"q_row {cfg}")
        _check_mx(q_col, want[1], f"q_col {cfg}")
    got = mla.mla_q_forward_launch(dx, dw, dcos, dsin, variant="gluon_mx")
    _check_mx(got[0], want[0], "q_row (op)")
    _check_mx(got[1], want[1], "q_col (op)")


def test_gluon_mx_e5m2_weight_exact_bytes(triton_target, mla):
    device = triton_target[1]
    _variant_or_skip(device, "gluon_mx")
    x, w, cos, sin = _exact_inputs(_seed("fwd-gluon-mx-e5m2"), 256, 160, 4, "mxfp8")
    w = _e5m2_weight(w)
    want = spec.mla_q_uproj_rope_quant(x, w, cos, sin)
    q_row, q_col, flag = _kernel_alone(mla, *_dev((x, w, cos, sin), device))
    assert flag == 0
    _check_mx(q_row, want[0], "q_row")
    _check_mx(q_col, want[1], "q_col")


def test_gluon_mx_random_within_bound(triton_target, mla):
    device = triton_target[1]
    _variant_or_skip(device, "gluon_mx")
    rng = _seed("fwd-gluon-mx-random")
    x, w = random_operands(rng, 512, 1536, 16, mx=True, spread=3)
    cos, sin = tables(rng, 512, BF16)
    want = spec.mla_q_uproj_rope_quant(x, w, cos, sin)
    got = mla.mla_q_forward_launch(*_dev((x, w, cos, sin), device), variant="gluon_mx")
    flip = staging_flip_bound(x, w, cos, sin)
    assert_close_mx(got[0], want[0], flip, "q_row")
    assert_close_mx(got[1], want[1], flip, "q_col")


@pytest.mark.gpu
def test_gluon_mx_deepseek_width_matches_dequantized_route(triton_target, mla):
    # T 4096 x 128 heads x K 1536, exact inputs: byte-equal to the gluon_ws128 route (itself compared with
    # spec at this width through the one-tile kernel in test_mla_q_triton)
    device = triton_target[1]
    _variant_or_skip(device, "gluon_mx")
    x, w, cos, sin = _dev(_exact_inputs(_seed("fwd-gluon-mx-wide"), 4096, 1536, 128, "mxfp8"), device)
    want = mla.mla_q_forward_launch(x, w, cos, sin, variant="gluon_ws128")
    q_row, q_col, flag = _kernel_alone(mla, x, w, cos, sin)
    assert flag == 0
    _check_mx(q_row, want[0], "q_row")
    _check_mx(q_col, want[1], "q_col")


def test_gluon_mx_unsafe_scale_and_nonfinite_take_the_exact_path(triton_target, mla):
    # a weight block's scale byte below the bf16-safe range over nonzero codes, then a NaN and an Inf in
    # x: the guard goes up and the gated pointer kernel's bytes (spec's) replace the kernel's
    device = triton_target[1]
    _variant_or_skip(device, "gluon_mx")
    x, w, cos, sin = _exact_inputs(_seed("fwd-gluon-mx-guard"), 256, 64, 2, "mxfp8")
    w_scale = w.scale.copy()
    w_scale[5, 1] = 4  # 2^-123: its products are bf16 subnormals or below
    w = MXTensor(w.data, w_scale, w.axis, w.elem, w.scale_layout)
    want = spec.mla_q_uproj_rope_quant(x, w, cos, sin)
    dx, dw, dcos, dsin = _dev((x, w, cos, sin), device)
    assert _kernel_alone(mla, dx, dw, dcos, dsin)[2] == 1
    got = mla.mla_q_forward_launch(dx, dw, dcos, dsin, variant="gluon_mx")
    _check_mx(got[0], want[0], "q_row (unsafe scale)")
    _check_mx(got[1], want[1], "q_col (unsafe scale)")
    x2, w2, cos2, sin2 = _exact_inputs(_seed("fwd-gluon-mx-nonfinite"), 256, 64, 2, "mxfp8")
    data = x2.data.copy()
    data[3, 5] = np.float32(np.nan)
    data[7, 9] = np.float32(np.inf)  # e4m3 has no Inf: the NaN code; a block's scale byte 255 instead
    scale = x2.scale.copy()
    scale[40, 0] = 255
    x2 = MXTensor(data, scale, x2.axis, x2.elem, x2.scale_layout)
    want = spec.mla_q_uproj_rope_quant(x2, w2, cos2, sin2)
    got = mla.mla_q_forward_launch(*_dev((x2, w2, cos2, sin2), device), variant="gluon_mx")
    _check_mx(got[0], want[0], "q_row (non-finite)")
    _check_mx(got[1], want[1], "q_col (non-finite)")


class _FakeMX(types.SimpleNamespace):
    """Stands in for MXTensor in the selection test (CUDA-looking codes without a GPU)."""


def _fake_mx(tokens, k=64, rows=192, axis=1, stride=None):
    data = types.SimpleNamespace(shape=(tokens, k), device=types.SimpleNamespace(type="cuda"))
    codes = torch.zeros((rows, k), dtype=torch.uint8)
    if stride is not None:
        codes = torch.zeros((rows, stride), dtype=torch.uint8)[:, :k]
    return _FakeMX(data=data, axis=1, shape=(tokens, k)), _FakeMX(data=codes, axis=axis, shape=(rows, k))


def test_gluon_mx_reasons_and_selection(monkeypatch):
    # capability mocked (no GPU here): gluon_mx is named only (the automatic choice stays gluon_ws128,
    # faster on the H200), its reasons are empty for an MXFP8 projection it can run and name each unmet
    # need otherwise; a bf16 projection is refused.
    import backends.triton.mla_q as mod

    pytest.importorskip("backends.triton.mla_q_mx_gluon")
    monkeypatch.setattr(mod, "interpret_mode", lambda: False)
    monkeypatch.setattr(mod, "_tma_ok", lambda t: True)
    monkeypatch.setattr(mod, "gluon_reasons", lambda x, w: [])
    monkeypatch.setattr(mod, "MXTensor", _FakeMX)
    x, w = _fake_mx(256, rows=384)
    assert mod.forward_variant(x, w) == "gluon_ws128"
    assert mod.forward_variant_reasons("gluon_mx", x, w) == []
    bf = types.SimpleNamespace(shape=(256, 64), device=types.SimpleNamespace(type="cuda"))
    assert mod.forward_variant(bf, bf) == "gluon_ws128"
    assert mod.forward_variant_reasons("gluon_mx", bf, bf) == [
        "gluon_mx is the MXFP8 projection's kernel: x and w must be MXTensors"]
    x, w = _fake_mx(128, rows=384)
    assert mod.forward_variant_reasons("gluon_mx", x, w) == ["gluon_mx needs tokens % 256 == 0, got 128"]
    assert mod.forward_variant(x, w) == "gluon_ws128"
    x, w = _fake_mx(256, rows=192)
    assert mod.forward_variant_reasons("gluon_mx", x, w) == [
        "gluon_mx needs an even head count (128-feature tiles), got 1"]
    x, w = _fake_mx(256, rows=384, axis=0)
    assert mod.forward_variant_reasons("gluon_mx", x, w) == [
        "gluon_mx needs the weight blocked along K (axis 1), got axis 0"]
    x, w = _fake_mx(256, rows=384, stride=72)
    assert mod.forward_variant_reasons("gluon_mx", x, w) == [
        "gluon_mx needs the weight's codes 2-D, K-contiguous, 16-byte aligned base and rows (TMA)"]
    x, w = _fake_mx(256, k=36, rows=384)  # rows of 36 code bytes: neither operand's rows are TMA rows
    assert "gluon_mx needs K % 8 == 0 (TMA rows of x's bf16 dequantization), got 36" in mod.forward_variant_reasons(
        "gluon_mx", x, w)
    import backends.triton.mla_q_mx_gluon as qm

    with pytest.raises(ValueError, match="config: the gluon_mx kernel takes keys"):
        qm.launch(torch.zeros((256, 64), dtype=torch.bfloat16), None, None, (0, 0), 0, False, False, (10, 246),
                  *([None] * 7), config=dict(BLOCK_K=64))
