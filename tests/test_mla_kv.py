"""dispatch.autograd.mla_kv_mxfp8: MLA's key and value as attention's MXFP8 operands in one graph node.

Checked against the spec (k = quantize of the bf16 concatenation [k_nope | k_pe broadcast over heads]
along D, v quantized along the sequence axis; codes and scales byte-equal) and against the composition
of tracked ops it replaces (quantize, expand_mx, cat_mx: the same bytes, and gradients byte-equal, since
they are the same slices, head sums and casts), on every layout, on the torch backend, the Triton
interpreter and CUDA where present; seeded data at several magnitudes with special values (NaN and
all-zero blocks, Inf, subnormals, -0, values one ulp from a power of two). Bad inputs raise naming
the argument; compile tracing and no-grad calls work. With cos / sin (k_pe rotated inside), bytes and
gradients equal those of the rope op followed by mla_kv_mxfp8 without tables, on the eager and the
custom-op paths. At the end, spec.mla_kv itself: k is the parts quantized apart and set side by side,
with tables it is rope then the op, the layout table, and its validator's words.
"""
from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest
import torch

import dispatch.autograd as mxag
import spec
from tests.util import BF16, assert_bytes_equal, random_magnitudes, skip_without_triton_interpreter

LAYOUTS = {"bshd": ((2, 64, 3), 1, 2), "sbhd": ((64, 2, 3), 0, 2), "thd": ((64, 3), 0, 1)}


def _inputs(layout, scale, shared=True, seed=5):
    lead, _, head = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(*lead, 256, generator=gen) * scale
    flat = kv.view(-1, 256)
    flat[0, :32] = float("nan")                # an all-NaN block of k_nope
    flat[1, 32:64] = 0.0                       # an all-zero block
    flat[2, 5] = float("inf")
    flat[3, 7] = 2.0 ** -133                   # a bf16 subnormal
    flat[3, 8] = -0.0
    flat[4, 130] = 2.0 ** 8 * (1 - 2 ** -8)    # one bf16 ulp under a power of two, in v
    flat[5, 200] = float("-inf")
    pe_lead = list(lead)
    if shared:
        pe_lead[head] = 1
    k_pe = torch.randn(*pe_lead, 64, generator=gen) * scale
    k_pe.view(-1, 64)[1, 3] = 2.0 ** -130
    return kv.bfloat16(), k_pe.bfloat16()


def _device(backend, monkeypatch):
    if backend == "triton":
        skip_without_triton_interpreter()
        return "triton", "cpu"
    if backend == "triton-cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        return "triton", "cuda"
    return backend, "cpu"


def _spec(kv, k_pe, layout):
    """spec's k (the bf16 concatenation quantized along D) and v (quantized along the sequence axis)."""
    lead, seq, _ = LAYOUTS[layout]
    kv32 = kv.float().numpy()  # bf16 values, exactly
    pe = np.broadcast_to(k_pe.float().numpy(), lead + (64,))
    k = np.concatenate([kv32[..., :128], pe], axis=-1).astype(BF16)
    return spec.mxfp8_quantize(k, axis=len(lead)), spec.mxfp8_quantize(kv32[..., 128:].astype(BF16), axis=seq)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("scale", [2.0 ** -20, 1.0, 2.0 ** 20])
@pytest.mark.parametrize("backend", ["torch", "triton", "triton-cuda"])
def test_bytes_equal_spec_and_composition(layout, scale, backend, monkeypatch):
    backend, device = _device(backend, monkeypatch)
    kv, k_pe = (t.to(device).requires_grad_(True) for t in _inputs(layout, scale))
    k_nope, v = kv[..., :128], kv[..., 128:]  # strided slices of one projection
    k, vq = mxag.mla_kv_mxfp8(k_nope, k_pe, v, layout=layout, backend=backend)
    k_ref, v_ref = mxag._kv_composed(k_nope, k_pe, v, layout, backend)
    want_k, want_v = _spec(kv.detach().cpu(), k_pe.detach().cpu(), layout)
    for got, ref, want, name in ((k, k_ref, want_k, "k"), (vq, v_ref, want_v, "v")):
        assert isinstance(got, mxag.TrackedMXTensor) and got.grad_proxy.requires_grad
        assert (got.axis, got.elem, got.scale_layout, got.shape) == (want.axis, "e4m3", "compact", want.data.shape)
        assert_bytes_equal(got.data.cpu(), want.data, f"{name} codes vs spec")
        assert_bytes_equal(got.scale.cpu(), want.scale, f"{name} scales vs spec")
        assert_bytes_equal(got.data, ref.data, f"{name} codes vs composition")
        assert_bytes_equal(got.scale, ref.scale, f"{name} scales vs composition")


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shared", [True, False])
def test_gradients_equal_composition(layout, shared):
    kv, k_pe = (t.requires_grad_(True) for t in _inputs(layout, 1.0, shared=shared))
    kv.data.nan_to_num_(0.0, 0.0, 0.0)  # finite data: the gradients are compared, not the forward
    gen = torch.Generator().manual_seed(9)
    k, vq = mxag.mla_kv_mxfp8(kv[..., :128], k_pe, kv[..., 128:], layout=layout, backend="torch")
    gk = torch.randn(k.shape, generator=gen).bfloat16()
    gv = torch.randn(vq.shape, generator=gen).bfloat16()
    got = torch.autograd.grad([k.grad_proxy, vq.grad_proxy], [kv, k_pe], [gk, gv])
    k2, v2 = mxag._kv_composed(kv[..., :128], k_pe, kv[..., 128:], layout, "torch")
    want = torch.autograd.grad([k2.grad_proxy, v2.grad_proxy], [kv, k_pe], [gk, gv])
    for a, b, name in zip(got, want, ("d kv", "d k_pe")):
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
        assert_bytes_equal(a.view(torch.int16), b.view(torch.int16), name)
    # only k used (v's gradient absent): k's still flows, as the composition's does
    k3, _ = mxag.mla_kv_mxfp8(kv[..., :128], k_pe, kv[..., 128:], layout=layout, backend="torch")
    k4, _ = mxag._kv_composed(kv[..., :128], k_pe, kv[..., 128:], layout, "torch")
    for a, b in zip(torch.autograd.grad([k3.grad_proxy], [kv, k_pe], [gk]),
                    torch.autograd.grad([k4.grad_proxy], [kv, k_pe], [gk])):
        assert_bytes_equal(a.view(torch.int16), b.view(torch.int16), "k only")


def test_float32_inputs_get_float32_gradients():
    kv, k_pe = _inputs("thd", 1.0)
    kv = kv.float().nan_to_num(0.0, 0.0, 0.0).requires_grad_(True)
    k_pe = k_pe.float().requires_grad_(True)
    k, v = mxag.mla_kv_mxfp8(kv[..., :128], k_pe, kv[..., 128:], layout="thd", backend="torch")
    assert k.grad_proxy.dtype == v.grad_proxy.dtype == torch.float32
    (k.grad_proxy.float().sum() + v.grad_proxy.float().sum()).backward()
    assert kv.grad.dtype == k_pe.grad.dtype == torch.float32
    assert torch.equal(k_pe.grad, torch.full_like(k_pe, 3.0))  # summed over the 3 heads sharing it


def test_no_grad_and_compile():
    kv, k_pe = _inputs("bshd", 1.0)
    with torch.no_grad():
        k, v = mxag.mla_kv_mxfp8(kv[..., :128], k_pe, kv[..., 128:], backend="torch")
    assert not k.grad_proxy.requires_grad
    want_k, want_v = _spec(kv, k_pe, "bshd")
    assert_bytes_equal(k.data, want_k.data, "no-grad k codes")

    def f(kv, k_pe):
        k, v = mxag.mla_kv_mxfp8(kv[..., :128], k_pe, kv[..., 128:], backend="torch")
        return k.data.view(torch.uint8), k.scale, v.data.view(torch.uint8), v.scale

    out = torch.compile(f, fullgraph=True, backend="eager")(kv, k_pe)
    for got, want, name in zip(out, (want_k.data, want_k.scale, want_v.data, want_v.scale), "kKvV"):
        assert_bytes_equal(got, want, f"compiled {name}")


def test_bad_inputs_raise():
    kv, k_pe = _inputs("bshd", 1.0)
    kn, v = kv[..., :128], kv[..., 128:]
    cases = [
        (dict(layout="bhsd"), ValueError, "layout"),
        (dict(k_nope=kv[..., :96]), ValueError, "k_nope"),
        (dict(k_pe=k_pe[..., :32]), ValueError, "k_pe"),
        (dict(k_pe=k_pe.expand(2, 64, 2, 64)), ValueError, "k_pe"),
        (dict(v=kv[:, :32, :, 128:]), ValueError, "v"),
        (dict(v=kv[:, :48, :, 128:], k_nope=kv[:, :48, :, :128], k_pe=k_pe[:, :48]), ValueError, "multiple of 32"),
        (dict(k_pe=k_pe.float()), TypeError, "k_pe"),
        (dict(v=v.to(torch.int32)), TypeError, "v"),
        (dict(k_nope="k"), TypeError, "k_nope"),
        (dict(layout="thd"), ValueError, "k_nope"),
    ]
    for change, exc, words in cases:
        args = dict(k_nope=kn, k_pe=k_pe, v=v, layout="bshd", backend="torch")
        args.update(change)
        with pytest.raises(exc, match=words):
            mxag.mla_kv_mxfp8(**args)


def _tables(rows, seed=11, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return tuple((torch.rand(rows, 64, generator=gen) * 2 - 1).to(dtype) for _ in range(2))


def _same_bits(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    assert torch.equal(a.view(bits), b.view(bits)), what


def _check_rope_path(layout, shared, backend, dtype=torch.bfloat16):
    """mla_kv_mxfp8 with tables against rope then mla_kv_mxfp8 without, and against the custom-op
    composition: codes and scales, and the gradients of k_nope / v and of k_pe (none for the tables)."""
    lead, seq, _ = LAYOUTS[layout]
    kv, k_pe = _inputs(layout, 1.0, shared=shared)
    kv = kv.to(dtype).nan_to_num(0.0, 0.0, 0.0).requires_grad_(True)  # finite: gradients are compared
    k_pe = k_pe.to(dtype).requires_grad_(True)
    cos, sin = (t.requires_grad_(True) for t in _tables(lead[seq] + 2, dtype=torch.bfloat16))
    gen = torch.Generator().manual_seed(9)
    gk = torch.randn(lead + (192,), generator=gen).to(dtype)
    gv = torch.randn(lead + (128,), generator=gen).to(dtype)

    def run(how):
        kn, v = kv[..., :128], kv[..., 128:]
        if how == "fused":
            k, vq = mxag.mla_kv_mxfp8(kn, k_pe, v, layout=layout, cos=cos, sin=sin, backend=backend)
        elif how == "rope first":
            k_rot = mxag.rope(k_pe, cos, sin, style="mla", layout=layout, backend=backend)
            k, vq = mxag.mla_kv_mxfp8(kn, k_rot, v, layout=layout, backend=backend)
        else:
            k, vq = mxag._kv_composed(kn, k_pe, v, layout, backend, cos, sin)
        grads = torch.autograd.grad([k.grad_proxy, vq.grad_proxy], [kv, k_pe, cos, sin], [gk, gv], allow_unused=True)
        return k, vq, grads

    k, vq, grads = run("fused")
    assert grads[2] is None and grads[3] is None  # the tables get no gradient
    for how in ("rope first", "custom ops"):
        k2, v2, grads2 = run(how)
        for got, want, name in ((k, k2, "k"), (vq, v2, "v")):
            assert_bytes_equal(got.data, want.data, f"{name} codes vs {how}")
            assert_bytes_equal(got.scale, want.scale, f"{name} scales vs {how}")
        assert grads2[2] is None and grads2[3] is None
        _same_bits(grads[0], grads2[0], f"d kv vs {how}")
        _same_bits(grads[1], grads2[1], f"d k_pe vs {how}")
    return k, vq, grads


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shared", [True, False], ids=["shared_pe", "per_head_pe"])
def test_rope_equals_rope_then_mla_kv(layout, shared):
    _, _, grads = _check_rope_path(layout, shared, "torch")
    # the rotation reached the gradient: k_pe's is not the plain head sum of dk's RoPE part
    lead, _, head = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(9)
    gk = torch.randn(lead + (192,), generator=gen).bfloat16()[..., 128:]
    plain = gk.sum(head, keepdim=True) if shared else gk
    assert not torch.equal(grads[1], plain.bfloat16())


def test_rope_float32_inputs():
    _check_rope_path("thd", True, "torch", dtype=torch.float32)


def test_rope_triton_interpreter(monkeypatch):
    _device("triton", monkeypatch)
    _check_rope_path("bshd", True, "triton")


def test_rope_compiled():
    kv, k_pe = _inputs("sbhd", 1.0)
    cos, sin = _tables(64)
    kv_np, pe_np = kv.float().numpy().astype(BF16), k_pe.float().numpy().astype(BF16)
    want_k, want_v = spec.mla_kv_quantize(kv_np[..., :128], pe_np, kv_np[..., 128:], layout="sbhd", cos=cos.numpy(),
                                          sin=sin.numpy())

    def f(kv, k_pe, cos, sin):
        k, v = mxag.mla_kv_mxfp8(kv[..., :128], k_pe, kv[..., 128:], layout="sbhd", cos=cos, sin=sin, backend="torch")
        return k.data.view(torch.uint8), k.scale, v.data.view(torch.uint8), v.scale

    out = torch.compile(f, fullgraph=True, backend="eager")(kv, k_pe, cos, sin)
    for got, want, name in zip(out, (want_k.data, want_k.scale, want_v.data, want_v.scale), "kKvV"):
        assert_bytes_equal(got, want, f"compiled {name}")


def test_rope_bad_inputs_raise():
    kv, k_pe = _inputs("bshd", 1.0)
    cos, sin = _tables(64)
    cases = [
        (dict(cos=cos), ValueError, "^sin: "),
        (dict(sin=sin), ValueError, "^cos: "),
        (dict(cos=cos.numpy(), sin=sin), TypeError, "^cos: expected a torch.Tensor"),
        (dict(cos=cos[:, :32], sin=sin[:, :32]), ValueError, r"^cos: expected tables \[max_positions, 64\]"),
        (dict(cos=cos[:63], sin=sin[:63]), ValueError, "^cos: tables have 63 rows"),
        (dict(cos=cos, sin=sin.bfloat16()), TypeError, "^sin: expected the dtype of cos"),
        (dict(cos=cos.to("meta"), sin=sin.to("meta")), ValueError, "^k_nope, k_pe, v, cos, sin: expected one device"),
    ]
    for change, exc, words in cases:
        args = dict(k_nope=kv[..., :128], k_pe=k_pe, v=kv[..., 128:], layout="bshd", backend="torch")
        args.update(change)
        with pytest.raises(exc, match=words):
            mxag.mla_kv_mxfp8(**args)


# ------------------------------------------------------------------------------------------------
# spec.mla_kv itself (NumPy): the op mla_kv_mxfp8's forward runs, its layouts and its validator


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shared", [True, False], ids=["shared_pe", "per_head_pe"])
@pytest.mark.parametrize("dtype", [BF16, np.float16, np.float32], ids=["bf16", "f16", "f32"])
def test_spec_is_the_parts_side_by_side(layout, shared, dtype):
    """SEMANTICS 9: k's codes and scales are k_nope's and k_pe's (repeated over the heads when shared),
    each quantized on its own; v is v quantized along the sequence axis."""
    kv, k_pe = _inputs(layout, 1.0, shared=shared)
    kv, k_pe = kv.float().numpy().astype(dtype), k_pe.float().numpy().astype(dtype)
    lead, seq, head = LAYOUTS[layout]
    assert spec.mla_kv.mla_kv_axes(layout) == (seq, head)
    assert spec.mla_kv.MLA_KV_LAYOUTS[layout] == (len(lead) + 1, seq, head)
    k, v = spec.mla_kv_quantize(kv[..., :128], k_pe, kv[..., 128:], layout=layout)
    assert (k.axis, k.elem, k.scale_layout, k.data.shape, k.scale.shape) == \
        (len(lead), "e4m3", "compact", lead + (192,), lead + (6,))
    kn = spec.mxfp8_quantize(kv[..., :128], axis=-1)
    kp = spec.mxfp8_quantize(k_pe, axis=-1)
    reps = tuple(lead[head] // k_pe.shape[head] if i == head else 1 for i in range(len(lead))) + (1,)
    assert_bytes_equal(k.data, np.concatenate([kn.data, np.tile(kp.data, reps)], axis=-1), "k codes")
    assert_bytes_equal(k.scale, np.concatenate([kn.scale, np.tile(kp.scale, reps)], axis=-1), "k scales")
    want_v = spec.mxfp8_quantize(kv[..., 128:], axis=seq)
    assert v.axis == seq
    assert_bytes_equal(v.data, want_v.data, "v codes")
    assert_bytes_equal(v.scale, want_v.scale, "v scales")


SPECIAL = {BF16: (2.0 ** -133, float(ml_dtypes.finfo(BF16).max)), np.float16: (2.0 ** -20, 65504.0),
           np.float32: (2.0 ** -140, float(np.finfo(np.float32).max))}  # (a subnormal, the largest finite)


def _spec_rope_case(layout, shared, dtype, table_dtype):
    """NumPy (k_nope, k_pe, v, cos, sin) with special values in k_pe (+-0, subnormals, +-largest, +-Inf,
    NaN, an all-NaN row) and in the tables (zeros, -0, a subnormal, huge entries, +-Inf, NaN)."""
    lead, _, head = LAYOUTS[layout]
    rng = np.random.default_rng(zlib.crc32(repr(("spec rope", layout, shared, str(dtype), str(table_dtype))).encode()))
    kv = np.clip(random_magnitudes(rng, lead + (256,)), -6e4, 6e4).astype(dtype)
    pe_lead = tuple(1 if i == head and shared else n for i, n in enumerate(lead))
    k_pe = np.clip(random_magnitudes(rng, pe_lead + (64,)), -6e4, 6e4)
    sub, big = SPECIAL[dtype]
    pe = k_pe.reshape(-1, 64)
    pe[0] = np.nan                                       # all-NaN blocks before and after the rotation
    pe[1, :8] = [0.0, -0.0, -0.0, 0.0, sub, -sub, big, -big]
    pe[2, 10:14] = [np.inf, -np.inf, 1.0, np.nan]
    pe[3, 32:64] = 0.0
    k_pe = k_pe.astype(dtype)
    rows = LAYOUTS[layout][0][LAYOUTS[layout][1]] + 4
    cos, sin = (rng.uniform(-1, 1, (rows, 64)).astype(np.float32) for _ in range(2))
    cos[1, :5] = [0.0, -0.0, 2.0 ** -133, 2.0 ** 120, -2.0 ** 120]
    sin[1, 30:34] = [-0.0, 2.0 ** 120, np.inf, 0.0]
    sin[2, 40:43] = [np.inf, -np.inf, np.nan]
    cos[4, 7] = np.nan
    return kv[..., :128], k_pe, kv[..., 128:], cos.astype(table_dtype), sin.astype(table_dtype)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shared", [True, False], ids=["shared_pe", "per_head_pe"])
@pytest.mark.parametrize("dtype", [BF16, np.float16, np.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("table_dtype", [np.float32, BF16], ids=["f32_tables", "bf16_tables"])
def test_spec_rope_inside_is_rope_then_the_op(layout, shared, dtype, table_dtype):
    """SEMANTICS 9: with tables, the bytes of rope(k_pe, cos, sin, style="mla", layout) in k_pe's dtype
    given to the op without tables."""
    k_nope, k_pe, v, cos, sin = _spec_rope_case(layout, shared, dtype, table_dtype)
    k, vq = spec.mla_kv_quantize(k_nope, k_pe, v, layout=layout, cos=cos, sin=sin)
    rotated = spec.rope(k_pe, cos, sin, style="mla", layout=layout)
    assert rotated.dtype == k_pe.dtype
    want_k, want_v = spec.mla_kv_quantize(k_nope, rotated, v, layout=layout)
    for got, want, name in ((k, want_k, "k"), (vq, want_v, "v")):
        assert (got.axis, got.elem, got.scale_layout) == (want.axis, want.elem, want.scale_layout)
        assert_bytes_equal(got.data, want.data, f"{name} codes")
        assert_bytes_equal(got.scale, want.scale, f"{name} scales")
    plain_k, plain_v = spec.mla_kv_quantize(k_nope, k_pe, v, layout=layout)
    assert_bytes_equal(k.data[..., :128], plain_k.data[..., :128], "k_nope part untouched")
    assert_bytes_equal(vq.data, plain_v.data, "v untouched")
    assert not np.array_equal(k.data[..., 128:].view(np.uint8), plain_k.data[..., 128:].view(np.uint8))
    nan_rows = np.broadcast_to(np.isnan(rotated.astype(np.float32)).all(axis=-1), k.data.shape[:-1])
    assert nan_rows.any() and (k.data[..., 128:].view(np.uint8)[nan_rows] == 0x7F).all()  # all-NaN blocks


def test_spec_rope_positions_are_sequence_indices():
    """bshd batch entries and a thd sequence each start at position 0: the same rows rotate alike."""
    k_nope, k_pe, v, cos, sin = _spec_rope_case("bshd", True, BF16, np.float32)
    k_pe = np.ascontiguousarray(np.broadcast_to(k_pe[:1], k_pe.shape))  # batch 1 = batch 0
    k, _ = spec.mla_kv_quantize(k_nope, k_pe, v, layout="bshd", cos=cos, sin=sin)
    assert_bytes_equal(k.data[1, ..., 128:], k.data[0, ..., 128:], "batch entries share positions")
    kt, _ = spec.mla_kv_quantize(k_nope[0], k_pe[0], v[0], layout="thd", cos=cos, sin=sin)
    assert_bytes_equal(kt.data[..., 128:], k.data[0, ..., 128:], "thd is one sequence")


def test_spec_layout_helper_refuses_unknown_layouts():
    with pytest.raises(ValueError, match="layout"):
        spec.mla_kv.mla_kv_axes("bhsd")


def test_spec_validator_words_as_mla_kv_mxfp8():
    """spec.validate_mla_kv_quantize raises what mla_kv_mxfp8's own check raises, in the same words
    (dtypes spelt without torch.), except where the two say different true things: the spec also
    takes NumPy arrays, and gives its own reason for k_pe's dtype."""
    from tests.conformance.test_mla_kv import BAD, _good

    for change, exc, _ in BAD:
        k_nope, k_pe, v = _good()
        args = dict(k_nope=k_nope, k_pe=k_pe, v=v, layout="bshd")
        args.update(change)
        got = []
        for check in (mxag._check_kv, spec.validate_mla_kv_quantize):
            with pytest.raises(exc) as info:
                check(args["k_nope"], args["k_pe"], args["v"], args["layout"], args.get("cos"), args.get("sin"))
            got.append(str(info.value).replace("torch.", ""))
        if "expected a" in got[0] and "Tensor" in got[0] or "dtype of k_nope" in got[0]:
            got = [g.split(" (")[0].split(" expected a")[0] for g in got]
        assert got[0] == got[1], change
