"""Conformance harness: every op on every backend present on this machine, against spec.

Parametrize a test with the `target` fixture: it yields (backend, device) for torch/triton/cudnn on
cpu/cuda, skipping with the reason when the device or backend is absent here. `run_on(target, op, ...)`
calls the op through the dispatcher with that backend named, skipping (with the backend's own reasons)
when the backend does not serve this call, so the report shows why a cell is empty.
"""
from __future__ import annotations

import os

import pytest

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

TARGETS = [
    ("torch", "cpu"),
    ("torch", "cuda"),
    ("triton", "cpu"),
    ("triton", "cuda"),
    ("cudnn", "cuda"),
]


def skip_reason(backend: str, device: str):
    if torch is None:
        return "torch is not installed"
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device on this machine"
    if backend == "triton" and device == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "triton on CPU needs TRITON_INTERPRET=1"
        from tests.util import triton_interpreter_unusable

        reason = triton_interpreter_unusable()
        if reason:
            return reason
    import backends

    backends.load()
    info = backends.backend_infos().get(backend)
    if info is None or not info.available:
        reasons = "; ".join(info.reasons) if info else "not registered"
        return f"backend {backend} unavailable: {reasons}"
    return None


@pytest.fixture(params=TARGETS, ids=[f"{b}-{d}" for b, d in TARGETS])
def target(request):
    backend, device = request.param
    reason = skip_reason(backend, device)
    if reason:
        pytest.skip(reason)
    return backend, device


@pytest.fixture(params=["cpu", "cuda"], ids=["cpu", "cuda"])
def triton_target(request):
    """("triton", device) for the Triton-only files, skipping where Triton cannot run on that device."""
    reason = skip_reason("triton", request.param)
    if reason:
        pytest.skip(reason)
    return "triton", request.param


@pytest.fixture
def poisoned_torch_empty(monkeypatch):
    """torch.empty filled with 0xFF bytes (NaN floats, 255 codes / scales) for the test's duration, so an
    output element a backend forgets to write fails the comparison."""
    if torch is None:
        pytest.skip("torch is not installed")
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.numel():
            t.view(torch.uint8).fill_(0xFF)
        return t

    monkeypatch.setattr(torch, "empty", empty)


# nodeid -> ops a test ran, read by `mxmla check` to build its op x backend table.
OPS_BY_TEST: dict = {}


def run_on(target, op, *args, **kwargs):
    """Run `op` on the target backend; skip (with reasons) when that backend cannot serve the call."""
    import dispatch

    backend, _ = target
    current = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    OPS_BY_TEST.setdefault(current, set()).add(op)
    try:
        return dispatch.run(op, *args, backend=backend, **kwargs)
    except dispatch.BackendUnavailable as exc:
        pytest.skip(str(exc))
