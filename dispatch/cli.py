"""The `mxmla` command: `mxmla info`, `mxmla check` and `mxmla bench`."""
from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

from spec.constants import OPS

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFORMANCE_DIR = REPO_ROOT / "tests" / "conformance"
BENCH_RUNNER = REPO_ROOT / "benchmarks" / "run_all.py"


def _device_line() -> str:
    try:
        import torch
    except ImportError:
        return "torch not installed"
    if torch.cuda.is_available():
        i = torch.cuda.current_device()
        cc = torch.cuda.get_device_capability(i)
        return f"{torch.cuda.get_device_name(i)} (sm{cc[0]}{cc[1]}), torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"CPU only ({platform.processor() or platform.machine()}), torch {torch.__version__}"


def _sample_call(op: str, device: str):
    """A small, valid DeepSeek-shaped call for `op` on `device`, for `mxmla info`'s selection column."""
    import torch

    import dispatch

    g = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    T, H, K = 128, 2, 1536
    if op in ("mxfp8_quantize", "rmsnorm_mxfp8"):
        x = randn(T, K)
        return ((x,), {}) if op == "mxfp8_quantize" else ((x, randn(K, dtype=torch.float32)), {})
    mx = dispatch.run("mxfp8_quantize", randn(T, K), axis=-1, backend="spec")
    if op in ("mxfp8_dequantize", "swizzle_scales"):
        return (mx,), {}
    if op == "unswizzle_scales":
        return (dispatch.run("swizzle_scales", mx, backend="spec"),), {}
    cos, sin = randn(T, 64, dtype=torch.float32), randn(T, 64, dtype=torch.float32)
    if op in ("rope", "rope_backward"):
        return (randn(T, H, 192), cos, sin), {"layout": "thd"}
    if op == "mxfp8_gemm":
        return (mx, dispatch.run("mxfp8_quantize", randn(256, K), axis=-1, backend="spec")), {}
    if op == "mla_q_uproj_rope_quant":
        return (randn(T, K), randn(H * 192, K), cos, sin), {}
    if op == "mla_q_uproj_rope_quant_backward":
        return (randn(T, H, 192), randn(T, K), randn(H * 192, K), cos, sin), {}
    q, k, v = randn(1, T, H, 192), randn(1, T, H, 192), randn(1, T, H, 128)
    if op == "mla_attention":
        return (q, k, v), {"causal": True}
    o, lse = dispatch.run("mla_attention", q, k, v, causal=True, backend="spec")
    return (randn(1, T, H, 128), q, k, v, o, lse), {"causal": True}


def cmd_info(args) -> int:
    import dispatch

    print(f"mxmla on Python {platform.python_version()}: {_device_line()}")
    print(f"MXMLA_BACKEND={os.environ.get('MXMLA_BACKEND', '(unset)')}\n")
    print(f"{'backend':8} {'available':9} {'version':18} ops / why not")
    for b in dispatch.backends():
        detail = f"{len(b['ops'])} ops" if b["available"] else "; ".join(b["reasons"])
        print(f"{b['backend']:8} {str(b['available']):9} {b['version'][:18]:18} {detail}")
    import torch

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        print(f"\nAutomatic selection on {device} (a small DeepSeek-shaped call per op):")
        for op in OPS:
            try:
                a, kw = _sample_call(op, device)
                rows = dispatch.explain(op, *a, print_table=False, **kw)
            except Exception as exc:  # noqa: BLE001 - info must report, not crash
                print(f"  {op:32} could not build a sample call: {type(exc).__name__}: {exc}")
                continue
            chosen = next((r["backend"] for r in rows if r["chosen"]), "NONE")
            rejected = [f"{r['backend']}: {'; '.join(r['reasons'])}" for r in rows if r["reasons"]]
            print(f"  {op:32} -> {chosen}")
            if args.verbose:
                for line in rejected:
                    print(f"      rejected {line}")
    if not args.verbose:
        print("\n(`mxmla info -v` lists every rejected backend with its reasons)")
    return 0


class _TablePlugin:
    """Collects pytest outcomes as op x (backend-device) cells."""

    def __init__(self):
        self.cells = {}
        self.targets = {}

    def pytest_collection_modifyitems(self, items):
        for item in items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            if "target" in params:
                self.targets[item.nodeid] = "-".join(params["target"])

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and not (report.when == "setup" and report.outcome != "passed"):
            return
        from tests.conformance.conftest import OPS_BY_TEST

        target = self.targets.get(report.nodeid, "any")
        ops = OPS_BY_TEST.get(report.nodeid) or {f"({Path(report.fspath).stem} other)"}
        for op in ops:
            cell = self.cells.setdefault((op, target), {"passed": 0, "failed": 0, "skipped": 0, "first": ""})
            cell[report.outcome] += 1
            if report.outcome != "passed" and not cell["first"]:
                text = report.longreprtext.strip().splitlines()
                cell["first"] = (text[-1] if text else "")[:160]


def cmd_check(args) -> int:
    import pytest

    if not CONFORMANCE_DIR.is_dir():
        print(f"mxmla check: conformance suite not found at {CONFORMANCE_DIR} (install from a source checkout)")
        return 2
    sys.path.insert(0, str(REPO_ROOT))
    keys = []
    if args.backend:
        keys.append(" or ".join(f"{b}-" for b in args.backend.split(",")))
    if args.device:
        keys.append(" or ".join(f"-{d}" for d in args.device.split(",")))
    if args.op:
        keys.append(" or ".join(args.op.split(",")))
    argv = [str(CONFORMANCE_DIR), "-p", "no:cacheprovider", "-q" if not args.verbose else "-v", "-rN"]
    if keys:
        argv += ["-k", " and ".join(f"({k})" for k in keys)]
    plugin = _TablePlugin()
    rc = pytest.main(argv, plugins=[plugin])
    targets = sorted({t for _, t in plugin.cells})
    ops = [op for op in OPS if any(o == op for o, _ in plugin.cells)]
    ops += sorted({o for o, _ in plugin.cells} - set(ops))
    print("\nmxmla check: op x backend (pass / FAIL with first mismatch / skip with reason)")
    width = max([len(o) for o in ops] + [10])
    print(f"{'op':{width}} " + " ".join(f"{t:14}" for t in targets))
    notes = []
    for op in ops:
        row = []
        for t in targets:
            c = plugin.cells.get((op, t))
            if c is None:
                row.append("-")
            elif c["failed"]:
                row.append(f"FAIL {c['failed']}/{sum(v for k, v in c.items() if k != 'first')}")
                notes.append(f"  {op} on {t}: {c['first']}")
            elif c["passed"]:
                row.append(f"pass {c['passed']}" + (f" ({c['skipped']} skip)" if c["skipped"] else ""))
            else:
                row.append("skip")
                notes.append(f"  {op} on {t}: skipped: {c['first']}")
        print(f"{op:{width}} " + " ".join(f"{r:14}" for r in row))
    if notes:
        print("\n".join(sorted(set(notes))))
    return int(rc)


def cmd_bench(bench_args) -> int:
    """Delegates to benchmarks/run_all.py of the source checkout (all its flags: `mxmla bench --help`)."""
    if not BENCH_RUNNER.is_file():
        print(f"mxmla bench: benchmark runner not found at {BENCH_RUNNER} (install from a source checkout)")
        return 2
    import importlib.util

    spec = importlib.util.spec_from_file_location("mxmla_bench_run_all", BENCH_RUNNER)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    return int(runner.main(list(bench_args)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mxmla", description="mxmla: MXFP8 MLA query path")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_info = sub.add_parser("info", help="device, backends, versions, and each op's automatic choice")
    p_info.add_argument("-v", "--verbose", action="store_true")
    p_check = sub.add_parser("check", help="run the conformance suite on this machine's backends")
    p_check.add_argument("--device", help="cpu, cuda (comma list)")
    p_check.add_argument("--backend", help="torch, triton, cudnn (comma list)")
    p_check.add_argument("--op", help="op names or module names (comma list), e.g. rope,quantize")
    p_check.add_argument("-v", "--verbose", action="store_true")
    # Every argument after `bench` goes to benchmarks/run_all.py (its own parser, its own --help).
    sub.add_parser("bench", add_help=False, help="run every benchmark under time caps: JSON, plots, one table "
                                                 "(mxmla bench --help)")
    args, rest = parser.parse_known_args(argv)
    if args.cmd == "bench":
        return cmd_bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return {"info": cmd_info, "check": cmd_check}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
