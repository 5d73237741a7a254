"""benchmarks/bench_block.py's first-call accounting (FirstCallCosts) on CPU: dispatched ops are timed
by name, the wrapped functions are put back on exit, and gpu_bound_ms says nothing off CUDA."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_block  # noqa: E402
import dispatch  # noqa: E402


def test_first_call_costs_times_ops_and_restores():
    real_run = dispatch.run
    pytest.importorskip("triton")
    from triton.runtime import autotuner, jit
    real_compile, real_bench = getattr(jit.JITFunction, "_do_compile", None), getattr(autotuner.Autotuner, "_bench", None)
    x = (torch.randn(64, 64) * 3).to(torch.bfloat16)
    with bench_block.FirstCallCosts() as costs:
        dispatch.run("mxfp8_quantize", x, axis=-1, backend="torch")
        dispatch.run("mxfp8_quantize", x, axis=0, backend="torch")
    assert dispatch.run is real_run
    assert getattr(jit.JITFunction, "_do_compile", None) is real_compile
    assert getattr(autotuner.Autotuner, "_bench", None) is real_bench
    n, seconds = costs.ops["mxfp8_quantize"]
    assert n == 2 and seconds > 0
    lines = costs.lines()
    assert lines[0].startswith("op (dispatch.run, synced)") and any("mxfp8_quantize" in ln for ln in lines)


def test_gpu_bound_is_none_off_cuda(monkeypatch):
    monkeypatch.setattr(bench_block, "DEVICE", "cpu")
    assert bench_block.gpu_bound_ms(object()) == (None, None, None)
