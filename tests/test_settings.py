"""Environment switches: one parser (backends/settings.py), a bad value raises naming the variable
even where no kernel reads it, one table in docs/ARCHITECTURE.md, and every Triton module with an
autotuned kernel launches its heuristic tile without timing by default (MXMLA_TRITON_AUTOTUNE unset)."""
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
    assert settings.flag("MXMLA_TRITON_AUTOTUNE") is False
    assert settings.flag("MXMLA_TRITON_PRETUNED") is True
    monkeypatch.setenv("MXMLA_TRITON_AUTOTUNE", "1")
    assert settings.flag("MXMLA_TRITON_AUTOTUNE") is True


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


def _gpu_path(monkeypatch, mod):
    monkeypatch.setattr(mod, "interpret_mode", lambda: False)
    # every launch through kernel[grid], i.e. the autotuner's run (fast_launch's cache keys on the CUDA device)
    monkeypatch.setenv("MXMLA_TRITON_FAST_LAUNCH", "0")
    import triton.runtime.autotuner as autotuner

    def timed(*a, **k):
        raise AssertionError("a config was timed at a first call with MXMLA_TRITON_AUTOTUNE unset")

    monkeypatch.setattr(autotuner.Autotuner, "_bench", timed)
    monkeypatch.setattr(autotuner.Autotuner, "check_disk_cache", timed)


def _launches(monkeypatch, tuner):
    """The meta-parameters the autotuner hands its kernel, recorded instead of a launch."""
    calls = []
    monkeypatch.setattr(tuner.fn, "run", lambda *a, **kw: calls.append(kw))
    return calls


def test_rope_heuristic_tile(monkeypatch):
    pytest.importorskip("triton")
    from backends.triton import rope as mod

    _gpu_path(monkeypatch, mod)
    calls = _launches(monkeypatch, mod._rope_autotuned)
    x = torch.randn(8, 2, 64)
    cos = torch.randn(8, 32)
    mod.rope(x, cos, cos.clone())
    # 2 heads of 64 features: both heads, 16 tokens (2K elements), 4 warps
    assert [(c["BLOCK_T"], c["BLOCK_H"], c["num_warps"]) for c in calls] == [(16, 2, 4)]


def test_rmsnorm_heuristic_tile(monkeypatch):
    pytest.importorskip("triton")
    from backends.triton import rmsnorm as mod

    _gpu_path(monkeypatch, mod)
    monkeypatch.setattr(mod, "use_hw_cvt", lambda device: False)
    monkeypatch.setattr(mod, "_sm_count", lambda device: 132)
    calls = _launches(monkeypatch, mod._rmsnorm_tuned)
    mod.rmsnorm_mxfp8(torch.randn(32, 1536), torch.randn(1536))
    # one band of 32 rows on 132 SMs: 256-column chunks, two programs per band
    assert [(c["BLOCK_D"], c["SPLIT"], c["num_warps"]) for c in calls] == [(256, 2, 4)]


def test_quantize_and_dequantize_heuristic_tile(monkeypatch):
    pytest.importorskip("triton")
    from backends.triton import quantize as mod

    _gpu_path(monkeypatch, mod)
    monkeypatch.setattr(mod, "use_hw_cvt", lambda device: False)
    calls = {k: _launches(monkeypatch, getattr(mod, k)) for k in ("_quantize_tuned", "_dequantize_tuned")}
    x = torch.randn(32, 64)
    t = mod.mxfp8_quantize(x)
    mod.mxfp8_dequantize(t)
    for kernel, made in calls.items():
        assert [(c["BM"], c["BN"], c["num_warps"]) for c in made] == [(32, 64, 1)], kernel


def test_attention_runs_the_first_config_without_timing(monkeypatch):
    # the interpreter's config lists hold one tile, so both settings give the same bytes; by default
    # Triton's autotuner is never entered (its run would raise here)
    from tests.util import skip_without_triton_interpreter

    skip_without_triton_interpreter()
    import dispatch as d
    from backends.triton import attention
    from tests.util import assert_bytes_equal

    g = torch.Generator().manual_seed(7)
    q, k = (torch.randn(1, 24, 2, 192, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(1, 24, 2, 128, generator=g).bfloat16()
    monkeypatch.setenv("MXMLA_TRITON_AUTOTUNE", "1")
    o, lse = d.run("mla_attention", q, k, v, causal=True, backend="triton")
    do = torch.randn(o.shape, generator=g).bfloat16()
    grads = d.run("mla_attention_backward", do, q, k, v, o, lse, causal=True, backend="triton")
    monkeypatch.delenv("MXMLA_TRITON_AUTOTUNE")
    for tuner in (attention._mla_fwd_kernel, attention._mla_bwd_dkdv_kernel, attention._mla_bwd_dq_kernel):
        monkeypatch.setattr(tuner.run.__self__, "autotune_run",
                            lambda *a, **k: (_ for _ in ()).throw(AssertionError("autotuned")))
    o0, lse0 = d.run("mla_attention", q, k, v, causal=True, backend="triton")
    grads0 = d.run("mla_attention_backward", do, q, k, v, o, lse, causal=True, backend="triton")
    assert_bytes_equal(o0, o, "o")
    assert_bytes_equal(lse0, lse, "lse")
    for a, b in zip(grads0, grads):
        assert_bytes_equal(a, b, "grad")
