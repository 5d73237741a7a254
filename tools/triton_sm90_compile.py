"""Compile the mla_q / gemm Triton kernels for sm90 WITHOUT a GPU and report shared memory, registers and
spills per autotune config (Triton's offline compiler + its bundled ptxas).

    TRITON_DEFAULT_FP_FUSION=1 python tools/triton_sm90_compile.py [--out DIR]

Catches front-end / lowering errors and register spills before a GPU run, and leaves TTGIR / PTX / cubin
per config in DIR (default /tmp/triton_sm90) for reading the pipelining (async_tma_copy, warp_group_dot)
and SASS (cuobjdump -sass). Integer arguments that the JIT would specialise (== 1, divisible by 16) are
given the same specialisation here; the local Triton version may differ from the GPU machine's.
"""
import argparse
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import backends.triton.gemm as G  # noqa: E402
import backends.triton.mla_q as Q  # noqa: E402

OUT = "/tmp/triton_sm90"


def compile_sm90(fn, types, consts, num_warps=8, num_stages=3, tag="k", extra=None, div16=()):
    """Compile `fn` (a JITFunction, possibly wrapped) for sm90a; print shared / registers / spills."""
    while not hasattr(fn, "arg_names"):
        fn = fn.fn
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in consts and (sig[n].startswith("*") or n in div16)}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    opts = {"num_warps": num_warps, "num_stages": num_stages, **(extra or {})}
    start = time.time()
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    os.makedirs(OUT, exist_ok=True)
    for ext in ("ttgir", "ptx"):
        with open(os.path.join(OUT, f"{tag}.{ext}"), "w") as f:
            f.write(k.asm[ext])
    with open(os.path.join(OUT, f"{tag}.cubin"), "wb") as f:
        f.write(k.asm["cubin"])
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    ptxas = next((os.path.join(bindir, p) for p in ("ptxas-blackwell", "ptxas") if os.path.exists(os.path.join(bindir, p))))
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(OUT, f"{tag}.ptx"), "-o", os.devnull],
                       capture_output=True, text=True)
    info = " ".join(re.sub(r"^ptxas\S* info\s*:\s*", "", line.strip()) for line in (r.stderr + r.stdout).splitlines()
                    if "registers" in line or "spill" in line)
    ir = k.asm["ttgir"]
    print(f"[{tag}] {time.time() - start:.1f}s shared={k.metadata.shared} tma_copies={ir.count('async_tma_copy')} "
          f"cp_async={ir.count('async_copy_global_to_local')} | {info}")
    return k


def main():
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=OUT)
    OUT = ap.parse_args().out
    def _go(fn, t, consts, cfg, tag, div):
        kw = dict(cfg.kwargs); mr = cfg.maxnreg
        extra = {"enable_fp_fusion": False}
        if mr: extra["maxnreg"] = mr
        compile_sm90(fn, t, {**consts, **kw}, cfg.num_warps, cfg.num_stages, tag, div16=div, extra=extra)
    # fused fwd TMA bf16 + mx
    for mx in (False, True):
        for i, cfg in enumerate(Q._fwd_configs(mx, tma=True)):
            bm, bk = cfg.kwargs["BLOCK_M"], (32 if mx else cfg.kwargs["BLOCK_K"]); dt = "fp8e4nv" if mx else "bf16"
            t = {"x_desc":f"tensordesc<{dt}[{bm},{bk}]>","wn_desc":f"tensordesc<{dt}[128,{bk}]>","wr_desc":f"tensordesc<{dt}[64,{bk}]>",
                 "xs_ptr":"*u8","ws_ptr":"*u8","cos_ptr":"*fp32","sin_ptr":"*fp32","row_code_ptr":"*u8","row_scale_ptr":"*u8","col_code_ptr":"*u8","col_scale_ptr":"*u8"}
            c = dict(MX=mx, XS_SWIZZLED=False, WS_SWIZZLED=False, HW_CVT=True, DOT_F32=False, EVEN_T=True, WIDEN_F16=mx)
            if mx: c.update(stride_xs_col=1, stride_ws_col=1)
            _go(Q._mla_q_fwd_tma_kernel, t, c, cfg, f"fwdtma{int(mx)}_{i}", ["T","K","T_BUCKET","stride_cos","stride_sin","stride_xs_row","stride_ws_row"])
        for i, cfg in enumerate(Q._fwd_configs(mx, tma=False)):
            dt = "fp8e4nv" if mx else "bf16"
            t = {"x_ptr":f"*{dt}","w_ptr":f"*{dt}","xs_ptr":"*u8","ws_ptr":"*u8","cos_ptr":"*bf16","sin_ptr":"*bf16","row_code_ptr":"*u8","row_scale_ptr":"*u8","col_code_ptr":"*u8","col_scale_ptr":"*u8"}
            c = dict(MX=mx, XS_SWIZZLED=mx, WS_SWIZZLED=False, HW_CVT=True, DOT_F32=False, EVEN_T=False, EVEN_K=True, stride_xk=1, stride_wk=1, WIDEN_F16=mx)
            _go(Q._mla_q_fwd_kernel, t, c, cfg, f"fwdptr{int(mx)}_{i}", ["T","K","T_BUCKET","stride_xt","stride_wn","stride_cos","stride_sin"])
    # prep kernel
    for flags in [dict(ROPE=True, WRITE_BF16=True, ROW_Q=False, COL_Q=False), dict(ROPE=True, WRITE_BF16=False, ROW_Q=True, COL_Q=True), dict(ROPE=False, WRITE_BF16=False, ROW_Q=False, COL_Q=True)]:
        t = {"src_ptr":"*bf16","cos_ptr":"*fp32","sin_ptr":"*fp32","g_ptr":"*bf16","row_code_ptr":"*u8","row_scale_ptr":"*u8","colt_code_ptr":"*u8","colt_scale_ptr":"*u8"}
        compile_sm90(Q._grad_prep_kernel, t, dict(flags, HW_CVT=True, BLOCK_R=128, stride_sc=1), 4, 1, "prep_" + "".join(str(int(v)) for v in flags.values()), div16=["R","C","stride_sr","stride_cos","stride_sin"], extra={"enable_fp_fusion": False})
    # gemm
    for i, cfg in enumerate(G._tma_configs()):
        bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
        t = {"a_desc":f"tensordesc<fp8e4nv[{bm},32]>","b_desc":f"tensordesc<fp8e4nv[{bn},32]>","sa_desc":f"tensordesc<fp32[1,{bm}]>","sb_desc":f"tensordesc<fp32[1,{bn}]>","c_ptr":"*bf16"}
        compile_sm90(G._mxfp8_gemm_tma_kernel, t, dict(cfg.kwargs, OUT_DTYPE=tl.bfloat16, stride_cn=1, WIDEN_F16=True), cfg.num_warps, cfg.num_stages, f"gtma_{i}", div16=["N","K","stride_cm"])
    for i, cfg in enumerate(G._sm90_configs()):
        t = {"a_ptr":"*fp8e4nv","a_scale_ptr":"*u8","b_ptr":"*fp8e5","b_scale_ptr":"*u8","c_ptr":"*fp32"}
        compile_sm90(G._mxfp8_gemm_kernel, t, dict(cfg.kwargs, A_SWIZZLED=False, B_SWIZZLED=True, OUT_DTYPE=tl.float32, EVEN_K=True, WIDEN_F16=True, stride_ak=1, stride_bk=1, stride_as_col=1, stride_cn=1), cfg.num_warps, cfg.num_stages, f"gptr_{i}", div16=["K","N","stride_am","stride_bn","stride_cm","stride_as_row"])
    # the Gluon fused forward (only with the Triton release it was written for)
    import backends.triton.mla_q_gluon as QG
    from backends.triton._gluon_compat import version_reasons
    if not version_reasons():
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon._runtime import GluonASTSource
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        from triton.runtime.jit import mangle_type
        import torch
        for i, cfg in enumerate(QG.CONFIGS):
            bk = cfg["BLOCK_K"]
            blocks = {"x_desc": (torch.bfloat16, [64, bk]), "wn_desc": (torch.bfloat16, [128, bk]),
                      "wr_desc": (torch.bfloat16, [64, bk]), "row_nope_desc": (torch.uint8, [64, 128]),
                      "row_rope_desc": (torch.uint8, [64, 64]), "col_nope_desc": (torch.uint8, [64, 128]),
                      "col_rope_desc": (torch.uint8, [64, 64])}
            types = {n: mangle_type(TensorDescriptor(torch.empty(256, 256, dtype=dt), [256, 256], [256, 1], b,
                                                     gl.NVMMASharedLayout.get_default_for(b, gl.bfloat16 if dt == torch.bfloat16 else gl.uint8)))
                     for n, (dt, b) in blocks.items()}
            types.update(cos_ptr="*fp32", sin_ptr="*fp32", row_scale_ptr="*u8", col_scale_ptr="*u8")
            for tag, fn in (("gluon", QG._mla_q_fwd_gluon_kernel), ("gluon_ws", QG._mla_q_fwd_gluon_ws_kernel)):
                names = fn.arg_names
                sig = {n: "constexpr" if n in cfg else types.get(n, "i32") for n in names}
                attrs = {(j,): [["tt.divisibility", 16]] for j, n in enumerate(names)
                         if n in ("cos_ptr", "sin_ptr", "row_scale_ptr", "col_scale_ptr", "T", "K", "stride_cos", "stride_sin")}
                src = GluonASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in cfg.items()}, attrs=attrs)
                start = time.time()
                k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": QG.NUM_WARPS, "enable_fp_fusion": False})
                print(f"[{tag}_{i}] {time.time() - start:.1f}s shared={k.metadata.shared} (max 232448) {cfg}")
    else:
        print(f"[gluon] skipped: {'; '.join(version_reasons())}")
    compile_sm90(G._scale_f32_kernel, {"scale_ptr":"*u8","out_ptr":"*fp32"}, dict(SWIZZLED=True, BLOCK_R=64, BLOCK_KB=16), 4, 1, "scalef32", div16=["R_PAD","KB_PAD"])


if __name__ == "__main__":
    main()
