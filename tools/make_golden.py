"""Write spec/golden/golden.npz: inputs and expected outputs of every op, produced once by the spec.

tests/test_golden.py reads the stored inputs, recomputes every case and compares bytes, so any change
of semantics shows up as a failing test and, when regenerated on purpose, as a diff of this file. Arrays are stored as their raw
unsigned-integer views plus a dtype-name manifest (npz cannot hold ml_dtypes types directly).
Regenerate only when a semantic change is intended: `python tools/make_golden.py`.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import spec  # noqa: E402
from spec.mxtensor import MXTensor  # noqa: E402
from spec.rmsnorm import rmsnorm_rstd  # noqa: E402

GOLDEN = Path(__file__).resolve().parent.parent / "spec" / "golden" / "golden.npz"
BF16 = ml_dtypes.bfloat16
UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def golden_cases():
    """(name, op, args, kwargs) — small, seeded, with special values; same list for writing and testing."""
    rng = np.random.default_rng(20261130)

    def mags(shape, dtype=np.float32, spread=20):
        x = rng.standard_normal(shape) * 2.0 ** rng.integers(-spread, spread + 1, size=shape[:-1] + (1,))
        return x.astype(np.float32).astype(dtype)

    x = mags((64, 96))
    x[0, :32] = np.nan
    x[1, :4] = [np.inf, -0.0, 448.0, 449.0]
    x[2, :32] = 0.0
    x[3, 0] = np.float32(2.0 ** -149)
    x[4, :3] = [np.nextafter(np.float32(1), np.float32(2)), np.nextafter(np.float32(1), np.float32(0)), -480.0]
    cases = []
    for elem in ("e4m3", "e5m2"):
        for mode in ("rceil", "floor", "ceil", "even"):
            for policy in ("saturate", "nan_block"):
                cases.append((f"quantize_{elem}_{mode}_{policy}", "mxfp8_quantize", (x,),
                              dict(axis=(-1, 0), elem=elem, scale_mode=mode, nonfinite=policy)))
    xb = mags((64, 64), BF16)
    cases.append(("quantize_bf16_swizzled", "mxfp8_quantize", (xb,), dict(axis=0, scale_layout="swizzled")))
    mx = spec.mxfp8_quantize(mags((64, 64)), axis=-1)
    cases.append(("dequantize_f32", "mxfp8_dequantize", (mx,), {}))
    cases.append(("dequantize_bf16", "mxfp8_dequantize", (mx,), dict(out_dtype="bfloat16")))
    cases.append(("swizzle", "swizzle_scales", (mx,), {}))
    cases.append(("unswizzle", "unswizzle_scales", (spec.swizzle_scales(mx),), {}))
    T, H = 32, 1
    cos = rng.standard_normal((T, 64)).astype(np.float32)
    sin = rng.standard_normal((T, 64)).astype(np.float32)
    xr = mags((T, H, 192), BF16)
    for style in ("mla", "neox", "interleaved"):
        cases.append((f"rope_{style}", "rope", (xr, cos, sin), dict(style=style, layout="thd", out_dtype="float32")))
        cases.append((f"rope_backward_{style}", "rope_backward", (xr, cos, sin),
                      dict(style=style, layout="thd", out_dtype="float32")))
    a = spec.mxfp8_quantize(mags((32, 64)), axis=-1)
    b = spec.mxfp8_quantize(mags((32, 64)), axis=-1)
    cases.append(("gemm", "mxfp8_gemm", (a, b), dict(out_dtype="float32")))
    xq, wq = mags((T, 64), BF16), mags((H * 192, 64), BF16)
    cases.append(("mla_q", "mla_q_uproj_rope_quant", (xq, wq, cos, sin), {}))
    dq = mags((T, H, 192), BF16)
    cases.append(("mla_q_backward", "mla_q_uproj_rope_quant_backward", (dq, xq, wq, cos, sin), {}))
    cases.append(("rmsnorm", "rmsnorm_mxfp8", (mags((32, 64), BF16), rng.standard_normal(64).astype(np.float32)), {}))
    # Scores stay moderate: with huge ones, exp(s - lse) in the backward is ill-conditioned by design.
    q, k, v = mags((1, 20, 1, 192), BF16, 2), mags((1, 24, 1, 192), BF16, 2), mags((1, 24, 1, 128), BF16, 2)
    cases.append(("attention_causal", "mla_attention", (q, k, v), dict(causal=True)))
    o, lse = spec.mla_attention(q, k, v, causal=True)
    do = mags((1, 20, 1, 128), BF16, 2)
    cases.append(("attention_backward", "mla_attention_backward", (do, q, k, v, o, lse), dict(causal=True)))
    # appended last: the generator's earlier draws, and so every case above, stay as they were
    kv = mags((1, 64, 2, 256), BF16)
    flat = kv.reshape(-1, 256)
    flat[0, :32] = np.nan                                  # an all-NaN block of k_nope
    flat[1, 32:64] = 0.0                                   # an all-zero block
    flat[2, :3] = [np.inf, -0.0, np.float32(2.0 ** -133)]  # Inf, -0, a bf16 subnormal
    flat[3, 130] = np.float32(2.0 ** 8 * (1 - 2 ** -8))    # one bf16 ulp under a power of two, in v
    k_pe = mags((1, 64, 1, 64), BF16)
    k_pe[0, 1, 0, 3] = np.nan
    cases.append(("mla_kv_bshd_shared", "mla_kv_quantize", (kv[..., :128], k_pe, kv[..., 128:]), dict(layout="bshd")))
    kv_t = kv[0]  # thd [64, 2, 256], k_pe one row per head
    cases.append(("mla_kv_thd_per_head", "mla_kv_quantize",
                  (kv_t[..., :128], mags((64, 2, 64), BF16), kv_t[..., 128:]), dict(layout="thd")))
    # sbhd [32, 1, 2, 256], k_pe shared by both heads; v's special values along its blocks (the S axis)
    kv_s = mags((32, 1, 2, 256), BF16)
    v_s = kv_s[..., 128:]
    v_s[:, 0, 0, 5] = 0.0                                  # an all-zero block of v
    v_s[:, 0, 1, 6] = 0.0
    v_s[9, 0, 1, 6] = np.float32(2.0 ** 8 * (1 - 2 ** -8)) # one ulp under a power of two, its block's amax
    v_s[3, 0, 0, 7] = np.nan
    v_s[4, 0, 1, 8] = np.float32(2.0 ** -133)              # a subnormal
    v_s[5, 0, 0, 9] = -0.0
    v_s[6, 0, 1, 10] = -np.inf
    k_pe_s = mags((32, 1, 1, 64), BF16)
    k_pe_s[2, 0, 0, 32:] = 0.0                             # an all-zero block of k_pe
    cases.append(("mla_kv_sbhd_shared", "mla_kv_quantize", (kv_s[..., :128], k_pe_s, v_s), dict(layout="sbhd")))
    # k_pe rotated inside the op: the bshd case's inputs (stored once) with bf16 tables one row longer
    # than the sequence; layout and tables positional, since kwargs hold JSON values only
    cos_r = rng.uniform(-1, 1, (65, 64)).astype(np.float32).astype(BF16)
    sin_r = rng.uniform(-1, 1, (65, 64)).astype(np.float32).astype(BF16)
    sin_r[2, 7] = np.inf
    cases.append(("mla_kv_bshd_shared_rope", "mla_kv_quantize",
                  (kv[..., :128], k_pe, kv[..., 128:], "bshd", cos_r, sin_r), {}))
    # RMSNorm's backward: T not a multiple of 32, the forward's rstd, an all-zero row of x, a NaN in dy
    x_n = mags((40, 96), BF16)
    x_n[3] = 0.0
    dy_n = mags((40, 96), BF16)
    dy_n[5, 7] = np.nan
    gamma_n = rng.standard_normal(96).astype(np.float32)
    rstd_n = rmsnorm_rstd(x_n.astype(np.float32), 1e-6)
    cases.append(("rmsnorm_backward", "rmsnorm_backward", (dy_n, x_n, gamma_n, rstd_n), {}))
    cases.append(("rmsnorm_backward_zero_centered", "rmsnorm_backward",
                  (dy_n.astype(np.float32), x_n, gamma_n.astype(BF16), rstd_n, True), {}))
    return cases


_stored: dict = {}


def flatten(prefix, value, arrays, manifest):
    """Store a (possibly nested) value's arrays under prefix; return its structure description."""
    if isinstance(value, MXTensor):
        return {"mx": {"axis": value.axis, "elem": value.elem, "scale_layout": value.scale_layout,
                       "data": flatten(prefix + ".data", value.data, arrays, manifest),
                       "scale": flatten(prefix + ".scale", value.scale, arrays, manifest)}}
    if isinstance(value, (tuple, list)):
        return {"seq": [flatten(f"{prefix}.{i}", v, arrays, manifest) for i, v in enumerate(value)]}
    if isinstance(value, np.ndarray):
        bits = np.ascontiguousarray(value).view(UINT_OF_SIZE[value.dtype.itemsize])
        key = (str(value.dtype), bits.shape, hashlib.sha256(bits.tobytes()).hexdigest())
        if key in _stored:  # the same input serves many cases: store it once
            return {"array": _stored[key]}
        _stored[key] = prefix
        arrays[prefix] = bits
        manifest[prefix] = str(value.dtype)
        return {"array": prefix}
    return {"value": value}


def unflatten(desc, data, manifest):
    """Inverse of flatten: rebuild arrays (with their dtypes), MXTensors and sequences."""
    if "mx" in desc:
        e = desc["mx"]
        return MXTensor(unflatten(e["data"], data, manifest), unflatten(e["scale"], data, manifest),
                        axis=e["axis"], elem=e["elem"], scale_layout=e["scale_layout"])
    if "seq" in desc:
        return tuple(unflatten(v, data, manifest) for v in desc["seq"])
    if "array" in desc:
        return data[desc["array"]].view(np.dtype(manifest["dtypes"][desc["array"]]))
    return desc["value"]


def kwargs_from_json(kwargs):
    return {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}


def main():
    arrays, manifest, index = {}, {}, []
    for name, op, args, kwargs in golden_cases():
        out = getattr(spec, op)(*args, **kwargs)
        index.append({"name": name, "op": op, "kwargs": kwargs,
                      "args": flatten(f"{name}.in", tuple(args), arrays, manifest),
                      "expected": flatten(f"{name}.out", out, arrays, manifest)})
    arrays["__manifest__"] = np.frombuffer(json.dumps({"dtypes": manifest, "index": index}).encode(), np.uint8)
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(GOLDEN, **arrays)
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size / 1024:.0f} KiB, {len(index)} cases)")


if __name__ == "__main__":
    main()
