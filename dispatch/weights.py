"""The MXFP8 copies of a projection weight, quantized once per weight update and reused.

    from dispatch.weights import quantized_weight
    w_row, w_col = quantized_weight(w_uq)          # w_uq [N, K] Parameter (fp32 or bf16 master)
    q_row, q_col = mxag.mla_q_uproj_rope_quant(y_row, w_row, cos, sin, quantize_grad=True, x_t=y_col, w_n=w_col)

`quantized_weight(w)` returns what `dispatch.autograd.mxfp8_quantize(w.to(torch.bfloat16), axis=(1, 0))`
returns -- the same codes and scales (e4m3, rceil, saturate, compact), TrackedMXTensors sharing one
bf16 gradient proxy whose gradient reaches w cast to w's dtype (straight through) -- but the
quantization runs only when the weight has changed since the last call. With gradient accumulation
(several forwards per optimizer step) or activation recomputation the weight is quantized once per
step instead of once per forward.

Layout: w_row [N, K] blocked along K (axis 1), codes and scales contiguous. w_col [N, K] blocked along
N (axis 0) is stored physically transposed: its codes are a contiguous [K, N] tensor and its scales a
contiguous [K, N/32] tensor, and w_col holds their `.t()` views. The MXFP8 backward's dx GEMM reads w
blocked along N with N as its contraction axis, i.e. the [K, N] view, which is then K-major without a
copy. The values are those of the untransposed copy, byte for byte.

Modules that own their weight keep persistent copies instead (`WeightCopies`: buffers refreshed in
place once per optimizer step, read by compiled graphs as inputs; see its docstring).

When a cached copy is stale (any of these differs from when it was made):
- `w._version` (autograd's version counter: every in-place op on w or a view of it, including
  torch.optim's for-each and single-tensor optimizers and `load_state_dict`);
- `w.data_ptr()`, dtype, shape, strides, device (`.to()`, `.data = ...`, resharding);
- the backend requested;
- the optimizer generation: a global `torch.optim` step pre-hook, registered when this module is
  imported, marks every cached copy stale at any optimizer step (before the step, so that a copy made
  by a step post-hook, `quantize_after_step` or `WeightCopies.refresh_after`, counts as made after
  it). Fused optimizers (`AdamW(fused=True)`) write parameters without bumping `_version`, so the version alone misses them.
Writes through `w.data` bypass the version counter (`w.data` is a new tensor with its own counter;
`w.detach()` shares w's), so `w.data.copy_(...)` outside a torch.optim step -- e.g. an optimizer that
is not a `torch.optim.Optimizer` copying main params into model params that way -- cannot be seen
without reading the whole weight; call `invalidate(w)` (or `invalidate()` for all) after such writes.

`quantize_after_step(optimizer, [w])` re-quantizes w right after every step of that optimizer (a
step post-hook), so the next forward finds fresh copies: the quantization's host time then falls after
the backward, while the GPU still runs it, instead of in the forward (`requantize(w)` does it once, now).

`plain_copies(w)` returns the same cached copies as plain MXTensors (no proxy) and `weight_grad` the
gradient rule of the proxy (scatter back through `rows`, cast to w's dtype), for a graph node that
takes w itself as an input (dispatch.q_path: the query path with RMSNorm as one node).

The cache allocates fresh tensors on every re-quantization (never writes in place), so a copy saved by
an autograd graph still in flight stays valid after the weight changes (`WeightCopies` writes its
buffers in place instead: see its docstring).

torch.compile: inside a compiled region the cache (Python state keyed by `_version`) is not traced;
`quantized_weight` quantizes the weight in the graph on every call through `mxag.mxfp8_quantize` (same
values; w_col then has the untransposed layout). A module that owns a `WeightCopies` hands the graph
its buffers instead (dispatch.nn.MLAQProjection, examples/mla_block.py, the HF patch of
dispatch.integrations.transformers). A DTensor weight (tensor parallelism) is quantized the same way on
every call, through the custom op's DTensor rule (dispatch.parallel.tensor). Under `torch.no_grad()` the cache works as in training and the
returned tensors carry a proxy that records no graph.
"""
from __future__ import annotations

import itertools
import operator
import sys
import threading
import weakref
from typing import Iterable, Optional, Tuple, Union

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakTensorKeyDictionary

import dispatch as _dispatch
from dispatch.policy import parse_backend_list
from dispatch.autograd import NAMESPACE, TrackedMXTensor, grad_proxy, mxfp8_quantize, shared_grad_proxy
from dispatch.transpose import transpose_bytes_into
from spec.mxtensor import MXTensor

__all__ = ["MXFP8Weight", "WeightCopies", "quantized_weight", "plain_copies", "weight_grad", "requantize", "quantize_after_step",
           "invalidate", "cached_copy", "optimizer_generation", "adopt"]

_QUANT = dict(axis=(1, 0), elem="e4m3", scale_mode="rceil", nonfinite="saturate", scale_layout="compact")

_lock = threading.Lock()
_cache: "WeakTensorKeyDictionary" = WeakTensorKeyDictionary()
_generation = [0]  # bumped by every torch.optim step


def optimizer_generation() -> int:
    """How many torch.optim steps have run since import (the staleness clock of the post-hook)."""
    return _generation[0]


# optimizer -> {handle key: ([(w, rows), ...], backend)}: quantize_after_step's registrations
_after_step: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    # before the step: torch runs an optimizer's own post-hooks before the global ones, so a bump there
    # would mark stale what WeightCopies.refresh_after's hook had just made
    _generation[0] += 1


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    for weights, backend in list(_after_step.get(optimizer, {}).values()):
        for w, rows in weights:
            requantize(w, backend=backend, rows=rows)


register_optimizer_step_pre_hook(_before_optimizer_step)
register_optimizer_step_post_hook(_after_optimizer_step)


def _key(w: Tensor, backend: Optional[str], rows: Optional[Tensor] = None) -> tuple:
    row_key = None if rows is None else (rows.data_ptr(), rows._version, rows.device)
    return (w._version, w.data_ptr(), w.dtype, tuple(w.shape), tuple(w.stride()), w.device, backend, row_key,
            _generation[0])


def _quantize_transposed(w: Tensor, backend: Optional[str], rows: Optional[Tensor],
                         codes_t: Optional[Tensor] = None, scales_t: Optional[Tensor] = None):
    """(key, row, codes_t, scales_t) of w (w[rows]) cast to bf16, with one `dispatch.run` call: the
    rowwise MXTensor as the op returned it, and the copy blocked along N transposed into codes_t
    [K, N] and scales_t [K, N/32] (made here unless given; any 1-byte dtype)."""
    if rows is not None:
        _check_rows(rows, w.shape[0])  # here, not per call: it reads the rows (a device sync)
    key = _key(w, backend, rows)
    with torch.no_grad():
        src = w.detach() if rows is None else w.detach().index_select(0, rows)
        row, col = _dispatch.run("mxfp8_quantize", src.to(torch.bfloat16), backend=backend, **_QUANT)
    n, k = col.data.shape
    if codes_t is None:
        codes_t = torch.empty(k, n, dtype=col.data.dtype, device=col.data.device)
    if scales_t is None:
        scales_t = torch.empty(k, n // 32, dtype=col.scale.dtype, device=col.scale.device)
    transpose_bytes_into(col.data, codes_t, backend=backend)
    transpose_bytes_into(col.scale, scales_t, backend=backend)
    return key, row, codes_t, scales_t


class MXFP8Weight:
    """The cached MXFP8 copies of one weight [N, K]: `row` (MXTensor blocked along K) and `col`
    (blocked along N, physically transposed), plain (untracked) MXTensors, and the `key` they were made
    under. `quantized_weight` returns tracked views of these; this object is what `cached_copy` shows."""

    __slots__ = ("key", "row", "col", "__weakref__")

    def __init__(self, key: tuple, row: MXTensor, col: MXTensor):
        self.key, self.row, self.col = key, row, col

    @classmethod
    def quantize(cls, w: Tensor, backend: Optional[str] = None, rows: Optional[Tensor] = None) -> "MXFP8Weight":
        """Quantize w (w[rows] when rows are given; cast to bf16 first) rowwise and columnwise with one
        `dispatch.run` call."""
        key, row, codes_t, scales_t = _quantize_transposed(w, backend, rows)
        row = MXTensor(row.data.contiguous(), row.scale.contiguous(), 1, "e4m3", "compact")
        col = MXTensor(codes_t.t(), scales_t.t(), 0, "e4m3", "compact")
        return cls(key, row, col)

    def tracked(self, proxy: Tensor) -> Tuple[TrackedMXTensor, TrackedMXTensor]:
        return (TrackedMXTensor(self.row.data, self.row.scale, 1, "e4m3", "compact", proxy),
                TrackedMXTensor(self.col.data, self.col.scale, 0, "e4m3", "compact", proxy))


# The gradient proxy of a cached copy: a bf16 zero-stride tensor of w's shape (as mxfp8_quantize's
# proxy of w.to(bf16) is) whose gradient goes to w cast to w's dtype -- the cast-then-quantize
# straight-through of the uncached path, without making the bf16 copy of w every forward.
# With rows, the proxy stands for w[rows] and the gradient is scattered back to w's rows.
@torch.library.custom_op(f"{NAMESPACE}::weight_grad_proxy", mutates_args=())
def _weight_proxy_op(w: Tensor, rows: Optional[Tensor]) -> Tensor:
    return grad_proxy(w.shape, torch.bfloat16, w.device)


@_weight_proxy_op.register_fake
def _(w, rows):
    return grad_proxy(w.shape, torch.bfloat16, w.device)


def _proxy_setup(ctx, inputs, output):
    w, rows = inputs
    ctx.w_dtype = w.dtype
    ctx.save_for_backward(rows)


def weight_grad(grad: Tensor, dtype: torch.dtype, rows: Optional[Tensor] = None) -> Tensor:
    """The gradient w receives for `grad`, the gradient with respect to its copies' dequantized values
    (w[rows] when rows are given): scattered back to w's rows, cast to w's dtype (`dtype`). It is the
    rule of quantized_weight's proxy, for a graph node that reads `plain_copies` itself."""
    if rows is not None:
        grad = torch.empty_like(grad).index_copy_(0, rows, grad)
    return grad.to(dtype)


def _proxy_backward(ctx, grad):
    if grad is None:
        return None, None
    (rows,) = ctx.saved_tensors
    return weight_grad(grad, ctx.w_dtype, rows), None


_weight_proxy_op.register_autograd(_proxy_backward, setup_context=_proxy_setup)


class _EagerWeightProxy(torch.autograd.Function):
    """The same proxy and gradient as _weight_proxy_op for eager calls, without the custom op's
    dispatch (host time on every forward; the custom op is for torch.compile and DTensor)."""

    @staticmethod
    def forward(ctx, w, rows):
        _proxy_setup(ctx, (w, rows), None)
        # the kept zero, expanded: a fresh one would cost an allocation and a fill launch per forward
        return shared_grad_proxy(w.shape, torch.bfloat16, w.device)

    @staticmethod
    def backward(ctx, grad):
        return _proxy_backward(ctx, grad)


def _check_weight(w) -> None:
    if not isinstance(w, Tensor):
        raise TypeError(f"w: expected a torch.Tensor weight [N, K], got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"w: expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
    if not w.is_floating_point() or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"w: expected a float32, bfloat16 or float16 weight, got {w.dtype}")
    if w.shape[0] % 32 or w.shape[1] % 32:
        raise ValueError(f"w: both dims must be multiples of 32 (MXFP8 blocks along N and K), got {tuple(w.shape)}")


def _is_dtensor(w) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before it is imported
    return dtensor is not None and isinstance(w, dtensor.DTensor)


def _replicated_like(t: Tensor, w) -> Tensor:
    """t as a DTensor replicated over w's mesh."""
    dtensor = sys.modules["torch.distributed.tensor"]
    return dtensor.DTensor.from_local(t, w.device_mesh, [dtensor.Replicate()] * w.device_mesh.ndim, run_check=False)


def _check_rows(rows, n: int) -> None:
    if not isinstance(rows, Tensor) or rows.dtype not in (torch.int32, torch.int64) or tuple(rows.shape) != (n,):
        what = f"{rows.dtype} {tuple(rows.shape)}" if isinstance(rows, Tensor) else type(rows).__name__
        raise ValueError(f"rows: expected an int64 or int32 permutation of range({n}) of shape ({n},), got {what}")
    if not torch.equal(torch.sort(rows.to(torch.int64)).values, torch.arange(n, device=rows.device)):
        raise ValueError(f"rows: expected a permutation of range({n}) (each row of w exactly once)")


def _cached(w: Tensor, backend: Optional[str], rows: Optional[Tensor]) -> MXFP8Weight:
    """The cache entry of (w, backend, rows), made now when there is none or it is stale."""
    key = _key(w, backend, rows)
    with _lock:
        entry = _cache.get(w)
    if entry is None or entry.key != key:
        entry = MXFP8Weight.quantize(w, backend, rows)
        with _lock:
            _cache[w] = entry
    return entry


def quantized_weight(w: Tensor, *, backend: Optional[str] = None, cache: bool = True,
                     rows: Optional[Tensor] = None) -> Tuple[TrackedMXTensor, TrackedMXTensor]:
    """(w_row, w_col) of weight w [N, K]: MXFP8 e4m3 rceil of w.to(bfloat16), blocked along K (axis 1)
    and along N (axis 0, physically transposed storage), sharing one bf16 gradient proxy connected to
    w. Quantized only when w changed since the last call (module docstring); `cache=False` quantizes
    now and leaves the cache alone. `backend` as for every mxmla op.

    rows: an optional permutation of range(N) on w's device (int64 / int32): the copies are then those
    of w[rows] (e.g. dispatch.nn's neox-to-mla reordering of the RoPE features) and the gradient goes
    back to w's own rows. The cache keys on the rows tensor's identity, so keep one tensor per order."""
    _check_weight(w)
    if torch.compiler.is_compiling() or _is_dtensor(w):
        # a DTensor (tensor parallelism) is quantized per call through the custom op, whose DTensor
        # rule (dispatch.parallel.tensor) keeps w's placement; the cache keys on local storage. A row
        # order is applied to the whole weight (DTensor gathers a sharded w for it: correct, not parallel)
        if rows is not None and _is_dtensor(w) and not _is_dtensor(rows):
            rows = _replicated_like(rows, w)
        src = w if rows is None else w.index_select(0, rows)
        return mxfp8_quantize(src.to(torch.bfloat16), backend=backend, **_QUANT)
    entry = _cached(w, backend, rows) if cache else MXFP8Weight.quantize(w, backend, rows)
    # the custom op for tensor subclasses (FakeTensor, ...), as dispatch.autograd's eager rule does
    plain = type(w) in (Tensor, torch.nn.Parameter)
    return entry.tracked(_EagerWeightProxy.apply(w, rows) if plain else _weight_proxy_op(w, rows))


def plain_copies(w: Tensor, *, backend: Optional[str] = None, rows: Optional[Tensor] = None) -> MXFP8Weight:
    """The cached copies `quantized_weight(w, backend=backend, rows=rows)` returns tracked views of,
    made now if w changed since they were (the same cache and staleness rules), as plain MXTensors
    without a gradient proxy: for a graph node that reads the copies itself and gives w its gradient
    through `weight_grad`, which saves the proxy's own autograd node per forward. A plain, non-DTensor
    weight outside torch.compile only: the others are quantized per call by quantized_weight."""
    _check_weight(w)
    if _is_dtensor(w) or torch.compiler.is_compiling():
        raise TypeError("w: plain_copies reads the cache of plain tensors; a DTensor or traced weight is "
                        "quantized per call by quantized_weight")
    return _cached(w, backend, rows)


def requantize(w: Tensor, *, backend: Optional[str] = None, rows: Optional[Tensor] = None) -> MXFP8Weight:
    """Quantize w now into the cache (the entry a following `quantized_weight(w, backend=backend,
    rows=rows)` reuses until w changes), and return the entry. For a training loop's optimizer step:
    the quantization's host time then falls where the GPU is still busy with the backward, not in the
    next forward (see quantize_after_step). A plain, non-DTensor weight only: the others are quantized
    per call by quantized_weight."""
    _check_weight(w)
    if _is_dtensor(w) or torch.compiler.is_compiling():
        raise TypeError("w: requantize caches plain tensors; a DTensor or traced weight is quantized per call")
    entry = MXFP8Weight.quantize(w, backend, rows)
    with _lock:
        _cache[w] = entry
    return entry


class WeightCopies(torch.nn.Module):
    """Persistent MXFP8 copies of one weight [N, K], owned by the module that uses the weight, refreshed
    in place: the copies a compiled graph reads (as module buffers, so their addresses hold across
    steps and CUDA graphs replay on fresh values), and an eager forward reuses.

        copies = WeightCopies((N, K), device=w.device)      # a submodule of the layer owning w
        copies.refresh(w)                                   # quantize now, into the buffers
        copies.refresh_after(optimizer, w)                  # ... and after every optimizer.step()
        entry = copies.current(w)                           # MXFP8Weight over the buffers (eager: checked)

    Buffers (non-persistent: not in the state dict): `row_codes` [N, K] and `row_scales` [N, K/32] (w
    blocked along K), `col_codes_t` [K, N] and `col_scales_t` [K, N/32] (w blocked along N, stored
    transposed as `quantized_weight`'s columnwise copy), codes as uint8. The bytes are those of
    `quantized_weight(w, rows=rows)`: one `mxfp8_quantize` call per refresh, its rowwise copy copied
    into the buffers and its columnwise copy transposed straight into them
    (`dispatch.transpose.transpose_bytes_into`).

    When the copies are refreshed:
    - `refresh(w)`: now. The owning module calls it at construction and after `load_state_dict`.
    - after every step of an optimizer passed to `refresh_after` (a step post-hook: the copies of
      the weight the step wrote, before the next forward), i.e. once per optimizer step however
      many forwards it has (gradient accumulation, recomputation);
    - eager forward (`current`): also whenever the weight changed since the last refresh, by the
      same rules as `quantized_weight`'s cache (version counter, storage, dtype / shape / device, the
      backend, the rows, any torch.optim step, `invalidate()`): a weight edited outside a step (a
      manual in-place edit, `load_state_dict` into a parent) is refreshed before it is used. The
      optimizer-step clock is part of the rule, so an FSDP2-style all-gathered weight, whose storage
      and version counter repeat every step, is still refreshed once per step.
    - under torch.compile (`traced`): never inside the graph; the graph reads the buffers as they
      are. They are fresh when every weight update goes through an optimizer registered with
      `refresh_after` or through the owning module's `load_state_dict`; after any other write to the
      weight call `refresh(w)` before the next compiled forward. Copies never made raise at trace time.
    A refresh writes the buffers in place: a backward still to run over a forward that saved them
    raises autograd's in-place error in eager mode (the optimizer steps after the backward, so a
    training loop never meets it); a compiled graph's saved copies are not checked, so refresh only
    between a backward and the next forward there, as the post-step hook does.
    """

    def __init__(self, shape, *, backend: Optional[str] = None, device=None):
        super().__init__()
        try:
            n, k = (operator.index(d) for d in shape)
        except (TypeError, ValueError):
            raise ValueError(f"shape: expected a weight's (N, K), two ints, got {shape!r}") from None
        if n % 32 or k % 32:
            raise ValueError(f"shape: both dims must be multiples of 32 (MXFP8 blocks along N and K), got {tuple(shape)}")
        if backend is not None:
            parse_backend_list(backend, "backend")
        u8 = dict(dtype=torch.uint8, device=device)
        self.register_buffer("row_codes", torch.empty(n, k, **u8), persistent=False)
        self.register_buffer("row_scales", torch.empty(n, k // 32, **u8), persistent=False)
        self.register_buffer("col_codes_t", torch.empty(k, n, **u8), persistent=False)
        self.register_buffer("col_scales_t", torch.empty(k, n // 32, **u8), persistent=False)
        self.backend = backend
        self.made = False      # refreshed at least once (buffers hold copies, not garbage)
        self.refreshes = 0     # how many refreshes ran (tests count them)
        self._key = None       # the staleness key of the last refresh

    def refresh(self, w: Tensor, rows: Optional[Tensor] = None) -> None:
        """Quantize w (w[rows]) now into the buffers, in place."""
        _check_weight(w)
        if _is_dtensor(w) or torch.compiler.is_compiling():
            got = "a DTensor" if _is_dtensor(w) else "a call inside torch.compile"
            raise TypeError(f"w: WeightCopies.refresh quantizes a plain weight outside torch.compile, got {got}")
        if tuple(w.shape) != tuple(self.row_codes.shape):
            raise ValueError(f"w: expected shape {tuple(self.row_codes.shape)} (the copies'), got {tuple(w.shape)}")
        if w.device != self.row_codes.device:
            raise ValueError(f"w: expected device {self.row_codes.device} (the copies'), got {w.device}")
        key, row, _, _ = _quantize_transposed(w, self.backend, rows, self.col_codes_t, self.col_scales_t)
        with torch.no_grad():
            self.row_codes.copy_(row.data.view(torch.uint8))
            self.row_scales.copy_(row.scale)
        self._key, self.made = key, True
        self.refreshes += 1

    def refresh_if_ready(self, w: Tensor, rows: Optional[Tensor] = None) -> bool:
        """Refresh from w when it can be quantized here: a plain tensor (not a DTensor), materialized
        (not on the meta device) and on the copies' device; else leave the copies as they are. Returns
        whether it refreshed. For an owner's construction, `.to()` and `load_state_dict` hooks."""
        if (w.device.type == "meta" or type(w) not in (Tensor, torch.nn.Parameter)
                or w.device != self.row_codes.device or tuple(w.shape) != tuple(self.row_codes.shape)):
            return False
        self.refresh(w, rows)
        return True

    def refresh_after(self, optimizer: torch.optim.Optimizer, w: Tensor, rows: Optional[Tensor] = None):
        """Refresh from w after every `optimizer.step()` (a step post-hook); returns its handle."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        _check_weight(w)
        ref = weakref.ref(self)

        def hook(_optimizer, _args, _kwargs):
            copies = ref()
            if copies is not None:
                copies.refresh(w, rows)

        return optimizer.register_step_post_hook(hook)

    def invalidate(self) -> None:
        """Mark the copies stale: the next eager `current` refreshes them (writes outside any rule)."""
        self._key = None

    def _entry(self, key) -> MXFP8Weight:
        row = MXTensor(self.row_codes.view(torch.float8_e4m3fn), self.row_scales, 1, "e4m3", "compact")
        col = MXTensor(self.col_codes_t.view(torch.float8_e4m3fn).t(), self.col_scales_t.t(), 0, "e4m3", "compact")
        return MXFP8Weight(key, row, col)

    def current(self, w: Tensor, rows: Optional[Tensor] = None) -> MXFP8Weight:
        """The copies of w (w[rows]) over the buffers, refreshed first when w changed (eager rules)."""
        if self._key is None or self._key != _key(w, self.backend, rows):
            self.refresh(w, rows)
        return self._entry(self._key)

    def traced(self) -> MXFP8Weight:
        """The copies over the buffers as they are, for a graph torch.compile traces (no check there)."""
        if not self.made:
            raise RuntimeError("WeightCopies: the copies were never made; call refresh(w) before compiling")
        return self._entry(None)  # the key is not read: a guard on it would recompile after every refresh

    def tracked(self, w: Tensor, rows: Optional[Tensor] = None) -> Tuple[TrackedMXTensor, TrackedMXTensor]:
        """(w_row, w_col) as `quantized_weight` returns them, over these copies."""
        _check_weight(w)
        entry = self.traced() if torch.compiler.is_compiling() else self.current(w, rows)
        plain = not torch.compiler.is_compiling() and type(w) in (Tensor, torch.nn.Parameter)
        return entry.tracked(_EagerWeightProxy.apply(w, rows) if plain else _weight_proxy_op(w, rows))

    def extra_repr(self) -> str:
        n, k = self.row_codes.shape
        return f"shape=({n}, {k}), backend={self.backend!r}, made={self.made}"


_handles = itertools.count()


class AfterStepHandle:
    """What quantize_after_step returns: `remove()` stops the re-quantization."""

    def __init__(self, optimizer, key: int):
        self._optimizer, self._key = weakref.ref(optimizer), key

    def remove(self) -> None:
        optimizer = self._optimizer()
        if optimizer is not None:
            _after_step.get(optimizer, {}).pop(self._key, None)


def quantize_after_step(optimizer: torch.optim.Optimizer, weights: Iterable[Union[Tensor, Tuple[Tensor, Tensor]]],
                        *, backend: Optional[str] = None) -> AfterStepHandle:
    """Re-quantize `weights` (each a weight [N, K], or a (weight, rows) pair as quantized_weight takes)
    right after every `optimizer.step()`, so the next forward's quantized_weight finds fresh copies
    instead of quantizing in the forward. The copies are the same bytes as those made on demand; the
    weights stay referenced while the optimizer lives. Returns a handle (`remove()`)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    items = []
    for i, item in enumerate(weights):
        w, rows = item if isinstance(item, tuple) else (item, None)
        _check_weight(w)
        if _is_dtensor(w):
            raise TypeError(f"weights[{i}]: a DTensor is quantized per call (its placement), not after the step")
        if rows is not None:
            _check_rows(rows, w.shape[0])
        items.append((w, rows))
    if not items:
        raise ValueError("weights: expected at least one weight")
    if backend is not None:
        parse_backend_list(backend, "backend")  # a bad name raises here, not inside a later step
    key = next(_handles)
    _after_step.setdefault(optimizer, {})[key] = (items, backend)
    return AfterStepHandle(optimizer, key)


def invalidate(w: Optional[Tensor] = None) -> None:
    """Drop the cached copies of w (all weights' when w is None): for writes that bypass the version
    counter outside a torch.optim step, e.g. `w.data.copy_(...)`."""
    with _lock:
        if w is None:
            _cache.clear()
        else:
            _cache.pop(w, None)


def cached_copy(w: Tensor, backend: Optional[str] = None, rows: Optional[Tensor] = None) -> Optional[MXFP8Weight]:
    """The cache entry `quantized_weight(w, backend=backend, rows=rows)` would reuse now (None: it would
    quantize)."""
    with _lock:
        entry = _cache.get(w)
    return entry if entry is not None and entry.key == _key(w, backend, rows) else None


def adopt(w: Tensor, entry: MXFP8Weight, *, backend: Optional[str] = None, rows: Optional[Tensor] = None) -> None:
    """Make `entry` (copies made earlier from the values w holds now) w's cache entry under w's current
    key, so the next `quantized_weight` / `plain_copies` of w with this backend and rows reuse it. For a
    caller that knows more than the key: an FSDP2-gathered weight lands in new storage at every
    all-gather while its values change only at optimizer steps and loads (the TorchTitan integration
    keys it on the sharded parameter's version and the step clock). The caller vouches for the values."""
    _check_weight(w)
    if not isinstance(entry, MXFP8Weight) or tuple(entry.row.shape) != tuple(w.shape):
        raise ValueError(f"entry: expected an MXFP8Weight of w's shape {tuple(w.shape)}, got "
                         f"{tuple(entry.row.shape) if isinstance(entry, MXFP8Weight) else type(entry).__name__}")
    with _lock:
        _cache[w] = MXFP8Weight(_key(w, backend, rows), entry.row, entry.col)
