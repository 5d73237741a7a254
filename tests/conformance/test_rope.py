"""rope / rope_backward on every backend present, byte-equal to spec (fp32 and bf16 outputs)."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import spec
from spec.constants import LAYOUTS, ROPE_STYLES
from tests.conformance.conftest import run_on
from tests.util import BF16, assert_bytes_equal, random_magnitudes, special_values_f32

torch = pytest.importorskip("torch")
from backends.convert import to_torch  # noqa: E402  (needs torch)

OPS = ("rope", "rope_backward")
OUT_DTYPES = ("float32", "bfloat16")


def _compare(target, op, x, cos, sin, what="", x_torch=None, **kw):
    """Run `op` on the target with the NumPy arguments moved to its device; compare bytes with spec."""
    device = target[1]
    want = getattr(spec, op)(x, cos, sin, **kw)
    args = [to_torch(x, device) if x_torch is None else x_torch, to_torch(cos, device), to_torch(sin, device)]
    got = run_on(target, op, *args, **{k: to_torch(v, device) for k, v in kw.items()})
    assert isinstance(got, torch.Tensor) and got.device.type == device
    assert_bytes_equal(got, want, f"{op} {what}")


def _tables(rng, n_rows, rope_dim, dtype=np.float32):
    # Asymmetric halves (as a real cat([f, f]) table would hide a half swap).
    return tuple(rng.uniform(-1.5, 1.5, (n_rows, rope_dim)).astype(dtype) for _ in range(2))


def _layout_shape(layout, B, S, H, D):
    return {"thd": (B * S, H, D), "sbhd": (S, B, H, D), "bshd": (B, S, H, D)}[layout]


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("style", ROPE_STYLES)
@pytest.mark.parametrize("op", OPS)
def test_styles_layouts(target, op, style, layout, out_dtype):
    rng = np.random.default_rng(zlib.crc32(f"{op}{style}{layout}{out_dtype}".encode()))  # reproducible seed
    B, S, H, D, R = 3, 10, 4, 40, 16
    x = random_magnitudes(rng, _layout_shape(layout, B, S, H, D), BF16)
    cos, sin = _tables(rng, 64, R)
    kw = dict(style=style, layout=layout, out_dtype=out_dtype, start_positions=np.array([0, 5, 30], np.int32))
    if layout == "thd":
        kw["cu_seqlens"] = np.array([0, 7, 19, 30], np.int32)
    _compare(target, op, x, cos, sin, f"{style} {layout}", **kw)


@pytest.mark.parametrize("x_dtype", [np.float32, BF16, np.float16])
@pytest.mark.parametrize("table_dtype", [np.float32, BF16])
@pytest.mark.parametrize("op", OPS)
def test_varlen_thd_with_start_positions(target, op, x_dtype, table_dtype):
    rng = np.random.default_rng(11)
    cu = np.array([0, 5, 5, 6, 23, 40], np.int32)  # an empty sequence and a single-token one
    x = random_magnitudes(rng, (40, 3, 24), np.float32)
    if x_dtype is np.float16:
        x = rng.standard_normal((40, 3, 24)).astype(np.float16)  # keep fp16 finite
    x = x.astype(x_dtype)
    cos, sin = _tables(rng, 128, 8, table_dtype)
    start = rng.integers(0, 80, size=5).astype(np.int64)
    for out_dtype in (None, *OUT_DTYPES):
        for style in ROPE_STYLES:
            _compare(target, op, x, cos, sin, f"{style} {out_dtype}", style=style, cu_seqlens=cu,
                     start_positions=start, out_dtype=out_dtype)


@pytest.mark.parametrize("cp", [(2, 0), (2, 1), (4, 3)])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", OPS)
def test_context_parallel(target, op, layout, cp):
    rng = np.random.default_rng(12)
    B, S, H, D, R = 2, 6, 2, 16, 8
    x = random_magnitudes(rng, _layout_shape(layout, B, S, H, D))
    cos, sin = _tables(rng, 256, R)
    kw = dict(layout=layout, cp_size=cp[0], cp_rank=cp[1], start_positions=np.array([3, 9], np.int32))
    if layout == "thd":
        kw["cu_seqlens"] = np.array([0, 4, 12], np.int32)
    for style in ROPE_STYLES:
        _compare(target, op, x, cos, sin, f"{style} cp{cp}", style=style, out_dtype="float32", **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", OPS)
def test_explicit_positions(target, op, layout):
    rng = np.random.default_rng(13)
    B, S, H, D, R = 2, 5, 2, 12, 12
    x = random_magnitudes(rng, _layout_shape(layout, B, S, H, D))
    cos, sin = _tables(rng, 100, R)
    shapes = [(B * S,)] if layout == "thd" else [(S,), (B, S)]
    for shape in shapes:
        pos = rng.integers(0, 100, size=shape).astype(np.int32)
        _compare(target, op, x, cos, sin, f"positions {shape}", style="mla", layout=layout, positions=pos,
                 out_dtype="bfloat16")


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("x_dtype", [np.float32, BF16])
@pytest.mark.parametrize("op", OPS)
def test_special_values(target, op, x_dtype, out_dtype):
    # Zeros of both signs, subnormals, format maxima, inf and NaN in x; tables with 0, -0, subnormal
    # and large entries, so inf*0 NaNs, overflowing sums and subnormal products all occur.
    rng = np.random.default_rng(14)
    vals = special_values_f32()
    T, H, D, R = 48, 2, 36, 32
    x = rng.choice(vals, size=(T, H, D)).astype(x_dtype)
    table_vals = np.array([0.0, -0.0, 1.0, -1.0, 0.5, 2.0 ** -140, 2.0 ** -126, 3e38, 1e-20, 0.7071], np.float32)
    cos = rng.choice(table_vals, size=(T, R)).astype(np.float32)
    sin = rng.choice(table_vals, size=(T, R)).astype(np.float32)
    for style in ROPE_STYLES:
        _compare(target, op, x, cos, sin, f"special {style}", style=style, positions=np.arange(T),
                 out_dtype=out_dtype)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_deepseek_shape(target, op, out_dtype):
    # DeepSeek-V3 MLA query scaled down: 8 heads of 128 no-RoPE + 64 RoPE features.
    rng = np.random.default_rng(15)
    T, H, D, R = 256, 8, 192, 64
    x = random_magnitudes(rng, (T, H, D), BF16)
    cos, sin = _tables(rng, 4096, R)
    cu = np.array([0, 31, 32, 200, 256], np.int32)
    start = np.array([0, 4000, 17, 1], np.int32)
    _compare(target, op, x, cos, sin, "deepseek varlen", style="mla", cu_seqlens=cu, start_positions=start,
             out_dtype=out_dtype)
    if op == "rope_backward":
        return  # same kernel path as above; skipping the repeat keeps the Triton interpreter under budget
    # The fused op's convention: tables already gathered per token row, positions = arange(T).
    _compare(target, op, x, cos[:T], sin[:T], "deepseek per-row", style="mla", positions=np.arange(T),
             out_dtype=out_dtype)


ODD = [
    # (layout, x shape, rope_dim, cu_seqlens)
    ("thd", (1, 1, 2), 2, None),
    ("thd", (0, 2, 8), 4, None),
    ("thd", (37, 3, 66), 2, [0, 0, 13, 13, 37]),
    ("thd", (9, 5, 7), 6, [0, 9]),
    ("sbhd", (1, 1, 1, 4), 4, None),
    ("sbhd", (7, 3, 1, 10), 10, None),
    ("bshd", (3, 5, 2, 130), 66, None),
]


@pytest.mark.parametrize("layout,shape,rope_dim,cu", ODD, ids=[f"{c[0]}-{c[1]}-r{c[2]}" for c in ODD])
@pytest.mark.parametrize("op", OPS)
def test_odd_sizes(target, op, layout, shape, rope_dim, cu):
    rng = np.random.default_rng(16)
    # (tests.util.random_magnitudes cannot build a zero-size array)
    x = random_magnitudes(rng, shape) if np.prod(shape) else np.zeros(shape, np.float32)
    cos, sin = _tables(rng, 50, rope_dim)
    kw = dict(layout=layout)
    if cu is not None:
        kw["cu_seqlens"] = np.array(cu, np.int32)
    for style in ROPE_STYLES:
        for out_dtype in OUT_DTYPES:
            _compare(target, op, x, cos, sin, f"{style} {out_dtype}", style=style, out_dtype=out_dtype, **kw)


@pytest.mark.parametrize("op", OPS)
def test_non_contiguous_input(target, op):
    # A bshd tensor viewed as sbhd (transposed, not copied): the backend must honour strides.
    rng = np.random.default_rng(17)
    x_bshd = random_magnitudes(rng, (3, 4, 2, 16), BF16)
    x_sbhd = np.ascontiguousarray(x_bshd.transpose(1, 0, 2, 3))
    view = to_torch(x_bshd, target[1]).transpose(0, 1)
    assert not view.is_contiguous()
    cos, sin = _tables(rng, 16, 8)
    _compare(target, op, x_sbhd, cos, sin, "strided", x_torch=view, layout="sbhd", style="neox",
             out_dtype="float32")


def test_bad_arguments_fail_like_spec(target):
    # The dispatcher runs spec's validator on the torch arguments: same exception, same message.
    # (Shape, dtype and choice checks; the values of index tensors are checked by spec only.)
    device = target[1]
    x = torch.zeros(6, 2, 8, device=device)
    cos = torch.zeros(16, 4, device=device)
    with pytest.raises(TypeError, match=r"^cu_seqlens:"):
        run_on(target, "rope", x, cos, cos, cu_seqlens=torch.tensor([0, 4, 2, 6], dtype=torch.float32, device=device))
    with pytest.raises(ValueError, match=r"^cos: rope_dim 10 exceeds"):
        run_on(target, "rope_backward", x, torch.zeros(16, 10, device=device), torch.zeros(16, 10, device=device))
    with pytest.raises(ValueError, match=r"^style:"):
        run_on(target, "rope", x, cos, cos, style="gptj")
