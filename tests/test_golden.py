"""Golden vectors: every op's spec output, recomputed, must equal the committed bytes.

Inputs and expected outputs are both stored (tools/make_golden.py wrote them once); a change of
semantics shows as a failing case here and, when regenerated on purpose, as a diff of
spec/golden/golden.npz.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import spec
from spec.mxtensor import MXTensor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from make_golden import GOLDEN, kwargs_from_json, unflatten  # noqa: E402

import ml_dtypes  # noqa: E402,F401  (registers the dtype names used in the manifest)


@pytest.fixture(scope="module")
def golden():
    data = np.load(GOLDEN)
    manifest = json.loads(data["__manifest__"].tobytes())
    return data, manifest


def _compare(got, expected, data, manifest, where):
    if "mx" in expected:
        e = expected["mx"]
        assert isinstance(got, MXTensor), where
        assert (got.axis, got.elem, got.scale_layout) == (e["axis"], e["elem"], e["scale_layout"]), where
        _compare(got.data, e["data"], data, manifest, where + ".data")
        _compare(got.scale, e["scale"], data, manifest, where + ".scale")
    elif "seq" in expected:
        assert len(got) == len(expected["seq"]), where
        for i, (g, e) in enumerate(zip(got, expected["seq"])):
            _compare(g, e, data, manifest, f"{where}.{i}")
    elif "array" in expected:
        key = expected["array"]
        want = data[key]
        assert str(got.dtype) == manifest["dtypes"][key], f"{where}: dtype {got.dtype}"
        got_bits = np.ascontiguousarray(got).view(want.dtype)
        assert got_bits.shape == want.shape, f"{where}: shape {got_bits.shape} != {want.shape}"
        bad = np.count_nonzero(got_bits != want)
        assert bad == 0, f"{where}: {bad} of {want.size} elements differ from the golden bytes"
    else:
        assert got == expected["value"], where


def test_golden_file_is_small():
    assert GOLDEN.stat().st_size < 1_000_000


def _case_names():
    if not GOLDEN.exists():
        return []
    data = np.load(GOLDEN)
    return [e["name"] for e in json.loads(data["__manifest__"].tobytes())["index"]]


def test_golden_covers_every_op(golden):
    _, manifest = golden
    assert {e["op"] for e in manifest["index"]} == set(spec.OPS)


@pytest.mark.parametrize("name", _case_names())
def test_golden(name, golden):
    data, manifest = golden
    entry = next(e for e in manifest["index"] if e["name"] == name)
    args = unflatten(entry["args"], data, manifest)
    got = getattr(spec, entry["op"])(*args, **kwargs_from_json(entry["kwargs"]))
    _compare(got, entry["expected"], data, manifest, name)
