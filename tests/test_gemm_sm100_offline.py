"""The sm100 route of the Triton MXFP8 GEMM (`tl.dot_scaled`, backends/triton/gemm.py) compiled offline for
sm100a, no GPU needed: Triton's own compiler lowers the kernel to TTGIR, PTX and (through the ptxas it
ships) a cubin, and the block-scaled tensor-core MMA must appear at every level:

- TTGIR: `ttng.tc_gen5_mma_scaled` (Triton's fifth-generation tensor-core MMA with scales),
- PTX:   `tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block32` (one E8M0 scale per 32 elements;
         Triton 3.6 spells the same scale vector `.scale_vec::1X`),
- SASS:  `UTCQMMA` (when cuobjdump is shipped beside ptxas).

It shows the route lowers to the MX instruction instead of an emulation; it does not run it (no sm100
device here). The compile runs in a subprocess because the test session sets TRITON_INTERPRET=1, under
which `@triton.jit` builds interpreter functions, not compilable ones.

    python tests/test_gemm_sm100_offline.py OUT_DIR     # writes OUT_DIR/<case>.{ttgir,ptx,cubin,sass}
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PTX_MMA = re.compile(r"tcgen05\.mma\.cta_group::1\.kind::mxf8f6f4\.block_scale\.(block32|scale_vec::1X)\b")

# (case, a format, b format, scales swizzled): e4m3 x e4m3 is the project's GEMM; e4m3 x e5m2 and the
# swizzled scale addressing are the other forms the route launches.
CASES = [("e4m3_e4m3_compact", "e4m3", "e4m3", False), ("e4m3_e5m2_swizzled", "e4m3", "e5m2", True)]


def compile_cases(out: Path) -> None:
    """Compile every case for sm100a (the route's fixed tile: 128 x 128 x 128, 4 warps, 4 stages)."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.path.insert(0, str(ROOT))
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from backends.triton import gemm

    fn = gemm._mxfp8_gemm_dot_scaled_kernel
    names = fn.arg_names
    tile = {k: v for k, v in gemm._FIXED_SM100.items() if k.isupper()}
    element = {"e4m3": "fp8e4nv", "e5m2": "fp8e5"}
    out.mkdir(parents=True, exist_ok=True)
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for case, fa, fb, swizzled in CASES:
        consts = dict(tile, A_SWIZZLED=swizzled, B_SWIZZLED=swizzled, OUT_DTYPE=tl.bfloat16, A_FORMAT=fa,
                      B_FORMAT=fb, EVEN_K=True, stride_ak=1, stride_bk=1, stride_cn=1)
        if not swizzled:
            consts.update(stride_as_col=1, stride_bs_col=1)
        types = {"a_ptr": f"*{element[fa]}", "b_ptr": f"*{element[fb]}", "a_scale_ptr": "*u8", "b_scale_ptr": "*u8",
                 "c_ptr": "*bf16", "gate_ptr": f"*{element[fa]}"}
        signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
        # What the JIT would specialise on a DeepSeek-V3 call: pointers and the K / N / row strides divisible by 16.
        divisible = {"N", "K", "stride_am", "stride_bn", "stride_cm", "stride_as_row", "stride_bs_row"}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                 if n not in consts and (signature[n].startswith("*") or n in divisible)}
        source = ASTSource(fn=fn, signature=signature, attrs=attrs,
                           constexprs={(names.index(k),): v for k, v in consts.items()})
        kernel = triton.compile(source, target=GPUTarget("cuda", 100, 64),
                                options={"num_warps": gemm._FIXED_SM100["num_warps"],
                                         "num_stages": gemm._FIXED_SM100["num_stages"]})
        (out / f"{case}.ttgir").write_text(kernel.asm["ttgir"])
        (out / f"{case}.ptx").write_text(kernel.asm["ptx"])
        (out / f"{case}.cubin").write_bytes(kernel.asm["cubin"])
        cuobjdump = bindir / "cuobjdump"
        if cuobjdump.exists():
            sass = subprocess.run([str(cuobjdump), "-sass", str(out / f"{case}.cubin")], capture_output=True, text=True)
            if sass.returncode == 0:
                (out / f"{case}.sass").write_text(sass.stdout)


def test_dot_scaled_route_compiles_to_block_scaled_mma_for_sm100a(tmp_path):
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia").is_dir():
        pytest.skip("this Triton build has no NVIDIA backend")
    result = subprocess.run([sys.executable, __file__, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    for case, *_ in CASES:
        ttgir = (tmp_path / f"{case}.ttgir").read_text()
        ptx = (tmp_path / f"{case}.ptx").read_text()
        assert "ttng.tc_gen5_mma_scaled" in ttgir, case
        assert re.search(r"^\.target\s+sm_100a\b", ptx, re.MULTILINE), case
        mma = [line.strip() for line in ptx.splitlines() if PTX_MMA.search(line)]
        assert mma, f"{case}: no {PTX_MMA.pattern} in the PTX"
        assert "tt.dot_scaled" not in ttgir  # the op became the MMA, not a decomposition around it
        assert (tmp_path / f"{case}.cubin").stat().st_size > 0  # ptxas accepted it for sm_100a
        print(f"{case}: {len(mma)} x {mma[0]}")
        sass_file = tmp_path / f"{case}.sass"
        if sass_file.exists():
            sass = sass_file.read_text()
            assert "code for sm_100a" in sass
            assert "UTCQMMA" in sass, case
            print(f"{case}: SASS {sass.count('UTCQMMA')} x UTCQMMA")


if __name__ == "__main__":
    compile_cases(Path(sys.argv[1]))
