#!/usr/bin/env python
"""Train the MLA block's MXFP8 path and the pure-torch bf16 reference from one init on one data
stream, and compare their loss curves.

    python examples/train_compare.py --device cpu --steps 200                          # small config
    python examples/train_compare.py --device cuda --config deepseek --steps 200 --out gpu_out

Writes <out>/train_compare.png (both curves) and <out>/train_compare.json: per-path losses, step
times and chosen backends, the final losses and their relative difference
|L_mxfp8 - L_ref| / L_ref, both for the last step and for the mean of the last 10 steps (one step's
loss carries batch noise; the runs see the same batches, so the two readings usually agree). The
target is a relative difference within 2% on the last-10 mean (`within_target`).
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
    for path in paths:
        t0 = time.perf_counter()
        runs[path] = mla_block.train(cfg, path, args.steps, args.device, args.seed, args.quantize_grad, args.backend,
                                     args.max_seconds)
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
        "final_loss_mean_last10": {p: sum(runs[p]["losses"][-TAIL:]) / len(runs[p]["losses"][-TAIL:]) for p in paths},
        "initial_loss": {p: runs[p]["losses"][0] for p in paths},
    }
    if steps_done:
        summary["rel_diff_final"] = _rel(cand[steps_done - 1], ref[steps_done - 1])
        tail_c = sum(cand[steps_done - TAIL:steps_done]) / len(cand[steps_done - TAIL:steps_done])
        tail_r = sum(ref[steps_done - TAIL:steps_done]) / len(ref[steps_done - TAIL:steps_done])
        summary["rel_diff_mean_last10"] = _rel(tail_c, tail_r)
        summary["max_rel_diff_any_step"] = max(_rel(c, r) for c, r in zip(cand, ref))
    summary["target_rel_diff"] = TARGET_REL_DIFF
    summary["within_target"] = bool(steps_done == args.steps and summary.get("rel_diff_mean_last10", math.inf)
                                    <= TARGET_REL_DIFF)

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
          f"{'WITHIN' if summary['within_target'] else 'NOT within'} {TARGET_REL_DIFF:.0%}")
    return 0 if summary["within_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
