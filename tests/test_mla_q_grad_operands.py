"""The fused MXFP8 backward's second operands (backends/triton/mla_q_grad_operands.py), byte for byte
against the torch backend's dequantization transposed and, for w, permuted as the dx kernel holds g's
rotated RoPE features; the guard on unsafe scale bytes and non-finite values. Interpreter (CPU)."""
from __future__ import annotations

import pytest
import torch

from spec.mxtensor import MXTensor

from tests.util import TRITON_INTERPRETER  # noqa: E402

pytest.importorskip("triton")
if not TRITON_INTERPRETER:
    pytest.skip("CPU tensors through the Triton interpreter only (tests/util.skip_without_triton_interpreter)",
                allow_module_level=True)
ops = pytest.importorskip("backends.triton.mla_q_grad_operands")
from backends.triton.gemm import BF16_SAFE_SCALE_BYTES  # noqa: E402
from backends.triton.mla_q import _dequantize_bf16  # noqa: E402

SAFE = BF16_SAFE_SCALE_BYTES["e4m3"]


def _mx_axis0(rows, cols, seed, kmajor=False, scale_lo=110, scale_hi=140):
    """An e4m3 MXTensor [rows, cols] blocked along rows, codes drawn over every finite code, both signs."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)  # no NaN codes
    scale = torch.randint(scale_lo, scale_hi, (rows // 32, cols), generator=g, dtype=torch.int32).to(torch.uint8)
    data = codes.view(torch.float8_e4m3fn)
    if kmajor:  # stored [cols, rows] contiguous, as dispatch.weights keeps the columnwise weight
        data = data.t().contiguous().t()
        scale = scale.t().contiguous().t()
    return MXTensor(data, scale, 0, "e4m3", "compact")


def _reference(t: MXTensor, permute: bool) -> torch.Tensor:
    """[cols, rows] bf16: the exact dequantization transposed, RoPE rows permuted."""
    dq = _dequantize_bf16(MXTensor(t.data.t(), t.scale.t(), 1, t.elem, "compact"))  # [cols, rows]
    if permute:
        rows = dq.shape[1]
        order = torch.arange(rows)
        for base in range(128, rows, 192):
            j = torch.arange(32)
            order[base + j] = base + 2 * j
            order[base + 32 + j] = base + 2 * j + 1
        dq = dq[:, order]
    return dq.contiguous()


@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("permute", [False, True])
def test_contraction_bf16_matches_torch(kmajor, permute):
    t = _mx_axis0(384, 48, seed=3 + kmajor, kmajor=kmajor)
    flag = torch.zeros(1, dtype=torch.int32)
    got = ops.contraction_bf16(t, flag, SAFE, permute, hw_cvt=False)
    want = _reference(t, permute)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert flag.item() == 0


def test_contraction_bf16_from_bf16_values():
    t = _mx_axis0(192, 40, seed=7)
    exact = _dequantize_bf16(MXTensor(t.data.t(), t.scale.t(), 1, "e4m3", "compact")).t().contiguous()  # [rows, cols]
    flag = torch.zeros(1, dtype=torch.int32)
    got = ops.contraction_bf16(exact, flag, SAFE, True, hw_cvt=False)
    assert torch.equal(got.view(torch.int16), _reference(t, True).view(torch.int16))
    assert flag.item() == 0


@pytest.mark.parametrize("case", ["low_scale", "high_scale", "nan_code"])
def test_contraction_bf16_guard(case):
    t = _mx_axis0(192, 32, seed=11)
    codes = t.data.view(torch.uint8).clone()
    scale = t.scale.clone()
    if case == "low_scale":
        scale[1, 5] = SAFE[0] - 1
        codes[32:64, 5] = 0x38  # nonzero codes under it
    elif case == "high_scale":
        scale[2, 7] = SAFE[1] + 1
        codes[64, 7] = 0x01
    else:
        codes[100, 3] = 0x7F
    t = MXTensor(codes.view(torch.float8_e4m3fn), scale, 0, "e4m3", "compact")
    flag = torch.zeros(1, dtype=torch.int32)
    ops.contraction_bf16(t, flag, SAFE, False, hw_cvt=False)
    assert flag.item() == 1


def test_zero_codes_under_unsafe_scale_keep_the_flag_down():
    t = _mx_axis0(64, 32, seed=13)
    codes = t.data.view(torch.uint8).clone()
    scale = t.scale.clone()
    scale[0, 0] = 0
    codes[0:32, 0] = torch.where(torch.arange(32) % 2 == 0, 0x00, 0x80).to(torch.uint8)  # +0 / -0
    flag = torch.zeros(1, dtype=torch.int32)
    ops.contraction_bf16(MXTensor(codes.view(torch.float8_e4m3fn), scale, 0, "e4m3", "compact"), flag, SAFE, False,
                         hw_cvt=False)
    assert flag.item() == 0


def test_bad_inputs_are_named():
    t = _mx_axis0(64, 32, seed=1)
    flag = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="src"):
        ops.contraction_bf16(MXTensor(t.data.t(), t.scale.t(), 1, "e4m3", "compact"), flag, SAFE, False, hw_cvt=False)
    with pytest.raises(ValueError, match="192"):
        ops.contraction_bf16(t, flag, SAFE, True, hw_cvt=False)
    with pytest.raises(ValueError, match="src"):
        ops.contraction_bf16(torch.zeros(64, 32), flag, SAFE, False, hw_cvt=False)
