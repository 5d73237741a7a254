#!/usr/bin/env python
"""The DeepSeek-V3 MLA block under tensor and context parallelism: checks against one device, and times.

    torchrun --nproc_per_node 2 tools/parallel_check.py --out parallel.json     # NCCL, one GPU per rank
    torchrun --nproc_per_node 1 tools/parallel_check.py                         # one H200: TP=1, CP=1 smoke
    python tools/parallel_check.py --smoke                                      # CPU, gloo, one process
    (tests/test_parallel_check.py runs --smoke at 1 and 2 gloo ranks)

The block is benchmarks/bench_block.py's (examples/mla_block.MLABlock: hidden 7168, 128 heads, q_lora
1536, kv_lora 512; B1 S4096 by default), on its mxfp8 and bf16 paths. Every rank builds the same
block and input, and runs:
- single: the whole block on this device (bench_block's step) -- the reference, and the baseline time;
- TP=W: the same parameters as DTensors on a 1-D mesh of all ranks (w_uq and w_ukv Shard(0), i.e.
  colwise over heads; w_o Shard(1), rowwise; the rest Replicate), the block's own forward run on them
  with cos / sin as Replicate DTensors and under implicit_replication (for the positions it builds). The mxmla ops
  dispatch through dispatch.parallel.tensor's sharding rules; the forward's only collective is the
  final all-reduce of o_proj's partial sums (counted by CommDebugMode);
- CP=W: the block's math on this rank's load-balanced sequence shard (shard_sequence), RoPE at the
  shard's global positions (cp_size / cp_rank; shard_positions for the fused op's per-token rows),
  attention through context_parallel_attention's ring. Weight gradients are all-reduced for the check
  (a data-parallel reduction, not timed).
Checks, each within relative Frobenius `BOUND[path]` of the single run: the block output, the input
gradient and the weight gradients (bf16 1e-2 and MXFP8 5e-2: the attention contract's bounds,
tests/conformance/test_attention.py; both runs are within them of the exact result and the parallel
run only regroups sums). Timing: median step (forward + backward) of --steps steps after --warmup,
CUDA events per rank; the table shows the slowest rank. A failed check exits with status 1.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402
from torch.distributed.tensor.experimental import implicit_replication  # noqa: E402

import bench_block  # noqa: E402
import dispatch.autograd as mxag  # noqa: E402
import examples.mla_block as mb  # noqa: E402
from dispatch.parallel import context_parallel_attention, shard_positions, shard_sequence  # noqa: E402

PATHS = ("mxfp8", "bf16")
BOUND = {"bf16": 1e-2, "mxfp8": 5e-2}
TP_PLACEMENTS = {"w_uq": Shard(0), "w_ukv": Shard(0), "w_o": Shard(1)}  # every other parameter: Replicate


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny block on CPU with gloo (seconds)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma list of {', '.join(PATHS)}")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backend", default=None, help="backend for every mxmla op (default: automatic)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here (rank 0)")
    args = ap.parse_args(argv)
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not args.paths or any(p not in PATHS for p in args.paths):
        ap.error(f"--paths: expected names from {', '.join(PATHS)}, got {','.join(args.paths)!r}")
    if args.smoke:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    return args


# --------------------------------------------------------------------------------------------------
# process group
# --------------------------------------------------------------------------------------------------

def init_distributed():
    """Join the group already made (a test's gloo ranks), or torchrun's (env:// rendezvous), or make a
    one-process group in this process's memory; (device, whether made here). The device follows the
    group's backend: CUDA with NCCL, the CPU with gloo (whose point-to-point ops move host memory only),
    also on a machine with a GPU."""
    made = not dist.is_initialized()
    if made:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device()), made
    return torch.device("cpu"), made


def block_config(args, world: int):
    if args.smoke:  # heads and chunks sized for W ranks: H divisible by W, chunks of 32 tokens
        return mb.replace(mb.CONFIGS["small"], heads=2 * world, batch=1, seq=64 * world)
    return bench_block.block_config(args.batch, args.seq, False)


# --------------------------------------------------------------------------------------------------
# the three modes
# --------------------------------------------------------------------------------------------------

class TensorParallelBlock:
    """The block's parameters as DTensors (TP_PLACEMENTS) and its own forward run on them."""

    def __init__(self, bench: "bench_block.Bench", mesh):
        self.block = copy.deepcopy(bench.block)
        for name, param in list(self.block.named_parameters()):
            placement = TP_PLACEMENTS.get(name, Replicate())
            setattr(self.block, name, nn.Parameter(distribute_tensor(param.detach(), mesh, [placement])))
        self.mesh, self.bench = mesh, bench
        self.h = bench.h.detach().clone().requires_grad_()
        # the tables as Replicate DTensors (so the backward, which saves what the ops took, sees no plain
        # tensor); implicit_replication covers the positions the forward builds
        self.cos, self.sin = (DTensor.from_local(t, mesh, [Replicate()]) for t in (bench.cos, bench.sin))
        self.fwd_comms = None

    def step(self, count_comms: bool = False):
        """One forward + backward; count_comms: record the forward's collectives (CommDebugMode, a
        dispatch mode that slows every op: the check's step only, not the timed ones)."""
        for p in self.block.parameters():
            p.grad = None
        self.h.grad = None
        with CommDebugMode() if count_comms else contextlib.nullcontext() as comm:
            with implicit_replication():
                out = self.block(DTensor.from_local(self.h, self.mesh, [Replicate()]), self.cos, self.sin)
            out = out.full_tensor()  # o_proj's partial sums: the forward's one all-reduce
        if count_comms:
            self.fwd_comms = {str(k): v for k, v in comm.get_comm_counts().items()}
        out.backward(self.bench.dout)
        return out


def cp_forward(block: "mb.MLABlock", h_local, cos, sin, group):
    """MLABlock.forward on this rank's load-balanced shard of every sequence (module docstring)."""
    cfg, bf16, backend = block.cfg, torch.bfloat16, block.backend
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    b, heads = cfg.batch, cfg.heads
    s = h_local.shape[0] // b
    hn = mb.torch_rmsnorm(h_local.to(bf16), block.attn_norm, cfg.eps)
    c_q = hn @ block.w_dq.to(bf16).T
    kv = hn @ block.w_dkv.to(bf16).T
    c_kv, k_pe = kv[:, :cfg.kv_lora], kv[:, cfg.kv_lora:].reshape(b, s, 1, mb.ROPE_DIM)
    kv_up = (mb.torch_rmsnorm(c_kv, block.kv_norm, cfg.eps) @ block.w_ukv.to(bf16).T)
    k_nope, v = kv_up.view(b, s, heads, mb.NOPE_DIM + mb.V_DIM).split([mb.NOPE_DIM, mb.V_DIM], dim=-1)
    cp = dict(cp_size=world, cp_rank=rank, backend=backend)
    k_pe = mxag.rope(k_pe, cos, sin, layout="bshd", **cp)
    k = torch.cat([k_nope, k_pe.expand(b, s, heads, mb.ROPE_DIM)], dim=-1)
    if block.path == "bf16":
        q = (mb.torch_rmsnorm(c_q, block.q_norm, cfg.eps) @ block.w_uq.to(bf16).T).view(b, s, heads, mb.QK_DIM)
        q = mxag.rope(q, cos, sin, layout="bshd", **cp)
    else:
        y_row, y_col, _ = mxag.rmsnorm_mxfp8(c_q, block.q_norm, eps=cfg.eps, backend=backend)
        w_row, w_col = mxag.mxfp8_quantize(block.w_uq.to(bf16), axis=(1, 0), backend=backend)
        positions = shard_positions(cfg.seq, group, device=h_local.device).repeat(b)
        q_row, _ = mxag.mla_q_uproj_rope_quant(y_row, w_row, cos[positions], sin[positions],
                                               quantize_grad=block.quantize_grad, x_t=y_col, w_n=w_col,
                                               backend=backend)
        q = mxag.reshape_mx(q_row, (b, s, heads, mb.QK_DIM))
        k = mxag.mxfp8_quantize(k, axis=-1, backend=backend)
        v = mxag.mxfp8_quantize(v, axis=1, backend=backend)
    o, _ = context_parallel_attention(q, k, v, group=group, causal=True, layout="bshd", backend=backend)
    return o.reshape(b * s, heads * mb.V_DIM) @ block.w_o.to(bf16).T


def shard_tokens(x, cfg):
    """[B*S, ...] (batch-major tokens) -> this rank's [B*S/W, ...] load-balanced shard."""
    return shard_sequence(x.reshape(cfg.batch, cfg.seq, *x.shape[1:]), 1).reshape(-1, *x.shape[1:])


class ContextParallelBlock:
    def __init__(self, bench: "bench_block.Bench", group=None):
        self.block = copy.deepcopy(bench.block)
        self.bench, self.group, self.cfg = bench, group, bench.block.cfg
        self.h = shard_tokens(bench.h.detach(), self.cfg).requires_grad_()
        self.dout = shard_tokens(bench.dout, self.cfg)

    def step(self):
        for p in self.block.parameters():
            p.grad = None
        self.h.grad = None
        out = cp_forward(self.block, self.h, self.bench.cos, self.bench.sin, self.group)
        out.backward(self.dout)
        return out


# --------------------------------------------------------------------------------------------------
# checks and timing
# --------------------------------------------------------------------------------------------------

def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_tp(tp: TensorParallelBlock, ref_out, bench) -> dict:
    out = tp.step(count_comms=True)
    errs = {"out": rel(out, ref_out), "dh": rel(tp.h.grad, bench.h.grad)}
    world, rank = dist.get_world_size(), dist.get_rank()
    for name, p in tp.block.named_parameters():
        want = dict(bench.block.named_parameters())[name].grad
        placement = TP_PLACEMENTS.get(name)
        if placement is not None:  # this rank's shard
            errs[f"d{name}"] = rel(p.grad.to_local(), want.chunk(world, dim=placement.dim)[rank])
        else:  # a replicated weight's gradient is Partial (each rank's heads' share): its sum
            errs[f"d{name}"] = rel(p.grad.full_tensor(), want)
    return errs


def check_cp(cp: ContextParallelBlock, ref_out, bench) -> dict:
    out = cp.step()
    errs = {"out": rel(out, shard_tokens(ref_out, cp.cfg)), "dh": rel(cp.h.grad, shard_tokens(bench.h.grad, cp.cfg))}
    for name, p in cp.block.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=cp.group)
        errs[f"d{name}"] = rel(grad, dict(bench.block.named_parameters())[name].grad)
    return errs


def time_steps(step, device, warmup: int, steps: int):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_path(path: str, args, device, mesh) -> list:
    world = dist.get_world_size()
    cfg = block_config(args, world)
    bench = bench_block.Bench(cfg, path, args.backend, device=device)  # the group's device, not the machine's
    ref_out = bench.step().detach()  # leaves the reference gradients on bench.block and bench.h
    ref_grads = {n: p.grad.clone() for n, p in bench.block.named_parameters()}
    ref_dh = bench.h.grad.clone()
    rows = []
    modes = (("single", 1, bench, None), ("TP", world, TensorParallelBlock(bench, mesh), check_tp),
             ("CP", world, ContextParallelBlock(bench), check_cp))
    for mode, degree, runner, check in modes:
        row = dict(path=path, mode=mode, degree=degree, world=world, batch=cfg.batch, seq=cfg.seq, heads=cfg.heads)
        if check is not None:
            for n, p in bench.block.named_parameters():  # the reference gradients, as the single step left them
                p.grad = ref_grads[n]
            bench.h.grad = ref_dh
            errs = check(runner, ref_out, bench)
            worst = max(errs, key=errs.get)
            row.update(max_rel_err=errs[worst], worst=worst, bound=BOUND[path], ok=errs[worst] <= BOUND[path],
                       errors=errs)
        row["step_ms"] = time_steps(runner.step, device, args.warmup, args.steps)
        if mode == "TP":
            row["fwd_collectives"] = runner.fwd_comms
        rows.append(row)
    del bench, modes
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def table(rows_by_rank) -> str:
    lines = [f"{'path':6} {'mode':6} {'W':>2} {'shape':>11} {'step ms':>9} {'(min..max rank)':>17} "
             f"{'fwd comm':>9} {'max err':>9} {'bound':>6} check"]
    for i, row in enumerate(rows_by_rank[0]):
        per_rank = [rows[i]["step_ms"] for rows in rows_by_rank]
        errs = [rows[i].get("max_rel_err") for rows in rows_by_rank]
        ok = [rows[i].get("ok") for rows in rows_by_rank]
        comm = row.get("fwd_collectives")
        comm_text = "-" if comm is None else str(sum(comm.values()))
        err_text = "-" if errs[0] is None else f"{max(errs):.2e}"
        check = "-" if ok[0] is None else ("ok" if all(ok) else "FAIL")
        lines.append(f"{row['path']:6} {row['mode']:6} {row['degree']:>2} {'B%dS%d' % (row['batch'], row['seq']):>11} "
                     f"{max(per_rank):9.3f} {min(per_rank):8.3f}..{max(per_rank):<8.3f} {comm_text:>9} "
                     f"{err_text:>9} {'-' if errs[0] is None else BOUND[row['path']]:>6} {check}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    device, made = init_distributed()
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("parallel_check: needs CUDA devices (use --smoke for the tiny CPU run)")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device.type, (world,))
    try:
        rows = []
        for path in args.paths:
            rows += run_path(path, args, device, mesh)
        gathered = [None] * world
        dist.all_gather_object(gathered, rows)
        failed = any(r.get("ok") is False for rows_r in gathered for r in rows_r)
        if rank == 0:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            print(f"parallel_check: {world} rank(s), {dist.get_backend()}, {name}, torch {torch.__version__}")
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"world": world, "backend": dist.get_backend(), "device": name,
                               "torch": torch.__version__, "ranks": gathered}, f, indent=1)
            print(table(gathered))
        return 1 if failed else 0
    finally:
        if made:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
