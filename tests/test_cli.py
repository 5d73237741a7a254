"""The `mxmla` command: help, version, argument errors, info's configuration check, bench's CUDA guard,
and check's table (one small real run in a subprocess)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import dispatch
from dispatch import cli, version
from tests.util import skip_without_triton_interpreter

ROOT = Path(__file__).resolve().parent.parent


def pyproject_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE).group(1)


def test_no_arguments_prints_help_and_exits_0(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mxmla") and all(cmd in out for cmd in ("info", "check", "bench"))


def test_version_flag_and_module_attribute(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"mxmla {dispatch.__version__}"
    assert dispatch.__version__ == pyproject_version()


def test_version_falls_back_to_pyproject_when_not_installed(monkeypatch):
    import importlib.metadata as metadata

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert version.package_version() == pyproject_version()
    monkeypatch.setattr(version, "PYPROJECT", ROOT / "no-such-pyproject.toml")
    assert version.package_version() == "unknown"


def test_unknown_subcommand_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["nope"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("argv, names", [
    (["check", "--backend", "nope"], ["'nope'", "torch, triton, cudnn"]),
    (["check", "--backend", "torch,nope"], ["'nope'", "torch, triton, cudnn"]),
    (["check", "--device", "gpu"], ["'gpu'", "cpu, cuda"]),
    (["check", "--op", "ropes"], ["'ropes'", "mxfp8_quantize", "modules: attention"]),
])
def test_check_rejects_unknown_names_before_running_tests(argv, names, capsys, monkeypatch):
    import pytest as pytest_module

    monkeypatch.setattr(pytest_module, "main", lambda *a, **k: pytest.fail("the suite must not run"))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    for name in names:
        assert name in err


def test_check_accepts_module_names_and_builds_one_expression():
    args = cli.build_parser().parse_args(["check", "--backend", "torch,triton", "--device", "cpu", "--op", "rope,gemm"])
    assert cli.check_selection(args) == ("(torch- or _torch or triton- or _triton) and (-cpu or [cpu-) "
                                         "and (rope or gemm)")


def test_skip_reasons_are_text_not_tuples():
    class Report:
        longrepr = ("/somewhere/test_x.py", 12, "Skipped: no CUDA device on this machine")
        longreprtext = ""

    assert cli._reason(Report()) == "no CUDA device on this machine"


def test_check_table_has_a_legend_and_groups_skip_reasons():
    def cell(passed=0, failed=0, skipped=0, reasons=None, failure=""):
        return dict(passed=passed, failed=failed, skipped=skipped, skip_reasons=reasons or {}, first_failure=failure)

    no_cuda = {"no CUDA device on this machine": 4}
    table = cli.format_check_table({
        ("rope", "torch-cpu"): cell(passed=5, skipped=1, reasons={"x": 1}),
        ("rope", "torch-cuda"): cell(skipped=4, reasons=no_cuda),
        ("mxfp8_gemm", "torch-cuda"): cell(skipped=4, reasons=no_cuda),
        ("mxfp8_gemm", cli.NO_TARGET): cell(passed=2, failed=1, failure="test_y: AssertionError: bytes differ"),
    })
    lines = table.splitlines()
    assert re.match(r"rope +pass 5 \+ 1 skip +skip +-$", next(ln for ln in lines if ln.startswith("rope")))
    assert "FAIL 1/3" in next(ln for ln in lines if ln.startswith("mxfp8_gemm"))
    assert any(ln.startswith("pass N: ") for ln in lines) and any(f"'{cli.NO_TARGET}'" in ln for ln in lines)
    assert "  mxfp8_gemm on per file: test_y: AssertionError: bytes differ" in lines
    assert "  no CUDA device on this machine (torch-cuda: rope, mxfp8_gemm)" in lines


def test_info_rejects_a_bad_backend_variable(monkeypatch, capsys):
    monkeypatch.setenv("MXMLA_BACKEND", "tritonn")
    assert cli.main(["info"]) == 2
    err = capsys.readouterr().err
    assert "MXMLA_BACKEND='tritonn'" in err and "valid backends: spec, torch, triton, cudnn" in err
    assert "Fix: unset it" in err


def test_info_reports_every_op_and_exits_0(monkeypatch, capsys):
    monkeypatch.delenv("MXMLA_BACKEND", raising=False)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"mxmla {dispatch.__version__}" in out
    for op in dispatch.backends()[0]["ops"]:
        assert re.search(rf"^  {op} +-> \w+$", out, re.MULTILINE), op


@pytest.mark.skipif(cli._has_cuda(), reason="the guard is for machines without CUDA")
def test_bench_without_cuda_says_so_in_one_line(capsys):
    assert cli.main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CUDA device" in err and "mxmla bench --smoke" in err


def test_bench_smoke_passes_the_guard_and_reaches_the_runner(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "_has_cuda", lambda: False)
    monkeypatch.setattr(cli, "BENCH_RUNNER", tmp_path / "run_all.py")
    (tmp_path / "run_all.py").write_text("def main(argv):\n    print('runner', argv)\n    return 0\n")
    assert cli.main(["bench", "--smoke", "--benches", "dispatch"]) == 0
    assert cli.main(["bench", "--help"]) == 0  # the runner's own help, CUDA or not
    out = capsys.readouterr().out.splitlines()
    assert out == ["runner ['--smoke', '--benches', 'dispatch']", "runner ['--help']"]


def test_check_runs_the_suite_and_prints_reasons_as_text():
    """One op on the torch backend, in a subprocess (pytest inside pytest would share its modules)."""
    env = {k: v for k, v in os.environ.items() if k != "MXMLA_BACKEND"}
    result = subprocess.run([sys.executable, "-m", "dispatch.cli", "check", "--op", "unswizzle_scales",
                             "--backend", "torch"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    out = result.stdout.split("mxmla check: each op on each backend-device, against spec", 1)[1]
    assert re.search(r"^unswizzle_scales +pass \d+", out, re.MULTILINE)
    assert "('/" not in out and "Skipped:" not in out
    if not cli._has_cuda():
        assert re.search(r"^  no CUDA device on this machine \(torch-cuda: ", out, re.MULTILINE)


def test_check_output_carries_no_interpreter_warnings():
    """RMSNorm's non-finite rows in Triton's interpreter: NumPy's overflow / invalid / All-NaN warnings
    for the GPU's Inf and NaN values stay out of the report (the table and real failures stay in)."""
    skip_without_triton_interpreter()
    env = {k: v for k, v in os.environ.items() if k != "MXMLA_BACKEND"}
    result = subprocess.run([sys.executable, "-m", "dispatch.cli", "check", "--op", "rmsnorm", "--backend", "triton",
                             "--device", "cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert re.search(r"^rmsnorm_mxfp8 +pass \d+", result.stdout, re.MULTILINE), result.stdout[-2000:]
    assert "Warning" not in result.stdout + result.stderr, (result.stdout + result.stderr)[:3000]


def test_interpreted_launches_raise_no_floating_point_warnings():
    """The interpreter's NumPy arithmetic computes the GPU's Inf / NaN without NumPy's warnings (errors here)."""
    pytest.importorskip("triton")
    from backends.triton import _common

    overflow = _common.serialized(lambda: np.float32(3e38) * np.float32(10) - np.float32(np.inf))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.isnan(overflow())
