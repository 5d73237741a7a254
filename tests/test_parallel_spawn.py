"""tests/parallel_spawn.run_ranks: every failed rank's own report reaches the caller, the likely root cause
first (a rank's own error before the peers that only lost it, a native crash with its Python stack, a
hung rank's stack at the timeout), and concurrent runs cannot meet (each has its own FileStore)."""
from __future__ import annotations

import os
import signal
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from tests.parallel_spawn import RankFailures, run_ranks  # noqa: E402


def _rank_zero_raises(rank, world):
    if rank == 0:
        time.sleep(0.5)  # the others are waiting in the all-reduce by then
        raise ValueError("rank zero's own fault")
    dist.all_reduce(torch.ones(4))
    return {}


def _rank_one_crashes(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.all_reduce(torch.ones(4))
    return {}


def _rank_one_hangs(rank, world):
    if rank == 1:
        time.sleep(600)
    return {"rank": rank}


def _world_and_rank(rank, world):
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": float(_all_reduced(rank))}


def _all_reduced(rank):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def test_ranks_return_their_results_in_order():
    assert run_ranks(_world_and_rank, 3) == [{"rank": r, "world": 3, "sum": 6.0} for r in range(3)]


def test_the_raising_rank_comes_first_and_every_rank_reports():
    with pytest.raises(RankFailures) as info:
        run_ranks(_rank_zero_raises, 3, timeout=60)
    failures = info.value.failures
    assert failures[0][0] == 0 and "ValueError: rank zero's own fault" in failures[0][1]
    assert sorted(rank for rank, _ in failures) == [0, 1, 2]  # the others lost their peer, and say so
    assert str(info.value).startswith("3 of 3 gloo ranks failed (rank 0, ")


def test_a_crashed_rank_reports_its_signal_and_python_stack():
    with pytest.raises(RankFailures) as info:
        run_ranks(_rank_one_crashes, 2, timeout=60)
    rank, report = info.value.failures[0]
    assert rank == 1 and "killed by SIGSEGV" in report and "_rank_one_crashes" in report, report


def test_a_hung_rank_is_terminated_at_the_timeout_with_its_stack():
    start = time.monotonic()
    with pytest.raises(RankFailures) as info:
        run_ranks(_rank_one_hangs, 2, timeout=5)
    assert time.monotonic() - start < 30
    reports = dict(info.value.failures)  # rank 0 waits for rank 1 in the closing barrier
    assert sorted(reports) == [0, 1] and all("still running at the timeout" in r for r in reports.values())
    assert "_rank_one_hangs" in reports[1] and "barrier" in reports[0], reports
