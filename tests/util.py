"""Shared test helpers: byte comparison, seeded inputs at several magnitudes, special values, poison."""
from __future__ import annotations

import functools
import os

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
F8E4M3 = ml_dtypes.float8_e4m3fn
F8E5M2 = ml_dtypes.float8_e5m2

# The test run's Triton mode, read once here (after tests/conftest.py turned the interpreter on where
# no GPU is): Triton fixes a kernel's mode when the kernel is defined, so a test that sets the
# variable later still gets compiled kernels, which refuse CPU tensors.
TRITON_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def subprocess_env(root, **overrides) -> dict:
    """os.environ for a child Python that imports this repository (`root`) first, with `overrides`: the
    repository goes before the PYTHONPATH already set, which is kept (it may hold installed packages,
    such as a site directory of optional extras)."""
    env = dict(os.environ, **overrides)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    return env


@functools.lru_cache(maxsize=None)
def triton_interpreter_unusable():
    """Why the installed Triton's interpreter cannot run mxmla's kernels here, or None. Triton's
    interpreter before 3.9 (seen with 3.6) indexes a runtime loop bound with int() of a one-element
    array, which the installed NumPy may refuse (checked here, not assumed)."""
    try:
        import triton
    except ImportError:
        return "triton is not installed"
    major_minor = tuple(int(p) for p in triton.__version__.split(".")[:2])
    if major_minor >= (3, 9):
        return None
    try:
        int(np.array([1]))
    except TypeError:
        return (f"Triton {triton.__version__}'s interpreter calls int() on one-element arrays, which NumPy "
                f"{np.__version__} refuses (Triton 3.9's interpreter does not)")
    return None


def skip_without_triton_interpreter() -> None:
    """Skip a test that runs Triton kernels on CPU tensors unless the test run uses the interpreter."""
    import pytest

    pytest.importorskip("triton")
    if not TRITON_INTERPRETER:
        pytest.skip("Triton on CPU tensors needs the interpreter from the start of the test run "
                    "(tests/conftest.py sets TRITON_INTERPRET=1 where no GPU is)")
    reason = triton_interpreter_unusable()
    if reason:
        pytest.skip(reason)


def as_bytes(a) -> np.ndarray:
    """Raw bytes of a NumPy array or torch tensor (any dtype) as a flat uint8 array."""
    if hasattr(a, "detach"):  # torch
        from backends.convert import to_numpy

        a = to_numpy(a)
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.uint8)


def assert_bytes_equal(actual, expected, what: str = "") -> None:
    """Byte-for-byte equality; on failure report count and first mismatching element."""
    a, e = np.ascontiguousarray(_np(actual)), np.ascontiguousarray(_np(expected))
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert a.dtype.itemsize == e.dtype.itemsize, f"{what}: itemsize {a.dtype} != {e.dtype}"
    ab, eb = as_bytes(a), as_bytes(e)
    if not np.array_equal(ab, eb):
        k = a.dtype.itemsize
        bad = np.nonzero((ab != eb).reshape(-1, k).any(axis=1))[0]
        i = int(bad[0])
        idx = np.unravel_index(i, a.shape) if a.ndim else ()
        raise AssertionError(
            f"{what}: {bad.size} of {a.size} elements differ; first at {idx}: "
            f"got {a.reshape(-1)[i]!r} (0x{ab[i*k:(i+1)*k].tobytes().hex()}), "
            f"expected {e.reshape(-1)[i]!r} (0x{eb[i*k:(i+1)*k].tobytes().hex()})"
        )


def _np(a):
    if hasattr(a, "detach"):
        from backends.convert import to_numpy

        return to_numpy(a)
    return np.asarray(a)


def random_magnitudes(rng: np.random.Generator, shape, dtype=np.float32) -> np.ndarray:
    """Normal data with each row scaled by a magnitude from 2^-30 to 2^30 (several binades)."""
    x = rng.standard_normal(shape).astype(np.float64)
    if len(shape) >= 1 and x.size:  # an empty shape (all sequence lengths 0) has no rows to scale
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        mags = 2.0 ** rng.integers(-30, 31, size=rows)
        x = (x.reshape(rows, -1) * mags[:, None]).reshape(shape)
    return x.astype(np.float32).astype(dtype)


def special_values_f32() -> np.ndarray:
    """fp32 values every quantizer must handle: zeros, subnormals, format maxima, non-finite, and
    values one ulp either side of powers of two."""
    f32 = np.float32
    vals = [
        0.0, -0.0, 1.0, -1.0, 448.0, -448.0, 480.0, -480.0, 449.0, 57344.0, -57344.0, 61440.0,
        2.0 ** -6, 2.0 ** -9, 2.0 ** -14, 2.0 ** -16, 2.0 ** -126, 2.0 ** -127, 2.0 ** -149,
        float(np.finfo(np.float32).max), float(ml_dtypes.finfo(BF16).max),
        float(ml_dtypes.finfo(BF16).smallest_subnormal), float(ml_dtypes.finfo(BF16).smallest_normal),
        np.inf, -np.inf, np.nan,
    ]
    for p in (-10, -1, 0, 1, 8, 9, 15, 16):
        v = f32(2.0 ** p)
        vals += [np.nextafter(v, f32(0)), np.nextafter(v, f32(np.inf))]
    return np.array(vals, dtype=np.float32)


def poison_like(a) -> np.ndarray:
    """An array of a's shape and dtype filled with 0xFF bytes (NaN for floats)."""
    out = np.empty_like(np.asarray(a))
    out.view(np.uint8)[...] = 0xFF
    return out


def poisoned_empty(shape, dtype, device):
    """torch.empty filled with 0xFF bytes (NaN floats, NaN codes, scale 255): the allocator tests give
    a backend's `_empty`, so that an element the kernel never writes fails the byte comparison."""
    import torch

    t = torch.empty(shape, dtype=dtype, device=device)
    t.view(torch.uint8).fill_(0xFF)
    return t


# --------------------------------------------------------------------------------------------------
# the warp-specialized kernels' barrier protocols, modelled (tests/test_*_protocol.py)
# --------------------------------------------------------------------------------------------------
class MBarrier:
    """Arrival count per phase; `phase` = completed phases. wait(parity) passes when the phase with that
    parity has completed, i.e. the current (incomplete) phase's parity differs from it -- PTX
    mbarrier.try_wait.parity."""

    def __init__(self, count: int):
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.phase += 1
            self.pending = self.count

    def passes(self, parity: int) -> bool:
        return (self.phase & 1) != parity


def interleave(actors, rng, progress, patience=100_000) -> bool:
    """Step randomly chosen live actors (generators that yield while they wait) until all finish: True;
    False when `progress()` has not changed for `patience` steps in a row (a deadlock)."""
    live = list(actors)
    idle = 0
    while live:
        actor = rng.choice(live)
        before = progress()
        try:
            next(actor)
        except StopIteration:
            live.remove(actor)
            idle = 0
            continue
        idle = idle + 1 if progress() == before else 0
        if idle >= patience:
            return False
    return True


def load_tool(name: str):
    """The module of the script tools/<name>.py (tools/ is no package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
