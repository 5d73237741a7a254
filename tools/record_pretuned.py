#!/usr/bin/env python
"""Record the autotuners' choices and the kernels compiled for the DeepSeek-V3 block on this GPU into
backends/triton/pretuned/<device>.json (backends/triton/pretuned.py) and <device>.compile.json
(backends/triton/compile_ahead.py).

    MXMLA_TRITON_PRETUNED=0 python tools/record_pretuned.py [--shapes B1S4096,B2S4096,B1S16384] [--out DIR]
    python tools/record_pretuned.py --what compile      # the compile lists only, tiles from the tables

Runs forward + backward of examples/mla_block.py's block on the mxfp8 and bf16 paths at each shape
(every autotuned kernel of those paths meets its DeepSeek-V3 keys), each under
compile_ahead.recording() as its own workload, then writes every registered autotuner's cache and the
workloads' launches. Run it with MXMLA_TRITON_PRETUNED=0 so that every choice is timed here; with the
tables on (the default), the recorded choices are kept and only keys they lack are timed and added.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402
import triton  # noqa: E402

from backends.triton import _common, compile_ahead, pretuned  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="B1S4096,B2S4096,B1S16384")
    ap.add_argument("--paths", default="mxfp8,bf16")
    ap.add_argument("--out", default=pretuned.DIR, help="folder for <device>.json and <device>.compile.json")
    ap.add_argument("--what", default="pretuned,compile", help="comma list of pretuned, compile")
    args = ap.parse_args(argv)
    what = set(args.what.split(","))
    if not what or what - {"pretuned", "compile"}:
        ap.error(f"--what: expected names from pretuned, compile, got {args.what!r}")
    if not torch.cuda.is_available():
        print("record_pretuned: needs CUDA (it records this GPU's choices)")
        return 2
    import bench_block as bb

    workloads = {}
    for shape in args.shapes.split(","):
        b, s = bb.parse_shape(shape)
        for path in args.paths.split(","):
            bench = bb.Bench(bb.block_config(b, s, False), path)
            _common.clear_fast_launches()  # every launch of this workload resolved (and noted) afresh
            with compile_ahead.recording() as launches:
                for _ in range(2):
                    bench.step()
                _common.wait_background_compiles()  # a gated fallback's ready launch is noted too
                bench.step()
            torch.cuda.synchronize()
            workloads[f"mla_block {path} B{b}S{s}"] = list(launches.values())
            del bench
            torch.cuda.empty_cache()
            print(f"{shape} {path}: done, {len(launches)} launches to compile ahead", flush=True)
    device = torch.cuda.get_device_name()
    os.makedirs(args.out, exist_ok=True)
    if "pretuned" in what:
        kernels = pretuned.record()
        path = os.path.join(args.out, pretuned.device_slug(device) + ".json")
        with open(path, "w") as f:
            json.dump({"device": device, "triton": triton.__version__, "torch": torch.__version__,
                       "shapes": args.shapes, "kernels": kernels}, f, indent=1, sort_keys=True)
        for name, rows in kernels.items():
            print(f"{len(rows):3d} keys  {name}")
        print(f"wrote {path}")
    if "compile" in what:
        path = os.path.join(args.out, pretuned.device_slug(device) + compile_ahead.SUFFIX)
        compile_ahead.write(path, device, workloads)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
