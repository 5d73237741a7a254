"""The machine's ceilings, measured once per run: device-to-device copy bandwidth and the bf16 cuBLAS
matmul rate. run_all.py runs this first and hands its JSON to every other script ($MXMLA_BENCH_PEAKS),
which divides an op's bytes by the bandwidth and its FLOPs by the rate to get `roofline_ms`.

    python benchmarks/bench_roofline.py [--json PATH]     # on the GPU
    python benchmarks/bench_roofline.py --smoke           # CPU: tiny buffers, numbers only to test the code

copy: dst.copy_(src) of a 512 MiB bf16 buffer; TB/s counts bytes read + written.
matmul: torch.matmul of bf16 [M, K] x [K, N] (cuBLAS), 8192^3 and DeepSeek's 16384 x 24576 x 1536;
the best TFLOP/s (2MNK / time) is the rate. Times: medians of triton.testing.do_bench(warmup=25, rep=100).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchlib  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="(the same measurement: it is short)")
    ap.add_argument("--smoke", action="store_true", help="runs on CPU: tiny buffers")
    benchlib.add_common_args(ap, tokens_axis=None)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    rec = benchlib.Recorder("roofline", args)

    def measure():
        rec.peaks = benchlib.measure_peaks(record=lambda **row: rec.row(op="roofline", **row))
        rec.note(f"roofline: copy {rec.peaks['copy_tbps']:.3f} TB/s, bf16 matmul {rec.peaks['bf16_tflops']:.1f} "
                 f"TFLOP/s ({rec.peaks['how']})")

    rec.run(measure)
    rec.finish([("op", "op", 9, ""), ("impl", "impl", 32, ""), ("shape", "shape", 26, ""), benchlib.MS,
                benchlib.TBPS, benchlib.TFLOPS])


if __name__ == "__main__":
    main()
