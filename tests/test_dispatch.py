"""The dispatcher: MXMLA_BACKEND grammar, requested-backend errors, unknown names, explain(), cache
invalidation on a change of the variable, and concurrent callers."""
from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch

import backends
import dispatch
from backends import registry
from dispatch.policy import parse_policy


@pytest.fixture
def fake_registry(monkeypatch):
    """A private copy of the registry with three fake 'rope' implementations to choose between."""
    backends.load()
    impls = copy.deepcopy(registry._impls)
    infos = copy.deepcopy(registry._backends)
    monkeypatch.setattr(registry, "_impls", impls)
    monkeypatch.setattr(registry, "_backends", infos)
    monkeypatch.delenv("MXMLA_BACKEND", raising=False)
    dispatch.clear_cache()

    def make(name, reasons):
        def fn(*a, **k):
            return name

        registry.declare_backend(name, True, version="test")
        registry.register("mxfp8_dequantize", name, check=lambda *a, **k: list(reasons))(fn)

    make("torch", [])
    make("triton", ["triton: no CUDA device (fake)"])
    make("cudnn", ["cudnn: needs sm100 (fake)"])
    yield
    dispatch.clear_cache()


def _mx():
    import spec

    x = torch.zeros(2, 32, dtype=torch.float8_e4m3fn)
    return spec.MXTensor(x, torch.zeros(2, 1, dtype=torch.uint8), axis=1)


def test_policy_grammar():
    assert parse_policy(None) == {}
    assert parse_policy("auto") == {"*": None}
    assert parse_policy("triton") == {"*": ("triton",)}
    assert parse_policy(" triton , torch ") == {"*": ("triton", "torch")}
    assert parse_policy("mla_attention=cudnn;rope=torch,spec;*=triton") == {
        "mla_attention": ("cudnn",),
        "rope": ("torch", "spec"),
        "*": ("triton",),
    }
    assert parse_policy("rope=auto;") == {"rope": None}


@pytest.mark.parametrize(
    "value, needle",
    [
        ("tritn", "unknown backend 'tritn'"),
        ("triton,torc", "unknown backend 'torc'"),
        ("ropee=torch", "unknown op 'ropee'"),
        ("rope=cudnnn", "unknown backend 'cudnnn'"),
        ("rope", "unknown backend 'rope'"),
        ("rope=torch;garbage", "has no '='"),
    ],
)
def test_policy_unknown_names_raise_listing_valid_ones(value, needle):
    with pytest.raises(dispatch.DispatchConfigError, match=needle) as exc:
        parse_policy(value)
    assert "valid" in str(exc.value) or "expected" in str(exc.value)


def test_unknown_op_and_backend_argument():
    with pytest.raises(dispatch.DispatchConfigError, match="unknown op 'quantise'.*mxfp8_quantize"):
        dispatch.run("quantise", torch.zeros(32))
    with pytest.raises(dispatch.DispatchConfigError, match="unknown backend 'trit'.*triton"):
        dispatch.run("mxfp8_dequantize", _mx(), backend="trit")


def test_auto_walks_priority_order(fake_registry, monkeypatch):
    monkeypatch.setitem(dispatch.PRIORITY, "cpu", ("cudnn", "triton", "torch"))
    assert dispatch.run("mxfp8_dequantize", _mx()) == "torch"


def test_requested_backend_that_cannot_serve_raises_with_every_reason(fake_registry):
    with pytest.raises(dispatch.BackendUnavailable) as exc:
        dispatch.run("mxfp8_dequantize", _mx(), backend="triton")
    assert "triton: no CUDA device (fake)" in str(exc.value)
    with pytest.raises(dispatch.BackendUnavailable) as exc:
        dispatch.run("mxfp8_dequantize", _mx(), backend="cudnn,triton")
    msg = str(exc.value)
    assert "needs sm100 (fake)" in msg and "no CUDA device (fake)" in msg


def test_env_variable_is_honoured_and_never_silently_replaced(fake_registry, monkeypatch):
    monkeypatch.setenv("MXMLA_BACKEND", "triton")
    with pytest.raises(dispatch.BackendUnavailable, match="MXMLA_BACKEND"):
        dispatch.run("mxfp8_dequantize", _mx())
    monkeypatch.setenv("MXMLA_BACKEND", "triton,torch")  # an explicit order the user chose
    assert dispatch.run("mxfp8_dequantize", _mx()) == "torch"
    monkeypatch.setenv("MXMLA_BACKEND", "rope=triton;*=torch")
    assert dispatch.run("mxfp8_dequantize", _mx()) == "torch"
    monkeypatch.setenv("MXMLA_BACKEND", "mxfp8_dequantize=cudnn;*=torch")
    with pytest.raises(dispatch.BackendUnavailable, match="sm100"):
        dispatch.run("mxfp8_dequantize", _mx())


def test_argument_overrides_environment(fake_registry, monkeypatch):
    monkeypatch.setenv("MXMLA_BACKEND", "triton")
    assert dispatch.run("mxfp8_dequantize", _mx(), backend="torch") == "torch"


def test_cache_follows_environment_changes(fake_registry, monkeypatch):
    def pick():
        return dispatch.select("mxfp8_dequantize", _mx())

    monkeypatch.setenv("MXMLA_BACKEND", "torch")
    assert pick() == "torch"
    # Make triton able to serve; the cached choice for MXMLA_BACKEND=torch must still be torch,
    # and a change of the variable must select afresh.
    registry.register("mxfp8_dequantize", "triton", check=lambda *a, **k: [])(lambda *a, **k: "triton")
    assert pick() == "torch"
    monkeypatch.setenv("MXMLA_BACKEND", "triton")
    assert pick() == "triton"
    monkeypatch.setenv("MXMLA_BACKEND", "torch")
    assert pick() == "torch"


def test_explain_lists_every_backend_with_reasons(fake_registry, capsys):
    rows = dispatch.explain("mxfp8_dequantize", _mx())
    by = {r["backend"]: r for r in rows}
    assert set(by) == {"spec", "torch", "triton", "cudnn"}
    assert by["torch"]["chosen"] and by["torch"]["accepts"]
    assert by["triton"]["reasons"] == ["triton: no CUDA device (fake)"]
    assert by["spec"]["note"] == "serves only when named"
    out = capsys.readouterr().out
    assert "chosen torch" in out and "no CUDA device (fake)" in out


def test_backends_lists_availability_and_versions():
    rows = {r["backend"]: r for r in dispatch.backends()}
    assert rows["spec"]["available"] and rows["torch"]["version"] == torch.__version__
    assert set(rows) == {"spec", "torch", "triton", "cudnn"}
    for r in rows.values():
        assert r["available"] or r["reasons"]


def test_numpy_inputs_need_spec_named():
    x = np.zeros((2, 32), np.float32)
    with pytest.raises(dispatch.BackendUnavailable, match="backend='spec'"):
        dispatch.run("mxfp8_quantize", x)


def test_unknown_keyword_names_the_op_and_its_arguments():
    """A keyword the op does not take, too many or too few arguments: the TypeError names the op and lists
    what it takes, not spec's internal validator."""
    x = torch.zeros(32, 32)
    with pytest.raises(TypeError, match=r"^mxfp8_quantize: got an unexpected keyword argument 'axes'; "
                                        r"mxfp8_quantize takes x, axis, elem, scale_mode, nonfinite, scale_layout") as info:
        dispatch.run("mxfp8_quantize", x, axes=-1)
    assert "validate_" not in str(info.value)
    with pytest.raises(TypeError, match=r"^mxfp8_quantize: missing a required argument: 'x'"):
        dispatch.run("mxfp8_quantize")
    with pytest.raises(TypeError, match=r"^swizzle_scales: .*; swizzle_scales takes "):
        dispatch.run("swizzle_scales", x, 1, 2, 3, 4, 5, 6, 7)


def test_mixed_devices_rejected(fake_registry):
    mx = _mx()
    with pytest.raises(ValueError, match="one device"):
        dispatch._same_device("mxfp8_dequantize", (mx,), {"other": torch.zeros(1, device="meta")})


def test_validation_runs_before_any_backend(fake_registry):
    with pytest.raises((ValueError, TypeError)):
        dispatch.run("mxfp8_dequantize", "not an MXTensor", backend="torch")


def test_concurrent_callers_get_identical_results(fake_registry, monkeypatch):
    monkeypatch.setenv("MXMLA_BACKEND", "triton,torch")
    results, errors = [], []
    barrier = threading.Barrier(8)

    def worker():
        try:
            barrier.wait()
            for _ in range(200):
                dispatch.clear_cache() if _ % 50 == 0 else None
                results.append(dispatch.run("mxfp8_dequantize", _mx()))
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 1600 and set(results) == {"torch"}


@pytest.mark.parametrize("bad", [1, ["torch"], ("torch",), b"torch"])
@pytest.mark.parametrize("entry", ["run", "select", "explain"])
def test_backend_argument_of_the_wrong_type_names_backend(bad, entry):
    x = torch.randn(32, 64)
    with pytest.raises(TypeError, match="^backend: expected a string"):
        getattr(dispatch, entry)("mxfp8_quantize", x, backend=bad)


def test_importing_dispatch_leaves_ml_dtypes_and_dynamo_unloaded():
    """ml_dtypes' extension and torch's dynamo each take most of a second to import on a 2-core CPU.
    Only spec's reference computations and the NumPy conversions use ml_dtypes, and only a trace uses
    dynamo, so a process that imports dispatch and runs the torch backend's mxfp8 ops eagerly loads
    neither. A fresh interpreter, as a training process starts."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, torch, dispatch, dispatch.nn, dispatch.autograd, backends\n"
        "backends.load()\n"
        "x = torch.randn(4, 64, dtype=torch.bfloat16)\n"
        "dispatch.autograd.mxfp8_quantize(x, axis=-1, backend='torch')\n"
        "print('ml_dtypes' in sys.modules, 'torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False False"
