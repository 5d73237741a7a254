"""A workload's Triton kernels compiled side by side at its first launch, from a recorded list.

A first training step compiles each of its kernels when it first launches it, one after another on the
caller's thread; the MXFP8 block's first step spends most of its seconds there. Those compilations are
independent, and most of each runs outside the GIL (MLIR passes, LLVM, ptxas), so on a few threads
they take little more than the longest one -- once the kernels are known before they are launched.

They are known from a recording. `tools/record_pretuned.py` runs each workload (the DeepSeek-V3 block
on one path at a few shapes) under `recording()`, which notes every launch `_common.fast_launch`
resolved: how it was called (the launched object, keyword names, argument values, a tensor by its
dtype and 16-byte alignment) and what it compiled (the JIT function, every parameter's value after
autotuner config, heuristics and defaults, and the compile options). The lists ship per architecture,
as pretuned/<arch>.compile.json (sm90: the H100 and the H200 alike, since every launch config is a
function of the shape, tile_choice.py).

A list is keyed by what a launch specializes on, not by the shape it was recorded at: a call matches
in shape-free form (`call_signature`: constexprs and launch options exactly, a runtime int by its
width and whether it is 1 or a multiple of 16, a runtime float by its type, a TMA descriptor by its
block shape and layout), and Triton compiles once per such specialization -- so one recording serves
every token count, head count and q_lora rank of the DeepSeek-V3 head dims. What does depend on the
shape (a tile the heuristic picks per shape class, a constexpr the kernel takes from a dimension) is
covered by recording the workload at a few shapes: a fresh process compiles the union.

In a later process, the first launch that opens a workload family (one path's workloads, every model
and shape recorded on it: a launch matching their first recorded launch, or any launch that only that
family makes) hands every distinct compilation of the family to background threads, each compiled
with Triton's `warmup` (compiled and loaded, nothing launched) for the launching thread's device; a
launch whose call has compilations pending waits for them instead of compiling again. A workload
never recorded (another model on the same path) so gets the kernels it shares with the recorded ones
compiled ahead from its first launch that matches one of them.

A list only says what to compile: a launch that matches nothing compiles as it always did, a recorded
entry that no longer fits its kernel (another signature) is skipped, a failed background compilation
is dropped (the launch compiles for itself and raises there), and a compilation never changes what a
kernel computes. A TMA descriptor argument (the Gluon kernels') is compiled ahead with a stand-in over a
block-shaped tensor: a kernel specializes on its type, dtype, block shape and layout, not on its
extent. MXMLA_TRITON_COMPILE_AHEAD=0 turns it off.

File format: {"arch", "device", "triton", "torch", "workloads": {name: [{"call": ..., "compile": ...},
...]}, "not_recorded": {name: {kernel: why}}} with "call" the launch's match string (see
`call_signature`; older lists' exact values are read in shape-free form), "device" the GPU it was
recorded on, "compile" {"fn": module.name of the JIT function, "args": its parameters' encoded values
in order, "options": compile options}, and "not_recorded" the kernels a workload launched that the
recording could not note (they compile at their first launch; older lists lack the key).
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
import triton.language as tl

from .. import settings
from . import pretuned

SUFFIX = ".compile.json"

_lock = threading.Lock()
_recording = None  # the Recording that recording() fills while entered
_lists: Dict[str, Optional[dict]] = {}         # arch -> _arch_lists' dict (None: no list)
_pending: Dict[tuple, list] = {}               # (device index, call) -> Futures of its class's compilations
_started: set = set()                          # (device index, workload) handed to the threads
_submitted: set = set()                        # (device index, compile key) handed to the threads
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
    base dtype and alignment, shape, strides, block shape and layout, a Triton element type by its name,
    a plain value with its type."""
    if isinstance(v, torch.Tensor):
        return ["tensor", str(v.dtype).replace("torch.", ""), v.data_ptr() % 16 == 0]
    if v is None or type(v) in (bool, int, float, str):
        return [type(v).__name__, v]
    if type(v) is tl.dtype:  # a scalar element type (not a pointer or block type): rmsnorm backward's DX_DTYPE
        return ["tl_dtype", v.name]
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
    if kind == "tl_dtype" and isinstance(value, str):
        try:
            return tl.dtype(value)  # by its name ("bf16"), as Triton names its element types
        except (AssertionError, ValueError, TypeError):
            raise _Unencodable(f"value {item!r}") from None
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


def _int_class(v: int) -> str:
    """What Triton specializes a non-constexpr int on: its width, and whether it is 1 or a multiple of 16."""
    width = "i32" if -(1 << 31) <= v < (1 << 31) else "i64"
    return f"{width}:{'1' if v == 1 else '16' if v % 16 == 0 else 'n'}"


def _shape_free(item, exact: bool):
    """An encoded value as the specialization it selects: a constexpr (exact) as itself, a runtime int
    by _int_class, a runtime float by its type, a descriptor's shape and strides by _int_class."""
    if exact:
        return item
    kind = item[0]
    if kind == "int" and type(item[1]) is int:
        return ["int", _int_class(item[1])]
    if kind == "float":
        return ["float"]
    if kind == "descriptor":
        return item[:4] + [[_int_class(n) for n in item[4]], [_int_class(n) for n in item[5]]] + item[6:]
    return item


def _shape_free_values(fn, names, values) -> list:
    """values (encoded, named by `names`) with every runtime value replaced by its class; a name that is
    no parameter of fn (a launch option) or a constexpr stays exact. Without fn's parameter list (not
    a JIT function) every value stays exact."""
    params = getattr(fn, "params", None)
    if params is None or not hasattr(fn, "arg_names"):
        return list(values)
    constexprs = {p.name for p in params if p.is_constexpr}
    kernel_params = set(fn.arg_names)
    return [_shape_free(v, n not in kernel_params or n in constexprs) for n, v in zip(names, values)]


def _importable_jit(qualified: str):
    try:
        return _jit_function(qualified)
    except (ImportError, AttributeError, ValueError):  # not importable here: values stay exact
        return None


def _match_string(layers, kwnames, values, fn) -> str:
    arg_names = list(getattr(fn, "arg_names", ()))
    names = arg_names[:len(values) - len(kwnames)] + list(kwnames)
    if len(names) == len(values):
        values = _shape_free_values(fn, names, values)
    return json.dumps([layers, list(kwnames), values], separators=(",", ":"))


def call_signature(kernel, args, kwargs) -> Optional[str]:
    """The match string of a launch (None when an argument has no encoding): the launched object, its
    keyword names and its arguments' values, each runtime value by the specialization it selects
    (_shape_free), so that a launch at any shape of a recorded class of shapes matches."""
    try:
        values = _call_values(args, kwargs)
    except _Unencodable:
        return None
    return _match_string(_layers(kernel), list(kwargs), values, pretuned._base_function(kernel))


def _call_values(args, kwargs) -> list:
    """A launch's arguments encoded, positional then keyword; _Unencodable names the one that is not."""
    values = []
    places = [*((f"argument {i}", a) for i, a in enumerate(args)), *((f"keyword {k}", a) for k, a in kwargs.items())]
    for where, v in places:
        try:
            values.append(_encode(v))
        except _Unencodable as e:
            raise _Unencodable(f"{where}: {e}") from None
    return values


def _normalized_call(stored: str) -> str:
    """A stored call string in the shape-free form call_signature gives (lists recorded before it kept
    runtime values exactly); anything not of the recorded form is kept as it is."""
    try:
        layers, kwnames, values = json.loads(stored)
        return _match_string(layers, kwnames, values, _importable_jit(layers[-1]))
    except (ValueError, TypeError):
        return stored


def _compile_key(spec: dict) -> str:
    """What an entry compiles: its function, its constexprs and runtime values' classes, its options."""
    fn = _importable_jit(spec["fn"])
    values = spec["args"]
    if len(getattr(fn, "arg_names", ())) == len(values):
        values = _shape_free_values(fn, list(fn.arg_names), values)
    return json.dumps([spec.get("fn"), values, spec.get("options")], sort_keys=True, separators=(",", ":"))


def enabled() -> bool:
    return not settings.interpret_mode() and settings.flag("MXMLA_TRITON_COMPILE_AHEAD")


# --------------------------------------------------------------------------------------------------
# recording
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Recording:
    """What `recording()` collected. launches: call string -> entry, in launch order. skipped: kernel
    name -> why one of its launches could not be noted (it compiles at its first launch in every
    process, so a list with gaps says where they are instead of losing them silently)."""
    launches: Dict[str, dict] = dataclasses.field(default_factory=dict)
    skipped: Dict[str, str] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def recording():
    """Collect the launches fast_launch resolves while entered: yields the `Recording` it fills.
    Launches resolved before (kept by fast_launch) are not seen again: record in a fresh process, or
    after `_common.clear_fast_launches()`."""
    global _recording
    with _lock:
        if _recording is not None:
            raise RuntimeError("compile_ahead.recording() is already active")
        _recording = Recording()
        out = _recording
    try:
        yield out
    finally:
        with _lock:
            _recording = None


def is_recording() -> bool:
    return _recording is not None


def kernel_name(kernel) -> str:
    """The launched object's JIT function as module.name (through Autotuner / Heuristics layers)."""
    return _layers(kernel)[-1]


def skip(kernel, why: str) -> None:
    """fast_launch's hook for a launch it could not reproduce while recording: noted as a gap."""
    rec = _recording
    if rec is not None:
        rec.skipped.setdefault(kernel_name(kernel), why)


def encode_launch(names: List[str], merged: dict):
    """(encoded parameter values in `names` order, compile options) of a resolved launch; raises
    _Unencodable naming what a list cannot hold."""
    missing = [n for n in names if n not in merged]
    if missing:
        raise _Unencodable(f"no value for parameter {missing[0]}")
    values = []
    for n in names:
        try:
            values.append(_encode(merged[n]))
        except _Unencodable as e:
            raise _Unencodable(f"parameter {n}: {e}") from None
    options = {k: v for k, v in merged.items() if k not in names and k in _OPTIONS
               and (v is None or type(v) in (bool, int, float, str))}
    return values, options


def note(kernel, args, kwargs, fn, merged) -> None:
    """fast_launch's hook after a launch it could reproduce: fn the JIT function, merged every
    parameter's value and the options as the launch resolved them."""
    rec = _recording
    if rec is None:
        return
    call = call_signature(kernel, args, kwargs)
    if call is None:
        try:
            _call_values(args, kwargs)
        except _Unencodable as e:  # what made call_signature give up
            rec.skipped.setdefault(kernel_name(kernel), f"unencodable {e}")
        return
    if call in rec.launches:
        return
    try:
        values, options = encode_launch(list(fn.arg_names), merged)
    except _Unencodable as e:
        rec.skipped.setdefault(kernel_name(kernel), f"unencodable {e}")
        return
    rec.launches[call] = {"call": call, "compile": {"fn": f"{fn.__module__}.{fn.__name__}", "args": values,
                                                    "options": options}}


# the launch keywords that are compile options, not kernel parameters (what Config.all_kwargs and a
# launch pass besides the parameters)
_OPTIONS = frozenset(("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid",
                      "launch_pdl", "num_buffers_warp_spec", "num_consumer_groups", "reg_dec_producer",
                      "reg_inc_consumer"))


def write(path: str, arch_name: str, device: str, workloads: Dict[str, List[dict]],
          not_recorded: Optional[Dict[str, Dict[str, str]]] = None) -> None:
    """The list file; not_recorded (workload -> kernel -> why, `Recording.skipped`) documents the
    kernels that compile at their first launch anyway."""
    import triton

    with open(path, "w") as f:
        json.dump({"arch": arch_name, "device": device, "triton": triton.__version__, "torch": torch.__version__,
                   "workloads": workloads, "not_recorded": not_recorded or {}}, f, indent=1, sort_keys=True)


# --------------------------------------------------------------------------------------------------
# compiling ahead
# --------------------------------------------------------------------------------------------------
def arch(index: int) -> str:
    """The lists' name for a device: its compute capability ('sm90' for the H100 and the H200)."""
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def _arch_lists(name: str) -> Optional[dict]:
    """The lists of an architecture, their calls in shape-free form: {"workloads": name -> entries,
    "index": call -> workloads making it, "openers": call -> workloads whose first launch it is}."""
    with _lock:
        if name in _lists:
            return _lists[name]
    try:
        with open(os.path.join(pretuned.DIR, name + SUFFIX)) as f:
            workloads = json.load(f).get("workloads", {})
    except (FileNotFoundError, ValueError):  # none recorded, or unreadable: compile as usual
        workloads = None
    lists = None
    if workloads is not None:
        index: Dict[str, List[str]] = {}
        openers: Dict[str, List[str]] = {}
        for wname, entries in workloads.items():
            for i, e in enumerate(entries):
                e["call"] = _normalized_call(e["call"])
                if wname not in index.setdefault(e["call"], []):
                    index[e["call"]].append(wname)
                if i == 0:
                    openers.setdefault(e["call"], []).append(wname)
        lists = {"index": index, "openers": openers, "workloads": workloads}
    with _lock:
        return _lists.setdefault(name, lists)


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
    """fast_launch's hook before a launch it has not resolved yet (the one that compiles): start the
    workloads it opens, then wait for the background compilations of its call's class, if any.

    A launch opens a whole family of workloads (`family`: one path's, every model and shape recorded
    on it; their union is compiled, each distinct compilation once): the families of the workloads
    whose first recorded launch it matches, else the one family whose workloads make its call. So the
    first launch of a workload that was never recorded starts its path's recorded kernels as soon as
    one of its launches matches one of theirs (the kernels it shares with them are then compiled
    ahead; the others as they launch). A call workloads of several families make without opening
    them (the bf16 and MXFP8 blocks' k RoPE backward) opens none."""
    if not enabled() or not torch.cuda.is_available():
        return
    call = call_signature(kernel, args, kwargs)
    if call is None:
        return
    index = torch.cuda.current_device()
    lists = _arch_lists(arch(index))
    if lists is not None:
        names = lists["openers"].get(call) or lists["index"].get(call, ())
        families = {family(n) for n in names}
        if len(families) == 1 or call in lists["openers"]:
            _start(index, lists, [n for n in lists["workloads"] if family(n) in families], call)
    for future in _pending.get((index, call), ()):
        try:
            future.result()
        except Exception:  # noqa: BLE001 - the launch compiles for itself and raises there
            pass


def family(workload: str) -> str:
    """The family a workload's name puts it in: its path, the second word of tools/record_pretuned.py's
    "<model> <path> <shape>" names ("mla_block mxfp8 B1S4096" and "hf_attention mxfp8 B1S4096" are both
    "mxfp8"), a compiled path with its eager one ("mxfp8-compile" is "mxfp8": they launch the same
    kernels, the compiled one a few more, and the weight copies' quantization that a model's construction
    launches is theirs alike, so it opens the family while the model is still being built); a name of
    another form is a family of its own."""
    words = workload.split()
    return words[1].removesuffix("-compile") if len(words) == 3 else workload


def _start(index: int, lists: dict, names, call: str) -> None:
    """Hand the workloads' compilations to the threads in the order a step needs them: the launching
    call's first, then each workload's i-th launch before any (i+1)-th (the threads take them in turn,
    so a kernel the step reaches early is not queued behind another shape's late ones)."""
    with _lock:
        names = [n for n in names if (index, n) not in _started]
        _started.update((index, n) for n in names)
    if not names:
        return
    triton_fingerprint()
    entries = sorted(((e["call"] != call, i, e) for n in names for i, e in enumerate(lists["workloads"][n])),
                     key=lambda t: t[:2])
    for _, _, entry in entries:
        key = (index, _compile_key(entry["compile"]))
        with _lock:
            if key in _submitted:
                continue
            _submitted.add(key)
            future = _pool().submit(_compile, index, entry["compile"])
            _pending.setdefault((index, entry["call"]), []).append(future)


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
    for future in [f for futures in list(_pending.values()) for f in futures]:
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
        _submitted.clear()
