"""Capability checks and helpers shared by the Triton kernels."""
from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import torch
import triton

from spec.mxtensor import MXTensor

from .. import kept, settings
from . import compile_ahead


_DEVICE_FACTS: dict = {}


def _device_fact(fn, pick, device):
    """pick(fn(device)), kept per device. Keyed on the torch function too, so that a test's mock of it
    is asked, not a value cached before."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (fn, pick, index)
    value = _DEVICE_FACTS.get(key)
    if value is None:
        value = _DEVICE_FACTS[key] = pick(fn(torch.device("cuda", index)))
    return value


def _multiprocessors(props) -> int:
    return props.multi_processor_count


def device_capability(device) -> Tuple[int, int]:
    """torch.cuda.get_device_capability(device), kept per device: launch paths ask on every call, and
    the lookup costs tens of microseconds of host time."""
    return _device_fact(torch.cuda.get_device_capability, tuple, device)


def sm_count(device) -> int:
    """The device's multiprocessor count (torch.cuda.get_device_properties), kept per device."""
    return _device_fact(torch.cuda.get_device_properties, _multiprocessors, device)


_PLACEHOLDERS: dict = {}  # (dtype, device) -> a one-element zero tensor


def placeholder(dtype: torch.dtype, device) -> torch.Tensor:
    """A one-element zero tensor for a pointer argument the launch never dereferences (its constexpr
    switch is off), kept per dtype and device: a fresh one per launch costs an allocation and a fill
    kernel. Only for pointers that are neither written nor read as data. Kept only where
    `backends.kept.may_keep` allows (not inside a CUDA graph's capture or CUDA-graph trees' warm-up:
    memory allocated then belongs to the graph's pool)."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    key = (dtype, device)
    t = _PLACEHOLDERS.get(key)
    if t is None:
        t = torch.zeros(1, dtype=dtype, device=device)
        if kept.may_keep(device):
            _PLACEHOLDERS[key] = t
    return t


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids on the host: triton.cdiv is a constexpr function in newer Triton
    releases, whose call costs several microseconds, and grids are computed on every launch."""
    return -(-a // b)


def interpret_mode() -> bool:
    return settings.interpret_mode()


def env_flag(name: str, default: bool) -> bool:
    """A 0 / 1 switch, parsed by backends/settings.py (any other value raises, naming the variable)."""
    return settings.flag(name, default)


def env_choice(name: str, choices: Tuple[str, ...], default: str) -> str:
    """One of `choices`, parsed by backends/settings.py (anything else raises, naming the variable)."""
    return settings.choice(name, choices, default)


def autotune_cached(*, configs, key, heuristic, **kwargs):
    """An autotuner that picks its config without timing by default: tile_choice.tuned."""
    from .tile_choice import tuned

    return tuned(configs=configs, key=key, heuristic=heuristic, **kwargs)


def autotune_enabled() -> bool:
    """MXMLA_TRITON_AUTOTUNE: time the configs per key (1) or take the heuristic / recorded tile (0,
    the default; tile_choice.py)."""
    return settings.flag("MXMLA_TRITON_AUTOTUNE")


# --------------------------------------------------------------------------------------------------
# fast_launch: Triton's launch path without its per-call Python
# --------------------------------------------------------------------------------------------------
# A launch through `kernel[grid](...)` binds every argument, specializes each one, builds the cache key,
# and, behind an autotuner and heuristics, rebuilds argument dicts per layer: tens of microseconds of
# host time per launch, which the MXFP8 block's forward pays a dozen times and which leaves it bound by
# its host issue rate. A call site that launches one kernel with the same argument values over and over
# (a training step) can keep what that resolved to -- the compiled kernel, the autotuner's config, the
# heuristics' values, the grid -- and hand the arguments straight to the compiled kernel's launcher.
#
# The key holds everything the resolution depends on: the kernel object, the current device, every
# argument's value (integers, floats, strings, None, exactly) and, for a tensor, its dtype and whether
# its data pointer is 16-byte aligned (what Triton specializes a pointer on). The first launch of a key
# goes through Triton; its result is kept only when it can be reproduced: a CompiledKernel came back,
# every wrapper layer is an Autotuner (config without pre_hook) or Heuristics, and the values it
# resolved for the constexpr parameters equal the compiled kernel's constants. A TMA tensor descriptor
# enters the key by its base tensor's dtype and alignment, shape, strides, block shape and layout.
# Anything else (an unhashable argument, the interpreter) takes Triton's path. The kept launch goes
# through the compiled kernel's own launcher (CompiledKernel[grid]), which calls Triton's launch hooks
# (profilers) as a launch through Triton does.

_FAST_LAUNCHES: dict = {}
_FAST_LIMIT = 4096  # entries kept at most (distinct shapes); beyond it launches take Triton's path
_NOT_KEPT = object()  # a key whose launch cannot be reproduced
_JIT_TYPES = None


def _jit_types():
    global _JIT_TYPES
    if _JIT_TYPES is None:
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime.autotuner import Autotuner, Heuristics
        from triton.runtime.jit import JITFunction

        _JIT_TYPES = (CompiledKernel, Autotuner, Heuristics, JITFunction)
    return _JIT_TYPES


def _is_descriptor(v) -> bool:
    """A host-side TMA tensor descriptor (triton.tools / Gluon's TensorDescriptor): it holds a tensor."""
    return type(v).__name__ == "TensorDescriptor" and isinstance(getattr(v, "base", None), torch.Tensor)


_PLAIN = frozenset((int, float, bool, str, type(None)))


def _arg_key(v):
    """The key part of a non-plain argument (plain values enter as themselves)."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    if _is_descriptor(v):  # what its specialization and encoding read, the base tensor by dtype and alignment
        base = v.base
        return (type(v), base.dtype, base.data_ptr() % 16 == 0, tuple(v.shape), tuple(v.strides),
                tuple(v.block_shape), getattr(v, "layout", None), getattr(v, "padding", None),
                getattr(v, "round_f32_to_tf32", None))
    return v


def _resolved_values(kernel, args, kwargs):
    """(JIT function, merged) for a launch just made through Triton: merged holds every parameter's
    value and the launch options as the launch resolved them (autotuner config, heuristics, defaults);
    None when a layer is neither an Autotuner with a config without pre-hook nor Heuristics."""
    _, autotuner_type, heuristics_type, jit_type = _jit_types()
    layers, obj = [], kernel
    while not isinstance(obj, jit_type):
        if not isinstance(obj, (autotuner_type, heuristics_type)):
            return None
        layers.append(obj)
        obj = obj.fn
    names = list(obj.arg_names)
    merged = dict(zip(names, args))
    merged.update(kwargs)
    for layer in layers:
        if isinstance(layer, autotuner_type):
            config = getattr(layer, "best_config", None)
            if config is None or config.pre_hook is not None:
                return None
            merged.update(config.all_kwargs())
        else:
            for name, rule in layer.values.items():
                merged[name] = rule(merged)
    for name, param in obj.signature.parameters.items():
        if name not in merged:
            if param.default is inspect.Parameter.empty:
                return None
            merged[name] = param.default
    return obj, merged


def _resolve_launch(kernel, grid, compiled, args, kwargs):
    """(compiled kernel, meta, sources) reproducing the launch just made, or None when it cannot be
    reproduced. meta: the launch's non-tensor values, for the grid function. sources: per kernel
    parameter, (0, i) = positional argument i, (1, name) = keyword argument, (2, value) = a value the
    launch resolved (config, heuristics, default)."""
    if not isinstance(compiled, _jit_types()[0]):
        return None
    values = _resolved_values(kernel, args, kwargs)
    if values is None:
        return None
    obj, merged = values
    names = list(obj.arg_names)
    src = getattr(compiled, "src", None)
    constants = getattr(src, "constants", None)
    if not isinstance(constants, dict):
        return None
    for where, value in constants.items():  # the compiled kernel's constexprs and specialized constants
        if isinstance(where, tuple) and len(where) == 1 and isinstance(where[0], int):
            name = names[where[0]]
        elif isinstance(where, str):
            name = where
        else:
            return None
        mine = merged.get(name)
        if type(mine) is not type(value) and not (isinstance(mine, int) and isinstance(value, int)):
            if not (mine is None and value is None):
                return None
        if mine != value:
            return None
    # what a grid function may read: the non-tensor values (none of the call's tensors stay referenced)
    meta = {k: v for k, v in merged.items() if not isinstance(v, torch.Tensor) and not _is_descriptor(v)}
    if callable(grid):
        try:
            if _grid3(grid(meta)) != _grid3(grid(merged)):
                return None
        except Exception:  # noqa: BLE001 - a grid reading the tensors: not reproducible without them
            return None
    positional = len(args)
    sources = tuple((0, i) if i < positional else (1, n) if n in kwargs else (2, merged[n])
                    for i, n in enumerate(names))
    return compiled, meta, sources


def _grid3(g) -> Tuple[int, int, int]:
    g = tuple(int(n) for n in g)
    return g + (1,) * (3 - len(g))


def fast_launch(kernel, grid, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), with a repeated launch handed straight to the compiled kernel
    (see above). MXMLA_TRITON_FAST_LAUNCH=0 sends every launch through Triton."""
    if interpret_mode() or not settings.flag("MXMLA_TRITON_FAST_LAUNCH"):
        kernel[grid](*args, **kwargs)
        return
    try:
        values = (*args, *kwargs.values())
        # the types enter separately: True == 1 must not share an entry
        key = (kernel, torch.cuda.current_device(), tuple(kwargs), tuple(map(type, values)),
               tuple([v if type(v) in _PLAIN else _arg_key(v) for v in values]))
        entry = _FAST_LAUNCHES.get(key)
    except TypeError:  # an unhashable argument: no key
        compile_ahead.skip(kernel, "an unhashable argument (no launch key)")
        kernel[grid](*args, **kwargs)
        return
    if entry is _NOT_KEPT:
        kernel[grid](*args, **kwargs)
        return
    if entry is not None:
        compiled, meta, sources = entry
        # the grid is evaluated per call: a grid function reads the caller's current sizes (closure)
        compiled[_grid3(grid(meta) if callable(grid) else grid)](
            *[args[v] if s == 0 else kwargs[v] if s == 1 else v for s, v in sources])
        return
    compile_ahead.before_compile(kernel, args, kwargs)  # waits for, or starts, compilations ahead
    compiled = kernel[grid](*args, **kwargs)
    if len(_FAST_LAUNCHES) < _FAST_LIMIT:
        # a launch that cannot be reproduced is remembered too: its next calls skip the resolution
        resolved = _resolve_launch(kernel, grid, compiled, args, kwargs)
        _FAST_LAUNCHES[key] = _NOT_KEPT if resolved is None else resolved
        if compile_ahead.is_recording():
            if resolved is None:
                compile_ahead.skip(kernel, "its launch could not be reproduced (an autotuner config with a pre-hook, "
                                           "a wrapper other than Autotuner / Heuristics, or constants that differ)")
            else:
                compile_ahead.note(kernel, args, kwargs, *_resolved_values(kernel, args, kwargs))


def clear_fast_launches() -> None:
    """Forget every kept launch (tests; a kernel recompiled under the same object)."""
    _FAST_LAUNCHES.clear()


_COMPILER = None  # a ThreadPoolExecutor, made on first use
_GATED_STATE: dict = {}  # (kernel, device index, constexpr items) -> Future of its background compile


def _compiler():
    global _COMPILER
    if _COMPILER is None:
        from concurrent.futures import ThreadPoolExecutor

        _COMPILER = ThreadPoolExecutor(max_workers=4, thread_name_prefix="mxmla-compile")
    return _COMPILER


def _stand_in(v):
    """What the kernel's specialization reads of a launch argument, without holding its memory: a tensor
    becomes its dtype (Triton's warmup takes a dtype for a 16-byte aligned pointer of that type)."""
    return v.dtype if isinstance(v, torch.Tensor) else v


def launch_gated(kernel, grid, flag: torch.Tensor, *args, **kwargs) -> None:
    """Launch an exact-fallback kernel that returns at once unless *flag (an int32 device tensor its
    guard raised) is nonzero. The first call for a (kernel, device, constexprs) on CUDA hands its
    compilation to a background thread (MXMLA_TRITON_BACKGROUND_COMPILE, on by default): the fallback
    almost never runs, so its seconds of compilation need not sit on the caller's first step. Until that
    compilation is done, a call reads the flag on the host (one synchronisation) and, only if it is up,
    waits for the kernel and launches it; once done, launches are gated on the device as always (no
    synchronisation). A background compile that fails is re-raised at the next call."""
    if (interpret_mode() or flag.device.type != "cuda" or not settings.flag("MXMLA_TRITON_BACKGROUND_COMPILE")
            or not hasattr(kernel, "warmup")):
        kernel[grid](*args, **kwargs)
        return
    index = flag.device.index if flag.device.index is not None else torch.cuda.current_device()
    key = (kernel, index, tuple(sorted(kwargs.items())))
    future = _GATED_STATE.get(key)
    if future is None:
        stand_ins = [_stand_in(v) for v in args]
        kw = {k: _stand_in(v) for k, v in kwargs.items()}

        def compile_now():
            torch.cuda.set_device(index)  # Triton compiles for the thread's current device
            kernel.warmup(*stand_ins, grid=grid if not callable(grid) else (1,), **kw)

        future = _GATED_STATE[key] = _compiler().submit(compile_now)
    if future.done() or torch.cuda.is_current_stream_capturing():  # a graph capture cannot read the flag
        future.result()  # a failed compile raises here
        fast_launch(kernel, grid, *args, **kwargs)
        return
    if int(flag.item()):
        future.result()
        kernel[grid](*args, **kwargs)


def wait_background_compiles() -> None:
    """Return once every background compilation launch_gated started is done (a warm-up that must leave
    nothing compiling behind it, e.g. before timing), and every compilation compile_ahead started. A
    failed one raises at its next launch."""
    for future in list(_GATED_STATE.values()):
        try:
            future.result()
        except Exception:  # noqa: BLE001 - re-raised by launch_gated at the kernel's next call
            pass
    compile_ahead.wait()


# Triton's interpreter runs a launch with the grid index and the patched triton.language in module
# globals (triton/runtime/interpreter.py), so concurrent interpreted launches interleave. Re-entrant:
# an op may call another registered op (the MXFP8 backward quantizes its operands).
INTERPRETER_LOCK = threading.RLock()


def serialized(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn, holding INTERPRETER_LOCK for the whole call, with NumPy's floating-point warnings off: the
    interpreter runs the kernel's arithmetic in NumPy, and an overflow to Inf or an invalid operation's
    NaN is the value the GPU computes (IEEE arithmetic raises no error there), not a fault to report."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with INTERPRETER_LOCK, np.errstate(all="ignore"):
            return fn(*args, **kwargs)

    run.unserialized = fn
    return run


def _tensors(args, kwargs):
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, MXTensor):
            yield v.data
            yield v.scale
        elif isinstance(v, torch.Tensor):
            yield v


def triton_reasons(*args: Any, min_capability: Optional[Tuple[int, int]] = None, **kwargs: Any) -> List[str]:
    """Device reasons common to every Triton kernel: torch tensors, on CUDA (or CPU when interpreting),
    and at least `min_capability` on CUDA."""
    reasons = []
    for i, v in enumerate(list(args) + list(kwargs.values())):
        arr = v.data if isinstance(v, MXTensor) else v
        if hasattr(arr, "shape") and hasattr(arr, "dtype") and not isinstance(arr, torch.Tensor):
            reasons.append(f"argument {i} is a {type(arr).__name__}, the triton backend takes torch tensors")
    devices = {t.device for t in _tensors(args, kwargs)}
    for dev in devices:
        if dev.type == "cuda":
            if interpret_mode():
                reasons.append("TRITON_INTERPRET=1 is set: kernels run on the CPU, inputs are on CUDA")
            elif min_capability is not None:
                cc = torch.cuda.get_device_capability(dev)
                if cc < min_capability:
                    reasons.append(f"needs compute capability >= {min_capability[0]}.{min_capability[1]}, "
                                   f"{dev} is {cc[0]}.{cc[1]}")
        elif dev.type == "cpu":
            if not interpret_mode():
                reasons.append("inputs are on the CPU: triton needs CUDA (or TRITON_INTERPRET=1 for testing)")
        else:
            reasons.append(f"unsupported device {dev}")
    return reasons


# --------------------------------------------------------------------------------------------------
# cache keys that do not depend on the order they were first computed in
# --------------------------------------------------------------------------------------------------
# Triton's on-disk cache key of a kernel holds its JITFunction's source key, which folds in the
# constexpr globals its callees use. Triton 3.6 reads a callee's globals before computing that
# callee's key, so a callee whose key no one has computed yet adds none: a kernel's key then depends
# on which other kernels were hashed before it -- in a training step, on how the compile-ahead threads
# and the caller's thread interleave -- and a second process can miss the entries the first one wrote
# (on the H200 the quantize and kv kernels were compiled again in a second process this way). Computing
# every key callees first makes each key the complete one whatever ran before: callers read finished
# callees. Later Tritons compute the callee's key first; the walk is then only an early computation.
_SETTLED: set = set()
_SETTLE_LOCK = threading.Lock()


def _callees(fn) -> List[Any]:
    """The JIT functions fn's source names: its globals and closure variables, and attributes of the
    modules it names."""
    py = getattr(fn, "fn", None)
    code = getattr(py, "__code__", None)
    if code is None:
        return []
    names = sorted(set(code.co_names) | set(code.co_freevars))
    closure = dict(zip(code.co_freevars, (c.cell_contents for c in py.__closure__ or ())))
    found = []
    for name in names:
        val = closure[name] if name in closure else fn.__globals__.get(name)
        if _is_jit(val):
            found.append(val)
        elif inspect.ismodule(val) and not val.__name__.startswith("triton"):
            found.extend(v for v in (getattr(val, n, None) for n in names) if _is_jit(v))
    return found


def _is_jit(obj) -> bool:
    # looked up on the class: hasattr on the instance would compute the key (a property) out of order
    return isinstance(getattr(type(obj), "cache_key", None), property) and hasattr(obj, "fn")


def settle_cache_keys(namespace: dict) -> None:
    """Compute the source key of every JIT function in `namespace` (a module's globals), callees first
    (see above). Call at the end of a module defining kernels, before another thread can launch them."""
    if interpret_mode():  # the interpreter keeps no compiled cache
        return
    with _SETTLE_LOCK:

        def visit(fn):
            if id(fn) in _SETTLED:
                return
            _SETTLED.add(id(fn))
            for callee in _callees(fn):
                visit(callee)
            try:
                fn.cache_key  # noqa: B018 - computed and kept by Triton
            except Exception:  # noqa: BLE001 - the kernel's launch computes it again and raises there
                fn.hash = None  # Triton leaves its recursion placeholder in place of a key that raised

        for name in sorted(namespace):
            obj = namespace[name]
            while not _is_jit(obj) and hasattr(obj, "fn"):  # an autotuner or heuristics wrapper
                obj = obj.fn
            if _is_jit(obj) and getattr(obj, "__module__", None) == namespace.get("__name__"):
                visit(obj)
