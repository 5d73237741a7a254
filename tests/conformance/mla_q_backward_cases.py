"""Inputs and the byte check of the MXFP8 backward's route tests (test_mla_q_triton_routes.py):
exact-arithmetic cases, so any fp32 summation order gives spec's sum
and the outputs compare as bytes."""
from __future__ import annotations

import zlib

import numpy as np

from tests.test_mla_q import exact_case
from tests.util import BF16, assert_bytes_equal

D = 192  # a head's q features (128 no-RoPE + 64 RoPE)


def case_rng(*parts):
    """A generator seeded by the tag (stable across runs and processes)."""
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def backward_case(tag, tokens=64, k=64, heads=2):
    """(x, w, cos, sin, dq): exact x / w / tables, and a sparse +-1 / 0.5 output gradient whose first
    token row is zero (a fully masked query row)."""
    rng = case_rng(tag)
    x, w, cos, sin, _, _, _ = exact_case(rng, tokens=tokens, k=k, heads=heads)
    dq = rng.choice([0.0, 1.0, -1.0, 0.5], size=(tokens, heads, D), p=[0.7, 0.1, 0.1, 0.1])
    dq[0] = 0.0
    return x.astype(BF16), w.astype(BF16), cos.astype(np.float32), sin.astype(np.float32), dq


def check_dx_dw(got, want):
    assert_bytes_equal(got[0], want[0], "dx")
    assert_bytes_equal(got[1], want[1], "dw")
