"""nn.Modules for model code: the fused MLA query path and the MLA attention core.

DeepSeek-V3's MLA query path, as HF transformers, TorchTitan and Megatron write it:

    c_q = q_a_proj(h)                        [T, q_lora]
    q   = q_b_proj(q_a_layernorm(c_q))       [T, H * 192]     (q_lora_rank None: q = q_proj(h))
    q   = RoPE(q viewed [T, H, 192])         last 64 features of each head rotated

`MLAQProjection` holds q_b_proj's weight [H * 192, q_lora] (and, optionally, q_a_layernorm's weight)
and replaces the last two lines:

    q_proj = MLAQProjection(q_lora, heads, path="mxfp8")       # or MLAQProjection.from_linear(q_b_proj, norm=...)
    attn   = MLAAttention(causal=True, softmax_scale=192 ** -0.5)
    q = q_proj(c_q, cos, sin)                                    # MXTensor [B, S, H, 192] (mxfp8) / bf16 tensor
    o, lse = attn(q, k, v)                                       # o bf16 [B, S, H, 128]

Paths:
- "mxfp8": RMSNorm straight to MXFP8 (`rmsnorm_mxfp8`, rowwise + columnwise), the weight's MXFP8
  copies (quantized once per weight update: `MLAQProjection`'s persistent `dispatch.weights.WeightCopies`,
  or `dispatch.weights.quantized_weight`'s cache where `mla_q_projection` is given none), and the fused
  up-projection + RoPE + quantize (`mla_q_uproj_rope_quant`; its MXFP8 backward by default). Without a
  norm weight the input is quantized with `mxfp8_quantize` instead (q_lora_rank None: x = h). q is the
  TrackedMXTensor blocked along the head dim, which `MLAAttention` / `mla_attention` take as is.
- "bf16": the same through bf16 ops: RMSNorm in torch (fp32 statistics, as HF's DeepseekV3RMSNorm),
  a bf16 GEMM, `dispatch.autograd.rope`; q is a bf16 tensor.
Forward and backward run through `dispatch.autograd` (every op one `dispatch.run`, with `backend`). A
plain eager call of the mxfp8 path with a norm weight and the MXFP8 backward (quantize_grad=True) is
one autograd node (`dispatch.q_path.rmsnorm_mla_q`: RMSNorm, the weight's cached copies and the fused
op, with the composition's bytes and gradients) instead of three wrappers' worth of host time; compile
tracing, tensor subclasses (DTensor, FakeTensor), no norm weight or the 16-bit backward take the
composition.

RoPE styles (`rope_style`; spec/rope.py has the formulas): "mla" takes each head's 64 RoPE features
as interleaved pairs (x[2k], x[2k+1]) and writes the rotated pairs as halves -- DeepSeek's checkpoints
(HF `rope_interleave=True`); "neox" takes them as halves (x[k], x[32+k]) and writes halves (HF
`rope_interleave=False`, Llama's rotate_half). The fused kernel implements "mla" only; "neox" on the
mxfp8 path runs it on q_b_proj's weight with each head's RoPE rows reordered (`neox_rows`): row
128 + 2k of the reordered weight is row 128 + k and row 128 + 2k + 1 is row 160 + k, so the fused op's
input pairs are the neox pairs, and its output equals neox RoPE of the original q exactly (each output
feature is the same dot product, only moved). The gradient returns to the original rows.

cos / sin are per-token rows [..., 64] matching x's leading dims (broadcast over a batch of 1), the
`cat([freqs, freqs])` layout HF's rotary embedding and DeepSeek's reference produce, float32 or
bfloat16 (float16 is widened to float32 exactly).
"""
from __future__ import annotations

import math
import threading
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dispatch.autograd as mxag
from dispatch.q_path import rmsnorm_mla_q, rmsnorm_mla_q_traced
from dispatch.weights import WeightCopies, quantized_weight
from spec.checks import require_bool
from spec.constants import BLOCK_SIZE, MLA_QK_HEAD_DIM
from spec.mxtensor import MXTensor

__all__ = ["MLAQProjection", "MLAAttention", "mla_q_projection", "rms_norm", "neox_rows", "PATHS", "ROPE_STYLES"]

PATHS = ("mxfp8", "bf16")
ROPE_STYLES = ("mla", "neox")
ROPE_DIM = 64
NOPE_DIM = MLA_QK_HEAD_DIM - ROPE_DIM

_rows_lock = threading.Lock()
_rows_cache: Dict[Tuple[int, str], Tensor] = {}


def neox_rows(heads: int, device=None) -> Tensor:
    """int64 [heads * 192]: the row order of q_b_proj's weight under which the fused (mla-style) RoPE
    computes neox RoPE (module docstring). One tensor per (heads, device), so that
    `dispatch.weights` caches the reordered copy."""
    device = torch.device("cpu" if device is None else device)
    key = (int(heads), str(device))
    rows = _rows_cache.get(key)  # read without the lock (a dict read is atomic), which dynamo cannot trace
    if rows is not None:
        return rows
    with _rows_lock:
        rows = _rows_cache.get(key)
        if rows is None:
            half = ROPE_DIM // 2
            k = torch.arange(half)
            rope = torch.stack([NOPE_DIM + k, NOPE_DIM + half + k], dim=1).reshape(-1)  # 128, 160, 129, 161, ...
            head = torch.cat([torch.arange(NOPE_DIM), rope])
            rows = (torch.arange(heads)[:, None] * MLA_QK_HEAD_DIM + head[None, :]).reshape(-1).to(device)
            _rows_cache[key] = rows
    return rows


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as HF's DeepseekV3RMSNorm (and TorchTitan's): statistics in fp32, normalized x cast
    back to x's dtype, then times weight (result in the promoted dtype)."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


def _token_rows(t: Tensor, name: str, lead: Tuple[int, ...]) -> Tensor:
    """cos / sin [..., 64] broadcast to x's leading dims and flattened to [T, 64]."""
    if not isinstance(t, Tensor) or t.dim() < 1 or t.shape[-1] != ROPE_DIM:
        shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected per-token rows [..., {ROPE_DIM}], got {shape}")
    try:
        t = t.expand(lead + (ROPE_DIM,))
    except RuntimeError:
        raise ValueError(f"{name}: shape {tuple(t.shape)} does not broadcast to x's leading dims {lead} + (64,)") from None
    if t.dtype == torch.float16:
        t = t.float()  # exact widening: the ops take float32 / bfloat16 tables
    return t.reshape(-1, ROPE_DIM)


def mla_q_projection(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, *, norm_weight: Optional[Tensor] = None,
                     eps: float = 1e-6, path: str = "mxfp8", rope_style: str = "mla", quantize_grad: bool = True,
                     backend: Optional[str] = None, weight_copies: Optional[WeightCopies] = None):
    """The MLA query path from x to roped q (module docstring), functional.

    x [..., K] (float32 / bfloat16 / float16; leading dims flattened to T tokens): c_q when norm_weight
    [K] is given (RMSNorm applied here, eps as given), else the up-projection's input itself.
    weight [H * 192, K] (q_b_proj's, any float dtype; the mxfp8 path quantizes it from bf16, the bf16
    path casts it to bf16). cos, sin: per-token rows [..., 64] (see the module docstring).
    Returns q [..., H, 192]: a TrackedMXTensor blocked along the head dim (e4m3, compact scales) on the
    mxfp8 path, a bfloat16 tensor on the bf16 path. The mxfp8 path needs T and K multiples of 32.
    weight_copies: the weight's persistent MXFP8 copies (`dispatch.weights.WeightCopies`, refreshed
    once per optimizer step), used on the mxfp8 path for a plain (non-DTensor) weight instead of
    `quantized_weight`'s cache; under torch.compile the graph then reads them as inputs, and with a
    norm weight and the MXFP8 backward the query path is one custom op (`rmsnorm_mla_q_traced`).
    Without them a compiled graph quantizes the weight in every forward."""
    _check_choice("path", path, PATHS)
    _check_choice("rope_style", rope_style, ROPE_STYLES)
    require_bool("quantize_grad", quantize_grad)
    if not isinstance(x, Tensor) or x.dim() < 2:
        raise ValueError(f"x: expected a tensor [..., K] with at least 2 dims, got "
                         f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[0] % MLA_QK_HEAD_DIM:
        raise ValueError(f"weight: expected [H * {MLA_QK_HEAD_DIM}, K], got "
                         f"{tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"x: expected {weight.shape[1]} features in the last dim (weight's K: the "
                         f"module's in_features), got shape {tuple(x.shape)}")
    if norm_weight is not None and tuple(norm_weight.shape) != (x.shape[-1],):
        raise ValueError(f"norm_weight: expected shape ({x.shape[-1]},), got {tuple(norm_weight.shape)}")
    lead = tuple(x.shape[:-1])
    heads = weight.shape[0] // MLA_QK_HEAD_DIM
    cos_t, sin_t = _token_rows(cos, "cos", lead), _token_rows(sin, "sin", lead)
    if cos_t.dtype != sin_t.dtype:
        sin_t = sin_t.to(cos_t.dtype)
    x2 = x.reshape(-1, x.shape[-1])
    tokens = x2.shape[0]
    if path == "bf16":
        h = x2 if norm_weight is None else rms_norm(x2, norm_weight, eps)
        q = F.linear(h.to(torch.bfloat16), weight.to(torch.bfloat16)).view(tokens, heads, MLA_QK_HEAD_DIM)
        q = mxag.rope(q, cos_t, sin_t, style=rope_style, layout="thd", backend=backend)
        return q.view(lead + (heads, MLA_QK_HEAD_DIM))
    if tokens % 32 or x2.shape[1] % 32:
        raise ValueError(f"x: the mxfp8 path needs the token count and K to be multiples of 32 (MXFP8 blocks), "
                         f"got {tokens} tokens of K = {x2.shape[1]}")
    rows = neox_rows(heads, weight.device) if rope_style == "neox" else None
    copies = weight_copies if weight_copies is not None and mxag.plain_classes((weight,)) else None
    if norm_weight is not None and quantize_grad is True:
        tensors = (x2, norm_weight, weight, cos_t, sin_t, rows)
        if mxag.plain_eager(tensors):
            entry = None if copies is None else copies.current(weight, rows)
            q_row = rmsnorm_mla_q(x2, norm_weight, weight, cos_t, sin_t, eps=eps, rows=rows, backend=backend,
                                  copies=entry)
            return mxag.reshape_mx(q_row, lead + (heads, MLA_QK_HEAD_DIM))
        if copies is not None and torch.compiler.is_compiling() and mxag.plain_classes(tensors):
            q_row = rmsnorm_mla_q_traced(x2, norm_weight, weight, copies.traced(), cos_t, sin_t, eps=eps, rows=rows,
                                         backend=backend)
            return mxag.reshape_mx(q_row, lead + (heads, MLA_QK_HEAD_DIM))
    if norm_weight is None:
        x_row, x_col = mxag.mxfp8_quantize(x2, axis=(1, 0), backend=backend)
    else:
        x_row, x_col, _ = mxag.rmsnorm_mxfp8(x2, norm_weight, eps=eps, backend=backend)
    if copies is not None:
        w_row, w_col = copies.tracked(weight, rows)
    else:
        w_row, w_col = quantized_weight(weight, backend=backend, rows=rows)
    q_row, _ = mxag.mla_q_uproj_rope_quant(x_row, w_row, cos_t, sin_t, quantize_grad=quantize_grad, x_t=x_col,
                                           w_n=w_col, backend=backend)
    return mxag.reshape_mx(q_row, lead + (heads, MLA_QK_HEAD_DIM))


class MLAQProjection(nn.Module):
    """The fused MLA query path: q = RoPE(RMSNorm(c_q) @ weight^T) (see the module docstring).

    Parameters: `weight` [num_heads * 192, in_features] (q_b_proj's), `norm_weight` [in_features]
    (q_a_layernorm's; None when norm=False, then the input is used unnormalized), in `dtype`.
    Path "mxfp8" keeps the weight's MXFP8 copies in `weight_copies` (`dispatch.weights.WeightCopies`:
    non-persistent buffers), made at construction, after `load_state_dict`, `.to()` and
    `refresh_weight_copies()`, after every step of an optimizer given to `refresh_after(optimizer)`,
    and in eager forwards whenever the weight changed; a compiled forward reads them as they are.
    forward(x [..., in_features], cos, sin [..., 64]) -> q [..., num_heads, 192]: TrackedMXTensor
    (path "mxfp8") or bfloat16 tensor (path "bf16")."""

    def __init__(self, in_features: int, num_heads: int, *, path: str = "mxfp8", norm: bool = True,
                 eps: float = 1e-6, rope_style: str = "mla", quantize_grad: bool = True,
                 backend: Optional[str] = None, device=None, dtype=None):
        super().__init__()
        _check_choice("path", path, PATHS)
        _check_choice("rope_style", rope_style, ROPE_STYLES)
        require_bool("quantize_grad", quantize_grad)
        self.in_features, self.num_heads = int(in_features), int(num_heads)
        self.path, self.rope_style, self.eps = path, rope_style, float(eps)
        self.quantize_grad, self.backend = bool(quantize_grad), backend
        factory = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(self.num_heads * MLA_QK_HEAD_DIM, self.in_features, **factory))
        if norm:
            self.norm_weight = nn.Parameter(torch.ones(self.in_features, **factory))
        else:
            self.register_parameter("norm_weight", None)
        self._make_copies()
        self.reset_parameters()
        self.register_load_state_dict_post_hook(lambda module, _keys: module.refresh_weight_copies())

    def _make_copies(self) -> None:
        self.weight_copies = (WeightCopies(self.weight.shape, backend=self.backend, device=self.weight.device)
                              if self.path == "mxfp8" else None)

    def _rows(self) -> Optional[Tensor]:
        return neox_rows(self.num_heads, self.weight.device) if self.rope_style == "neox" else None

    def refresh_weight_copies(self) -> None:
        """Quantize the weight into `weight_copies` now (path "mxfp8" with a plain, materialized weight)."""
        if self.weight_copies is not None:
            self.weight_copies.refresh_if_ready(self.weight, self._rows())

    def refresh_after(self, optimizer: torch.optim.Optimizer):
        """Refresh `weight_copies` after every `optimizer.step()`; returns the hook's handle (None on the
        bf16 path)."""
        if self.weight_copies is None:
            return None
        return self.weight_copies.refresh_after(optimizer, self.weight, self._rows())

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if getattr(self, "weight_copies", None) is not None:
            self.refresh_weight_copies()  # .to(dtype) may change the weight's bf16 values
        return out

    @classmethod
    def from_linear(cls, linear: nn.Linear, norm: Optional[nn.Module] = None, **kwargs) -> "MLAQProjection":
        """A module sharing `linear`'s weight (q_b_proj, no bias) and `norm`'s weight and eps
        (`variance_epsilon` or `eps` attribute); the Parameters are the same objects, not copies."""
        if getattr(linear, "bias", None) is not None:
            raise ValueError("linear: the fused Q path has no bias; got a Linear with bias")
        out_features, in_features = linear.weight.shape
        if out_features % MLA_QK_HEAD_DIM:
            raise ValueError(f"linear: expected out_features a multiple of {MLA_QK_HEAD_DIM}, got {out_features}")
        if norm is not None:
            kwargs.setdefault("eps", getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        module = cls(in_features, out_features // MLA_QK_HEAD_DIM, norm=False, device="meta", **kwargs)
        module.weight = linear.weight
        if norm is not None:
            module.norm_weight = norm.weight
        module._make_copies()
        module.refresh_weight_copies()
        return module

    def reset_parameters(self) -> None:
        if self.weight.device.type == "meta":
            return
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's default
        if self.norm_weight is not None:
            nn.init.ones_(self.norm_weight)
        self.refresh_weight_copies()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor):
        return mla_q_projection(x, self.weight, cos, sin, norm_weight=self.norm_weight, eps=self.eps, path=self.path,
                                rope_style=self.rope_style, quantize_grad=self.quantize_grad, backend=self.backend,
                                weight_copies=self.weight_copies)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, num_heads={self.num_heads}, path={self.path!r}, "
                f"rope_style={self.rope_style!r}, norm={self.norm_weight is not None}, backend={self.backend!r}")


_SEQ_AXIS = {"bshd": 1, "sbhd": 0, "thd": 0}


def attention_operand(name: str, t, axis: int, path: str, backend=None):
    """The attention operand `name` for `path`: an MXTensor as it is; otherwise bf16 (path "bf16") or
    quantized to MXFP8 along `axis` (path "mxfp8": q, k along D, v along S)."""
    if isinstance(t, MXTensor):
        return t
    if path == "bf16":
        return t.to(torch.bfloat16)
    if isinstance(t, Tensor) and -t.dim() <= axis < t.dim() and t.shape[axis] % BLOCK_SIZE:
        along, size = ("the head dim", "D") if axis == -1 else (f"the sequence axis (dim {axis})", "S")
        raise ValueError(f"{name}: path 'mxfp8' quantizes {name} in blocks of {BLOCK_SIZE} along {along}, "
                         f"expected {size} a multiple of {BLOCK_SIZE}, got {size} = {t.shape[axis]} "
                         f"(shape {tuple(t.shape)})")
    return mxag.mxfp8_quantize(t, axis=axis, backend=backend)  # a strided slice is read in place where it can be


class MLAAttention(nn.Module):
    """The MLA attention core: o, lse = attention(q, k, v) through `dispatch.autograd.mla_attention`.

    q, k [..., H, 192] and v [..., H, 128] in `layout` ("bshd" [B, S, H, D], "sbhd", or "thd" [T, H, D]
    with int32 cu_seqlens [B + 1] given to forward). Each is a tensor or an MXTensor (q and k blocked
    along D, v along the sequence axis). Path "mxfp8" quantizes plain operands so blocked (e4m3, from
    their own dtype, straight-through gradient); path "bf16" casts plain operands to bfloat16 and
    passes MXTensors through. softmax_scale None is 1/sqrt(192); yarn-scaled models pass their scale
    (HF: `attn.scaling`, which includes mscale^2). causal masks key j > i (bottom-right aligned).
    Returns o bfloat16 [..., H, 128] (differentiable) and lse float32 ([B, H, S] / [H, T]; no gradient)."""

    def __init__(self, *, causal: bool = True, softmax_scale: Optional[float] = None, layout: str = "bshd",
                 path: str = "mxfp8", backend: Optional[str] = None):
        super().__init__()
        _check_choice("path", path, PATHS)
        _check_choice("layout", layout, tuple(_SEQ_AXIS))
        self.causal, self.layout, self.path, self.backend = bool(causal), layout, path, backend
        self.softmax_scale = None if softmax_scale is None else float(softmax_scale)

    def _prepare(self, name: str, t, axis: int):
        return attention_operand(name, t, axis, self.path, self.backend)

    def forward(self, q, k, v, cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_kv: Optional[Tensor] = None,
                causal: Optional[bool] = None, softmax_scale: Optional[float] = None) -> Tuple[Tensor, Tensor]:
        """(o, lse); `causal` and `softmax_scale` override the module's settings for this call (an
        argument, so that a caller with a per-call scale mutates no module state under torch.compile)."""
        q = self._prepare("q", q, -1)
        k = self._prepare("k", k, -1)
        v = self._prepare("v", v, _SEQ_AXIS[self.layout])
        causal = self.causal if causal is None else bool(causal)
        scale = self.softmax_scale if softmax_scale is None else float(softmax_scale)
        return mxag.mla_attention(q, k, v, causal=causal, softmax_scale=scale, layout=self.layout,
                                  cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, backend=self.backend)

    def extra_repr(self) -> str:
        return (f"causal={self.causal}, softmax_scale={self.softmax_scale}, layout={self.layout!r}, "
                f"path={self.path!r}, backend={self.backend!r}")

