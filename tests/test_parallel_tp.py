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


def _kv_case(seed, shared):
    """mxmla::mla_kv_mxfp8 (k_pe rotated in it) and its backward on DTensors against one process: k_nope
    and v Shard(head), k_pe Replicate when shared by the heads (else Shard(head)), the tables Replicate.
    Forward: no collective, every output Shard(head) and this rank's heads' bytes. Backward: dk_nope and
    dv this rank's heads' bytes; a shared k_pe's gradient is the backward op's Partial (each rank's heads'
    sum), all-reduced into the replicated input's gradient (within GRAD_BOUND: two bf16 roundings of
    partial sums, as x_q's above); a per-head one is this rank's heads' bytes."""
    world, rank = dist.get_world_size(), dist.get_rank()
    heads = slice(rank * H // world, (rank + 1) * H // world)
    rng = np.random.default_rng(seed)
    t = lambda *shape: torch.from_numpy(rng.standard_normal(shape)).bfloat16()  # noqa: E731
    k_nope, k_pe, v = t(B, S, H, 128), t(B, S, 1 if shared else H, 64), t(B, S, H, 128)
    dk, dv = t(B, S, H, 192), t(B, S, H, 128)
    cos, sin = _inputs(seed)[0][3:5]
    op = torch.ops.mxmla.mla_kv_mxfp8

    ref_in = [x.clone().requires_grad_() for x in (k_nope, k_pe, v)]
    ref = op(*ref_in, cos, sin, "bshd", None)
    torch.autograd.backward([ref[0], ref[3]], [dk, dv])

    mesh = init_device_mesh("cpu", (world,))
    mine = [x[:, :, heads].clone().requires_grad_() for x in (k_nope, v)]
    pe = (k_pe if shared else k_pe[:, :, heads]).clone().requires_grad_()
    on_heads = lambda x: DTensor.from_local(x, mesh, [Shard(2)])  # noqa: E731
    replicated = lambda x: DTensor.from_local(x, mesh, [Replicate()])  # noqa: E731
    with CommDebugMode() as fwd_comm:
        outs = op(on_heads(mine[0]), replicated(pe) if shared else on_heads(pe), on_heads(mine[1]), replicated(cos),
                  replicated(sin), "bshd", None)
    result = {"fwd collectives": dict(fwd_comm.get_comm_counts()),
              "placements": sorted({str(o.placements) for o in outs})}
    for i, what in ((1, "k codes"), (2, "k scales"), (4, "v codes"), (5, "v scales")):
        assert_bytes_equal(outs[i].to_local(), ref[i][:, :, heads], what)
    with CommDebugMode() as bwd_comm:
        torch.autograd.backward([outs[0], outs[3]], [on_heads(dk[:, :, heads]), on_heads(dv[:, :, heads])])
    result["bwd collectives"] = {str(k): v for k, v in bwd_comm.get_comm_counts().items()}
    assert_bytes_equal(mine[0].grad, ref_in[0].grad[:, :, heads], "dk_nope")
    assert_bytes_equal(mine[1].grad, ref_in[2].grad[:, :, heads], "dv")
    if shared:
        result["dk_pe"] = _rel(pe.grad, ref_in[1].grad)
    else:
        assert_bytes_equal(pe.grad, ref_in[1].grad[:, :, heads], "dk_pe")
    dk_pe = torch.ops.mxmla.mla_kv_mxfp8_pe_backward(on_heads(dk[:, :, heads]), replicated(cos), replicated(sin), "bshd",
                                                  shared, "bfloat16", None)
    result["backward placements"] = [str(dk_pe.placements)]
    return result


def _rank_checks(rank, world):
    results = {}
    checked(results, "bf16", _tp_case, 21, False)
    checked(results, "mxfp8", _tp_case, 22, True)
    checked(results, "kv shared k_pe", _kv_case, 23, True)
    checked(results, "kv per-head k_pe", _kv_case, 24, False)
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


@pytest.mark.parametrize("shared", [True, False])
def test_kv_op_on_heads(ranks, shared):
    for rank, result in enumerate(result_of(ranks, "kv shared k_pe" if shared else "kv per-head k_pe")):
        assert result["fwd collectives"] == {}, result["fwd collectives"]
        assert result["placements"] == ["(Shard(dim=2),)"], result["placements"]
        pe = "(Partial(sum),)" if shared else "(Shard(dim=2),)"
        assert result["backward placements"] == [pe], result
        if shared:  # the Partial gradient reaches the replicated k_pe through one all-reduce
            assert any("all_reduce" in k for k in result["bwd collectives"]), result["bwd collectives"]
            assert result["dk_pe"] <= GRAD_BOUND, f"rank {rank}: dk_pe rel. Frobenius {result['dk_pe']:.2e}"
        else:
            assert result["bwd collectives"] == {}, result["bwd collectives"]


# mxmla ops that only plain tensors reach: dispatch.nn.mla_q_projection takes the fused query op
# (dispatch.q_path) and a weight's kept copies (dispatch.weights, whose proxy op this is) for a plain
# weight only; a DTensor weight takes the composition of the ops above, quantized per call. (The
# mla_kv_mxfp8 wrapper, too, hands DTensors to the composition; its two ops' rules serve direct calls.)
PLAIN_TENSORS_ONLY = {"rmsnorm_mla_q", "rmsnorm_mla_q_backward", "weight_grad_proxy"}


def test_every_custom_op_has_a_rule():
    """Every op of dispatch.autograd.OPS has a DTensor strategy: a register_sharding rule, except
    mxfp8_quantize (list output), whose strategy is registered with the propagator directly; the
    namespace's other ops are the plain-tensor ones (PLAIN_TENSORS_ONLY) and those of the optional
    integrations (dispatch.integrations.*: their own layers' helpers)."""
    import dispatch.nn  # noqa: F401  (defines the query path's ops)
    from torch._library.custom_ops import OPDEFS

    assert set(mxag.OPS) - set(RULES) == {"mxfp8_quantize"}
    defined = {name.split("::")[1].split(".")[0] for name in torch._C._dispatch_get_all_op_names()
               if name.startswith("mxmla::")}
    assert PLAIN_TENSORS_ONLY <= defined - set(mxag.OPS)
    others = defined - set(mxag.OPS) - PLAIN_TENSORS_ONLY
    modules = {name: OPDEFS[f"mxmla::{name}"]._init_fn.__module__ for name in others}
    assert all(m.startswith("dispatch.integrations.") for m in modules.values()), modules
    props = DTensor._op_dispatcher.sharding_propagator
    for name in mxag.OPS:
        assert getattr(torch.ops.mxmla, name).default in props.op_strategy_funcs, name
