"""The backward pre-pass (RoPE backward + both quantizations, bf16 dequantized out) at DeepSeek-V3's
[T, 128 * 192], on CUDA: the general pre-pass kernel (mla_q._grad_prep_kernel, its [32, 64] tile) and
the per-head kernel (mla_q_prepass) at several launch shapes (mla_q_prepass.Tile: tokens, heads, warps,
grid order), all timed in turns with a device copy of g, whose bandwidth each pass's (6 bytes an element
moved) is quoted against; bytes and guard compared with the general kernel's. Prints a table.

    python3 tools/sweep_prepass.py [--tokens 4096[,16384]]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import torch  # noqa: E402

import backends  # noqa: E402
import backends.triton.mla_q as mla  # noqa: E402
import backends.triton.mla_q_prepass as prepass  # noqa: E402
import benchlib  # noqa: E402

T = prepass.Tile
TILES = [T(32, 1, 2), T(32, 1, 2, True), T(32, 2, 2), T(32, 2, 2, True), T(32, 4, 2), T(32, 1, 1), T(32, 2, 1),
         T(32, 1, 4), T(64, 1, 2), T(64, 1, 4), T(64, 2, 4)]


def sweep(t):
    n = 128 * 192
    dq = torch.randn(t, n, device="cuda").to(torch.bfloat16)
    cos, sin = torch.rand(t, 64, device="cuda"), torch.rand(t, 64, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.empty_like(dq)
    moved = dq.numel() * 2 * 3  # read g, write two bf16 tensors

    def general():
        mla.PREPASS_HEADS_KERNEL = False
        try:
            return mla._prep_launch(dq, cos, sin, rope=True, row_dq=True, col_dq=True, flag=flag)
        finally:
            mla.PREPASS_HEADS_KERNEL = True

    def heads(tile):
        row, col = torch.empty_like(dq), torch.empty_like(dq)

        def run():
            prepass.prepass_dequantized(dq, cos, sin, flag, row, col, True, tile)
            return row, col

        return run

    want = [g.clone() for g in general()]
    runs = {"general [32, 64] / 2 warps": general}
    same = {"general [32, 64] / 2 warps": True}
    for tile in TILES:
        name = f"per-head {tuple(tile)}"
        run = heads(tile)
        got = run()
        torch.cuda.synchronize()
        same[name] = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, want))
        runs[name] = run
    times = benchlib.interleaved_ms({"copy": lambda: out.copy_(dq), **runs})
    copy_bw = 4 * dq.numel() / times.pop("copy") / 1e9
    print(f"T={t}: device copy {copy_bw:.2f} TB/s (read + write of g), guard {int(flag.item())}")
    print(f"{'kernel':>34} {'ms':>8} {'TB/s':>6} {'of copy':>8} same-bytes")
    for name, ms in times.items():
        bw = moved / ms / 1e9
        print(f"{name:>34} {ms:8.4f} {bw:6.2f} {bw / copy_bw:8.3f} {same[name]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096")
    args = ap.parse_args()
    backends.load()
    for t in (int(v) for v in args.tokens.split(",")):
        sweep(t)


if __name__ == "__main__":
    main()
