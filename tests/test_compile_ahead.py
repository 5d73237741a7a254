"""compile_ahead: a recorded workload's kernels handed to background compilation at the launch that
opens it, each distinct compilation once, a launch waiting for its call's pending compilations, calls
matched by what Triton specializes on (not the shape), and the recording fast_launch feeds. On the CPU, Triton's compile is a recorder (the fast_launch tests' toy kernel) and
the compile of an entry is a stand-in JIT function whose warmup records its arguments; the GPU run of
the recorded DeepSeek-V3 lists is in BENCHMARKS.md (first step)."""
import json
import time

import pytest
import torch

pytest.importorskip("triton")
from backends.triton import _common, compile_ahead, pretuned  # noqa: E402
from tests.test_fast_launch import _launch, toy  # noqa: E402, F401 (fixture)


class _FakeJit:
    """A JIT function stand-in: arg_names, and warmup recording (stand-ins, options)."""

    def __init__(self, names, log, delay=0.0):
        self.arg_names = names
        self.log, self.delay = log, delay

    def warmup(self, *args, grid, **options):
        time.sleep(self.delay)
        self.log.append((args, options))


def _entry(call, fn="pkg.mod._k", args=(["tensor", "bfloat16", True], ["int", 4096], ["bool", True]),
           options=None):
    return {"call": call, "compile": {"fn": fn, "args": [list(a) for a in args],
                                      "options": options or {"num_warps": 4}}}


@pytest.fixture
def gpu_lists(tmp_path, monkeypatch):
    """A fake sm90 CUDA device whose compile list lives in tmp_path; yields (write, log,
    jits): write(workloads) stores the list, jits maps fn names to _FakeJit."""
    log, jits = [], {}
    monkeypatch.setattr(pretuned, "DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(compile_ahead, "_jit_function", lambda name: jits[name])
    monkeypatch.setattr(compile_ahead, "triton_fingerprint", lambda: None)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MXMLA_TRITON_COMPILE_AHEAD", raising=False)
    compile_ahead.reset()

    def write(workloads):
        path = tmp_path / ("sm90" + compile_ahead.SUFFIX)
        path.write_text(json.dumps({"arch": "sm90", "device": "Fake GPU", "workloads": workloads}))
        compile_ahead.reset()

    yield write, log, jits
    compile_ahead.reset()


def test_encoding_round_trip_and_refusals():
    x = torch.zeros(8, dtype=torch.bfloat16)
    assert compile_ahead._encode(x) == ["tensor", "bfloat16", True]
    assert compile_ahead._encode(x[1:])[2] is False  # 2-byte offset: not 16-byte aligned
    for v in (7, 1.5, True, "s", None):
        assert compile_ahead._decode(compile_ahead._encode(v)) == v
        assert type(compile_ahead._decode(compile_ahead._encode(v))) is type(v)
    assert compile_ahead._decode(["tensor", "float8_e4m3fn", True]) is torch.float8_e4m3fn
    assert compile_ahead._decode(["float", 2]) == 2.0 and type(compile_ahead._decode(["float", 2])) is float
    import triton.language as tl

    for dtype in (tl.bfloat16, tl.float16, tl.float32):  # constexpr element types (rmsnorm backward's DX_DTYPE)
        assert compile_ahead._encode(dtype) == ["tl_dtype", dtype.name]
        assert compile_ahead._decode(compile_ahead._encode(dtype)) == dtype
    assert compile_ahead.call_signature(object(), (), {"D": tl.bfloat16}) != \
        compile_ahead.call_signature(object(), (), {"D": tl.float32})
    for bad in (["int", True], ["int", "3"], ["bool", 1], ["tensor", "bfloat16", False], ["list", []],
                ["tl_dtype", "arange"], ["tl_dtype", 3]):
        with pytest.raises(compile_ahead._Unencodable):
            compile_ahead._decode(bad)
    with pytest.raises(compile_ahead._Unencodable):
        compile_ahead._encode(object())
    # True and 1 are different calls (a bool and an int argument specialize differently)
    assert compile_ahead.call_signature(object(), (True,), {}) != compile_ahead.call_signature(object(), (1,), {})
    assert compile_ahead.call_signature(object(), (object(),), {}) is None


def test_descriptor_encoding_and_stand_in():
    gluon = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon import language as gl

    base = torch.zeros(256, 192, dtype=torch.bfloat16)
    layout = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    desc = gluon.TensorDescriptor(base, [256, 192], [192, 1], [64, 64], layout)
    item = compile_ahead._encode(desc)
    assert item[:7] == ["descriptor", f"{type(desc).__module__}.{type(desc).__qualname__}", "bfloat16", True,
                        [256, 192], [192, 1], [64, 64]]
    json.dumps(item)  # storable
    made = compile_ahead._decode(json.loads(json.dumps(item)), device="cpu")
    # what a kernel specializes on is kept; the base is a block-shaped stand-in
    assert type(made) is type(desc) and made.base.dtype == torch.bfloat16
    assert list(made.block_shape) == [64, 64] and repr(made.layout) == repr(layout)
    assert list(made.base.shape) == [64, 64]
    stale = json.loads(json.dumps(item))
    stale[7][2] = "NVMMASharedLayout(other)"  # a layout that rebuilds differently: refused
    with pytest.raises(compile_ahead._Unencodable):
        compile_ahead._decode(stale, device="cpu")
    misaligned = json.loads(json.dumps(item))
    misaligned[3] = False  # a base off 16 bytes: the stand-in (aligned) would specialize otherwise
    with pytest.raises(compile_ahead._Unencodable):
        compile_ahead._decode(misaligned, device="cpu")


def test_recording_notes_what_the_launch_resolved(toy):  # noqa: F811
    kernel, log = toy
    x, y = torch.zeros(64), torch.zeros(64)
    with compile_ahead.recording() as rec:
        _launch(kernel, x, y, 1000)
        _launch(kernel, x, y, 1000)  # a kept launch: not seen again
        with pytest.raises(RuntimeError, match="already active"):
            with compile_ahead.recording():
                pass
    assert not compile_ahead.is_recording()
    launches = rec.launches
    assert rec.skipped == {}
    assert len(launches) == 1
    (entry,) = launches.values()
    assert entry["call"] == compile_ahead.call_signature(kernel, (x, y, 1000), {"scale": 0.5, "enable_fp_fusion": False})
    spec = entry["compile"]
    assert spec["fn"].endswith("._toy")
    # every parameter in order: tensors by dtype, n, scale, the config's BLOCK, the heuristic's MASKED,
    # the default MODE; the options from the config and the launch
    assert spec["args"] == [["tensor", "float32", True], ["tensor", "float32", True], ["int", 1000],
                            ["float", 0.5], ["int", 128], ["bool", True], ["int", 3]]
    assert spec["options"]["num_warps"] == 4 and spec["options"]["enable_fp_fusion"] is False
    _launch(kernel, x, y, 1024)  # outside recording(): nothing noted
    assert len(launches) == 1


def test_recording_names_the_launches_it_cannot_note(toy, monkeypatch):  # noqa: F811
    """A launch the list cannot hold is a named gap, never a silent one: the recorder keeps the
    kernel and why (its first launch will compile in every process)."""
    kernel, _ = toy
    x, y = torch.zeros(64), torch.zeros(64)
    with compile_ahead.recording() as rec:
        _launch(kernel, x, y, 1000, scale=[0.5])  # a value no list encodes
    assert rec.launches == {}
    assert list(rec.skipped) == ["tests.test_fast_launch._toy"]
    assert "unhashable" in rec.skipped["tests.test_fast_launch._toy"]
    with compile_ahead.recording() as rec:
        _launch(kernel, x, y, 1000, scale=1j)  # hashable, but no list holds a complex
    assert rec.launches == {}
    assert "scale" in rec.skipped["tests.test_fast_launch._toy"]

    _common.clear_fast_launches()
    monkeypatch.setattr(_common, "_resolve_launch", lambda *a: None)
    with compile_ahead.recording() as rec:
        _launch(kernel, x, y, 1000)
    assert rec.launches == {}
    assert "could not be reproduced" in rec.skipped["tests.test_fast_launch._toy"]


def test_calls_match_by_specialization_not_shape(toy):  # noqa: F811
    """Triton compiles once per constexpr values and runtime-value class (an int's width, == 1, a
    multiple of 16): calls differing only within a class are one call."""
    kernel, _ = toy
    x, y = torch.zeros(64), torch.zeros(64)

    def sig(n, scale=0.5, **kw):
        return compile_ahead.call_signature(kernel, (x, y, n), {"scale": scale, "enable_fp_fusion": False, **kw})

    assert sig(1024) == sig(4096) == sig(16 * 12345)
    assert len({sig(1024), sig(1000), sig(1), sig(1 << 33)}) == 4
    assert sig(1024, scale=0.25) == sig(1024)
    assert sig(1024, MODE=4) != sig(1024, MODE=5)  # a constexpr exactly
    assert sig(1024) != compile_ahead.call_signature(kernel, (x, y.double(), 1024), {"scale": 0.5, "enable_fp_fusion": False})
    # a list recorded with exact values reads in the same form
    exact = json.dumps([compile_ahead._layers(kernel), ["scale", "enable_fp_fusion"],
                        [["tensor", "float32", True], ["tensor", "float32", True], ["int", 2048], ["float", 0.1],
                         ["bool", False]]])
    read = compile_ahead._match_string(*json.loads(exact), compile_ahead.pretuned._base_function(kernel))
    assert read == sig(4096)


def _n(n):
    """An entry's compile arguments differing in the int (a distinct compilation per n)."""
    return (["tensor", "bfloat16", True], ["int", n], ["bool", True])


def test_opening_launch_compiles_its_workloads_ahead(gpu_lists, monkeypatch):
    write, log, jits = gpu_lists
    jits["pkg.mod._k"] = _FakeJit(["x", "n", "FLAG"], log)
    # two workloads opened by the same first call (one path at two shapes): their union, each distinct
    # compilation once; w3 starts elsewhere
    write({"w1": [_entry("s", args=_n(1)), _entry("a", args=_n(2)),
                  _entry("b", args=(["tensor", "float8_e4m3fn", True], ["int", 1], ["bool", False])),
                  _entry("c", args=_n(2), options={"num_warps": 8, "maxnreg": 128})],
           "w2": [_entry("s", args=_n(1)), _entry("s", args=_n(3)), _entry("a", args=_n(2))],
           "w3": [_entry("t", args=_n(4)), _entry("e", args=_n(5))]})
    monkeypatch.setattr(compile_ahead, "call_signature", lambda kernel, args, kwargs: args[0])  # calls by name
    compile_ahead.before_compile(None, ("zzz",), {})  # matches nothing: nothing starts
    compile_ahead.wait()
    assert log == []
    compile_ahead.before_compile(None, ("s",), {})  # waits for s's two compilations
    assert {a[1] for a, _ in log} >= {1, 3}
    compile_ahead.wait()
    assert sorted(log, key=repr) == sorted([
        ((torch.bfloat16, 1, True), {"num_warps": 4}),
        ((torch.bfloat16, 3, True), {"num_warps": 4}),
        ((torch.bfloat16, 2, True), {"num_warps": 4}),
        ((torch.float8_e4m3fn, 1, False), {"num_warps": 4}),
        ((torch.bfloat16, 2, True), {"num_warps": 8, "maxnreg": 128}),
    ], key=repr)
    compile_ahead.before_compile(None, ("c",), {})  # started already: nothing again
    compile_ahead.wait()
    assert len(log) == 5
    compile_ahead.before_compile(None, ("e",), {})  # only w3 makes it: w3 opens
    compile_ahead.wait()
    assert len(log) == 7


def test_compilations_start_in_the_order_a_step_needs_them(gpu_lists, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    write, log, jits = gpu_lists
    jits["pkg.mod._k"] = _FakeJit(["x", "n", "FLAG"], log)
    write({"w1": [_entry("s", args=_n(1)), _entry("a", args=_n(2)), _entry("b", args=_n(3))],
           "w2": [_entry("s", args=_n(4)), _entry("c", args=_n(5)), _entry("a", args=_n(2)), _entry("d", args=_n(6))]})
    monkeypatch.setattr(compile_ahead, "call_signature", lambda kernel, args, kwargs: args[0])
    monkeypatch.setattr(compile_ahead, "_POOL", ThreadPoolExecutor(max_workers=1))  # one thread: start order
    compile_ahead.before_compile(None, ("s",), {})
    compile_ahead.wait()
    assert [a[1] for a, _ in log] == [1, 4, 2, 5, 3, 6]


def test_a_call_several_workloads_make_opens_none(gpu_lists, monkeypatch):
    write, log, jits = gpu_lists
    jits["pkg.mod._k"] = _FakeJit(["x", "n", "FLAG"], log)
    write({"bf16": [_entry("q", args=_n(1)), _entry("k", args=_n(2))],
           "mxfp8": [_entry("r", args=_n(3)), _entry("k", args=_n(2))]})
    monkeypatch.setattr(compile_ahead, "call_signature", lambda kernel, args, kwargs: args[0])
    compile_ahead.before_compile(None, ("k",), {})
    compile_ahead.wait()
    assert log == []


def test_a_call_of_one_path_opens_that_paths_whole_family(gpu_lists, monkeypatch):
    """Workloads named "<model> <path> <shape>" form one family per path. A launch that is no recorded
    workload's first (a model never recorded, e.g. another DeepSeek-V3-head-dims attention) opens the
    family as soon as it matches any launch only that family makes: every model and shape of the path,
    not the other path's; a call both paths make opens none."""
    write, log, jits = gpu_lists
    jits["pkg.mod._k"] = _FakeJit(["x", "n", "FLAG"], log)
    write({"mla_block mxfp8 B1S4096": [_entry("norm32", args=_n(1)), _entry("q", args=_n(2)), _entry("kbwd", args=_n(3))],
           "mla_block mxfp8 B1S16384": [_entry("norm32", args=_n(1)), _entry("q", args=_n(2)), _entry("x", args=_n(4))],
           "hf_attention mxfp8 B1S4096": [_entry("norm16", args=_n(5)), _entry("q", args=_n(2))],
           "mla_block bf16 B1S4096": [_entry("r", args=_n(6)), _entry("kbwd", args=_n(3))]})
    monkeypatch.setattr(compile_ahead, "call_signature", lambda kernel, args, kwargs: args[0])
    assert compile_ahead.family("mla_block mxfp8 B1S4096") == compile_ahead.family("hf_attention mxfp8 B1S4096")
    compile_ahead.before_compile(None, ("norm_other",), {})  # an unrecorded workload's first launch
    compile_ahead.before_compile(None, ("kbwd",), {})  # both paths make it: nothing opens
    compile_ahead.wait()
    assert log == []
    compile_ahead.before_compile(None, ("q",), {})  # the mxfp8 workloads make it (no first launch)
    compile_ahead.wait()
    assert sorted(a[1] for a, _ in log) == [1, 2, 3, 4, 5]  # every mxfp8 compilation, once; not bf16's 6
    compile_ahead.before_compile(None, ("r",), {})  # the bf16 block's first launch opens its family
    compile_ahead.wait()
    assert sorted(a[1] for a, _ in log) == [1, 2, 3, 4, 5, 6]


def test_a_compiled_path_is_in_its_eager_paths_family(gpu_lists, monkeypatch):
    """The weight copies' quantization, which a model's construction launches, is made by the eager and
    the compiled mxfp8 workloads alike: it opens their one family (the compiled path's extra kernels
    included), so the step's kernels compile while the model is still being built."""
    write, log, jits = gpu_lists
    jits["pkg.mod._k"] = _FakeJit(["x", "n", "FLAG"], log)
    assert compile_ahead.family("mla_block mxfp8-compile B1S4096") == compile_ahead.family("mla_block mxfp8 B1S4096")
    assert compile_ahead.family("mla_block bf16 B1S4096") != compile_ahead.family("mla_block mxfp8-compile B1S4096")
    write({"mla_block mxfp8 B1S4096": [_entry("norm", args=_n(1)), _entry("wq", args=_n(2))],
           "mla_block mxfp8-compile B1S4096": [_entry("norm", args=_n(1)), _entry("deq", args=_n(3)),
                                               _entry("wq", args=_n(2))],
           "mla_block bf16 B1S4096": [_entry("r", args=_n(4))]})
    monkeypatch.setattr(compile_ahead, "call_signature", lambda kernel, args, kwargs: args[0])
    compile_ahead.before_compile(None, ("wq",), {})  # the weight copies' quantization, at construction
    compile_ahead.wait()
    assert sorted(a[1] for a, _ in log) == [1, 2, 3]  # both paths' compilations, once each; not bf16's


def test_launch_waits_for_its_pending_compile(gpu_lists, monkeypatch):
    write, log, jits = gpu_lists
    jits["pkg.mod._k"] = _FakeJit(["x", "n", "FLAG"], log)
    jits["pkg.mod._slow"] = _FakeJit(["x", "n", "FLAG"], log, delay=0.5)
    write({"w": [_entry("a", args=_n(1)), _entry("b", fn="pkg.mod._slow", args=_n(2))]})
    monkeypatch.setattr(compile_ahead, "call_signature", lambda kernel, args, kwargs: args[0])
    compile_ahead.before_compile(None, ("a",), {})  # a's own compilation (fast) waited for, b's runs
    assert len(log) == 1
    compile_ahead.before_compile(None, ("b",), {})  # b's: waited for
    assert len(log) == 2


def test_stale_or_failing_entries_are_dropped(gpu_lists, monkeypatch):
    write, log, jits = gpu_lists
    jits["pkg.mod._k"] = _FakeJit(["x", "n"], log)  # the kernel lost a parameter since the recording
    jits["pkg.mod._ok"] = _FakeJit(["x", "n", "FLAG"], log)
    write({"w": [_entry("a", fn="pkg.mod._ok", args=_n(7)), _entry("b"), _entry("c", fn="pkg.mod._ok"),
                 _entry("d", fn="pkg.mod._ok", args=(["tensor", "bfloat16", False], ["int", 1], ["bool", True]))]})
    monkeypatch.setattr(compile_ahead, "call_signature", lambda kernel, args, kwargs: args[0])
    compile_ahead.before_compile(None, ("a",), {})
    compile_ahead.wait()  # b (stale) and d (a misaligned pointer) fail in the background, quietly
    assert sorted(log, key=repr) == [((torch.bfloat16, 4096, True), {"num_warps": 4}),
                                     ((torch.bfloat16, 7, True), {"num_warps": 4})]
    compile_ahead.before_compile(None, ("b",), {})  # its failed compile: the launch goes on


def test_switch_and_missing_or_unreadable_lists(gpu_lists, monkeypatch, tmp_path):
    write, log, jits = gpu_lists
    jits["pkg.mod._k"] = _FakeJit(["x", "n", "FLAG"], log)
    monkeypatch.setattr(compile_ahead, "call_signature", lambda kernel, args, kwargs: args[0])
    compile_ahead.before_compile(None, ("a",), {})  # no list for this device
    write({"w": [_entry("a"), _entry("b")]})
    monkeypatch.setenv("MXMLA_TRITON_COMPILE_AHEAD", "0")
    compile_ahead.before_compile(None, ("a",), {})
    monkeypatch.setenv("MXMLA_TRITON_COMPILE_AHEAD", "yes")
    with pytest.raises(ValueError, match="MXMLA_TRITON_COMPILE_AHEAD"):
        compile_ahead.before_compile(None, ("a",), {})
    monkeypatch.delenv("MXMLA_TRITON_COMPILE_AHEAD")
    (tmp_path / ("sm90" + compile_ahead.SUFFIX)).write_text("{not json")
    compile_ahead.reset()
    compile_ahead.before_compile(None, ("a",), {})
    compile_ahead.wait()
    assert log == []


def test_fast_launch_consults_it_before_compiling(toy, monkeypatch):  # noqa: F811
    kernel, log = toy
    seen = []
    monkeypatch.setattr(compile_ahead, "before_compile", lambda k, a, kw: seen.append(a[2]))
    x, y = torch.zeros(64), torch.zeros(64)
    _launch(kernel, x, y, 1000)
    _launch(kernel, x, y, 1000)  # kept: compiled already, not asked again
    _launch(kernel, x, y, 2000)
    assert seen == [1000, 2000]


def test_every_launch_of_the_mxfp8_block_is_recordable(monkeypatch):
    """Each Triton launch of the mxfp8 block's forward and backward (the kernels the interpreter runs
    on the CPU) has a call string and parameter values a compile list can hold. A launch passing a value
    no list encodes (as RMSNorm backward's element-type argument once did) would compile at its first
    launch in every process; on a GPU the recorder names such gaps (Recording.skipped), and this finds
    them without one. The Gluon kernels' TMA descriptors are covered by the encoding tests above."""
    import importlib
    import inspect
    import pkgutil
    import sys

    import backends.triton as triton_backend
    from pathlib import Path

    if not _common.interpret_mode():
        pytest.skip("the CPU's view of the launches (the GPU's recorder reports its own gaps)")
    launches = []

    def spy(kernel, grid, *args, **kwargs):
        launches.append((kernel, args, kwargs))
        real(kernel, grid, *args, **kwargs)

    real = _common.fast_launch
    for info in pkgutil.iter_modules(triton_backend.__path__):
        module = importlib.import_module(f"{triton_backend.__name__}.{info.name}")
        if getattr(module, "fast_launch", None) is real:
            monkeypatch.setattr(module, "fast_launch", spy)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples"))
    sys.modules.pop("mla_block", None)
    import mla_block as mb

    cfg = mb.replace(mb.CONFIGS["small"], batch=1, seq=64)
    block = mb.MLABlock(cfg, "mxfp8", quantize_grad=True, backend="triton").reset_parameters(0)
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(cfg.tokens, cfg.hidden, generator=gen).to(torch.bfloat16).requires_grad_(True)
    cos, sin = mb.rope_tables(cfg, torch.device("cpu"))
    block(h, cos, sin).backward(torch.randn(cfg.tokens, cfg.hidden, generator=gen).to(torch.bfloat16))

    kernels, gaps = set(), {}
    for kernel, args, kwargs in launches:
        name = compile_ahead.kernel_name(kernel)
        kernels.add(name.rpartition(".")[2])
        layers, base = [], kernel
        while type(base).__name__ in ("Autotuner", "Heuristics"):  # down to the (interpreted) JIT function
            layers.append(base)
            base = base.fn
        merged = dict(zip(base.arg_names, args))
        merged.update(kwargs)
        for layer in layers:  # a heuristics layer's values, as the launch resolves them
            merged.update({k: rule(merged) for k, rule in getattr(layer, "values", {}).items()})
        for p_name, param in inspect.signature(base.fn).parameters.items():
            if p_name not in merged and param.default is not inspect.Parameter.empty:
                merged[p_name] = param.default
        try:
            compile_ahead._call_values(args, kwargs)
            compile_ahead.encode_launch(list(base.arg_names), merged)
        except compile_ahead._Unencodable as e:
            gaps.setdefault(name, str(e))
    assert gaps == {}
    # the forward's and the backward's kernels both ran, RMSNorm's backward among them
    assert {"_rmsnorm_mxfp8_kernel", "_mla_kv_kernel", "_rope_kernel", "_rmsnorm_backward_kernel"} <= kernels, kernels
