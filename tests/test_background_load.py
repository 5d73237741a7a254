"""The background loader `import dispatch` starts: imports the backends and computes Triton's compiler
fingerprint on a machine with a CUDA device, once, never on a CPU-only machine, switched off by
MXMLA_BACKGROUND_LOAD=0, and a bad value does not break the import (the first selection raises)."""
import subprocess
import sys
from pathlib import Path

import pytest

import backends
from tests.util import subprocess_env

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full = subprocess_env(ROOT, **env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300,
                          cwd=str(ROOT))


def test_load_for_device_loads_and_fingerprints_where_cuda_is(monkeypatch):
    pytest.importorskip("triton")
    import torch

    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(backends, "load", lambda: calls.append("load"))
    monkeypatch.setattr(backends.settings, "interpret_mode", lambda: False)
    monkeypatch.setattr(backends, "backend_infos", lambda: {"triton": type("I", (), {"available": True})()})
    from backends.triton import compile_ahead

    monkeypatch.setattr(compile_ahead, "triton_fingerprint", lambda: calls.append("fingerprint"))
    backends._load_for_device()
    assert calls == ["load", "fingerprint"]


def test_load_for_device_skips_the_fingerprint_when_interpreting(monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(backends, "load", lambda: calls.append("load"))
    monkeypatch.setattr(backends.settings, "interpret_mode", lambda: True)
    backends._load_for_device()
    assert calls == ["load"]


def test_load_for_device_does_nothing_without_cuda(monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(backends, "load", lambda: calls.append("load"))
    backends._load_for_device()
    assert calls == []


def test_background_errors_stay_in_the_thread(monkeypatch):
    def boom():
        raise RuntimeError("a backend import failed oddly")

    monkeypatch.setattr(backends, "_load_for_device", boom)
    backends._background_main()  # no exception: the first op's own load() reports it


@pytest.mark.parametrize("value, started", [("1", True), ("", True), ("0", False)])
def test_import_starts_one_thread_unless_switched_off(value, started):
    code = ("import threading, dispatch, backends; "
            "print(len(backends._background), "
            "sum(t.name == 'mxmla-background-load' for t in threading.enumerate()) <= 1)")
    proc = _run(code, MXMLA_BACKGROUND_LOAD=value)
    assert proc.returncode == 0, proc.stderr
    count, at_most_one = proc.stdout.split()
    assert int(count) == (1 if started else 0)
    assert at_most_one == "True"


def test_bad_value_does_not_break_the_import_and_raises_at_selection():
    code = ("import dispatch, torch\n"
            "try:\n"
            "    dispatch.run('mxfp8_quantize', torch.zeros(2, 32), backend='torch')\n"
            "except ValueError as e:\n"
            "    print('raised', 'MXMLA_BACKGROUND_LOAD' in str(e))\n")
    proc = _run(code, MXMLA_BACKGROUND_LOAD="yes")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["raised", "True"]
