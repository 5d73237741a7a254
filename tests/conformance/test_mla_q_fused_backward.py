"""The fused MXFP8 backward route (backends/triton/mla_q_grad_gluon.py: g's RoPE backward and both
quantize-dequantizes inside the two GEMMs' main loops) against spec's bytes, on CUDA sm90 (its Gluon
kernels do not run under the interpreter).

Inputs are exact-arithmetic (any fp32 summation order gives spec's sum), outputs poisoned. Shapes put
RoPE chunks in both consumer warpgroups of dw's tiles (3 heads), an odd and an even number of k-steps,
and a partial token tile; forms: bf16 x / w, MXFP8 x_t / w_n, w_n held K-major. The guard: an Inf, a NaN
and a tiny gradient raise it, and the gated exact path gives spec's bytes.
"""
from __future__ import annotations

import numpy as np
import pytest

import spec
from tests.conformance.mla_q_backward_cases import backward_case, case_rng, check_dx_dw
from tests.util import BF16, poisoned_empty

torch = pytest.importorskip("torch")
from backends.convert import to_torch  # noqa: E402
from spec.mxtensor import MXTensor  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                                 reason="the fused backward's Gluon kernels run on sm90 GPUs only")]


@pytest.fixture
def mod(monkeypatch):
    import backends.triton.gemm as gemm_mod
    import backends.triton.mla_q as m

    monkeypatch.setattr(m, "_empty", poisoned_empty)
    monkeypatch.setattr(gemm_mod, "_empty", poisoned_empty)
    assert not m.fused_backward_reasons(torch.zeros(1, device="cuda"), torch.zeros(1), torch.zeros(1))
    return m


def _kmajor(t: MXTensor) -> MXTensor:
    return MXTensor(t.data.t().contiguous().t(), t.scale.t().contiguous().t(), t.axis, t.elem, t.scale_layout)


def _run(m, dq, x, w, cos, sin, kmajor=False):
    conv = lambda a: MXTensor(to_torch(a.data, "cuda"), to_torch(a.scale, "cuda"), a.axis, a.elem, a.scale_layout) \
        if isinstance(a, spec.MXTensor) else to_torch(a, "cuda")  # noqa: E731
    xa, wa = conv(x), conv(w)
    if kmajor:
        wa = _kmajor(wa)
    args = [to_torch(dq.astype(BF16), "cuda"), xa, wa, to_torch(cos, "cuda"), to_torch(sin, "cuda")]
    out = m.mla_q_backward_launch(*args, quantize_grad=True, route="fused")
    return [o.cpu() for o in out]


@pytest.mark.parametrize("form", ["bf16", "mxfp8", "mxfp8_kmajor"])
@pytest.mark.parametrize("tokens,heads", [(64, 2), (160, 3), (256, 3)])
def test_fused_backward_bytes_equal_spec(mod, form, tokens, heads):
    x, w, cos, sin, dq = backward_case(f"fused-{tokens}-{heads}", tokens=tokens, heads=heads)
    if form != "bf16":
        x, w = spec.mxfp8_quantize(x, axis=0), spec.mxfp8_quantize(w, axis=0)
    want = spec.mla_q_uproj_rope_quant_backward(dq.astype(BF16), x, w, cos, sin, True)
    check_dx_dw(_run(mod, dq, x, w, cos, sin, kmajor=form == "mxfp8_kmajor"), want)


@pytest.mark.parametrize("case", ["inf", "tiny", "nan"])
def test_fused_backward_guard_gives_spec_bytes(mod, case):
    x, w, cos, sin, dq = backward_case("fused-guard-" + case)
    if case == "tiny":
        dq[:] = 0.0
        dq[:, 1, :32] = 2.0 ** -110 * np.sign(case_rng("tiny-signs").standard_normal((64, 32)))
        w = (w.astype(np.float32) * 64.0).astype(BF16)
    else:
        dq[5, 1, 7 if case == "inf" else 150] = {"inf": np.inf, "nan": np.nan}[case]
    want = spec.mla_q_uproj_rope_quant_backward(dq.astype(BF16), x, w, cos, sin, True)
    check_dx_dw(_run(mod, dq, x, w, cos, sin), want)


def test_fused_backward_matches_the_dequantized_route_on_random_data(mod):
    # random bf16 gradients at several magnitudes: both routes multiply the same exact operands, so
    # outputs differ only by the fp32 summation order: within a bf16 half-ulp (2^-8 relative) plus the
    # sums' own fp32 error (bounded here by 2^-16 of the largest output)
    g = torch.Generator(device="cuda").manual_seed(5)
    tokens, heads, k = 512, 4, 256
    dq = (torch.randn(tokens, heads, 192, device="cuda", generator=g)
          * torch.logspace(-3, 3, heads * 192, device="cuda").view(1, heads, 192)).to(torch.bfloat16)
    x = torch.randn(tokens, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(heads * 192, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    ang = torch.rand(tokens, 64, device="cuda", generator=g) * 6.283
    cos, sin = torch.cos(ang), torch.sin(ang)
    a = mod.mla_q_backward_launch(dq, x, w, cos, sin, quantize_grad=True, route="fused")
    b = mod.mla_q_backward_launch(dq, x, w, cos, sin, quantize_grad=True, route="dequantized")
    for got, want in zip(a, b):
        assert torch.isfinite(got).all()
        diff = (got.float() - want.float()).abs()
        bound = 2.0 ** -8 * want.float().abs() + 2.0 ** -16 * want.float().abs().max()
        assert bool((diff <= bound).all()), f"max excess {float((diff - bound).max())}"
        assert float((got != want).float().mean()) < 0.05


def _launch_configs(dq, w16p, x16t, cos, sin, configs):
    """(dx, dw, flag) of mla_q_grad_gluon.launch_pair under each config, outputs poisoned with NaN."""
    from backends.triton import mla_q_grad_gluon as G
    from backends.triton.gemm import BF16_SAFE_SCALE_BYTES

    tokens, n = dq.shape
    k = w16p.shape[0]
    outs = []
    for cfg in configs:
        dx = torch.full((tokens, k), float("nan"), device="cuda", dtype=torch.bfloat16)
        dw = torch.full((n, k), float("nan"), device="cuda", dtype=torch.bfloat16)
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        G.launch_pair(dq, w16p, x16t, cos, sin, dx, dw, flag, BF16_SAFE_SCALE_BYTES["e4m3"],
                      config=dict(G.CONFIGS[0], **cfg))
        outs.append((dx, dw, int(flag.item())))
    return outs


@pytest.mark.parametrize("spread", [0, 12, 40])
def test_bf16_bit_path_equals_the_conversions(mod, spread):
    # the no-RoPE chunks' quantize-dequantize on bf16 bits (BITS=1, the default) against the hardware
    # conversions (BITS=0): the same kernel, the same MMA order, so the bytes and the guard must match.
    # spread: log2 of the magnitude range across the features; 5 % zeros; at spread 40 one row block
    # past the bit path's cap (scale byte 244), which raises the guard on the bit path
    g = torch.Generator(device="cuda").manual_seed(spread)
    tokens, heads, k = 320, 3, 256
    n = heads * 192
    scale = torch.exp2(torch.linspace(-spread / 2, spread / 2, n, device="cuda"))
    dq = torch.randn(tokens, n, device="cuda", generator=g) * scale
    dq[torch.rand(tokens, n, device="cuda", generator=g) < 0.05] = 0.0
    x16t = torch.randn(k, tokens, device="cuda", generator=g).to(torch.bfloat16)
    w16p = (torch.randn(k, n, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    if spread == 40:
        dq[7, :32] = 448.0 * 2.0 ** (244 - 127)  # one row block past the cap: guard raised, both paths
    dq = dq.to(torch.bfloat16)
    ang = torch.rand(tokens, 64, device="cuda", generator=g) * 6.283
    cos, sin = torch.cos(ang), torch.sin(ang)
    (dx0, dw0, f0), (dx1, dw1, f1) = _launch_configs(dq, w16p, x16t, cos, sin, [dict(BITS=0), dict(BITS=1)])
    if spread == 40:
        assert f1 == 1  # scale byte 244 is past the bit path's cap (242)
    else:
        assert f0 == f1 == 0
        assert torch.equal(dx0.view(torch.int16), dx1.view(torch.int16))
        assert torch.equal(dw0.view(torch.int16), dw1.view(torch.int16))
