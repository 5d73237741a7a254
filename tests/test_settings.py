"""Environment switches: one parser (backends/settings.py), a bad value raises naming the variable
even where no kernel reads it, one table in docs/ARCHITECTURE.md, and every Triton module with an
autotuned kernel runs a fixed tile under MXMLA_TRITON_AUTOTUNE=0."""
from __future__ import annotations

import pathlib
import re

import pytest
import torch

import dispatch
from backends import settings

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORD_SWITCHES = [s for s in settings.SWITCHES.values() if s.values is not None]


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in list(settings.SWITCHES) + list(settings.REMOVED):
        monkeypatch.delenv(name, raising=False)
    dispatch.clear_cache()
    yield
    dispatch.clear_cache()


@pytest.mark.parametrize("name, bad", [("MXMLA_TRITON_AUTOTUNE", "2"), ("MXMLA_TRITON_FP8_MMA", "yes"),
                                       ("MXMLA_TRITON_SOFT_FP8", "true"), ("MXMLA_CHECK_VALUES", "on"),
                                       ])
def test_bad_value_raises_naming_the_variable_on_any_backend(monkeypatch, name, bad):
    x = torch.randn(32, 64)
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=f"^environment variable {name}={bad!r}: expected"):
        dispatch.run("mxfp8_quantize", x, backend="torch")
    with pytest.raises(ValueError, match=f"^environment variable {name}="):
        dispatch.explain("mxfp8_quantize", x, print_table=False)


@pytest.mark.parametrize("name", sorted(settings.REMOVED))
def test_removed_variant_switches_raise_with_the_replacement(monkeypatch, name):
    monkeypatch.setenv(name, "tma")
    with pytest.raises(ValueError, match=f"^environment variable {name} was removed: name the variant in MXMLA_BACKEND"):
        dispatch.run("mxfp8_quantize", torch.randn(32, 64), backend="torch")


@pytest.mark.parametrize("sw", WORD_SWITCHES, ids=lambda s: s.name)
def test_every_accepted_value_and_the_default_parse(monkeypatch, sw):
    assert settings.choice(sw.name) == sw.default
    for v in sw.values:
        monkeypatch.setenv(sw.name, v)
        assert settings.choice(sw.name) == v
        settings.check_all()
    monkeypatch.setenv(sw.name, "")
    assert settings.choice(sw.name) == sw.default


def test_flags_read_as_bools(monkeypatch):
    assert settings.flag("MXMLA_TRITON_AUTOTUNE") is True
    assert settings.flag("MXMLA_TRITON_FP8_MMA") is False
    monkeypatch.setenv("MXMLA_TRITON_AUTOTUNE", "0")
    assert settings.flag("MXMLA_TRITON_AUTOTUNE") is False


def test_interpret_mode_reads_the_variable_as_triton_does(monkeypatch):
    for v, want in (("1", True), ("true", True), ("ON", True), ("0", False), ("", False), ("off", False)):
        monkeypatch.setenv("TRITON_INTERPRET", v)
        assert settings.interpret_mode() is want


def test_architecture_doc_carries_the_table():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert settings.markdown_table() in doc


def test_no_other_library_module_parses_an_mxmla_variable():
    """backends/ and dispatch/ read MXMLA_* only through settings (dispatch's hot path compares the raw
    MXMLA_BACKEND / MXMLA_CHECK_VALUES bytes for its cache key; the CLI prints MXMLA_BACKEND)."""
    allowed = {"backends/settings.py", "dispatch/__init__.py", "dispatch/cli.py"}
    offenders = []
    for sub in ("backends", "dispatch"):
        for path in (ROOT / sub).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            text = path.read_text()
            if rel not in allowed and re.search(r"os\.environ|os\.getenv", text):
                offenders.append(rel)
    assert not offenders, offenders


class _Recorder:
    """Stands in for a jitted kernel: records the launch's meta-parameters instead of running."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *a, **kw: self.calls.append(kw)


class _NoAutotune:
    def __getitem__(self, grid):
        raise AssertionError("the autotuned kernel was launched with MXMLA_TRITON_AUTOTUNE=0")


def _gpu_path(monkeypatch, mod):
    monkeypatch.setattr(mod, "interpret_mode", lambda: False)
    monkeypatch.setenv("MXMLA_TRITON_AUTOTUNE", "0")
    # every launch through kernel[grid], i.e. the recorder (fast_launch's cache keys on the CUDA device)
    monkeypatch.setenv("MXMLA_TRITON_FAST_LAUNCH", "0")


def test_rope_fixed_tile(monkeypatch):
    from backends.triton import rope as mod

    _gpu_path(monkeypatch, mod)
    rec = _Recorder()
    monkeypatch.setattr(mod, "_rope_kernel", rec)
    monkeypatch.setattr(mod, "_rope_autotuned", _NoAutotune())
    x = torch.randn(8, 2, 64)
    cos = torch.randn(8, 32)
    mod.rope(x, cos, cos.clone())
    assert rec.calls and rec.calls[0]["BLOCK_T"] >= 1 and "BLOCK_H" in rec.calls[0]


def test_rmsnorm_fixed_tile(monkeypatch):
    from backends.triton import rmsnorm as mod

    _gpu_path(monkeypatch, mod)
    monkeypatch.setattr(mod, "use_hw_cvt", lambda device: False)
    rec = _Recorder()
    monkeypatch.setattr(mod, "_rmsnorm_mxfp8_kernel", rec)
    monkeypatch.setattr(mod, "_rmsnorm_tuned", _NoAutotune())
    mod.rmsnorm_mxfp8(torch.randn(32, 64), torch.randn(64))
    assert rec.calls[0]["BLOCK_D"] == mod._FIXED_CONFIG["BLOCK_D"]


def test_quantize_and_dequantize_fixed_tile(monkeypatch):
    from backends.triton import quantize as mod

    _gpu_path(monkeypatch, mod)
    monkeypatch.setattr(mod, "use_hw_cvt", lambda device: False)
    monkeypatch.setattr(mod, "_register_cap", lambda tile: None)
    for kernel, tuned in (("_quantize_heuristic", "_quantize_tuned"), ("_dequantize_heuristic", "_dequantize_tuned")):
        monkeypatch.setattr(mod, kernel, _Recorder())
        monkeypatch.setattr(mod, tuned, _NoAutotune())
    x = torch.randn(32, 64)
    t = mod.mxfp8_quantize(x)
    mod.mxfp8_dequantize(t)
    for kernel in ("_quantize_heuristic", "_dequantize_heuristic"):
        call = getattr(mod, kernel).calls[0]
        assert (call["BM"], call["BN"], call["num_warps"]) == mod._INTERPRET_CONFIG


def test_attention_runs_the_first_config_without_the_autotuner(monkeypatch):
    # the interpreter's config lists hold one tile, so both settings give the same bytes; with 0 the
    # autotuners never run (their run() would raise here)
    from tests.util import skip_without_triton_interpreter

    skip_without_triton_interpreter()
    import triton.runtime.autotuner as autotuner

    import dispatch as d
    from tests.util import assert_bytes_equal

    g = torch.Generator().manual_seed(7)
    q, k = (torch.randn(1, 24, 2, 192, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(1, 24, 2, 128, generator=g).bfloat16()
    o, lse = d.run("mla_attention", q, k, v, causal=True, backend="triton")
    do = torch.randn(o.shape, generator=g).bfloat16()
    grads = d.run("mla_attention_backward", do, q, k, v, o, lse, causal=True, backend="triton")
    monkeypatch.setenv("MXMLA_TRITON_AUTOTUNE", "0")
    monkeypatch.setattr(autotuner.Autotuner, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("autotuned")))
    o0, lse0 = d.run("mla_attention", q, k, v, causal=True, backend="triton")
    grads0 = d.run("mla_attention_backward", do, q, k, v, o, lse, causal=True, backend="triton")
    assert_bytes_equal(o0, o, "o")
    assert_bytes_equal(lse0, lse, "lse")
    for a, b in zip(grads0, grads):
        assert_bytes_equal(a, b, "grad")
