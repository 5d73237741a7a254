"""The backward pre-pass (RoPE backward + both quantizations, bf16 dequantized out) at DeepSeek-V3's
[T, 128 * 192] per tile shape, against a device copy of the same bytes, on CUDA; prints a table.

    python3 tools/sweep_prepass.py [--tokens 4096]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton.testing  # noqa: E402

import backends  # noqa: E402
import backends.triton.mla_q as mla  # noqa: E402

TILES = [(32, 2), (32, 1), (32, 4), (64, 2), (64, 4), (128, 4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    backends.load()
    t, n = args.tokens, 128 * 192
    dq = torch.randn(t, n, device="cuda").to(torch.bfloat16)
    cos, sin = torch.rand(t, 64, device="cuda"), torch.rand(t, 64, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    src = torch.empty(t * n * 3, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    moved = dq.numel() * 2 * 3  # read g, write two bf16 tensors
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src[: dst.numel()]), warmup=25, rep=200)
    copy_bw = 2 * src.numel() * 2 / copy_ms / 1e9  # read + write bytes per ms -> TB/s
    want = None
    rows = []
    for tile in TILES:
        mla._PREP_DQ_TILE = tile
        run = lambda: mla._prep_launch(dq, cos, sin, rope=True, row_dq=True, col_dq=True, flag=flag)  # noqa: E731
        got = run()
        torch.cuda.synchronize()
        if want is None:
            want = [g.clone() for g in got]
        same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, want))
        ms = triton.testing.do_bench(run, warmup=25, rep=200)
        rows.append((tile, ms, moved / ms / 1e9, same))
    print(f"device copy: {copy_ms:.4f} ms for {2 * src.numel() * 2 / 1e9:.2f} GB moved = {copy_bw:.2f} TB/s")
    print(f"{'tile':>10} {'ms':>8} {'TB/s':>6} {'of copy':>8} same-bytes  (T={t}, flag={int(flag.item())})")
    for tile, ms, bw, same in rows:
        print(f"{str(tile):>10} {ms:8.4f} {bw:6.2f} {bw / copy_bw:8.3f} {same}")


if __name__ == "__main__":
    main()
