"""Eager torch MLA attention (CPU and CUDA): mla_attention, mla_attention_backward.

Same math as spec/attention.py, computed in fp32 instead of float64: float64 runs at a small fraction
of fp32 speed on data-centre GPUs (and not at all on tensor cores), and fp32 accumulation already
keeps o within bf16 rounding of the float64 reference (tests/conformance/test_attention.py states the
bounds). Note that matmuls follow torch's fp32 matmul precision setting: if a caller enables TF32 the
error grows to about 1e-3 relative, still inside the conformance bounds.

The score matrix is materialised one block of queries at a time (softmax needs every key of a row,
so blocks run over queries only), which caps memory at about `_SCORE_BUDGET_BYTES` per block.

MXFP8 operands are dequantized exactly with torch ops (decode(code) * 2^(e-127), one fp32 multiply,
as SEMANTICS section 2); swizzled scales are unswizzled first. P is kept in fp32: this backend does
not quantize P (cuDNN does, to e4m3 with a fixed x16 scale), so its MXFP8 results are as close to the
reference as its bf16 ones.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from spec.attention import DEFAULT_SOFTMAX_SCALE
from spec.constants import E8M0_NAN, MLA_V_HEAD_DIM
from spec.mxtensor import MXTensor
from .swizzle import unswizzle_scales

from ..registry import register
from ._common import torch_tensor_reasons

# Bytes of fp32 scores (and as many of probabilities) allowed per query block.
_SCORE_BUDGET_BYTES = 256 * 2**20


# --------------------------------------------------------------------------------------------------
# Exact MXFP8 dequantize
# --------------------------------------------------------------------------------------------------

def _e8m0_to_f32(scale: torch.Tensor) -> torch.Tensor:
    """2^(e-127) as fp32, built from bits so it is exact: e=0 is the subnormal 2^-127, 255 is NaN."""
    e = scale.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)
    bits = torch.where(e == E8M0_NAN, torch.full_like(e, 0x7FC00000), bits)
    return bits.view(torch.float32)


def _compact_scales(t: MXTensor) -> torch.Tensor:
    """t's scale bytes in the compact layout (swizzled scales are unswizzled first)."""
    return unswizzle_scales(t).scale


def _dequantize(t: MXTensor) -> torch.Tensor:
    scale = _e8m0_to_f32(_compact_scales(t)).repeat_interleave(32, dim=t.axis)
    return t.data.to(torch.float32) * scale  # fp8 -> fp32 is exact; the product is one fp32 RN


def _as_f32(x) -> torch.Tensor:
    return _dequantize(x) if isinstance(x, MXTensor) else x.to(torch.float32)


# --------------------------------------------------------------------------------------------------
# fp32 core on [N, H, S, D] tensors
# --------------------------------------------------------------------------------------------------

def _query_block(n_heads_total: int, s_q: int, s_kv: int) -> int:
    per_query = max(1, n_heads_total * s_kv * 4)
    return max(1, min(s_q, _SCORE_BUDGET_BYTES // per_query))


def _scores(q_blk, k, causal: bool, scale: float, q_start: int, s_q: int):
    s = torch.matmul(q_blk, k.transpose(-1, -2)) * scale
    if causal:
        s_kv = k.shape[-2]
        i = torch.arange(q_start, q_start + q_blk.shape[-2], device=q_blk.device)[:, None]
        j = torch.arange(s_kv, device=q_blk.device)[None, :]
        s = s.masked_fill(j > i + (s_kv - s_q), float("-inf"))
    return s


def _forward_bhsd(q, k, v, causal: bool, scale: float):
    """fp32 q [N,H,Sq,192], k [N,H,Skv,192], v [N,H,Skv,128] -> (o fp32, lse fp32 [N,H,Sq])."""
    n, h, s_q, _ = q.shape
    s_kv = k.shape[-2]
    o = torch.zeros(n, h, s_q, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((n, h, s_q), float("-inf"), dtype=torch.float32, device=q.device)
    if s_kv == 0 or s_q == 0:
        return o, lse  # no keys: every row fully masked
    step = _query_block(n * h, s_q, s_kv)
    for start in range(0, s_q, step):
        stop = min(s_q, start + step)
        s = _scores(q[:, :, start:stop], k, causal, scale, start, s_q)
        row_max = s.amax(dim=-1)
        masked_row = row_max == float("-inf")
        shift = torch.where(masked_row, torch.zeros_like(row_max), row_max)  # keeps exp finite
        e = torch.exp(s - shift[..., None])
        row_sum = e.sum(dim=-1)
        o_blk = torch.matmul(e, v) / row_sum[..., None]
        o[:, :, start:stop] = torch.where(masked_row[..., None], torch.zeros_like(o_blk), o_blk)
        lse[:, :, start:stop] = torch.where(masked_row, torch.full_like(row_max, float("-inf")),
                                            shift + torch.log(row_sum))
    return o, lse


def _backward_bhsd(do, q, k, v, o, lse, causal: bool, scale: float):
    """fp32 (dq, dk, dv) on [N,H,S,D] tensors; dk, dv accumulate over query blocks."""
    n, h, s_q, _ = q.shape
    s_kv = k.shape[-2]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if s_kv == 0 or s_q == 0:
        return dq, dk, dv
    step = _query_block(2 * n * h, s_q, s_kv)  # two score-sized buffers live at once (P and dS)
    for start in range(0, s_q, step):
        stop = min(s_q, start + step)
        q_blk, do_blk = q[:, :, start:stop], do[:, :, start:stop]
        lse_blk = lse[:, :, start:stop]
        masked_row = lse_blk == float("-inf")
        s = _scores(q_blk, k, causal, scale, start, s_q)
        p = torch.exp(s - torch.where(masked_row, torch.zeros_like(lse_blk), lse_blk)[..., None])
        p = torch.where(masked_row[..., None], torch.zeros_like(p), p)
        d = (o[:, :, start:stop] * do_blk).sum(dim=-1)
        ds = p * (torch.matmul(do_blk, v.transpose(-1, -2)) - d[..., None])
        dq[:, :, start:stop] = torch.matmul(ds, k) * scale
        dk += torch.matmul(ds.transpose(-1, -2), q_blk) * scale
        dv += torch.matmul(p.transpose(-1, -2), do_blk)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------------

def _to_bhsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x.permute(0, 2, 1, 3) if layout == "bshd" else x.permute(1, 2, 0, 3)


def _from_bhsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x.permute(0, 2, 1, 3) if layout == "bshd" else x.permute(2, 0, 1, 3)


def _thd_seq(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return x[start:stop].permute(1, 0, 2)[None]


def _scale(softmax_scale: Optional[float]) -> float:
    return DEFAULT_SOFTMAX_SCALE if softmax_scale is None else float(softmax_scale)


def attention_reasons(*args, **kwargs) -> List[str]:
    return torch_tensor_reasons(*args, **kwargs)


# --------------------------------------------------------------------------------------------------
# Ops
# --------------------------------------------------------------------------------------------------

@register("mla_attention", "torch", check=attention_reasons)
def mla_attention(q, k, v, causal=False, softmax_scale=None, layout="bshd", cu_seqlens_q=None,
                  cu_seqlens_kv=None):
    """spec.mla_attention in fp32 torch: (o bf16, lse fp32 [B, H, S_q] or [H, T_q] for thd)."""
    scale = _scale(softmax_scale)
    q32, k32, v32 = _as_f32(q), _as_f32(k), _as_f32(v)
    if layout == "thd":
        cq = [int(c) for c in cu_seqlens_q.tolist()]
        ckv = [int(c) for c in cu_seqlens_kv.tolist()]
        o = torch.zeros(q32.shape[0], q32.shape[1], MLA_V_HEAD_DIM, dtype=torch.float32, device=q32.device)
        lse = torch.full((q32.shape[1], q32.shape[0]), float("-inf"), dtype=torch.float32, device=q32.device)
        for b in range(len(cq) - 1):
            if cq[b + 1] == cq[b]:
                continue
            o_b, lse_b = _forward_bhsd(
                _thd_seq(q32, cq[b], cq[b + 1]), _thd_seq(k32, ckv[b], ckv[b + 1]),
                _thd_seq(v32, ckv[b], ckv[b + 1]), causal, scale,
            )
            o[cq[b]:cq[b + 1]] = o_b[0].permute(1, 0, 2)
            lse[:, cq[b]:cq[b + 1]] = lse_b[0]
    else:
        o, lse = _forward_bhsd(_to_bhsd(q32, layout), _to_bhsd(k32, layout), _to_bhsd(v32, layout), causal, scale)
        o = _from_bhsd(o, layout)
    return o.to(torch.bfloat16).contiguous(), lse.contiguous()


@register("mla_attention_backward", "torch", check=attention_reasons)
def mla_attention_backward(do, q, k, v, o, lse, causal=False, softmax_scale=None, layout="bshd",
                           cu_seqlens_q=None, cu_seqlens_kv=None):
    """spec.mla_attention_backward in fp32 torch: (dq, dk, dv) bf16 shaped like q, k, v."""
    scale = _scale(softmax_scale)
    q32, k32, v32 = _as_f32(q), _as_f32(k), _as_f32(v)
    o32, do32, lse32 = o.to(torch.float32), do.to(torch.float32), lse.to(torch.float32)
    if layout == "thd":
        cq = [int(c) for c in cu_seqlens_q.tolist()]
        ckv = [int(c) for c in cu_seqlens_kv.tolist()]
        dq, dk, dv = torch.zeros_like(q32), torch.zeros_like(k32), torch.zeros_like(v32)
        for b in range(len(cq) - 1):
            qsl, ksl = slice(cq[b], cq[b + 1]), slice(ckv[b], ckv[b + 1])
            if qsl.start == qsl.stop or ksl.start == ksl.stop:
                continue
            g = _backward_bhsd(
                _thd_seq(do32, qsl.start, qsl.stop), _thd_seq(q32, qsl.start, qsl.stop),
                _thd_seq(k32, ksl.start, ksl.stop), _thd_seq(v32, ksl.start, ksl.stop),
                _thd_seq(o32, qsl.start, qsl.stop), lse32[None, :, qsl], causal, scale,
            )
            for out, grad, sl in ((dq, g[0], qsl), (dk, g[1], ksl), (dv, g[2], ksl)):
                out[sl] = grad[0].permute(1, 0, 2)
    else:
        dq, dk, dv = _backward_bhsd(
            _to_bhsd(do32, layout), _to_bhsd(q32, layout), _to_bhsd(k32, layout), _to_bhsd(v32, layout),
            _to_bhsd(o32, layout), lse32, causal, scale,
        )
        dq, dk, dv = (_from_bhsd(g, layout) for g in (dq, dk, dv))
    return tuple(g.to(torch.bfloat16).contiguous() for g in (dq, dk, dv))
