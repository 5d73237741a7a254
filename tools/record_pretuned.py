#!/usr/bin/env python
"""Record the autotuners' choices for the DeepSeek-V3 block on this GPU into
backends/triton/pretuned/<device>.json (see backends/triton/pretuned.py).

    MXMLA_TRITON_PRETUNED=0 python tools/record_pretuned.py [--shapes B1S4096,B2S4096,B1S16384] [--out DIR]

Runs forward + backward of examples/mla_block.py's block on the mxfp8 and bf16 paths at each shape
(every autotuned kernel of those paths meets its DeepSeek-V3 keys), then writes every registered
autotuner's cache. Run it with MXMLA_TRITON_PRETUNED=0 so that every choice is timed here.
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

from backends.triton import pretuned  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="B1S4096,B2S4096,B1S16384")
    ap.add_argument("--paths", default="mxfp8,bf16")
    ap.add_argument("--out", default=pretuned.DIR, help="folder for <device>.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("record_pretuned: needs CUDA (it records this GPU's choices)")
        return 2
    import bench_block as bb

    for shape in args.shapes.split(","):
        b, s = bb.parse_shape(shape)
        for path in args.paths.split(","):
            bench = bb.Bench(bb.block_config(b, s, False), path)
            for _ in range(2):
                bench.step()
            torch.cuda.synchronize()
            del bench
            torch.cuda.empty_cache()
            print(f"{shape} {path}: done", flush=True)
    device = torch.cuda.get_device_name()
    kernels = pretuned.record()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, pretuned.device_slug(device) + ".json")
    with open(path, "w") as f:
        json.dump({"device": device, "triton": triton.__version__, "torch": torch.__version__,
                   "shapes": args.shapes, "kernels": kernels}, f, indent=1, sort_keys=True)
    for name, rows in kernels.items():
        print(f"{len(rows):3d} keys  {name}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
