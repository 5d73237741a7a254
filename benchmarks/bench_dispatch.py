"""Cached dispatch overhead: dispatch.run(op, ...) against calling the chosen backend's function.

Reports microseconds per call for a few ops with typical argument lists (tensors, an MXTensor,
keyword arguments). Run on the CI machine: `python benchmarks/bench_dispatch.py`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import timeit

import torch

import backends
import dispatch


def _noop(*args, **kwargs):
    return None


def overhead_us(op, args, kwargs, repeat=15, number=2000):
    """Time run() and a direct call with the chosen implementation's function replaced by a no-op in
    the selection cache, so the difference is the dispatcher's own cost and not the op's noise."""
    backends.load()
    impl = dispatch._select(op, None, args, kwargs)  # fills the cache entry run() will hit
    for key, cached in list(dispatch._cache.items()):
        if cached is impl:
            dispatch._cache[key] = dataclasses.replace(impl, fn=_noop)
    direct = lambda: _noop(*args, **kwargs)  # noqa: E731
    routed = lambda: dispatch.run(op, *args, **kwargs)  # noqa: E731
    select_only = lambda: dispatch._select(op, None, args, kwargs)  # noqa: E731
    t_direct = min(timeit.repeat(direct, repeat=repeat, number=number)) / number * 1e6
    t_routed = min(timeit.repeat(routed, repeat=repeat, number=number)) / number * 1e6
    t_select = min(timeit.repeat(select_only, repeat=repeat, number=number)) / number * 1e6
    return impl.backend, t_direct, t_routed, t_select


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    mx = dispatch.run("mxfp8_quantize", x, axis=-1)
    cos, sin = torch.randn(64, 64), torch.randn(64, 64)
    xr = torch.randn(32, 2, 192, dtype=torch.bfloat16)
    cases = [
        ("mxfp8_quantize", (x,), {"axis": -1}),
        ("mxfp8_dequantize", (mx,), {}),
        ("rope", (xr, cos, sin), {"style": "mla", "layout": "thd"}),
    ]
    rows = []
    number = 500 if args.quick else 2000
    for op, a, kw in cases:
        backend, t_direct, t_routed, t_select = overhead_us(op, a, kw, number=number)
        rows.append({"op": op, "impl": f"dispatch->{backend}", "ms": t_routed / 1e3,
                     "overhead_us": t_routed - t_direct, "select_us": t_select, "direct_us": t_direct})
    print("Cached dispatch overhead per call (implementation replaced by a no-op; min of 15 repeats)")
    print(f"{'op':18} {'backend':8} {'direct us':>10} {'run us':>10} {'overhead us':>12} {'select us':>10}")
    for r in rows:
        print(f"{r['op']:18} {r['impl'][10:]:8} {r['direct_us']:10.2f} {r['ms']*1e3:10.2f} "
              f"{r['overhead_us']:12.2f} {r['select_us']:10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
