"""A workload's Triton kernels compiled side by side at its first launch, from a recorded list.

A first training step compiles each of its kernels when it first launches it, one after another on the
caller's thread; the MXFP8 block's first step spends most of its seconds there. Those compilations are
independent, and most of each runs outside the GIL (MLIR passes, LLVM, ptxas), so on a few threads
they take little more than the longest one -- once the kernels are known before they are launched.

They are known from a recording. `tools/record_pretuned.py` runs each workload (the DeepSeek-V3 block
on one path at one shape) under `recording()`, which notes every launch `_common.fast_launch`
resolved: how it was called (the launched object, keyword names, argument values, a tensor by its
dtype and 16-byte alignment) and what it compiled (the JIT function, every parameter's value after
autotuner config, heuristics and defaults, and the compile options). The lists ship as
pretuned/<device slug>.compile.json beside the autotuning table. In a later process on that GPU model,
the first launch matching a call that one workload alone makes hands the rest of that workload to
background threads, each compiled with Triton's `warmup` (compiled and loaded, nothing launched) for
the launching thread's device; a launch whose kernel is still compiling there waits for that
compilation instead of doing it twice.

A list only says what to compile: a launch that matches nothing compiles as it always did, a recorded
entry that no longer fits its kernel (another signature) is skipped, a failed background compilation
is dropped (the launch compiles for itself and raises there), and a compilation never changes what a
kernel computes. A TMA descriptor argument (the Gluon kernels') is compiled ahead with a stand-in over a
block-shaped tensor: a kernel specializes on its type, dtype, block shape and layout, not on its
extent. MXMLA_TRITON_COMPILE_AHEAD=0 turns it off.

File format: {"device", "triton", "torch", "workloads": {name: [{"call": ..., "compile": ...}, ...]}}
with "call" the launch's match string (see `call_signature`) and "compile" {"fn": module.name of the
JIT function, "args": its parameters' encoded values in order, "options": compile options}.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import threading
from typing import Dict, List, Optional

import torch

from .. import settings
from . import pretuned

SUFFIX = ".compile.json"

_lock = threading.Lock()
_recording: Optional[Dict[str, dict]] = None  # call -> entry, while recording() is entered
_lists: Dict[str, Optional[dict]] = {}         # device name -> {"index": call -> [workload], "workloads"}
_pending: Dict[tuple, object] = {}             # (device index, call) -> Future of its compilation
_started: set = set()                          # (device index, workload) handed to the threads
_POOL = None


class _Unencodable(Exception):
    pass


def _qualified(obj_type) -> str:
    return f"{obj_type.__module__}.{obj_type.__qualname__}"


def _layout(layout):
    """A descriptor's shared-memory layout (a Gluon layout dataclass) as [class, fields], or None."""
    if layout is None:
        return None
    if not dataclasses.is_dataclass(layout):
        raise _Unencodable(f"layout {type(layout).__name__}")
    fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout) if f.init}
    try:
        json.dumps(fields)
    except TypeError:
        raise _Unencodable(f"layout {layout!r}") from None
    return [_qualified(type(layout)), fields, repr(layout)]


def _encode(v):
    """A launch value as JSON: a tensor by dtype and 16-byte alignment, a TMA descriptor by its type,
    base dtype and alignment, shape, strides, block shape and layout, a plain value with its type."""
    if isinstance(v, torch.Tensor):
        return ["tensor", str(v.dtype).replace("torch.", ""), v.data_ptr() % 16 == 0]
    if v is None or type(v) in (bool, int, float, str):
        return [type(v).__name__, v]
    if type(v).__name__ == "TensorDescriptor" and isinstance(getattr(v, "base", None), torch.Tensor):
        extra = {k: getattr(v, k) for k in ("padding", "round_f32_to_tf32") if hasattr(v, k)}
        if any(x is not None and type(x) not in (bool, int, float, str) for x in extra.values()):
            raise _Unencodable("descriptor options")
        return ["descriptor", _qualified(type(v)), str(v.base.dtype).replace("torch.", ""),
                v.base.data_ptr() % 16 == 0, list(v.shape), list(v.strides), list(v.block_shape),
                _layout(getattr(v, "layout", None)), extra]
    raise _Unencodable(type(v).__name__)


def _class(qualified: str):
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _descriptor(item, device):
    """A stand-in descriptor for warmup: what the kernel's specialization reads (type, dtype, block
    shape, layout) over a block-shaped tensor on `device` (nothing is launched)."""
    _, cls, dtype, aligned, _, _, block, layout, extra = item
    if not aligned:
        raise _Unencodable("a misaligned descriptor base")
    base = torch.empty(block, dtype=getattr(torch, dtype), device=device)
    kwargs = dict(extra)
    if layout is not None:
        made = _class(layout[0])(**layout[1])
        if repr(made) != layout[2]:  # rebuilt differently: its specialization would not match
            raise _Unencodable(f"layout {layout[2]}")
        kwargs["layout"] = made
    return _class(cls)(base, list(base.shape), list(base.stride()), list(block), **kwargs)


def _decode(item, device="cuda"):
    """The stand-in Triton's warmup takes for an encoded value (a tensor: its dtype; a descriptor: one
    over a block-shaped tensor on `device`)."""
    kind, value = item[0], item[1]
    if kind == "descriptor":
        return _descriptor(item, device)
    if kind == "tensor":
        if not item[2]:
            raise _Unencodable("a misaligned pointer")  # warmup's stand-in is always aligned
        return getattr(torch, value)
    if kind == "NoneType":
        return None
    if kind == "float" and type(value) in (int, float):
        return float(value)
    if kind in ("bool", "int", "str") and type(value).__name__ == kind:
        return value
    raise _Unencodable(f"value {item!r}")


def _layers(kernel) -> List[str]:
    """The launched object's wrapper kinds (Autotuner, Heuristics) down to its JIT function's
    qualified name."""
    base = pretuned._base_function(kernel)
    out = []
    while kernel is not base:
        out.append(type(kernel).__name__)
        kernel = kernel.fn
    out.append(f"{getattr(base, '__module__', '?')}.{getattr(base, '__name__', '?')}")
    return out


def call_signature(kernel, args, kwargs) -> Optional[str]:
    """The match string of a launch (None when an argument has no encoding)."""
    try:
        values = [_encode(v) for v in (*args, *kwargs.values())]
    except _Unencodable:
        return None
    return json.dumps([_layers(kernel), list(kwargs), values], separators=(",", ":"))


def enabled() -> bool:
    return not settings.interpret_mode() and settings.flag("MXMLA_TRITON_COMPILE_AHEAD")


# --------------------------------------------------------------------------------------------------
# recording
# --------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def recording():
    """Collect the launches fast_launch resolves while entered: yields the dict it fills (call string
    -> entry), in launch order. Launches resolved before (kept by fast_launch) are not seen again:
    record in a fresh process, or after `_common.clear_fast_launches()`."""
    global _recording
    with _lock:
        if _recording is not None:
            raise RuntimeError("compile_ahead.recording() is already active")
        _recording = {}
        out = _recording
    try:
        yield out
    finally:
        with _lock:
            _recording = None


def is_recording() -> bool:
    return _recording is not None


def note(kernel, args, kwargs, fn, merged) -> None:
    """fast_launch's hook after a launch it could reproduce: fn the JIT function, merged every
    parameter's value and the options as the launch resolved them."""
    rec = _recording
    if rec is None:
        return
    call = call_signature(kernel, args, kwargs)
    if call is None or call in rec:
        return
    names = list(fn.arg_names)
    try:
        values = [_encode(merged[n]) for n in names]
        options = {k: v for k, v in merged.items() if k not in names and k in _OPTIONS
                   and (v is None or type(v) in (bool, int, float, str))}
    except (_Unencodable, KeyError):
        return
    rec[call] = {"call": call, "compile": {"fn": f"{fn.__module__}.{fn.__name__}", "args": values,
                                           "options": options}}


# the launch keywords that are compile options, not kernel parameters (what Config.all_kwargs and a
# launch pass besides the parameters)
_OPTIONS = frozenset(("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid",
                      "launch_pdl", "num_buffers_warp_spec", "num_consumer_groups", "reg_dec_producer",
                      "reg_inc_consumer"))


def write(path: str, device: str, workloads: Dict[str, List[dict]]) -> None:
    import triton

    with open(path, "w") as f:
        json.dump({"device": device, "triton": triton.__version__, "torch": torch.__version__,
                   "workloads": workloads}, f, indent=1, sort_keys=True)


# --------------------------------------------------------------------------------------------------
# compiling ahead
# --------------------------------------------------------------------------------------------------
def _device_lists(device_name: str) -> Optional[dict]:
    with _lock:
        if device_name not in _lists:
            path = os.path.join(pretuned.DIR, pretuned.device_slug(device_name) + SUFFIX)
            try:
                with open(path) as f:
                    workloads = json.load(f).get("workloads", {})
            except (FileNotFoundError, ValueError):  # none recorded, or unreadable: compile as usual
                _lists[device_name] = None
                return None
            index: Dict[str, List[str]] = {}
            for name, entries in workloads.items():
                for e in entries:
                    index.setdefault(e["call"], []).append(name)
            _lists[device_name] = {"index": index, "workloads": workloads}
        return _lists[device_name]


def _pool():
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)),
                                   thread_name_prefix="mxmla-compile-ahead")
    return _POOL


def _jit_function(qualified: str):
    return pretuned._base_function(_class(qualified))


def _compile(index: int, spec: dict) -> None:
    fn = _jit_function(spec["fn"])
    if len(fn.arg_names) != len(spec["args"]):
        raise _Unencodable("the recorded entry no longer fits its kernel")
    torch.cuda.set_device(index)  # Triton compiles for the thread's current device
    stand_ins = [_decode(a) for a in spec["args"]]
    fn.warmup(*stand_ins, grid=(1,), **spec["options"])


def before_compile(kernel, args, kwargs) -> None:
    """fast_launch's hook before a launch it has not resolved yet (the one that compiles): wait for
    this launch's background compilation if one runs, else, if it opens a recorded workload, start
    the workload's other compilations."""
    if not enabled() or not torch.cuda.is_available():
        return
    call = call_signature(kernel, args, kwargs)
    if call is None:
        return
    index = torch.cuda.current_device()
    future = _pending.get((index, call))
    if future is not None:
        try:
            future.result()
        except Exception:  # noqa: BLE001 - the launch compiles for itself and raises there
            pass
        return
    lists = _device_lists(torch.cuda.get_device_name(index))
    if lists is None:
        return
    workloads = lists["index"].get(call, ())
    if len(workloads) != 1:  # a call several workloads make (the bf16 and MXFP8 blocks' k RoPE) opens none
        return
    with _lock:
        if (index, workloads[0]) in _started:
            return
        _started.add((index, workloads[0]))
    triton_fingerprint()
    for entry in lists["workloads"][workloads[0]]:
        key = (index, entry["call"])
        if entry["call"] == call or key in _pending:
            continue
        _pending[key] = _pool().submit(_compile, index, entry["compile"])


def triton_fingerprint() -> None:
    """Triton's compiler fingerprint (a hash of its sources and its 500 MB library, kept per process),
    computed once here: every thread's first compile or cache lookup needs it, and threads that start
    without it each compute it."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        try:
            from triton.compiler.compiler import triton_key
        except ImportError:  # another Triton layout: each thread computes its own
            return
    triton_key()


def wait() -> None:
    """Return once every compilation started here is done (failed ones are dropped)."""
    for future in list(_pending.values()):
        try:
            future.result()
        except Exception:  # noqa: BLE001 - the kernel's own launch compiles it and raises there
            pass


def reset() -> None:
    """Forget loaded lists, started workloads and finished compilations (tests)."""
    wait()
    with _lock:
        _lists.clear()
        _pending.clear()
        _started.clear()
