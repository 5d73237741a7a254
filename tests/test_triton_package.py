"""The Triton package: Gluon kernel modules import lazily (a Triton without triton.experimental.gluon
keeps every other op online), private helpers stay inside their op module, and interpreted launches
from several threads give the serial bytes."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from tests.util import triton_interpreter_unusable

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRITON_PKG = ROOT / "backends" / "triton"


def test_without_gluon_every_op_module_still_registers():
    """In a fresh interpreter whose `import triton.experimental.gluon` fails, the triton backend stays
    available and serves quantize and RoPE; the Gluon variants only say why they cannot run."""
    reason = triton_interpreter_unusable()
    if reason:
        pytest.skip(reason)
    script = textwrap.dedent("""
        import builtins, os
        os.environ["TRITON_INTERPRET"] = "1"
        real_import = builtins.__import__
        def no_gluon(name, globals=None, locals=None, fromlist=(), level=0):
            # only mxmla's own imports fail: Triton's runtime imports its Gluon types internally
            ours = (globals or {}).get("__name__", "").startswith("backends")
            wants_gluon = name.startswith("triton.experimental.gluon") or (
                name == "triton.experimental" and fromlist and "gluon" in fromlist)
            if ours and wants_gluon:
                raise ImportError("No module named 'triton.experimental.gluon' (mocked)")
            return real_import(name, globals, locals, fromlist, level)
        builtins.__import__ = no_gluon
        import torch, dispatch, backends
        backends.load()
        info = backends.backend_infos()["triton"]
        assert info.available, info.reasons
        x = torch.randn(32, 64)
        q = dispatch.run("mxfp8_quantize", x, backend="triton")
        ref = dispatch.run("mxfp8_quantize", x, backend="torch")
        assert q.data.view(torch.uint8).equal(ref.data.view(torch.uint8))
        cos = torch.randn(32, 32)
        dispatch.run("rope", torch.randn(32, 2, 64), cos, cos.clone(), backend="triton")
        from backends.triton import mla_q
        w = torch.randn(192, 64).bfloat16()
        print("REASONS", mla_q.gluon_reasons(torch.randn(32, 64).bfloat16(), w))
        print("OK", sorted(op for op in dispatch.backends()[2]["ops"]))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout and "mla_attention" in out.stdout and "rope" in out.stdout
    assert "Gluon unavailable" in out.stdout or "CUDA only" in out.stdout


def _private_imports(path: pathlib.Path):
    """(module, name) of every `from .<op module> import _name` in path."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module and not node.module.startswith("_"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    yield node.module, alias.name


@pytest.mark.parametrize("pkg", ["triton", "torch", "cudnn"])
def test_private_helpers_do_not_cross_op_modules(pkg):
    crossings = [f"{p.name} imports {mod}.{name}" for p in (ROOT / "backends" / pkg).glob("*.py")
                 for mod, name in _private_imports(p)]
    assert not crossings, crossings


def _attention_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    scale = [1.0, 8.0, 1 / 16][seed % 3]
    q = (torch.randn(1, 16, 1, 192, generator=g) * scale).bfloat16()
    k = (torch.randn(1, 16, 1, 192, generator=g) * scale).bfloat16()
    v = (torch.randn(1, 16, 1, 128, generator=g) * scale).bfloat16()
    return q, k, v


def test_interpreted_attention_from_eight_threads_matches_serial_bytes():
    import dispatch

    pytest.importorskip("triton")
    from backends.triton._common import interpret_mode

    if not interpret_mode():
        pytest.skip("checks the interpreter's lock; compiled launches are thread-safe by themselves")
    reason = triton_interpreter_unusable()
    if reason:
        pytest.skip(reason)
    inputs = [_attention_inputs(s) for s in range(8)]
    serial = [dispatch.run("mla_attention", *t, causal=bool(i % 2), backend="triton") for i, t in enumerate(inputs)]
    results = [None] * 8
    barrier = threading.Barrier(8)

    def work(i):
        barrier.wait()
        results[i] = dispatch.run("mla_attention", *inputs[i], causal=bool(i % 2), backend="triton")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (got, want) in enumerate(zip(results, serial)):
        for g, w in zip(got, want):
            assert g.view(torch.uint8 if g.dtype != torch.float32 else torch.int32).equal(
                w.view(torch.uint8 if w.dtype != torch.float32 else torch.int32)), f"thread {i}"
