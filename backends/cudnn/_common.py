"""Shared plumbing of the cuDNN backend: frontend access, versions, capability reasons, handles, streams.

Everything that asks the machine a question (frontend importable? cuDNN version? compute capability?
a package present?) goes through one small function here, so the CPU tests can replace exactly that
answer (tests/test_cudnn_backend.py monkeypatches these module attributes; callers must look them up
through the module, never bind them at import time).
"""
from __future__ import annotations

import importlib.util
import threading
from functools import lru_cache
from typing import Any, Iterable, List, Optional, Tuple

import torch

from spec.mxtensor import MXTensor

from .. import kept


# --------------------------------------------------------------------------------------------------
# Frontend and versions
# --------------------------------------------------------------------------------------------------

def frontend():
    """The nvidia-cudnn-frontend module (`import cudnn`), or None when it does not import."""
    try:
        import cudnn  # noqa: PLC0415  (looked up per call so tests can swap sys.modules["cudnn"])
    except ImportError:
        return None
    return cudnn


def frontend_reasons() -> List[str]:
    if frontend() is None:
        return ["nvidia-cudnn-frontend is not installed (`import cudnn` failed)"]
    return []


def parse_version(text: str) -> Tuple[int, ...]:
    """'1.32.0' -> (1, 32, 0); anything unparsable after the numeric prefix is dropped."""
    out = []
    for part in str(text).split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def frontend_version() -> Tuple[int, ...]:
    fe = frontend()
    return parse_version(getattr(fe, "__version__", "0")) if fe is not None else ()


def backend_version() -> Optional[int]:
    """The loaded cuDNN library version as cuDNN encodes it (9.19.0 -> 91900): the frontend's
    `cudnn.backend_version()` (the library the frontend actually dlopened), else torch's."""
    fe = frontend()
    if fe is not None:
        try:
            return int(fe.backend_version())
        except Exception:  # noqa: BLE001  (no library loadable: fall through to torch's answer)
            pass
    try:
        v = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001
        v = None
    return int(v) if v else None


def version_text(v: Optional[int]) -> str:
    if v is None:
        return "unknown"
    return f"{v // 10000}.{(v // 100) % 100}.{v % 100}"


def version_int(major: int, minor: int, patch: int = 0) -> int:
    return major * 10000 + minor * 100 + patch


def missing_modules(names: Iterable[str]) -> List[str]:
    """Which of the importable module names are absent (find_spec: nothing is imported)."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a missing parent package ("cuda" of "cuda.bindings")
            found = False
        if not found:
            missing.append(name)
    return missing


# --------------------------------------------------------------------------------------------------
# Devices
# --------------------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _capability(index: int) -> Tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def device_capability(device: torch.device) -> Tuple[int, int]:
    """(major, minor) compute capability of a CUDA device."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def tensors_of(values: Iterable[Any]):
    """Every torch tensor among the values (an MXTensor gives its data and scale)."""
    for v in values:
        if isinstance(v, MXTensor):
            if isinstance(v.data, torch.Tensor):
                yield v.data
            if isinstance(v.scale, torch.Tensor):
                yield v.scale
        elif isinstance(v, torch.Tensor):
            yield v


def cuda_reasons(values: Iterable[Any]) -> List[str]:
    """The backend runs on one CUDA device with torch tensors."""
    reasons = []
    values = list(values)
    for i, v in enumerate(values):
        arr = v.data if isinstance(v, MXTensor) else v
        if hasattr(arr, "shape") and hasattr(arr, "dtype") and not isinstance(arr, torch.Tensor):
            reasons.append(f"argument {i} is a {type(arr).__name__}, the cudnn backend takes torch tensors")
    devices = {t.device for t in tensors_of(values)}
    for dev in devices:
        if dev.type != "cuda":
            reasons.append(f"inputs are on {dev}: the cudnn backend needs CUDA tensors")
    if len({d for d in devices if d.type == "cuda"}) > 1:
        reasons.append(f"inputs span several CUDA devices {sorted(str(d) for d in devices)}")
    return reasons


def first_device(values: Iterable[Any]) -> Optional[torch.device]:
    for t in tensors_of(values):
        return t.device
    return None


def capability_reasons(device: Optional[torch.device], what: str, min_cc=None, major_only=None) -> List[str]:
    """Compute-capability gate: `min_cc` (major, minor) lower bound, or `major_only` (one major)."""
    if device is None:
        return []  # no tensor: cuda_reasons already said why
    cc = device_capability(device)
    if major_only is not None and cc[0] != major_only:
        return [f"{what} needs compute capability {major_only}.x (sm{major_only}0 family), "
                f"{device} is {cc[0]}.{cc[1]}"]
    if min_cc is not None and tuple(cc) < tuple(min_cc):
        return [f"{what} needs compute capability >= {min_cc[0]}.{min_cc[1]}, {device} is {cc[0]}.{cc[1]}"]
    return []


# --------------------------------------------------------------------------------------------------
# Handles and streams
# --------------------------------------------------------------------------------------------------

_tls = threading.local()  # cuDNN forbids sharing one handle between host threads
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(device: torch.device) -> int:
    """cudaStream_t of torch's current stream on `device` (0 off CUDA, for the CPU tests)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _RAW_STREAM is not None:
        return int(_RAW_STREAM(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


class _Launch:
    """Per (thread, device): the frontend module, a cuDNN handle, and one workspace per stream."""

    __slots__ = ("fe", "handle", "workspaces", "stream")

    def __init__(self, fe, handle):
        self.fe, self.handle, self.workspaces, self.stream = fe, handle, {}, None


def _launch_state(device: torch.device) -> _Launch:
    cache = getattr(_tls, "launch", None)
    if cache is None:
        cache = _tls.launch = {}
    key = (device.type, device.index)
    state = cache.get(key)
    if state is None:
        fe = frontend()
        if device.type == "cuda":
            with torch.cuda.device(device):
                handle = fe.create_handle()
        else:
            handle = fe.create_handle()
        state = cache[key] = _Launch(fe, handle)
    return state


def handle_for(device: torch.device):
    """This thread's cuDNN handle for `device`, bound to torch's current stream.

    `cudnn.set_stream` is called only when torch's stream differs from the one last bound, so the
    steady state costs a dict lookup and the raw-stream query."""
    state = _launch_state(device)
    stream = current_stream_handle(device)
    if stream != state.stream:
        state.fe.set_stream(state.handle, stream)
        state.stream = stream
    return state.handle


def launch(device: torch.device, workspace_bytes: int):
    """(handle on torch's current stream, workspace of >= workspace_bytes or None).

    The workspace is kept per (thread, device, stream) and grows when a graph needs more: work on
    one stream is ordered, so graphs on that stream can share it, and a buffer replaced by a larger
    one goes back to torch's caching allocator, which reuses it only in that stream's order. It is
    kept only where `backends.kept.may_keep` allows (the default stream, outside capture): inside a
    CUDA graph's capture or CUDA-graph trees' warm-up (side streams whose allocations go to the graph's
    pool) each call gets its own, freed when the call returns."""
    state = _launch_state(device)
    stream = current_stream_handle(device)
    if stream != state.stream:  # the handle is this thread's own: no one else moves its stream
        state.fe.set_stream(state.handle, stream)
        state.stream = stream
    if not workspace_bytes:
        return state.handle, None
    ws = state.workspaces.get(stream)
    if ws is None or ws.numel() < workspace_bytes:
        ws = torch.empty((workspace_bytes,), dtype=torch.uint8, device=device)
        if kept.may_keep(device):
            state.workspaces[stream] = ws
    return state.handle, ws


def reset_handles() -> None:
    """Forget this thread's handles and workspaces (tests swap the frontend module)."""
    _tls.launch = {}
