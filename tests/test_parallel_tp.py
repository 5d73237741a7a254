"""Tensor parallelism over heads with DTensor on CPU with gloo (2 ranks) against one process.

The model is the DeepSeek-V3 MLA block after its latent projections, at tiny size: the fused
q_b_proj + RoPE + MXFP8 quantize op, kv_b_proj, RoPE of the shared k_pe, MXFP8 quantize of k and v,
causal attention, o_proj. The TorchTitan-style plan: the attention module's inputs replicated
(PrepareModuleInput), q_b_proj and kv_b_proj colwise over heads (ColwiseParallel), o_proj rowwise.

Checks, per rank:
- forward: q (codes and scales) and the attention output o of this rank's heads are bytes-equal to
  the same heads of the one-process run (heads are independent, and every op computes a head the
  same way whatever the head count); CommDebugMode counts no collective in the attention module's
  forward (only o_proj's row-parallel all-reduce follows).
- backward: DTensor all-reduces the replicated inputs' gradients (CommDebugMode sees all_reduce);
  the gradients of x_q, c_kv, k_pe and of this rank's weight shards are within relative Frobenius
  1e-2 of one process's, and q_b_proj's gradient shard is bytes-equal (the fused backward's dW is
  exact and per head; kv_b_proj's and o_proj's came out bytes-equal too, not asserted: torch's bf16
  matmul gives no such promise). Where they differ it is rounding order: an input gradient is the sum of the
  ranks' bf16 partial gradients (one bf16 rounding, 2^-9 relative, per rank's share) where one
  process rounds the whole sum once; 1e-2 is the attention bound family (tests/conformance/
  test_attention.py) and leaves a 5x margin over two such roundings. o_proj's output differs only
  by its all-reduce's summation order: same bound.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402
from torch.distributed.tensor.parallel import (  # noqa: E402
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

import dispatch.autograd as mxag  # noqa: E402
import dispatch.parallel  # noqa: E402,F401  (registers the DTensor rules)
from dispatch.parallel import ReplicateParameters
from dispatch.parallel.tensor import RULES, mxfp8_quantize  # noqa: E402
from tests.parallel_spawn import checked, result_of, run_ranks  # noqa: E402
from tests.util import assert_bytes_equal  # noqa: E402

B, S, H = 2, 64, 4
Q_LORA, KV_LORA, HIDDEN = 64, 32, 64
GRAD_BOUND = 1e-2


class Weight(nn.Module):
    """An RMSNorm's weight (a module of its own, as in Hugging Face's DeepseekV3 attention)."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


class LatentAttention(nn.Module):
    """q, k, v from the latents and causal attention over them; o [B, S, H, 128]."""

    def __init__(self, mxfp8: bool):
        super().__init__()
        self.q_b_proj = nn.Linear(Q_LORA, H * 192, bias=False)
        self.kv_b_proj = nn.Linear(KV_LORA, H * 256, bias=False)
        self.q_norm = Weight(Q_LORA)
        self.mxfp8 = mxfp8

    def forward(self, x_q, c_kv, k_pe, cos, sin, cos_tok, sin_tok):
        w = self.q_b_proj.weight
        if self.mxfp8:  # MXFP8 x and w, with the copies blocked along T and N for the MXFP8 backward
            x_row, x_col, _ = mxag.rmsnorm_mxfp8(x_q, self.q_norm.weight)
            w_row, w_col = mxag.mxfp8_quantize(w, axis=(1, 0))  # colwise: N sharded in whole blocks
            q_row, _ = mxag.mla_q_uproj_rope_quant(x_row, w_row, cos_tok, sin_tok, quantize_grad=True, x_t=x_col,
                                                   w_n=w_col)
        else:
            q_row, _ = mxag.mla_q_uproj_rope_quant(x_q, w, cos_tok, sin_tok)
        heads = q_row.shape[1]  # global heads (a DTensor's shape is global)
        q = mxag.reshape_mx(q_row, (B, S, heads, 192))
        k_nope, v = self.kv_b_proj(c_kv).view(B, S, heads, 256).split([128, 128], dim=-1)
        k_rot = mxag.rope(k_pe, cos, sin, layout="bshd")  # [B, S, 1, 64], shared by every head
        k = torch.cat([k_nope, k_rot.expand(B, S, heads, 64)], dim=-1)
        if self.mxfp8:
            k, v = mxag.mxfp8_quantize(k, axis=-1), mxag.mxfp8_quantize(v, axis=1)
        o, _ = mxag.mla_attention(q, k, v, causal=True)
        return o, q_row


class Block(nn.Module):
    def __init__(self, mxfp8: bool):
        super().__init__()
        self.attn = LatentAttention(mxfp8)
        self.o_proj = nn.Linear(H * 128, HIDDEN, bias=False)

    def forward(self, *inputs):
        o, _ = self.attn(*inputs)
        return self.o_proj(o.reshape(B, S, -1))


def tp_plan(mesh, n_inputs: int):
    """The attention module's inputs replicated DTensors, q_b_proj / kv_b_proj colwise, o_proj rowwise."""
    return {
        "attn": PrepareModuleInput(input_layouts=(Replicate(),) * n_inputs,
                                   desired_input_layouts=(Replicate(),) * n_inputs, use_local_output=False),
        "attn.q_b_proj": ColwiseParallel(),
        "attn.kv_b_proj": ColwiseParallel(use_local_output=False),
        "attn.q_norm": ReplicateParameters(),
        "o_proj": RowwiseParallel(),
    }


def _inputs(seed):
    rng = np.random.default_rng(seed)
    t = lambda *shape, scale=1.0: (torch.from_numpy(rng.standard_normal(shape)) * scale).bfloat16()  # noqa: E731
    # rows at magnitudes 2^-3 .. 2^3 (far larger spreads make dW = g^T x ill-conditioned: a rounding-level
    # change in g at a huge row swamps it), and a zero row (RMSNorm's eps path, a zero query)
    x_q = t(B * S, Q_LORA) * (2.0 ** torch.from_numpy(rng.integers(-3, 4, size=(B * S, 1)))).bfloat16()
    x_q[3] = 0.0
    c_kv, k_pe = t(B * S, KV_LORA), t(B, S, 1, 64)
    angles = torch.arange(S, dtype=torch.float64)[:, None] * 0.7 ** torch.arange(32, dtype=torch.float64)
    angles = torch.cat([angles, angles], dim=1)
    cos, sin = torch.cos(angles).float(), torch.sin(angles).float()
    cos_tok, sin_tok = cos.repeat(B, 1), sin.repeat(B, 1)  # the fused op takes per-token rows
    cotangent = t(B, S, HIDDEN)  # the loss is <out, cotangent>: both runs start the backward alike
    return [x_q, c_kv, k_pe, cos, sin, cos_tok, sin_tok], cotangent


def _model(seed, mxfp8):
    torch.manual_seed(seed)
    model = Block(mxfp8)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16())
    return model.bfloat16()


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _tp_case(seed, mxfp8):
    world, rank = dist.get_world_size(), dist.get_rank()
    heads = slice(rank * H // world, (rank + 1) * H // world)
    inputs, cotangent = _inputs(seed)
    ref = _model(seed, mxfp8)
    ref_in = [t.clone().requires_grad_(i < 3) for i, t in enumerate(inputs)]
    ref_o, ref_q = ref.attn(*ref_in)
    ref_out = ref.o_proj(ref_o.reshape(B, S, -1))
    ref_out.backward(cotangent)

    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(_model(seed, mxfp8), mesh, tp_plan(mesh, len(inputs)))
    tp_in = [t.clone().requires_grad_(i < 3) for i, t in enumerate(inputs)]
    with CommDebugMode() as fwd_comm:
        o, q_row = model.attn(*tp_in)
    result = {"fwd collectives": dict(fwd_comm.get_comm_counts())}
    assert isinstance(o, DTensor) and o.placements == (Shard(2),), o
    assert_bytes_equal(_local(q_row.data).view(torch.uint8), ref_q.data[:, heads].view(torch.uint8), "q codes")
    assert_bytes_equal(_local(q_row.scale), ref_q.scale[:, heads], "q scales")
    assert_bytes_equal(_local(o), ref_o[:, :, heads], "o")
    out = model.o_proj(o.reshape(B, S, -1))
    with CommDebugMode() as bwd_comm:
        out.backward(cotangent)
    result["bwd collectives"] = {str(k): v for k, v in bwd_comm.get_comm_counts().items()}
    result["out"] = _rel(out, ref_out)
    for name, mine, theirs in zip(("x_q", "c_kv", "k_pe"), tp_in, ref_in):
        result[f"d{name}"] = _rel(mine.grad, theirs.grad)
    shards = (("q_b_proj", model.attn.q_b_proj.weight, ref.attn.q_b_proj.weight, 0),
              ("kv_b_proj", model.attn.kv_b_proj.weight, ref.attn.kv_b_proj.weight, 0),
              ("o_proj", model.o_proj.weight, ref.o_proj.weight, 1))
    for name, mine, theirs, dim in shards:
        assert mine.grad.placements == (Shard(dim),), (name, mine.grad.placements)
        part = theirs.grad.chunk(world, dim=dim)[rank]
        result[f"d{name}"] = _rel(mine.grad.to_local(), part)
        result[f"d{name} bytes equal"] = bool(torch.equal(mine.grad.to_local().view(torch.int16),
                                                          part.view(torch.int16)))
    return result


def _quantize_sharded_blocked_axis():
    """A blocked axis may be sharded into whole 32-element blocks (bytes equal to the shard of the whole
    quantized tensor), and not otherwise."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    x = torch.from_numpy(np.random.default_rng(9).standard_normal((32 * world, 4, 64))).bfloat16()
    mine = mxfp8_quantize(distribute_tensor(x, mesh, [Shard(0)]), axis=(2, 0))
    for got, want in zip(mine, mxag.mxfp8_quantize(x, axis=(2, 0))):
        assert got.data.placements == (Shard(0),) and got.scale.placements == (Shard(0),)
        assert_bytes_equal(got.data.to_local().view(torch.uint8), want.data.view(torch.uint8).chunk(world)[rank])
        assert_bytes_equal(got.scale.to_local(), want.scale.chunk(world)[rank])
    try:
        mxfp8_quantize(distribute_tensor(x[:48 * world // 2], mesh, [Shard(0)]), axis=0)
    except ValueError as e:
        return str(e)
    return None


def _rank_checks(rank, world):
    results = {}
    checked(results, "bf16", _tp_case, 21, False)
    checked(results, "mxfp8", _tp_case, 22, True)
    checked(results, "quantize placement", _quantize_sharded_blocked_axis)
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_rank_checks, 2, timeout=150)


@pytest.mark.parametrize("case", ["bf16", "mxfp8"])
def test_tp_forward_bytes_and_no_forward_communication(ranks, case):
    for result in result_of(ranks, case):
        assert result["fwd collectives"] == {}, result["fwd collectives"]


@pytest.mark.parametrize("case", ["bf16", "mxfp8"])
def test_tp_gradients_within_bound(ranks, case):
    for rank, result in enumerate(result_of(ranks, case)):
        assert any("all_reduce" in k for k in result["bwd collectives"]), result["bwd collectives"]
        for name in ("out", "dx_q", "dc_kv", "dk_pe", "dq_b_proj", "dkv_b_proj", "do_proj"):
            assert result[name] <= GRAD_BOUND, f"rank {rank} {case}: {name} rel. Frobenius {result[name]:.2e}"
        # the fused op's dW is an exact product rounded once (spec.mla_q), computed per head
        assert result["dq_b_proj bytes equal"], f"rank {rank} {case}: q_b_proj's gradient shard differs"


def test_quantize_shards_a_blocked_axis_only_in_whole_blocks(ranks):
    for message in result_of(ranks, "quantize placement"):
        assert message is not None and message.startswith("x: sharded 2 ways along blocked axis 0"), message


# DTensor never meets these: mla_kv_mxfp8 given DTensors takes the composition of the other ops (rope,
# then mxfp8_quantize of k and of v), as the TP runs of the block (tests/test_parallel_check.py) and
# of the patched HF model (tests/test_parallel_hf.py) do on the mxfp8 path.
COMPOSED_FOR_DTENSOR = {"mla_kv_mxfp8", "mla_kv_mxfp8_backward"}


def test_every_custom_op_has_a_rule():
    """Every op of dispatch.autograd.OPS that a DTensor can reach has a DTensor strategy: a register_sharding
    rule, except mxfp8_quantize (list output), whose strategy is registered with the propagator directly."""
    assert set(mxag.OPS) - set(RULES) - COMPOSED_FOR_DTENSOR == {"mxfp8_quantize"}
    props = DTensor._op_dispatcher.sharding_propagator
    for name in set(mxag.OPS) - COMPOSED_FOR_DTENSOR:
        assert getattr(torch.ops.mxmla, name).default in props.op_strategy_funcs, name
