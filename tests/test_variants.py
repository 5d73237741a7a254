"""Kernel variants as registry entries: each with its own capability check and a priority; the
automatic choice takes the highest-priority variant that can serve; a variant named in MXMLA_BACKEND
(`op=backend:variant`) or by `variant=` serves or raises BackendUnavailable with its reasons (never a
downgrade); explain() lists every variant with its verdict."""
from __future__ import annotations

import copy

import pytest
import torch

import backends
import dispatch
from backends import registry
from dispatch.policy import parse_policy

OP = "mxfp8_dequantize"


def _mx(rows=2):
    import spec

    x = torch.zeros(rows, 32, dtype=torch.float8_e4m3fn)
    return spec.MXTensor(x, torch.zeros(rows, 1, dtype=torch.uint8), axis=1)


@pytest.fixture
def fake(monkeypatch):
    """A private registry: torch serves OP through variants 'wide' (priority 20, needs >= 4 rows) and
    'narrow' (priority 10, any call); triton serves it with no variants."""
    backends.load()
    monkeypatch.setattr(registry, "_impls", copy.deepcopy(registry._impls))
    monkeypatch.setattr(registry, "_backends", copy.deepcopy(registry._backends))
    monkeypatch.setattr(registry, "_variants", copy.deepcopy(registry._variants))
    monkeypatch.delenv("MXMLA_BACKEND", raising=False)
    dispatch.clear_cache()
    registry.declare_backend("torch", True, version="test")
    registry.declare_backend("triton", True, version="test")
    registry.register(OP, "torch")(lambda t, out_dtype="float32", variant=None: ("torch", variant))
    registry.register(OP, "triton")(lambda t, out_dtype="float32": ("triton", None))
    registry.register_variant(OP, "torch", "wide", 20,
                              check=lambda t, **kw: [] if t.shape[0] >= 4 else [f"needs >= 4 rows, got {t.shape[0]}"])
    registry.register_variant(OP, "torch", "narrow", 10)
    yield
    dispatch.clear_cache()


def test_auto_takes_the_highest_priority_variant_that_can_serve(fake):
    assert dispatch.run(OP, _mx(8), backend="torch") == ("torch", "wide")
    assert dispatch.run(OP, _mx(2), backend="torch") == ("torch", "narrow")
    assert dispatch.select(OP, _mx(2), backend="torch") == "torch:narrow"
    assert dispatch.select(OP, _mx(2), backend="triton") == "triton"  # no variants: the backend's name


@pytest.mark.parametrize("how", ["env", "backend", "variant"])
def test_named_variant_that_cannot_serve_raises_with_its_reasons(fake, monkeypatch, how):
    kw = {}
    if how == "env":
        monkeypatch.setenv("MXMLA_BACKEND", f"{OP}=torch:wide")
    elif how == "backend":
        kw["backend"] = "torch:wide"
    else:
        kw.update(backend="torch", variant="wide")
    with pytest.raises(dispatch.BackendUnavailable, match="needs >= 4 rows, got 2") as err:
        dispatch.run(OP, _mx(2), **kw)
    assert "narrow" not in str(err.value)  # no downgrade to the variant that could serve
    assert dispatch.run(OP, _mx(8), **kw) == ("torch", "wide")


def test_variant_argument_implies_its_backend_and_a_list_falls_through_named_entries_only(fake, monkeypatch):
    assert dispatch.run(OP, _mx(8), variant="wide") == ("torch", "wide")
    monkeypatch.setenv("MXMLA_BACKEND", f"{OP}=torch:wide,triton")
    assert dispatch.run(OP, _mx(2)) == ("triton", None)  # the user's own order: wide, then triton


@pytest.mark.parametrize("kw, needle", [
    (dict(variant="fastest"), "has no variant 'fastest'; valid variants: torch:wide, torch:narrow"),
    (dict(backend="torch:fastest"), "torch has no variant 'fastest'"),
    (dict(backend="triton", variant="wide"), "'wide' belongs to torch"),
    (dict(backend="torch:narrow", variant="wide"), "conflicts with 'torch:narrow'"),
])
def test_unknown_or_conflicting_variant_names_raise(fake, kw, needle):
    with pytest.raises(dispatch.DispatchConfigError, match=needle):
        dispatch.run(OP, _mx(8), **kw)


def test_variant_argument_type(fake):
    with pytest.raises(TypeError, match="^variant: expected a variant name"):
        dispatch.run(OP, _mx(8), variant=3)


def test_grammar_accepts_backend_variant_entries():
    assert parse_policy("mla_q_uproj_rope_quant=triton:gluon_ws128;*=triton") == {
        "mla_q_uproj_rope_quant": ("triton:gluon_ws128",), "*": ("triton",)}
    assert parse_policy(" triton : tma , torch ") == {"*": ("triton:tma", "torch")}
    for bad in ("triton:", "triton:gl-uon", "tritn:tma"):
        with pytest.raises(dispatch.DispatchConfigError):
            parse_policy(bad)


def test_explain_lists_every_variant_with_reasons(fake, capsys):
    rows = dispatch.explain(OP, _mx(2), backend="torch")
    torch_row = next(r for r in rows if r["backend"] == "torch")
    assert torch_row["chosen"]
    by_name = {v["variant"]: v for v in torch_row["variants"]}
    assert by_name["wide"] == {"variant": "wide", "priority": 20, "chosen": False, "accepts": False,
                               "reasons": ["needs >= 4 rows, got 2"]}
    assert by_name["narrow"]["chosen"] and by_name["narrow"]["accepts"]
    out = capsys.readouterr().out
    assert "chosen torch:narrow" in out and ":wide" in out and "needs >= 4 rows" in out


def test_cache_keeps_variant_requests_apart(fake):
    assert dispatch.run(OP, _mx(8), backend="torch", variant="narrow") == ("torch", "narrow")
    assert dispatch.run(OP, _mx(8), backend="torch") == ("torch", "wide")


def test_register_variant_checks_its_arguments():
    with pytest.raises(ValueError, match="unknown op"):
        registry.register_variant("no_such_op", "triton", "x", 1)
    with pytest.raises(ValueError, match="letters, digits"):
        registry.register_variant(OP, "triton", "a:b", 1)
