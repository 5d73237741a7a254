"""dispatch.transpose / backends.triton.transpose: a 1-byte tensor transposed into a given output, byte
for byte equal to torch's `.t().contiguous()` (the Triton kernel, and torch's copy as the fallback)."""
from __future__ import annotations

import pytest
import torch

import dispatch.transpose as mxt
from tests.util import TRITON_INTERPRETER, assert_bytes_equal, poisoned_empty, skip_without_triton_interpreter

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]

# odd sizes (no multiple of a tile), single rows / columns, and [24576, 1536] (q_b_proj) scaled down
SHAPES = [(1, 1), (1, 200), (200, 1), (37, 53), (65, 129), (96, 48), (768, 1536 // 32), (3072, 192)]
BYTE_DTYPES = [torch.uint8, torch.float8_e4m3fn]


def _use_triton(device: str) -> None:
    if device == "cpu":
        skip_without_triton_interpreter()
    else:
        pytest.importorskip("triton")
        if TRITON_INTERPRETER:
            pytest.skip("TRITON_INTERPRET=1: the kernels run on the CPU")


def _bytes(shape, device, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device)


def _triton_transpose(src, out):
    from backends.triton import transpose

    assert not transpose.transpose_reasons(src, out)
    return transpose.transpose_bytes_into(src, out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", BYTE_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_kernel_bytes_equal_torch_transpose(shape, dtype, device):
    _use_triton(device)
    src = _bytes(shape, device, seed=sum(shape)).view(dtype)
    out = poisoned_empty(shape[::-1], dtype, device)
    assert _triton_transpose(src, out) is out
    assert_bytes_equal(out, src.t().contiguous(), f"{tuple(shape)} {dtype}")


@pytest.mark.parametrize("device", DEVICES)
def test_triton_kernel_reads_and_writes_strided_views(device):
    _use_triton(device)
    base = _bytes((70, 300), device, seed=1)
    src = base[3:, 5::3]                                  # neither stride contiguous-like: (300, 3)
    big = poisoned_empty((src.shape[1] + 4, src.shape[0] * 2), torch.uint8, device)
    out = big[2:-2, ::2]                                  # a strided output: (2 * rows, 2)
    _triton_transpose(src, out)
    assert_bytes_equal(out, src.t().contiguous(), "strided")
    untouched = big.clone()
    untouched[2:-2, ::2] = 0xFF
    assert bool((untouched == 0xFF).all()), "bytes outside the output view were written"
    src_t = _bytes((90, 40), device, seed=2).t()            # a transposed source: stride (1, 40)
    out = poisoned_empty((90, 40), torch.uint8, device)
    _triton_transpose(src_t, out)
    assert_bytes_equal(out, src_t.t(), "transposed source")


@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_helper_writes_codes_into_a_uint8_buffer(device):
    """The weight-copy case: float8 codes [N, K] into a uint8 buffer [K, N], by the Triton kernel where
    it can run and torch's copy otherwise (backend='torch'); both the same bytes."""
    if device == "cuda":
        _use_triton(device)
    src = _bytes((192, 96), device, seed=3).view(torch.float8_e4m3fn)
    want = src.view(torch.uint8).t().contiguous()
    for backend in (None, "torch"):
        out = poisoned_empty((96, 192), torch.uint8, device)
        assert mxt.transpose_bytes_into(src, out, backend=backend) is out
        assert_bytes_equal(out, want, f"backend={backend}")


def test_dispatch_helper_falls_back_to_torch_where_triton_cannot_serve(monkeypatch):
    pytest.importorskip("triton")
    from backends.triton import transpose

    src, out = _bytes((33, 17), "cpu"), poisoned_empty((17, 33), torch.uint8, "cpu")
    monkeypatch.setattr(mxt, "_chosen", {})  # the choice is kept per device: made afresh here
    monkeypatch.setattr(transpose, "transpose_reasons", lambda s, o: ["inputs are on the CPU"])
    monkeypatch.setattr(transpose, "transpose_bytes_into", lambda s, o: pytest.fail("the kernel ran"))
    mxt.transpose_bytes_into(src, out)
    assert_bytes_equal(out, src.t().contiguous(), "fallback")


def test_triton_kernel_not_used_when_the_backend_request_excludes_it(monkeypatch):
    pytest.importorskip("triton")
    from backends.triton import transpose

    monkeypatch.setattr(mxt, "_chosen", {})
    monkeypatch.setattr(transpose, "transpose_bytes_into", lambda s, o: pytest.fail("the kernel ran"))
    src, out = _bytes((8, 40), "cpu"), poisoned_empty((40, 8), torch.uint8, "cpu")
    mxt.transpose_bytes_into(src, out, backend="torch")
    assert_bytes_equal(out, src.t().contiguous(), "backend=torch")


@pytest.mark.parametrize("policy, kernel_runs", [("torch", False), ("mxfp8_quantize=torch;*=triton", False),
                                                 ("mla_attention=cudnn;*=torch,triton", True)])
def test_triton_kernel_follows_mxmla_backend_without_a_backend_argument(monkeypatch, policy, kernel_runs):
    """With no backend=, MXMLA_BACKEND's entry for mxfp8_quantize (the op whose bytes it moves) decides
    whether the kernel may serve; the same bytes either way."""
    pytest.importorskip("triton")
    from backends.triton import transpose

    ran = []
    monkeypatch.setattr(mxt, "_chosen", {})
    monkeypatch.setattr(transpose, "transpose_reasons", lambda s, o: [])
    monkeypatch.setattr(transpose, "transpose_bytes_into", lambda s, o: (ran.append(1), o.copy_(s.t())))
    monkeypatch.setenv("MXMLA_BACKEND", policy)
    src, out = _bytes((8, 40), "cpu"), poisoned_empty((40, 8), torch.uint8, "cpu")
    mxt.transpose_bytes_into(src, out)
    assert bool(ran) is kernel_runs, policy
    assert_bytes_equal(out, src.t().contiguous(), policy)


@pytest.mark.parametrize("src, out, exc, match", [
    (torch.zeros(4, 6, dtype=torch.uint8), torch.zeros(4, 6, dtype=torch.uint8), ValueError, "out: expected shape"),
    (torch.zeros(4, 6, dtype=torch.bfloat16), torch.zeros(6, 4, dtype=torch.uint8), TypeError, "src: expected 1-byte"),
    (torch.zeros(4, 6, dtype=torch.uint8), torch.zeros(6, 4, dtype=torch.int16), TypeError, "out: expected 1-byte"),
    (torch.zeros(2, 4, 6, dtype=torch.uint8), torch.zeros(6, 4, dtype=torch.uint8), ValueError, "src: expected a 2-D"),
    ([[1]], torch.zeros(1, 1, dtype=torch.uint8), TypeError, "src: expected a torch.Tensor"),
    (torch.zeros(4, 6, dtype=torch.uint8), torch.zeros(6, 1, dtype=torch.uint8).expand(6, 4), ValueError,
     "out: expected no element written twice"),
])
def test_bad_arguments_name_the_argument(src, out, exc, match):
    with pytest.raises(exc, match=match):
        mxt.transpose_bytes_into(src, out)


def test_plan_switches_to_64_bit_offsets_past_int32():
    pytest.importorskip("triton")
    from backends.triton.transpose import _plan

    assert _plan(24576, 1536, 1536, 1, 24576, 1)[-1] is False
    assert _plan(1 << 16, 1 << 15, 1 << 15, 1, 1 << 16, 1)[-1] is True  # 2^31 bytes
    grid, tiles_c, block_r, block_c, _ = _plan(37, 200, 200, 1, 37, 1)
    assert (block_r, block_c, tiles_c, grid) == (64, 64, 4, (4,))
    assert _plan(1, 1, 1, 1, 1, 1)[2:4] == (16, 16)


def test_weight_copies_write_the_transposed_copy_into_poisoned_buffers():
    """WeightCopies.refresh transposes the columnwise copy straight into its buffers: every byte of
    them is written, and equals the uncached quantization's copy transposed."""
    import dispatch.autograd as mxag
    import dispatch.weights as mxw

    n, k = 96, 64
    w = torch.nn.Parameter(torch.randn(n, k, generator=torch.Generator().manual_seed(5)) * 0.05)
    copies = mxw.WeightCopies((n, k))
    for buf in (copies.row_codes, copies.row_scales, copies.col_codes_t, copies.col_scales_t):
        buf.fill_(0xFF)
    copies.refresh(w)
    row, col = mxag.mxfp8_quantize(w.detach().to(torch.bfloat16), axis=(1, 0))
    assert_bytes_equal(copies.row_codes, row.data.view(torch.uint8), "row codes")
    assert_bytes_equal(copies.row_scales, row.scale, "row scales")
    assert_bytes_equal(copies.col_codes_t, col.data.view(torch.uint8).t().contiguous(), "col codes")
    assert_bytes_equal(copies.col_scales_t, col.scale.t().contiguous(), "col scales")
    entry = mxw.MXFP8Weight.quantize(w)
    assert_bytes_equal(entry.col.data.t(), copies.col_codes_t, "MXFP8Weight.quantize col codes")
    assert entry.col.data.t().is_contiguous() and entry.col.scale.t().is_contiguous()
