"""spec.swizzle: the F8_128x4 scale layout (SEMANTICS 3), its inverse, MXTensor wrappers, attention packing."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spec.mxtensor import MXTensor
from spec.quantize import mxfp8_quantize
from spec.swizzle import (
    pack_attention_scales,
    swizzle_matrix,
    swizzle_offset,
    swizzle_scales,
    unswizzle_matrix,
    unswizzle_scales,
    validate_swizzle_scales,
    validate_unswizzle_scales,
)
from tests.util import assert_bytes_equal, random_magnitudes


def _roundup(n, m):
    return -(-n // m) * m


def _formula(i, j, cols):
    """SEMANTICS 3.3 written out literally."""
    cp = _roundup(cols, 4)
    return ((i // 128) * (cp // 4) + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + (j % 4)


def _permute_view(s):
    """SEMANTICS 3.3's second statement: pad, view (R'/128, 4, 32, C'/4, 4), permute (0, 3, 2, 1, 4), flatten."""
    r, c = s.shape
    rp, cp = _roundup(r, 128), _roundup(c, 4)
    p = np.zeros((rp, cp), np.uint8)
    p[:r, :c] = s
    return p.reshape(rp // 128, 4, 32, cp // 4, 4).transpose(0, 3, 2, 1, 4).reshape(-1)


def _distinct_bytes(rng, shape):
    return rng.integers(1, 256, size=shape, dtype=np.uint8)  # nonzero, so padding is distinguishable


def test_literal_offsets():
    s = np.zeros((160, 9), np.uint8)
    s[0, 0], s[1, 0], s[32, 0], s[96, 3], s[0, 4], s[127, 8], s[128, 0], s[159, 5] = range(1, 9)
    buf = swizzle_matrix(s)
    assert buf.shape == (256, 12)
    flat = buf.reshape(-1)
    # C' = 12 -> 3 tiles per 128-row group; tile = 512 bytes
    expect = {0: 1, 16: 2, 4: 3, 12 + 3: 4, 512: 5, 2 * 512 + 31 * 16 + 3 * 4 + 0: 6, 3 * 512: 7,
              3 * 512 + 512 + 31 * 16 + 1: 8}
    for off, val in expect.items():
        assert flat[off] == val, off
    assert np.count_nonzero(flat) == 8


def test_single_byte_pads_to_one_tile():
    buf = swizzle_matrix(np.array([[0xAB]], np.uint8))
    assert buf.shape == (128, 4) and buf.dtype == np.uint8
    assert buf.reshape(-1)[0] == 0xAB and np.count_nonzero(buf) == 1


@pytest.mark.parametrize("shape", [(1, 1), (128, 4), (200, 7), (300, 13), (256, 224), (7168, 48)])
def test_formula_permute_view_and_implementation_agree(shape):
    rng = np.random.default_rng(sum(shape))
    s = _distinct_bytes(rng, shape)
    flat = swizzle_matrix(s).reshape(-1)
    view = _permute_view(s)
    assert_bytes_equal(flat, view, "implementation vs permute view")
    i, j = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
    off = _formula(i, j, shape[1])
    assert_bytes_equal(view[off], s, "formula vs permute view")
    assert_bytes_equal(swizzle_offset(i, j, shape[1]), off, "swizzle_offset")
    assert len(np.unique(off)) == s.size  # a bijection onto its image


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 400), st.integers(1, 40), st.integers(0, 2**31 - 1))
def test_roundtrip_identity_and_zero_padding(rows, cols, seed):
    s = _distinct_bytes(np.random.default_rng(seed), (rows, cols))
    buf = swizzle_matrix(s)
    assert buf.shape == (_roundup(rows, 128), _roundup(cols, 4))
    assert_bytes_equal(unswizzle_matrix(buf, rows, cols), s)
    assert_bytes_equal(unswizzle_matrix(buf.reshape(-1), rows, cols), s)
    # every byte outside the image of S is padding and must be 0
    i, j = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    mask = np.ones(buf.size, bool)
    mask[_formula(i, j, cols).ravel()] = False
    assert not buf.reshape(-1)[mask].any()


def test_batched_matrices():
    rng = np.random.default_rng(3)
    s = _distinct_bytes(rng, (2, 3, 130, 6))
    buf = swizzle_matrix(s)
    assert buf.shape == (2, 3, 256, 8)
    for a in range(2):
        for b in range(3):
            assert_bytes_equal(buf[a, b], swizzle_matrix(s[a, b]))
    assert_bytes_equal(unswizzle_matrix(buf, 130, 6), s)


@pytest.mark.parametrize("shape,axis", [((64, 96), 1), ((64, 96), 0), ((3, 64, 5, 96), 1), ((3, 64, 5, 96), 3),
                                        ((160, 7, 192), 2), ((160, 7, 192), 0)])
def test_mxtensor_swizzle_any_axis(shape, axis):
    rng = np.random.default_rng(len(shape) + axis)
    t = mxfp8_quantize(random_magnitudes(rng, shape), axis=axis)
    s = swizzle_scales(t)
    assert s.scale_layout == "swizzled" and s.scale.shape == t.swizzled_scale_shape
    assert s.data is t.data
    # 2-D matrix: blocked axis last, the others flattened in order
    other = [d for d in range(len(shape)) if d != axis]
    mat = np.transpose(t.scale, other + [axis]).reshape(t.scale_matrix_shape)
    assert_bytes_equal(s.scale.reshape(-1), _permute_view(mat))
    u = unswizzle_scales(s)
    assert u.scale_layout == "compact"
    assert_bytes_equal(u.scale, t.scale)


def test_columnwise_matrix_is_transpose_of_compact():
    # SEMANTICS 3.1: columnwise [M, N] blocked on axis 0 -> S[N, M/32], the transpose of compact [M/32, N]
    rng = np.random.default_rng(5)
    t = mxfp8_quantize(random_magnitudes(rng, (96, 40)), axis=0)
    assert t.scale_matrix_shape == (40, 3)
    assert_bytes_equal(swizzle_scales(t).scale.reshape(-1), _permute_view(t.scale.T))


def test_layout_change_is_idempotent():
    t = mxfp8_quantize(np.ones((32, 32), np.float32))
    s = swizzle_scales(t)
    assert swizzle_scales(s) is s
    assert unswizzle_scales(t) is t


def test_bad_inputs():
    t = mxfp8_quantize(np.ones((32, 32), np.float32))
    for fn in (swizzle_scales, unswizzle_scales, validate_swizzle_scales, validate_unswizzle_scales):
        with pytest.raises(TypeError, match="^t:"):
            fn(t.scale)
        with pytest.raises(TypeError, match="^t:"):
            fn(t.replace(scale=t.scale.astype(np.int32)))
    with pytest.raises(ValueError, match="^buf:"):
        unswizzle_matrix(np.zeros((128, 8), np.uint8), 10, 3)
    with pytest.raises(ValueError, match="^s:"):
        swizzle_matrix(np.zeros(4, np.uint8))


# ---------------------------------------------------------------------------------------------
# cuDNN SDPA per-(batch, head) packing


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_pack_qk(layout):
    rng = np.random.default_rng(11)
    b, s, h, d = 2, 100, 3, 192  # S not a multiple of 128; D/32 = 6 pads to 8
    x = random_magnitudes(rng, (b, s, h, d))
    if layout == "sbhd":
        x = np.ascontiguousarray(x.transpose(1, 0, 2, 3))
    t = mxfp8_quantize(x, axis=3)
    packed = pack_attention_scales(t, "qk", layout=layout)
    assert packed.shape == (b, h, 128, 8) and packed.dtype == np.uint8
    for bi in range(b):
        for hi in range(h):
            mat = t.scale[bi, :, hi, :] if layout == "bshd" else t.scale[:, bi, hi, :]  # [S, D/32]
            assert_bytes_equal(packed[bi, hi].reshape(-1), _permute_view(mat), f"b={bi} h={hi}")
    # swizzled input gives the same packing
    assert_bytes_equal(pack_attention_scales(swizzle_scales(t), "qk", layout=layout), packed)


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_pack_v(layout):
    rng = np.random.default_rng(12)
    b, s, h, d = 2, 96, 3, 128  # S/32 = 3 pads to 4
    x = random_magnitudes(rng, (b, s, h, d))
    seq_axis = 1
    if layout == "sbhd":
        x = np.ascontiguousarray(x.transpose(1, 0, 2, 3))
        seq_axis = 0
    t = mxfp8_quantize(x, axis=seq_axis)
    packed = pack_attention_scales(t, "v", layout=layout)
    assert packed.shape == (b, h, 4, 128)
    for bi in range(b):
        for hi in range(h):
            mat = t.scale[bi, :, hi, :] if layout == "bshd" else t.scale[:, bi, hi, :]  # [S/32, D]
            # the blocked axis (S/32) is last in the swizzled 2-D matrix: [D, S/32]
            assert_bytes_equal(packed[bi, hi].reshape(-1), _permute_view(mat.T), f"b={bi} h={hi}")


def test_pack_d192_v_pads_to_256():
    t = mxfp8_quantize(np.ones((1, 32, 1, 192), np.float32), axis=1)
    assert pack_attention_scales(t, "v").shape == (1, 1, 4, 256)


def test_pack_bad_inputs():
    q = mxfp8_quantize(np.ones((1, 32, 2, 64), np.float32), axis=3)
    with pytest.raises(ValueError, match="^role:"):
        pack_attention_scales(q, "k")
    with pytest.raises(ValueError, match="^layout:"):
        pack_attention_scales(q, "qk", layout="thd")
    with pytest.raises(ValueError, match="^t:"):
        pack_attention_scales(q, "v")  # blocked along D, not S
    with pytest.raises(ValueError, match="^t:"):
        pack_attention_scales(mxfp8_quantize(np.ones((32, 64), np.float32)), "qk")
    with pytest.raises(TypeError, match="^t:"):
        pack_attention_scales(q.scale, "qk")
