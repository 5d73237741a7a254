"""Cached dispatch overhead: dispatch.run(op, ...) against calling the chosen backend's function.

Reports microseconds per call for a few ops with typical argument lists (tensors, an MXTensor,
keyword arguments). Run on the CI machine: `python benchmarks/bench_dispatch.py [--quick] [--smoke]`.
--smoke and --quick time fewer calls; --tokens and --no-compile are accepted and ignored (host-side
cost of a few small calls: no token axis, nothing compiled).
"""
from __future__ import annotations

import argparse
import os
import sys
import timeit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import backends  # noqa: E402
import benchlib  # noqa: E402
import dispatch  # noqa: E402


def _noop(*args, **kwargs):
    return None


def overhead_us(op, args, kwargs, repeat=15, number=2000):
    """Time run() and a direct call with the chosen implementation's function replaced by a no-op in
    the selection cache, so the difference is the dispatcher's own cost and not the op's noise."""
    backends.load()
    entry = dispatch._select(op, None, args, kwargs)  # fills the cache entry run() will hit
    _, impl, variant, check_values = entry
    for key, cached in list(dispatch._cache.items()):
        if cached is entry:
            dispatch._cache[key] = (_noop, impl, variant, check_values)
    direct = lambda: _noop(*args, **kwargs)  # noqa: E731
    routed = lambda: dispatch.run(op, *args, **kwargs)  # noqa: E731
    select_only = lambda: dispatch._select(op, None, args, kwargs)  # noqa: E731
    t_direct = min(timeit.repeat(direct, repeat=repeat, number=number)) / number * 1e6
    t_routed = min(timeit.repeat(routed, repeat=repeat, number=number)) / number * 1e6
    t_select = min(timeit.repeat(select_only, repeat=repeat, number=number)) / number * 1e6
    return impl.backend, t_direct, t_routed, t_select


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="500 calls per timing instead of 2000")
    ap.add_argument("--smoke", action="store_true", help="100 calls per timing, 3 repeats")
    benchlib.add_common_args(ap, tokens_axis=None)
    args = ap.parse_args()
    rec = benchlib.Recorder("dispatch", args)
    rec.run(measure, args, rec)
    rec.finish([("op", "op", 18, ""), ("impl", "impl", 16, ""), ("direct_us", "direct us", 10, ".2f"),
                (lambda r: r["ms"] * 1e3, "run us", 10, ".2f"), ("overhead_us", "overhead us", 12, ".2f"),
                ("select_us", "select us", 10, ".2f")])


def measure(args, rec):
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
    number = 100 if args.smoke else 500 if args.quick else 2000
    rec.note("Cached dispatch overhead per call (implementation replaced by a no-op; min of the repeats)")
    for op, a, kw in cases:
        backend, t_direct, t_routed, t_select = overhead_us(op, a, kw, repeat=3 if args.smoke else 7, number=number)
        rec.row(op=op, shape="", impl=f"dispatch->{backend}", ms=t_routed / 1e3, overhead_us=t_routed - t_direct,
                select_us=t_select, direct_us=t_direct, note="host time per call")


if __name__ == "__main__":
    main()
