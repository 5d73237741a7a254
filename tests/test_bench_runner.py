"""`mxmla bench` (benchmarks/run_all.py) and the bench scripts' plumbing, on CPU.

The runner is driven with fake bench scripts (tiny Python files: one that works, one that hangs and
takes the cap's SIGINT like the real scripts do, one that ignores SIGINT and is killed, one that
crashes); every real script's --smoke runs under TRITON_INTERPRET=1 in a subprocess with a time limit,
and one real script is interrupted mid-run to show its JSON keeps the rows measured so far.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import benchlib  # noqa: E402
import run_all  # noqa: E402
import summarize  # noqa: E402
from tests.util import triton_interpreter_unusable  # noqa: E402

FAKE_OK = """
import argparse, json
ap = argparse.ArgumentParser()
ap.add_argument("--json")
args, _ = ap.parse_known_args()
rows = []
for tokens in (1024, 2048):
    for impl, speed in (("fast", 1.0), ("slow", 3.0)):
        row = dict(op="fake op", shape=f"[{tokens},64]", family="[T,64]", tokens=tokens, impl=impl,
                   ms=speed * tokens / 1024, roofline_ms=0.5 * tokens / 1024, tbps=1.5, ratio=1 / speed, vs="fast")
        print("BENCH_ROW " + json.dumps(row), flush=True)
        rows.append(row)
json.dump(dict(bench="fake_ok", rows=rows, notes=["fine"]), open(args.json, "w"))
"""

# Like the real scripts: benchlib's Recorder turns the cap's SIGINT into a JSON of the rows so far.
FAKE_HANG = """
import argparse, sys, time
sys.path.insert(0, {bench_dir!r})
import benchlib
ap = argparse.ArgumentParser()
ap.add_argument("--json")
args, _ = ap.parse_known_args()
rec = benchlib.Recorder("fake_hang", args, device="fake device")
def measure():
    rec.row(op="fake op", shape="[1024,64]", family="[T,64]", tokens=1024, impl="hangs later", ms=2.0)
    time.sleep(600)  # a torch.compile that never returns
rec.run(measure)
rec.finish([("op", "op", 8, ""), ("impl", "impl", 12, ""), benchlib.MS])
"""

FAKE_STUBBORN = """
import json, signal, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # stuck where SIGINT cannot reach Python
row = dict(op="fake op", shape="[2048,64]", tokens=2048, impl="stubborn", ms=4.0)
print("BENCH_ROW " + json.dumps(row), flush=True)
time.sleep(600)
"""

FAKE_CRASH = """
import json
print("BENCH_ROW " + json.dumps(dict(op="other op", shape="[1024,8]", tokens=1024, impl="crashes", ms=1.0)), flush=True)
raise RuntimeError("boom")
"""


def write_fakes(folder: Path, names=("ok", "hang", "stubborn", "crash")) -> Path:
    sources = {"ok": FAKE_OK, "hang": FAKE_HANG.format(bench_dir=str(BENCH_DIR)), "stubborn": FAKE_STUBBORN,
               "crash": FAKE_CRASH}
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / f"bench_fake_{name}.py").write_text(textwrap.dedent(sources[name]))
    return folder


def table_of(text: str) -> list[str]:
    """The markdown table at the end of the runner's output."""
    lines = text.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("| bench |"))
    return lines[start:]


def test_parse_tokens_and_caps():
    assert benchlib.parse_tokens("1024, 4096") == [1024, 4096]
    assert benchlib.parse_tokens("sweep") == [1024, 2048, 4096, 8192, 16384, 32768]
    for bad in ("", "12,x", "0"):
        with pytest.raises(Exception):
            benchlib.parse_tokens(bad)
    assert run_all.parse_caps("quantize=90,mla_q=120 rope=5.5") == {"quantize": 90, "mla_q": 120, "rope": 5.5}
    with pytest.raises(Exception):
        run_all.parse_caps("quantize")


def test_roofline_is_the_slower_of_bandwidth_and_compute():
    peaks = dict(copy_tbps=4.0, bf16_tflops=800.0)
    assert benchlib.roofline_ms(peaks, nbytes=4e9) == pytest.approx(1.0)  # 4 GB at 4 TB/s
    assert benchlib.roofline_ms(peaks, flops=8e11) == pytest.approx(1.0)  # 0.8 PFLOP at 800 TFLOP/s
    assert benchlib.roofline_ms(peaks, nbytes=4e9, flops=1.6e12) == pytest.approx(2.0)
    assert benchlib.roofline_ms(None, nbytes=1) is None and benchlib.roofline_ms(peaks) is None


def test_runner_collects_ok_capped_killed_and_crashed(tmp_path, capsys):
    fakes = write_fakes(tmp_path / "fakes")
    out = tmp_path / "out"
    start = time.monotonic()
    rc = run_all.main(["--bench-dir", str(fakes), "--out", str(out), "--cap", "30",
                       "--caps", "fake_hang=5,fake_stubborn=3", "--grace", "2", "--no-plots", "--quiet",
                       "--commit", "test"])
    elapsed = time.monotonic() - start
    text = capsys.readouterr().out
    assert rc == 1, "a crashed script makes the run fail"
    assert elapsed < 25, f"the caps did not hold: {elapsed:.1f} s"

    results = json.loads((out / "results.json").read_text())
    runs = {r["bench"]: r for r in results["runs"]}
    assert runs["fake_ok"]["status"] == "ok" and runs["fake_ok"]["rows_from"] == "json"
    assert runs["fake_hang"]["status"] == "capped" and runs["fake_hang"]["rows_from"] == "json"
    assert runs["fake_hang"]["interrupted"] is True
    assert runs["fake_stubborn"]["status"] == "killed" and runs["fake_stubborn"]["rows_from"] == "stream"
    assert runs["fake_crash"]["status"] == "failed" and runs["fake_crash"]["rc"] != 0
    assert runs["fake_crash"]["rows_from"] == "stream"
    assert "RuntimeError: boom" in (out / "bench_fake_crash.log").read_text()

    by_bench = {}
    for row in results["rows"]:
        by_bench.setdefault(row["bench"], []).append(row)
    assert len(by_bench["fake_ok"]) == 4
    assert [r["impl"] for r in by_bench["fake_hang"]] == ["hangs later"]
    assert by_bench["fake_hang"][0]["device"] == "fake device"
    assert [r["impl"] for r in by_bench["fake_stubborn"]] == ["stubborn"]
    assert [r["impl"] for r in by_bench["fake_crash"]] == ["crashes"]

    table = table_of(text)
    assert len(table) == 2 + len(results["rows"])
    assert all(impl in "\n".join(table) for impl in ("fast", "slow", "hangs later", "stubborn", "crashes"))
    fast_1k = next(line for line in table if "| fast |" in line and "| 1024 |" in line)
    assert "| 0.5 |" in fast_1k, "of_roof = roofline_ms / ms"
    assert "fake_stubborn    killed" in text


def test_runner_interrupted_passes_sigint_on_and_still_reports(tmp_path):
    """Ctrl-C or `timeout -s INT` on the runner: the running script gets the SIGINT (it is in its own
    session), writes its rows, the rest are skipped, results.json and the table still come out."""
    fakes = write_fakes(tmp_path / "fakes", names=("hang", "ok"))
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCH_DIR / "run_all.py"), "--bench-dir", str(fakes), "--out", str(out),
           "--benches", "fake_hang,fake_ok", "--cap", "60", "--grace", "5", "--no-plots"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[fake_hang] row:"):
                proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    results = json.loads((out / "results.json").read_text())
    assert [r["status"] for r in results["runs"]] == ["interrupted", "skipped (interrupted)"]
    assert results["runs"][0]["rows_from"] == "json" and len(results["rows"]) == 1
    assert lines[-1].startswith("| fake_hang |")


def test_runner_budget_skips_what_no_longer_fits(tmp_path, capsys):
    fakes = write_fakes(tmp_path / "fakes", names=("ok",))
    rc = run_all.main(["--bench-dir", str(fakes), "--out", str(tmp_path / "out"), "--budget", "1", "--no-plots",
                       "--quiet"])
    assert rc == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["status"] for r in results["runs"]] == ["skipped (budget)"]
    assert "skipped" in capsys.readouterr().out


def test_cli_bench_delegates_to_the_runner(tmp_path, capsys):
    from dispatch import cli

    fakes = write_fakes(tmp_path / "fakes", names=("ok",))
    rc = cli.main(["bench", "--bench-dir", str(fakes), "--out", str(tmp_path / "out"), "--no-plots", "--quiet"])
    assert rc == 0
    assert table_of(capsys.readouterr().out)[-1].startswith("| fake_ok | fake op |")
    assert (tmp_path / "out" / "bench_fake_ok.log").exists()
    # summarize.py reads the combined file too
    summarize.main([str(tmp_path / "out" / "results.json")])
    assert sum(line.startswith("| fake_ok |") for line in capsys.readouterr().out.splitlines()) == 4


def fake_rows():
    rows = []
    for tokens in (1024, 4096):
        for impl, k in (("triton", 1.0), ("torch eager", 4.0)):
            rows.append(dict(bench="b", op="fwd", shape=f"T{tokens} K64", family="K64", tokens=tokens, impl=impl,
                             ms=k * tokens / 1024, roofline_ms=0.4 * tokens / 1024))
    rows.append(dict(bench="b", op="fwd", shape="T1024 K64", family="K64", tokens=1024, impl="gemm only", ms=0.7,
                     roofline_ms=0.3))
    rows.append(dict(bench="c", op="copy", shape="[2048,8]", tokens=2048, impl="copy_", ms=0.1))
    rows.append(dict(bench="b", op="host", shape="", tokens=None, impl="no token axis", ms=0.001))
    rows.append(dict(bench="b", op="skip", shape="", tokens=1024, impl="skipped", ms=None))
    return rows


def test_plot_groups():
    groups = run_all.plot_groups(fake_rows())
    assert set(groups) == {("b", "fwd", "K64"), ("c", "copy", "[T,8]")}
    assert len(groups[("b", "fwd", "K64")]) == 5


def test_plots_are_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    paths, message = run_all.make_plots(fake_rows(), tmp_path / "plots")
    assert len(paths) == 2, message
    for p in paths:
        data = Path(p).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


def test_plots_without_matplotlib_say_why(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    paths, message = run_all.make_plots(fake_rows(), tmp_path / "plots")
    assert paths == [] and "matplotlib" in message
    assert not (tmp_path / "plots").exists()


# --------------------------------------------------------------------------------------------------
# The real scripts, tiny shapes, CPU interpreter
# --------------------------------------------------------------------------------------------------

SLOW = {"quantize", "attention", "mla_q"}  # 5-10 s each under the interpreter on the CI machine
REAL = [name for name, _ in run_all.discover(BENCH_DIR)]


def smoke_env():
    """The --smoke runs' environment (Triton through its interpreter); skips where that cannot run."""
    reason = triton_interpreter_unusable()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.pop(benchlib.PEAKS_ENV, None)
    return env


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in REAL])
def test_bench_script_smoke(name, tmp_path):
    out = tmp_path / f"bench_{name}.json"
    proc = subprocess.run([sys.executable, str(BENCH_DIR / f"bench_{name}.py"), "--smoke", "--json", str(out)],
                          cwd=REPO, env=smoke_env(), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["bench"] == name and data["rows"] and data["interrupted"] is False
    streamed = [line for line in proc.stdout.splitlines() if line.startswith(benchlib.ROW_PREFIX)]
    assert len(streamed) == len(data["rows"]), "every row is printed as it is measured"
    for row in data["rows"]:
        assert {"op", "shape", "impl", "ms", "tokens", "device"} <= set(row), row
        assert row["tokens"] is None or isinstance(row["tokens"], int)
        if (row.get("bytes") or row.get("flops")) and name != "roofline":  # roofline's rows measure the peaks
            assert row.get("roofline_ms", 0) > 0, row
    # the table is printed last
    assert not proc.stdout.rstrip().splitlines()[-1].startswith(benchlib.ROW_PREFIX)


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_sigint_keeps_the_rows_measured(tmp_path, inherited):
    """A time cap's SIGINT mid-run: the script stops and still writes the JSON of what it measured; also
    when it was started with SIGINT ignored, as a background job's children are (`cmd &`, nohup)."""
    out = tmp_path / "bench_rope.json"
    proc = subprocess.Popen([sys.executable, str(BENCH_DIR / "bench_rope.py"), "--smoke", "--tokens", "32,64,96",
                             "--json", str(out)], cwd=REPO, env=smoke_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_ignore_sigint if inherited == "ignored" else None)
    seen = 0
    try:
        for line in proc.stdout:
            if line.startswith(benchlib.ROW_PREFIX):
                seen += 1
                if seen == 2:
                    proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    data = json.loads(out.read_text())
    assert data["interrupted"] is True
    assert 2 <= len(data["rows"]) < 15, "stopped early, kept what it had"
    assert [r["tokens"] for r in data["rows"][:2]] == [32, 32]


def test_quick_skips_torch_compile_unless_asked():
    # --quick must fit in 3 minutes on the H200; the torch.compile baselines alone take longer.
    script, js = Path("bench_x.py"), Path("x.json")
    quick = run_all.script_argv(script, js, run_all.parse_args(["--quick"]))
    assert "--quick" in quick and "--no-compile" in quick
    kept = run_all.script_argv(script, js, run_all.parse_args(["--quick", "--compile"]))
    assert "--no-compile" not in kept
    full = run_all.script_argv(script, js, run_all.parse_args([]))
    assert "--no-compile" not in full and "--quick" not in full


def test_interleaved_ms_takes_turns_and_reports_medians():
    calls = []
    readings = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 9.0, 4.0])}

    def bench(fn):
        name = fn()
        calls.append(name)
        return next(readings[name])

    got = benchlib.interleaved_ms({"a": lambda: "a", "b": lambda: "b"}, rounds=3, bench=bench)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert got == {"a": 3.0, "b": 4.0}


def test_compile_static_raises_dynamo_recompile_limits():
    import torch._dynamo

    benchlib.compile_static(lambda x: x + 1)
    cfg = torch._dynamo.config
    assert all(getattr(cfg, n) >= 1024 for n in ("recompile_limit", "cache_size_limit") if hasattr(cfg, n))
