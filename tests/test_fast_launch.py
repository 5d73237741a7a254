"""_common.fast_launch: a repeated launch reproduces exactly what Triton's own path resolved (argument
order, autotuner config, heuristics, defaults, grid), and every launch it cannot reproduce goes through
Triton. On the CPU the kernel's compile-and-launch step is replaced by a recorder (a fake compiled
kernel carrying the constants Triton would bake in), so the resolution logic runs without a GPU; the
CUDA test runs real kernels both ways and compares bytes."""
import gc
import weakref

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from backends.triton import _common  # noqa: E402


def _toy(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr, MASKED: tl.constexpr, MODE: tl.constexpr = 3):
    pass


class _Compiled:
    """Stands in for triton's CompiledKernel: `constants` as ASTSource keeps them, launches recorded."""

    def __init__(self, constants, log):
        self.src = type("Src", (), {"constants": constants})()
        self.log = log

    def __getitem__(self, grid):
        def run(*args):
            self.log.append(("fast", grid, args))
        return run


@pytest.fixture
def toy(monkeypatch):
    """(kernel: autotune(heuristics(jit)), log of launches). The jit's run records the bound values
    Triton would launch with and returns a compiled stand-in whose constants are the constexprs."""
    log = []
    compiled_cache = {}
    # a JITFunction itself: under TRITON_INTERPRET=1 (the CPU suite) @triton.jit makes an interpreted one
    jit = JITFunction(_toy)

    def fake_run(*args, grid, warmup, **kwargs):
        names = jit.arg_names
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        bound.setdefault("MODE", 3)
        values = tuple(bound[n] for n in names)
        g = grid(bound) if callable(grid) else grid
        log.append(("triton", tuple(g), values))
        constants = {(i,): bound[n] for i, n in enumerate(names) if n in ("BLOCK", "MASKED", "MODE")}
        key = tuple(sorted(constants.items()))
        return compiled_cache.setdefault(key, _Compiled(constants, log))

    monkeypatch.setattr(jit, "run", fake_run)
    heur = triton.heuristics({"MASKED": lambda a: a["n"] % a["BLOCK"] != 0})(jit)
    tuned = triton.autotune(configs=[triton.Config({"BLOCK": 128}, num_warps=4)], key=["n"])(heur)
    monkeypatch.setattr(_common, "_JIT_TYPES", (_Compiled,) + _common._jit_types()[1:])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MXMLA_TRITON_FAST_LAUNCH", raising=False)
    _common.clear_fast_launches()
    yield tuned, log
    _common.clear_fast_launches()


def _launch(kernel, x, y, n, scale=0.5):
    _common.fast_launch(kernel, lambda m: (triton.cdiv(n, m["BLOCK"]),), x, y, n, scale=scale,
                        enable_fp_fusion=False)


def _values(entry):
    return [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in entry[2]]


def test_repeat_launch_reproduces_triton(toy):
    kernel, log = toy
    x, y = torch.zeros(64), torch.zeros(64)
    _launch(kernel, x, y, 1000)
    x2, y2 = torch.zeros(64), torch.zeros(64)  # other buffers, same dtype and alignment
    _launch(kernel, x2, y2, 1000)
    assert [e[0] for e in log] == ["triton", "fast"]
    triton_values = _values(log[0])
    fast_values = _values(log[1])
    # same order and resolved values (config BLOCK=128, heuristic MASKED, default MODE); new pointers
    assert fast_values[2:] == triton_values[2:] == [1000, 0.5, 128, True, 3]
    assert fast_values[:2] == [x2.data_ptr(), y2.data_ptr()]
    assert log[1][1] == (8, 1, 1) and log[0][1] == (8,)


def test_changed_value_or_switch_goes_through_triton(toy, monkeypatch):
    kernel, log = toy
    x, y = torch.zeros(64), torch.zeros(64)
    _launch(kernel, x, y, 1000)
    _launch(kernel, x, y, 1024)          # another n: its own resolution (MASKED False)
    _launch(kernel, x, y, 1000, 0.25)    # another scalar value
    _launch(kernel, x, y.to(torch.float16), 1000)  # another dtype
    assert [e[0] for e in log] == ["triton"] * 4
    assert _values(log[1])[5] is False
    monkeypatch.setenv("MXMLA_TRITON_FAST_LAUNCH", "0")
    _launch(kernel, x, y, 1000)
    assert log[-1][0] == "triton"
    monkeypatch.setenv("MXMLA_TRITON_FAST_LAUNCH", "1")
    _launch(kernel, x, y, 1000)
    assert log[-1][0] == "fast"
    monkeypatch.setenv("MXMLA_TRITON_FAST_LAUNCH", "yes")
    with pytest.raises(ValueError, match="MXMLA_TRITON_FAST_LAUNCH"):
        _launch(kernel, x, y, 1000)


def test_misaligned_pointer_is_another_key(toy):
    kernel, log = toy
    buf = torch.zeros(80)
    _launch(kernel, buf[:64], buf[:64], 1000)
    _launch(kernel, buf[1:65], buf[:64], 1000)  # 4-byte offset: Triton specializes on 16-byte alignment
    assert [e[0] for e in log] == ["triton", "triton"]


def test_grid_read_per_call(toy):
    kernel, log = toy
    x, y = torch.zeros(64), torch.zeros(64)
    for rows in (3, 5):
        _common.fast_launch(kernel, lambda m: (rows, triton.cdiv(1000, m["BLOCK"])), x, y, 1000, scale=0.5)
    assert [e[0] for e in log] == ["triton", "fast"]
    assert log[1][1] == (5, 8, 1)


def test_grid_reading_a_tensor_is_not_kept(toy):
    kernel, log = toy
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(2):
        _common.fast_launch(kernel, lambda m: (m["x_ptr"].numel(),), x, y, 1000, scale=0.5)
    assert [e[0] for e in log] == ["triton", "triton"]


def test_unreproducible_launches_are_not_kept(toy, monkeypatch):
    kernel, log = toy
    x, y = torch.zeros(64), torch.zeros(64)
    # a config with a pre_hook (it must run before every launch)
    kernel.configs[0].pre_hook = lambda nargs: None
    for _ in range(2):
        _launch(kernel, x, y, 1000)
    assert [e[0] for e in log] == ["triton", "triton"]
    assert list(_common._FAST_LAUNCHES.values()) == [_common._NOT_KEPT]  # remembered: no second resolution
    kernel.configs[0].pre_hook = None
    _common.clear_fast_launches()
    # resolved values that disagree with the compiled kernel's constants: not kept
    real = kernel.fn.fn.run

    def lying_run(*args, **kwargs):
        compiled = real(*args, **kwargs)
        return _Compiled({k: (v + 1 if isinstance(v, int) and not isinstance(v, bool) else v)
                          for k, v in compiled.src.constants.items()}, log)

    monkeypatch.setattr(kernel.fn.fn, "run", lying_run)
    log.clear()
    for _ in range(2):
        _launch(kernel, x, y, 1000)
    assert [e[0] for e in log] == ["triton", "triton"]


def test_unhashable_argument_goes_through_triton(toy):
    kernel, log = toy
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(2):
        _common.fast_launch(kernel, (1,), x, y, 1000, scale=[0.5])
    assert [e[0] for e in log] == ["triton", "triton"]


def test_descriptor_key(toy):
    """A TMA descriptor enters the key by what its encoding reads; its base tensor is not held."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    kernel, log = toy
    base = torch.zeros(64, 64)
    other = torch.zeros(64, 64)
    d = lambda t, block: TensorDescriptor(t, list(t.shape), list(t.stride()), block)  # noqa: E731
    _launch(kernel, d(base, [16, 16]), base, 1000)
    _launch(kernel, d(other, [16, 16]), base, 1000)   # same description, another tensor: kept launch
    _launch(kernel, d(other, [32, 16]), base, 1000)   # another block shape: Triton
    _launch(kernel, d(other[:32], [16, 16]), base, 1000)  # another shape: Triton
    assert [e[0] for e in log] == ["triton", "fast", "triton", "triton"]
    assert log[1][2][0].base is other
    ref = weakref.ref(base)
    del base, other
    log.clear()
    gc.collect()
    assert ref() is None


def test_kept_launch_holds_no_tensor(toy):
    kernel, log = toy
    x, y = torch.zeros(64), torch.zeros(64)
    ref = weakref.ref(x)
    _launch(kernel, x, y, 1000)
    del x
    log.clear()
    gc.collect()
    assert ref() is None
    assert len(_common._FAST_LAUNCHES) == 1 and list(_common._FAST_LAUNCHES.values())[0] is not _common._NOT_KEPT


def test_interpreter_goes_through_triton(toy, monkeypatch):
    kernel, log = toy
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(2):
        _launch(kernel, x, y, 1000)
    assert [e[0] for e in log] == ["triton", "triton"]
    assert not _common._FAST_LAUNCHES  # nothing kept, nothing remembered


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fast_launch_bytes_equal(monkeypatch):
    """The wired kernels (quantize, dequantize, rmsnorm, rope) give the same bytes through the kept
    launch as through Triton, on fresh buffers, and the launches are kept."""
    import dispatch

    monkeypatch.delenv("MXMLA_TRITON_FAST_LAUNCH", raising=False)
    g = torch.Generator(device="cpu").manual_seed(3)
    x = (torch.randn(256, 4, 192, generator=g) * 3).to(torch.bfloat16).cuda()
    c = (torch.randn(256, 1536, generator=g)).to(torch.bfloat16).cuda()
    gamma = torch.rand(1536, generator=g).cuda()
    cos, sin = torch.rand(256, 64, generator=g).cuda(), torch.rand(256, 64, generator=g).cuda()

    def outputs():
        q = dispatch.run("mxfp8_quantize", x, axis=-1, backend="triton")
        qs = dispatch.run("mxfp8_quantize", x, axis=0, backend="triton")
        d = dispatch.run("mxfp8_dequantize", q, out_dtype="bfloat16", backend="triton")
        yr, yc, rstd = dispatch.run("rmsnorm_mxfp8", c, gamma, backend="triton")
        r = dispatch.run("rope", x, cos, sin, layout="thd", backend="triton")
        ts = [q.data, q.scale, qs.data, qs.scale, d, yr.data, yr.scale, yc.data, yc.scale, rstd, r]
        return [t.view(torch.uint8) if t.dtype.itemsize == 1 else t.contiguous().view(torch.uint8) for t in ts]

    _common.clear_fast_launches()
    monkeypatch.setenv("MXMLA_TRITON_FAST_LAUNCH", "0")
    ref = outputs()
    monkeypatch.setenv("MXMLA_TRITON_FAST_LAUNCH", "1")
    first = outputs()
    kept = sum(v is not _common._NOT_KEPT for v in _common._FAST_LAUNCHES.values())
    again = outputs()
    torch.cuda.synchronize()
    assert kept >= 5
    for a, b, c2 in zip(ref, first, again):
        assert torch.equal(a, b) and torch.equal(a, c2)

