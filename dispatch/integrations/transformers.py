"""HF transformers' DeepSeek-V3 on the mxmla path: `patch_deepseek_v3(model, path="mxfp8" | "bf16")`.

    from dispatch.integrations.transformers import patch_deepseek_v3, unpatch_deepseek_v3
    model = patch_deepseek_v3(DeepseekV3ForCausalLM(config), path="mxfp8")   # every DeepseekV3Attention
    loss = model(input_ids, labels=labels).loss; loss.backward()             # training and eval alike
    unpatch_deepseek_v3(model)                                               # the original forwards back

Each `DeepseekV3Attention` instance of the model gets a forward (an instance attribute; the class and
other models are untouched) that computes what HF's forward computes, through `dispatch.autograd`:

    c_q = q_a_proj(h)                                  HF module (q_lora_rank None: the input is h)
    q   = mla_q_projection(c_q, q_b_proj.weight, cos, sin, norm_weight=q_a_layernorm.weight, ...)
          mxfp8: rmsnorm_mxfp8 -> fused up-projection + RoPE + MXFP8 quantize, reading the weight's
                 persistent MXFP8 copies (below; one autograd node in eager mode, one custom op under
                 torch.compile); q_lora_rank None: mxfp8_quantize(h) -> the fused op on q_proj
          bf16:  RMSNorm -> bf16 GEMM -> rope
    kv_nope, k_pe = split(kv_a_proj_with_mqa(h)); kv_nope = kv_a_layernorm(kv_nope)    HF modules
    [k_nope | v] = kv_b_proj(kv_nope)                                                  HF module
    k = [k_nope | rope(k_pe)]
    o = mla_attention(q, k, v, causal, softmax_scale=attn.scaling)
          mxfp8: k MXFP8 along D, v along S, quantized from the model's dtype by one mla_kv_mxfp8 op
                 (k joined from codes with the shared k_pe broadcast over heads); with the mla RoPE
                 style, no cache and cos / sin shared by the batch (HF's default [1, S, 64]) k_pe's RoPE
                 runs inside that op too, else a rope op first; bf16: rope, k and v in bf16
    out = o_proj(o)                                    HF module, o cast to the model's dtype

Weight copies (mxfp8 path): each patched attention module gets a submodule `mxmla_q_weight_copies`
(`dispatch.weights.WeightCopies`: non-persistent uint8 buffers, not in the state dict) holding the
MXFP8 copies of q_b_proj's weight (q_proj's when q_lora_rank is None), made at patch time and
refreshed in place: after `.to()` and `load_state_dict` (of any module holding the layer), after
every step of an optimizer registered with `patch_state(model).refresh_after(optimizer)` (or
`patch_deepseek_v3(..., optimizer=optimizer)`), once per step however many forwards it has, and, in
eager mode, before any forward that finds the weight changed since (dispatch.weights' staleness rules:
version counter, storage, any torch.optim step, ...). A compiled graph reads the buffers as inputs and
never quantizes the weight -- while an optimizer is registered. Without one a compiled forward could
not see a weight update (no Python check runs inside the graph), so it quantizes the weight in the
graph instead, every forward (correct, slower), and says so once in the log
(`patch_state(model).quantized_in_graph` counts those traces); registering an optimizer later
recompiles once. Likewise while the last refresh could not read the weight (a DTensor, e.g. FSDP2's
sharded parameter at the optimizer step, or a weight on the meta device): the graph quantizes the
gathered weight itself until a refresh succeeds. After any other write to a query weight under
compile (an edit outside the optimizer, `.data` assignments, a Parameter replaced by a loader that
does not go through `load_state_dict`) call `patch_state(model).refresh_weight_copies()`. A weight that is a DTensor inside the forward (tensor
parallelism) is quantized per call as before, the copies unused.

Mapping of HF's conventions:
- RoPE: HF's cos / sin (`position_embeddings`, per token, from position_ids, offsets and the rope type's
  attention factor included) are used as given, widened to float32 (exact). `config.rope_interleave=True` (DeepSeek's checkpoints;
  `apply_rotary_pos_emb_interleave`) is mxmla's "mla" style: interleaved pairs in, halves out, with
  HF's cat([freqs, freqs]) tables. `rope_interleave=False` (`apply_rotary_pos_emb`, rotate_half) is
  "neox". Both equal HF's formulas in exact arithmetic (tests/test_integration_transformers.py checks
  them numerically); mxmla rotates in fp32 and rounds once, HF rounds each product in the model dtype.
- Softmax scale: `attn.scaling`, i.e. 1/sqrt(192) times mscale^2 when rope_parameters has yarn's
  mscale_all_dim (HF's `yarn_apply_mscale`).
- RMSNorm eps: the modules' own `variance_epsilon` (HF builds q_a_layernorm with its default 1e-6).
- Weights in fp32 or bf16: the mxfp8 path quantizes q_b_proj's weight from its bf16 cast (its gradient
  arrives in the weight's dtype); HF's modules run in the model's dtype; attention in bf16 or MXFP8.

What the path serves, per call, and what falls back to HF's own forward (reason logged once per reason
to logging.getLogger("mxmla.integrations"), every eager occurrence counted in
`patch_state(model).fallbacks`):
- attention_mask: None (sdpa / flash: causal, as HF's `is_causal`; eager: no mask); the mask HF builds
  when the model is called without attention_mask, position_ids and cache (then it is the plain causal
  mask by construction: a forward pre-hook on each DeepseekV3Model passes that fact to the layers as a
  keyword, and the tensor is never read); otherwise, in eager mode, a 4-D mask that is exactly the
  plain causal mask (bool: the lower triangle; float: 0 there and <= the dtype's min elsewhere), or a
  2-D all-ones padding mask. Anything else (padding, packed-sequence block masks, flex BlockMasks)
  falls back. Checking a mask tensor reads it (one device sync per new mask; the verdict is remembered
  for the layers that share it); under torch.compile a mask tensor not marked plain causal is not
  read and falls back.
- cache: None, or an empty DynamicCache layer (a plain forward with use_cache=True, the prefill of
  generate): served, and the layer's compressed latents (kv_a_layernorm(kv_nope), roped k_rot) are
  written to it as HF does. A cache already holding tokens (decoding) or another cache type falls back.
- mxfp8 path: a sequence length that is not a multiple of 32 falls back (MXFP8 blocks run along S for
  v and along the tokens for the fused op's backward).
- attention dropout > 0 in training, `output_attentions`, packed-sequence kwargs (cu_seq_lens_q / _k)
  fall back.
Raised at patch time, naming the config field: head dims other than qk_nope 128 + qk_rope 64 / v 128,
a q_lora_rank (or hidden_size when q_lora_rank is None) that is not a multiple of 32 on the mxfp8
path, a q_b_proj with bias, a model without DeepseekV3Attention, a model already patched.

torch.compile: a patched model compiles with fullgraph=True, per decoder layer (as TorchTitan applies
it) and as a whole model, on both paths, and does not recompile from one training step to the next.
Every check above reads only shapes, module attributes and the arguments' Python values, which dynamo
turns into guards that hold from step to step; no Python state is updated in the compiled graph
(eager calls update `served` / `fallbacks`; under compile the choice is made once per trace and
counted in `patch_state(model).traced`, by a function dynamo runs while tracing); the softmax scale
reaches the attention core as an argument. A fallback under compile is HF's own forward, compiled
into the same graph. Under dynamo HF hands every layer a 4-D bool mask even for a plain call (its
packed-sequence check would read position_ids, so it builds the mask instead of passing None): the
pre-hook's keyword is what lets the layers serve it without a host read.
tests/test_compile_transformers.py checks all this with aot_eager and inductor.

Tested with transformers 5.24 (the forward signature with `cache`, formerly `past_key_values`; both
names are accepted).
"""
from __future__ import annotations

import logging
import types
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakTensorKeyDictionary

import dispatch.autograd as mxag
from dispatch.nn import PATHS, MLAAttention, mla_q_projection, neox_rows
from dispatch.policy import parse_backend_list
from dispatch.weights import WeightCopies
from spec.checks import require_bool

try:  # the optional extra `.[hf]`
    from transformers import cache_utils as _hf_cache
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as _hf_deepseek
except ImportError as _error:  # pragma: no cover - exercised only without transformers
    _hf_cache = None
    _hf_deepseek = None
    _IMPORT_ERROR: Optional[ImportError] = _error
else:
    _IMPORT_ERROR = None

__all__ = ["patch_deepseek_v3", "unpatch_deepseek_v3", "patch_state", "PatchState", "RefreshHandle"]

log = logging.getLogger("mxmla.integrations")

NOPE_DIM, ROPE_DIM, V_DIM = 128, 64, 128
_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens_q", "cu_seqlens_k")


@dataclass
class PatchState:
    """What `patch_deepseek_v3` did to a model: the options, the patched modules, and what served the
    calls. Eager calls: per-reason counts of calls served by HF's own forward (`fallbacks`) against
    calls served by mxmla (`served`). Under torch.compile the choice is made when the forward is traced
    and nothing is counted per call: `traced` counts traces per outcome ("served" or the reason)."""

    path: str
    backend: Optional[str]
    quantize_grad: bool
    modules: List[nn.Module] = field(default_factory=list)
    fallbacks: Counter = field(default_factory=Counter)
    served: int = 0
    traced: Counter = field(default_factory=Counter)
    hooks: List[Any] = field(default_factory=list)  # handles of the DeepseekV3Model pre-hooks
    optimizer_hooks: int = 0  # live `refresh_after` registrations (the copies are then fresh under compile)
    quantized_in_graph: int = 0  # traces that quantize the query weight in the graph (no refresh_after)
    _logged: set = field(default_factory=set)
    _trace_marker: Any = field(init=False, repr=False, compare=False)
    _copies_marker: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # called with constants only, so that any torch version's dynamo can run it while tracing
        @torch._dynamo.assume_constant_result
        def note_trace(layer_idx: Optional[int], reason: Optional[str]) -> bool:
            self.note_trace(layer_idx, reason)
            return True

        @torch._dynamo.assume_constant_result
        def note_unhooked(layer_idx: Optional[int], why: str) -> bool:
            self.note_unhooked(layer_idx, why)
            return True

        self._trace_marker, self._copies_marker = note_trace, note_unhooked

    def __getstate__(self) -> dict:  # a copy (deepcopy of a patched model) gets markers of its own
        return {k: v for k, v in self.__dict__.items() if k not in ("_trace_marker", "_copies_marker")}

    @property
    def weight_copies(self) -> List[WeightCopies]:
        """The persistent MXFP8 copies of each patched layer's query up-projection weight (mxfp8 path; in
        the order of `modules`; empty on the bf16 path)."""
        return [c for c in (getattr(m, _COPIES_ATTR, None) for m in self.modules) if c is not None]

    def refresh_after(self, optimizer: torch.optim.Optimizer) -> "RefreshHandle":
        """Refresh every layer's weight copies after each `optimizer.step()` (a step post-hook), so that
        a compiled forward reads the copies instead of quantizing the weight in its graph. Returns a
        handle; `remove()` undoes it. Pass the optimizer that updates the query weights."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        updated = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for attn in self.modules:
            copies = getattr(attn, _COPIES_ATTR, None)
            if copies is not None and id(copies.weight) not in updated:
                raise ValueError(f"optimizer: does not update the query weight of DeepseekV3Attention layer "
                                 f"{attn.layer_idx} (not among its parameters), so its steps cannot say when "
                                 "the copies go stale; pass the optimizer that updates it")
        handles = [copies.hook_after(optimizer) for copies in self.weight_copies]
        self.optimizer_hooks += 1
        return RefreshHandle(self, handles)

    def refresh_weight_copies(self) -> None:
        """Quantize every layer's query weight into its copies now (after a write to the weights outside
        an optimizer registered with `refresh_after`, `load_state_dict` and `.to()`)."""
        for copies in self.weight_copies:
            copies.refresh_now()

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    def record(self, module: nn.Module, reason: Optional[str]) -> None:
        """One eager call served (reason None) or fallen back. Under torch.compile dynamo folds
        `is_compiling()` and runs the marker while tracing (`assume_constant_result`): the trace is
        counted once, the compiled graph updates no Python state and guards on no counter."""
        if torch.compiler.is_compiling():
            self._trace_marker(getattr(module, "layer_idx", None), reason)
        elif reason is None:
            self.served += 1
        else:
            self.fall_back(module, reason)

    def note_trace(self, layer_idx: Optional[int], reason: Optional[str]) -> None:
        """One trace of a patched forward: dynamo runs this while tracing, the compiled graph does not
        contain it."""
        self.traced["served" if reason is None else reason] += 1
        if reason is not None:
            self._log(layer_idx, f"{reason} (under torch.compile, decided when traced)")

    def note_unhooked(self, layer_idx: Optional[int], why: str) -> None:
        """A trace of the mxfp8 path whose graph quantizes the query weight itself, since the copies may
        be stale (`why`; dynamo runs this while tracing)."""
        self.quantized_in_graph += 1
        message = f"the compiled graph quantizes q_b_proj's weight in every forward: {why}"
        if message not in self._logged:
            self._logged.add(message)
            log.warning("mxmla mxfp8 path, DeepseekV3Attention layer %s: %s (logged once)", layer_idx, message)

    def fall_back(self, module: nn.Module, reason: str) -> None:
        self.fallbacks[reason] += 1
        self._log(getattr(module, "layer_idx", "?"), reason)

    def _log(self, layer_idx, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("mxmla %s path: DeepseekV3Attention layer %s runs HF's forward: %s (logged once per reason)",
                        self.path, layer_idx, reason)
        else:
            log.debug("layer %s falls back: %s", layer_idx, reason)


class RefreshHandle:
    """What `PatchState.refresh_after` returns: `remove()` removes its step hooks."""

    def __init__(self, state: PatchState, handles: list):
        self._state, self._handles = state, handles

    def remove(self) -> None:
        if self._handles is None:
            return
        for handle in self._handles:
            handle.remove()
        self._handles = None
        self._state.optimizer_hooks -= 1


class _QueryWeightCopies(WeightCopies):
    """The persistent MXFP8 copies of a patched layer's query up-projection weight (q_b_proj's, or
    q_proj's when q_lora_rank is None), a submodule of the attention module: its buffers follow the
    module through `.to()`, and it refreshes them from the projection's current weight after `.to()`
    (registered after the projection, so the weight has moved by then) and after `load_state_dict` of
    any module holding it. Non-persistent buffers: the state dict is HF's."""

    def __init__(self, attn: nn.Module, backend: Optional[str]):
        proj = attn.q_b_proj if attn.q_lora_rank is not None else attn.q_proj
        super().__init__(proj.weight.shape, backend=backend, device=proj.weight.device)
        object.__setattr__(self, "_proj", proj)  # read, not owned: no submodule, no second state-dict entry
        self.neox = not attn.config.rope_interleave
        # the last refresh from the weight could not run (the weight was a DTensor, on the meta device or
        # another device: e.g. FSDP2's sharded parameter at an optimizer step): the buffers may be stale,
        # so a compiled forward quantizes the weight in its graph until a refresh succeeds
        self.unrefreshed = False
        self.register_load_state_dict_post_hook(lambda module, _keys: module.refresh_now())
        self.refresh_now()

    @property
    def weight(self) -> Tensor:
        return self._proj.weight

    def rows(self) -> Optional[Tensor]:
        w = self.weight
        return neox_rows(w.shape[0] // (NOPE_DIM + ROPE_DIM), w.device) if self.neox else None

    def refresh(self, w: Tensor, rows: Optional[Tensor] = None) -> None:
        super().refresh(w, rows)
        self.unrefreshed = False

    def refresh_now(self) -> None:
        """Refresh from the projection's weight as it is now, or note that it could not be done."""
        if not self.refresh_if_ready(self.weight, self.rows()):
            self.unrefreshed = True

    def hook_after(self, optimizer: torch.optim.Optimizer):
        """A step post-hook on `optimizer` refreshing the copies from the projection's weight as it is
        then (a weight replaced since, e.g. by load_state_dict(assign=True), is the one read)."""
        ref = weakref.ref(self)

        def hook(_optimizer, _args, _kwargs):
            copies = ref()
            if copies is not None:
                copies.refresh_now()

        return optimizer.register_step_post_hook(hook)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.refresh_now()  # .to(dtype) may change the weight's bf16 values, .to(device) its device
        return out


@dataclass
class _ModuleState:
    patch: PatchState
    original: Any  # HF's forward bound to the module
    attention: nn.Module  # the attention core: MLAAttention, or dispatch.parallel's ContextParallelAttention


_STATE_ATTR = "_mxmla_state"
_PATCH_ATTR = "_mxmla_patch"
_COPIES_ATTR = "mxmla_q_weight_copies"  # the submodule holding the query weight's MXFP8 copies (mxfp8)


def _require_transformers() -> None:
    if _IMPORT_ERROR is not None:
        raise ImportError("dispatch.integrations.transformers needs HF transformers: pip install 'mxmla[hf]' "
                          f"(or pip install transformers); import failed with: {_IMPORT_ERROR}")


def _transformers_version() -> str:
    import transformers

    return getattr(transformers, "__version__", "?")


def _check_module(attn: nn.Module, path: str) -> None:
    config = attn.config
    for name, want in (("qk_nope_head_dim", NOPE_DIM), ("qk_rope_head_dim", ROPE_DIM), ("v_head_dim", V_DIM)):
        got = getattr(attn, name)
        if got != want:
            raise ValueError(f"config.{name}: mxmla serves DeepSeek-V3's head dims (qk_nope 128 + qk_rope 64, "
                             f"v 128), got {name}={got}")
    if attn.q_lora_rank is not None:
        if attn.q_b_proj.bias is not None:
            raise ValueError("q_b_proj: the fused Q path has no bias, got a q_b_proj with bias")
        if path == "mxfp8" and attn.q_lora_rank % 32:
            raise ValueError(f"config.q_lora_rank: the mxfp8 path needs a multiple of 32 (MXFP8 blocks), "
                             f"got {attn.q_lora_rank}")
    else:
        if attn.q_proj.bias is not None:
            raise ValueError("q_proj: the fused Q path has no bias, got a q_proj with bias")
        if path == "mxfp8" and config.hidden_size % 32:
            raise ValueError(f"config.hidden_size: with q_lora_rank None the mxfp8 path quantizes the hidden "
                             f"states, which needs a multiple of 32, got {config.hidden_size}")


def patch_deepseek_v3(model: nn.Module, path: str = "mxfp8", backend: Optional[str] = None, *,
                      quantize_grad: bool = True, optimizer: Optional[torch.optim.Optimizer] = None) -> nn.Module:
    """Route every DeepseekV3Attention of `model` through mxmla (module docstring) and return `model`.

    path: "mxfp8" | "bf16". backend: for every mxmla op (None: MXMLA_BACKEND or the automatic choice).
    quantize_grad: the fused Q op's MXFP8 backward (mxfp8 path). optimizer: the optimizer that updates
    the model's weights, for the mxfp8 path's query weight copies (the same as calling
    `patch_state(model).refresh_after(optimizer)` later; see "Weight copies" in the module docstring).
    Undo with `unpatch_deepseek_v3`."""
    _require_transformers()
    if path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
    if backend is not None:
        parse_backend_list(backend, "backend")  # a bad name raises here, not at the first forward
    require_bool("quantize_grad", quantize_grad)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, _PATCH_ATTR, None) is not None:
        raise ValueError(f"model: already patched by mxmla (path={getattr(model, _PATCH_ATTR).path!r}); "
                         "call unpatch_deepseek_v3(model) first")
    if not hasattr(_hf_deepseek.DeepseekV3Attention, "expand_kv"):
        raise ImportError(f"transformers {_transformers_version()}: its DeepseekV3Attention does not cache the "
                          "compressed latents (no expand_kv); patch_deepseek_v3 needs transformers >= 5.24")
    modules = [m for m in model.modules() if isinstance(m, _hf_deepseek.DeepseekV3Attention)]
    if not modules:
        raise ValueError(f"model: no transformers DeepseekV3Attention module in {type(model).__name__}")
    for attn in modules:
        if getattr(attn, _STATE_ATTR, None) is not None:
            raise ValueError(f"model: DeepseekV3Attention layer {attn.layer_idx} is already patched by mxmla "
                             "(through another model object)")
        _check_module(attn, path)
    state = PatchState(path, backend, bool(quantize_grad), modules)
    for attn in modules:
        original = type(attn).forward.__get__(attn)
        attention = MLAAttention(causal=True, softmax_scale=attn.scaling, layout="bshd", path=path, backend=backend)
        setattr(attn, _STATE_ATTR, _ModuleState(state, original, attention))
        if path == "mxfp8":
            setattr(attn, _COPIES_ATTR, _QueryWeightCopies(attn, backend))
        attn.forward = types.MethodType(_patched_forward, attn)
    state.hooks = [m.register_forward_pre_hook(_mark_plain_causal, with_kwargs=True)
                   for m in model.modules() if isinstance(m, _hf_deepseek.DeepseekV3Model)]
    setattr(model, _PATCH_ATTR, state)
    if optimizer is not None and path == "mxfp8":
        state.refresh_after(optimizer)
    return model


def unpatch_deepseek_v3(model: nn.Module) -> nn.Module:
    """Give every patched DeepseekV3Attention of `model` its class's forward back; returns `model`."""
    state = getattr(model, _PATCH_ATTR, None)
    if state is None:
        raise ValueError("model: not patched by mxmla (patch_deepseek_v3 was not called on it)")
    for attn in state.modules:
        attn.__dict__.pop("forward", None)
        attn.__dict__.pop(_STATE_ATTR, None)
        attn._modules.pop(_COPIES_ATTR, None)
    for hook in state.hooks:
        hook.remove()
    delattr(model, _PATCH_ATTR)
    return model


def patch_state(model: nn.Module) -> Optional[PatchState]:
    """The PatchState of a patched model (None when it is not patched)."""
    return getattr(model, _PATCH_ATTR, None)


# --------------------------------------------------------------------------------------------------
# What the path can serve
# --------------------------------------------------------------------------------------------------

_mask_verdicts: "WeakTensorKeyDictionary" = WeakTensorKeyDictionary()


def _mask_is_plain_causal(mask: Tensor, batch: int, seq: int) -> Optional[str]:
    """None when `mask` is the plain causal mask (or an all-ones 2-D padding mask) for [batch, seq]
    queries and keys, else why not. Reads the mask once per tensor version."""
    key = (mask._version, mask.data_ptr(), tuple(mask.shape), batch, seq)
    cached = _mask_verdicts.get(mask)
    if cached is not None and cached[0] == key:
        return cached[1]
    verdict = _judge_mask(mask, batch, seq)
    _mask_verdicts[mask] = (key, verdict)
    return verdict


def _judge_mask(mask: Tensor, batch: int, seq: int) -> Optional[str]:
    if mask.dim() == 2:
        if tuple(mask.shape) != (batch, seq):
            return f"attention_mask: a 2-D mask of shape {tuple(mask.shape)}, expected ({batch}, {seq})"
        return None if bool((mask != 0).all()) else "attention_mask: padding (a 2-D mask with zeros)"
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or tuple(mask.shape[-2:]) != (seq, seq):
        return f"attention_mask: shape {tuple(mask.shape)} is not [B, 1|H, {seq}, {seq}] of a plain causal mask"
    causal = torch.ones(seq, seq, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        plain = torch.equal(mask, causal.expand(mask.shape))
    elif mask.is_floating_point():
        plain = bool(torch.where(causal, mask == 0, mask <= torch.finfo(mask.dtype).min).all())
    else:
        return f"attention_mask: dtype {mask.dtype} (expected bool or floating)"
    return None if plain else "attention_mask: not the plain causal mask (padding or packed sequences)"


# The model-level marker: DeepseekV3Model builds the mask its layers get from its own inputs. Called
# without attention_mask, position_ids (it then uses arange from 0) and cache (use_cache=True makes an
# empty one), with no packed-sequence kwargs, it builds the plain causal mask: `create_causal_mask`
# then has no padding, no packed sequences and no offset. HF cannot know that statically under
# torch.compile (its packed-sequence check reads position_ids), so it hands a 4-D bool mask to every
# layer; this pre-hook passes the layers that knowledge as a keyword instead, so the patched forward
# serves the mask without reading it, eager and compiled alike.
_PLAIN_CAUSAL_KWARG = "mxmla_plain_causal"
_MASK_SHAPING_INPUTS = ("attention_mask", "position_ids", "cache", "past_key_values") + _PACKED_KWARGS


def _mark_plain_causal(module: nn.Module, args, kwargs):
    if len(args) > 1 or any(kwargs.get(name) is not None for name in _MASK_SHAPING_INPUTS):
        return None  # a positional mask or any input that shapes the mask: the layers judge it themselves
    return args, {**kwargs, _PLAIN_CAUSAL_KWARG: True}


def _dynamic_layer_type():
    return getattr(_hf_cache, "DynamicLayer", None)


def _unservable(attn, st: _ModuleState, hidden_states, position_embeddings, attention_mask, cache, plain_causal,
                kwargs):
    """(reason or None, causal) for this call, from shapes, attributes and static arguments; a mask
    tensor's values are read only in eager mode, and only when the model did not mark it plain causal."""
    if hidden_states.dim() != 3:
        return f"hidden_states: expected [B, S, hidden], got {tuple(hidden_states.shape)}", True
    batch, seq = hidden_states.shape[:2]
    if position_embeddings is None:
        return "position_embeddings: None (HF passes cos / sin from the model's rotary embedding)", True
    if st.patch.path == "mxfp8" and seq % 32:
        return f"sequence length {seq} is not a multiple of 32 (the mxfp8 path blocks v along S)", True
    if attn.training and attn.attention_dropout:
        return f"attention_dropout={attn.attention_dropout} in training (mla_attention has no dropout)", True
    if kwargs.get("output_attentions"):
        return "output_attentions=True (mla_attention returns no attention weights)", True
    for name in _PACKED_KWARGS:
        if kwargs.get(name) is not None:
            return f"{name}: packed sequences are not served (HF's forward handles them)", True
    if cache is not None:
        past = cache.get_seq_length(attn.layer_idx)
        if past:
            return f"cache: layer {attn.layer_idx} already holds {past} tokens (decoding with a KV cache)", True
        layers = getattr(cache, "layers", None)
        layer = layers[attn.layer_idx] if layers is not None and attn.layer_idx < len(layers) else None
        dynamic = _dynamic_layer_type()
        if layers is None or (layer is not None and type(layer) is not dynamic) or (
                layer is None and getattr(cache, "layer_class_to_replicate", None) is not dynamic):
            return f"cache: {type(cache).__name__} (only an empty DynamicCache layer is served)", True
    is_causal = bool(kwargs.get("is_causal", getattr(attn, "is_causal", True)))
    if attention_mask is None:
        eager = attn.config._attn_implementation in (None, "eager")
        return None, is_causal and not eager
    if not isinstance(attention_mask, Tensor):
        return f"attention_mask: a {type(attention_mask).__name__} (only None or a plain causal tensor)", True
    if plain_causal:
        return None, True
    if torch.compiler.is_compiling():
        return ("attention_mask: a mask tensor under torch.compile, not built from the model's own inputs "
                "(its values would need a host read; HF's forward applies it)"), True
    reason = _mask_is_plain_causal(attention_mask, batch, seq)
    return reason, attention_mask.dim() == 4 or is_causal


# --------------------------------------------------------------------------------------------------
# The patched forward
# --------------------------------------------------------------------------------------------------

def _patched_forward(self, hidden_states: Tensor, position_embeddings=None, attention_mask: Optional[Tensor] = None,
                     cache=None, **kwargs):
    st: _ModuleState = getattr(self, _STATE_ATTR)
    if cache is None and "past_key_values" in kwargs:
        cache = kwargs.pop("past_key_values")
    plain_causal = bool(kwargs.pop(_PLAIN_CAUSAL_KWARG, False))
    reason, causal = _unservable(self, st, hidden_states, position_embeddings, attention_mask, cache, plain_causal,
                                 kwargs)
    patch = st.patch
    patch.record(self, reason)
    if reason is not None:
        return st.original(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask,
                           cache=cache, **kwargs)
    batch, seq = hidden_states.shape[:2]
    tokens = batch * seq
    style = "mla" if self.config.rope_interleave else "neox"
    # float32 tables, as the example block's: the same values (a bf16 / fp16 table widens exactly, and
    # mxmla rotates in fp32 either way), and the same kernel specializations as the block's, so that
    # the kernels compiled (or compiled ahead, backends/triton/compile_ahead.py) for one serve the other
    cos, sin = position_embeddings[0].float(), position_embeddings[1].float()

    if self.q_lora_rank is None:
        x, weight, norm_weight, eps = hidden_states, self.q_proj.weight, None, 0.0
    else:
        x, weight = self.q_a_proj(hidden_states), self.q_b_proj.weight
        norm_weight, eps = self.q_a_layernorm.weight, self.q_a_layernorm.variance_epsilon
    q = mla_q_projection(x, weight, cos, sin, norm_weight=norm_weight, eps=eps, path=patch.path, rope_style=style,
                         quantize_grad=patch.quantize_grad, backend=patch.backend,
                         weight_copies=_weight_copies(self, patch))                            # [B, S, H, 192]

    compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
    kv_nope, k_pe = torch.split(compressed_kv, [self.kv_lora_rank, ROPE_DIM], dim=-1)
    kv_nope = self.kv_a_layernorm(kv_nope)                                                    # [B, S, kv_lora]
    # heads from the tensors, as HF's views do (-1): a tensor-parallel shard holds fewer than num_heads
    kv = self.kv_b_proj(kv_nope).view(batch, seq, -1, NOPE_DIM + V_DIM)
    heads = kv.shape[2]
    k_nope, v = kv[..., :NOPE_DIM], kv[..., NOPE_DIM:]
    k_pe = k_pe.view(batch, seq, 1, ROPE_DIM)
    mx_kv = patch.path == "mxfp8" and k_pe.dtype == k_nope.dtype
    tables = _shared_tables(cos, sin, batch, seq) if mx_kv and style == "mla" and cache is None else None
    if tables is not None:
        # k = [k_nope | rope(k_pe)] along D and v along S in one op, k_pe rotated inside it (as the block
        # does): the bytes and gradients of rope followed by the op, without the rope launch
        k, v = mxag.mla_kv_mxfp8(k_nope, k_pe, v, layout="bshd", cos=tables[0], sin=tables[1], backend=patch.backend)
    else:
        cos_t = cos.expand(batch, seq, ROPE_DIM).reshape(tokens, ROPE_DIM)
        sin_t = sin.expand(batch, seq, ROPE_DIM).reshape(tokens, ROPE_DIM)
        k_rot = mxag.rope(k_pe.reshape(tokens, 1, ROPE_DIM), cos_t, sin_t, style=style, layout="thd",
                          backend=patch.backend).view(batch, seq, 1, ROPE_DIM)
        if cache is not None:  # an empty DynamicCache layer (checked): store the latents as HF does
            cache.update(kv_nope.view(batch, 1, seq, self.kv_lora_rank), k_rot.view(batch, 1, seq, ROPE_DIM),
                         self.layer_idx)
        if mx_kv:
            # k along D, v along S, from the slices and the shared k_rot: the bytes of quantizing the concatenation
            k, v = mxag.mla_kv_mxfp8(k_nope, k_rot, v, layout="bshd", backend=patch.backend)
        else:
            k = torch.cat([k_nope, k_rot.expand(batch, seq, heads, ROPE_DIM)], dim=-1)        # [B, S, H, 192]
    # attn.scaling read per call, as HF's forward does (a float: a constant of a compiled graph)
    o, _ = st.attention(q, k, v, causal=causal, softmax_scale=float(self.scaling))            # [B, S, H, 128]
    out = self.o_proj(o.reshape(batch, seq, heads * V_DIM).to(hidden_states.dtype))
    return out, None


def _weight_copies(attn, patch: PatchState) -> Optional[WeightCopies]:
    """The query weight's persistent copies for this call (mxfp8 path), or None: the weight is then
    quantized per call (eager: through dispatch.weights' cache; compiled: in the graph). Eager calls use
    them whenever they exist (refreshed first when the weight changed); a compiled graph reads them as
    they are, so it uses them only while an optimizer refreshes them after its steps."""
    copies = getattr(attn, _COPIES_ATTR, None)
    if copies is None or not torch.compiler.is_compiling():
        return copies
    if not patch.optimizer_hooks:
        patch._copies_marker(getattr(attn, "layer_idx", None), _NO_OPTIMIZER)
    elif copies.unrefreshed:
        patch._copies_marker(getattr(attn, "layer_idx", None), _NOT_REFRESHED)
    else:
        return copies
    return None


_NO_OPTIMIZER = ("no optimizer registered for its persistent MXFP8 copies (patch_state(model).refresh_after("
                 "optimizer), or patch_deepseek_v3(..., optimizer=optimizer))")
_NOT_REFRESHED = ("its persistent MXFP8 copies could not be refreshed from the weight (a DTensor, e.g. FSDP2's "
                  "sharded parameter at the optimizer step, or a weight on another device)")


def _shared_tables(cos: Tensor, sin: Tensor, batch: int, seq: int):
    """HF's per-token cos / sin [1 | B, S, 64] as [S, 64] tables indexed by sequence position, which
    the kv op takes, when every sequence of the batch has the same rows ([1, S, 64]: position ids
    shared by the batch, HF's default; or a batch of one); else None."""
    if cos.dim() != 3 or tuple(cos.shape[1:]) != (seq, ROPE_DIM) or cos.shape != sin.shape:
        return None
    if cos.shape[0] != 1 and batch != 1:
        return None
    return cos[0], sin[0]
