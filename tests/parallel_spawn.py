"""Run a function on W local processes joined in a gloo process group (127.0.0.1 only).

The processes are forked where that is safe, so they inherit the imported modules (a fresh
interpreter per rank spends seconds importing torch); on a machine with a GPU they are spawned, because
a parent that has run a backward on a GPU holds autograd's device threads and a forked child's
backward then fails (the rank's function is then pickled by reference: a module-level function).
Each rank's function returns a dict of picklable results; `run_ranks` returns them in rank order. A
rank that raises fails the call with its traceback; a run past `timeout` seconds is terminated.
"""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, outdir: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def start_method() -> str:
    return "spawn" if torch.cuda.is_available() else "fork"


def run_ranks(fn: Callable, world: int, *args, timeout: float = 120.0) -> List[Dict[str, Any]]:
    """fn(rank, world, *args) on `world` gloo ranks; the list of their returned dicts."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_entry, args=(world, free_port(), outdir, fn, args), nprocs=world,
                                 join=False, start_method=start_method())
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                raise TimeoutError(f"{world} gloo ranks still running after {timeout} s")
        results = []
        for rank in range(world):
            with open(os.path.join(outdir, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
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
