"""mla_kv_quantize on every backend present, byte-equal to spec (codes and scales of k and v).

Inputs: seeded rows at magnitudes 2^-30..2^30 with special values planted in k_nope, k_pe and v (an
all-NaN and all-zero blocks, +-Inf, NaN, a subnormal, -0, one ulp under a power of two as a block's
amax; v's along the sequence axis, the axis its blocks run on), k_nope and v as strided slices of one
[..., H, 256] projection (as the block makes them), k_pe shared by every head or one per head, every
layout, bf16 and float32 (strided) and float16 (contiguous). With cos / sin tables (k_pe rotated in
the op; float32 and bf16 tables with zeros, a subnormal, huge entries, +-Inf and NaN, contiguous and
strided) the same cells against spec, whose result is rope's output quantized. The op allocates its
outputs, so there is no poisoned-output case. Bad arguments raise naming the argument, through the
dispatcher and the spec.
"""
from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

import spec
from spec.mla_kv import mla_kv_axes
from tests.conformance.conftest import run_on
from tests.util import BF16, assert_bytes_equal, random_magnitudes

torch = pytest.importorskip("torch")
from backends.convert import to_numpy, to_torch  # noqa: E402  (needs torch)
from spec.mxtensor import MXTensor  # noqa: E402

# layout -> leading shape [.., H] (three heads; sequence length 64 or 96)
LEAD = {"bshd": (2, 64, 3), "sbhd": (96, 2, 3), "thd": (64, 3)}
DTYPES = {"bfloat16": BF16, "float16": np.float16, "float32": np.float32}
SUBNORMAL = {"bfloat16": 2.0 ** -133, "float16": 2.0 ** -20, "float32": 2.0 ** -133}
# one ulp under 2^8 in each dtype (8, 11 and 24 significant bits)
UNDER_POW2 = {"bfloat16": 2.0 ** 8 * (1 - 2 ** -8), "float16": 2.0 ** 8 * (1 - 2 ** -11),
              "float32": 2.0 ** 8 * (1 - 2 ** -24)}


def _inputs(layout, shared, dtype, seed=0):
    """(kv [..., H, 256], k_pe [..., 1 or H, 64]) in `dtype`: k_nope is kv[..., :128], v kv[..., 128:]."""
    lead = LEAD[layout]
    seq, head = mla_kv_axes(layout)
    rng = np.random.default_rng(zlib.crc32(repr(("mla_kv", layout, shared, dtype, seed)).encode()))
    kv = random_magnitudes(rng, lead + (256,))
    if dtype == "float16":  # keep float16's range: magnitudes beyond it would all be Inf
        kv = np.clip(kv, -6e4, 6e4)
    sub, under = SUBNORMAL[dtype], UNDER_POW2[dtype]
    flat = kv.reshape(-1, 256)  # a view: rows are (position, head) pairs
    flat[0, :32] = np.nan                            # an all-NaN block of k_nope
    flat[1, 32:64] = 0.0                             # an all-zero block
    flat[1, 64:96] = 0.0
    flat[1, 64:66] = [under, -under / 2]             # one ulp under 2^8 as its block's amax
    flat[2, :3] = [np.inf, -0.0, sub]                # Inf, -0, a subnormal
    flat[4, 250] = -np.inf                           # in v
    # v's blocks run along the sequence axis: plant its special values there (batch 0, head 0 or 1)
    vs = np.moveaxis(kv[..., 128:], seq, 0)  # a view, [S, (B,) H, 128]
    rest = (0,) * (vs.ndim - 2)
    vs[(slice(0, 32),) + rest + (5,)] = 0.0          # an all-zero block of v
    vs[(slice(32, 64),) + rest + (6,)] = 0.0
    vs[(40,) + rest + (6,)] = under                  # one ulp under 2^8 as its block's amax
    vs[(3,) + rest + (7,)] = np.nan
    vs[(4,) + rest + (8,)] = sub
    vs[(5,) + rest + (9,)] = -0.0
    vs[(6,) + rest[:-1] + (1, 10)] = np.inf
    pe_lead = list(lead)
    if shared:
        pe_lead[head] = 1
    k_pe = np.clip(random_magnitudes(rng, tuple(pe_lead) + (64,)), -6e4, 6e4)
    pe = k_pe.reshape(-1, 64)
    pe[1, 3] = np.nan
    pe[2, 32:] = 0.0                                 # an all-zero block of k_pe
    pe[3, :3] = [-0.0, sub, -np.inf]
    return kv.astype(DTYPES[dtype]), k_pe.astype(DTYPES[dtype])


def _check(got, want, what):
    assert isinstance(got, MXTensor), what
    assert (got.axis, got.elem, got.scale_layout) == (want.axis, want.elem, want.scale_layout), what
    assert got.data.dtype == torch.float8_e4m3fn and got.scale.dtype == torch.uint8, what
    assert got.data.is_contiguous() and got.scale.is_contiguous(), what
    assert_bytes_equal(got.data, want.data, f"{what} codes")
    assert_bytes_equal(got.scale, want.scale, f"{what} scales")


def _run_and_check(target, layout, k_nope, k_pe, v, np_kv, np_pe, **tables):
    """tables: cos and sin as torch tensors on the target's device, or nothing."""
    np_tables = {name: to_numpy(t) for name, t in tables.items()}
    want_k, want_v = spec.mla_kv_quantize(np_kv[..., :128], np_pe, np_kv[..., 128:], layout=layout, **np_tables)
    lead = LEAD[layout]
    assert want_k.data.shape == lead + (192,) and want_k.scale.shape == lead + (6,)
    k, v = run_on(target, "mla_kv_quantize", k_nope, k_pe, v, layout=layout, **tables)
    _check(k, want_k, "k")
    _check(v, want_v, "v")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("layout", list(LEAD))
@pytest.mark.parametrize("shared", [True, False], ids=["shared_pe", "per_head_pe"])
def test_bytes_equal_spec(target, layout, shared, dtype):
    """k_nope and v as strided slices of one [..., H, 256] tensor, read in place."""
    kv, k_pe = _inputs(layout, shared, dtype)
    kv_t = to_torch(kv, target[1])
    k_nope, v = kv_t[..., :128], kv_t[..., 128:]
    assert not k_nope.is_contiguous() and not v.is_contiguous()
    _run_and_check(target, layout, k_nope, to_torch(k_pe, target[1]), v, kv, k_pe)


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_float16_contiguous(target, layout):
    kv, k_pe = _inputs(layout, True, "float16")
    dev = target[1]
    _run_and_check(target, layout, to_torch(np.ascontiguousarray(kv[..., :128]), dev), to_torch(k_pe, dev),
                   to_torch(np.ascontiguousarray(kv[..., 128:]), dev), kv, k_pe)


def test_equals_parts_quantized_apart(target):
    """The join is exact: k is k_nope's and k_pe's quantizations side by side (k_pe's repeated per head)."""
    kv, k_pe = _inputs("sbhd", True, "bfloat16", seed=1)
    dev = target[1]
    kv_t = to_torch(kv, dev)
    k, _ = run_on(target, "mla_kv_quantize", kv_t[..., :128], to_torch(k_pe, dev), kv_t[..., 128:], layout="sbhd")
    kn = spec.mxfp8_quantize(kv[..., :128], axis=-1)
    kp = spec.mxfp8_quantize(np.broadcast_to(k_pe, kv.shape[:-1] + (64,)), axis=-1)
    assert_bytes_equal(k.data[..., :128], kn.data, "k_nope part codes")
    assert_bytes_equal(k.data[..., 128:], kp.data, "k_pe part codes")
    assert_bytes_equal(k.scale[..., :4], kn.scale, "k_nope part scales")
    assert_bytes_equal(k.scale[..., 4:], kp.scale, "k_pe part scales")


def _tables(rows, dtype, seed=0):
    """cos, sin [rows, 64] in dtype (float32 or bfloat16): uniform in [-1, 1], asymmetric (a wrong
    column or row shows), with zeros, -0, a subnormal, huge entries (products overflow), +-Inf and NaN."""
    rng = np.random.default_rng(zlib.crc32(repr(("mla_kv tables", rows, dtype, seed)).encode()))
    cos, sin = (rng.uniform(-1, 1, (rows, 64)).astype(np.float32) for _ in range(2))
    cos[1, :4] = [0.0, -0.0, 2.0 ** -133, 2.0 ** 100]
    sin[1, 32:34] = [-0.0, -2.0 ** 100]
    sin[2, 5:8] = [np.inf, -np.inf, np.nan]
    cos[3, 40] = np.nan
    return cos.astype(DTYPES[dtype]), sin.astype(DTYPES[dtype])


def _rope_inputs(layout, shared, dtype):
    """_inputs plus, in k_pe, a NaN row (an all-NaN block after the rotation too) and +-the dtype's
    largest finite value."""
    kv, k_pe = _inputs(layout, shared, dtype)
    pe = k_pe.reshape(-1, 64)
    pe[4] = np.nan
    big = float(ml_dtypes.finfo(DTYPES[dtype]).max)
    pe[5, :3] = [big, -big, big]
    return kv, k_pe


# (layout, shared k_pe, dtype, table dtype): every layout and k_pe form, each dtype and table dtype
ROPE_CELLS = [
    ("bshd", True, "bfloat16", "float32"),
    ("bshd", False, "float32", "bfloat16"),
    ("sbhd", True, "float32", "float32"),
    ("sbhd", False, "bfloat16", "bfloat16"),
    ("thd", True, "bfloat16", "bfloat16"),
    ("thd", False, "bfloat16", "float32"),
]


@pytest.mark.parametrize("layout, shared, dtype, table_dtype", ROPE_CELLS,
                         ids=[f"{c[0]}-{'shared' if c[1] else 'per_head'}-{c[2]}-{c[3]}_tables" for c in ROPE_CELLS])
def test_rope_bytes_equal_spec(target, layout, shared, dtype, table_dtype):
    """k_pe rotated in the op (tables a few rows longer than the sequence), k_nope and v strided."""
    kv, k_pe = _rope_inputs(layout, shared, dtype)
    seq, _ = mla_kv_axes(layout)
    dev = target[1]
    cos, sin = (to_torch(t, dev) for t in _tables(LEAD[layout][seq] + 3, table_dtype))
    kv_t = to_torch(kv, dev)
    _run_and_check(target, layout, kv_t[..., :128], to_torch(k_pe, dev), kv_t[..., 128:], kv, k_pe, cos=cos, sin=sin)


def test_rope_float16_contiguous(target):
    kv, k_pe = _rope_inputs("bshd", True, "float16")
    dev = target[1]
    cos, sin = (to_torch(t, dev) for t in _tables(64, "float32"))
    _run_and_check(target, "bshd", to_torch(np.ascontiguousarray(kv[..., :128]), dev), to_torch(k_pe, dev),
                   to_torch(np.ascontiguousarray(kv[..., 128:]), dev), kv, k_pe, cos=cos, sin=sin)


def test_rope_strided_tables(target):
    """cos a column slice of a wider table, sin a transposed one: read through their strides."""
    kv, k_pe = _rope_inputs("bshd", False, "bfloat16")
    dev = target[1]
    cos, sin = _tables(64, "float32", seed=2)
    wide = to_torch(np.concatenate([sin, cos], axis=1), dev)  # [64, 128]
    cos_t = wide[:, 64:]
    sin_t = to_torch(np.ascontiguousarray(sin.T), dev).t()
    assert cos_t.stride() == (128, 1) and sin_t.stride() == (1, 64)
    kv_t = to_torch(kv, dev)
    _run_and_check(target, "bshd", kv_t[..., :128], to_torch(k_pe, dev), kv_t[..., 128:], kv, k_pe, cos=cos_t,
                   sin=sin_t)


def _good():
    kv, k_pe = _inputs("bshd", True, "bfloat16")
    return to_torch(kv[..., :128]), to_torch(k_pe), to_torch(kv[..., 128:])


def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


def _f32(*shape):
    return torch.zeros(*shape, dtype=torch.float32)


BAD = [  # (change, exception, words the message starts with)
    (dict(layout="bhsd"), ValueError, "layout: expected one of"),
    (dict(layout=None), ValueError, "layout: expected one of"),
    (dict(k_nope="k"), TypeError, "k_nope: expected a NumPy array or torch tensor"),
    (dict(k_nope=torch.zeros(2, 64, 3, 128, dtype=torch.int32)), TypeError, "k_nope: expected float32, bfloat16"),
    (dict(k_pe=torch.zeros(2, 64, 1, 64, dtype=torch.float64)), TypeError, "k_pe: expected float32, bfloat16"),
    (dict(v=torch.zeros(2, 64, 3, 128, dtype=torch.int8)), TypeError, "v: expected float32, bfloat16"),
    (dict(k_nope=_bf16(2, 64, 3, 96)), ValueError, r"k_nope: expected 4 dims \(bshd\) with last axis 128"),
    (dict(k_nope=_bf16(64, 3, 128)), ValueError, r"k_nope: expected 4 dims \(bshd\)"),
    (dict(k_pe=_bf16(2, 64, 1, 32)), ValueError, r"k_pe: expected 4 dims \(bshd\) with last axis 64"),
    (dict(v=_bf16(2, 64, 3, 192)), ValueError, r"v: expected 4 dims \(bshd\) with last axis 128"),
    (dict(layout="thd"), ValueError, r"k_nope: expected 3 dims \(thd\)"),
    (dict(v=_bf16(2, 64, 4, 128)), ValueError, "v: expected the leading shape of k_nope"),
    (dict(v=_bf16(2, 32, 3, 128)), ValueError, "v: expected the leading shape of k_nope"),
    (dict(k_pe=_bf16(2, 64, 2, 64)), ValueError, r"k_pe: expected shape \(2, 64\) \+ \(1 or 3,\)"),
    (dict(k_pe=_bf16(2, 32, 1, 64)), ValueError, "k_pe: expected shape"),
    (dict(k_pe=torch.zeros(2, 64, 1, 64, dtype=torch.float32)), TypeError, "k_pe: expected the dtype of k_nope"),
    (dict(k_nope=_bf16(2, 48, 3, 128), k_pe=_bf16(2, 48, 1, 64), v=_bf16(2, 48, 3, 128)), ValueError,
     r"v: its sequence axis 1 \(bshd\) is blocked by 32; got length 48"),
    (dict(k_nope=_bf16(48, 2, 3, 128), k_pe=_bf16(48, 2, 3, 64), v=_bf16(48, 2, 3, 128), layout="sbhd"),
     ValueError, r"v: its sequence axis 0 \(sbhd\)"),
    # the RoPE tables (the k_pe of _good has 64 positions)
    (dict(cos=_f32(64, 64)), ValueError, "sin: RoPE of k_pe takes both tables; cos was given without sin"),
    (dict(sin=_f32(64, 64)), ValueError, "cos: RoPE of k_pe takes both tables; sin was given without cos"),
    (dict(cos="c", sin=_f32(64, 64)), TypeError, "cos: expected a NumPy array or torch tensor"),
    (dict(cos=_f32(64, 32), sin=_f32(64, 32)), ValueError, r"cos: expected tables \[max_positions, 64\]"),
    (dict(cos=_f32(64, 128), sin=_f32(64, 128)), ValueError, r"cos: expected tables \[max_positions, 64\]"),
    (dict(cos=_f32(1, 64, 64), sin=_f32(1, 64, 64)), ValueError, "cos: expected 2 dimensions"),
    (dict(cos=_f32(64, 64), sin=_f32(65, 64)), ValueError, "cos and sin: expected equal shapes"),
    (dict(cos=_f32(64, 64).half(), sin=_f32(64, 64).half()), TypeError, r"cos: expected dtype in \('float32', 'bfloat16'\)"),
    (dict(cos=_f32(64, 64), sin=_f32(64, 64).to(torch.int32)), TypeError, r"sin: expected dtype in \('float32', 'bfloat16'\)"),
    (dict(cos=_f32(64, 64), sin=_bf16(64, 64)), TypeError, r"sin: expected the dtype of cos \(float32\)"),
    (dict(cos=_f32(63, 64), sin=_f32(63, 64)), ValueError, "cos: tables have 63 rows but a token needs position 63"),
]


@pytest.mark.parametrize("change, exc, match", BAD, ids=[f"{i}-{'-'.join(c)}" for i, (c, _, _) in enumerate(BAD)])
def test_bad_arguments(change, exc, match):
    import dispatch

    k_nope, k_pe, v = _good()
    args = dict(k_nope=k_nope, k_pe=k_pe, v=v, layout="bshd")
    args.update(change)
    layout = args.pop("layout")
    tables = {name: args[name] for name in ("cos", "sin") if name in args}
    with pytest.raises(exc, match=match):
        dispatch.run("mla_kv_quantize", args["k_nope"], args["k_pe"], args["v"], layout=layout, backend="torch",
                     **tables)
    with pytest.raises(exc, match=match):
        spec.validate_mla_kv_quantize(args["k_nope"], args["k_pe"], args["v"], layout, **tables)
    # the spec on NumPy arrays fails the same way (a dtype NumPy lacks aside)
    np_args = [to_numpy(a) if isinstance(a, torch.Tensor) else a for a in (args["k_nope"], args["k_pe"], args["v"])]
    np_tables = {name: to_numpy(t) if isinstance(t, torch.Tensor) else t for name, t in tables.items()}
    with pytest.raises(exc, match=match):
        spec.mla_kv_quantize(*np_args, layout=layout, **np_tables)
