"""benchmarks/hf_layer.py --smoke runs on the CPU: every layer row (unpatched, mxfp8 and bf16, eager
and torch.compile'd) steps, the patched rows are served by mxmla (compiled ones traced through it
once, no recompile while timed), and the JSON has a median time for each."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="benchmarks/hf_layer.py needs transformers")

ROOT = Path(__file__).resolve().parents[1]
# one layer's output against unpatched: five e4m3 quantizations (y, w_q_b, q, k, v), 2^-4 relative
# each, in quadrature (tests/test_integration_transformers.py derives the same bound for two layers)
OUT_BOUND = math.sqrt(5) * 2 ** -4
ROWS = ["unpatched", "unpatched_compile", "mxfp8", "mxfp8_compile", "bf16", "bf16_compile"]


def test_hf_layer_smoke_runs_every_row(tmp_path):
    out = tmp_path / "hf_layer.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_layer.py"), "--smoke", "--iters", "1",
                           "--rounds", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    layer = json.loads(out.read_text())["layer"]
    assert layer["variants"] == ROWS and not layer["errors"]
    assert all(math.isfinite(layer["ms_median"][v]) and layer["ms_median"][v] > 0 for v in ROWS)
    assert all(not f for f in layer["fallbacks"].values()), layer["fallbacks"]
    assert layer["traced"] == {"mxfp8_compile": {"served": 1}, "bf16_compile": {"served": 1}}
    # the optimizer refreshes the weight copies: the compiled graph reads them, never quantizes the weight
    assert layer["quantized_in_graph"] == {"mxfp8_compile": 0, "bf16_compile": 0}
    assert all(layer["out_rel_err_vs_unpatched"][v] <= OUT_BOUND for v in ROWS)
