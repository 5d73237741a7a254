"""launch_gated: an exact fallback's first compilation leaves the caller's path (mocked CUDA: a fake
kernel records warmups and launches; a fake flag stands for the device-side guard)."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from backends.triton import _common  # noqa: E402


class FakeKernel:
    def __init__(self, fail=False):
        self.release = threading.Event()
        self.warmups, self.launches, self.fail = [], [], fail

    def warmup(self, *args, grid, **kwargs):
        self.release.wait(10)
        self.warmups.append((args, kwargs))
        if self.fail:
            raise RuntimeError("compile failed")

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


class FakeFlag:
    def __init__(self, value):
        self.value, self.device = value, SimpleNamespace(type="cuda", index=0)

    def item(self):
        return self.value


@pytest.fixture
def cuda_like(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MXMLA_TRITON_BACKGROUND_COMPILE", raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    capturing = {"on": False}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["on"])
    monkeypatch.setattr(_common, "_GATED_STATE", {})
    return capturing


def _wait(kernel):
    kernel.release.set()
    for fut in list(_common._GATED_STATE.values()):
        try:
            fut.result(10)
        except RuntimeError:
            pass


def test_flag_down_skips_until_compiled_then_launches_gated(cuda_like):
    k = FakeKernel()
    buf = torch.zeros(8, dtype=torch.bfloat16)
    _common.launch_gated(k, (4,), FakeFlag(0), buf, 7, BLOCK=64)
    assert k.launches == [], "flag down and the kernel still compiling: nothing to run"
    _wait(k)
    assert k.warmups == [((torch.bfloat16, 7), {"BLOCK": 64})], "warmup gets the dtype, not the tensor"
    _common.launch_gated(k, (4,), FakeFlag(0), buf, 7, BLOCK=64)
    assert len(k.launches) == 1 and k.launches[0][1][0] is buf, "once compiled: launched, gated on the device"
    assert len(k.warmups) == 1


def test_flag_up_waits_for_the_compile_and_runs(cuda_like):
    k = FakeKernel()
    threading.Timer(0.05, k.release.set).start()
    _common.launch_gated(k, (2,), FakeFlag(1), 3, BLOCK=32)
    assert len(k.warmups) == 1 and k.launches == [((2,), (3,), {"BLOCK": 32})]


def test_new_constexprs_compile_separately(cuda_like):
    k = FakeKernel()
    k.release.set()
    _common.launch_gated(k, (1,), FakeFlag(0), 1, BLOCK=32)
    _common.launch_gated(k, (1,), FakeFlag(0), 1, BLOCK=64)
    _wait(k)
    assert sorted(w[1]["BLOCK"] for w in k.warmups) == [32, 64]


def test_capture_waits_instead_of_reading_the_flag(cuda_like):
    k = FakeKernel()
    cuda_like["on"] = True
    threading.Timer(0.05, k.release.set).start()

    class Unreadable(FakeFlag):
        def item(self):
            raise AssertionError("read during a graph capture")

    _common.launch_gated(k, (1,), Unreadable(0), 5)
    assert len(k.launches) == 1


def test_compile_failure_is_raised(cuda_like):
    k = FakeKernel(fail=True)
    _common.launch_gated(k, (1,), FakeFlag(0), 1)
    _wait(k)
    with pytest.raises(RuntimeError, match="compile failed"):
        _common.launch_gated(k, (1,), FakeFlag(0), 1)


def test_switch_off_and_interpreter_launch_directly(cuda_like, monkeypatch):
    k = FakeKernel()
    monkeypatch.setenv("MXMLA_TRITON_BACKGROUND_COMPILE", "0")
    _common.launch_gated(k, (1,), FakeFlag(0), 1)
    assert len(k.launches) == 1 and k.warmups == []
    monkeypatch.delenv("MXMLA_TRITON_BACKGROUND_COMPILE")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _common.launch_gated(k, (1,), FakeFlag(0), 1)
    assert len(k.launches) == 2 and k.warmups == []


def test_wait_background_compiles(cuda_like):
    k = FakeKernel()
    _common.launch_gated(k, (1,), FakeFlag(0), 1)
    threading.Timer(0.05, k.release.set).start()
    _common.wait_background_compiles()
    assert len(k.warmups) == 1 and all(f.done() for f in _common._GATED_STATE.values())
