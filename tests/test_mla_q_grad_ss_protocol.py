"""The slot / phase protocol of the fused MXFP8 backward's shared-memory-operand form
(backends/triton/mla_q_grad_gluon.py: _transform, which also issues the TMA loads through _load_step, and
two _consumer_ss warpgroups), modelled in Python and run under many random interleavings.

The model follows the kernels' waits, arrivals and phase arithmetic line for line: a ring of STAGES
slots for g's raw tile and the other operand (ready: the loads landed; empty: both consumers' MMAs on
the other operand retired; raw_empty: the transform read g), a ring of A_STAGES prepared A tiles (a_ready,
a_empty), and work items of unequal k-step counts on one schedule row. It asserts that every MMA reads
the step it expects, that no slot is refilled while an MMA that reads it is still in flight, and that
no interleaving deadlocks. Loading step c + STAGES - 1 before preparing step c (instead of after)
deadlocks, and so does a single A slot: the last two tests show both.
"""
from __future__ import annotations

import random

import pytest

from tests.util import MBarrier, interleave


def _actors(k_steps_per_item, stages, a_stages, load_first=False):
    ready = [MBarrier(1) for _ in range(stages)]
    empty = [MBarrier(2) for _ in range(stages)]
    raw_empty = [MBarrier(1) for _ in range(stages)]
    a_ready = [MBarrier(1) for _ in range(a_stages)]
    a_empty = [MBarrier(2) for _ in range(a_stages)]
    slot_fill = [None] * stages  # which ring step a slot holds (g's raw tile and the other operand)
    a_fill = [None] * a_stages  # which ring step an A slot holds
    steps = [(item, kk) for item, n in enumerate(k_steps_per_item) for kk in range(n)]
    mma_log = [[], []]

    def wait(bar, parity):
        while not bar.passes(parity):
            yield

    def load(lc):  # _load_step with SS=1
        s = lc % stages
        yield from wait(empty[s], ((lc // stages) & 1) ^ 1)
        yield from wait(raw_empty[s], ((lc // stages) & 1) ^ 1)
        slot_fill[s] = lc
        ready[s].arrive()  # the copies land

    def transform():
        lc = 0
        for _ in range(stages - 1):
            if lc < len(steps):
                yield from load(lc)
                lc += 1
        for c in range(len(steps)):
            if load_first and lc < len(steps):
                yield from load(lc)
                lc += 1
            s, j = c % stages, c % a_stages
            yield from wait(ready[s], (c // stages) & 1)
            assert slot_fill[s] == c, f"transform read step {slot_fill[s]} for {c}"
            yield from wait(a_empty[j], ((c // a_stages) & 1) ^ 1)
            a_fill[j] = c
            raw_empty[s].arrive()
            a_ready[j].arrive()
            if not load_first and lc < len(steps):
                yield from load(lc)
                lc += 1

    def consumer(cid):
        c = 0
        for n in k_steps_per_item:
            in_flight = None
            for kk in range(n):
                s, j = c % stages, c % a_stages
                yield from wait(a_ready[j], (c // a_stages) & 1)
                yield from wait(ready[s], (c // stages) & 1)
                assert a_fill[j] == c and slot_fill[s] == c, f"consumer {cid} step {c}: A {a_fill[j]}, B {slot_fill[s]}"
                if in_flight is not None:  # retire step c - 1: its slots must still hold it
                    p = in_flight
                    assert a_fill[p % a_stages] == p and slot_fill[p % stages] == p, f"step {p} overwritten in flight"
                    empty[p % stages].arrive()
                    a_empty[p % a_stages].arrive()
                mma_log[cid].append(c)
                in_flight = c
                c += 1
                yield
            p = in_flight
            assert a_fill[p % a_stages] == p and slot_fill[p % stages] == p, f"step {p} overwritten in flight"
            empty[p % stages].arrive()
            a_empty[p % a_stages].arrive()

    return [transform(), consumer(0), consumer(1)], mma_log, len(steps)


def _run(seed, k_steps_per_item, stages, a_stages, load_first=False):
    actors, log, total = _actors(k_steps_per_item, stages, a_stages, load_first)
    if not interleave(actors, random.Random(seed), lambda: len(log[0]) + len(log[1]), patience=20000):
        raise RuntimeError("deadlock")
    assert log[0] == log[1] == list(range(total))


@pytest.mark.parametrize("stages,a_stages", [(3, 2), (2, 2), (4, 3), (2, 3)])
@pytest.mark.parametrize("items", [[6, 6, 2, 2, 2], [1], [2, 1, 3], [4]])
def test_ss_protocol_random_interleavings(stages, a_stages, items):
    for seed in range(40):
        _run(seed, items, stages, a_stages)


def test_one_a_slot_deadlocks_and_the_launch_refuses_it():
    # the consumers retire step c only after issuing step c + 1, which needs a second A slot
    with pytest.raises(RuntimeError, match="deadlock"):
        for seed in range(40):
            _run(seed, [4], 3, 1)
    G = pytest.importorskip("backends.triton.mla_q_grad_gluon")
    torch = pytest.importorskip("torch")
    g2 = torch.zeros(64, 192, dtype=torch.bfloat16)
    other = torch.zeros(64, 192, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="A_STAGES"):
        G.launch_pair(g2, other, None, torch.zeros(64, 64), torch.zeros(64, 64), torch.zeros(64, 64), None,
                      torch.zeros(1, dtype=torch.int32), (10, 246), config=dict(STAGES=3, SS=1, A_STAGES=1))


def test_loading_before_preparing_deadlocks():
    with pytest.raises(RuntimeError, match="deadlock"):
        for seed in range(40):
            _run(seed, [6, 2], 3, 2, load_first=True)


def test_the_ss_launch_refuses_strided_outputs():
    G = pytest.importorskip("backends.triton.mla_q_grad_gluon")
    torch = pytest.importorskip("torch")
    g2 = torch.zeros(64, 192, dtype=torch.bfloat16)
    other = torch.zeros(64, 192, dtype=torch.bfloat16)
    dx = torch.zeros(64, 128, dtype=torch.bfloat16)[:, :64]
    with pytest.raises(ValueError, match="dx: SS=1 stores contiguous outputs"):
        G.launch_pair(g2, other, None, torch.zeros(64, 64), torch.zeros(64, 64), dx, None,
                      torch.zeros(1, dtype=torch.int32), (10, 246), config=dict(STAGES=3, SS=1))
