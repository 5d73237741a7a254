"""dispatch.weights: the per-update MXFP8 copies of a weight (bytes, staleness, gradients, compile)."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import dispatch
import dispatch.autograd as mxag
import dispatch.weights as mxw
from spec.mxtensor import MXTensor
from tests.util import assert_bytes_equal, random_magnitudes, skip_without_triton_interpreter, special_values_f32

N, K, T = 2 * 192, 64, 64  # two heads of the fused Q op, q_lora 64, 64 tokens


def _weight(gen, dtype=torch.float32, scale=0.05) -> torch.nn.Parameter:
    return torch.nn.Parameter((torch.randn(N, K, generator=gen) * scale).to(dtype))


@pytest.fixture
def quantize_calls(monkeypatch):
    """Counts dispatch.run("mxfp8_quantize") calls on [N, K] inputs (the weight's quantizations)."""
    calls = []
    real_run = dispatch.run

    def run(op, *args, **kwargs):
        if op == "mxfp8_quantize" and tuple(args[0].shape) == (N, K):
            calls.append(kwargs.get("backend"))
        return real_run(op, *args, **kwargs)

    monkeypatch.setattr(dispatch, "run", run)
    return calls


def _uncached(w):
    return mxag.mxfp8_quantize(w.to(torch.bfloat16), axis=(1, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_equal_the_uncached_quantize_and_col_is_stored_transposed(dtype):
    w = torch.nn.Parameter(_magnitudes().to(dtype))
    row, col = mxw.quantized_weight(w)
    want_row, want_col = _uncached(w)
    assert (row.axis, col.axis, row.shape, col.shape) == (1, 0, (N, K), (N, K))
    assert_bytes_equal(row.data, want_row.data, "w_row codes")
    assert_bytes_equal(row.scale, want_row.scale, "w_row scales")
    assert_bytes_equal(col.data, want_col.data, "w_col codes")
    assert_bytes_equal(col.scale, want_col.scale, "w_col scales")
    # the [K, N] views the MXFP8 backward's dx GEMM reads are K-major without a copy
    assert col.data.t().is_contiguous() and col.scale.t().is_contiguous()
    assert row.data.is_contiguous() and row.scale.is_contiguous()
    assert row.grad_proxy is col.grad_proxy and row.grad_proxy.dtype == torch.bfloat16


def _magnitudes() -> torch.Tensor:
    """Rows at magnitudes 2^-30 .. 2^30, with the special values (zeros, subnormals, format maxima,
    inf, nan) written into rows 7 and 100."""
    out = torch.from_numpy(random_magnitudes(np.random.default_rng(0), (N, K)))
    specials = torch.from_numpy(special_values_f32().astype(np.float32)).flatten()
    for row in (7, 100):
        n = min(K, specials.numel())
        out[row, :n] = specials[:n]
    return out


def test_unchanged_weight_is_quantized_once(quantize_calls):
    gen = torch.Generator().manual_seed(1)
    w = _weight(gen)
    first = mxw.quantized_weight(w)
    for _ in range(3):
        again = mxw.quantized_weight(w)
        assert again[0].data is first[0].data and again[1].data is first[1].data
    with torch.no_grad():
        mxw.quantized_weight(w)
    assert len(quantize_calls) == 1


def _in_place_add(w):
    with torch.no_grad():
        w.add_(1e-2)


def _detach_mul(w):
    w.detach().mul_(1.5)


def _new_storage(w):
    w.data = w.data.clone() * 1.25


def _optimizer(kind):
    def step(w):
        opt = {"adamw": lambda: torch.optim.AdamW([w], lr=1e-2),
               "adamw_foreach": lambda: torch.optim.AdamW([w], lr=1e-2, foreach=True),
               "adamw_fused": lambda: torch.optim.AdamW([w], lr=1e-2, fused=True),
               "sgd": lambda: torch.optim.SGD([w], lr=1e-1)}[kind]()
        w.grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(9)).to(w.dtype)
        opt.step()
    return step


def _data_copy_then_invalidate(w):
    w.data.copy_(w.data * 0.7)  # bypasses w._version: only invalidate() can tell the cache
    mxw.invalidate(w)


CHANGES = {
    "in_place_add": _in_place_add,
    "detach_mul": _detach_mul,
    "new_storage": _new_storage,
    "adamw": _optimizer("adamw"),
    "adamw_foreach": _optimizer("adamw_foreach"),
    "adamw_fused": _optimizer("adamw_fused"),  # writes without bumping _version: the step hook sees it
    "sgd": _optimizer("sgd"),
    "data_copy_then_invalidate": _data_copy_then_invalidate,
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_changed_weight_is_requantized(change, quantize_calls):
    gen = torch.Generator().manual_seed(2)
    w = _weight(gen)
    before = mxw.quantized_weight(w)
    CHANGES[change](w)
    after = mxw.quantized_weight(w)
    assert len(quantize_calls) == 2
    want_row, want_col = _uncached(w)
    assert_bytes_equal(after[0].data, want_row.data, "w_row codes after the change")
    assert_bytes_equal(after[1].scale, want_col.scale, "w_col scales after the change")
    assert not torch.equal(before[0].data.view(torch.uint8), after[0].data.view(torch.uint8))
    quantize_calls.clear()
    mxw.quantized_weight(w)
    assert not quantize_calls


def test_data_copy_alone_is_not_seen_and_the_docstring_says_so(quantize_calls):
    """w.data has its own version counter: the documented limit (invalidate() is the remedy)."""
    gen = torch.Generator().manual_seed(3)
    w = _weight(gen)
    mxw.quantized_weight(w)
    w.data.copy_(w.data * 0.5)
    assert mxw.cached_copy(w) is not None
    assert "w.data.copy_" in mxw.__doc__ and "invalidate(w)" in mxw.__doc__
    mxw.invalidate()
    assert mxw.cached_copy(w) is None


def test_dtype_backend_and_cache_false_requantize(quantize_calls):
    gen = torch.Generator().manual_seed(4)
    w = _weight(gen)
    mxw.quantized_weight(w)
    mxw.quantized_weight(w, backend="torch")  # another backend request: quantized by that backend
    assert quantize_calls == [None, "torch"]
    mxw.quantized_weight(w, backend="torch")
    mxw.quantized_weight(w, backend="torch", cache=False)
    assert quantize_calls == [None, "torch", "torch"]
    assert mxw.cached_copy(w, backend="torch") is not None
    w.data = w.data.to(torch.bfloat16)
    mxw.quantized_weight(w, backend="torch")
    assert len(quantize_calls) == 4


def _inputs(gen, wdtype):
    x_bf16 = torch.randn(T, K, generator=gen).bfloat16()
    x_row, x_col = mxag.mxfp8_quantize(x_bf16, axis=(1, 0))
    angles = torch.rand(T, 64, generator=gen, dtype=torch.float64) * 6.0
    r = torch.randn(T, N // 192, 192, generator=gen)
    return x_row, x_col, angles.cos().float(), angles.sin().float(), r


def _mla_q_grad(w, weights_fn, quantize_grad, gen_seed, micro_batches=1):
    gen = torch.Generator().manual_seed(gen_seed)
    w.grad = None
    losses = []
    for _ in range(micro_batches):
        x_row, x_col, cos, sin, r = _inputs(gen, w.dtype)
        w_row, w_col = weights_fn(w)
        q_row, _ = mxag.mla_q_uproj_rope_quant(x_row, w_row, cos, sin, quantize_grad=quantize_grad,
                                               x_t=x_col, w_n=w_col)
        loss = (mxag.mxfp8_dequantize(q_row) * r).sum()
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), w.grad.clone()


@pytest.mark.parametrize("quantize_grad", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_equal_the_uncached_path(quantize_grad, dtype, quantize_calls):
    """Byte-equal: the same codes, the same backward ops, the same casts (bf16 dw -> w's dtype)."""
    w = _weight(torch.Generator().manual_seed(5), dtype)
    want_loss, want_grad = _mla_q_grad(w, _uncached, quantize_grad, 6, micro_batches=3)
    quantize_calls.clear()
    got_loss, got_grad = _mla_q_grad(w, mxw.quantized_weight, quantize_grad, 6, micro_batches=3)
    assert got_grad.dtype == dtype
    assert_bytes_equal(got_loss, want_loss, "losses")
    assert_bytes_equal(got_grad, want_grad, "w.grad (3 accumulated micro-batches)")
    assert len(quantize_calls) == 1  # one quantization for three forwards and backwards


def test_graph_in_flight_keeps_its_copies_after_the_weight_changes():
    gen = torch.Generator().manual_seed(7)
    w = _weight(gen)
    x_row, x_col, cos, sin, r = _inputs(gen, w.dtype)
    want_row, want_col = _uncached(w)

    def loss_of(w_row, w_col):
        q_row, _ = mxag.mla_q_uproj_rope_quant(x_row, w_row, cos, sin, quantize_grad=True, x_t=x_col, w_n=w_col)
        return (mxag.mxfp8_dequantize(q_row) * r).sum()

    loss = loss_of(*mxw.quantized_weight(w))
    with torch.no_grad():
        w.mul_(3.0)
    mxw.quantized_weight(w)  # re-quantizes into fresh tensors
    loss.backward()
    got = w.grad.clone()
    w.grad = None
    loss_of(want_row, want_col).backward()
    assert_bytes_equal(got, w.grad, "w.grad of the graph made before the change")


def test_no_grad_and_frozen_weight_record_no_graph():
    w = _weight(torch.Generator().manual_seed(8))
    with torch.no_grad():
        row, col = mxw.quantized_weight(w)
    assert not row.grad_proxy.requires_grad
    frozen = w.detach().clone()
    row, _ = mxw.quantized_weight(frozen)
    assert not row.grad_proxy.requires_grad
    row, _ = mxw.quantized_weight(w)
    assert row.grad_proxy.requires_grad


def test_torch_compile_fullgraph_matches_eager():
    """In a compiled region the weight is quantized in the graph (cache not traced): same loss and
    gradient bytes as eager with the cache."""
    w = _weight(torch.Generator().manual_seed(10))
    gen = torch.Generator().manual_seed(11)
    x_row, x_col, cos, sin, r = _inputs(gen, w.dtype)

    def fn(w):
        w_row, w_col = mxw.quantized_weight(w)
        q_row, _ = mxag.mla_q_uproj_rope_quant(x_row, w_row, cos, sin, quantize_grad=True, x_t=x_col, w_n=w_col)
        return (mxag.mxfp8_dequantize(q_row) * r).sum()

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        w.grad = None
        loss = f(w)
        loss.backward()
        results.append((loss.detach(), w.grad.clone()))
    assert_bytes_equal(results[1][0], results[0][0], "loss")
    assert_bytes_equal(results[1][1], results[0][1], "w.grad")


def test_cache_holds_weights_weakly():
    w = _weight(torch.Generator().manual_seed(12))
    mxw.quantized_weight(w)
    before = len(mxw._cache)
    del w
    gc.collect()
    assert len(mxw._cache) == before - 1


def test_weight_proxy_op_passes_opcheck():
    w = _weight(torch.Generator().manual_seed(13))
    torch.library.opcheck(mxw._weight_proxy_op, (w, None))
    torch.library.opcheck(mxw._weight_proxy_op, (w, torch.randperm(N, generator=torch.Generator().manual_seed(1))))


@pytest.mark.parametrize("bad, exc, match", [
    ("not a tensor", TypeError, "w: expected a torch.Tensor"),
    (torch.zeros(64), ValueError, "w: expected a 2-D weight"),
    (torch.zeros(64, 64, dtype=torch.int32), TypeError, "w: expected a float32"),
    (torch.zeros(64, 48), ValueError, "w: both dims must be multiples of 32"),
])
def test_bad_weight_names_the_argument(bad, exc, match):
    with pytest.raises(exc, match=match):
        mxw.quantized_weight(bad)


@pytest.mark.parametrize("shape, match", [
    ((64, 64, 64), r"shape: expected a weight's \(N, K\), two ints, got \(64, 64, 64\)"),
    ((64.0, 64), r"shape: expected a weight's \(N, K\), two ints, got \(64.0, 64\)"),
    (64, r"shape: expected a weight's \(N, K\), two ints, got 64"),
    ((64, 48), r"shape: both dims must be multiples of 32"),
])
def test_weight_copies_bad_shape_names_the_argument(shape, match):
    with pytest.raises(ValueError, match=match):
        mxw.WeightCopies(shape)


def test_weight_copies_refresh_under_compile_names_the_argument(monkeypatch):
    copies = mxw.WeightCopies((64, 64))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(TypeError, match="w: WeightCopies.refresh quantizes a plain weight outside torch.compile, "
                                        "got a call inside torch.compile"):
        copies.refresh(torch.zeros(64, 64))


def test_triton_interpreter_reads_the_transposed_col():
    """The Triton MXFP8 backward takes w_col's [K, N] view as its K-major GEMM operand: same dw as
    the torch backend given the same codes (both GEMMs exact-sum then one bf16 rounding)."""
    skip_without_triton_interpreter()
    w = _weight(torch.Generator().manual_seed(14))
    grads = []
    for backend in ("torch", "triton"):
        gen = torch.Generator().manual_seed(15)
        x_row, x_col, cos, sin, r = _inputs(gen, w.dtype)
        w.grad = None
        w_row, w_col = mxw.quantized_weight(w, backend=backend)
        q_row, _ = mxag.mla_q_uproj_rope_quant(x_row, w_row, cos, sin, quantize_grad=True, x_t=x_col, w_n=w_col,
                                               backend=backend)
        (mxag.mxfp8_dequantize(q_row) * r).sum().backward()
        grads.append(w.grad.clone())
    assert_bytes_equal(grads[1], grads[0], "w.grad, triton vs torch")


def test_rows_quantize_the_reordered_weight_and_scatter_the_gradient_back(quantize_calls):
    gen = torch.Generator().manual_seed(16)
    w = _weight(gen)
    rows = torch.randperm(N, generator=gen)
    row, col = mxw.quantized_weight(w, rows=rows)
    want_row, want_col = _uncached(w.detach()[rows])
    assert_bytes_equal(row.data, want_row.data, "w[rows] row codes")
    assert_bytes_equal(col.scale, want_col.scale, "w[rows] col scales")
    mxw.quantized_weight(w, rows=rows)
    assert len(quantize_calls) == 2  # the reference call above plus one cached quantization
    g = torch.randn(N, K, generator=gen).bfloat16()
    (grad,) = torch.autograd.grad(row.grad_proxy, w, g)
    want = torch.empty_like(g)
    want[rows] = g
    assert_bytes_equal(grad, want.float(), "gradient scattered to w's rows")
    mxw.quantized_weight(w)  # another order: quantized again
    assert len(quantize_calls) == 3
    with pytest.raises(ValueError, match="rows: expected a permutation"):
        mxw.quantized_weight(w, rows=torch.zeros(N, dtype=torch.int64))
    with pytest.raises(ValueError, match="rows: expected an int64"):
        mxw.quantized_weight(w, rows=torch.arange(N).float())


@pytest.mark.parametrize("fused", [False, True])
def test_quantize_after_step_makes_the_next_forwards_copy(fused, quantize_calls):
    """The copies are made inside optimizer.step() (one quantization per step), equal the on-demand
    ones byte for byte, and the forward that follows quantizes nothing."""
    gen = torch.Generator().manual_seed(11)
    w, other = _weight(gen), _weight(gen)
    opt = torch.optim.AdamW([w, other], lr=1e-2, fused=fused if fused else None)
    handle = mxw.quantize_after_step(opt, [w])
    mxw.quantized_weight(w)
    for step in range(2):
        quantize_calls.clear()
        w.grad = torch.randn(w.shape, generator=gen)
        opt.step()
        assert len(quantize_calls) == 1  # in the step hook: w only, not the other parameter
        entry = mxw.cached_copy(w)
        assert entry is not None
        row, col = mxw.quantized_weight(w)
        assert len(quantize_calls) == 1  # the forward reuses the step's copy
        want_row, want_col = _uncached(w)
        assert_bytes_equal(row.data, want_row.data, f"w_row codes after step {step}")
        assert_bytes_equal(col.scale, want_col.scale, f"w_col scales after step {step}")
    handle.remove()
    quantize_calls.clear()
    w.grad = torch.randn(w.shape, generator=gen)
    opt.step()
    assert not quantize_calls and mxw.cached_copy(w) is None  # removed: stale until the next forward


def test_quantize_after_step_rows_and_bad_arguments():
    gen = torch.Generator().manual_seed(12)
    w = _weight(gen)
    rows = torch.randperm(N, generator=gen)
    opt = torch.optim.SGD([w], lr=0.1)
    mxw.quantize_after_step(opt, [(w, rows)])
    w.grad = torch.randn(w.shape, generator=gen)
    opt.step()
    assert mxw.cached_copy(w, rows=rows) is not None and mxw.cached_copy(w) is None
    with pytest.raises(TypeError, match="optimizer"):
        mxw.quantize_after_step(object(), [w])
    with pytest.raises(ValueError, match="at least one"):
        mxw.quantize_after_step(opt, [])
    with pytest.raises(ValueError, match="w: expected a 2-D"):
        mxw.quantize_after_step(opt, [torch.zeros(N)])
    with pytest.raises(ValueError, match="rows"):
        mxw.quantize_after_step(opt, [(w, rows[:-1])])
    with pytest.raises(Exception, match="backend"):
        mxw.quantize_after_step(opt, [w], backend="no_such_backend")
    entry = mxw.requantize(w)
    assert mxw.cached_copy(w) is entry


def test_plain_copies_are_the_cache_entries_quantized_weight_returns(quantize_calls):
    """The same cache and staleness rules, without a proxy; weight_grad is the proxy's gradient rule."""
    gen = torch.Generator().manual_seed(40)
    w = _weight(gen, torch.bfloat16)
    rows = torch.randperm(N, generator=gen)
    entry = mxw.plain_copies(w, rows=rows)
    assert type(entry.row) is MXTensor and type(entry.col) is MXTensor
    row, col = mxw.quantized_weight(w, rows=rows)
    assert row.data is entry.row.data and col.scale is entry.col.scale and len(quantize_calls) == 1
    assert mxw.plain_copies(w, rows=rows) is entry and mxw.cached_copy(w, rows=rows) is entry
    g = (torch.randn(N, K, generator=gen) * 3.0).bfloat16()
    row.grad_proxy.backward(g)
    assert_bytes_equal(mxw.weight_grad(g, w.dtype, rows), w.grad, "weight_grad is the proxy's rule")
    assert mxw.weight_grad(g, torch.float32).dtype == torch.float32
    with torch.no_grad():
        w.add_(1.0)
    fresh = mxw.plain_copies(w, rows=rows)
    assert fresh is not entry and len(quantize_calls) == 2
    assert_bytes_equal(fresh.row.data, _uncached(w.detach()[rows])[0].data, "re-quantized after the write")
    with pytest.raises(ValueError, match="w: expected a 2-D weight"):
        mxw.plain_copies(torch.ones(N))
