#!/usr/bin/env python
"""Train the MLA block's MXFP8 path and the pure-torch bf16 reference from one init on one data
stream, and compare their loss curves.

    python examples/train_compare.py --device cpu --steps 200                          # small config
    python examples/train_compare.py --device cuda --config deepseek --steps 200 --out gpu_out

Writes <out>/train_compare.png (both curves) and <out>/train_compare.json: per-path losses, step
times and chosen backends, the final losses and their relative difference
|L_mxfp8 - L_ref| / L_ref, both for the last step and for the mean of the last 10 steps, the task's
label-noise floor and each path's excess loss above it (one step's
loss carries batch noise; the runs see the same batches, so the two readings usually agree). The
target is a relative difference within 2% on the last-10 mean (`within_target`). With --max-seconds
the first path may stop early; the others then train as many steps, without a time limit
(`completed` is false).
--paths adds the bf16 path through the mxmla ops (e.g. --paths mxfp8,bf16,torch).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mla_block  # noqa: E402

TARGET_REL_DIFF = 0.02
TAIL = 10


def _mean(values) -> float:
    return sum(values) / len(values) if values else math.nan


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else math.inf


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mla_block.add_common_arguments(parser)
    parser.set_defaults(steps=200)
    parser.add_argument("--paths", default="mxfp8,torch",
                        help="comma-separated paths to train; the first is compared with the last (reference)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_out", help="output folder")
    args = parser.parse_args(argv)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    cfg = mla_block.config_from_args(args)
    os.makedirs(args.out, exist_ok=True)
    print(f"config {args.config}: {asdict(cfg)}; device {args.device}; paths {paths}; steps {args.steps}")

    runs = {}
    steps = args.steps
    for path in paths:
        t0 = time.perf_counter()
        budget = args.max_seconds if path == paths[0] else None  # the others must reach the same step
        runs[path] = mla_block.train(cfg, path, steps, args.device, args.seed, args.quantize_grad, args.backend,
                                     budget)
        # if the time budget stopped the candidate early, the others train as many steps, for a fair comparison
        steps = min(steps, len(runs[path]["losses"]))
        runs[path]["wall_seconds"] = time.perf_counter() - t0
        if args.device != "cpu" and torch.cuda.is_available():
            runs[path]["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        print(f"[{path}] backends: {runs[path]['backends'] or 'none (pure torch)'}; "
              f"{runs[path]['wall_seconds']:.1f} s")

    candidate, reference = paths[0], paths[-1]
    cand, ref = runs[candidate]["losses"], runs[reference]["losses"]
    steps_done = min(len(cand), len(ref))
    summary = {
        "candidate": candidate,
        "reference": reference,
        "steps_requested": args.steps,
        "steps_done": steps_done,
        "final_loss": {p: runs[p]["losses"][-1] for p in paths},
        "final_loss_mean_last10": {p: _mean(runs[p]["losses"][-TAIL:]) for p in paths},
        "initial_loss": {p: runs[p]["losses"][0] for p in paths},
    }
    if steps_done:
        summary["rel_diff_final"] = _rel(cand[steps_done - 1], ref[steps_done - 1])
        tail = slice(max(0, steps_done - TAIL), steps_done)
        summary["rel_diff_mean_last10"] = _rel(_mean(cand[tail]), _mean(ref[tail]))
        summary["max_rel_diff_any_step"] = max(_rel(c, r) for c, r in zip(cand, ref))
        # the label noise's floor (the same batches for every path): what is left above it is learnable
        floor = _mean(runs[reference]["loss_floor"][tail])
        summary["loss_floor_mean_last10"] = floor
        summary["excess_over_floor_last10"] = {p: _mean(runs[p]["losses"][tail]) - floor for p in paths}
    summary["target_rel_diff"] = TARGET_REL_DIFF
    summary["completed"] = steps_done == args.steps
    summary["within_target"] = bool(summary.get("rel_diff_mean_last10", math.inf) <= TARGET_REL_DIFF)

    png = os.path.join(args.out, "train_compare.png")
    title = (f"MLA block {args.config} (H {cfg.heads}, hidden {cfg.hidden}, T {cfg.tokens}): "
             f"{candidate} vs {reference}, rel diff {summary.get('rel_diff_mean_last10', math.nan):.2%}")
    summary["plot"] = mla_block.plot_losses({p: runs[p]["losses"] for p in paths}, png, title)
    result = {"summary": summary, "config_name": args.config, "config": asdict(cfg), "device": str(args.device),
              "seed": args.seed, "runs": runs}
    with open(os.path.join(args.out, "train_compare.json"), "w") as f:
        json.dump(result, f, indent=1)

    print(f"plot: {png} ({summary['plot']})")
    print(f"train_compare: {args.config} {steps_done}/{args.steps} steps; final loss "
          + ", ".join(f"{p} {summary['final_loss'][p]:.5f}" for p in paths)
          + f"; rel diff last-10 mean {summary.get('rel_diff_mean_last10', math.nan):.3%} "
          f"(final step {summary.get('rel_diff_final', math.nan):.3%}); "
          f"noise floor {summary.get('loss_floor_mean_last10', math.nan):.5f}, excess over it "
          + ", ".join(f"{p} {v:.5f}" for p, v in summary.get("excess_over_floor_last10", {}).items()) + "; "
          f"{'WITHIN' if summary['within_target'] else 'NOT within'} {TARGET_REL_DIFF:.0%}"
          + ("" if summary["completed"] else " (time budget: fewer steps than requested)"))
    return 0 if summary["within_target"] and summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
