"""Run a function on W local processes joined in a gloo process group (loopback only).

The processes are forked where that is safe, so they inherit the imported modules (a fresh
interpreter per rank spends seconds importing torch); on a machine with a GPU they are spawned, because
a parent that has run a backward on a GPU holds autograd's device threads and a forked child's
backward then fails (the rank's function is then pickled by reference: a module-level function).

Rendezvous is a FileStore in the run's own temporary directory, so concurrent runs (pytest-xdist
workers, two pytest sessions) cannot meet each other; gloo's own sockets are bound by gloo itself.

Each rank's function returns a dict of picklable results; `run_ranks` returns them in rank order. Every
rank reports on its own (its result, or its traceback; a rank killed by a signal leaves its Python
stack through faulthandler), and the parent waits for all of them: when any fails, RankFailures lists
every failed rank, the likely root cause first (a rank whose error is not the loss of a peer), then the
ranks that only lost a peer, then those still running at `timeout` seconds (terminated).
"""
from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What a rank raises when another rank's process went away (its own error is the one to read first).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed",
              "Connection refused")


class RankFailures(RuntimeError):
    """One or more ranks failed; `failures` is [(rank, report)] with the likely root cause first."""

    def __init__(self, world: int, failures: List[Tuple[int, str]]):
        self.failures = failures
        ranks = ", ".join(str(rank) for rank, _ in failures)
        parts = [f"{len(failures)} of {world} gloo ranks failed (rank {ranks}; likely root cause first)"]
        parts += [f"---- rank {rank} ----\n{report.rstrip()}" for rank, report in failures]
        super().__init__("\n".join(parts))


def _entry(rank: int, world: int, rundir: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    fault = open(os.path.join(rundir, f"{rank}.fault"), "w")
    faulthandler.enable(fault)  # a native crash still leaves this rank's Python stack
    faulthandler.register(signal.SIGUSR1, fault, all_threads=True)  # the parent asks a hung rank where it is
    try:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(rundir, 'store')}", rank=rank,
                                world_size=world)
        try:
            outcome = ("ok", fn(rank, world, *args))
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported by the parent, with every other rank's
        outcome = ("error", traceback.format_exc())
    path = os.path.join(rundir, f"{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(outcome, f)
    os.replace(path + ".tmp", path)
    if outcome[0] != "ok":
        os._exit(1)


def start_method() -> str:
    return "spawn" if torch.cuda.is_available() else "fork"


def _outcome(rundir: str, rank: int):
    """("ok", result) or ("error", traceback) as the rank wrote it, or None."""
    path = os.path.join(rundir, f"{rank}.pkl")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _failure(rundir: str, rank: int, exitcode, timed_out: bool) -> Tuple[int, str]:
    """(order, report) of a failed rank; order 0: its own error (the likely root cause), 1: it lost a
    peer, 2: still running at the timeout."""
    outcome = _outcome(rundir, rank)
    if outcome is not None and outcome[0] == "error":
        return (1 if any(s in outcome[1] for s in _PEER_LOST) else 0), outcome[1]
    with open(os.path.join(rundir, f"{rank}.fault")) as f:
        stack = f.read().strip()
    if timed_out:
        return 2, f"still running at the timeout (terminated); its stack then:\n{stack}"
    how = f"killed by {signal.Signals(-exitcode).name}" if exitcode is not None and exitcode < 0 else \
        f"exit code {exitcode}"
    return 0, f"process {how} without reporting a result\n{stack}"


def run_ranks(fn: Callable, world: int, *args, timeout: float = 120.0) -> List[Dict[str, Any]]:
    """fn(rank, world, *args) on `world` gloo ranks; the list of their returned dicts, or RankFailures."""
    with tempfile.TemporaryDirectory(prefix="gloo_ranks_") as rundir:
        context = mp.get_context(start_method())
        processes = [context.Process(target=_entry, args=(rank, world, rundir, fn, args), daemon=True)
                     for rank in range(world)]
        for p in processes:
            p.start()
        deadline = time.monotonic() + timeout
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, p in enumerate(processes) if p.is_alive()]
        if hung:
            for rank in hung:
                os.kill(processes[rank].pid, signal.SIGUSR1)
            time.sleep(1.0)  # for faulthandler to write their stacks
            for rank in hung:
                processes[rank].terminate()
                processes[rank].join(10)
        results, failures = [], []
        for rank, p in enumerate(processes):
            outcome = _outcome(rundir, rank)
            if rank not in hung and outcome is not None and outcome[0] == "ok":
                results.append(outcome[1])
            else:
                order, report = _failure(rundir, rank, p.exitcode, rank in hung)
                failures.append((order, rank, report))
        if failures:
            raise RankFailures(world, [(rank, report) for _, rank, report in sorted(failures)])
        return results


def checked(results: Dict[str, Any], name: str, fn: Callable, *args) -> None:
    """results[name] = fn(*args), or the traceback string when it raises (so one failing check does
    not hide the others: the test of that check reports it)."""
    try:
        results[name] = fn(*args)
    except Exception:  # noqa: BLE001 - reported by the test that reads this entry
        results[name] = "FAILED\n" + traceback.format_exc()


def result_of(per_rank: List[Dict[str, Any]], name: str) -> List[Any]:
    """Every rank's entry `name`; fails with the rank's traceback where the check raised."""
    out = []
    for rank, results in enumerate(per_rank):
        value = results[name]
        if isinstance(value, str) and value.startswith("FAILED\n"):
            raise AssertionError(f"rank {rank}, check {name}:\n{value}")
        out.append(value)
    return out
