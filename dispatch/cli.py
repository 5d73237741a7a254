"""The `mxmla` command: `mxmla info`, `mxmla check` and `mxmla bench` (`mxmla --help` lists them)."""
from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

from spec.constants import OPS

from .version import package_version

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFORMANCE_DIR = REPO_ROOT / "tests" / "conformance"
BENCH_RUNNER = REPO_ROOT / "benchmarks" / "run_all.py"
SPEC_DIR = REPO_ROOT / "spec"

# What `mxmla check --backend / --device` can select: the (backend, device) targets of the conformance
# suite. The spec backend is the reference every target is compared with, so it is not a target.
CHECK_BACKENDS = ("torch", "triton", "cudnn")
CHECK_DEVICES = ("cpu", "cuda")
# Column of the tests that do not run once per backend-device (helpers, variant choice, a kernel
# launched directly): they belong to no single target.
NO_TARGET = "per file"

EXIT_CONFIG = 2  # a bad argument or environment variable, as argparse exits on a bad flag


class ConfigError(Exception):
    """A bad command-line value or environment variable; the message says what to fix."""


# --------------------------------------------------------------------------------------------------
# mxmla info
# --------------------------------------------------------------------------------------------------

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


def check_backend_variable() -> None:
    """Raise ConfigError when MXMLA_BACKEND does not parse, with the variable's grammar as the fix."""
    from .errors import DispatchConfigError
    from .policy import parse_policy

    value = os.environ.get("MXMLA_BACKEND")
    try:
        parse_policy(value)
    except DispatchConfigError as exc:
        raise ConfigError(
            f"MXMLA_BACKEND={value!r} is not valid: {exc}.\n"
            "Fix: unset it (automatic choice), or set one backend ('triton'), an ordered list ('triton,torch') "
            "or per-op entries ('mla_attention=cudnn;rope=torch;*=triton')."
        ) from None


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
    if op == "rmsnorm_backward":
        return (randn(T, K), randn(T, K), randn(K, dtype=torch.float32), randn(T, dtype=torch.float32).abs()), {}
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
    if op == "mla_kv_quantize":
        kv = randn(1, T, H, 256)
        return (kv[..., :128], randn(1, T, 1, 64), kv[..., 128:]), {}
    q, k, v = randn(1, T, H, 192), randn(1, T, H, 192), randn(1, T, H, 128)
    if op == "mla_attention":
        return (q, k, v), {"causal": True}
    o, lse = dispatch.run("mla_attention", q, k, v, causal=True, backend="spec")
    return (randn(1, T, H, 128), q, k, v, o, lse), {"causal": True}


def _is_environment_error(exc: BaseException) -> bool:
    """A backend switch read from the environment with a value outside its choices (its message
    names the variable)."""
    return isinstance(exc, ValueError) and str(exc).startswith("environment variable MXMLA_")


def cmd_info(args) -> int:
    import dispatch

    print(f"mxmla {package_version()} on Python {platform.python_version()}: {_device_line()}")
    print(f"MXMLA_BACKEND={os.environ.get('MXMLA_BACKEND', '(unset)')}")
    check_backend_variable()
    print(f"\n{'backend':8} {'available':9} {'version':18} ops / why not")
    for b in dispatch.backends():
        detail = f"{len(b['ops'])} ops" if b["available"] else "; ".join(b["reasons"])
        print(f"{b['backend']:8} {str(b['available']):9} {b['version'][:18]:18} {detail}")
    import torch

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    environment_errors, other_errors = set(), 0
    for device in devices:
        print(f"\nAutomatic selection on {device} (a small DeepSeek-shaped call per op):")
        for op in OPS:
            try:
                a, kw = _sample_call(op, device)
                rows = dispatch.explain(op, *a, print_table=False, **kw)
            except Exception as exc:  # noqa: BLE001 - info reports every op, then fails at the end
                if _is_environment_error(exc):
                    environment_errors.add(str(exc))
                else:
                    other_errors += 1
                print(f"  {op:32} could not select: {type(exc).__name__}: {exc}")
                continue
            chosen = next((r["backend"] for r in rows if r["chosen"]), "NONE")
            rejected = [f"{r['backend']}: {'; '.join(r['reasons'])}" for r in rows if r["reasons"]]
            print(f"  {op:32} -> {chosen}")
            if args.verbose:
                for line in rejected:
                    print(f"      rejected {line}")
    if not args.verbose:
        print("\n(`mxmla info -v` lists every rejected backend with its reasons)")
    if environment_errors:
        raise ConfigError("\n".join(sorted(environment_errors))
                          + "\nFix: unset the variable or set one of the values listed.")
    if other_errors:
        print(f"\nmxmla info: {other_errors} sample call(s) failed (above)", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------------------------------
# mxmla check
# --------------------------------------------------------------------------------------------------

def _comma_list(text: str):
    return [s.strip() for s in text.split(",") if s.strip()]


def _op_modules():
    """Module names that group ops (quantize, rope, ...): spec/<module>.py of every op."""
    skip = {"__init__", "checks", "constants", "mxtensor"}
    return sorted(p.stem for p in SPEC_DIR.glob("*.py") if p.stem not in skip)


def check_selection(args):
    """The -k expression for `mxmla check`'s filters; ConfigError naming the valid values for a bad one."""
    # Test ids hold the target as "[torch-cpu-..." (the `target` fixture) or, in the files of one backend
    # (test_<module>_triton.py, test_<module>_cudnn.py), the device alone as "[cpu-...".
    keys = []
    for flag, given, valid, form in (("--backend", args.backend, CHECK_BACKENDS, "{0}- or _{0}"),
                                     ("--device", args.device, CHECK_DEVICES, "-{0} or [{0}-")):
        if given is None:
            continue
        names = _comma_list(given)
        bad = [n for n in names if n not in valid]
        if bad or not names:
            raise ConfigError(f"{flag}: unknown {flag[2:]} {', '.join(map(repr, bad)) or repr(given)}; "
                              f"valid: {', '.join(valid)} (comma list)")
        keys.append(" or ".join(form.format(n) for n in names))
    if args.op is not None:
        names = _comma_list(args.op)
        valid = list(OPS) + _op_modules()
        bad = [n for n in names if n not in valid]
        if bad or not names:
            raise ConfigError(f"--op: unknown op {', '.join(map(repr, bad)) or repr(args.op)}; "
                              f"valid ops: {', '.join(OPS)}; or modules: {', '.join(_op_modules())}")
        keys.append(" or ".join(names))
    return " and ".join(f"({k})" for k in keys)


def _reason(report) -> str:
    """One line of text for a skip or a failure (pytest keeps a skip as a (path, line, message) tuple)."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        text = str(longrepr[2])
        return text[len("Skipped: "):] if text.startswith("Skipped: ") else text
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", ""):
        return crash.message.strip().splitlines()[0]
    lines = report.longreprtext.strip().splitlines()
    return lines[-1] if lines else ""


class _TablePlugin:
    """Collects pytest outcomes as op x (backend-device) cells."""

    def __init__(self):
        self.cells = {}
        self.targets = {}
        self.param_ops = {}  # ops named by a test's parameters: where a test that skips before its op call goes

    def pytest_collection_modifyitems(self, items):
        for item in items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            named = {v for v in params.values() if isinstance(v, str) and v in OPS}
            if named:
                self.param_ops[item.nodeid] = named
            if "target" in params:
                self.targets[item.nodeid] = "-".join(params["target"])
            elif "triton_target" in params:  # the Triton-only files are parametrized by device alone
                self.targets[item.nodeid] = f"triton-{params['triton_target']}"

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and not (report.when == "setup" and report.outcome != "passed"):
            return
        from tests.conformance.conftest import OPS_BY_TEST

        target = self.targets.get(report.nodeid, NO_TARGET)
        ops = (OPS_BY_TEST.get(report.nodeid) or self.param_ops.get(report.nodeid)
               or {f"{Path(report.fspath).name}: other"})
        for op in ops:
            cell = self.cells.setdefault((op, target), {"passed": 0, "failed": 0, "skipped": 0,
                                                        "skip_reasons": {}, "first_failure": ""})
            cell[report.outcome] += 1
            if report.outcome == "skipped":
                why = _reason(report)
                cell["skip_reasons"][why] = cell["skip_reasons"].get(why, 0) + 1
            elif report.outcome == "failed" and not cell["first_failure"]:
                cell["first_failure"] = f"{report.nodeid.split('::')[-1]}: {_reason(report)}"[:200]


LEGEND = (
    "pass N: N tests passed (+ K skip: K more skipped) | FAIL F/N: F of N failed (first failure below)",
    "skip: every test skipped (reason below) | -: no such test",
    "Columns: backend-device targets, each compared with spec (bytes where spec is bit-exact);",
    f"'{NO_TARGET}': tests not run once per target (utilities, variant choice, kernels launched directly).",
    "Rows 'test_x.py: other': tests that skipped or failed before they called an op.",
)


def _column_order(target: str):
    """CPU columns first, then CUDA; torch, triton, cudnn within each; the per-file column last."""
    backend, _, device = target.partition("-")
    known = backend in CHECK_BACKENDS and device in CHECK_DEVICES
    return (not known, CHECK_DEVICES.index(device) if known else 0,
            CHECK_BACKENDS.index(backend) if known else 0, target)


def format_check_table(cells) -> str:
    targets = sorted({t for _, t in cells}, key=_column_order)
    ops = [op for op in OPS if any(o == op for o, _ in cells)]
    ops += sorted({o for o, _ in cells} - set(ops))
    width = max([len(o) for o in ops] + [10])
    colw = max([len(t) for t in targets] + [16])
    lines = ["mxmla check: each op on each backend-device, against spec", "",
             (f"{'op':{width}} " + " ".join(f"{t:{colw}}" for t in targets)).rstrip()]
    skipped, failures = {}, []
    for op in ops:
        row = []
        for t in targets:
            c = cells.get((op, t))
            if c is None:
                row.append("-")
                continue
            total = c["passed"] + c["failed"] + c["skipped"]
            if c["failed"]:
                row.append(f"FAIL {c['failed']}/{total}")
                failures.append(f"  {op} on {t}: {c['first_failure']}")
            elif c["passed"]:
                row.append(f"pass {c['passed']}" + (f" + {c['skipped']} skip" if c["skipped"] else ""))
            else:
                row.append("skip")
                for why in c["skip_reasons"]:
                    skipped.setdefault(why, []).append((op, t))
        lines.append(f"{op:{width}} " + " ".join(f"{r:{colw}}" for r in row).rstrip())
    lines += [""] + list(LEGEND)
    if failures:
        lines += ["", "Failures (first of each cell):"] + failures
    if skipped:
        lines += ["", "Skipped cells, by reason:"]
        for why, where in sorted(skipped.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            parts = []
            for t in sorted({c for _, c in where}, key=_column_order):
                named = [o for o, c in where if c == t]
                parts.append(f"{t}: all {len(named)} rows" if len(named) > 3 else f"{t}: {', '.join(named)}")
            lines.append(f"  {why} ({'; '.join(parts)})")
    return "\n".join(lines)


def cmd_check(args) -> int:
    import pytest

    if not CONFORMANCE_DIR.is_dir():
        print(f"mxmla check: conformance suite not found at {CONFORMANCE_DIR} (install from a source checkout)")
        return 2
    expression = check_selection(args)
    sys.path.insert(0, str(REPO_ROOT))
    argv = [str(CONFORMANCE_DIR), "-p", "no:cacheprovider", "-q" if not args.verbose else "-v", "-rN"]
    if expression:
        argv += ["-k", expression]
    plugin = _TablePlugin()
    rc = pytest.main(argv, plugins=[plugin])
    print()
    if not plugin.cells:
        print("mxmla check: no conformance test matched this selection")
        return int(rc)
    print(format_check_table(plugin.cells))
    return int(rc)


# --------------------------------------------------------------------------------------------------
# mxmla bench
# --------------------------------------------------------------------------------------------------

def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def cmd_warmup(args) -> int:
    """Compile and tune the query path's kernels for one shape (dispatch.warmup.mla_block)."""
    import torch

    from . import warmup

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("mxmla warmup: --device cuda, but CUDA is not available here", file=sys.stderr)
        return EXIT_CONFIG
    try:
        seconds = warmup.mla_block(args.seq, batch=args.batch, heads=args.heads, q_lora=args.q_lora, path=args.path,
                                   backend=args.backend, device=device)
    except ValueError as exc:
        print(f"mxmla warmup: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"mxmla warmup: {args.path} query path + attention, B{args.batch} S{args.seq} H{args.heads} "
          f"q_lora {args.q_lora} on {device}: {seconds:.1f} s")
    return 0


def cmd_bench(bench_args) -> int:
    """Delegates to benchmarks/run_all.py of the source checkout (all its flags: `mxmla bench --help`)."""
    if not BENCH_RUNNER.is_file():
        print(f"mxmla bench: benchmark runner not found at {BENCH_RUNNER} (install from a source checkout)")
        return 2
    # The repository's scripts time CUDA kernels; --smoke runs them at tiny shapes on the CPU, and a
    # --bench-dir of other scripts decides for itself what it needs.
    asks_help = any(a in ("-h", "--help") for a in bench_args)
    own_scripts = not any(a == "--bench-dir" or a.startswith("--bench-dir=") for a in bench_args)
    if own_scripts and not asks_help and "--smoke" not in bench_args and not _has_cuda():
        print("mxmla bench: timing needs a CUDA device and none is visible; on a CPU, "
              "`mxmla bench --smoke` runs every script at tiny shapes to check that they work.", file=sys.stderr)
        return EXIT_CONFIG
    import importlib.util

    spec = importlib.util.spec_from_file_location("mxmla_bench_run_all", BENCH_RUNNER)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    return int(runner.main(list(bench_args)))


# --------------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mxmla", description="mxmla: the DeepSeek-V3 MLA query path in MXFP8 -- conformance, "
                                  "backend selection and benchmarks on this machine.")
    parser.add_argument("--version", action="version", version=f"mxmla {package_version()}")
    sub = parser.add_subparsers(dest="cmd", metavar="{info,check,warmup,bench}")
    p_info = sub.add_parser("info", help="device, backends, versions, and each op's automatic choice")
    p_info.add_argument("-v", "--verbose", action="store_true", help="every rejected backend with its reasons")
    p_check = sub.add_parser("check", help="run the conformance suite on this machine's backends; "
                                           "print an op x backend table")
    p_check.add_argument("--device", help=f"{', '.join(CHECK_DEVICES)} (comma list)")
    p_check.add_argument("--backend", help=f"{', '.join(CHECK_BACKENDS)} (comma list)")
    p_check.add_argument("--op", help="op names or module names (comma list), e.g. rope,quantize")
    p_check.add_argument("-v", "--verbose", action="store_true", help="pytest's verbose output")
    p_warm = sub.add_parser("warmup", help="compile and tune the query path's kernels for a training shape "
                                           "ahead of the first step")
    p_warm.add_argument("--batch", type=int, default=1)
    p_warm.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    p_warm.add_argument("--heads", type=int, default=128, help="attention heads (per rank under tensor parallelism)")
    p_warm.add_argument("--q-lora", type=int, default=1536, help="q_lora_rank (the projection's input width)")
    p_warm.add_argument("--path", choices=("mxfp8", "bf16"), default="mxfp8")
    p_warm.add_argument("--backend", default=None, help="backend for every op (default: automatic)")
    p_warm.add_argument("--device", default=None, help="cuda (default where available) or cpu")
    # Every argument after `bench` goes to benchmarks/run_all.py (its own parser, its own --help).
    sub.add_parser("bench", add_help=False, help="run every benchmark under time caps: JSON, plots, one table "
                                                 "(needs CUDA; --smoke on a CPU; mxmla bench --help)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.cmd is None:
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        parser.print_help()
        return 0
    if args.cmd == "bench":
        return cmd_bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return {"info": cmd_info, "check": cmd_check, "warmup": cmd_warmup}[args.cmd](args)
    except ConfigError as exc:
        print(f"mxmla {args.cmd}: {exc}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
