"""benchmarks/first_step.py on CPU: each case's first process gets new empty Triton, Inductor and mxmla
cache folders and its second process the same (now filled) folders; a failed child is reported, not
raised; the table shows every case; the run's budget bounds each child; the case table names
bench_block's paths; compile seconds add up each compilation once."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import first_step  # noqa: E402

CACHE_VARS = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "MXMLA_CACHE_DIR")


def test_fresh_then_second_process_share_new_empty_caches(monkeypatch):
    seen = []

    def fake_run(cmd, env, capture_output, text, timeout):
        dirs = [env[v] for v in CACHE_VARS]
        seen.append((cmd, dirs, [os.path.exists(d) and os.listdir(d) for d in dirs]))
        for d in dirs:  # the child fills its caches
            os.makedirs(d, exist_ok=True)
            Path(d, "entry").write_text("x")
        out = "FIRST_STEP " + json.dumps({"step_s": 3.0 if len(seen) == 1 else 0.5, "build_s": 1.0, "compile_s": 0.0})
        return subprocess.CompletedProcess(cmd, 0, stdout=out + "\n", stderr="")

    monkeypatch.setattr(first_step.subprocess, "run", fake_run)
    row = first_step.run_case("unrecorded", breakdown=False)
    (cmd1, dirs1, before1), (cmd2, dirs2, before2) = seen
    assert dirs1 == dirs2 and len(set(dirs1)) == 3
    assert before1 == [False, False, False]  # fresh: the folders do not exist yet
    assert all(before2)  # second: what the first process left
    assert cmd1[-2:] == ["--child", "unrecorded"] and cmd2 == cmd1
    assert row["fresh_s"] == 3.0 and row["second_s"] == 0.5
    assert not any(os.path.exists(d) for d in dirs1)  # the temporary folders are gone
    table = first_step.table([row, {"label": "failed case"}])
    assert "block mxfp8 B1 S6144 H96" in table and "3.0" in table and "failed case" in table


def test_a_failed_child_is_reported(monkeypatch):
    monkeypatch.setattr(first_step.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, stdout="", stderr="boom"))
    row = first_step.run_case("hf", breakdown=False)
    assert row["fresh_error"] == "boom" and "fresh_s" not in row and "second_s" not in row


def test_case_table():
    import bench_block

    assert first_step.DEFAULT_CASES == tuple(first_step.CASES)
    assert set(first_step.SMOKE_CASES) == set(first_step.CASES) - {"block-compile-bf16"}
    compiled = [first_step.CASES[c]["compiled"] for c in first_step.DEFAULT_CASES]
    assert compiled == sorted(compiled)  # the eager cases first: a spent budget drops compiled ones
    for name, case in first_step.CASES.items():
        assert case["kind"] in ("block", "hf"), name
        if case["kind"] == "block":  # bench_block's own paths, compiled exactly where bench_block compiles
            assert case["path"] in bench_block.PATHS and case["compiled"] == (case["path"] in bench_block.BLOCK_PATH)
    assert first_step.CASES["block-compile"]["path"] == "mxfp8-compile"
    assert first_step.CASES["block-compile-bf16"]["path"] == "compile"
    assert first_step.CASES["hf-compile"]["compiled"] and not first_step.CASES["hf"]["compiled"]


def test_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exit_:
        first_step.main(["--help"])
    assert exit_.value.code == 0 and "hf-compile" in capsys.readouterr().out
    for bad in (["--cases", "block,nope"], ["--budget", "0"]):
        with pytest.raises(SystemExit) as exit_:
            first_step.main(bad)
        assert exit_.value.code == 2


def test_the_budget_bounds_each_child(monkeypatch):
    limits = []

    def fake_run(cmd, env, capture_output, text, timeout):
        limits.append(timeout)
        out = "FIRST_STEP " + json.dumps({"step_s": 1.0, "build_s": 1.0, "compile_s": 0.5})
        return subprocess.CompletedProcess(cmd, 0, stdout=out + "\n", stderr="")

    monkeypatch.setattr(first_step.subprocess, "run", fake_run)
    row = first_step.run_case("block-compile", breakdown=False, deadline=time.perf_counter() + 100)
    assert len(limits) == 2 and all(lim <= 100 for lim in limits) and row["fresh_compile_s"] == 0.5
    row = first_step.run_case("hf-compile", breakdown=False, deadline=time.perf_counter() + 1)
    assert len(limits) == 2 and "budget" in row["fresh_error"] and "fresh_s" not in row
    table = first_step.table([row, first_step.run_case("block-compile", False, deadline=time.perf_counter() + 100)])
    assert "0.5" in table


def test_compile_seconds_counts_each_compilation_once():
    """The two outermost timers only: the frame's compilation and the lazy backward's, both > 0, and
    their sum within the wall time of the step that compiled (the nested timers would double it)."""
    import torch
    from torch._dynamo.utils import compilation_time_metrics

    def f(x, w):
        return torch.relu(x @ w).sum()

    x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    before = first_step.compile_seconds()
    every_before = {k: sum(v) for k, v in compilation_time_metrics.items()}
    t0 = time.perf_counter()
    compiled(x, w).backward()
    wall = time.perf_counter() - t0
    spent = {k: v - before[k] for k, v in first_step.compile_seconds().items()}
    every = sum(sum(v) - every_before.get(k, 0.0) for k, v in compilation_time_metrics.items())
    torch._dynamo.reset()
    assert set(spent) == set(first_step.COMPILE_TIMERS) and all(v > 0 for v in spent.values()), spent
    assert sum(spent.values()) <= wall < every  # summing every timer would count nested ones again


def test_smoke_child_reports_compile_seconds_of_a_compiled_case(capsys):
    """--smoke's child for the compiled HF case (aot_eager on the CPU) steps through mxmla (it raises
    otherwise) and reports compile seconds within its step's; the eager case's are 0."""
    pytest.importorskip("transformers", reason="the hf cases need transformers")
    import torch

    got = {}
    try:
        for name in ("hf-compile", "hf"):
            first_step.child(name, breakdown=False, smoke=True)
            line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("FIRST_STEP ")][-1]
            got[name] = json.loads(line[len("FIRST_STEP "):])
    finally:
        torch._dynamo.reset()
    assert 0 < got["hf-compile"]["compile_s"] <= got["hf-compile"]["step_s"]
    assert got["hf"]["compile_s"] == 0


def test_record_pretuned_calls_the_step_builders_as_they_are_declared():
    """tools/record_pretuned.py builds its patched-HF workload with first_step's step builder, on a GPU
    only: every call it makes of a first_step function must bind to that function's signature here,
    where no GPU is needed to find a stale call."""
    import ast
    import inspect

    tree = ast.parse(Path(__file__).resolve().parent.parent.joinpath("tools", "record_pretuned.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and isinstance(n.func.value, ast.Name) and n.func.value.id == "first_step"]
    assert calls, "record_pretuned no longer calls first_step"
    for call in calls:
        fn = getattr(first_step, call.func.attr)
        args = [None] * len(call.args)
        inspect.signature(fn).bind(*args, **{k.arg: None for k in call.keywords})  # TypeError: stale call
