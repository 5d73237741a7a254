"""swizzle_scales / unswizzle_scales on every backend present, byte-equal to spec."""
from __future__ import annotations

import numpy as np
import pytest

import spec
from tests.conformance.conftest import run_on
from tests.util import F8E4M3, assert_bytes_equal

torch = pytest.importorskip("torch")
from backends.convert import to_torch  # noqa: E402  (needs torch)
from spec.mxtensor import MXTensor  # noqa: E402

# (data shape, blocked axis): rowwise/columnwise DeepSeek-V3-like shapes, row counts that are not
# multiples of 128, scale columns that are not multiples of 4, 3-D and 4-D tensors.
CASES = [
    ((256, 1536), 1),
    ((256, 1536), 0),
    ((96, 8, 192), 2),
    ((96, 8, 192), 0),
    ((37, 96), 1),
    ((2, 100, 3, 192), 3),
    ((2, 96, 3, 128), 1),
    ((1, 32), 1),
]


def _compact(shape, axis, seed):
    """A compact MXTensor with random (nonzero) scale bytes: the swizzle moves bytes, values don't matter."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=shape, dtype=np.uint8).view(F8E4M3)
    scale_shape = list(shape)
    scale_shape[axis] //= 32
    scale = rng.integers(1, 256, size=scale_shape, dtype=np.uint8)
    return MXTensor(data, scale, axis)


@pytest.mark.parametrize("shape,axis", CASES, ids=[f"{s}-ax{a}" for s, a in CASES])
def test_swizzle_unswizzle(target, shape, axis):
    device = target[1]
    t = _compact(shape, axis, seed=len(shape) * 10 + axis)
    want = spec.swizzle_scales(t)
    got = run_on(target, "swizzle_scales", to_torch(t, device))
    assert isinstance(got, MXTensor) and got.scale_layout == "swizzled"
    assert got.scale.device.type == device and got.scale.dtype == torch.uint8
    assert tuple(got.scale.shape) == t.swizzled_scale_shape
    assert_bytes_equal(got.scale, want.scale, "swizzled scale")
    assert_bytes_equal(got.data, t.data, "data untouched")

    back = run_on(target, "unswizzle_scales", got)
    assert back.scale_layout == "compact"
    assert_bytes_equal(back.scale, t.scale, "unswizzled")
    assert_bytes_equal(run_on(target, "unswizzle_scales", to_torch(want, device)).scale, t.scale, "from spec")


def test_layout_change_is_idempotent(target):
    device = target[1]
    t = to_torch(_compact((64, 64), 1, seed=1), device)
    s = run_on(target, "swizzle_scales", t)
    assert run_on(target, "swizzle_scales", s) is s
    assert run_on(target, "unswizzle_scales", t) is t


@pytest.mark.parametrize("role,shape,axis", [("qk", (2, 100, 3, 192), 3), ("v", (2, 96, 3, 128), 1)])
def test_pack_attention_scales(target, role, shape, axis):
    backend, device = target
    if backend != "torch":
        pytest.skip("pack_attention_scales is a helper of the torch backend (not a dispatched op)")
    from backends.torch.swizzle import pack_attention_scales

    t = _compact(shape, axis, seed=7)
    want = spec.pack_attention_scales(t, role)
    got = pack_attention_scales(to_torch(t, device), role)
    assert got.device.type == device
    assert_bytes_equal(got, want, f"pack {role}")
    got_swz = pack_attention_scales(to_torch(spec.swizzle_scales(t), device), role)
    assert_bytes_equal(got_swz, want, f"pack {role} from swizzled")
