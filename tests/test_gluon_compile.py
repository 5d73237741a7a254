"""The sm90 Gluon kernels (mla_q_gluon's three forward kernels, gemm_gluon's GEMM) compile offline for
sm90 with the installed Triton (3.9 on the CPU CI, through _gluon_compat's shim; 3.6 on the H200,
where the conformance suite runs them), and the PTX holds the wgmma main loop and the TMA traffic.
No GPU needed: Triton's offline compiler and its bundled ptxas (GPUTarget cuda 90)."""
from __future__ import annotations

import os

import pytest

gluon = pytest.importorskip("triton.experimental.gluon")
torch = pytest.importorskip("torch")

import triton  # noqa: E402

compat = pytest.importorskip("backends.triton._gluon_compat")
if compat.version_reasons():
    pytest.skip("; ".join(compat.version_reasons()), allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from backends.triton import gemm_gluon as GG  # noqa: E402
from backends.triton import mla_q_gluon as QG  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)  # (backend, compute capability, warp size)


@pytest.fixture(autouse=True, scope="module")
def _compiled_not_interpreted():
    # The offline compiler ignores TRITON_INTERPRET, but the Gluon front end reads it at trace time.
    saved = os.environ.pop("TRITON_INTERPRET", None)
    yield
    if saved is not None:
        os.environ["TRITON_INTERPRET"] = saved


def _desc_type(dtype, block):
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.uint8
    t = torch.empty(256, 256, dtype=dtype)
    layout = gl.NVMMASharedLayout.get_default_for(block, gdt)
    return mangle_type(TensorDescriptor(t, [256, 256], [256, 1], block, layout))


def _compile(fn, types, consts, div16, num_warps):
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    attrs = {(j,): [["tt.divisibility", 16]] for j, n in enumerate(names) if n in div16}
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                         attrs=attrs)
    return triton.compile(src, target=SM90, options={"num_warps": num_warps, "enable_fp_fusion": False})


def _check_ptx(k, min_wgmma):
    ptx = k.asm["ptx"]
    assert ".target sm_90a" in ptx
    assert ptx.count("wgmma.mma_async") >= min_wgmma
    assert "cp.async.bulk.tensor" in ptx  # TMA loads and stores
    assert "mbarrier.try_wait" in ptx
    assert k.metadata.shared <= 232448  # the H200's 227 KB of shared memory per block


MLA_Q_KERNELS = {"plain": ("_mla_q_fwd_gluon_kernel", "CONFIGS", 8),
                 "ws": ("_mla_q_fwd_gluon_ws_kernel", "WS_CONFIGS", 16),
                 "ws128": ("_mla_q_fwd_gluon_ws128_kernel", "WS128_CONFIGS", 32)}


@pytest.mark.parametrize("kind", list(MLA_Q_KERNELS))
def test_mla_q_gluon_kernel_compiles_for_sm90(kind):
    fn_name, configs, wgmma = MLA_Q_KERNELS[kind]
    cfg = dict(getattr(QG, configs)[0])
    bk = cfg["BLOCK_K"]
    types = {"x_desc": _desc_type(torch.bfloat16, [64, bk]), "wn_desc": _desc_type(torch.bfloat16, [128, bk]),
             "wr_desc": _desc_type(torch.bfloat16, [64, bk]), "row_nope_desc": _desc_type(torch.uint8, [64, 128]),
             "row_rope_desc": _desc_type(torch.uint8, [64, 64]), "col_nope_desc": _desc_type(torch.uint8, [64, 128]),
             "col_rope_desc": _desc_type(torch.uint8, [64, 64]),
             "cos_ptr": "*fp32", "sin_ptr": "*fp32", "row_scale_ptr": "*u8", "col_scale_ptr": "*u8"}
    div16 = ("cos_ptr", "sin_ptr", "row_scale_ptr", "col_scale_ptr", "T", "K", "stride_cos", "stride_sin")
    _check_ptx(_compile(getattr(QG, fn_name), types, cfg, div16, QG.NUM_WARPS), wgmma)


def test_gemm_gluon_kernel_compiles_for_sm90():
    cfg = dict(GG.CONFIGS[0])
    bk = cfg["BLOCK_K"]
    types = {"a_desc": _desc_type(torch.bfloat16, [GG._TILE_A, bk]), "b_desc": _desc_type(torch.uint8, [GG._TILE_B, bk]),
             "out_desc": _desc_type(torch.bfloat16, [GG._TILE_A, 64]), "b_scale_ptr": "*u8", "flag_ptr": "*i32"}
    consts = dict(cfg, SWIZZLED=0, IS_E5M2=0, LO=100, HI=150, ODD_STEPS=0)
    k = _compile(GG._mxfp8_gemm_gluon_kernel, types, consts, ("b_scale_ptr", "flag_ptr", "M", "N", "K", "stride_sr"),
                 GG.NUM_WARPS)
    _check_ptx(k, 32)


def test_shim_binds_the_installed_triton_spelling():
    from triton.experimental.gluon.language.nvidia.hopper import tma

    if hasattr(tma, "async_load"):
        assert compat.async_load is tma.async_load and compat.async_store is tma.async_store
    else:
        assert compat.async_load is tma.async_copy_global_to_shared
    assert compat.barrier is getattr(gl, "thread_barrier", None) or compat.barrier is gl.barrier
