"""Triton cache keys of the package's kernels do not depend on the order they were first computed in
(backends/triton/_common.py, settle_cache_keys): the walk computes callees before callers, never
computes a key by merely inspecting an object, leaves a key Triton refuses uncomputed (its launch
raises), and importing the package (and a Gluon module) leaves every kernel's key computed, the same in
two processes. JIT source keys are pure Python (no GPU), so this runs compiled-mode Triton on the CPU in
a child process (the test session runs the interpreter, where the walk does nothing)."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["MXMLA_BACKGROUND_LOAD"] = "0"
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_settle_computes_callees_first_and_inspection_computes_nothing(tmp_path):
    (tmp_path / "kern_mod.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        LEAF_BITS = tl.constexpr(0x7F)

        @triton.jit
        def leaf(x):
            return x & LEAF_BITS

        @triton.jit
        def middle(x):
            return leaf(x) + 1

        @triton.jit
        def kernel(p):
            tl.store(p, middle(tl.load(p)))

        tuned = triton.heuristics({"UNUSED": lambda args: 1})(kernel)

        def host_helper(x):
            return x

        @triton.jit
        def broken(p):  # names a plain Python function: Triton refuses its key
            tl.store(p, host_helper(tl.load(p)))
    """))
    proc = _run(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import triton.runtime.jit as jit
        from backends.triton import _common
        import kern_mod
        order = []
        real = jit.JITFunction.cache_key.fget

        def recorded(self):
            if self.hash is None:
                order.append(self.__name__.rsplit(".", 1)[-1])
            return real(self)

        jit.JITFunction.cache_key = property(recorded)
        assert _common._is_jit(kern_mod.leaf) and not _common._is_jit(kern_mod.tuned)
        assert kern_mod.leaf.hash is None, "inspecting a function computed its key"
        assert [f.__name__ for f in _common._callees(kern_mod.kernel)] == ["middle"]
        _common.settle_cache_keys(vars(kern_mod))
        print(order)
        assert order.index("leaf") < order.index("middle") < order.index("kernel"), order
        assert all(f.hash is not None for f in (kern_mod.leaf, kern_mod.middle, kern_mod.kernel))
        assert kern_mod.broken.hash is None, kern_mod.broken.hash  # left for its launch to raise
        try:
            kern_mod.broken.cache_key
        except RuntimeError:  # Triton 3.6 and 3.9: "Unsupported function referenced"
            pass
        else:
            raise AssertionError("the broken kernel's key computed")
        print("OK")
    """)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_import_leaves_every_kernel_key_computed_and_stable():
    code = """
        import hashlib, importlib, sys
        import backends.triton as bt
        from backends.triton import _common
        for gluon in ("mla_q_gluon", "gemm_gluon"):  # imported by their op modules when they launch
            try:
                importlib.import_module("backends.triton." + gluon)
            except ImportError:  # a Triton without Gluon
                pass
        keys = {}
        for mod_name in sorted(m for m in sys.modules if m.startswith("backends.triton.")):
            mod = sys.modules[mod_name]
            for name, obj in sorted(vars(mod).items()):
                if _common._is_jit(obj) and obj.__module__ == mod.__name__:
                    assert obj.hash is not None, f"{mod.__name__}.{name}: key not computed at import"
                    keys[mod.__name__ + "." + name] = obj.hash
        print(len(keys), hashlib.sha256(repr(sorted(keys.items())).encode()).hexdigest())
    """
    first, second = _run(code), _run(code)
    assert first.returncode == 0, first.stderr[-3000:]
    assert second.returncode == 0, second.stderr[-3000:]
    count = int(first.stdout.split()[0])
    assert count > 50, first.stdout
    assert first.stdout == second.stdout
