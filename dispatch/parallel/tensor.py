"""Tensor parallelism over heads: DTensor sharding rules for the mxmla custom ops.

With these rules registered (on import, through `torch.distributed.tensor.experimental.register_sharding`),
the `dispatch.autograd` wrappers take DTensors: each custom op runs once per rank on the local shards,
and DTensor wraps the outputs with the placements below. Attention heads are independent, so a
TorchTitan-style plan (q_b_proj / kv_b_proj colwise over heads, their inputs replicated, o_proj
rowwise) runs the fused Q op, RoPE, the quantizers and attention on each rank's heads with no
communication; in the backward, the fused op's rule marks dx as Partial (each rank's heads' share of
x's gradient) and DTensor all-reduces it where x is replicated. docs/PARALLEL.md has the plan.

What DTensor sees: every MXFP8 operand crosses a custom op as separate tensors (the gradient proxy,
the uint8 codes, the scale bytes; dispatch/autograd.py's slots) plus a format string. Codes, compact
scales and proxy all keep the operand's axes (the scales' blocked axis divided by 32), so one
placement fits all three: Shard(head axis) shards each along its head axis. Swizzled scales mix every
axis into a padded 2-D matrix, so an operand with swizzled scales only has the all-Replicate rule.

Rules, per op (besides all-Replicate, always accepted):
- mla_q_uproj_rope_quant: x (and x_t) Replicate, w (and w_n) Shard(0) over its N = H*192 rows,
  cos/sin Replicate -> every output Shard(1) (heads of [T, H, 192], of q_row's [T, H, 6] scales and
  q_col's [T/32, H, 192] scales). H must divide by the mesh size (N by 192 * mesh size).
- mla_q_uproj_rope_quant_backward: dq Shard(1), x Replicate, w Shard(0) -> dx Partial(sum), dw Shard(0).
- rope, rope_backward: x Shard(head axis = ndim-2), tables and index tensors Replicate -> Shard(head).
- mla_kv_mxfp8: k_nope and v Shard(head axis), k_pe Replicate when one head is shared by all (else
  Shard(head) too), cos/sin Replicate -> every output (k's and v's proxy, codes, scales) Shard(head).
- mla_kv_mxfp8_pe_backward (k_pe's gradient): dk Shard(head), tables Replicate -> dk_pe Partial(sum) for a
  shared k_pe (each rank sums its heads' share), else Shard(head).
- mxfp8_dequantize: Shard(d) for any d but the blocked axis -> Shard(d).
- mla_attention, mla_attention_backward: q, k, v, o, do Shard(head axis), lse Shard(its H axis) ->
  outputs alike; or all of them Shard(batch axis) (bshd, sbhd).
- rmsnorm_mxfp8: all-Replicate only (its column copy is blocked along T); rmsnorm_backward likewise
  (what the forward's rule hands its autograd rule).
- mxfp8_quantize: x Shard(d) -> proxy, codes and compact scales Shard(d), for d not blocked, or
  blocked and splitting into whole 32-element blocks per rank (a colwise weight's N = H * 192 rows,
  quantized along N for the backward).

mxfp8_quantize is the one op register_sharding cannot take: its op returns a list of 1 + 2 *
len(axes) tensors, and register_sharding derives the number of outputs from the schema's returns
(one Tensor[] slot), so DTensor rejects its rule ("output_specs has 1 output which does not equal the
number of op outputs"). Its strategy goes to DTensor's sharding propagator directly
(`register_op_strategy`, which register_sharding itself calls; private API, as is
`expand_to_full_mesh_op_strategy` that expands it over the mesh). Without it the dispatch.autograd
wrappers, and every model built on them, could not take DTensors at all.

Cache note: DTensor caches a rule's result per op, keyed on the tensor arguments' specs and, as
register_sharding derives the key, on non-tensor arguments only from the first int argument on; a
string argument (a format, a layout) would not be in the key, and a call differing only there would
reuse a stale rule. `_register` therefore widens the key to every argument (the propagator's
RuntimeSchemaInfo.static_argnum = 0; a private field, checked when this module is imported).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Union

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
from torch.distributed.tensor.experimental import register_sharding

import dispatch.autograd as mxag
from spec.constants import BLOCK_SIZE
from spec.mla_kv import mla_kv_axes


__all__ = ["mxfp8_quantize", "RULES"]

_OPS = torch.ops.mxmla
R = Replicate()


def _register(op):
    """register_sharding(op), then every argument of op in DTensor's rule cache key (module docstring)."""
    def wrap(fn):
        register_sharding(op)(fn)
        infos = getattr(DTensor._op_dispatcher.sharding_propagator, "op_to_schema_info", None)
        if infos is None or op not in infos or not hasattr(infos[op], "static_argnum"):
            raise RuntimeError(f"{op}: this torch's DTensor keeps no RuntimeSchemaInfo per op, so the rule cache "
                               f"key cannot include string arguments; dispatch.parallel.tensor needs it")
        infos[op].static_argnum = 0
        return fn
    return wrap


def _rank(spec) -> int:
    return len(spec.tensor_meta.shape)


def _present(args: Sequence[Any], placement) -> List[Any]:
    """placement for each tensor argument (a DTensorSpec), None for the rest."""
    return [placement if _is_tensor(a) else None for a in args]


def _is_tensor(a) -> bool:
    return hasattr(a, "placements") and hasattr(a, "tensor_meta")


def _replicated(n_out: int, args: Sequence[Any]):
    return ([R] * n_out, _present(args, R))


# --------------------------------------------------------------------------------------------------
# fused Q path
# --------------------------------------------------------------------------------------------------

@_register(_OPS.mla_q_uproj_rope_quant.default)
def _mla_q_rule(x, x_codes, x_scales, x_format, w, w_codes, w_scales, w_format, cos, sin, x_t_codes, x_t_scales,
                x_t_format, w_n_codes, w_n_scales, w_n_format, quantize_grad, backend):
    args = (x, x_codes, x_scales, x_format, w, w_codes, w_scales, w_format, cos, sin, x_t_codes, x_t_scales,
            x_t_format, w_n_codes, w_n_scales, w_n_format, quantize_grad, backend)
    rules = [_replicated(5, args)]
    if "swizzled" in (w_format, w_n_format):  # padded 2-D tiles: rows of the matrix are not rows of w
        return rules
    w_slots = {4, 5, 6, 13, 14}  # w (value, codes, scales) and its N-blocked copy w_n (codes, scales)
    placements = [(Shard(0) if i in w_slots else R) if _is_tensor(a) else None for i, a in enumerate(args)]
    rules.append(([Shard(1)] * 5, placements))
    return rules


@_register(_OPS.mla_q_uproj_rope_quant_backward.default)
def _mla_q_backward_rule(dq, x, x_codes, x_scales, x_format, w, w_codes, w_scales, w_format, cos, sin,
                         quantize_grad, backend):
    args = (dq, x, x_codes, x_scales, x_format, w, w_codes, w_scales, w_format, cos, sin, quantize_grad, backend)
    if w_format.startswith("e") and "swizzled" in w_format:
        return [_replicated(2, args)]
    heads = [Shard(1)] + [(Shard(0) if 5 <= i <= 7 else R) if _is_tensor(a) else None
                          for i, a in enumerate(args[1:], start=1)]
    return [_replicated(2, args), ([Partial(), Shard(0)], heads)]


# --------------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------------

def _rope_rules(x, args):
    head = _rank(x) - 2
    placements = [Shard(head)] + _present(args[1:], R)
    return [_replicated(1, args), ([Shard(head)], placements)]


@_register(_OPS.rope.default)
def _rope_rule(x, cos, sin, style, layout, cu_seqlens, positions, start_positions, cp_size, cp_rank, out_dtype,
               backend):
    return _rope_rules(x, (x, cos, sin, style, layout, cu_seqlens, positions, start_positions, cp_size, cp_rank,
                           out_dtype, backend))


@_register(_OPS.rope_backward.default)
def _rope_backward_rule(grad, cos, sin, style, layout, cu_seqlens, positions, start_positions, cp_size, cp_rank,
                        out_dtype, backend):
    return _rope_rules(grad, (grad, cos, sin, style, layout, cu_seqlens, positions, start_positions, cp_size,
                              cp_rank, out_dtype, backend))


# --------------------------------------------------------------------------------------------------
# MLA's key and value (mla_kv_mxfp8): what the composition's rules give (rope of k_pe, its expand over
# the heads, the concatenation and the two quantizes)
# --------------------------------------------------------------------------------------------------

@_register(_OPS.mla_kv_mxfp8.default)
def _kv_rule(k_nope, k_pe, v, cos, sin, layout, backend):
    args = (k_nope, k_pe, v, cos, sin, layout, backend)
    head = mla_kv_axes(layout)[1]
    shared = tuple(k_pe.tensor_meta.shape)[head] != tuple(k_nope.tensor_meta.shape)[head]
    # k_nope and v per head; k_pe as it is shared (Replicate) or per head; the tables Replicate. k's codes
    # and scales ([..., H, 192] blocked along D) and v's ([..., H, 128] blocked along the sequence) keep
    # the head axis, as the proxies do
    placements = [Shard(head), R if shared else Shard(head), Shard(head)] + _present(args[3:], R)
    return [_replicated(6, args), ([Shard(head)] * 6, placements)]


@_register(_OPS.mla_kv_mxfp8_pe_backward.default)
def _kv_backward_rule(dk, cos, sin, layout, pe_shared, pe_dtype, backend):
    args = (dk, cos, sin, layout, pe_shared, pe_dtype, backend)
    head = mla_kv_axes(layout)[1]
    # a shared k_pe's gradient sums over the heads: each rank's sum over its heads is a Partial share
    out = Partial() if pe_shared else Shard(head)
    return [_replicated(1, args), ([out], [Shard(head)] + _present(args[1:], R))]


# --------------------------------------------------------------------------------------------------
# MXFP8 dequantize
# --------------------------------------------------------------------------------------------------

def _blocked_axis(codes, scales) -> Optional[int]:
    """The axis compact scales divide by 32 (None for swizzled, 2-D padded, scales)."""
    data, scale = tuple(codes.tensor_meta.shape), tuple(scales.tensor_meta.shape)
    if len(scale) != len(data):
        return None
    diff = [i for i, (d, s) in enumerate(zip(data, scale)) if d != s]
    return diff[0] if len(diff) == 1 else None


@_register(_OPS.mxfp8_dequantize.default)
def _dequantize_rule(value, codes, scales, fmt, out_dtype, backend):
    args = (value, codes, scales, fmt, out_dtype, backend)
    rules = [_replicated(1, args)]
    blocked = _blocked_axis(codes, scales)
    if blocked is not None:
        for d in range(_rank(codes)):
            if d != blocked:
                rules.append(([Shard(d)], _present(args, Shard(d))))
    return rules


@_register(_OPS.rmsnorm_mxfp8.default)
def _rmsnorm_rule(x, gamma, eps, zero_centered_gamma, elem, backend):
    return [_replicated(6, (x, gamma, eps, zero_centered_gamma, elem, backend))]


@_register(_OPS.rmsnorm_backward.default)
def _rmsnorm_backward_rule(dy, x, gamma, rstd, zero_centered_gamma, backend):
    return [_replicated(2, (dy, x, gamma, rstd, zero_centered_gamma, backend))]


# --------------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------------

def _attention_operands_swizzled(scales: Sequence[Any]) -> bool:
    return any(_is_tensor(s) and _rank(s) == 2 for s in scales)


def _attention_rules(n_out: int, args: Sequence[Any], lse_index: Optional[int], q_like, scales):
    """Head (and batch) sharding for the attention ops; q_like: any 4-D or 3-D operand spec."""
    rules = [_replicated(n_out, args)]
    if _attention_operands_swizzled(scales):
        return rules
    ndim = _rank(q_like)
    cu = {len(args) - 3, len(args) - 2}  # cu_seqlens_q, cu_seqlens_kv: index tensors, replicated
    splits = [(ndim - 2, 1 if ndim == 4 else 0)]  # (operand head axis, lse head axis)
    if ndim == 4:
        layout_batch = 0 if args[len(args) - 4] == "bshd" else 1  # bshd [B,S,..], sbhd [S,B,..]
        splits.append((layout_batch, 0))
    for axis, lse_axis in splits:
        placements = []
        for i, a in enumerate(args):
            if not _is_tensor(a):
                placements.append(None)
            elif i in cu:
                placements.append(R)
            else:
                placements.append(Shard(lse_axis) if i == lse_index else Shard(axis))
        outs = [Shard(axis)] * n_out if lse_index is not None else [Shard(axis), Shard(lse_axis)]
        rules.append((outs, placements))
    return rules


@_register(_OPS.mla_attention.default)
def _attention_rule(q, q_codes, q_scales, q_format, k, k_codes, k_scales, k_format, v, v_codes, v_scales,
                    v_format, causal, softmax_scale, layout, cu_seqlens_q, cu_seqlens_kv, backend):
    args = (q, q_codes, q_scales, q_format, k, k_codes, k_scales, k_format, v, v_codes, v_scales, v_format,
            causal, softmax_scale, layout, cu_seqlens_q, cu_seqlens_kv, backend)
    q_like = q if _is_tensor(q) else q_codes
    return _attention_rules(2, args, None, q_like, (q_scales, k_scales, v_scales))


@_register(_OPS.mla_attention_backward.default)
def _attention_backward_rule(do, q, q_codes, q_scales, q_format, k, k_codes, k_scales, k_format, v, v_codes,
                             v_scales, v_format, o, lse, causal, softmax_scale, layout, cu_seqlens_q,
                             cu_seqlens_kv, backend):
    args = (do, q, q_codes, q_scales, q_format, k, k_codes, k_scales, k_format, v, v_codes, v_scales, v_format,
            o, lse, causal, softmax_scale, layout, cu_seqlens_q, cu_seqlens_kv, backend)
    return _attention_rules(3, args, 14, do, (q_scales, k_scales, v_scales))


RULES = ("mla_q_uproj_rope_quant", "mla_q_uproj_rope_quant_backward", "rope", "rope_backward",
         "mla_kv_mxfp8", "mla_kv_mxfp8_pe_backward", "mxfp8_dequantize", "rmsnorm_mxfp8", "rmsnorm_backward",
         "mla_attention",
         "mla_attention_backward")


# --------------------------------------------------------------------------------------------------
# mxfp8_quantize: a strategy through DTensor's propagator (its list output has no register_sharding rule)
# --------------------------------------------------------------------------------------------------

def _quantize_strategy(*args):
    """All-Replicate, or Shard(d) in and Shard(d) on every output (proxy, codes, compact scales) for an
    axis d that is not blocked, or is blocked and splits into whole 32-element blocks on every rank.
    The propagator calls strategy functions with (op_schema); older torch releases with (mesh, op_schema)."""
    op_schema = args[-1]
    mesh = args[0] if len(args) == 2 else op_schema.get_mesh_from_args()
    x = op_schema.args_schema[0].strategies[0].output_spec
    axes, scale_layout = op_schema.args_schema[1], op_schema.args_schema[5]
    shape = tuple(x.tensor_meta.shape)
    blocked = {int(a) % len(shape) for a in axes}
    n_out = 1 + 2 * len(blocked)
    rules = [[R] * (n_out + 1)]
    if scale_layout == "compact":
        ranks = mesh.size()  # whole blocks even if every mesh dimension shards this axis
        for d in range(len(shape)):
            if d not in blocked or shape[d] % (ranks * BLOCK_SIZE) == 0:
                rules.append([Shard(d)] * (n_out + 1))
    return expand_to_full_mesh_op_strategy(mesh, op_schema, rules, input_index=n_out)


def _register_quantize_strategy() -> None:
    op = _OPS.mxfp8_quantize.default
    propagator = DTensor._op_dispatcher.sharding_propagator
    # static_argnum 1: axes, elem, ..., scale_layout are all in the rule cache key
    propagator.register_op_strategy(op, _quantize_strategy, RuntimeSchemaInfo(static_argnum=1, needs_pytree=True))


_register_quantize_strategy()


def mxfp8_quantize(x, axis: Union[int, Sequence[int]] = -1, elem: str = "e4m3", scale_mode: str = "rceil",
                   nonfinite: str = "saturate", scale_layout: str = "compact", backend: Optional[str] = None):
    """`dispatch.autograd.mxfp8_quantize`, with a check for DTensors first: a blocked axis sharded into
    pieces that are not whole 32-element blocks raises (DTensor would otherwise gather x whole to
    quantize it, a silent all-gather). Plain tensors and every other placement go straight through."""
    if isinstance(x, DTensor):
        axes = [int(a) % x.ndim for a in (axis if isinstance(axis, (tuple, list)) else [axis])]
        for mesh_dim, p in enumerate(x.placements):
            if isinstance(p, Shard) and p.dim % x.ndim in axes:
                n, parts = x.shape[p.dim % x.ndim], x.device_mesh.size()
                if n % (parts * BLOCK_SIZE):
                    raise ValueError(f"x: sharded {parts} ways along blocked axis {p.dim % x.ndim} of length {n}; "
                                     f"each shard must be whole {BLOCK_SIZE}-element blocks (length a multiple of "
                                     f"{parts * BLOCK_SIZE}); placements {x.placements}")
    return mxag.mxfp8_quantize(x, axis, elem, scale_mode, nonfinite, scale_layout, backend)
