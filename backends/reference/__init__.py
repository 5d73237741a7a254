"""The `spec` backend: runs the NumPy reference, converting torch arguments in and results back.

Only used when named (it is the definition, not a fast path). Torch inputs come back as torch tensors
on the input's device; NumPy inputs come back as NumPy.
"""
from __future__ import annotations

import functools

import numpy as np

import spec
from spec.constants import OPS

from ..convert import device_of, to_numpy, to_torch
from ..registry import declare_backend, register


def _wrap(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        device = device_of(*args, **kwargs)
        out = fn(*to_numpy(list(args)), **{k: to_numpy(v) for k, v in kwargs.items()})
        return out if device is None else to_torch(out, device)

    return run


declare_backend("spec", True, version=f"numpy {np.__version__}")
for _op in OPS:
    register(_op, "spec")(_wrap(getattr(spec, _op)))
