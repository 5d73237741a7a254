"""The fused MXFP8 backward's second operands (mla_q_grad_gluon.py): x and w blocked along the GEMMs'
contraction axis, dequantized to bf16 and written K-major (contraction axis contiguous), as that
kernel's TMA boxes read them.

    contraction_bf16(src, flag, safe_bytes, permute_rope) -> [C, R] bf16

src is [R, C] blocked along R (axis 0): an MXTensor (x blocked along T, or w blocked along N) or a bf16
tensor already holding exact MXFP8 values (the backward's bf16-input forms quantize and dequantize
first). Every 64-row chunk R0 .. R0 + 63 of a head's RoPE part (chunk index % 3 == 2) is written, with
permute_rope, in the order the dx kernel holds g's rotated features: position j < 32 <- row R0 + 2j,
position 32 + j <- row R0 + 2j + 1.

Guard (the dequantize pass's rule): *flag is raised for a nonzero code under a scale byte outside
safe_bytes or a value that is not finite; the caller's exact path then recomputes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from spec.mxtensor import MXTensor

from ._common import cdiv, fast_launch, placeholder
from ._fpbits import round_f32
from ._mxfp8 import bf16_unsafe, decode_e4m3, scale_value

@triton.jit
def _contraction_bf16_kernel(src_ptr, scale_ptr, out_ptr, flag_ptr, R, C, s_r, s_c, ss_r, ss_c,
                             BF16_SRC: tl.constexpr, PERMUTE: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr,
                             HW_CVT: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[c, p] = dq(src)[row(p), c] for the program's BLOCK_C values of c and one 64-row chunk of r: read
    in the source's order (contiguous), the RoPE chunk's rows de-interleaved in registers."""
    pid_c = tl.program_id(0)
    chunk = tl.program_id(1)
    r = chunk * 64 + tl.arange(0, 64)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (c < C)[:, None] & (r < R)[None, :]
    src = src_ptr + r.to(tl.int64)[None, :] * s_r + c.to(tl.int64)[:, None] * s_c
    if BF16_SRC:
        x = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    else:
        codes = tl.load(src, mask=ok, other=0)
        e = tl.load(scale_ptr + (r // 32).to(tl.int64)[None, :] * ss_r + c.to(tl.int64)[:, None] * ss_c,
                    mask=ok, other=127).to(tl.int32)
        x = decode_e4m3(codes) * scale_value(e)
        bits = x.to(tl.int32, bitcast=True)
        bad = (bf16_unsafe(codes, e, LO, HI) != 0) | ((bits & 0x7F800000) == 0x7F800000)
        if tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0) > 0:
            tl.store(flag_ptr, 1)
    if HW_CVT:
        y = x.to(tl.bfloat16)
    else:  # the interpreter's cast truncates: round on the bits
        y = round_f32(x, tl.bfloat16)
    out = out_ptr + c.to(tl.int64)[:, None] * R + r.to(tl.int64)[None, :]
    out_ok = (c < C)[:, None] & (r < R)[None, :]
    if PERMUTE and chunk % 3 == 2:
        # rows 2j, 2j + 1 -> positions j, 32 + j (whole heads: the chunk is in range)
        y = tl.reshape(tl.permute(tl.reshape(y, [BLOCK_C, 32, 2]), [0, 2, 1]), [BLOCK_C, 64])
    tl.store(out, y, mask=out_ok)


_BLOCK_C = 64  # output rows (C) per program; each program writes one 64-wide chunk of them


def contraction_bf16(src, flag: torch.Tensor, safe_bytes, permute_rope: bool, hw_cvt: bool) -> torch.Tensor:
    """[C, R] bf16 (contiguous) of src [R, C] blocked along R (module docstring)."""
    if isinstance(src, MXTensor):
        if src.axis != 0 or src.scale_layout != "compact" or src.elem != "e4m3":
            raise ValueError(f"src: expected an e4m3 MXTensor blocked along axis 0 with compact scales, got axis "
                             f"{src.axis}, {src.elem}, {src.scale_layout}")
        data, scale = src.data.view(torch.uint8), src.scale
        rows, cols = data.shape
        ss = scale.stride()
    else:
        if src.dtype != torch.bfloat16 or src.dim() != 2:
            raise ValueError(f"src: expected a 2-D bfloat16 tensor or an MXTensor, got {src.dtype} {tuple(src.shape)}")
        data, scale = src, placeholder(torch.uint8, src.device)
        rows, cols = data.shape
        ss = (0, 0)
    if permute_rope and rows % 192:
        raise ValueError(f"src: permute_rope needs whole heads of 192 rows, got {rows} rows")
    out = torch.empty((cols, rows), dtype=torch.bfloat16, device=data.device)
    if rows and cols:
        grid = (cdiv(cols, _BLOCK_C), cdiv(rows, 64))
        fast_launch(_contraction_bf16_kernel, grid, data, scale, out, flag, rows, cols, data.stride(0), data.stride(1),
                    ss[0], ss[1], BF16_SRC=not isinstance(src, MXTensor), PERMUTE=permute_rope,
                    LO=int(safe_bytes[0]), HI=int(safe_bytes[1]), HW_CVT=hw_cvt, BLOCK_C=_BLOCK_C, num_warps=4)
    return out
