"""TorchTitan's DeepSeek-V3 on the mxmla path: `convert_deepseek_v3(model_config, path="mxfp8" | "bf16")`.

    from torchtitan.models.deepseek_v3 import model_registry
    from dispatch.integrations.torchtitan import MXMLAConverter, convert_deepseek_v3

    spec = model_registry("671B", attn_backend="varlen", converters=[MXMLAConverter.Config(path="mxfp8")])
    config = convert_deepseek_v3(model_config, path="mxfp8")      # the same on any config tree

A TorchTitan job names it either way: `model_registry(flavor, converters=[MXMLAConverter.Config(...)])`
in its config function, or `--override.imports dispatch.integrations.torchtitan.mxmla_attention` (kwargs
as JSON: `'dispatch.integrations.torchtitan.mxmla_attention={"path": "bf16"}'`).

Every DeepSeek-V3 `Attention.Config` of the tree becomes an `MXMLAAttention.Config` (TorchTitan's
`derive`: every field kept, plus `path`, `backend`, `quantize_grad`). `MXMLAAttention` subclasses
TorchTitan's `Attention` and builds the same submodules (wq / wq_a, q_norm, wq_b, wkv_a, kv_norm,
wkv_b, wo, rope, inner_attention), so parameters, FQNs, state dicts, initialisation and TorchTitan's
sharding configs are stock's. Its forward computes what stock computes, through `dispatch`:

    c_q = wq_a(x)                                           TorchTitan module (q_lora_rank 0: the input is x)
    q   = mla_q_projection(c_q, wq_b.weight, cos, sin, norm_weight=q_norm.weight, eps=q_norm.eps)
          mxfp8: rmsnorm_mxfp8 -> fused up-projection + RoPE + MXFP8 quantize; bf16: RMSNorm -> GEMM -> rope
    kv, k_pe = split(wkv_a(x)); k_pe = rope(k_pe)           TorchTitan module, mxmla rope
    [k_nope | v] = wkv_b(kv_norm(kv))                       TorchTitan modules
    o = mla_attention(q, [k_nope | k_pe], v, causal, softmax_scale)     mxfp8: k, v by mla_kv_mxfp8
    out = wo(o)                                             TorchTitan module

Conventions mapped:
- RoPE: TorchTitan's ComplexRoPE rotates adjacent pairs (x[2k], x[2k+1]) and writes them back
  interleaved; mxmla's "mla" style rotates the same pairs by the same angles and writes them as halves.
  Applied to both q and k_pe, the two layouts differ by one permutation of the 64 RoPE features shared by
  q and k, so every q.k (hence o, and every gradient reaching a parameter) is the same. cos / sin are the
  real and imaginary parts of the layer's own `rope.cache` (yarn frequencies included), gathered by
  `positions` (None: 0..S-1), so positions restarting per packed document are honoured.
- Softmax scale: the layer's `softmax_scale` (192^-0.5 times mscale^2 under yarn, as stock computes it).
- q_norm: its own weight and eps (TorchTitan's RMSNorm.Config default 1e-5; eps None is the dtype's
  machine epsilon, as nn.RMSNorm).
- Masks: a flex BlockMask whose mask_mod is TorchTitan's causal mask, or causal AND its packed-document
  mask (`get_efficient_causal_mask_mod_for_packed_document` / `get_document_mask_mod`, which
  `Decoder.get_attention_masks` builds from the same `positions`): causal attention over the documents
  where `positions` restart at 0 (thd layout; the number of documents is data, so building their
  cu_seqlens reads the device once: per forward in eager mode, shared by the layers; per layer under
  torch.compile, a custom op with a data-dependent size). `VarlenMetadata` of a causal `VarlenAttention`
  (window (-1, 0)), or a full one ((-1, -1)): its `cu_seq_q` as thd cu_seqlens, used as given (the
  integration reads nothing; TorchTitan built it with one read per forward). Under torch.compile a
  changing number of documents costs dynamo's one recompile to a dynamic size, then none.

What the path cannot serve runs stock's forward, the reason logged once per reason to
logging.getLogger("mxmla.integrations") and counted in `layer.mxmla_fallbacks` (eager calls): a
mask_mod other than those above (sliding windows, fixed blocks, score mods, mappings of several masks),
a document mask without positions, VarlenMetadata with a sliding window or different q / k offsets,
masks None, on the mxfp8 path a sequence length that is not a multiple of 32, and context parallelism
(mxmla's ring attention is not wired to TorchTitan's CP). Where stock's `VarlenAttention` cannot be built
(TorchTitan activates FlashAttention 3 for it on Hopper and 4 on Blackwell, and raises ImportError where
that package is absent), the layer builds with a parameterless stand-in in its place (the same FQNs and
state dict), logs why once, serves what mxmla serves, and raises a RuntimeError naming the missing package
and the unservable setting for any call it would hand to stock's forward. Raised at conversion, naming the field: head
dims other than 128 + 64 / 128, a RoPE other than ComplexRoPE, q_lora_rank (or dim when it is 0) not a
multiple of 32 on the mxfp8 path, wq_b / wq with bias, q_norm without a weight, an unknown path.

Tensor parallelism: with DTensor parameters (TorchTitan's "partial_dtensor" backend; tested) the
forward runs on each rank's local heads (x replicated, wq_b / wkv_b column shards; replicated inputs
used per head hand back Partial gradients) and hands wo its input as a DTensor sharded on the features,
as stock's rowwise wo expects; with the "spmd_types" backend (TorchTitan's default; tested) the tensors
are the local ones already. FSDP2 in eager mode: q's MXFP8 weight copy is keyed on the sharded
parameter and the optimizer-step clock (`_q_copy_token`), so it is made once per optimizer step
although the all-gather lands the weight in new storage every forward (docs/INTEGRATION.md).
"""
from __future__ import annotations

import logging
import weakref
from collections import Counter
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

import dispatch.autograd as mxag
from dispatch.nn import PATHS, mla_q_projection
from dispatch.policy import parse_backend_list
from dispatch.weights import adopt, cached_copy, invalidate, optimizer_generation
from spec.checks import require_bool

try:  # the optional extra `.[torchtitan]`
    from torch.nn.attention.flex_attention import BlockMask, and_masks
    from torchtitan.config import derive, override
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.common.attention import (
        VarlenAttention,
        VarlenMetadata,
        get_causal_mask_mod,
        get_document_mask_mod,
        get_efficient_causal_mask_mod_for_packed_document,
    )
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.deepseek_v3.model import Attention
    from torchtitan.protocols.model import ModelConfigConverter
except ImportError as _error:  # pragma: no cover - exercised only without torchtitan
    raise ImportError("dispatch.integrations.torchtitan needs TorchTitan: pip install 'mxmla[torchtitan]' "
                      f"(torchtitan==0.3.0, which imports names torch 2.12 added; this is torch "
                      f"{torch.__version__}); import failed with: {_error}") from _error

__all__ = ["MXMLAAttention", "MXMLAConverter", "MXMLASelectiveAC", "convert_deepseek_v3", "mxmla_attention",
           "mxmla_save_ops"]

log = logging.getLogger("mxmla.integrations")

NOPE_DIM, ROPE_DIM, V_DIM = 128, 64, 128
_logged: set = set()


def _dtensor_type():
    import sys

    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def _local(t, per_head: bool = False):
    """t's local tensor when it is a DTensor (differentiable), else t. per_head: t is replicated over the
    tensor-parallel mesh and each rank uses it for its own heads only, so each rank's gradient is a
    partial sum (declared Partial where t is Replicate: DTensor reduces it where stock's ops would)."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(t, dtensor):
        return t
    if not per_head:
        return t.to_local()
    from torch.distributed.tensor import Partial, Replicate

    grads = [Partial() if isinstance(p, Replicate) else p for p in t.placements]
    return t.to_local(grad_placements=grads)


# --------------------------------------------------------------------------------------------------
# Which flex mask_mods map onto mla_attention (identified by their code objects, not their names)
# --------------------------------------------------------------------------------------------------

def _code(fn):
    return getattr(fn, "__code__", None)


_CAUSAL_CODE = _code(get_causal_mask_mod())
_AND_CODE = _code(and_masks(get_causal_mask_mod()))
_DOCUMENT_CODES = frozenset(
    _code(f) for f in (get_efficient_causal_mask_mod_for_packed_document(torch.zeros(1, 2, dtype=torch.long)),
                       get_efficient_causal_mask_mod_for_packed_document(torch.zeros(2, 2, dtype=torch.long)),
                       get_document_mask_mod(torch.zeros(1, 2, dtype=torch.long))))


def _mask_mods(mask_mod) -> Optional[tuple]:
    """The mask_mods an `and_masks` result combines ((mask_mod,) for any other function)."""
    if _code(mask_mod) is _AND_CODE:
        names = mask_mod.__code__.co_freevars
        return tuple(mask_mod.__closure__[names.index("mask_mods")].cell_contents)
    return (mask_mod,)


def _flex_plan(mask: "BlockMask", seq: int, positions) -> Tuple[Optional[str], str]:
    """(reason or None, "causal" | "documents") for a flex BlockMask."""
    if tuple(mask.seq_lengths) != (seq, seq):
        return f"attention_masks: a BlockMask for lengths {tuple(mask.seq_lengths)}, the input has {seq}", ""
    if getattr(mask, "score_mod", None) is not None:
        return "attention_masks: a BlockMask with a score_mod", ""
    mods = _mask_mods(mask.mask_mod)
    codes = [_code(m) for m in mods]
    if _CAUSAL_CODE not in codes:
        return f"attention_masks: a flex mask_mod without TorchTitan's causal mask ({_names(mods)})", ""
    rest = [c for c in codes if c is not _CAUSAL_CODE]
    if not rest:
        return None, "causal"
    if all(c in _DOCUMENT_CODES for c in rest):
        if positions is None:
            return "attention_masks: a packed-document mask without positions", ""
        return None, "documents"
    return f"attention_masks: a flex mask_mod mxmla cannot map ({_names(mods)})", ""


def _names(mods) -> str:
    return ", ".join(getattr(m, "__name__", type(m).__name__) for m in mods)


@torch.library.custom_op("mxmla::titan_document_cu_seqlens", mutates_args=())
def _document_cu_seqlens_op(positions: Tensor, batch: int, seq: int) -> Tensor:
    tokens = batch * seq
    flat = positions.expand(batch, seq).reshape(tokens)
    index = torch.arange(tokens, device=flat.device)
    starts = ((flat == 0) | (index % seq == 0)).nonzero().flatten()
    return torch.cat([starts, starts.new_full((1,), tokens)]).to(torch.int32)


@_document_cu_seqlens_op.register_fake
def _(positions, batch, seq):
    # the number of documents is data: an unbacked size (at least one document, at most one per token)
    entries = torch.library.get_ctx().new_dynamic_size(min=2, max=batch * seq + 1)
    return positions.new_empty((entries,), dtype=torch.int32)


_cu_cache: "WeakTensorKeyDictionary" = WeakTensorKeyDictionary()


def document_cu_seqlens(positions: Tensor, batch: int, seq: int) -> Tensor:
    """int32 [documents + 1]: cu_seqlens of the documents of the packed rows, a document starting at
    each row start and wherever `positions` is 0 (TorchTitan's convention). The number of documents is
    data, so this reads the device once (a custom op with a data-dependent size under torch.compile);
    eager calls keep the result per positions tensor, so the layers of one forward share that read."""
    compiling = torch.compiler.is_compiling()
    key = (positions._version, batch, seq)
    if not compiling:
        hit = _cu_cache.get(positions)
        if hit is not None and hit[0] == key:
            return hit[1]
    cu = _document_cu_seqlens_op(positions, batch, seq)
    if not compiling:
        _cu_cache[positions] = (key, cu)
    return cu


# --------------------------------------------------------------------------------------------------
# The attention module
# --------------------------------------------------------------------------------------------------

def _check_config(cfg, path: str) -> None:
    """Raise, naming the field, for what the mxmla path cannot run at all."""
    if path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
    for name, want in (("qk_nope_head_dim", NOPE_DIM), ("qk_rope_head_dim", ROPE_DIM), ("v_head_dim", V_DIM)):
        if getattr(cfg, name) != want:
            raise ValueError(f"Attention.Config.{name}: mxmla serves DeepSeek-V3's head dims (qk_nope 128 + "
                             f"qk_rope 64, v 128), got {name}={getattr(cfg, name)}")
    if not isinstance(cfg.rope, ComplexRoPE.Config):
        raise TypeError(f"Attention.Config.rope: mxmla maps TorchTitan's ComplexRoPE (adjacent pairs), got "
                        f"{type(cfg.rope).__qualname__}")
    if cfg.q_lora_rank == 0:
        proj, width, field = cfg.wq, cfg.dim, "dim"
    else:
        proj, width, field = cfg.wq_b, cfg.q_lora_rank, "q_lora_rank"
        if not cfg.q_norm.elementwise_affine:
            raise ValueError("Attention.Config.q_norm.elementwise_affine: the fused Q path needs q_norm's weight, "
                             "got False")
    name = "wq" if cfg.q_lora_rank == 0 else "wq_b"
    if proj is None:
        raise ValueError(f"Attention.Config.{name}: required for q_lora_rank={cfg.q_lora_rank}, got None")
    if proj.bias:
        raise ValueError(f"Attention.Config.{name}.bias: the fused Q path has no bias, got True")
    if path == "mxfp8" and width % 32:
        raise ValueError(f"Attention.Config.{field}: the mxfp8 path needs a multiple of 32 (MXFP8 blocks), "
                         f"got {width}")


def _cp_wrapped(inner) -> bool:
    """Whether TorchTitan's apply_cp_to_forward wrapped this inner attention (its CP path without
    Module.parallelize, where `MXMLAAttention.parallelize` does not see the CP degree)."""
    return getattr(vars(inner).get("forward"), "__name__", "") == "cp_forward"


def _fsdp_param(module, name: str):
    """FSDP2's FSDPParam of `module.<name>`, or None where FSDP2 does not manage it. Read from
    torch.distributed's registry of composable states (FSDP2 internals, so every step is checked:
    anything unexpected answers None, and the copy is then keyed as dispatch.weights keys it)."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    for ref in list(_module_state_mapping.values()):
        state = ref() if isinstance(ref, weakref.ref) else ref
        if not isinstance(state, FSDPState):
            continue
        group = getattr(state, "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", None) or ():
            info = getattr(fsdp_param, "_module_info", None)
            if getattr(info, "module", None) is module and getattr(info, "param_name", None) == name:
                return fsdp_param
    return None


def _drop_weight_copies(module, incompatible_keys) -> None:
    invalidate()


class _UnbuiltVarlenAttention(VarlenAttention):
    """In place of stock's `VarlenAttention` where it cannot be built (`unbuildable`): no parameters, as
    stock's, so FQNs and state dicts are unchanged; calling it raises (MXMLAAttention raises first)."""

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        unbuilt: str = ""
        """Why stock's VarlenAttention could not be built."""

    def __init__(self, config: Config) -> None:
        super(VarlenAttention, self).__init__()  # not VarlenAttention's: it activates the missing kernel
        self.window_size = config.window_size
        self.unbuilt = config.unbuilt

    def forward(self, *args, **kwargs):
        raise RuntimeError(self.unbuilt)


def unbuildable(inner_config) -> Optional[str]:
    """Why TorchTitan's inner attention `inner_config` cannot be built here, or None (it builds, or it
    is not a VarlenAttention). Its build activates FlashAttention 3 (Hopper) or 4 (Blackwell) for
    varlen_attn and raises ImportError where that package is absent."""
    if not isinstance(inner_config, VarlenAttention.Config) or isinstance(inner_config, _UnbuiltVarlenAttention.Config):
        return None
    try:
        inner_config.build()
    except ImportError as error:
        package = f" (package {error.name!r})" if getattr(error, "name", None) else ""
        return (f"TorchTitan's VarlenAttention cannot be built here{package}: {type(error).__name__}: {error}")
    return None


class MXMLAAttention(Attention):
    """TorchTitan's DeepSeek-V3 `Attention` whose forward runs mxmla's MLA path (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Attention.Config):
        path: str = "mxfp8"
        """"mxfp8" | "bf16": the mxmla path (dispatch.nn)."""
        backend: Optional[str] = None
        """For every mxmla op (None: MXMLA_BACKEND or the automatic choice)."""
        quantize_grad: bool = True
        """The fused Q op's MXFP8 backward (path "mxfp8")."""

    def __init__(self, config: Config):
        _check_config(config, config.path)
        require_bool("MXMLAAttention.Config.quantize_grad", config.quantize_grad)
        unbuilt = unbuildable(config.inner_attention)
        if unbuilt is not None:  # mxmla serves varlen itself: build without stock's kernel (module docstring)
            inner = config.inner_attention
            config = replace(config, inner_attention=_UnbuiltVarlenAttention.Config(window_size=inner.window_size,
                                                                                    unbuilt=unbuilt))
            if unbuilt not in _logged:  # once per reason, as the fallbacks
                _logged.add(unbuilt)
                log.warning("mxmla %s path: a DeepSeek-V3 Attention builds without stock's inner attention: %s; "
                            "mxmla serves VarlenMetadata itself, a call it would hand to TorchTitan's forward "
                            "raises", config.path, unbuilt)
        super().__init__(config)
        self.stock_unbuilt: Optional[str] = unbuilt
        """Why stock's inner attention could not be built (its calls then raise), or None."""
        self.path, self.backend, self.quantize_grad = config.path, config.backend, bool(config.quantize_grad)
        self.mxmla_fallbacks: Counter = Counter()
        self.mxmla_served = 0
        self._context_parallel = False
        self._q_copy = None       # (token, MXFP8Weight): q's weight copy under FSDP2 (see _q_copy_token)
        self._fsdp_probe = None   # (weakref to the weight seen, weakref to its FSDPParam or None)
        # a load writes the parameters outside an optimizer step; under FSDP2 the gathered weight the
        # copies were keyed on does not see it, so every cached copy goes (dispatch.weights.invalidate)
        self.register_load_state_dict_post_hook(_drop_weight_copies)

    def __getstate__(self):
        # the FSDP2 probe holds weak references (not picklable) and the copy is a cache: neither travels
        state = super().__getstate__()
        return {**state, "_q_copy": None, "_fsdp_probe": None}

    def parallelize(self, parallel_dims) -> None:
        self._context_parallel = bool(getattr(parallel_dims, "cp_enabled", False))
        super().parallelize(parallel_dims)

    # ---- what this call can run -------------------------------------------------------------

    def _plan(self, x, attention_masks, positions) -> Tuple[Optional[str], str, bool]:
        """(reason or None, "causal" | "documents" | "varlen", causal)."""
        if self._context_parallel or _cp_wrapped(self.inner_attention):
            return "context parallelism (mxmla's ring attention is not wired to TorchTitan's CP)", "", True
        if x.dim() != 3:
            return f"x: expected [B, S, dim], got {tuple(x.shape)}", "", True
        seq = x.shape[1]
        if self.path == "mxfp8" and seq % 32:
            return f"sequence length {seq} is not a multiple of 32 (the mxfp8 path blocks v along S)", "", True
        if attention_masks is None:
            return "attention_masks: None (stock's inner attention needs a BlockMask or VarlenMetadata)", "", True
        if isinstance(attention_masks, BlockMask):
            reason, kind = _flex_plan(attention_masks, seq, positions)
            return reason, kind, True
        if isinstance(attention_masks, VarlenMetadata):
            window = tuple(getattr(self.inner_attention, "window_size", (-1, 0)))
            if not isinstance(self.inner_attention, VarlenAttention) or window not in ((-1, 0), (-1, -1)):
                return f"VarlenMetadata with window_size {window} (served: (-1, 0) causal, (-1, -1) full)", "", True
            if attention_masks.cu_seq_k is not attention_masks.cu_seq_q:
                return "VarlenMetadata: cu_seq_k is not cu_seq_q (mxmla serves self-attention offsets)", "", True
            return None, "varlen", window == (-1, 0)
        return f"attention_masks: a {type(attention_masks).__name__} (served: a BlockMask or VarlenMetadata)", "", True

    def _fall_back(self, reason: str) -> None:
        if torch.compiler.is_compiling():
            return
        self.mxmla_fallbacks[reason] += 1
        if reason not in _logged:
            _logged.add(reason)
            log.warning("mxmla %s path: a DeepSeek-V3 Attention runs TorchTitan's forward: %s (logged once per "
                        "reason)", self.path, reason)

    # ---- q's weight copy under FSDP2 --------------------------------------------------------

    def _q_copy_token(self, owner, weight) -> Optional[tuple]:
        """When FSDP2 manages q's weight (eager, unsharded for this forward): what its values depend on,
        the optimizer-step clock and the sharded parameter's identity and version counters (in-place
        writes: optimizer steps, loads). The gathered weight lands in new storage at each all-gather
        while these stand still, so dispatch.weights' own key (storage, version) would re-quantize every
        forward; equal tokens let the copy made earlier in the step serve. None elsewhere."""
        probe = self._fsdp_probe
        if probe is None or probe[0]() is not weight:
            fsdp_param = _fsdp_param(owner, "weight")
            probe = self._fsdp_probe = (weakref.ref(weight), None if fsdp_param is None else weakref.ref(fsdp_param))
        fsdp_param = None if probe[1] is None else probe[1]()
        if fsdp_param is None or getattr(fsdp_param, "_unsharded_param", None) is not weight:
            return None
        sharded = fsdp_param.sharded_param
        local = getattr(sharded, "_local_tensor", sharded)
        return (optimizer_generation(), id(sharded), sharded._version, local._version, self.backend)

    def _q_projection(self, c_q, owner, weight, norm_weight, eps, cos, sin):
        token = None
        # FSDP2's gathered weight is a plain nn.Parameter (a tensor-parallel local view is not: skipped)
        if self.path == "mxfp8" and not torch.compiler.is_compiling() and type(weight) is torch.nn.Parameter:
            token = self._q_copy_token(owner, weight)
            if token is not None and self._q_copy is not None and self._q_copy[0] == token:
                adopt(weight, self._q_copy[1], backend=self.backend)
        q = mla_q_projection(c_q, weight, cos, sin, norm_weight=norm_weight, eps=eps, path=self.path,
                             rope_style="mla", quantize_grad=self.quantize_grad, backend=self.backend)
        if token is not None:
            entry = cached_copy(weight, self.backend)
            self._q_copy = None if entry is None else (token, entry)
        return q

    # ---- forward ---------------------------------------------------------------------------

    def _tables(self, positions, batch: int, seq: int) -> Tuple[Tensor, Tensor]:
        """cos, sin float32 [B or 1, S, 64]: the "mla"-style rows (cat([f, f])) of each token's position."""
        cache = _local(self.rope.cache)
        cos = torch.cat([cache.real, cache.real], dim=-1)
        sin = torch.cat([cache.imag, cache.imag], dim=-1)
        if positions is None:
            return cos[:seq].unsqueeze(0), sin[:seq].unsqueeze(0)
        positions = _local(positions)
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)
        return cos[positions], sin[positions]

    def forward(self, x: Tensor, attention_masks, positions: Optional[Tensor] = None):
        reason, kind, causal = self._plan(x, attention_masks, positions)
        if reason is not None:
            if self.stock_unbuilt is not None:
                raise RuntimeError(f"mxmla {self.path} path cannot serve this call ({reason}), and TorchTitan's "
                                   f"forward cannot run it: {self.stock_unbuilt}")
            self._fall_back(reason)
            return super().forward(x, attention_masks, positions)
        if not torch.compiler.is_compiling():
            self.mxmla_served += 1
        dtensor = _dtensor_type()
        x_in = x
        batch, seq, _ = x.shape
        tokens = batch * seq
        cos, sin = self._tables(positions, batch, seq)

        if self.q_lora_rank == 0:
            owner, c_q, norm_weight, eps = self.wq, _local(x, True), None, 0.0
        else:
            owner, c_q = self.wq_b, _local(self.wq_a(x), True)
            norm_weight = _local(self.q_norm.weight, True)
            eps = self.q_norm.eps if self.q_norm.eps is not None else torch.finfo(c_q.dtype).eps
        q = self._q_projection(c_q, owner, _local(owner.weight), norm_weight, eps, cos, sin)

        kv_down = self.wkv_a(x)
        kv_latent, k_pe = torch.split(kv_down, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = _local(self.wkv_b(self.kv_norm(kv_latent)))
        k_pe = _local(k_pe, True)
        cos_t = cos.expand(batch, seq, ROPE_DIM).reshape(tokens, ROPE_DIM)
        sin_t = sin.expand(batch, seq, ROPE_DIM).reshape(tokens, ROPE_DIM)
        k_pe = mxag.rope(k_pe.reshape(tokens, 1, ROPE_DIM), cos_t, sin_t, style="mla", layout="thd",
                         backend=self.backend)                                          # [T, 1, 64]

        heads = kv.shape[-1] // (NOPE_DIM + V_DIM)  # local heads under tensor parallelism
        if kind == "causal":
            layout, lead, cu = "bshd", (batch, seq), None
        else:
            layout, lead = "thd", (tokens,)
            cu = _local(attention_masks.cu_seq_q) if kind == "varlen" else document_cu_seqlens(
                _local(positions), batch, seq)
            cu = cu.to(torch.int32)
        kv = kv.reshape(lead + (heads, NOPE_DIM + V_DIM))
        k_nope, v = kv[..., :NOPE_DIM], kv[..., NOPE_DIM:]
        k_pe = k_pe.reshape(lead + (1, ROPE_DIM))
        if self.path == "mxfp8":
            if k_pe.dtype != k_nope.dtype:
                k_pe = k_pe.to(k_nope.dtype)
            k, v = mxag.mla_kv_mxfp8(k_nope, k_pe, v, layout=layout, backend=self.backend)
            q = mxag.reshape_mx(q, lead + (heads, NOPE_DIM + ROPE_DIM))
        else:
            k = torch.cat([k_nope, k_pe.expand(lead + (heads, ROPE_DIM))], dim=-1).to(torch.bfloat16)
            v = v.to(torch.bfloat16)
            q = q.reshape(lead + (heads, NOPE_DIM + ROPE_DIM))
        o, _ = mxag.mla_attention(q, k, v, causal=causal, softmax_scale=float(self.softmax_scale), layout=layout,
                                  cu_seqlens_q=cu, cu_seqlens_kv=cu, backend=self.backend)
        out_dtype = _local(x_in).dtype
        o = o.reshape(batch, seq, heads * V_DIM).to(out_dtype)
        wo_weight = self.wo.weight
        if dtensor is not None and isinstance(wo_weight, dtensor):
            # stock's rowwise wo takes the heads' features sharded over the TP mesh
            from torch.distributed.tensor import Replicate, Shard

            mesh = wo_weight.device_mesh
            placements = [Shard(2) if p.is_shard(1) else Replicate() for p in wo_weight.placements]
            o = dtensor.from_local(o, mesh, placements, run_check=False)
        return self.wo(o)


# --------------------------------------------------------------------------------------------------
# Conversion entries
# --------------------------------------------------------------------------------------------------

def convert_deepseek_v3(model_config, path: str = "mxfp8", backend: Optional[str] = None, *,
                        quantize_grad: bool = True):
    """`model_config` (a TorchTitan config tree, e.g. `DeepSeekV3Model.Config`) with every DeepSeek-V3
    `Attention.Config` replaced by an `MXMLAAttention.Config` running `path` ("mxfp8" | "bf16") with
    `backend` for every mxmla op; returns the (root) config. Raises, naming the field, where the path
    cannot run (module docstring); a tree without a DeepSeek-V3 Attention.Config is a ValueError."""
    if path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
    if backend is not None:
        parse_backend_list(backend, "backend")  # a bad name raises here, not at the first forward
    require_bool("quantize_grad", quantize_grad)
    if not hasattr(model_config, "traverse"):
        raise TypeError(f"model_config: expected a TorchTitan Configurable.Config tree, got "
                        f"{type(model_config).__name__}")
    found = list(model_config.traverse(Attention.Config))
    if not found:
        raise ValueError(f"model_config: no DeepSeek-V3 Attention.Config in {type(model_config).__qualname__}")
    root = model_config
    for fqn, cfg, parent, attr in found:
        new = _derive(cfg, path, backend, quantize_grad, fqn)
        if parent is None:
            root = new
        elif isinstance(attr, int):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    return root


def _derive(cfg, path: str, backend: Optional[str], quantize_grad: bool, fqn: str = ""):
    try:
        _check_config(cfg, path)
    except (ValueError, TypeError) as error:
        raise type(error)(f"{fqn + ': ' if fqn else ''}{error}") from None
    return derive(cfg, MXMLAAttention.Config, path=path, backend=backend, quantize_grad=bool(quantize_grad))


class MXMLAConverter(ModelConfigConverter):
    """The converter a TorchTitan config names: `model_registry(flavor, converters=[MXMLAConverter.Config(
    path="mxfp8")])` applies `convert_deepseek_v3` to the flavor's model config."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        path: str = "mxfp8"
        backend: Optional[str] = None
        quantize_grad: bool = True

    def __init__(self, config: Config):
        if config.path not in PATHS:
            raise ValueError(f"MXMLAConverter.Config.path: expected one of {PATHS}, got {config.path!r}")
        if config.backend is not None:
            parse_backend_list(config.backend, "MXMLAConverter.Config.backend")
        require_bool("MXMLAConverter.Config.quantize_grad", config.quantize_grad)
        self.config = config

    def convert(self, model_config):
        c = self.config
        return convert_deepseek_v3(model_config, c.path, c.backend, quantize_grad=c.quantize_grad)


@override(target=Attention.Config, description="DeepSeek-V3 MLA through mxmla (MXFP8 query path and attention).")
def mxmla_attention(cfg, path: str = "mxfp8", backend: Optional[str] = None, quantize_grad: bool = True):
    """`--override.imports dispatch.integrations.torchtitan.mxmla_attention` (kwargs as JSON)."""
    require_bool("quantize_grad", quantize_grad)
    return _derive(cfg, path, backend, quantize_grad)


# --------------------------------------------------------------------------------------------------
# Selective activation checkpointing
# --------------------------------------------------------------------------------------------------

def mxmla_save_ops() -> set:
    """mxmla's ops whose outputs selective activation checkpointing saves rather than recomputes: the
    attention (o, lse) and the fused query up-projection (q's codes and scales), the two GEMM-sized ops
    of the path (the quantizes, RMSNorm and RoPE are recomputed)."""
    ops = torch.ops.mxmla
    return {ops.mla_attention.default, ops.mla_q_uproj_rope_quant.default}


class MXMLASelectiveAC(SelectiveAC):
    """TorchTitan's per-op selective activation checkpointing with mxmla's ops in the save list
    (`mxmla_save_ops`): `Trainer.Config(activation_checkpoint=MXMLASelectiveAC.Config())`."""

    @dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def get_save_ops(self) -> set:
        return super().get_save_ops() | mxmla_save_ops()
