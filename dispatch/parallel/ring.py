"""Context-parallel MLA attention: a ring over the process group.

Each of the W ranks holds its sequence shard of q, k, v (for causal attention the load-balanced shard
of `dispatch.parallel.shard_sequence`: chunks r and 2W-1-r of 2W, c tokens each). In W steps every
rank sees every rank's k/v: at step i it holds the k/v of rank (r - i) mod W, and while it attends to
them, the next shard is already on its way (one `batch_isend_irecv` to rank r+1 and from r-1 started
before the step's attention, waited for after it).

Causal masking, per pair of chunks (query chunk a, key chunk b of the global sequence): b < a sees
every key, b == a is the causal diagonal block, b > a is skipped. With the load-balanced layout each
step is one attention call:
- own k/v (step 0): the local causal mask over [chunk r, chunk 2W-1-r] is exactly the global one;
- k/v of a rank s < r: both query chunks see chunk s whole and neither sees chunk 2W-1-s:
  all 2c queries against the first c keys, unmasked;
- k/v of a rank s > r: chunk r sees neither of s's chunks, chunk 2W-1-r sees both whole:
  the last c queries against all 2c keys, unmasked.
Not causal: every step is all queries against all keys, and any contiguous sharding works.

Merging: each step gives (o_i bf16, lse_i fp32) over its query rows; partial results combine in
fp32 as lse = logaddexp(lse, lse_i), o = o * exp(lse_old - lse) + o_i * exp(lse_i - lse); o is
rounded to bf16 once at the end.

Backward (the ring-attention identity): softmax rows of the whole sequence are P = exp(S - lse) with
the *global* lse, and D = rowsum(o * do) with the global o, so `mla_attention_backward` on one block
pair given the global o and lse rows of its queries returns that block's exact share of dq, dk, dv.
The k/v ring runs again, and a dk/dv accumulator (fp32) travels with each rank's k/v: a rank adds its
share and passes it on, and after W steps it is back home holding the full dk, dv.

MXFP8 q, k, v travel as codes plus scale bytes. v is blocked along the sequence axis, so a causal
ring slices it at the chunk boundary: with MXFP8 v, the shard length must be twice a multiple of 32
(each chunk whole 32-token blocks), and sliced MXFP8 operands must have compact scales.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

import dispatch as _dispatch
from backends.convert import device_of
from spec.attention import SEQ_AXIS, validate_mla_attention
from spec.checks import shape_checks_only
from spec.constants import BLOCK_SIZE
from spec.mxtensor import MXTensor

from .operands import from_slots, from_wire, global_rank, group_size_rank, narrow, to_slots, wire_tensors

__all__ = ["context_parallel_attention", "block_plan"]

_LAYOUTS = ("bshd", "sbhd")


# --------------------------------------------------------------------------------------------------
# the per-step block and the ring transfers
# --------------------------------------------------------------------------------------------------

def block_plan(rank: int, source: int, causal: bool, length: int) -> Tuple[int, int, int, int, bool]:
    """(q_start, q_stop, kv_start, kv_stop, causal) of the one attention call rank makes on the k/v
    shard of rank `source`, both of local length `length` (module docstring)."""
    if not causal:
        return 0, length, 0, length, False
    chunk = length // 2
    if source == rank:
        return 0, length, 0, length, True
    if source < rank:
        return 0, length, 0, chunk, False
    return chunk, length, 0, length, False


class _Transfer:
    """One ring step's exchange: `tensors` to the next rank, as many of the same shapes from the
    previous one; started on construction, `wait()` returns what arrived."""

    def __init__(self, tensors: List[Tensor], group, send_to: int, recv_from: int):
        self.received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, send_to, group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, recv_from, group) for t in self.received]
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self) -> List[Tensor]:
        for r in self.requests:
            r.wait()
        return self.received


class _Ring:
    def __init__(self, group):
        self.group = group
        self.world, self.rank = group_size_rank(group)
        self.send_to = global_rank(group, (self.rank + 1) % self.world)
        self.recv_from = global_rank(group, (self.rank - 1) % self.world)

    def source(self, step: int) -> int:
        return (self.rank - step) % self.world

    def start(self, tensors: List[Tensor]) -> _Transfer:
        return _Transfer(tensors, self.group, self.send_to, self.recv_from)


def _kv_wire(k: Any, v: Any) -> Tuple[List[Tensor], int]:
    k_wire = wire_tensors(k)
    return k_wire + wire_tensors(v), len(k_wire)


def _kv_from_wire(k_like: Any, v_like: Any, tensors: List[Tensor], split: int) -> Tuple[Any, Any]:
    return from_wire(k_like, tensors[:split]), from_wire(v_like, tensors[split:])


# --------------------------------------------------------------------------------------------------
# lse merge (fp32)
# --------------------------------------------------------------------------------------------------

def _lse_as_o(lse: Tensor, layout: str) -> Tensor:
    """lse [B, H, S] as a weight broadcastable against o ([B, S, H, D] or [S, B, H, D])."""
    perm = (0, 2, 1) if layout == "bshd" else (2, 0, 1)
    return lse.permute(perm).unsqueeze(-1)


def _merge_into(o_acc: Tensor, lse_acc: Tensor, o_blk: Tensor, lse_blk: Tensor, layout: str) -> None:
    """o_acc, lse_acc (fp32 views of the block's query rows) <- their merge with (o_blk, lse_blk)."""
    lse_new = torch.logaddexp(lse_acc, lse_blk)
    empty = lse_new == float("-inf")  # no key so far on either side: keep zeros, not NaN
    w_acc = torch.where(empty, 0.0, torch.exp(lse_acc - lse_new))
    w_blk = torch.where(empty, 0.0, torch.exp(lse_blk - lse_new))
    o_acc.mul_(_lse_as_o(w_acc, layout)).add_(o_blk.float() * _lse_as_o(w_blk, layout))
    lse_acc.copy_(lse_new)


# --------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------

def _validate(q, k, v, causal, layout, softmax_scale, group, world) -> None:
    if world > 1 and dist.get_backend(group) == "gloo" and device_of(q, k, v).type != "cpu":
        # gloo's send / recv hand the tensor's address to its socket transport, which reads and writes it
        # from the host: a CUDA address fails there (the rank's transport dies, its peers see the
        # connection closed), so name the group instead.
        raise ValueError(f"group: a gloo group moves host memory only; q, k, v are on "
                         f"{device_of(q, k, v)}: use an NCCL group for CUDA tensors (or CPU tensors with gloo)")
    if layout not in _LAYOUTS:
        raise ValueError(f"layout: context_parallel_attention takes one of {_LAYOUTS} (a sequence axis to "
                         f"shard), got {layout!r}")
    with shape_checks_only():
        validate_mla_attention(q, k, v, causal, softmax_scale, layout)
    seq = SEQ_AXIS[layout]
    q_len, kv_len = int(q.shape[seq]), int(k.shape[seq])
    if causal and q_len != kv_len:
        raise ValueError(f"q, k: causal context parallelism needs equal local q and k/v lengths (the shard of "
                         f"one sequence), got {q_len} and {kv_len}")
    if causal and world > 1:
        if q_len % 2:
            raise ValueError(f"q: a causal load-balanced shard is two equal chunks; got odd local length {q_len}")
        chunk = q_len // 2
        if isinstance(v, MXTensor) and chunk % BLOCK_SIZE:
            raise ValueError(f"v: MXFP8 v is blocked along the sequence, so each of the shard's two chunks must be "
                             f"whole {BLOCK_SIZE}-token blocks: the local length must be a multiple of "
                             f"{2 * BLOCK_SIZE}, got {q_len}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if isinstance(t, MXTensor) and t.scale_layout != "compact":
                raise ValueError(f"{name}: a causal ring slices the shard at its chunk boundary, which needs "
                                 f"compact scales, got {t.scale_layout!r}")


# --------------------------------------------------------------------------------------------------
# forward and backward
# --------------------------------------------------------------------------------------------------

def _forward(q, k, v, causal, softmax_scale, layout, ring: _Ring, backend):
    seq = SEQ_AXIS[layout]
    length = int(q.shape[seq])
    o_acc = lse_acc = None
    wire, split = _kv_wire(k, v)
    for step in range(ring.world):
        transfer = ring.start(wire) if step + 1 < ring.world else None
        k_cur, v_cur = _kv_from_wire(k, v, wire, split)
        q0, q1, kv0, kv1, blk_causal = block_plan(ring.rank, ring.source(step), causal, length)
        o_blk, lse_blk = _dispatch.run(
            "mla_attention", narrow("q", q, seq, q0, q1), narrow("k", k_cur, seq, kv0, kv1),
            narrow("v", v_cur, seq, kv0, kv1), causal=blk_causal, softmax_scale=softmax_scale, layout=layout,
            backend=backend)
        if o_acc is None:  # step 0 covers every query row (block_plan)
            o_acc, lse_acc = o_blk.float(), lse_blk.clone()
        else:
            _merge_into(o_acc.narrow(seq, q0, q1 - q0), lse_acc.narrow(2, q0, q1 - q0), o_blk, lse_blk, layout)
        if transfer is not None:
            wire = transfer.wait()
    return o_acc.to(torch.bfloat16), lse_acc


def _backward(do, q, k, v, o, lse, causal, softmax_scale, layout, ring: _Ring, backend):
    seq = SEQ_AXIS[layout]
    length = int(q.shape[seq])
    dq = torch.zeros(q.shape, dtype=torch.float32, device=do.device)
    kv_wire, split = _kv_wire(k, v)
    dkv_transfer = None
    for step in range(ring.world):
        kv_transfer = ring.start(kv_wire) if step + 1 < ring.world else None
        k_cur, v_cur = _kv_from_wire(k, v, kv_wire, split)
        q0, q1, kv0, kv1, blk_causal = block_plan(ring.rank, ring.source(step), causal, length)
        dq_blk, dk_blk, dv_blk = _dispatch.run(
            "mla_attention_backward", narrow("do", do, seq, q0, q1), narrow("q", q, seq, q0, q1),
            narrow("k", k_cur, seq, kv0, kv1), narrow("v", v_cur, seq, kv0, kv1), narrow("o", o, seq, q0, q1),
            lse.narrow(2, q0, q1 - q0).contiguous(), causal=blk_causal, softmax_scale=softmax_scale,
            layout=layout, backend=backend)
        dq.narrow(seq, q0, q1 - q0).add_(dq_blk.float())
        if dkv_transfer is None:  # own k/v: the accumulators start here
            dk = torch.zeros(k.shape, dtype=torch.float32, device=do.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=do.device)
        else:  # the accumulators of this k/v, holding the shares of the ranks it has visited
            dk, dv = dkv_transfer.wait()
        dk.narrow(seq, kv0, kv1 - kv0).add_(dk_blk.float())
        dv.narrow(seq, kv0, kv1 - kv0).add_(dv_blk.float())
        if ring.world > 1:
            dkv_transfer = ring.start([dk, dv])
        if kv_transfer is not None:
            kv_wire = kv_transfer.wait()
    if dkv_transfer is not None:  # after W steps, this rank's own k/v accumulators come home
        dk, dv = dkv_transfer.wait()
    return dq, dk, dv


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, options, q_value, q_codes, q_scales, k_value, k_codes, k_scales, v_value, v_codes, v_scales):
        formats, causal, softmax_scale, layout, group, backend = options
        q = from_slots(q_value, q_codes, q_scales, formats[0])
        k = from_slots(k_value, k_codes, k_scales, formats[1])
        v = from_slots(v_value, v_codes, v_scales, formats[2])
        ring = _Ring(group)
        o, lse = _forward(q, k, v, causal, softmax_scale, layout, ring, backend)
        ctx.mark_non_differentiable(lse)
        # an MXFP8 operand's backward reads its codes, never its proxy
        saved = [q_value if formats[0] is None else None, q_codes, q_scales,
                 k_value if formats[1] is None else None, k_codes, k_scales,
                 v_value if formats[2] is None else None, v_codes, v_scales, o, lse]
        ctx.save_for_backward(*saved)
        ctx.options = options
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (q_value, k_value, v_value))
        return o, lse

    @staticmethod
    def backward(ctx, do, _lse_grad):
        grads: List[Optional[Tensor]] = [None] * 10
        if do is None:
            return tuple(grads)
        qv, qc, qs, kv, kc, ks, vv, vc, vs, o, lse = ctx.saved_tensors
        formats, causal, softmax_scale, layout, group, backend = ctx.options
        q, k, v = (from_slots(*s, f) for s, f in zip(((qv, qc, qs), (kv, kc, ks), (vv, vc, vs)), formats))
        dq, dk, dv = _backward(do.to(torch.bfloat16).contiguous(), q, k, v, o, lse, causal, softmax_scale, layout,
                               _Ring(group), backend)
        for slot, grad, dtype in zip((1, 4, 7), (dq, dk, dv), ctx.dtypes):
            if dtype is not None:
                grads[slot] = grad.to(dtype)
        return tuple(grads)


def context_parallel_attention(q: Any, k: Any, v: Any, group: Optional[dist.ProcessGroup] = None,
                               causal: bool = True, layout: str = "bshd", softmax_scale: Optional[float] = None,
                               backend: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """MLA attention of this rank's sequence shard against the whole sequence, over `group`'s ring.

    q [B, L, H, 192], k [B, L, H, 192], v [B, L, H, 128] (layout "bshd"; "sbhd" has S first): tensors
    or MXTensors (q, k blocked along D, v along the sequence; TrackedMXTensors receive gradients
    through their proxies). Every rank of `group` (None: the default group) calls this with shards of
    equal shape. causal=True expects the load-balanced shards of `shard_sequence` (chunks r and
    2W-1-r); causal=False takes any sharding of the keys. Returns (o bf16 [B, L, H, 128], lse fp32
    [B, H, L]) for the local queries, as `mla_attention` on the whole sequence would give them
    (within its bf16 bound; o is merged in fp32 and rounded once). o is differentiable, lse is not.
    `backend` is passed to every `dispatch.run` of the forward and the backward.
    """
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {causal!r}")
    world, _ = group_size_rank(group)
    _validate(q, k, v, causal, layout, softmax_scale, group, world)
    slots = [to_slots(t) for t in (q, k, v)]
    formats = tuple(s[3] for s in slots)
    scale = None if softmax_scale is None else float(softmax_scale)
    options = (formats, causal, scale, layout, group, backend)
    flat = [t for s in slots for t in s[:3]]
    return _ContextParallelAttention.apply(options, *flat)
