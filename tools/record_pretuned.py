#!/usr/bin/env python
"""Record the kernels the DeepSeek-V3 block compiles on this GPU's architecture into
backends/triton/pretuned/<arch>.compile.json (backends/triton/compile_ahead.py), and optionally the
autotuners' choices into <device>.json (backends/triton/pretuned.py).

    python tools/record_pretuned.py [--shapes B1S4096,B1S16384] [--out DIR]            # compile lists
    MXMLA_TRITON_AUTOTUNE=1 MXMLA_TRITON_PRETUNED=0 python tools/record_pretuned.py --what pretuned,compile

Runs forward + backward of examples/mla_block.py's block on the mxfp8, bf16 and mxfp8-compile paths
(the compiled graph launches kernels the eager path does not: the attention backward's
dequantizations) at each shape, and of transformers' DeepseekV3Attention patched to mxfp8 (where
transformers is installed), each under compile_ahead.recording() as its own workload ("<model> <path>
<shape>": compile_ahead opens the workloads of one path together, by that name's second word, a
compiled path with its eager one). Then it writes the workloads' launches, and the kernels a workload
launched that the recording could not note (printed as NOT recorded, kept under the list's
"not_recorded": they compile at their first launch in every process). The lists match
launches by what Triton specializes on, not by shape, so a few shapes cover every token and head
count; they are recorded at two token counts because the heuristic tiles of some kernels change with
the token count (rmsnorm's programs per band). A table of tile choices (--what pretuned) needs the
autotuners to time (MXMLA_TRITON_AUTOTUNE=1; with MXMLA_TRITON_PRETUNED=0 every choice is timed here)
and pays only where the heuristic tiles (backends/triton/tile_choice.py) lose on that GPU.
"""
import argparse
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402
import triton  # noqa: E402

from backends import settings  # noqa: E402
from backends.triton import _common, compile_ahead, pretuned  # noqa: E402


def _record(name: str, step, workloads: dict, gaps: dict) -> None:
    _common.clear_fast_launches()  # every launch of this workload resolved (and noted) afresh
    with compile_ahead.recording() as rec:
        for _ in range(2):
            step()
        _common.wait_background_compiles()  # a gated fallback's ready launch is noted too
        step()
    torch.cuda.synchronize()
    workloads[name] = list(rec.launches.values())
    if rec.skipped:
        gaps[name] = dict(rec.skipped)
    torch.cuda.empty_cache()
    print(f"{name}: done, {len(rec.launches)} launches to compile ahead", flush=True)
    for kernel, why in rec.skipped.items():
        print(f"{name}: NOT recorded, compiles at its first launch: {kernel}: {why}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="B1S4096,B1S16384")
    ap.add_argument("--paths", default="mxfp8,bf16,mxfp8-compile")
    ap.add_argument("--no-hf", action="store_true", help="skip the patched transformers attention workload")
    ap.add_argument("--out", default=pretuned.DIR, help="folder for <arch>.compile.json and <device>.json")
    ap.add_argument("--what", default="compile", help="comma list of pretuned, compile")
    args = ap.parse_args(argv)
    what = set(args.what.split(","))
    if not what or what - {"pretuned", "compile"}:
        ap.error(f"--what: expected names from pretuned, compile, got {args.what!r}")
    if "pretuned" in what and not settings.flag("MXMLA_TRITON_AUTOTUNE"):
        ap.error("--what pretuned records what autotuning chose: run with MXMLA_TRITON_AUTOTUNE=1")
    if not torch.cuda.is_available():
        print("record_pretuned: needs CUDA (it records this GPU's compilations)")
        return 2
    import bench_block as bb
    import first_step

    workloads, gaps, failed = {}, {}, []

    def attempt(name, build):
        # one workload's failure is reported and leaves the others' launches to be written
        try:
            _record(name, build(), workloads, gaps)
        except Exception:  # noqa: BLE001 -- reported below, and the exit status says so
            traceback.print_exc()
            failed.append(name)
            print(f"{name}: FAILED, not recorded", flush=True)

    for shape in args.shapes.split(","):
        b, s = bb.parse_shape(shape)
        for path in args.paths.split(","):
            attempt(f"mla_block {path} B{b}S{s}", lambda: bb.Bench(bb.block_config(b, s, False), path).step)
    if not args.no_hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("transformers is not installed: no patched-attention workload", flush=True)
        else:
            attempt("hf_attention mxfp8 B1S4096", lambda: first_step._hf_step(first_step.CASES["hf"], smoke=False))
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
        arch = compile_ahead.arch(torch.cuda.current_device())
        path = os.path.join(args.out, arch + compile_ahead.SUFFIX)
        compile_ahead.write(path, arch, device, workloads, gaps)
        print(f"wrote {path}")
    if failed:
        print(f"not recorded (see the tracebacks above): {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
