"""Whether the MXFP8-projection forward is bound by its host at DeepSeek-V3 shapes, and what one
launch for both dequantizations costs on the GPU against two.

    python tools/mla_q_mx_host_check.py

Per T (4096, 16384), two rounds (the first includes compilation): the flat dequantization of w
[24576, 1536] and x [T, 1536] in one launch (`dequantize_bf16_flat_many`) and in two, then the fused
forward through `dispatch.run` called eagerly and replayed from a CUDA graph (no host work per call).
An eager time above the replay's is host issue the GPU waited for. triton.testing.do_bench medians.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

import dispatch  # noqa: E402
from backends.triton.quantize import dequantize_bf16_flat, dequantize_bf16_flat_many  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    w = torch.randn(24576, 1536, device="cuda")
    w_row = dispatch.run("mxfp8_quantize", w.bfloat16(), axis=-1)
    for tokens in (4096, 16384):
        x_row = dispatch.run("mxfp8_quantize", torch.randn(tokens, 1536, device="cuda", dtype=torch.bfloat16), axis=-1)
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        cos, sin = torch.randn(tokens, 64, device="cuda"), torch.randn(tokens, 64, device="cuda")

        def one_launch():
            dequantize_bf16_flat_many([w_row, x_row], guard=(flag, [(10, 246), (10, 246)]))

        def two_launches():
            dequantize_bf16_flat(w_row, guard=(flag, 10, 246))
            dequantize_bf16_flat(x_row, guard=(flag, 10, 246))

        def forward():
            dispatch.run("mla_q_uproj_rope_quant", x_row, w_row, cos, sin)

        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        cases = (("flat, one launch", one_launch), ("flat, two launches", two_launches),
                 ("forward, eager", forward), ("forward, graph", graph.replay))
        for _round in range(2):
            for name, fn in cases:
                print(f"T{tokens} {name:20s} {triton.testing.do_bench(fn, warmup=25, rep=100):.4f} ms", flush=True)


if __name__ == "__main__":
    main()
