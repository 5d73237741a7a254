"""mxmla under torch.distributed: context parallelism (a ring over a process group) and tensor
parallelism over heads (DTensor sharding rules for the mxmla custom ops). docs/PARALLEL.md.

    from dispatch.parallel import context_parallel_attention, shard_sequence, shard_positions
    q_l, k_l, v_l = (shard_sequence(t, dim=1) for t in (q, k, v))     # chunks r and 2W-1-r
    o_l, lse_l = context_parallel_attention(q_l, k_l, v_l, causal=True)

Tensor parallelism needs no call: importing this package registers the DTensor rules
(dispatch.parallel.tensor), so the dispatch.autograd wrappers take head-sharded DTensors.
"""
from . import tensor  # registers the DTensor sharding rules of the mxmla custom ops
from .plans import ContextParallelAttention, ReplicateInputs, ReplicateParameters, deepseek_v3_tp_plan
from .ring import block_plan, context_parallel_attention
from .sequence import chunk_indices, shard_positions, shard_sequence, unshard_sequence

__all__ = [
    "context_parallel_attention",
    "block_plan",
    "shard_sequence",
    "unshard_sequence",
    "shard_positions",
    "chunk_indices",
    "tensor",
    "ContextParallelAttention",
    "ReplicateInputs",
    "ReplicateParameters",
    "deepseek_v3_tp_plan",
]
