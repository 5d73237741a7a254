"""The cuDNN backend on CPU, with the frontend and the machine mocked.

A fake `cudnn` module (put in sys.modules) records every graph, tensor, op, build and execute; the
machine's answers (compute capability, cuDNN version, CUDA placement) are replaced through
backends.cudnn._common. This proves what the backend asks the library for -- shapes, dtypes,
layouts, strides, scale bytes, mask attributes -- and how it maps the library's outputs, on paths
no machine of this project can run (sm100). It does not prove cuDNN computes the right numbers:
tests/conformance/test_attention.py (cudnn-cuda target) and test_attention_cudnn.py do that on the GPU.
"""
from __future__ import annotations

import importlib
import sys
import time
import types

import numpy as np
import pytest

import spec
from tests.util import BF16, assert_bytes_equal

torch = pytest.importorskip("torch")
from backends import registry  # noqa: E402
from backends.convert import to_numpy, to_torch  # noqa: E402
from backends.cudnn import _common, _scales  # noqa: E402
from backends.cudnn import attention as att  # noqa: E402
from backends.cudnn import mla_q as mq  # noqa: E402


# --------------------------------------------------------------------------------------------------
# The fake frontend
# --------------------------------------------------------------------------------------------------

class _Enum:
    """An enum namespace whose members are their own names (so recorded calls read plainly)."""

    def __init__(self, *names):
        for n in names:
            setattr(self, n, n)


class FakeTensor:
    def __init__(self, graph, **kw):
        self.graph = graph
        self.attrs = dict(kw)
        self.attrs.setdefault("is_output", False)

    def _set(self, key, value):
        self.attrs[key] = value
        return self

    def set_output(self, v):
        return self._set("is_output", v)

    def set_dim(self, v):
        return self._set("dim", list(v))

    def set_stride(self, v):
        return self._set("stride", list(v))

    def set_data_type(self, v):
        return self._set("data_type", v)

    def set_uid(self, v):
        return self._set("uid", v)

    def set_ragged_offset(self, v):
        return self._set("ragged_offset", v)

    def get_uid(self):
        return self.attrs["uid"]

    def __getitem__(self, key):
        return self.attrs.get(key)


OUTPUT_ARITY = {"sdpa": 2, "sdpa_backward": 3, "sdpa_mxfp8": 3, "sdpa_mxfp8_backward": 6}
WORKSPACE = 4096


class FakeGraph:
    instances: list = []
    on_execute = None  # callable(graph, pack) to emulate writes into output buffers

    def __init__(self, **kw):
        self.ctor = kw
        self.tensors = []
        self.ops = []
        self.built_with = None
        self.executions = []
        FakeGraph.instances.append(self)

    def tensor(self, **kw):
        t = FakeTensor(self, **kw)
        self.tensors.append(t)
        return t

    def _op(self, name, args, kw):
        outs = [FakeTensor(self, name=f"{name}::out{i}") for i in range(OUTPUT_ARITY[name])]
        self.ops.append((name, args, kw, outs))
        self.tensors.extend(outs)
        return outs

    def sdpa(self, *args, **kw):
        return self._op("sdpa", args, kw)

    def sdpa_backward(self, *args, **kw):
        return self._op("sdpa_backward", args, kw)

    def sdpa_mxfp8(self, *args, **kw):
        return self._op("sdpa_mxfp8", args, kw)

    def sdpa_mxfp8_backward(self, *args, **kw):
        return self._op("sdpa_mxfp8_backward", args, kw)

    def build(self, heuristics=None):
        self.built_with = heuristics

    def get_workspace_size(self):
        return WORKSPACE

    def execute(self, pack, workspace=None, handle=None, tensor_uids=None):
        if tensor_uids is not None:  # the ordered form: buffers and their uids
            assert len(tensor_uids) == len(pack) == len(set(tensor_uids))
            pack = dict(zip(tensor_uids, pack))
        self.executions.append((dict(pack), workspace, handle))
        if FakeGraph.on_execute is not None:
            FakeGraph.on_execute(self, pack)

    # helpers for the tests
    def by_uid(self, uid):
        (t,) = [t for t in self.tensors if t["uid"] == uid]
        return t


class FakeHandle:
    def __init__(self):
        self.streams = []


def make_fake_cudnn(version="1.32.0", backend=92100, with_mxfp8=True):
    m = types.ModuleType("cudnn")
    m.__version__ = version
    m.backend_version = lambda: backend
    m.data_type = _Enum("BFLOAT16", "FLOAT", "INT32", "INT64", "FP8_E4M3", "FP8_E8M0", "HALF")
    m.tensor_reordering = _Enum("NONE", "F8_128x4")
    m.diagonal_alignment = _Enum("TOP_LEFT", "BOTTOM_RIGHT")
    m.heur_mode = _Enum("A", "B", "FALLBACK")
    m.create_handle = FakeHandle
    m.set_stream = lambda h, s: h.streams.append(s)
    # an old frontend: a graph class without the MXFP8 builders
    m.pygraph = FakeGraph if with_mxfp8 else type("OldGraph", (), {"sdpa": FakeGraph.sdpa})
    m.wrapper_calls = []

    def wrapper(x, w, cos, sin, x_scale=None, w_scale=None, w_out_in=True, stream=None):
        m.wrapper_calls.append(dict(x=x, w=w, cos=cos, sin=sin, x_scale=x_scale, w_scale=w_scale,
                                    w_out_in=w_out_in, stream=stream))
        t, h = x.shape[0], w.shape[0] // 192
        return {
            "out_fp8_row": torch.zeros(t, h, 192, dtype=torch.float8_e4m3fn),
            "out_scales_row": torch.zeros(t, h, 6, dtype=torch.uint8),
            "out_fp8_col": torch.zeros(t, h, 192, dtype=torch.float8_e4m3fn),
            "out_scales_col": torch.zeros(t // 32, h, 192, dtype=torch.uint8),
        }

    m.gemm_proj_rope_mxfp8_wrapper_sm100 = wrapper
    return m


@pytest.fixture
def fake(monkeypatch):
    """A fake frontend plus a pretend sm100 machine with cuDNN 9.21; tensors stay on the CPU."""
    m = make_fake_cudnn()
    monkeypatch.setitem(sys.modules, "cudnn", m)
    monkeypatch.setattr(_common, "cuda_reasons", lambda values: [])
    monkeypatch.setattr(_common, "device_capability", lambda dev: (10, 0))
    monkeypatch.setattr(_common, "missing_modules", lambda names: [])
    monkeypatch.setattr(att, "BIND", "view")
    FakeGraph.instances = []
    FakeGraph.on_execute = None
    att.clear_cache()
    _common.reset_handles()
    yield m
    att.clear_cache()
    _common.reset_handles()
    FakeGraph.on_execute = None


def set_machine(monkeypatch, cc=(10, 0), cudnn=92100):
    monkeypatch.setattr(_common, "device_capability", lambda dev: cc)
    monkeypatch.setattr(_common, "backend_version", lambda: cudnn)


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------

def bf16_inputs(seed, b, s_q, s_kv, h, layout):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, s_q, h, 192)).astype(BF16)
    k = rng.standard_normal((b, s_kv, h, 192)).astype(BF16)
    v = rng.standard_normal((b, s_kv, h, 128)).astype(BF16)
    do = rng.standard_normal((b, s_q, h, 128)).astype(BF16)
    arrs = [q, k, v, do]
    if layout == "sbhd":
        arrs = [np.ascontiguousarray(np.swapaxes(a, 0, 1)) for a in arrs]
    return [to_torch(a) for a in arrs]


def mx_inputs(seed, b, s_q, s_kv, h, layout, swizzled=False):
    """Spec-quantized MXFP8 q, k (along D) and v (along S), as numpy and torch MXTensors."""
    rng = np.random.default_rng(seed)
    shape = (b, s_q, h) if layout == "bshd" else (s_q, b, h)
    kv_shape = (b, s_kv, h) if layout == "bshd" else (s_kv, b, h)
    mags = 2.0 ** rng.integers(-8, 9, size=h)
    q = (rng.standard_normal(shape + (192,)) * mags[:, None]).astype(np.float32)
    k = rng.standard_normal(kv_shape + (192,)).astype(np.float32)
    v = (rng.standard_normal(kv_shape + (128,)) * mags[:, None]).astype(np.float32)
    s_axis = 1 if layout == "bshd" else 0
    lay = "swizzled" if swizzled else "compact"
    q_mx = spec.mxfp8_quantize(q, axis=-1, scale_layout=lay)
    k_mx = spec.mxfp8_quantize(k, axis=-1)
    v_mx = spec.mxfp8_quantize(v, axis=s_axis, scale_layout=lay)
    return (q_mx, k_mx, v_mx), to_torch([q_mx, k_mx, v_mx])


def e8m0_bytes(bound: torch.Tensor) -> np.ndarray:
    """The bytes a bound scale view addresses, in the packed buffer's own order."""
    base = bound
    if base.dtype != torch.uint8:
        base = base.view(torch.uint8)
    if not base.is_contiguous():  # a v-role view [B, H, S'', D'] with S'' fastest
        b, h, sp, dp = base.shape
        base = base.transpose(2, 3).contiguous().view(b, h, sp, dp)
    return base.numpy()


def contig_strides(shape):
    return list(torch.empty(shape).stride())


# --------------------------------------------------------------------------------------------------
# Scale re-layout: torch twin of spec.pack_attention_scales, byte for byte
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("swizzled", [False, True])
@pytest.mark.parametrize("s_q,s_kv", [(32, 64), (160, 96), (288, 256)])
def test_pack_attention_scales_matches_spec(layout, swizzled, s_q, s_kv):
    (q_np, k_np, v_np), (q_t, k_t, v_t) = mx_inputs(1, 2, s_q, s_kv, 3, layout, swizzled)
    for role, a_np, a_t in (("qk", q_np, q_t), ("qk", k_np, k_t), ("v", v_np, v_t)):
        got = _scales.pack_attention_scales(a_t, role, layout)
        want = spec.pack_attention_scales(a_np, role, layout)
        assert got.dtype == torch.uint8 and got.is_contiguous()
        assert_bytes_equal(got, want, f"{role} {layout} swizzled={swizzled}")


def plane_major_reference(t_np, layout):
    """The frontend's dense columnwise F8_128x4 order, built element by element from its documented
    atom formula: scale (b, h, s_blk, d) at atom plane*(B*H*T) + (b*H + h)*T + s_blk//4, byte
    (r % 32)*16 + (r // 32)*4 + s_blk % 4, r = d % 128, plane = d // 128, T = roundup(S/32, 4)/4."""
    scale = np.asarray(spec.unswizzle_scales(t_np).scale)
    if layout == "sbhd":
        scale = np.swapaxes(scale, 0, 1)  # -> [B, S/32, H, D]
    b, sb, h, d = scale.shape
    ss, dp = -(-sb // 4) * 4, -(-d // 128) * 128
    t_per = ss // 4
    out = np.zeros(b * h * ss * dp, dtype=np.uint8)
    for bi in range(b):
        for hi in range(h):
            for blk in range(sb):
                for di in range(d):
                    atom = (di // 128) * (b * h * t_per) + (bi * h + hi) * t_per + blk // 4
                    r = di % 128
                    out[atom * 512 + (r % 32) * 16 + (r // 32) * 4 + blk % 4] = scale[bi, blk, hi, di]
    return out.reshape(b, h, ss, dp)


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("d", [128, 192])
def test_pack_columnwise(layout, d):
    """D <= 128: spec's bytes. D > 128 (the backward's q_T, k_T): the frontend's D-plane-major order,
    which differs from spec's per-(b, h) packing (module docstring of backends/cudnn/_scales.py)."""
    rng = np.random.default_rng(4)
    shape = (2, 96, 3, d) if layout == "bshd" else (96, 2, 3, d)
    x = (rng.standard_normal(shape) * 2.0 ** rng.integers(-9, 9, size=shape[:-1] + (1,))).astype(np.float32)
    t_np = spec.mxfp8_quantize(x, axis=1 if layout == "bshd" else 0)
    got = _scales.pack_columnwise(to_torch(t_np), layout)
    want = plane_major_reference(t_np, layout)
    assert_bytes_equal(got, want, f"plane-major d={d}")
    spec_bytes = spec.pack_attention_scales(t_np, "v", layout)
    assert spec_bytes.shape == want.shape
    assert np.array_equal(spec_bytes, want) == (d <= 128)


def test_pack_attention_scales_poisoned_padding_is_zero():
    """Padding bytes must be 0 whatever the allocator held: pack a 255-filled scale tensor."""
    data = torch.zeros(1, 40, 2, 192, dtype=torch.float8_e4m3fn)
    scale = torch.full((1, 40, 2, 6), 0xAB, dtype=torch.uint8)
    t = spec.MXTensor(data, scale, 3)
    got = _scales.pack_attention_scales(t, "qk", "bshd")
    assert tuple(got.shape) == (1, 2, 128, 8)
    want = spec.pack_attention_scales(spec.MXTensor(to_numpy(data), to_numpy(scale), 3), "qk")
    assert_bytes_equal(got, want)
    assert int((got == 0xAB).sum()) == 40 * 2 * 6 and int((got == 0).sum()) == got.numel() - 40 * 2 * 6


def test_compact_scales_unswizzles_like_spec():
    (q_np, _, v_np), (q_t, _, v_t) = mx_inputs(2, 1, 160, 96, 2, "sbhd", swizzled=True)
    for a_np, a_t in ((q_np, q_t), (v_np, v_t)):
        assert_bytes_equal(_scales.compact_scales(a_t).contiguous(), spec.unswizzle_scales(a_np).scale)


def test_q_row_of_fused_op_packs_like_spec():
    """mla_q_uproj_rope_quant's q_row [T, H, 192] (compact [T, H, 6]) re-laid for the MXFP8 SDPA."""
    rng = np.random.default_rng(3)
    t, h = 160, 2
    x = (rng.integers(-4, 5, size=(t, 1536)) * 0.25).astype(BF16)
    w = (rng.integers(-4, 5, size=(h * 192, 1536)) * 0.125).astype(BF16)
    cos = rng.uniform(-1, 1, size=(t, 64)).astype(BF16)
    sin = rng.uniform(-1, 1, size=(t, 64)).astype(BF16)
    q_row, q_col = spec.mla_q_uproj_rope_quant(x, w, cos, sin)
    assert q_row.scale.shape == (t, h, 6) and q_col.scale.shape == (t // 32, h, 192)
    for mx, role in ((q_row, "qk"), (q_col, "v")):
        as_bshd_np = spec.MXTensor(mx.data[None], mx.scale[None], mx.axis + 1, mx.elem)
        want = spec.pack_attention_scales(as_bshd_np, role, "bshd")
        got = _scales.pack_attention_scales(_scales.thd_as_bshd(to_torch(mx)), role, "bshd")
        assert_bytes_equal(got, want, f"q_{'row' if role == 'qk' else 'col'}")


# --------------------------------------------------------------------------------------------------
# Gating
# --------------------------------------------------------------------------------------------------

def test_missing_frontend_reasons(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)  # `import cudnn` raises ImportError
    q, k, v, _ = bf16_inputs(0, 1, 64, 64, 2, "bshd")
    reasons = att.attention_reasons(q, k, v)
    assert reasons == ["nvidia-cudnn-frontend is not installed (`import cudnn` failed)"]
    x = torch.zeros(128, 1536, dtype=torch.bfloat16)
    assert mq.mla_q_reasons(x, torch.zeros(384, 1536, dtype=torch.bfloat16), x[:, :64], x[:, :64]) == reasons
    # the package declares the backend unavailable, with the import error, and registers nothing new
    saved = dict(registry._backends)
    try:
        pkg = importlib.import_module("backends.cudnn")
        pkg._load()
        info = registry.backend_infos()["cudnn"]
        assert not info.available and info.reasons[0].startswith("nvidia-cudnn-frontend is not installed")
    finally:
        registry._backends.clear()
        registry._backends.update(saved)


def test_cpu_tensors_are_rejected(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", make_fake_cudnn())
    q, k, v, _ = bf16_inputs(0, 1, 64, 64, 2, "bshd")
    assert att.attention_reasons(q, k, v) == ["inputs are on cpu: the cudnn backend needs CUDA tensors"]
    assert "NumPy" not in " ".join(att.attention_reasons(q, k, to_numpy(v)))
    assert any("ndarray" in r for r in att.attention_reasons(q, k, to_numpy(v)))


@pytest.mark.parametrize("cc,cudnn,ok", [((9, 0), 91900, True), ((10, 0), 92400, True), ((8, 0), 91900, False),
                                         ((9, 0), 91001, False), ((9, 0), 91002, True)])
def test_bf16_gating(fake, monkeypatch, cc, cudnn, ok):
    set_machine(monkeypatch, cc, cudnn)
    q, k, v, do = bf16_inputs(0, 1, 64, 64, 2, "bshd")
    reasons = att.attention_reasons(q, k, v, causal=True)
    assert (reasons == []) == ok, reasons
    if cc < (9, 0):
        assert reasons == ["cudnn graph SDPA (bf16, d_qk 192 / d_v 128) needs compute capability >= 9.0, "
                           "cpu is 8.0"]
    if cudnn == 91001:
        assert "needs cuDNN >= 9.10.2, found 9.10.1" in reasons[0]


def test_bf16_dtype_and_layout_reasons(fake, monkeypatch):
    set_machine(monkeypatch, (9, 0), 91900)
    q, k, v, do = bf16_inputs(0, 1, 64, 64, 2, "bshd")
    r = att.attention_reasons(q.half(), k.half(), v.half())
    assert r[0] == "q: the cudnn graph SDPA path takes bfloat16, got torch.float16"
    wide = torch.zeros(1, 64, 2, 400, dtype=torch.bfloat16)
    q_odd = wide[..., 3:195]  # strides fine; the base address is 6 bytes off: copied at call time, not a reason
    assert att.attention_reasons(q_odd, k, v) == []
    q_step = torch.zeros(1, 64, 2, 384, dtype=torch.bfloat16)[..., ::2]
    assert att.attention_reasons(q_step, k, v) == [
        "q: the feature (last) axis must be contiguous for cuDNN, got strides (49152, 768, 384, 2)"]
    q_pad = torch.zeros(1, 64, 2, 196, dtype=torch.bfloat16)[..., :192]
    assert att.attention_reasons(q_pad, k, v) == [
        "q: strides must be multiples of 8 elements (16 bytes) for cuDNN, got strides (25088, 392, 196, 1)"]
    t_q = torch.zeros(64, 2, 192, dtype=torch.bfloat16)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    assert att.attention_reasons(t_q, t_q, t_q[..., :128].contiguous(), layout="thd", cu_seqlens_q=cu,
                                 cu_seqlens_kv=cu) == []
    r = att.attention_reasons(t_q, t_q, t_q[..., :128], layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert r == ["v: thd tensors must be contiguous [T, H, D] (ragged offsets assume a token stride of H*D), "
                 "got strides (384, 192, 1)"]
    _, (qm, km, vm) = mx_inputs(0, 1, 64, 64, 2, "bshd")
    assert att.attention_reasons(qm, k, v) == [
        "cudnn needs q, k, v all bfloat16 or all MXFP8 (MXFP8 SDPA takes no mixed operands)"]


MX_GATES = [
    ((9, 0), 92100, ["cudnn MXFP8 SDPA needs compute capability 10.x (sm100 family), cpu is 9.0"]),
    ((12, 0), 92100, ["cudnn MXFP8 SDPA needs compute capability 10.x (sm100 family), cpu is 12.0"]),
    ((10, 0), 92000, ["cudnn MXFP8 SDPA needs cuDNN >= 9.21.0, found 9.20.0"]),
    ((10, 0), 92300, ["cudnn MXFP8 SDPA: cuDNN 9.23.0 is excluded (9.23.0 and 9.23.1 are known-bad for this path)"]),
    ((10, 0), 92301, ["cudnn MXFP8 SDPA: cuDNN 9.23.1 is excluded (9.23.0 and 9.23.1 are known-bad for this path)"]),
    ((10, 0), 92100, []),
    ((10, 3), 92400, []),
    ((10, 0), 92302, []),
]


@pytest.mark.parametrize("cc,cudnn,want", MX_GATES, ids=[f"sm{c[0]}{c[1]}-{v}" for c, v, _ in MX_GATES])
def test_mxfp8_gating(fake, monkeypatch, cc, cudnn, want):
    # the native MXFP8 graph's gate; where it declines, the dequantized route (bf16 graph) serves
    set_machine(monkeypatch, cc, cudnn)
    _, (q, k, v) = mx_inputs(0, 1, 64, 64, 2, "bshd")
    assert att._mxfp8_reasons(q, k, v, True, "bshd", backward=False) == want
    assert att.mx_route(q, k, v, True, "bshd", backward=False) == ("dequantized" if want else "native", [])
    assert att.attention_reasons(q, k, v, causal=True) == []
    do = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 64)
    extra = (("o", do), ("do", do))
    assert att._mxfp8_reasons(q, k, v, True, "bshd", backward=True, extra=extra) == [
        r.replace("MXFP8 SDPA", "MXFP8 SDPA backward") for r in want]
    assert att.attention_backward_reasons(do, q, k, v, do, lse, causal=True) == []


def test_sm90_mxfp8_takes_the_dequantized_route(fake, monkeypatch):
    """The H200: bf16 served by the bf16 graph, MXFP8 by the same graph on its exact bf16 dequantization."""
    set_machine(monkeypatch, (9, 0), 91900)
    q, k, v, _ = bf16_inputs(0, 1, 64, 64, 2, "bshd")
    assert att.attention_reasons(q, k, v, causal=True) == []
    _, (qm, km, vm) = mx_inputs(0, 1, 64, 64, 2, "bshd")
    assert att.mx_route(qm, km, vm, False, "bshd", backward=False) == ("dequantized", [])
    assert att.attention_reasons(qm, km, vm) == []
    assert att._mxfp8_reasons(qm, km, vm, False, "bshd", backward=False) == [
        "cudnn MXFP8 SDPA needs compute capability 10.x (sm100 family), cpu is 9.0",
        "cudnn MXFP8 SDPA needs cuDNN >= 9.21.0, found 9.19.0"]
    FakeGraph.instances = []
    monkeypatch.setattr(att, "_dequantize_bf16",
                        lambda *ts: [to_torch(spec.mxfp8_dequantize(to_numpy(t), "bfloat16")) for t in ts])
    att.mla_attention(qm, km, vm, causal=True)
    ops = [op[0] for g in FakeGraph.instances for op in g.ops]
    assert "sdpa" in ops and "sdpa_mxfp8" not in ops


def test_mxfp8_rejected_by_both_routes(fake, monkeypatch):
    set_machine(monkeypatch, (8, 0), 91900)
    _, (qm, km, vm) = mx_inputs(0, 1, 64, 64, 2, "bshd")
    r = att.attention_reasons(qm, km, vm)
    assert r[0] == "cudnn MXFP8 SDPA needs compute capability 10.x (sm100 family), cpu is 8.0"
    assert "dequantized route: cudnn graph SDPA on dequantized MXFP8 (bf16 graph) needs compute capability >= 9.0, cpu is 8.0" in r


def test_mxfp8_shape_and_frontend_reasons(fake, monkeypatch):
    # the native graph's own conditions (att._mxfp8_reasons); the dequantized route takes these shapes
    _, (q, k, v) = mx_inputs(0, 1, 96, 128, 2, "bshd")
    assert att.attention_reasons(q, k, v, causal=True) == []
    r = att._mxfp8_reasons(q, k, v, True, "bshd", backward=False)
    assert r == ["cudnn MXFP8 SDPA: a bottom-right causal mask (S_q 96 < S_kv 128) needs S_q and S_kv multiples "
                 "of 64 in cuDNN's FP8 SDPA"]
    assert att._mxfp8_reasons(q, k, v, False, "bshd", backward=False) == []
    _, (q, k, v) = mx_inputs(0, 1, 80, 64, 2, "bshd")
    do = torch.zeros(1, 80, 2, 128, dtype=torch.bfloat16)
    r = att._mxfp8_reasons(q, k, v, False, "bshd", backward=True, extra=(("o", do), ("do", do)))
    assert r == ["cudnn MXFP8 SDPA backward: S_q (80) must be a multiple of 32 (q and do are quantized along S "
                 "for dK = dS^T q and dV = P^T dO)"]
    (qn, kn, vn), _ = mx_inputs(0, 1, 64, 64, 2, "bshd")
    q5 = to_torch(spec.mxfp8_quantize(spec.mxfp8_dequantize(qn), axis=-1, elem="e5m2"))
    _, (q, k, v) = mx_inputs(0, 1, 64, 64, 2, "bshd")
    assert att._mxfp8_reasons(q5, k, v, False, "bshd", backward=False) == ["q: cuDNN MXFP8 SDPA takes e4m3 codes, got e5m2"]
    thd = spec.MXTensor(q.data[0], q.scale[0], 2)
    kt = spec.MXTensor(k.data[0], k.scale[0], 2)
    vt = to_torch(spec.mxfp8_quantize(spec.mxfp8_dequantize(vn)[0], axis=0))
    cu = torch.tensor([0, 64], dtype=torch.int32)
    r = att._mxfp8_reasons(thd, kt, vt, False, "thd", backward=False)
    assert r == ["MXFP8 attention in thd layout: cuDNN's per-(batch, head) F8_128x4 scale tensors would need "
                 "per-sequence padding; use bshd or sbhd"]
    monkeypatch.setitem(sys.modules, "cudnn", make_fake_cudnn(version="1.20.0", with_mxfp8=False))
    assert att._mxfp8_reasons(q, k, v, False, "bshd", backward=False) == ["nvidia-cudnn-frontend 1.20.0 has no pygraph.sdpa_mxfp8"]


def mla_q_inputs(t=128, h=2, mx=False):
    x = torch.zeros(t, 1536, dtype=torch.bfloat16)
    w = torch.zeros(h * 192, 1536, dtype=torch.bfloat16)
    cos = torch.zeros(t, 64, dtype=torch.bfloat16)
    sin = torch.zeros(t, 64, dtype=torch.bfloat16)
    if mx:
        x = spec.MXTensor(torch.zeros(t, 1536, dtype=torch.float8_e4m3fn), torch.zeros(t, 48, dtype=torch.uint8), 1)
        w = spec.MXTensor(torch.zeros(h * 192, 1536, dtype=torch.float8_e4m3fn),
                          torch.zeros(h * 192, 48, dtype=torch.uint8), 1)
    return x, w, cos, sin


def test_mla_q_gating(fake, monkeypatch):
    assert mq.mla_q_reasons(*mla_q_inputs()) == []
    assert mq.mla_q_reasons(*mla_q_inputs(mx=True)) == []
    set_machine(monkeypatch, (9, 0), 91900)
    assert mq.mla_q_reasons(*mla_q_inputs()) == [
        "gemm_proj_rope_mxfp8_wrapper_sm100 (tcgen05 kernel) needs compute capability 10.x (sm100 family), cpu is 9.0"]
    set_machine(monkeypatch, (10, 0), 92100)
    x, w, cos, sin = mla_q_inputs(t=96)
    assert mq.mla_q_reasons(x, w, cos, sin) == [
        "x: the fused kernel needs the token count to be a multiple of 128, got 96"]
    x, w, cos, sin = mla_q_inputs()
    assert mq.mla_q_reasons(x, w, cos.float(), sin) == [
        "cos: the fused kernel takes bfloat16 [T, 64] tables, got torch.float32"]
    assert mq.mla_q_reasons(x, w, torch.zeros(64, 128, dtype=torch.bfloat16).t(), sin) == [
        "cos: the fused kernel needs C-contiguous tensors, got strides (1, 128)"]
    x, w, cos, sin = mla_q_inputs(h=3, mx=True)
    assert mq.mla_q_reasons(x, w, cos, sin) == [
        "w: the MXFP8-input kernel needs an even head count (scale-relay pairing), got 3"]
    x, w, cos, sin = mla_q_inputs(mx=True)
    w_sw = spec.MXTensor(w.data, torch.zeros(384, 48, dtype=torch.uint8), 1, "e4m3", "swizzled")
    assert mq.mla_q_reasons(x, w_sw, cos, sin) == [
        "w: the MXFP8 kernel takes compact [rows, K/32] scales, got swizzled (unswizzle first)"]


def test_mla_q_missing_packages_and_old_frontend(fake, monkeypatch):
    monkeypatch.setattr(_common, "missing_modules", lambda names: [n for n in names if n != "cuda.bindings"])
    assert mq.mla_q_reasons(*mla_q_inputs()) == [
        "gemm_proj_rope_mxfp8_wrapper_sm100 needs nvidia-cutlass-dsl (module 'cutlass'), which is not installed",
        "gemm_proj_rope_mxfp8_wrapper_sm100 needs apache-tvm-ffi (module 'tvm_ffi'), which is not installed"]
    monkeypatch.setattr(_common, "missing_modules", lambda names: [])
    monkeypatch.setitem(sys.modules, "cudnn", make_fake_cudnn(version="1.26.1"))
    assert mq.mla_q_reasons(*mla_q_inputs()) == [
        "gemm_proj_rope_mxfp8_wrapper_sm100 needs nvidia-cudnn-frontend >= 1.27, found 1.26.1"]


def test_missing_modules_is_real():
    assert _common.missing_modules(("os", "no_such_module_xyz", "no_such_pkg.sub")) == [
        "no_such_module_xyz", "no_such_pkg.sub"]


def test_version_helpers():
    assert _common.version_text(92301) == "9.23.1"
    assert _common.parse_version("1.32.0rc1") == (1, 32, 0)
    assert _common.parse_version("1.27.0+cu13") == (1, 27, 0)


# --------------------------------------------------------------------------------------------------
# bf16 graph SDPA: what the backend asks cuDNN for
# --------------------------------------------------------------------------------------------------

def bhsd(shape, stride, layout):
    p = (0, 2, 1, 3) if layout == "bshd" else (1, 2, 0, 3)
    return [shape[i] for i in p], [stride[i] for i in p]


def read_declared(buf: torch.Tensor, declared: FakeTensor) -> torch.Tensor:
    """What a kernel reading the declaration (dims, strides from the buffer's address) sees."""
    return torch.as_strided(buf, declared["dim"], declared["stride"], buf.storage_offset())


def assert_bound(buf, declared: FakeTensor, like: torch.Tensor = None, expect: torch.Tensor = None):
    """A bound buffer either is a view with the declared dims and strides, or is dense and exactly as
    large as the declaration (the frontend re-describes such a buffer as the declaration). `like`: the
    tensor whose memory it must be; `expect`: what reading it through the declaration must give."""
    if list(buf.shape) == declared["dim"]:
        assert list(buf.stride()) == declared["stride"], (list(buf.stride()), declared["stride"])
    else:
        assert buf.is_contiguous() and buf.numel() == int(np.prod(declared["dim"])), (buf.shape, declared["dim"])
    if like is not None:
        assert buf.data_ptr() == like.data_ptr()
    if expect is not None:
        got = read_declared(buf, declared)
        assert got.shape == expect.shape and torch.equal(got.view(torch.uint8) if got.element_size() == 1
                                                         else got, expect.view(torch.uint8)
                                                         if expect.element_size() == 1 else expect)


def fill_outputs(values):
    """on_execute hook: write constants into the output buffers bound to the given uids."""
    def hook(graph, pack):
        for uid, value in values.items():
            if uid in pack:
                pack[uid].fill_(value)
    return hook


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("s_q,s_kv,causal", [(64, 64, True), (48, 80, True), (64, 96, False)])
def test_bf16_forward_graph(fake, layout, s_q, s_kv, causal):
    q, k, v, _ = bf16_inputs(0, 2, s_q, s_kv, 3, layout)
    FakeGraph.on_execute = fill_outputs({att.O: 1.5, att.STATS: -2.0})
    o, lse = att.mla_attention(q, k, v, causal=causal, layout=layout)
    (g,) = FakeGraph.instances
    dt = fake.data_type
    assert g.ctor == dict(io_data_type="BFLOAT16", intermediate_data_type="FLOAT", compute_data_type="FLOAT",
                          handle=g.ctor["handle"])
    assert isinstance(g.ctor["handle"], FakeHandle)
    for uid, t in ((att.Q, q), (att.K, k), (att.V, v)):
        d, s = bhsd(t.shape, t.stride(), layout)
        assert (g.by_uid(uid)["dim"], g.by_uid(uid)["stride"], g.by_uid(uid)["data_type"]) == (d, s, dt.BFLOAT16)
    ((name, args, kw, outs),) = g.ops
    assert name == "sdpa" and [a["uid"] for a in args] == [att.Q, att.K, att.V]
    want_kw = dict(attn_scale=1 / np.sqrt(192), generate_stats=True, name="mla_sdpa")
    if causal:
        want_kw.update(diagonal_alignment="TOP_LEFT" if s_q == s_kv else "BOTTOM_RIGHT", diagonal_band_right_bound=0)
    assert kw == want_kw
    o_decl, st_decl = outs
    b, h = 2, 3
    od, os_ = bhsd(o.shape, contig_strides(o.shape), layout)
    assert (o_decl["dim"], o_decl["stride"], o_decl["data_type"], o_decl["is_output"]) == (od, os_, "BFLOAT16", True)
    assert (st_decl["dim"], st_decl["stride"], st_decl["data_type"]) == ([b, h, s_q, 1], [h * s_q, s_q, 1, 1], "FLOAT")
    assert g.built_with == ["A", "FALLBACK"]
    ((pack, ws, handle),) = g.executions
    assert ws.dtype == torch.uint8 and ws.numel() == WORKSPACE and handle is g.ctor["handle"]
    assert handle.streams == [0]  # bound once to torch's current stream (0 off CUDA), not again per call
    perm = (0, 2, 1, 3) if layout == "bshd" else (1, 2, 0, 3)
    for uid, t in ((att.Q, q), (att.K, k), (att.V, v)):
        assert_bound(pack[uid], g.by_uid(uid), t, expect=t.permute(perm))
    FakeGraph.on_execute = None
    assert_bound(pack[att.O], o_decl, o, expect=o.permute(perm))
    assert_bound(pack[att.STATS], st_decl, lse, expect=lse.unsqueeze(-1))
    assert o.shape == q.shape[:-1] + (128,) and o.dtype == torch.bfloat16 and o.is_contiguous()
    assert lse.shape == (b, h, s_q) and lse.dtype == torch.float32
    assert bool((o == 1.5).all()) and bool((lse == -2.0).all())


def test_bf16_strided_views_go_in_without_copies(fake):
    """sbhd q/k/v sliced out of wider projections: the graph is told the real strides."""
    big = torch.zeros(64, 2, 3, 192 + 128 + 64, dtype=torch.bfloat16)
    q = big[..., :192]
    kv = torch.zeros(64, 2, 3, 192 + 128, dtype=torch.bfloat16)
    k, v = kv[..., :192], kv[..., 192:]
    assert not q.is_contiguous()
    att.mla_attention(q, k, v, causal=True, layout="sbhd")
    (g,) = FakeGraph.instances
    assert g.by_uid(att.Q)["stride"] == [3 * 384, 384, 2 * 3 * 384, 1]
    assert g.by_uid(att.V)["stride"] == [3 * 320, 320, 2 * 3 * 320, 1]
    pack = g.executions[0][0]
    assert_bound(pack[att.Q], g.by_uid(att.Q), q, expect=q.permute(1, 2, 0, 3))
    assert_bound(pack[att.V], g.by_uid(att.V), v, expect=v.permute(1, 2, 0, 3))
    assert list(pack[att.V].shape) == [2, 3, 64, 128]  # a strided view goes in as the declared view


def test_misaligned_base_and_do_layout_are_normalized(fake):
    """A q starting off a 16-byte boundary is copied; dO is handed over in O's layout."""
    q, k, v, do = bf16_inputs(0, 1, 64, 64, 2, "bshd")
    store = torch.zeros(q.numel() + 3, dtype=torch.bfloat16)
    q_odd = store[3:].view(q.shape).copy_(q)
    assert q_odd.data_ptr() % 16 and torch.equal(q_odd, q)
    att.mla_attention(q_odd, k, v, causal=True)
    (g,) = FakeGraph.instances
    bound = g.executions[0][0][att.Q]
    assert bound.data_ptr() % 16 == 0 and torch.equal(bound.view(q.shape), q)
    o = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    do_t = do.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides than o
    att.mla_attention_backward(do_t, q, k, v, o, torch.zeros(1, 2, 64), causal=True)
    g = FakeGraph.instances[-1]
    assert g.by_uid(att.DO)["stride"] == g.by_uid(att.O)["stride"]
    assert torch.equal(g.executions[0][0][att.DO], do)


def test_bf16_forward_sq_gt_skv_causal_masks_leading_rows(fake):
    q, k, v, _ = bf16_inputs(0, 1, 100, 64, 2, "bshd")
    FakeGraph.on_execute = fill_outputs({att.O: 1.0, att.STATS: 3.0})
    o, lse = att.mla_attention(q, k, v, causal=True)
    (g,) = FakeGraph.instances
    assert g.by_uid(att.Q)["dim"] == [1, 2, 64, 192]  # cuDNN sees only the last S_kv query rows
    assert g.ops[0][2]["diagonal_alignment"] == "TOP_LEFT"
    assert g.executions[0][0][att.Q].data_ptr() == q[:, 36:].data_ptr()
    assert bool((o[:, :36] == 0).all()) and bool((o[:, 36:] == 1).all())
    assert bool((lse[..., :36] == float("-inf")).all()) and bool((lse[..., 36:] == 3).all())


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_bf16_backward_graph(fake, layout):
    q, k, v, do = bf16_inputs(0, 2, 64, 96, 3, layout)
    o = do.clone()
    lse = torch.randn(2, 3, 64)
    FakeGraph.on_execute = fill_outputs({att.DQ: 1.0, att.DK: 2.0, att.DV: 3.0})
    dq, dk, dv = att.mla_attention_backward(do, q, k, v, o, lse, causal=True, softmax_scale=0.25, layout=layout)
    (g,) = FakeGraph.instances
    ((name, args, kw, outs),) = g.ops
    assert name == "sdpa_backward"
    assert [a["uid"] for a in args] == [att.Q, att.K, att.V, att.O, att.DO, att.STATS]
    assert kw == dict(attn_scale=0.25, name="mla_sdpa_bwd", diagonal_alignment="BOTTOM_RIGHT",
                      diagonal_band_right_bound=0)
    assert g.by_uid(att.STATS)["dim"] == [2, 3, 64, 1] and g.by_uid(att.STATS)["data_type"] == "FLOAT"
    for out, like in zip(outs, (q, k, v)):
        d, s = bhsd(like.shape, contig_strides(like.shape), layout)
        assert (out["dim"], out["stride"], out["data_type"], out["is_output"]) == (d, s, "BFLOAT16", True)
    pack = g.executions[0][0]
    assert_bound(pack[att.STATS], g.by_uid(att.STATS), lse, expect=lse.unsqueeze(-1))
    for g_out, like, val in ((dq, q, 1), (dk, k, 2), (dv, v, 3)):
        assert g_out.shape == like.shape and g_out.dtype == torch.bfloat16 and bool((g_out == val).all())


def test_bf16_backward_sq_gt_skv_zero_dq_rows(fake):
    q, k, v, do = bf16_inputs(0, 1, 80, 64, 2, "sbhd")
    lse = torch.randn(1, 2, 80)
    FakeGraph.on_execute = fill_outputs({att.DQ: 1.0, att.DK: 2.0, att.DV: 3.0})
    dq, dk, dv = att.mla_attention_backward(do, q, k, v, do, lse, causal=True, layout="sbhd")
    (g,) = FakeGraph.instances
    pack = g.executions[0][0]
    assert_bound(pack[att.STATS], g.by_uid(att.STATS), expect=lse[..., 16:, None])
    assert bool((dq[:16] == 0).all()) and bool((dq[16:] == 1).all()) and bool((dk == 2).all())


def test_graph_cache_hits(fake):
    q, k, v, _ = bf16_inputs(0, 1, 64, 64, 2, "bshd")
    before = att.build_count
    att.mla_attention(q, k, v, causal=True)
    att.mla_attention(q.clone(), k.clone(), v.clone(), causal=True)
    assert att.build_count == before + 1 and len(FakeGraph.instances) == 1
    (_, ws1, h1), (_, ws2, h2) = FakeGraph.instances[0].executions
    assert ws1 is ws2 and h1 is h2  # one workspace per (thread, device, stream), reused
    att.mla_attention(q, k, v, causal=False)  # mask is part of the key
    att.mla_attention(q, k, v, causal=True, softmax_scale=0.5)  # so is the scale
    att.mla_attention(torch.zeros(1, 64, 2, 200, dtype=torch.bfloat16)[..., :192], k, v, causal=True)  # strides
    assert att.build_count == before + 4


def test_workspace_made_per_call_where_it_may_not_be_kept(fake, monkeypatch):
    """Where backends.kept.may_keep says no (a CUDA graph's capture, or CUDA-graph trees' warm-up on
    their side stream: memory from the graph's private pool), each call gets its own workspace and
    the handle's state keeps none; elsewhere one is kept and reused."""
    from backends import kept

    q, k, v, _ = bf16_inputs(0, 1, 64, 64, 2, "bshd")
    monkeypatch.setattr(kept, "may_keep", lambda device: False)
    att.mla_attention(q, k, v, causal=True)
    att.mla_attention(q, k, v, causal=True)
    (_, ws1, _), (_, ws2, _) = FakeGraph.instances[0].executions
    assert ws1 is not ws2 and not _common._launch_state(q.device).workspaces
    monkeypatch.setattr(kept, "may_keep", lambda device: True)
    att.mla_attention(q, k, v, causal=True)
    assert list(_common._launch_state(q.device).workspaces.values()) == [FakeGraph.instances[0].executions[-1][1]]


def test_graph_cache_hit_host_time(fake):
    """Host cost of a cache hit with the library mocked out (its execute is a no-op here).

    The budget on the GPU machine is 20 us for the whole call including the frontend's execute; the
    lead measures that (benchmarks/bench_attention_cudnn.py). Here, on a shared CPU, only this
    backend's share is timed; the assertion is loose, the printed number is the data."""
    q, k, v, _ = bf16_inputs(0, 1, 64, 64, 2, "bshd")
    att.mla_attention(q, k, v, causal=True)
    FakeGraph.instances[0].execute = lambda pack, ws=None, handle=None, tensor_uids=None: None
    best = {}
    for mode in ("view", "ptr"):
        att.BIND = mode
        runs = []
        for _ in range(5):
            n = 300
            t0 = time.perf_counter()
            for _ in range(n):
                att.mla_attention(q, k, v, causal=True)
            runs.append((time.perf_counter() - t0) / n * 1e6)
        best[mode] = min(runs)
    att.BIND = "view"
    print(f"\ncudnn cache-hit host time with a no-op execute (CPU, mocked): "
          f"view {best['view']:.1f} us, ptr {best['ptr']:.1f} us per call")
    assert best["view"] < 150 and best["ptr"] < 150


# --------------------------------------------------------------------------------------------------
# bf16 thd: ragged offsets + padding mask
# --------------------------------------------------------------------------------------------------

def thd_inputs(cu_q, cu_kv, h=2, seed=0):
    rng = np.random.default_rng(seed)
    tq, tkv = cu_q[-1], cu_kv[-1]
    q = to_torch(rng.standard_normal((tq, h, 192)).astype(BF16))
    k = to_torch(rng.standard_normal((tkv, h, 192)).astype(BF16))
    v = to_torch(rng.standard_normal((tkv, h, 128)).astype(BF16))
    do = to_torch(rng.standard_normal((tq, h, 128)).astype(BF16))
    return q, k, v, do, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_kv, dtype=torch.int32)


def test_thd_forward_graph(fake):
    cu_q, cu_kv = [0, 45, 128, 131, 200], [0, 60, 130, 130, 256]
    q, k, v, _, cq, ckv = thd_inputs(cu_q, cu_kv, h=2)

    def hook(graph, pack):
        pack[att.O].fill_(1.0)
        st = pack[att.STATS]  # [B, H, S_max, 1]: stats[b, h, s] = 1000 b + 100 h + s
        b, h, s, _ = st.shape
        st.copy_((1000 * torch.arange(b)[:, None, None] + 100 * torch.arange(h)[None, :, None]
                  + torch.arange(s)[None, None, :]).float()[..., None])
    FakeGraph.on_execute = hook
    o, lse = att.mla_attention(q, k, v, causal=True, layout="thd", cu_seqlens_q=cq, cu_seqlens_kv=ckv)
    (g,) = FakeGraph.instances
    b, h, smq, smkv = 4, 2, 128, 128  # longest sequences 83 and 126, bucketed to 128
    assert g.by_uid(att.Q)["dim"] == [b, h, smq, 192] and g.by_uid(att.Q)["stride"] == [smq * h * 192, 192, h * 192, 1]
    assert g.by_uid(att.V)["dim"] == [b, h, smkv, 128] and g.by_uid(att.V)["stride"] == [smkv * h * 128, 128, h * 128, 1]
    for uid, rag in ((att.Q, att.RAG_QK), (att.K, att.RAG_KK), (att.V, att.RAG_V)):
        assert g.by_uid(uid)["ragged_offset"]["uid"] == rag
    ((name, args, kw, (o_decl, st_decl)),) = g.ops
    assert kw["use_padding_mask"] is True and kw["seq_len_q"]["uid"] == att.SEQ_Q and kw["seq_len_kv"]["uid"] == att.SEQ_KV
    assert "max_total_seq_len_q" not in kw  # forward: not set (the frontend's own torch op neither)
    assert kw["diagonal_alignment"] == "BOTTOM_RIGHT" and kw["diagonal_band_right_bound"] == 0
    assert o_decl["ragged_offset"]["uid"] == att.RAG_O and o_decl["dim"] == [b, h, smq, 128]
    assert st_decl["dim"] == [b, h, smq, 1] and st_decl.attrs.get("ragged_offset") is None
    for uid in (att.RAG_QK, att.RAG_KK, att.RAG_V, att.RAG_O):
        assert g.by_uid(uid)["dim"] == [b + 1, 1, 1, 1] and g.by_uid(uid)["data_type"] == "INT32"
    pack = g.executions[0][0]
    assert pack[att.RAG_QK].flatten().tolist() == [c * h * 192 for c in cu_q]
    assert pack[att.RAG_KK].flatten().tolist() == [c * h * 192 for c in cu_kv]
    assert pack[att.RAG_V].flatten().tolist() == [c * h * 128 for c in cu_kv]
    assert pack[att.RAG_O].flatten().tolist() == [c * h * 128 for c in cu_q]
    assert pack[att.SEQ_Q].flatten().tolist() == [45, 83, 3, 69]
    assert pack[att.SEQ_KV].flatten().tolist() == [60, 70, 0, 126]
    assert pack[att.Q].data_ptr() == q.data_ptr() and pack[att.O].data_ptr() == o.data_ptr()
    # lse[h, t] = stats[seq(t), h, pos(t)], except fully masked rows: seq 1 rows 0..12 (83 queries,
    # 70 keys, causal bottom-right) and all of seq 2 (no keys) are o = 0, lse = -inf.
    masked = set(range(45, 58)) | {128, 129, 130}
    for t in range(200):
        seq = next(i for i in range(4) if cu_q[i] <= t < cu_q[i + 1])
        for hh in range(h):
            want = float("-inf") if t in masked else 1000 * seq + 100 * hh + (t - cu_q[seq])
            assert float(lse[hh, t]) == want, (hh, t)
        assert bool((o[t] == (0 if t in masked else 1)).all()), t
    assert lse.shape == (h, 200) and o.shape == (200, h, 128)


def test_thd_graph_reused_across_packings(fake):
    """Packed batches with other lengths (same B, longest sequence in the same 128 bucket) reuse the
    forward graph; the backward's key also holds the token totals rounded to 64."""
    before = att.build_count
    for cu in ([0, 40, 100], [0, 90, 110], [0, 7, 136]):
        q, k, v, do, cq, ckv = thd_inputs(cu, cu)
        o, lse = att.mla_attention(q, k, v, causal=True, layout="thd", cu_seqlens_q=cq, cu_seqlens_kv=ckv)
    assert att.build_count == before + 2  # [0, 7, 136]: longest 129 -> bucket 256
    for cu in ([0, 40, 100], [0, 60, 120]):
        q, k, v, do, cq, ckv = thd_inputs(cu, cu)
        att.mla_attention_backward(do, q, k, v, do, torch.zeros(2, cu[-1]), causal=True, layout="thd",
                                   cu_seqlens_q=cq, cu_seqlens_kv=ckv)
    assert att.build_count == before + 3  # totals 100 and 120 both round to 128


def test_thd_equal_lengths_use_top_left_and_no_masking(fake):
    cu = [0, 97, 194]
    q, k, v, _, cq, ckv = thd_inputs(cu, cu)
    FakeGraph.on_execute = fill_outputs({att.O: 1.0, att.STATS: 0.5})
    o, lse = att.mla_attention(q, k, v, causal=True, layout="thd", cu_seqlens_q=cq, cu_seqlens_kv=ckv)
    assert FakeGraph.instances[0].ops[0][2]["diagonal_alignment"] == "TOP_LEFT"
    assert bool((o == 1).all()) and bool((lse == 0.5).all())


def test_thd_backward_graph(fake):
    cu_q, cu_kv = [0, 45, 128, 131, 200], [0, 60, 130, 130, 256]
    q, k, v, do, cq, ckv = thd_inputs(cu_q, cu_kv, h=2)
    o = do.clone()
    lse = torch.arange(2 * 200, dtype=torch.float32).view(2, 200)
    lse[:, 128:131] = float("-inf")
    FakeGraph.on_execute = fill_outputs({att.DQ: 1.0, att.DK: 2.0, att.DV: 3.0})
    dq, dk, dv = att.mla_attention_backward(do, q, k, v, o, lse, causal=False, layout="thd", cu_seqlens_q=cq,
                                            cu_seqlens_kv=ckv)
    (g,) = FakeGraph.instances
    ((name, args, kw, outs),) = g.ops
    assert name == "sdpa_backward" and "diagonal_alignment" not in kw
    assert kw["use_padding_mask"] is True
    for out, rag in zip(outs, (att.RAG_DQ, att.RAG_DK, att.RAG_DV)):
        assert out["ragged_offset"]["uid"] == rag and out["is_output"]
    assert g.by_uid(att.DO)["ragged_offset"]["uid"] == att.RAG_O
    assert kw["max_total_seq_len_q"] == 256 and kw["max_total_seq_len_kv"] == 256  # 200, 256 rounded up to 64
    pack = g.executions[0][0]
    for rag, same in ((att.RAG_DQ, att.RAG_QK), (att.RAG_DK, att.RAG_KK), (att.RAG_DV, att.RAG_V)):
        assert pack[rag].flatten().tolist() == pack[same].flatten().tolist()
    stats = g.executions[0][0][att.STATS][..., 0]  # [B, H, S_max]
    for t in (0, 44, 45, 127, 130, 199):
        seq = next(i for i in range(4) if cu_q[i] <= t < cu_q[i + 1])
        for hh in range(2):
            want = float(torch.tensor(att.MASKED_ROW_LSE)) if 128 <= t < 131 else float(lse[hh, t])
            assert float(stats[seq, hh, t - cu_q[seq]]) == want
    assert bool((dq[128:131] == 0).all()) and bool((dq[:128] == 1).all()) and bool((dk == 2).all())


# --------------------------------------------------------------------------------------------------
# MXFP8 SDPA (sm100): operands, scale tensors and their bytes
# --------------------------------------------------------------------------------------------------

def qk_scale_decl(b, h, s):
    sp = -(-s // 128) * 128
    return [b, h, sp, 8], [h * sp * 8, sp * 8, 8, 1]


def s_scale_decl(b, h, s, d):
    ss, dp = -(-(s // 32) // 4) * 4, -(-d // 128) * 128
    return [b, h, ss, dp], [h * ss * dp, ss * dp, 1, ss]


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("swizzled", [False, True])
def test_mxfp8_forward_graph(fake, layout, swizzled):
    b, s_q, s_kv, h = 2, 160, 192, 3
    (q_np, k_np, v_np), (q, k, v) = mx_inputs(7, b, s_q, s_kv, h, layout, swizzled)
    o, lse = att.mla_attention(q, k, v, causal=False, softmax_scale=0.1, layout=layout)
    (g,) = FakeGraph.instances
    assert g.ctor["io_data_type"] == "BFLOAT16"
    ((name, args, kw, (o_decl, st_decl, amax_decl)),) = g.ops
    assert name == "sdpa_mxfp8"
    assert [a["uid"] for a in args] == [att.Q, att.K, att.V, att.SF_Q, att.SF_K, att.SF_V]
    assert kw == dict(attn_scale=0.1, generate_stats=True, name="mla_sdpa_mxfp8")
    for uid, t in ((att.Q, q), (att.K, k), (att.V, v)):
        d, s = bhsd(t.data.shape, t.data.stride(), layout)
        assert (g.by_uid(uid)["dim"], g.by_uid(uid)["stride"], g.by_uid(uid)["data_type"]) == (d, s, "FP8_E4M3")
    decls = {att.SF_Q: qk_scale_decl(b, h, s_q), att.SF_K: qk_scale_decl(b, h, s_kv),
             att.SF_V: s_scale_decl(b, h, s_kv, 128)}
    pack = g.executions[0][0]
    want_bytes = {att.SF_Q: spec.pack_attention_scales(q_np, "qk", layout),
                  att.SF_K: spec.pack_attention_scales(k_np, "qk", layout),
                  att.SF_V: spec.pack_attention_scales(v_np, "v", layout)}
    for uid, (d, s) in decls.items():
        decl = g.by_uid(uid)
        assert (decl["dim"], decl["stride"], decl["data_type"], decl["reordering_type"]) == (d, s, "FP8_E8M0", "F8_128x4")
        assert_bound(pack[uid], decl)
        assert pack[uid].dtype == getattr(torch, "float8_e8m0fnu", torch.uint8)
        assert_bytes_equal(e8m0_bytes(pack[uid]), want_bytes[uid], f"scale uid {uid}")
    perm = (0, 2, 1, 3) if layout == "bshd" else (1, 2, 0, 3)
    for uid, t in ((att.Q, q), (att.K, k), (att.V, v)):
        assert_bound(pack[uid], g.by_uid(uid), t.data, expect=t.data.permute(perm))
    od, os_ = bhsd(o.shape, contig_strides(o.shape), layout)
    assert (o_decl["dim"], o_decl["stride"], o_decl["data_type"]) == (od, os_, "BFLOAT16")
    assert (st_decl["dim"], st_decl["data_type"]) == ([b, h, s_q, 1], "FLOAT")
    assert (amax_decl["dim"], amax_decl["data_type"], amax_decl["is_output"]) == ([1, 1, 1, 1], "FLOAT", True)
    assert list(pack[att.AMAX_O].shape) == [1, 1, 1, 1]
    assert o.dtype == torch.bfloat16 and lse.shape == (b, h, s_q)


def test_mxfp8_forward_causal_masks(fake):
    _, (q, k, v) = mx_inputs(1, 1, 128, 192, 2, "bshd")
    att.mla_attention(q, k, v, causal=True)
    assert FakeGraph.instances[-1].ops[0][2] == dict(attn_scale=1 / np.sqrt(192), generate_stats=True,
                                                      name="mla_sdpa_mxfp8", use_causal_mask_bottom_right=True)
    _, (q, k, v) = mx_inputs(1, 1, 128, 128, 2, "bshd")
    att.mla_attention(q, k, v, causal=True)
    assert FakeGraph.instances[-1].ops[0][2]["use_causal_mask"] is True
    (q_np, _, _), (q, k, v) = mx_inputs(1, 1, 200, 64, 2, "bshd")  # S_q > S_kv: last 64 query rows only
    FakeGraph.on_execute = fill_outputs({att.O: 1.0, att.STATS: 1.0})
    o, lse = att.mla_attention(q, k, v, causal=True)
    g = FakeGraph.instances[-1]
    assert g.by_uid(att.Q)["dim"] == [1, 2, 64, 192] and g.ops[0][2]["use_causal_mask"] is True
    want = spec.pack_attention_scales(spec.MXTensor(q_np.data[:, 136:], q_np.scale[:, 136:], 3), "qk")
    assert_bytes_equal(e8m0_bytes(g.executions[0][0][att.SF_Q]), want)
    assert bool((o[:, :136] == 0).all()) and bool((o[:, 136:] == 1).all())
    assert bool((lse[..., :136] == float("-inf")).all())


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_mxfp8_backward_graph(fake, layout):
    b, s_q, s_kv, h = 1, 96, 128, 2
    (q_np, k_np, v_np), (q, k, v) = mx_inputs(9, b, s_q, s_kv, h, layout)
    rng = np.random.default_rng(10)
    oshape = (b, s_q, h, 128) if layout == "bshd" else (s_q, b, h, 128)
    do_np = rng.standard_normal(oshape).astype(BF16)
    do, o = to_torch(do_np), to_torch(rng.standard_normal(oshape).astype(BF16))
    lse = torch.randn(b, h, s_q)
    dq, dk, dv = att.mla_attention_backward(do, q, k, v, o, lse, causal=False, layout=layout)
    (g,) = FakeGraph.instances
    ((name, args, kw, outs),) = g.ops
    assert name == "sdpa_mxfp8_backward"
    assert [a["uid"] for a in args] == [att.Q, att.Q_T, att.K, att.K_T, att.V, att.O, att.DO, att.DO_F8, att.DO_T,
                                        att.STATS, att.SF_Q, att.SF_Q_T, att.SF_K, att.SF_K_T, att.SF_V, att.SF_DO,
                                        att.SF_DO_T]
    assert kw == dict(attn_scale=1 / np.sqrt(192), name="mla_sdpa_mxfp8_bwd")
    s_axis = 1 if layout == "bshd" else 0
    # the re-quantized operands, computed by spec from the same values
    q_t = spec.mxfp8_quantize(spec.mxfp8_dequantize(q_np), axis=s_axis)
    k_t = spec.mxfp8_quantize(spec.mxfp8_dequantize(k_np), axis=s_axis)
    v_d = spec.mxfp8_quantize(spec.mxfp8_dequantize(v_np), axis=-1)
    do_d, do_t = spec.mxfp8_quantize(do_np, axis=(-1, s_axis))
    pack = g.executions[0][0]
    for uid, mx in ((att.Q, q_np), (att.Q_T, q_t), (att.K, k_np), (att.K_T, k_t), (att.V, v_d), (att.DO_F8, do_d),
                    (att.DO_T, do_t)):
        decl = g.by_uid(uid)
        assert decl["data_type"] == "FP8_E4M3"
        perm = (0, 2, 1, 3) if layout == "bshd" else (1, 2, 0, 3)
        assert_bound(pack[uid], decl, expect=to_torch(mx.data).permute(perm))
    for uid, t in ((att.O, o), (att.DO, do)):
        assert g.by_uid(uid)["data_type"] == "BFLOAT16" and pack[uid].data_ptr() == t.data_ptr()
    scales = {att.SF_Q: (q_np, "qk", qk_scale_decl(b, h, s_q)),
              att.SF_Q_T: (q_t, "plane-major", s_scale_decl(b, h, s_q, 192)),
              att.SF_K: (k_np, "qk", qk_scale_decl(b, h, s_kv)),
              att.SF_K_T: (k_t, "plane-major", s_scale_decl(b, h, s_kv, 192)),
              att.SF_V: (v_d, "qk", [[b, h, 128, 4], [h * 128 * 4, 128 * 4, 4, 1]]),
              att.SF_DO: (do_d, "qk", [[b, h, 128, 4], [h * 128 * 4, 128 * 4, 4, 1]]),
              att.SF_DO_T: (do_t, "v", s_scale_decl(b, h, s_q, 128))}
    for uid, (mx, role, (d, s)) in scales.items():
        decl = g.by_uid(uid)
        assert (decl["dim"], decl["stride"], decl["data_type"], decl["reordering_type"]) == (d, s, "FP8_E8M0", "F8_128x4")
        assert_bound(pack[uid], decl)
        want = (plane_major_reference(mx, layout) if role == "plane-major"
                else spec.pack_attention_scales(mx, role, layout))
        assert_bytes_equal(e8m0_bytes(pack[uid]), want, f"scale uid {uid}")
    assert g.by_uid(att.STATS)["dim"] == [b, h, s_q, 1]
    for out, like in zip(outs[:3], (q, k, v)):
        dd, ss = bhsd(like.shape, contig_strides(like.shape), layout)
        assert (out["dim"], out["stride"], out["data_type"]) == (dd, ss, "BFLOAT16")
    for out in outs[3:]:
        assert (out["dim"], out["data_type"], out["is_output"]) == ([1, 1, 1, 1], "FLOAT", True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


# --------------------------------------------------------------------------------------------------
# mla_q_uproj_rope_quant via gemm_proj_rope_mxfp8_wrapper_sm100
# --------------------------------------------------------------------------------------------------

def test_mla_q_bf16_call_and_outputs(fake):
    x, w, cos, sin = mla_q_inputs(t=256, h=4)
    q_row, q_col = mq.mla_q_uproj_rope_quant(x, w, cos, sin)
    (call,) = fake.wrapper_calls
    assert call["x"] is x and call["w"] is w and call["cos"] is cos and call["sin"] is sin
    assert call["x_scale"] is None and call["w_scale"] is None and call["w_out_in"] is True and call["stream"] is None
    assert (q_row.shape, q_row.scale.shape, q_row.axis, q_row.elem, q_row.scale_layout) == (
        (256, 4, 192), (256, 4, 6), 2, "e4m3", "compact")
    assert (q_col.shape, q_col.scale.shape, q_col.axis) == ((256, 4, 192), (8, 4, 192), 0)


def test_mla_q_mxfp8_call(fake):
    x, w, cos, sin = mla_q_inputs(t=128, h=2, mx=True)
    q_row, q_col = mq.mla_q_uproj_rope_quant(x, w, cos, sin)
    (call,) = fake.wrapper_calls
    assert call["x"] is x.data and call["w"] is w.data
    assert call["x_scale"] is x.scale and call["w_scale"] is w.scale and call["w_out_in"] is True
    assert tuple(call["x_scale"].shape) == (128, 48) and tuple(call["w_scale"].shape) == (384, 48)
    assert q_row.scale.shape == (128, 2, 6) and q_col.scale.shape == (4, 2, 192)


def test_rope_is_not_registered_for_cudnn():
    assert "cudnn" not in registry.implementations("rope")
    assert "cudnn" not in registry.implementations("mla_q_uproj_rope_quant_backward")
    assert registry.implementations("mla_attention")["cudnn"].fn is att.mla_attention
    assert registry.implementations("mla_q_uproj_rope_quant")["cudnn"].fn is mq.mla_q_uproj_rope_quant


# --------------------------------------------------------------------------------------------------
# End to end with an emulated library: the fake graph computes attention from what it was told
# --------------------------------------------------------------------------------------------------
# The emulator reads every operand through its declaration only (dims, strides, ragged offsets,
# F8_128x4 scale tensors, sequence lengths, mask attributes), computes in fp32 as a kernel would,
# and writes outputs through their declarations. Rows a kernel leaves undefined get NaN (o) and
# NaN (Stats), so the backend's own handling of fully masked rows is what the spec comparison sees.
# Running the conformance cases of tests/conformance/test_attention.py through it checks the
# backend's plumbing end to end on CPU; cuDNN's arithmetic itself is checked only on the GPU.

def _e8m0_value(e: np.ndarray) -> np.ndarray:
    e = e.astype(np.int64)
    out = np.where(e == 0, 2.0 ** -127, np.exp2((e - 127).astype(np.float64)))
    return np.where(e == 255, np.nan, out)


class Emulator:
    def __init__(self):
        self.calls = 0
        self.quantized_do = True  # MXFP8 backward: dP and dV from the e4m3 dO / dO_T, as cuDNN does

    def __call__(self, graph, pack):
        self.calls += 1
        name, args, kw, outs = graph.ops[0]
        self._check_limits(kw, args[0], args[2] if name == "sdpa_mxfp8_backward" else args[1])
        getattr(self, name)(graph, pack, args, kw, outs)

    # ---- reading and writing through declarations
    @staticmethod
    def _lens(pack, kw, key, decl):
        t = kw.get(key)
        if t is None:
            return [decl["dim"][2]] * decl["dim"][0]
        return pack[t["uid"]].flatten().tolist()

    @staticmethod
    def _views(buf, decl, pack, lens):
        """Per batch b, the [H, len_b, D] view a kernel reads (ragged offsets in elements)."""
        dims, strides = decl["dim"], decl["stride"]
        rag = decl.attrs.get("ragged_offset")
        offs = pack[rag["uid"]].flatten().tolist() if rag is not None else [b * strides[0] for b in range(dims[0])]
        return [torch.as_strided(buf, (dims[1], n, dims[3]), (strides[1], strides[2], strides[3]),
                                 buf.storage_offset() + off) for n, off in zip(lens, offs)]

    def _read(self, graph, pack, decl, lens, scale_decl=None):
        views = self._views(pack[decl["uid"]], decl, pack, lens)
        vals = [v.float() for v in views]
        if scale_decl is not None:
            vals = [x * s for x, s in zip(vals, self._scales(pack, scale_decl, lens, decl["dim"][3]))]
        return vals

    @staticmethod
    def _scales(pack, sdecl, lens, d):
        """Per batch [H, len, D] fp32 scale multipliers from an F8_128x4 E8M0 tensor, read with the
        frontend's documented atom order (not with this backend's packing code): rowwise (stride 1 on
        the last dim) atom ((b*H + h) * S'/128 + s//128) * C'/4 + j//4; columnwise (stride 1 on dim 2)
        atom plane * (B*H*T) + (b*H + h) * T + s_tile (D-plane-major); byte in an atom
        (r % 32) * 16 + (r // 32) * 4 + c."""
        buf = pack[sdecl["uid"]]
        raw = buf.view(torch.uint8) if buf.dtype != torch.uint8 else buf
        flat = raw.numpy().reshape(-1) if raw.is_contiguous() else raw.transpose(2, 3).contiguous().numpy().reshape(-1)
        nb, nh, x, y = sdecl["dim"]
        columnwise = sdecl["stride"][2] == 1
        out = []
        for b, n in enumerate(lens):
            hh, ss, dd = np.meshgrid(np.arange(nh), np.arange(n), np.arange(d), indexing="ij")
            g = b * nh + hh
            if columnwise:  # dims [B, H, S'' (S/32 blocks), D']
                blk, r, plane = ss // 32, dd % 128, dd // 128
                t_per = x // 4
                atom = plane * (nb * nh * t_per) + g * t_per + blk // 4
                c = blk % 4
            else:  # dims [B, H, S', C' (D/32 blocks)]
                j, r = dd // 32, ss % 128
                atom = (g * (x // 128) + ss // 128) * (y // 4) + j // 4
                c = j % 4
            byte = atom * 512 + (r % 32) * 16 + (r // 32) * 4 + c
            out.append(torch.from_numpy(_e8m0_value(flat[byte])).float())
        return out

    def _write(self, pack, decl, lens, values, dtype):
        for view, val in zip(self._views(pack[decl["uid"]], decl, pack, lens), values):
            view.copy_(val.to(dtype))

    @staticmethod
    def _check_limits(kw, q_decl, k_decl):
        """Limits cuDNN states (frontend validation strings), so the backend must steer around them."""
        br = kw.get("use_causal_mask_bottom_right") or kw.get("diagonal_alignment") == "BOTTOM_RIGHT"
        s_q, s_kv = q_decl["dim"][2], k_decl["dim"][2]
        if br and not kw.get("use_padding_mask") and s_q > s_kv:
            raise RuntimeError("Bottom right causal mask does not support s_q > s_kv")
        if br and q_decl["data_type"] == "FP8_E4M3" and (s_q % 64 or s_kv % 64):
            raise RuntimeError("Bottom right causal mask is only supported with s_q, s_kv multiples of 64")

    @staticmethod
    def _mask(kw, n_q, n_kv):
        causal = kw.get("use_causal_mask") or kw.get("use_causal_mask_bottom_right") or (
            kw.get("diagonal_band_right_bound") == 0)
        if not causal:
            return torch.zeros(n_q, n_kv, dtype=torch.bool)
        br = kw.get("use_causal_mask_bottom_right") or kw.get("diagonal_alignment") == "BOTTOM_RIGHT"
        i = torch.arange(n_q)[:, None]
        j = torch.arange(n_kv)[None, :]
        return j > i + ((n_kv - n_q) if br else 0)

    # ---- ops
    def _fwd(self, q, k, v, kw, lq, lkv):
        o_all, lse_all = [], []
        for qb, kb, vb, nq, nkv in zip(q, k, v, lq, lkv):
            s = torch.matmul(qb, kb.transpose(-1, -2)) * kw["attn_scale"]
            s = s.masked_fill(self._mask(kw, nq, nkv), float("-inf"))
            m = s.amax(-1, keepdim=True) if nkv else torch.full(s.shape[:-1] + (1,), float("-inf"))
            p = torch.exp(s - m)  # fully masked rows: exp(-inf + inf) = NaN, left as a kernel might
            l = p.sum(-1, keepdim=True)
            o_all.append(torch.matmul(p, vb) / l)
            lse_all.append((m + torch.log(l))[..., 0])
        return o_all, lse_all

    def _write_stats(self, pack, decl, lse_all):
        buf = pack[decl["uid"]]
        d, st = decl["dim"], decl["stride"]
        full = torch.as_strided(buf, d, st, buf.storage_offset())
        full.fill_(float("nan"))  # padding rows of a padded Stats: never to be read
        for b, lse in enumerate(lse_all):
            full[b, :, : lse.shape[1], 0] = lse

    def sdpa(self, graph, pack, args, kw, outs):
        q, k, v = args
        lq, lkv = self._lens(pack, kw, "seq_len_q", q), self._lens(pack, kw, "seq_len_kv", k)
        o_all, lse_all = self._fwd(self._read(graph, pack, q, lq), self._read(graph, pack, k, lkv),
                                   self._read(graph, pack, v, lkv), kw, lq, lkv)
        self._write(pack, outs[0], lq, o_all, torch.bfloat16)
        self._write_stats(pack, outs[1], lse_all)

    def sdpa_mxfp8(self, graph, pack, args, kw, outs):
        q, k, v, sq, sk, sv = args
        lq, lkv = [q["dim"][2]] * q["dim"][0], [k["dim"][2]] * k["dim"][0]
        o_all, lse_all = self._fwd(self._read(graph, pack, q, lq, sq), self._read(graph, pack, k, lkv, sk),
                                   self._read(graph, pack, v, lkv, sv), kw, lq, lkv)
        self._write(pack, outs[0], lq, o_all, torch.bfloat16)
        self._write_stats(pack, outs[1], lse_all)
        pack[outs[2]["uid"]].fill_(max(float(o.abs().max()) for o in o_all))

    def _bwd(self, q, k, v, o, do, lse, kw, lq, lkv, q_t=None, k_t=None, do_t=None, o16=None, do16=None):
        if do16 is not None and not self.quantized_do:
            do, do_t = do16, do16
        grads = ([], [], [])
        for b, (nq, nkv) in enumerate(zip(lq, lkv)):
            s = torch.matmul(q[b], k[b].transpose(-1, -2)) * kw["attn_scale"]
            s = s.masked_fill(self._mask(kw, nq, nkv), float("-inf"))
            p = torch.exp(s - lse[b][..., None])
            d = ((o16 or o)[b] * (do16 or do)[b]).sum(-1, keepdim=True)
            ds = p * (torch.matmul(do[b], v[b].transpose(-1, -2)) - d)
            grads[0].append(torch.matmul(ds, (k_t or k)[b]) * kw["attn_scale"])
            grads[1].append(torch.matmul(ds.transpose(-1, -2), (q_t or q)[b]) * kw["attn_scale"])
            grads[2].append(torch.matmul(p.transpose(-1, -2), (do_t or do)[b]))
        return grads

    def _read_stats(self, pack, decl, lq):
        buf = pack[decl["uid"]]
        full = torch.as_strided(buf, decl["dim"], decl["stride"], buf.storage_offset())
        return [full[b, :, :n, 0].float() for b, n in enumerate(lq)]

    def sdpa_backward(self, graph, pack, args, kw, outs):
        q, k, v, o, do, stats = args
        lq, lkv = self._lens(pack, kw, "seq_len_q", q), self._lens(pack, kw, "seq_len_kv", k)
        r = lambda decl, lens: self._read(graph, pack, decl, lens)  # noqa: E731
        grads = self._bwd(r(q, lq), r(k, lkv), r(v, lkv), r(o, lq), r(do, lq), self._read_stats(pack, stats, lq),
                          kw, lq, lkv)
        for out, lens, g in zip(outs, (lq, lkv, lkv), grads):
            self._write(pack, out, lens, g, torch.bfloat16)

    def sdpa_mxfp8_backward(self, graph, pack, args, kw, outs):
        (q, q_t, k, k_t, v, o16, do16, do, do_t, stats, sq, sq_t, sk, sk_t, sv, sdo, sdo_t) = args
        lq, lkv = [q["dim"][2]] * q["dim"][0], [k["dim"][2]] * k["dim"][0]
        r = lambda decl, lens, s=None: self._read(graph, pack, decl, lens, s)  # noqa: E731
        grads = self._bwd(r(q, lq, sq), r(k, lkv, sk), r(v, lkv, sv), None, r(do, lq, sdo),
                          self._read_stats(pack, stats, lq), kw, lq, lkv, q_t=r(q_t, lq, sq_t),
                          k_t=r(k_t, lkv, sk_t), do_t=r(do_t, lq, sdo_t), o16=r(o16, lq), do16=r(do16, lq))
        for out, lens, g in zip(outs[:3], (lq, lkv, lkv), grads):
            self._write(pack, out, lens, g, torch.bfloat16)
        for out in outs[3:]:
            pack[out["uid"]].fill_(1.0)


@pytest.fixture
def emulated(fake, monkeypatch):
    """The fake frontend computing attention, and the cudnn backend marked available to the dispatcher."""
    import dispatch

    emu = Emulator()
    FakeGraph.on_execute = emu
    monkeypatch.setitem(registry._backends, "cudnn", registry.BackendInfo("cudnn", True, "fake"))
    dispatch.clear_cache()
    yield emu
    dispatch.clear_cache()


def _cpu_target():
    return ("cudnn", "cpu")


def test_emulated_conformance_bf16(emulated):
    """Every bf16 case of tests/conformance/test_attention.py, forward and backward, through the
    dispatcher and the emulated library, against spec with the SEMANTICS 8 bounds."""
    from tests.conformance import test_attention as conf

    for case in conf.CASES:
        emulated.calls = 0
        conf.test_forward_bf16(_cpu_target(), case)
        conf.test_backward_bf16(_cpu_target(), case)
        assert emulated.calls == 2, case[0]
    conf.test_forward_softmax_scale(_cpu_target())
    for causal in (False, True):
        conf.test_varlen_thd(_cpu_target(), causal)


def test_emulated_strided_sbhd_views(emulated):
    from tests.conformance import test_attention as conf

    q, k, v, do = conf.make_inputs(11, 2, 96, 128, 4, "sbhd")
    want = spec.mla_attention(q, k, v, causal=True, layout="sbhd")
    kv = torch.cat([to_torch(k), to_torch(v)], dim=-1)  # k and v as slices of one fused tensor
    got = att.mla_attention(to_torch(q), kv[..., :192], kv[..., 192:], causal=True, layout="sbhd")
    conf.check_forward(got, want, conf.BF16_BOUND, "strided sbhd", "sbhd")


@pytest.mark.parametrize("layout,s_q,s_kv,causal", [("bshd", 64, 64, True), ("sbhd", 96, 128, False),
                                                    ("bshd", 192, 128, True), ("sbhd", 128, 192, True)])
def test_emulated_mxfp8(emulated, layout, s_q, s_kv, causal):
    """MXFP8 forward and backward through the emulated library against spec.

    Forward: the SEMANTICS 8 MXFP8 bound, 5e-2 (the emulator does not quantize P; cuDNN does).
    Backward, with dP and dV computed from the bf16 do: <= 1e-3. This isolates what this backend adds
    -- the plumbing and the re-quantization of q, k along S and v along D, which turns out nearly
    lossless (an e4m3 value re-blocked keeps its 3 mantissa bits unless it drops into e4m3
    subnormals). Backward as cuDNN computes it (dO quantized to e4m3 along D and S, which the API
    requires): printed, and held to 0.15 only. On these sharp-softmax inputs (q up to x8) the dO
    quantization alone gives dk errors up to ~1e-1 -- above SEMANTICS' 5e-2, whatever the backend
    does; the real kernel also quantizes P and dS, so expect at least this on sm100."""
    from tests.conformance import test_attention as conf

    q, k, v, do = conf.make_inputs(12, 2, s_q, s_kv, 4, layout)
    q_mx, k_mx, v_mx = conf.quantize_inputs(q, k, v, layout)
    kw = dict(causal=causal, layout=layout)
    want = spec.mla_attention(q_mx, k_mx, v_mx, **kw)
    mx = to_torch([q_mx, k_mx, v_mx])
    got = run_dispatch("mla_attention", *mx, **kw)
    conf.check_forward(got, want, conf.MX_BOUND, f"mxfp8 {layout}", layout)
    want_g = spec.mla_attention_backward(do, q_mx, k_mx, v_mx, *want, **kw)
    errs = {}
    for quantized_do, bound in ((False, 1e-3), (True, 0.15)):
        emulated.quantized_do = quantized_do
        got_g = run_dispatch("mla_attention_backward", to_torch(do), *mx, *to_torch(list(want)), **kw)
        errs[quantized_do] = [conf.rel_fro(g, w) for g, w in zip(got_g, want_g)]
        conf.check_backward(got_g, want_g, bound, f"mxfp8 {layout} quantized_do={quantized_do}")
    print(f"\nemulated MXFP8 backward ({layout}, S_q {s_q}, S_kv {s_kv}, causal {causal}) dq/dk/dv: "
          f"bf16 dO {' '.join(f'{e:.1e}' for e in errs[False])}; "
          f"e4m3 dO {' '.join(f'{e:.1e}' for e in errs[True])} (SEMANTICS bound 5e-2)")


def run_dispatch(op, *args, **kwargs):
    import dispatch

    return dispatch.run(op, *args, backend="cudnn", **kwargs)



def test_handle_follows_torch_stream_changes(fake, monkeypatch):
    # The handle is rebound only when torch's current stream differs from the one last bound (the
    # call is host time on every cache hit); a stream switch, and a switch back, rebind it.
    current = {"stream": 11}
    monkeypatch.setattr(_common, "current_stream_handle", lambda device: current["stream"])
    q, k, v, _ = bf16_inputs(3, 1, 64, 64, 2, "bshd")
    for stream in (11, 11, 22, 22, 11):
        current["stream"] = stream
        att.mla_attention(q, k, v, causal=True)
    (g,) = FakeGraph.instances
    assert g.ctor["handle"].streams == [11, 22, 11]


def test_routes_are_registry_variants(fake, monkeypatch):
    # sm90: MXFP8 operands take "dequantized" (native names its sm100 reason), bf16 operands "bf16";
    # naming the native route there gets its reasons (the dispatcher raises them instead of dequantizing)
    set_machine(monkeypatch, (9, 0), 91900)
    q, k, v, _ = bf16_inputs(0, 1, 64, 64, 2, "bshd")
    _, (qm, km, vm) = mx_inputs(0, 1, 64, 64, 2, "bshd")
    assert att.variant_reasons("bf16", q, k, v, False, "bshd", backward=False) == []
    assert att.variant_reasons("dequantized", qm, km, vm, False, "bshd", backward=False) == []
    assert "compute capability 10.x" in att.variant_reasons("native", qm, km, vm, False, "bshd", backward=False)[0]
    assert "takes MXFP8 operands" in att.variant_reasons("native", q, k, v, False, "bshd", backward=False)[0]
    from backends import registry

    names = [v.name for v in registry.variants("mla_attention", "cudnn")]
    assert names == ["native", "dequantized", "bf16"]
    assert [v.name for v in registry.variants("mla_attention_backward", "cudnn")] == names
