"""The sm90 Gluon kernels (mla_q_gluon's two forward kernels, gemm_gluon's GEMM) compile
offline for sm90 with the installed Triton (3.9 on the CPU CI, through _gluon_compat's shim; 3.6 on the H200,
where the conformance suite also runs them), and the PTX holds the wgmma main loop and the TMA traffic.
No GPU needed: Triton's offline compiler and its bundled ptxas (GPUTarget cuda 90).

The compile runs in a child process without TRITON_INTERPRET: a Gluon module imported under the
interpreter (as this test session's other files do) holds interpreted functions, which the compiler
refuses."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton.experimental.gluon")
compat = pytest.importorskip("backends.triton._gluon_compat")
if compat.version_reasons():
    pytest.skip("; ".join(compat.version_reasons()), allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNELS = {"gluon_ws": 16, "gluon_ws128": 32, "gemm": 32}  # kernel -> wgmma instructions at least

_CHILD = textwrap.dedent("""
    import inspect, json, sys
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type
    from backends.triton import gemm_gluon as GG, mla_q_gluon as QG

    SM90 = GPUTarget("cuda", 90, 32)  # (backend, compute capability, warp size)

    def desc(dtype, block):
        gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.uint8
        t = torch.empty(256, 256, dtype=dtype)
        return mangle_type(TensorDescriptor(t, [256, 256], [256, 1], block, gl.NVMMASharedLayout.get_default_for(block, gdt)))

    def build(fn, types, consts, div16, num_warps):
        # constexpr parameters left out take their defaults, as at a launch (typed as i32 they would
        # become runtime branches and compile code no launch runs)
        consts = dict({p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty},
                      **consts)
        missing = [p.name for p in fn.params if p.is_constexpr and p.name not in consts]
        assert not missing, f"constexpr parameters without a value: {missing}"
        names = fn.arg_names
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
        attrs = {(j,): [["tt.divisibility", 16]] for j, n in enumerate(names) if n in div16}
        src = GluonASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                             attrs=attrs)
        k = triton.compile(src, target=SM90, options={"num_warps": num_warps, "enable_fp_fusion": False})
        ptx = k.asm["ptx"]
        return {"sm_90a": ".target sm_90a" in ptx, "wgmma": ptx.count("wgmma.mma_async"),
                "tma": ptx.count("cp.async.bulk.tensor"), "mbarrier_wait": ptx.count("mbarrier.try_wait"),
                "shared": k.metadata.shared}

    out = {}
    fwd = {"gluon_ws": (QG._mla_q_fwd_gluon_ws_kernel, QG.WS_CONFIGS),
           "gluon_ws128": (QG._mla_q_fwd_gluon_ws128_kernel, QG.WS128_CONFIGS)}
    for name in sys.argv[1:]:
        if name == "gemm":
            cfg = dict(GG.CONFIGS[0]); bk = cfg["BLOCK_K"]
            types = {"a_desc": desc(torch.bfloat16, [GG._TILE_A, bk]), "b_desc": desc(torch.uint8, [GG._TILE_B, bk]),
                     "out_desc": desc(torch.bfloat16, [GG._TILE_A, 64]), "b_scale_ptr": "*u8", "flag_ptr": "*i32"}
            out[name] = build(GG._mxfp8_gemm_gluon_kernel, types, dict(cfg, SWIZZLED=0, IS_E5M2=0, LO=100, HI=150, ODD_STEPS=0),
                              ("b_scale_ptr", "flag_ptr", "M", "N", "K", "stride_sr"), GG.NUM_WARPS)
            continue
        fn, configs = fwd[name]
        cfg = dict(configs[0]); bk = cfg["BLOCK_K"]
        types = {"x_desc": desc(torch.bfloat16, [64, bk]), "wn_desc": desc(torch.bfloat16, [128, bk]),
                 "wr_desc": desc(torch.bfloat16, [64, bk]), "row_nope_desc": desc(torch.uint8, [64, 128]),
                 "row_rope_desc": desc(torch.uint8, [64, 64]), "col_nope_desc": desc(torch.uint8, [64, 128]),
                 "col_rope_desc": desc(torch.uint8, [64, 64]),
                 "cos_ptr": "*fp32", "sin_ptr": "*fp32", "row_scale_ptr": "*u8", "col_scale_ptr": "*u8"}
        out[name] = build(fn, types, cfg, ("cos_ptr", "sin_ptr", "row_scale_ptr", "col_scale_ptr", "T", "K",
                                           "stride_cos", "stride_sin"), QG.NUM_WARPS)
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _CHILD, *KERNELS], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert run.returncode == 0 and line, run.stderr[-4000:]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_gluon_kernel_compiles_for_sm90(compiled, kernel):
    got = compiled[kernel]
    assert got["sm_90a"]
    assert got["wgmma"] >= KERNELS[kernel]
    assert got["tma"] > 0 and got["mbarrier_wait"] > 0  # TMA loads / stores behind mbarriers
    assert got["shared"] <= 232448  # the H200's 227 KB of shared memory per block


def test_shim_binds_the_installed_triton_spelling():
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import tma

    if hasattr(tma, "async_load"):
        assert compat.async_load is tma.async_load and compat.async_store is tma.async_store
    else:
        assert compat.async_load is tma.async_copy_global_to_shared
    assert compat.barrier is (getattr(gl, "thread_barrier", None) or gl.barrier)
