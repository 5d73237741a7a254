"""Plans for models built on the mxmla ops: tensor-parallel styles, the DeepSeek-V3 TP plan for models
patched by `dispatch.integrations.transformers.patch_deepseek_v3`, and the context-parallel
attention core.

Tensor parallelism (torch.distributed.tensor.parallel.parallelize_module): inside a TP attention every
activation is a DTensor, and an op mixing DTensors with plain tensors is an error. So besides torch's
ColwiseParallel / RowwiseParallel for the head-sharded projections, a plan needs the attention's
inputs as Replicate DTensors (`ReplicateInputs`: every tensor of args and kwargs, also inside tuples
such as Hugging Face's position_embeddings = (cos, sin)) and its unsharded weights as Replicate
DTensors (`ReplicateParameters`). Such a weight feeds a head-sharded computation, so its gradient
arrives Partial (each rank's heads' share); the style all-reduces it on arrival (a gradient hook), so
the optimizer sees the full gradient, equal on every rank.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.utils._pytree import tree_map_only

from dispatch.nn import attention_operand
from spec.attention import SEQ_AXIS

from .ring import context_parallel_attention

__all__ = ["ReplicateInputs", "ReplicateParameters", "deepseek_v3_tp_plan", "ContextParallelAttention"]


class ReplicateInputs(ParallelStyle):
    """Plan entry: every plain tensor the module is called with (positional or keyword, also nested in
    tuples and lists) becomes a Replicate DTensor on the mesh (DTensor.from_local: no communication;
    the gradient back to a plain input is all-reduced there by DTensor)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def to_dtensor(t: Tensor):
            if isinstance(t, DTensor):
                return t
            return DTensor.from_local(t, device_mesh, [Replicate()], run_check=False)

        def hook(_module, args, kwargs):
            return (tree_map_only(Tensor, to_dtensor, args), tree_map_only(Tensor, to_dtensor, kwargs))

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _all_reduce_partial(grad: Tensor) -> Tensor:
    if isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements):
        return grad.redistribute(placements=[Replicate()] * grad.device_mesh.ndim)
    return grad


class ReplicateParameters(ParallelStyle):
    """Plan entry: the module's own parameters become Replicate DTensors; a gradient arriving Partial
    is all-reduced before it accumulates (module docstring)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            replicated = nn.Parameter(distribute_tensor(param.data, device_mesh, [Replicate()]),
                                      requires_grad=param.requires_grad)
            if replicated.requires_grad:
                replicated.register_hook(_all_reduce_partial)
            module.register_parameter(name, replicated)
        return module


def deepseek_v3_tp_plan(attention: str = "model.layers.*.self_attn", q_lora: bool = True) -> Dict[str, ParallelStyle]:
    """The tensor-parallel plan (heads over the mesh) of the DeepseekV3Attention modules at `attention`
    (an FQN pattern) of a model patched by `patch_deepseek_v3`, for `parallelize_module`:
    inputs replicated; q_b_proj and kv_b_proj colwise (ColwiseParallel: weights Shard(0) over
    H * 192 and H * 256 rows; q_b_proj's forward is never called, the fused op reads its weight);
    o_proj rowwise (RowwiseParallel: the forward's one all-reduce); the latent down-projections and
    RMSNorms replicated. The mlp / MoE and everything outside attention are left alone.
    q_lora=False (config.q_lora_rank None): q_proj colwise in place of q_a_proj / q_a_layernorm / q_b_proj."""
    a = attention
    plan: Dict[str, ParallelStyle] = {a: ReplicateInputs()}
    if q_lora:
        plan.update({f"{a}.q_a_proj": ReplicateParameters(), f"{a}.q_a_layernorm": ReplicateParameters(),
                     f"{a}.q_b_proj": ColwiseParallel()})
    else:
        plan[f"{a}.q_proj"] = ColwiseParallel()
    plan.update({f"{a}.kv_a_proj_with_mqa": ReplicateParameters(), f"{a}.kv_a_layernorm": ReplicateParameters(),
                 f"{a}.kv_b_proj": ColwiseParallel(use_local_output=False), f"{a}.o_proj": RowwiseParallel()})
    return plan


class ContextParallelAttention(nn.Module):
    """The attention core of `dispatch.nn.MLAAttention`, over a sequence-sharded process group:
    `forward(q, k, v, cu_seqlens_q=None, cu_seqlens_kv=None, causal=None, softmax_scale=None) -> (o, lse)`
    (causal and softmax_scale override the module's settings for the call) on this rank's
    load-balanced shard (`shard_sequence`), through `context_parallel_attention`. Path "mxfp8"
    quantizes plain operands (q, k along D, v along the sequence; straight-through gradient), "bf16"
    casts them to bfloat16; MXTensors pass through. Packed sequences (cu_seqlens) are not sharded by
    this layout: they raise."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, *, causal: bool = True,
                 softmax_scale: Optional[float] = None, layout: str = "bshd", path: str = "mxfp8",
                 backend: Optional[str] = None):
        super().__init__()
        if path not in ("mxfp8", "bf16"):
            raise ValueError(f"path: expected one of ('mxfp8', 'bf16'), got {path!r}")
        if layout not in ("bshd", "sbhd"):
            raise ValueError(f"layout: expected 'bshd' or 'sbhd' (a sequence axis to shard), got {layout!r}")
        self.group, self.causal, self.layout, self.path, self.backend = group, bool(causal), layout, path, backend
        self.softmax_scale = None if softmax_scale is None else float(softmax_scale)

    def _operand(self, name: str, t: Any, axis: int) -> Any:
        return attention_operand(name, t, axis, self.path, self.backend)

    def forward(self, q, k, v, cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_kv: Optional[Tensor] = None,
                causal: Optional[bool] = None, softmax_scale: Optional[float] = None) -> Tuple[Tensor, Tensor]:
        if cu_seqlens_q is not None or cu_seqlens_kv is not None:
            raise ValueError("cu_seqlens_q: packed sequences are not context-parallel here (one sequence axis "
                             "sharded by shard_sequence)")
        q, k = self._operand("q", q, -1), self._operand("k", k, -1)
        v = self._operand("v", v, SEQ_AXIS[self.layout])
        causal = self.causal if causal is None else bool(causal)
        scale = self.softmax_scale if softmax_scale is None else float(softmax_scale)
        return context_parallel_attention(q, k, v, group=self.group, causal=causal, layout=self.layout,
                                          softmax_scale=scale, backend=self.backend)

    @classmethod
    def like(cls, core: nn.Module, group: Optional[dist.ProcessGroup] = None) -> "ContextParallelAttention":
        """The context-parallel twin of an MLAAttention core (its scale, layout, path, backend)."""
        return cls(group, causal=core.causal, softmax_scale=core.softmax_scale, layout=core.layout,
                   path=core.path, backend=core.backend)

    def extra_repr(self) -> str:
        return (f"causal={self.causal}, softmax_scale={self.softmax_scale}, layout={self.layout!r}, "
                f"path={self.path!r}, backend={self.backend!r}")
