"""Context parallelism on CPU with gloo, 2 and 4 ranks: dispatch.parallel against one process.

Every rank builds the same whole-sequence inputs (tests/conformance/test_attention.make_inputs: per-head
magnitudes, a zero query, tied keys, bf16 subnormals and -0.0 in v), runs `mla_attention` on the whole
sequence (the one-process reference, forward and backward), then `context_parallel_attention` on its
load-balanced shard, and compares its shard of o, lse, dq, dk, dv with the same shard of the reference.

Bounds: the attention conformance bounds (tests/conformance/test_attention.py), since the reference
and the ring are both within them of the float64 result: o and dq, dk, dv relative Frobenius
<= 1e-2 (bf16 and, on the torch backend, MXFP8 inputs alike); lse absolute <= 1e-3. The ring adds one
bf16 rounding per block result (each block's o and gradients come back in bf16 before the fp32 merge),
2^-9 relative per element: measured about 3e-3 here.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import dispatch.autograd as mxag  # noqa: E402
from backends.convert import to_torch  # noqa: E402
from dispatch.parallel import (  # noqa: E402
    block_plan,
    context_parallel_attention,
    shard_positions,
    shard_sequence,
    unshard_sequence,
)

from tests.conformance.test_attention import BF16_BOUND, LSE_ABS_BOUND, make_inputs  # noqa: E402
from tests.parallel_spawn import checked, result_of, run_ranks  # noqa: E402
from tests.util import assert_bytes_equal, random_magnitudes, special_values_f32  # noqa: E402

B, S, H = 1, 256, 2
GRAD_NAMES = ("dq", "dk", "dv")


def _rel(actual, expected) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    assert torch.isfinite(a).all(), "non-finite values"
    return float((a - e).norm() / e.norm())


def _inputs(seed, layout="bshd", batch=B):
    q, k, v, do = (to_torch(x, "cpu") for x in make_inputs(seed, batch, S, S, H, layout))
    return q, k, v, do


def _seq(layout):
    return 1 if layout == "bshd" else 0


def _quantized(q, k, v, layout):
    """Tracked MXFP8 q, k (blocked along D) and v (along the sequence) of bf16 leaves."""
    return (mxag.mxfp8_quantize(q, axis=-1), mxag.mxfp8_quantize(k, axis=-1),
            mxag.mxfp8_quantize(v, axis=_seq(layout)))


def _errors(o, lse, leaves, ref_o, ref_lse, ref_leaves, layout, group=None):
    seq = _seq(layout)
    errs = {"o": _rel(o, shard_sequence(ref_o, seq, group)),
            "lse": float((lse - shard_sequence(ref_lse, 2, group)).abs().max())}
    for name, leaf, ref in zip(GRAD_NAMES, leaves, ref_leaves):
        errs[name] = _rel(leaf.grad, shard_sequence(ref.grad, seq, group))
    return errs


def _pair_groups():
    """Ranks {0, 1}, {2, 3}, ... as process groups (every rank creates every group); this rank's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    return groups[rank // 2]


def _cp_case(seed, layout, mxfp8, batch=B, group=None):
    """Errors of this rank's CP shard against the one-process result (causal, load-balanced), the ring
    over `group` (None: all ranks)."""
    seq = _seq(layout)
    shard = functools.partial(shard_sequence, group=group)
    q, k, v, do = _inputs(seed, layout, batch)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ops = _quantized(*ref, layout) if mxfp8 else ref
    ref_o, ref_lse = mxag.mla_attention(*ops, causal=True, layout=layout)
    ref_o.backward(do)
    local = [shard(t, seq).requires_grad_() for t in (q, k, v)]
    ops = _quantized(*local, layout) if mxfp8 else local
    if mxfp8:  # quantizing the shard equals sharding the quantized sequence (whole blocks either way)
        whole = _quantized(q, k, v, layout)
        for name, mine, full in zip("qkv", ops, whole):
            theirs = shard(full, seq)
            assert_bytes_equal(mine.data.view(torch.uint8), theirs.data.view(torch.uint8), f"{name} codes")
            assert_bytes_equal(mine.scale, theirs.scale, f"{name} scales")
    o, lse = context_parallel_attention(*ops, group=group, causal=True, layout=layout)
    o.backward(shard(do, seq))
    return _errors(o, lse, local, ref_o, ref_lse, ref, layout, group)


def _cp_not_causal(seed):
    """causal=False with plain contiguous shards (any sharding of the keys works unmasked)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, do = _inputs(seed)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_o, ref_lse = mxag.mla_attention(*ref, causal=False)
    ref_o.backward(do)
    mine = lambda t, d=1: t.chunk(world, dim=d)[rank]  # noqa: E731
    local = [mine(t).clone().requires_grad_() for t in (q, k, v)]
    o, lse = context_parallel_attention(*local, causal=False)
    o.backward(mine(do))
    errs = {"o": _rel(o, mine(ref_o)), "lse": float((lse - mine(ref_lse, 2)).abs().max())}
    for name, leaf, r in zip(GRAD_NAMES, local, ref):
        errs[name] = _rel(leaf.grad, mine(r.grad))
    return errs


def _round_trip():
    """unshard(shard(x)) is x, byte for byte: bf16 with special values, fp32 at many magnitudes, and
    MXTensors blocked along the sharded axis and across it."""
    rng = np.random.default_rng(7)
    world = dist.get_world_size()
    specials = special_values_f32()
    x32 = random_magnitudes(rng, (2, 64 * world, 3, 32))
    x32.reshape(-1)[: specials.size] = specials
    for name, x, dim in (("fp32", torch.from_numpy(x32), 1), ("bf16", torch.from_numpy(x32).bfloat16(), 1),
                         ("bf16 dim -1", torch.from_numpy(x32[..., :2 * world]).bfloat16(), -1)):
        assert_bytes_equal(unshard_sequence(shard_sequence(x, dim), dim), x, name)
    v = torch.from_numpy(x32).bfloat16()
    for axis in (1, 3):
        mx = mxag.mxfp8_quantize(v, axis=axis)
        back = unshard_sequence(shard_sequence(mx, 1), 1)
        assert back.axis == axis
        assert_bytes_equal(back.data.view(torch.uint8), mx.data.view(torch.uint8), f"codes axis {axis}")
        assert_bytes_equal(back.scale, mx.scale, f"scales axis {axis}")
    return True


def _positions():
    """shard_positions gives the rows rope's cp_size / cp_rank arguments use: rope on the shard with
    those explicit positions is bytes-equal to rope with cp_size, cp_rank, and to the shard of rope on
    the whole sequence."""
    world, rank = dist.get_world_size(), dist.get_rank()
    pos = shard_positions(S)
    c = S // (2 * world)
    want = list(range(rank * c, rank * c + c)) + list(range((2 * world - 1 - rank) * c, (2 * world - rank) * c))
    assert pos.dtype == torch.int64 and pos.tolist() == want
    rng = np.random.default_rng(8)
    x = torch.from_numpy(random_magnitudes(rng, (B, S, H, 192))).bfloat16()
    angles = torch.arange(S, dtype=torch.float64)[:, None] * 0.5 ** torch.arange(32, dtype=torch.float64)
    cos, sin = torch.cos(angles).float(), torch.sin(angles).float()
    rope = lambda t, **kw: mxag.rope(t, cos, sin, layout="bshd", **kw)  # noqa: E731
    local = shard_sequence(x, 1)
    by_positions = rope(local, positions=pos)
    assert_bytes_equal(by_positions, rope(local, cp_size=world, cp_rank=rank), "positions vs cp_size/cp_rank")
    assert_bytes_equal(by_positions, shard_sequence(rope(x), 1), "shard of the whole sequence's rope")
    return True


def _bad_inputs():
    """Bad calls raise naming the argument."""
    world = dist.get_world_size()
    q, k, v, _ = _inputs(3)
    short = [t[:, : 32 * world] for t in (q, k, v)]  # shards of 32 tokens: chunks of 16
    qm, km, vm = _quantized(*(shard_sequence(t, 1) for t in short), "bshd")
    messages = {}
    for name, call in (
        ("v", lambda: context_parallel_attention(qm, km, vm)),
        ("layout", lambda: context_parallel_attention(q, k, v, layout="thd")),
        ("q, k", lambda: context_parallel_attention(q, k[:, :64], v[:, :64])),
        ("q", lambda: context_parallel_attention(q[:, :33], k[:, :33], v[:, :33])),
        ("causal", lambda: context_parallel_attention(q, k, v, causal=1)),
        ("group", lambda: context_parallel_attention(*(t.to("meta") for t in (q, k, v)))),  # gloo: host memory only
        ("x", lambda: shard_sequence(q[:, : 2 * world + 1], 1)),
        ("S", lambda: shard_positions(2 * world + 2)),
        ("dim", lambda: shard_sequence(q, 4)),
    ):
        try:
            call()
        except (ValueError, TypeError) as e:
            messages[name] = str(e)
        else:
            messages[name] = None
    return messages


def _rank_checks(rank, world):
    results = {}
    checked(results, "bf16 bshd", _cp_case, 11, "bshd", False)
    checked(results, "mxfp8 bshd", _cp_case, 12, "bshd", True)
    if world == 2:  # sbhd (batch 2) and the unmasked ring once (the ring's steps are alike at every W)
        checked(results, "bf16 sbhd", _cp_case, 13, "sbhd", False, 2)
        checked(results, "mxfp8 sbhd", _cp_case, 14, "sbhd", True, 2)
        checked(results, "not causal", _cp_not_causal, 15)
    if world == 4:  # two rings of 2 ranks each (subgroups: peers named by their global ranks)
        checked(results, "bf16 bshd pairs", _cp_case, 16, "bshd", False, B, _pair_groups())
    checked(results, "round trip", _round_trip)
    checked(results, "positions", _positions)
    checked(results, "bad inputs", _bad_inputs)
    return results


_RUNS = {}


def _ranks(world):
    """Every check on `world` gloo ranks, run once per module (one spawn per world size)."""
    if world not in _RUNS:
        _RUNS[world] = run_ranks(_rank_checks, world, timeout=150)
    return _RUNS[world]


@pytest.fixture(scope="module", params=[2, 4], ids=["W2", "W4"])
def ranks(request):
    return request.param, _ranks(request.param)


CASES = [(2, c) for c in ("bf16 bshd", "mxfp8 bshd", "bf16 sbhd", "mxfp8 sbhd", "not causal")]
CASES += [(4, c) for c in ("bf16 bshd", "mxfp8 bshd", "bf16 bshd pairs")]


@pytest.mark.parametrize("world, case", CASES, ids=[f"W{w}-{c}" for w, c in CASES])
def test_cp_matches_one_process(world, case):
    for rank, errs in enumerate(result_of(_ranks(world), case)):
        for name in ("o",) + GRAD_NAMES:
            assert errs[name] <= BF16_BOUND, f"rank {rank}/{world} {case}: {name} rel. Frobenius {errs[name]:.2e}"
        assert errs["lse"] <= LSE_ABS_BOUND, f"rank {rank}/{world} {case}: lse abs error {errs['lse']:.2e}"


def test_round_trip_bytes_equal(ranks):
    assert all(result_of(ranks[1], "round trip"))


def test_shard_positions(ranks):
    assert all(result_of(ranks[1], "positions"))


def test_bad_inputs_name_the_argument(ranks):
    for messages in result_of(ranks[1], "bad inputs"):
        for name, message in messages.items():
            assert message is not None, f"{name}: no error raised"
            assert message.startswith(f"{name}:"), (name, message)
        assert "multiple of 64" in messages["v"]


def test_block_plan_covers_the_causal_mask():
    """Single-process: over all W steps, the blocks of block_plan cover exactly the global causal
    mask's (query chunk, key chunk) pairs (full below the diagonal, causal on it), for W = 1..5."""
    for world in range(1, 6):
        for rank in range(world):
            mine = (rank, 2 * world - 1 - rank)
            seen = {}
            for source in range(world):
                theirs = (source, 2 * world - 1 - source)
                q0, q1, k0, k1, causal = block_plan(rank, source, True, 2)
                for qi in range(q0, q1):
                    for ki in range(k0, k1):
                        key = (mine[qi], theirs[ki])
                        assert key not in seen
                        seen[key] = "diag" if causal and qi == ki else ("masked" if causal and ki > qi else "full")
            for a in mine:
                for b in range(2 * world):
                    got = seen.get((a, b))
                    want = ("full",) if b < a else (("diag",) if b == a else (None, "masked"))
                    assert got in want, (world, rank, a, b, got)
