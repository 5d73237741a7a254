"""Run every benchmark script on this machine, each in its own subprocess under its own time cap, and
gather the results: one combined JSON, PNG plots (time against tokens per op, one line per
implementation, the roofline dashed) and one table printed last.

    python benchmarks/run_all.py --quick --out bench_out           # or: mxmla bench --quick --out bench_out
    python benchmarks/run_all.py --tokens sweep --benches quantize,rope --out bench_out
    python benchmarks/run_all.py --smoke --no-plots                # CPU, TRITON_INTERPRET=1: checks the plumbing

Each benchmarks/bench_<name>.py runs as `python bench_<name>.py [--quick|--smoke] [--tokens ..]
[--no-compile] --json OUT/bench_<name>.json`. A script prints each row as it is measured
(a `BENCH_ROW {json}` line, see benchlib.py); at its cap it gets SIGINT, which the scripts turn into
"write the JSON of what was measured", and --grace seconds later the whole process group is killed.
Rows come from the script's JSON when it wrote one, else from the BENCH_ROW lines of its output, so
even a killed script keeps what it measured. bench_roofline.py runs first: its copy bandwidth and bf16
matmul rate reach the others through $MXMLA_BENCH_PEAKS, for the roofline_ms of every row.

Output in --out: bench_<name>.log and .json per script, results.json (every row with its bench, each
script's status, the peaks), plots/*.png (when matplotlib imports; otherwise a message says why not).
docs/BENCHMARKING.md explains the columns and the roofline.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import benchlib  # noqa: E402
import summarize  # noqa: E402

# Order of the run (a --budget that runs out cuts the end): the roofline first (the others read it), then
# the scripts with the fewest H200 numbers so far, then the rest. Scripts not named here run last.
ORDER = ("roofline", "mla_q", "gemm", "rmsnorm", "quantize", "rope", "attention", "attention_cudnn", "dispatch")
# Seconds per script (python and torch start-up, compile and autotune included).
CAPS_QUICK = dict(roofline=40, mla_q=120, gemm=60, rmsnorm=60, quantize=120, rope=50, attention=110,
                  attention_cudnn=60, dispatch=20)
CAPS_FULL = {k: 3 * v for k, v in CAPS_QUICK.items()}
CAP_SMOKE = 180  # CPU interpreter
CAP_OTHER = 60
PLOT_RESERVE_S = 15  # kept back from --budget for the plots and the table


def parse_caps(text: str) -> dict[str, float]:
    """'quantize=90,mla_q=120' or 'quantize=90 mla_q=120' -> {name: seconds}."""
    caps = {}
    for item in re.split(r"[,\s]+", text.strip()):
        if not item:
            continue
        name, sep, value = item.partition("=")
        try:
            caps[name] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--caps: expected NAME=SECONDS, got {item!r}") from None
        if not sep or caps[name] <= 0:
            raise argparse.ArgumentTypeError(f"--caps: expected NAME=SECONDS, got {item!r}")
    return caps


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="mxmla bench", description=" ".join(__doc__.split("\n\n")[0].split()),
                                 epilog="Columns, caps and the roofline: docs/BENCHMARKING.md")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="each script's --quick (the headline shapes)")
    mode.add_argument("--smoke", action="store_true", help="tiny shapes; CPU under TRITON_INTERPRET=1")
    ap.add_argument("--tokens", type=benchlib.parse_tokens,
                    help="token counts for every script with a token axis, comma list or 'sweep' "
                         f"(= {','.join(map(str, benchlib.SWEEP_TOKENS))})")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    ap.add_argument("--compile", action="store_true",
                    help="with --quick: keep the torch.compile baselines (--quick skips them: compiling them "
                         "takes longer than the 3-minute quick run)")
    ap.add_argument("--out", default="bench_out", help="folder for logs, JSON and plots (default: bench_out)")
    ap.add_argument("--benches", help="comma list of scripts to run (bench_<name>.py), in this order")
    ap.add_argument("--skip", help="comma list of scripts not to run")
    ap.add_argument("--cap", type=float, help="seconds per script, for every script (default: per script)")
    ap.add_argument("--caps", type=parse_caps, default={}, help="per-script caps, e.g. 'quantize=90,mla_q=120'")
    ap.add_argument("--budget", type=float, help="seconds for the whole run; caps shrink to fit, scripts that no "
                                                 "longer fit are skipped")
    ap.add_argument("--grace", type=float, default=15.0,
                    help="seconds between the cap's SIGINT and killing the script's process group (default 15)")
    ap.add_argument("--no-plots", action="store_true", help="no PNG plots")
    ap.add_argument("--quiet", action="store_true", help="do not echo the scripts' output (it is in the logs)")
    ap.add_argument("--commit", default=None, help="recorded in results.json (default: git rev-parse)")
    ap.add_argument("--bench-dir", default=str(HERE), help=argparse.SUPPRESS)  # tests point it at fakes
    return ap.parse_args(argv)


# --------------------------------------------------------------------------------------------------
# Scripts
# --------------------------------------------------------------------------------------------------

def discover(bench_dir: Path, only=None, skip=None) -> list[tuple[str, Path]]:
    found = {p.stem[len("bench_"):]: p for p in sorted(bench_dir.glob("bench_*.py"))}
    if only:
        missing = [n for n in only if n not in found]
        if missing:
            raise SystemExit(f"mxmla bench: no bench_<name>.py for {', '.join(missing)} in {bench_dir} "
                             f"(have: {', '.join(sorted(found))})")
        names = list(only)
    else:
        names = [n for n in ORDER if n in found] + sorted(n for n in found if n not in ORDER)
    return [(n, found[n]) for n in names if n not in (skip or ())]


def cap_for(name: str, args) -> float:
    if name in args.caps:
        return args.caps[name]
    if args.cap:
        return args.cap
    if args.smoke:
        return CAP_SMOKE
    return (CAPS_QUICK if args.quick else CAPS_FULL).get(name, CAP_OTHER)


def script_argv(script: Path, json_path: Path, args) -> list[str]:
    cmd = [sys.executable, "-u", str(script)]
    if args.quick:
        cmd.append("--quick")
    if args.smoke:
        cmd.append("--smoke")
    if args.tokens:
        cmd += ["--tokens", ",".join(map(str, args.tokens))]
    if args.no_compile or (args.quick and not args.compile):
        cmd.append("--no-compile")
    return cmd + ["--json", str(json_path)]


def short_row(row: dict) -> str:
    ms = row.get("ms")
    ms_text = f"{ms:.4f} ms" if isinstance(ms, (int, float)) else "-"
    return f"{row.get('op', '')} {row.get('shape', '')} | {row.get('impl', '')} | {ms_text}"


def run_script(name: str, script: Path, args, out: Path, cap: float, env: dict) -> dict:
    """Run one script under its cap; returns its status record with its rows."""
    json_path, log_path = out / f"bench_{name}.json", out / f"bench_{name}.log"
    if json_path.exists():
        json_path.unlink()  # a stale file from an earlier run must not pass for this one's
    cmd = script_argv(script, json_path, args)
    streamed: list[dict] = []
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=str(HERE.parent), env=env, start_new_session=True, text=True, bufsize=1,
                                errors="replace")

        def pump():
            for line in proc.stdout:
                try:
                    log.write(line)
                    log.flush()
                except ValueError:  # the log was closed: a leftover process kept the pipe open
                    return
                if line.startswith(benchlib.ROW_PREFIX):
                    try:
                        streamed.append(json.loads(line[len(benchlib.ROW_PREFIX):]))
                    except ValueError:
                        continue
                    if not args.quiet:
                        print(f"[{name}] row: {short_row(streamed[-1])}", flush=True)
                elif not args.quiet:
                    print(f"[{name}] {line}", end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        status, stop = "ok", False
        try:
            proc.wait(timeout=cap)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
            # At the cap, or when the runner itself is interrupted (Ctrl-C, `timeout -s INT`): the script
            # is in its own session, so the SIGINT is passed on by hand; the run then stops after it.
            stop = isinstance(exc, KeyboardInterrupt)
            status = "interrupted" if stop else "capped"
            _signal(proc.pid, signal.SIGINT, group=False)  # the script writes what it has
            try:
                proc.wait(timeout=args.grace)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                status = "killed"
                _signal(proc.pid, signal.SIGKILL, group=True)
                proc.wait()
        _signal(proc.pid, signal.SIGKILL, group=True)  # leftovers (compile workers) would hold the pipe open
        reader.join(timeout=10)
        seconds = time.monotonic() - start
        if status == "ok" and proc.returncode != 0:
            status = "failed"
        log.write(f"\n[run_all] {name}: {status}, rc={proc.returncode}, {seconds:.1f} s (cap {cap:.0f} s)\n")

    record = dict(bench=name, status=status, rc=proc.returncode, seconds=round(seconds, 1), cap_s=cap,
                  log=log_path.name, json=None, rows_from=None, interrupted=False, notes=[], stop=stop)
    rows = None
    if json_path.exists():
        try:
            data = json.loads(json_path.read_text())
            rows = data["rows"] if isinstance(data, dict) else data
            record.update(json=json_path.name, rows_from="json")
            if isinstance(data, dict):
                record["interrupted"] = bool(data.get("interrupted"))
                record["notes"] = data.get("notes") or []
                if data.get("peaks"):
                    record["peaks"] = data["peaks"]
        except (ValueError, KeyError, TypeError) as exc:
            record["json_error"] = f"{type(exc).__name__}: {exc}"
            rows = None
    if rows is None:
        rows = streamed
        record["rows_from"] = "stream" if streamed else None
    record["rows"] = [dict(r, bench=r.get("bench") or name) for r in rows if isinstance(r, dict)]
    return record


def _signal(pid: int, sig, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, sig)  # the script is its group's leader (start_new_session)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# --------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------

def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", str(text)).strip("_")[:60] or "x"


def plot_groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows with a token count and a time, grouped by (bench, op, family): one figure each. `family` is
    the shape without its token count; rows without one use their shape with the count cut out."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        tokens, ms = r.get("tokens"), r.get("ms")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or not isinstance(ms, (int, float)) or ms <= 0:
            continue
        family = r.get("family") or re.sub(rf"\b{tokens}\b", "T", str(r.get("shape", "")))
        groups.setdefault((r.get("bench", ""), r.get("op", ""), family), []).append(r)
    return groups


def make_plots(rows: list[dict], folder: Path) -> tuple[list[str], str]:
    """One PNG per (bench, op, family): ms against tokens (log-log), a line per impl, the roofline dashed
    (per token count the largest roofline_ms of the group's rows: the op's own bytes / FLOPs, not a
    baseline's smaller ones). Returns (paths, message)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except Exception as exc:  # noqa: BLE001 - plots are optional; the table and JSON stand alone
        return [], f"no plots: matplotlib is not importable here ({type(exc).__name__}: {exc})"
    groups = plot_groups(rows)
    if not groups:
        return [], "no plots: no row has a token count"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for (bench, op, family), members in sorted(groups.items()):
        fig, ax = plt.subplots(figsize=(9, 4.5))
        impls = []
        for r in members:
            if r.get("impl") not in impls:
                impls.append(r.get("impl"))
        for impl in impls:
            pts = sorted((r["tokens"], r["ms"]) for r in members if r.get("impl") == impl)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=str(impl))
        roof = {}
        for r in members:
            v = r.get("roofline_ms")
            if isinstance(v, (int, float)) and v > 0:
                roof[r["tokens"]] = max(v, roof.get(r["tokens"], 0.0))
        if roof:
            xs = sorted(roof)
            ax.plot(xs, [roof[x] for x in xs], linestyle="--", color="black", marker="", label="roofline")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sorted({r["tokens"] for r in members})
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t // 1024}K" if t % 1024 == 0 else str(t) for t in ticks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("tokens")
        ax.set_ylabel("ms (median)")
        ax.set_title(f"{bench}: {op}  {family}".strip(), fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        fig.tight_layout()
        path = folder / f"{_slug(bench)}__{_slug(op)}__{_slug(family)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths, f"{len(paths)} plots in {folder}"


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------

def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=str(HERE.parent), capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # heard even when started from a background job
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    split = lambda text: [s for s in re.split(r"[,\s]+", text or "") if s]  # noqa: E731
    scripts = discover(Path(args.bench_dir), split(args.benches), split(args.skip))
    commit = args.commit or git_commit()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), env.get("PYTHONPATH")) if p)
    env.pop(benchlib.PEAKS_ENV, None)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    print(f"mxmla bench ({mode}): {len(scripts)} scripts -> {out}; commit {commit}", flush=True)

    deadline = time.monotonic() + args.budget if args.budget else None
    runs, peaks, stopped = [], None, False
    for name, script in scripts:
        cap = cap_for(name, args)
        if stopped:
            runs.append(dict(bench=name, status="skipped (interrupted)", rc=None, seconds=0, cap_s=0, rows=[],
                             rows_from=None, notes=[]))
            continue
        if deadline is not None:
            left = deadline - time.monotonic() - PLOT_RESERVE_S - args.grace
            if left < 10:
                print(f"[{name}] skipped: the --budget is spent", flush=True)
                runs.append(dict(bench=name, status="skipped (budget)", rc=None, seconds=0, cap_s=0, rows=[],
                                 rows_from=None, notes=[]))
                continue
            cap = min(cap, left)
        print(f"== {name}: {script.name} (cap {cap:.0f} s)", flush=True)
        record = run_script(name, script, args, out, cap, env)
        stopped = record.pop("stop")
        runs.append(record)
        print(f"== {name}: {record['status']} in {record['seconds']} s, {len(record['rows'])} rows "
              f"(from {record['rows_from'] or 'nowhere'})", flush=True)
        if name == "roofline" and record.get("peaks") and record.get("json"):
            peaks = record["peaks"]
            env[benchlib.PEAKS_ENV] = str(out / record["json"])

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a few seconds more: the JSON, plots, table
    try:
        return report(args, out, commit, mode, runs, peaks, argv)
    finally:
        signal.signal(signal.SIGINT, previous)


def report(args, out: Path, commit: str, mode: str, runs: list[dict], peaks, argv) -> int:
    rows = [r for run in runs for r in run["rows"]]
    devices = sorted({str(r["device"]) for r in rows if r.get("device")})
    plots, plot_msg = ([], "no plots: --no-plots") if args.no_plots else make_plots(rows, out / "plots")
    results = dict(commit=commit, date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                   mode=mode, tokens=args.tokens, argv=sys.argv[1:] if argv is None else list(argv),
                   device=", ".join(devices), peaks=peaks,
                   runs=[{k: v for k, v in run.items() if k != "rows"} for run in runs],
                   rows=rows, plots=[os.path.relpath(p, out) for p in plots])
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))

    print()
    print(f"== mxmla bench summary: commit {commit}, {mode}, device {results['device'] or '?'} ==")
    if peaks:
        print(f"roofline: copy {peaks['copy_tbps']:.3f} TB/s, bf16 matmul {peaks['bf16_tflops']:.1f} TFLOP/s")
    for run in runs:
        flag = " (interrupted: rows so far)" if run.get("interrupted") else ""
        print(f"  {run['bench']:16} {run['status']:16} rc={run['rc']} {run['seconds']:>6} s  "
              f"{len(run['rows'])} rows from {run['rows_from'] or '-'}{flag}")
    print(plot_msg)
    print(f"results: {out / 'results.json'}")
    print()
    print("\n".join(summarize.table_lines(rows)))
    return 1 if any(run["status"] == "failed" for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
