"""mla_q_uproj_rope_quant through cuDNN's fused sm100 kernel `cudnn.gemm_proj_rope_mxfp8_wrapper_sm100`.

The frontend's CuTe-DSL kernel (nvidia-cudnn-frontend >= 1.27) fuses the Q up-projection GEMM, the
mla RoPE on each head's last 64 features and the rowwise + columnwise MXFP8 quantize
(SEMANTICS 6). It is written against the frontend 1.32 sources and NOT run by this project (no
sm100 machine here): the CPU tests prove the call (shapes, dtypes, layouts, scale bytes) and the
mapping of its outputs, not the kernel's numbers.

Call: `gemm_proj_rope_mxfp8_wrapper_sm100(x, w, cos, sin, x_scale=None, w_scale=None, w_out_in=True,
stream=None)`. w is passed as the project's [N, K] ("out, in", `w_out_in=True`); bf16 x/w select the
bf16-GEMM kernel, float8_e4m3fn codes + compact E8M0 scales (x_scale [T, K/32], w_scale [N, K/32])
the MXFP8-GEMM kernel. stream=None launches on torch's current stream. It returns a TupleDict
{out_fp8_row [T, H, 192] e4m3, out_scales_row [T, H, 6] uint8, out_fp8_col [T, H, 192] e4m3,
out_scales_col [T/32, H, 192] uint8}: exactly the project's compact shapes, so q_row =
MXTensor(out_fp8_row, out_scales_row, axis=2) and q_col = MXTensor(out_fp8_col, out_scales_col,
axis=0), no copies. (To feed q_row to cuDNN's MXFP8 SDPA, `_scales.thd_as_bshd` + `pack_attention_scales`
re-lay its scales.)

The wrapper compiles one kernel per (x shape, w shape, device), i.e. per token count T, on first use
(CuTe DSL JIT, seconds) and caches it in the frontend process-wide. Warm every token count up
before CUDA graph capture: a first call inside capture would compile (and allocate) there.

Requirements (each a capability reason): the frontend imports and is >= 1.27; the wrapper's
dependencies nvidia-cutlass-dsl (`cutlass`), apache-tvm-ffi (`tvm_ffi`) and cuda-python
(`cuda.bindings`) are installed (the GPU machine of this project has none of them, so this op is
reported unavailable there); compute capability 10.x; T % 128 == 0; x, w, cos, sin contiguous; cos/sin
bfloat16 [T, 64] (the spec also allows fp32 tables; this kernel does not); MXFP8 inputs e4m3 with
compact scales, an even head count, K % 128 == 0 (the kernel reads K/128 scale words per row).

Numerics (SEMANTICS 6): the kernel's GEMM order is its own, and the frontend's reference
(`gemm_proj_rope_mxfp8_reference`) quantizes from the fp32 accumulator without the bf16 staging
step SEMANTICS 6.2 fixes; whether the kernel stages to bf16 is unverified. Agreement with spec is
therefore the section-6 contract: byte-exact on exactly representable inputs, rare one-step flips on
random ones -- to be measured on an sm100 machine.

RoPE alone (`rope` / `rope_backward`) is deliberately not registered for cudnn: the brief allows it
only where it beats the Triton kernel, and there is no measurement of that. The backward of this op
has no cuDNN kernel either, so `mla_q_uproj_rope_quant_backward` is not registered.
"""
from __future__ import annotations

from typing import List

import torch

from spec.constants import MLA_QK_HEAD_DIM, MLA_ROPE_DIM
from spec.mxtensor import MXTensor

from ..registry import register
from . import _common

MIN_FRONTEND = (1, 27)
TOKEN_TILE = 128
WRAPPER_MODULES = ("cutlass", "tvm_ffi", "cuda.bindings")
_MODULE_PACKAGES = {"cutlass": "nvidia-cutlass-dsl", "tvm_ffi": "apache-tvm-ffi", "cuda.bindings": "cuda-python"}


def _contiguous_reasons(named) -> List[str]:
    return [f"{name}: the fused kernel needs C-contiguous tensors, got strides {tuple(t.stride())}"
            for name, t in named if not t.is_contiguous()]


def mla_q_reasons(x, w, cos, sin) -> List[str]:
    reasons = _common.frontend_reasons()
    if reasons:
        return reasons
    have = _common.frontend_version()
    if have < MIN_FRONTEND:
        reasons.append(f"gemm_proj_rope_mxfp8_wrapper_sm100 needs nvidia-cudnn-frontend >= "
                       f"{'.'.join(map(str, MIN_FRONTEND))}, found {'.'.join(map(str, have)) or 'unknown'}")
    for mod in _common.missing_modules(WRAPPER_MODULES):
        reasons.append(f"gemm_proj_rope_mxfp8_wrapper_sm100 needs {_MODULE_PACKAGES[mod]} (module {mod!r}), "
                       f"which is not installed")
    device_reasons = _common.cuda_reasons((x, w, cos, sin))
    reasons += device_reasons
    if device_reasons:
        return reasons
    dev = _common.first_device((x, w, cos, sin))
    reasons += _common.capability_reasons(dev, "gemm_proj_rope_mxfp8_wrapper_sm100 (tcgen05 kernel)", major_only=10)
    tokens = x.shape[0]
    if tokens % TOKEN_TILE:
        reasons.append(f"x: the fused kernel needs the token count to be a multiple of {TOKEN_TILE}, got {tokens}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.bfloat16:
            reasons.append(f"{name}: the fused kernel takes bfloat16 [T, {MLA_ROPE_DIM}] tables, got {t.dtype}")
    reasons += _contiguous_reasons((("cos", cos), ("sin", sin)))
    if isinstance(x, MXTensor):
        heads = w.shape[0] // MLA_QK_HEAD_DIM
        for name, t in (("x", x), ("w", w)):
            if t.elem != "e4m3":
                reasons.append(f"{name}: the MXFP8 kernel takes e4m3 codes, got {t.elem}")
            if t.scale_layout != "compact":
                reasons.append(f"{name}: the MXFP8 kernel takes compact [rows, K/32] scales, got {t.scale_layout} "
                               f"(unswizzle first)")
            reasons += _contiguous_reasons(((f"{name}.data", t.data), (f"{name}.scale", t.scale)))
        if heads % 2:
            reasons.append(f"w: the MXFP8-input kernel needs an even head count (scale-relay pairing), got {heads}")
        if x.shape[1] % 128:
            reasons.append(f"x: the MXFP8-input kernel needs K % 128 == 0 (K/128 scale words per row), got K {x.shape[1]}")
    else:
        reasons += _contiguous_reasons((("x", x), ("w", w)))
    return reasons


@register("mla_q_uproj_rope_quant", "cudnn", check=mla_q_reasons)
def mla_q_uproj_rope_quant(x, w, cos, sin):
    """(q_row, q_col) from cuDNN's fused sm100 kernel; see the module docstring (compiles per T)."""
    wrapper = _common.frontend().gemm_proj_rope_mxfp8_wrapper_sm100
    if isinstance(x, MXTensor):
        out = wrapper(x.data, w.data, cos, sin, x_scale=x.scale, w_scale=w.scale, w_out_in=True)
    else:
        out = wrapper(x, w, cos, sin, w_out_in=True)
    q_row = MXTensor(out["out_fp8_row"], out["out_scales_row"], 2, "e4m3", "compact")
    q_col = MXTensor(out["out_fp8_col"], out["out_scales_col"], 0, "e4m3", "compact")
    return q_row, q_col
