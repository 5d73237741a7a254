"""Triton rope cases the shared conformance file does not reach: fp16 outputs, the kernel's head loop
and token blocks with tails, many sequences in the in-kernel binary search, int64 / strided position
tensors, and the autotune pruning. Byte-equal to spec; CUDA adds DeepSeek-V3 sizes."""
from __future__ import annotations

import numpy as np
import pytest

import spec
from tests.conformance.conftest import run_on
from tests.util import BF16, assert_bytes_equal, random_magnitudes, special_values_f32

torch = pytest.importorskip("torch")
pytest.importorskip("triton")  # every test here is of the Triton backend
from backends.convert import to_torch  # noqa: E402

STYLES = ("mla", "neox", "interleaved")
OPS = ("rope", "rope_backward")


def _check(target, op, x, cos, sin, what="", **kw):
    device = target[1]
    want = getattr(spec, op)(x, cos, sin, **kw)
    targs = {k: to_torch(v, device) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    got = run_on(target, op, to_torch(x, device), to_torch(cos, device), to_torch(sin, device), **targs)
    assert_bytes_equal(got, want, f"{op} {what}")


def _tables(rng, n, r, dtype=np.float32):
    return tuple(rng.uniform(-1.5, 1.5, (n, r)).astype(dtype) for _ in range(2))


@pytest.mark.parametrize("x_dtype", [np.float32, BF16, np.float16])
@pytest.mark.parametrize("op", OPS)
def test_float16_output(triton_target, op, x_dtype):
    # fp16 outputs: fp32 sums that overflow fp16 become Inf, fp16 subnormals, and pass-through values
    # converted (not copied) with canonical NaN 0x7E00.
    rng = np.random.default_rng(21)
    vals = special_values_f32()
    vals = vals[np.abs(vals) < 7e4] if x_dtype is np.float16 else vals
    x = rng.choice(np.concatenate([vals, rng.standard_normal(64).astype(np.float32) * 300]), size=(24, 3, 20))
    with np.errstate(over="ignore"):  # fp16: the values past its largest finite one become Inf inputs
        x = x.astype(x_dtype)
    cos, sin = _tables(rng, 24, 12, BF16)
    for style in STYLES:
        _check(triton_target, op, x, cos, sin, f"{style} fp16", style=style, positions=np.arange(24),
               out_dtype="float16")


@pytest.mark.parametrize("op", OPS)
def test_head_loop_and_token_tails(triton_target, op):
    # 37 heads: more than one head chunk, the last one partial; 8-feature heads: several tokens per
    # program, the last block partial (T = 29).
    rng = np.random.default_rng(22)
    for shape, r in [((5, 37, 24), 8), ((29, 3, 8), 8), ((13, 1, 6), 6)]:
        x = random_magnitudes(rng, shape, BF16)
        cos, sin = _tables(rng, 64, r)
        for style in STYLES:
            _check(triton_target, op, x, cos, sin, f"{style} {shape}", style=style, out_dtype="float32",
                   start_positions=np.array([7], np.int64))


@pytest.mark.parametrize("op", OPS)
def test_many_sequences(triton_target, op):
    # 70 sequences, many empty: the binary search over cu_seqlens runs 8 steps.
    rng = np.random.default_rng(23)
    lengths = rng.integers(0, 4, size=70) * rng.integers(0, 2, size=70)
    lengths[0] = 2
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    x = random_magnitudes(rng, (int(cu[-1]), 2, 12), BF16)
    cos, sin = _tables(rng, 128, 8)
    start = rng.integers(0, 100, size=70).astype(np.int32)
    _check(triton_target, op, x, cos, sin, "70 seqs", style="mla", cu_seqlens=cu, start_positions=start)
    even = (lengths // 2 * 2)
    cu2 = np.concatenate([[0], np.cumsum(even)]).astype(np.int32)
    x2 = random_magnitudes(rng, (int(cu2[-1]), 2, 12), BF16)
    _check(triton_target, op, x2, cos, sin, "70 seqs cp", style="neox", cu_seqlens=cu2, cp_size=3, cp_rank=1)


@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
@pytest.mark.parametrize("op", OPS)
def test_position_tensors(triton_target, op, layout):
    # int64 [B, S] positions given as a transposed (non-contiguous) view, and int64 [S] positions.
    rng = np.random.default_rng(24)
    B, S, H, D = 3, 5, 2, 16
    shape = (S, B, H, D) if layout == "sbhd" else (B, S, H, D)
    x = random_magnitudes(rng, shape, BF16)
    cos, sin = _tables(rng, 50, 8)
    device = triton_target[1]
    pos_sb = rng.integers(0, 50, size=(S, B)).astype(np.int64)
    want = spec.rope_backward if op == "rope_backward" else spec.rope
    want = want(x, cos, sin, style="interleaved", layout=layout, positions=np.ascontiguousarray(pos_sb.T))
    pos_view = to_torch(pos_sb, device).t()
    assert not pos_view.is_contiguous()
    got = run_on(triton_target, op, to_torch(x, device), to_torch(cos, device), to_torch(sin, device),
                 style="interleaved", layout=layout, positions=pos_view)
    assert_bytes_equal(got, want, f"{op} strided positions")
    _check(triton_target, op, x, cos, sin, "int64 [S]", style="mla", layout=layout,
           positions=rng.integers(0, 50, size=S).astype(np.int64))


def test_autotune_pruning_keeps_heads_together():
    from backends.triton.rope import _gpu_configs, _prune

    # DeepSeek-V3 q: 128 heads of 128 + 64 features -> one token per program, 16-64 heads per chunk.
    cfgs = _prune(_gpu_configs(), {"n_heads": 128}, BLOCK_KEEP=128, BLOCK_HALF=32)
    assert cfgs and all(c.kwargs["BLOCK_T"] == 1 and 16 <= c.kwargs["BLOCK_H"] <= 64 for c in cfgs)
    # k_pe: one head of 64 features -> many tokens per program.
    cfgs = _prune(_gpu_configs(), {"n_heads": 1}, BLOCK_KEEP=1, BLOCK_HALF=32)
    assert cfgs and all(c.kwargs["BLOCK_T"] >= 32 for c in cfgs)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_deepseek_full_size_cuda(op):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import dispatch

    # [T, 128, 192] bf16 with rope_dim 64, varlen with start positions; torch is byte-equal to spec.
    g = torch.Generator(device="cuda").manual_seed(0)
    T = 4096
    x = torch.randn(T, 128, 192, device="cuda", generator=g).to(torch.bfloat16)
    cos = torch.rand(8192, 64, device="cuda", generator=g) * 2 - 1
    sin = torch.rand(8192, 64, device="cuda", generator=g) * 2 - 1
    cu = torch.tensor([0, 1000, 1001, 3000, T], dtype=torch.int32, device="cuda")
    start = torch.tensor([0, 5000, 7, 100], dtype=torch.int32, device="cuda")
    for style in STYLES:
        kw = dict(style=style, cu_seqlens=cu, start_positions=start)
        got = dispatch.run(op, x, cos, sin, backend="triton", **kw)
        want = dispatch.run(op, x, cos, sin, backend="torch", **kw)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), style
