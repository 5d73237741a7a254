"""Compile every Triton MLA attention kernel variant for sm90 without a GPU and report what ptxas
says: registers, spills, shared memory, wgmma count, and whether ptxas serialised the wgmma
(warning C7515, "wgmma.mma_async instructions are serialized": every HGMMA then waits for the
previous one, a large loss that no test catches).

    python benchmarks/aot_attention_sm90.py [--all-configs] [--arch 90]

Shapes are the target's (B=1, S=4096, H=128, bshd; varlen variants with thd strides). Exits 1 when
a variant is serialised. Uses the ptxas bundled with Triton (the newest one it has, as
triton.compile does for PTX it generates).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # the GPU tile configs, not the interpreter's
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from backends.triton import attention as attn  # noqa: E402

S, H = 4096, 128


def ptxas_path():
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):
        path = os.path.join(bin_dir, name)
        if os.path.exists(path):
            return path
    return "ptxas"


def compile_variant(jit_fn, args, constexprs, num_warps, num_stages, arch):
    """args: name -> "*type" (pointer, 16-byte aligned), float (fp32) or int (i32; divisible by 16
    is marked as the JIT would)."""
    signature, attrs = {}, {}
    for i, name in enumerate(jit_fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = args[name]
        if isinstance(value, str):
            signature[name] = value
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=jit_fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    out = subprocess.run([ptxas_path(), f"-arch=sm_{arch}a", "-v", f.name, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return dict(regs=int(regs.group(1)) if regs else -1,
                spill=(int(spills.group(1)), int(spills.group(2))) if spills else (-1, -1),
                smem=compiled.metadata.shared, wgmma=compiled.asm["ptx"].count("wgmma.mma_async"),
                serialised=re.findall(r"serialized due to (.*?) in the function", out))


def bshd(d):
    return S * H * d, H * d, d


def fwd_args(q_mx, k_mx, v_mx, varlen):
    t = {True: "*fp8e4nv", False: "*bf16"}
    a = dict(Q=t[q_mx], K=t[k_mx], V=t[v_mx], QS="*u8" if q_mx else t[q_mx], KS="*u8" if k_mx else t[k_mx],
             VS="*u8" if v_mx else t[v_mx], O="*bf16", LSE="*fp32", CU_Q="*i32", CU_KV="*i32")
    strides = (("q", bshd(192)), ("k", bshd(192)), ("v", bshd(128)), ("o", bshd(128)),
               ("qs", (S * H * 6, H * 6, 6) if q_mx else (0, 0, 0)), ("ks", (S * H * 6, H * 6, 6) if k_mx else (0, 0, 0)),
               ("vs", (S // 32 * H * 128, H * 128, 128) if v_mx else (0, 0, 0)))
    for p, st in strides:
        a[f"stride_{p}b"], a[f"stride_{p}s"], a[f"stride_{p}h"] = (0,) + st[1:] if varlen else st
    a.update(stride_lb=0 if varlen else H * S, stride_lh=S, SEQ_Q=S, SEQ_KV=S, qk_scale=0.1, SEQ_BUCKET=S)
    return a


def bwd_args(varlen):
    a = dict(Q="*bf16", K="*bf16", V="*bf16", DO="*bf16", LSE2="*fp32", DELTA="*fp32", DQ="*bf16", DK="*bf16",
             DV="*bf16", DQA="*fp32", CU_Q="*i32", CU_KV="*i32")
    for p, d in (("q", 192), ("k", 192), ("v", 128), ("do", 128), ("dq", 192), ("dk", 192), ("dv", 128), ("dqa", 192)):
        st = bshd(d)
        a[f"stride_{p}b"], a[f"stride_{p}s"], a[f"stride_{p}h"] = (0,) + st[1:] if varlen else st
    a.update(stride_lb=0 if varlen else H * S, stride_lh=S, SEQ_Q=S, SEQ_KV=S, qk_scale=0.1, sm_scale=0.07,
             SEQ_BUCKET=S)
    return a


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all-configs", action="store_true", help="every autotune config (default: the first two)")
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args()

    def configs(kernel):
        return kernel.configs if args.all_configs else kernel.configs[:2]

    jobs = []
    for causal in (False, True):
        for varlen in (False, True):
            for mx in ((False,) * 3, (True,) * 3, (True, False, False)):
                for c in configs(attn._mla_fwd_kernel):
                    ce = dict(c.kwargs, CAUSAL=causal, VARLEN=varlen, Q_MX=mx[0], K_MX=mx[1], V_MX=mx[2])
                    jobs.append((f"fwd causal={causal} varlen={varlen} mx={''.join('1' if m else '0' for m in mx)}",
                                 attn._mla_fwd_kernel.fn, fwd_args(*mx, varlen), ce, c))
            for atomic in (False, True):
                for c in configs(attn._mla_bwd_dkdv_kernel):
                    ce = dict(c.kwargs, CAUSAL=causal, VARLEN=varlen, ATOMIC_DQ=atomic)
                    jobs.append((f"dkdv causal={causal} varlen={varlen} atomic_dq={atomic}",
                                 attn._mla_bwd_dkdv_kernel.fn, bwd_args(varlen), ce, c))
            for c in configs(attn._mla_bwd_dq_kernel):
                ce = dict(c.kwargs, CAUSAL=causal, VARLEN=varlen)
                jobs.append((f"dq causal={causal} varlen={varlen}", attn._mla_bwd_dq_kernel.fn, bwd_args(varlen), ce, c))

    bad = 0
    for what, fn, fargs, ce, c in jobs:
        r = compile_variant(fn, fargs, ce, c.num_warps, c.num_stages, args.arch)
        flag = "SERIALISED: " + "; ".join(r["serialised"]) if r["serialised"] else "ok"
        bad += bool(r["serialised"])
        print(f"{what:42} {str(c.kwargs):32} w{c.num_warps} s{c.num_stages}  regs {r['regs']:3}  "
              f"spill {r['spill'][0]:4}/{r['spill'][1]:<4} smem {r['smem'] // 1024:3} KB  wgmma {r['wgmma']:3}  {flag}",
              flush=True)
    print(f"{len(jobs)} variants, {bad} with serialised wgmma")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
