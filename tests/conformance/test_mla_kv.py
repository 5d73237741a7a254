"""mla_kv_quantize on every backend present, byte-equal to spec (codes and scales of k and v).

Inputs: seeded rows at magnitudes 2^-30..2^30 with special values planted (an all-NaN and an all-zero
block, +-Inf, a subnormal, -0, one ulp under a power of two, NaN in k_pe), k_nope and v as strided
slices of one [..., H, 256] projection (as the block makes them), k_pe shared by every head or one
per head, every layout, bf16 / float16 / float32. Bad arguments raise naming the argument.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import spec
from tests.conformance.conftest import run_on
from tests.util import BF16, assert_bytes_equal, random_magnitudes

torch = pytest.importorskip("torch")
from backends.convert import to_torch  # noqa: E402  (needs torch)
from spec.mxtensor import MXTensor  # noqa: E402

# layout -> (leading shape [.., H], head axis)
LEAD = {"bshd": ((2, 64, 3), 2), "sbhd": ((96, 2, 3), 2), "thd": ((64, 3), 1)}
DTYPES = {"bfloat16": BF16, "float16": np.float16, "float32": np.float32}


def _inputs(layout, shared, dtype, seed=0):
    lead, head = LEAD[layout]
    rng = np.random.default_rng(zlib.crc32(repr(("mla_kv", layout, shared, dtype, seed)).encode()))
    kv = random_magnitudes(rng, lead + (256,))
    if dtype == "float16":  # keep float16's range: magnitudes beyond it would all be Inf
        kv = np.clip(kv, -6e4, 6e4)
    flat = kv.reshape(-1, 256)
    flat[0, :32] = np.nan
    flat[1, 32:64] = 0.0
    flat[2, :3] = [np.inf, -0.0, 2.0 ** -133 if dtype != "float16" else 2.0 ** -20]
    flat[3, 130] = 2.0 ** 8 * (1 - 2 ** -8)
    flat[4, 250] = -np.inf
    pe_lead = list(lead)
    if shared:
        pe_lead[head] = 1
    k_pe = np.clip(random_magnitudes(rng, tuple(pe_lead) + (64,)), -6e4, 6e4)
    k_pe.reshape(-1, 64)[1, 3] = np.nan
    return kv.astype(DTYPES[dtype]), k_pe.astype(DTYPES[dtype])


def _check(got, want):
    assert isinstance(got, MXTensor)
    assert (got.axis, got.elem, got.scale_layout) == (want.axis, want.elem, want.scale_layout)
    assert_bytes_equal(got.data, want.data, "codes")
    assert_bytes_equal(got.scale, want.scale, "scales")


@pytest.mark.parametrize("layout", list(LEAD))
@pytest.mark.parametrize("shared", [True, False], ids=["shared_pe", "per_head_pe"])
def test_bytes_equal_spec(target, layout, shared):
    kv, k_pe = _inputs(layout, shared, "bfloat16")
    want_k, want_v = spec.mla_kv_quantize(kv[..., :128], k_pe, kv[..., 128:], layout=layout)
    kv_t = to_torch(kv, target[1])
    k, v = run_on(target, "mla_kv_quantize", kv_t[..., :128], to_torch(k_pe, target[1]), kv_t[..., 128:],
                  layout=layout)
    _check(k, want_k)
    _check(v, want_v)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_other_dtypes(target, dtype):
    kv, k_pe = _inputs("bshd", True, dtype)
    want_k, want_v = spec.mla_kv_quantize(kv[..., :128], k_pe, kv[..., 128:])
    k, v = run_on(target, "mla_kv_quantize", to_torch(np.ascontiguousarray(kv[..., :128]), target[1]),
                  to_torch(k_pe, target[1]), to_torch(np.ascontiguousarray(kv[..., 128:]), target[1]))
    _check(k, want_k)
    _check(v, want_v)


def _good():
    kv, k_pe = _inputs("bshd", True, "bfloat16")
    return to_torch(kv[..., :128]), to_torch(k_pe), to_torch(kv[..., 128:])


@pytest.mark.parametrize("change, exc, match", [
    (dict(layout="bhsd"), ValueError, "layout"),
    (dict(k_nope=torch.zeros(2, 64, 3, 128, dtype=torch.int32)), TypeError, "k_nope"),
    (dict(k_nope=torch.zeros(2, 64, 3, 96, dtype=torch.bfloat16)), ValueError, "k_nope"),
    (dict(v=torch.zeros(2, 64, 4, 128, dtype=torch.bfloat16)), ValueError, "v: expected the leading shape"),
    (dict(k_pe=torch.zeros(2, 64, 2, 64, dtype=torch.bfloat16)), ValueError, "k_pe"),
    (dict(k_pe=torch.zeros(2, 64, 1, 64, dtype=torch.float32)), TypeError, "k_pe: expected the dtype"),
    (dict(k_nope=torch.zeros(2, 48, 3, 128, dtype=torch.bfloat16), k_pe=torch.zeros(2, 48, 1, 64, dtype=torch.bfloat16),
          v=torch.zeros(2, 48, 3, 128, dtype=torch.bfloat16)), ValueError, "multiple of 32"),
])
def test_bad_arguments(change, exc, match):
    import dispatch

    k_nope, k_pe, v = _good()
    args = dict(k_nope=k_nope, k_pe=k_pe, v=v, layout="bshd")
    args.update(change)
    layout = args.pop("layout")
    with pytest.raises(exc, match=match):
        dispatch.run("mla_kv_quantize", args["k_nope"], args["k_pe"], args["v"], layout=layout, backend="torch")
    with pytest.raises(exc, match=match):
        spec.validate_mla_kv_quantize(args["k_nope"], args["k_pe"], args["v"], layout)
