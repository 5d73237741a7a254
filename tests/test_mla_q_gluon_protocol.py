"""The slot / phase protocol of the warp-specialized Gluon kernel (backends/triton/mla_q_gluon.py,
_ws_producer / _ws_consumer), modelled in Python and run under many random interleavings.

Beside the GPU runs, what is checked here is the synchronisation itself: mbarriers with
parity waits (a wait passes when the phase of the given parity has completed -- it cannot tell phase n
from n + 2), one producer filling a STAGES-slot ring in tile order, two consumers taking alternate
tiles and taking turns on the main loop through `done`. The model follows the kernel's wait / arrive
sequence and its phase arithmetic line for line; it asserts that every consumer step reads the fill
it expects and that no interleaving deadlocks. Without the `done` turns the first check fails (a
consumer starting its tile early passes a slot's wait on a fill two phases old), which is why the
kernel has them.
"""
from __future__ import annotations

import random

import pytest

from tests.util import MBarrier, interleave


def _actors(tiles: int, k_steps: int, stages: int, turns: bool, shared_epilogue: bool = False):
    ready = [MBarrier(1) for _ in range(stages)]
    empty = [MBarrier(1) for _ in range(stages)]
    done = [MBarrier(1) for _ in range(2)]
    epi_done = [MBarrier(1) for _ in range(2)]
    slot_fill = [None] * stages  # which fill (slot counter c) a slot holds
    log = []
    epi_owner = [None]  # shared_epilogue (_ws128_consumer): who is using the one set of epilogue buffers
    epi_order = []

    def producer():
        c = 0
        for _tile in range(tiles):
            for _kk in range(k_steps):
                s = c % stages
                while not empty[s].passes(((c // stages) & 1) ^ 1):
                    yield
                slot_fill[s] = c  # expect + TMA copies; the copy completing arrives on ready[s]
                ready[s].arrive()
                c += 1

    def wait_turn(bars, cid, n):  # _wait_turn
        if cid == 0:
            while n > 0 and not bars[1].passes((n + 1) & 1):
                yield
        else:
            while not bars[0].passes(n & 1):
                yield

    def consumer(cid: int):
        j, n = cid, 0
        for _tile in range(cid, tiles, 2):
            if turns:
                yield from wait_turn(done, cid, n)
            c0 = j * k_steps
            for kk in range(k_steps):
                c = c0 + kk
                s = c % stages
                while not ready[s].passes((c // stages) & 1):
                    yield
                log.append((cid, c, slot_fill[s]))  # the MMA reads slot s
                yield
                if kk > 0:
                    empty[(c + stages - 1) % stages].arrive()
            if shared_epilogue and turns:  # _ws128_consumer hands the turn over before its last release
                done[cid].arrive()
                yield
            empty[(c0 + k_steps - 1) % stages].arrive()
            if turns and not shared_epilogue:
                done[cid].arrive()
            if shared_epilogue:
                yield from wait_turn(epi_done, cid, n)
                assert epi_owner[0] is None, f"consumer {cid} entered the epilogue buffers of {epi_owner[0]}"
                epi_owner[0] = cid
                epi_order.append(cid)
                yield  # the epilogue, then tma.store_wait(0)
                epi_owner[0] = None
                epi_done[cid].arrive()
            else:
                yield  # the epilogue
            j += 2
            n += 1

    actors = [producer(), consumer(0), consumer(1)]
    return (actors, log, epi_order) if shared_epilogue else (actors, log)


def _run(tiles, k_steps, stages, turns, seed, shared_epilogue=False):
    """Run the actors in a seeded random interleaving: the consumers' (consumer, step, fill read) log,
    and with shared_epilogue the order in which the warpgroups took the epilogue buffers."""
    made = _actors(tiles, k_steps, stages, turns, shared_epilogue)
    actors, log = made[0], made[1]
    order = made[2] if shared_epilogue else []
    if not interleave(actors, random.Random(seed), lambda: len(log) + len(order)):
        raise AssertionError(f"deadlock (tiles={tiles}, k_steps={k_steps}, stages={stages})")
    return (log, order) if shared_epilogue else log


# the shipped configs: 4 stages of BLOCK_K 64 (24 k-steps at K = 1536), 8 of BLOCK_K 32 (48 k-steps)
@pytest.mark.parametrize("tiles,k_steps,stages", [(1, 1, 3), (2, 1, 3), (5, 2, 3), (7, 24, 3), (9, 3, 2), (4, 5, 4),
                                                  (7, 24, 4), (5, 48, 8), (3, 1, 8)])
def test_every_step_reads_its_own_fill(tiles, k_steps, stages):
    for seed in range(40):
        log = _run(tiles, k_steps, stages, turns=True, seed=seed)
        assert len(log) == tiles * k_steps
        for cid, want, got in log:
            assert got == want, f"consumer {cid} read fill {got} for step {want} (seed {seed})"


def test_without_turns_a_consumer_reads_a_stale_fill():
    # the reason for `done`: some interleaving lets consumer 1 pass a parity wait on an old fill
    stale = False
    for seed in range(200):
        try:
            log = _run(6, 3, 3, turns=False, seed=seed)
        except AssertionError:
            continue
        stale |= any(got != want for _, want, got in log)
    assert stale


@pytest.mark.parametrize("tiles,k_steps,stages", [(1, 1, 3), (2, 1, 3), (5, 2, 3), (7, 24, 3), (6, 48, 6), (9, 3, 2)])
def test_shared_epilogue_buffers_alternate(tiles, k_steps, stages):
    # _ws128_consumer: both warpgroups use one set of epilogue buffers, taken in turn through epi_done
    # (the ring's checks hold as before; 3 stages of BLOCK_K 64 and 6 of BLOCK_K 32 are the shipped rings)
    for seed in range(40):
        log, order = _run(tiles, k_steps, stages, turns=True, seed=seed, shared_epilogue=True)
        assert len(log) == tiles * k_steps
        assert all(got == want for _, want, got in log)
        assert order == [t % 2 for t in range(tiles)]
