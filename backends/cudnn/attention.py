"""MLA attention through cuDNN's graph SDPA (nvidia-cudnn-frontend `cudnn.pygraph`).

What runs where (the three routes are registry variants, ATTENTION_VARIANTS: bf16, dequantized,
native; MXMLA_BACKEND `mla_attention=cudnn:dequantized` or `variant=` names one)
- bf16 q, k, v (d_qk 192, d_v 128): `pygraph.sdpa` / `pygraph.sdpa_backward`, compute capability >= 9.0
  (H200 is the target; validated there by the lead's GPU run). bshd and sbhd go in as strided
  [B, H, S, D] descriptors (no copies); thd goes in through ragged offsets (element offsets
  cu_seqlens * H * D, int32, so T * H * 192 must stay below 2^31) with a padding mask
  (seq_len_q / seq_len_kv). thd needs the sequence lengths on the host: one device->host copy of
  cu_seqlens per call.
- MXFP8 q, k, v on sm90 (and wherever the native graph below cannot serve): each dequantized exactly to
  bf16 by one flat pass (spec's MXFP8 attention inputs), then the bf16 graph; the backward dequantizes
  again (no bf16 copies kept between forward and backward) and returns bf16 gradients (mx_route).
- MXFP8 q, k, v (e4m3; q, k blocked along D, v along S): `pygraph.sdpa_mxfp8` /
  `pygraph.sdpa_mxfp8_backward`, compute capability 10.x, cuDNN >= 9.21 except 9.23.0 / 9.23.1, bshd
  and sbhd only. Written against the frontend 1.32 documentation and sources; NOT run by this
  project (no sm100 machine). Scale tensors are E8M0 with F8_128x4 reordering, per (batch, head),
  byte-identical to spec.swizzle.pack_attention_scales (backends/cudnn/_scales.py) -- except the
  backward's S-blocked q_T / k_T (D = 192 > 128), which follow the frontend's documented D-plane-major
  order instead (see backends/cudnn/_scales.py: spec and frontend disagree there).

Choices, where SEMANTICS.md 8 leaves room
- Causal masking is bottom-right aligned (SEMANTICS 8). When S_q == S_kv both alignments coincide and
  the graph says TOP_LEFT (cuDNN's best-trodden causal path); otherwise BOTTOM_RIGHT. The bf16 graphs
  use the frontend's preferred spelling (diagonal_alignment + diagonal_band_right_bound=0); the MXFP8
  graphs use use_causal_mask / use_causal_mask_bottom_right, the only spelling the four SDPA bindings
  all document (the MXFP8 backward names its band bounds left_bound / right_bound).
- cuDNN refuses a bottom-right causal mask with S_q > S_kv (without padding). Query rows
  i < S_q - S_kv see no key at all, so they are fully masked: this backend runs cuDNN on the last
  S_kv query rows and writes o = 0, lse = -inf (forward) and dq = 0 (backward) for the others itself.
  thd sequences go through the padding mask, where cuDNN takes per-sequence lengths; rows that are
  fully masked there (a sequence with no keys, or S_q > S_kv under causal) are likewise set to
  o = 0, lse = -inf / dq = 0 after the call, and the backward receives lse = +1e30 for them (so that
  exp(S - lse) is 0 instead of exp(-inf + inf) = NaN inside the kernel).
- lse is cuDNN's Stats output: fp32 max + ln(sum exp), natural log (the frontend documents natural
  log as cuDNN's default; `stats_use_log2` is left unset), [B, H, S_q, 1] -> [B, H, S_q]; thd:
  Stats stays a padded [B, H, S_max, 1] tensor (non-ragged) and is gathered into [H, T].
- o and the gradients are bf16, written in q's (k's, v's) layout as fresh contiguous tensors.
- MXFP8 backward: cuDNN needs each operand quantized along the axis its GEMM contracts: q_T, k_T
  (q, k along S), v along D, dO along D and along S. This backend derives them by quantizing
  (e4m3, rceil, SEMANTICS 1) the exactly dequantized q, k, v and the bf16 do with the torch backend's
  quantizer, so S_q must be a multiple of 32. The second quantization of q, k, v adds error the spec
  does not have; the MXFP8 bound of SEMANTICS 8 (5e-2) is meant to absorb it (unverified on hardware).
  P and dS are quantized inside cuDNN (fixed-scale e4m3 P; SEMANTICS 8).

Graph cache: one built graph per (kind, layout, shapes, strides, dtypes, mask, scale, device[, thd
geometry]), keyed by a tuple of torch.Size / stride tuples (cheap to build and hash). A hit costs the
key, output allocation, the handle/stream bind and `graph.execute`; the workspace comes from torch's
caching allocator on the current stream, and the handle runs on torch's current stream.
"""
from __future__ import annotations

import threading
from typing import Dict, List, Optional, Tuple

import torch

from spec.attention import DEFAULT_SOFTMAX_SCALE
from spec.constants import MLA_QK_HEAD_DIM, MLA_V_HEAD_DIM
from spec.mxtensor import MXTensor

from ..registry import register, register_variant
from . import _common, plan_cache
from ._scales import compact_scales, pack_attention_scales, pack_columnwise, v_role_strides, v_role_view

D_QK, D_V = MLA_QK_HEAD_DIM, MLA_V_HEAD_DIM
MIN_CUDNN_BF16 = _common.version_int(9, 10, 2)
MIN_CUDNN_MXFP8 = _common.version_int(9, 21, 0)
EXCLUDED_CUDNN_MXFP8 = (_common.version_int(9, 23, 0), _common.version_int(9, 23, 1))
MASKED_ROW_LSE = 1e30  # lse handed to the backward for fully masked rows: exp(S - 1e30) = 0

# How operands are handed to graph.execute: "view" = torch tensors (dense ones as they are, strided
# ones as views matching the [B, H, S, D] declarations; every engine reads the right geometry),
# "ptr" = bare device addresses (the frontend borrows the declared geometry).
# benchmarks/bench_attention_cudnn.py times both.
BIND = "view"

# tensor uids (fixed, so the execute dict needs no lookups)
Q, K, V, O, STATS, DO, DQ, DK, DV = 1, 2, 3, 4, 5, 6, 7, 8, 9
SEQ_Q, SEQ_KV, RAG_QK, RAG_KK, RAG_V, RAG_O, RAG_DQ, RAG_DK, RAG_DV = 10, 11, 12, 13, 14, 15, 16, 17, 18
SF_Q, SF_K, SF_V, AMAX_O = 20, 21, 22, 23
Q_T, K_T, DO_F8, DO_T, SF_Q_T, SF_K_T, SF_DO, SF_DO_T, AMAX_DQ, AMAX_DK, AMAX_DV = range(24, 35)

_PERM = {"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3)}
_SEQ_AXIS = {"bshd": 1, "sbhd": 0, "thd": 0}


# --------------------------------------------------------------------------------------------------
# Capability checks
# --------------------------------------------------------------------------------------------------

def _seq_lengths(t, layout: str) -> Tuple[int, int]:
    """(batch, sequence length) of a 4-D bshd / sbhd tensor or MXTensor."""
    shape = t.shape
    return (shape[0], shape[1]) if layout == "bshd" else (shape[1], shape[0])


def _stride_reasons(name: str, t: torch.Tensor, layout: str, align_elems: int) -> List[str]:
    stride = t.stride()
    if t.dim() and stride[-1] != 1:
        return [f"{name}: the feature (last) axis must be contiguous for cuDNN, got strides {tuple(stride)}"]
    if layout == "thd" and not t.is_contiguous():
        return [f"{name}: thd tensors must be contiguous [T, H, D] (ragged offsets assume a token stride "
                f"of H*D), got strides {tuple(stride)}"]
    bad = [s for s, n in zip(stride[:-1], t.shape[:-1]) if n > 1 and s % align_elems]
    if bad:
        return [f"{name}: strides must be multiples of {align_elems} elements (16 bytes) for cuDNN, "
                f"got strides {tuple(stride)}"]
    return []


def _version_reasons(minimum: int, what: str, excluded=()) -> List[str]:
    v = _common.backend_version()
    if v is None:
        return [f"{what}: cannot read the cuDNN library version"]
    if v < minimum:
        return [f"{what} needs cuDNN >= {_common.version_text(minimum)}, found {_common.version_text(v)}"]
    if v in excluded:
        listed = " and ".join(_common.version_text(e) for e in excluded)
        return [f"{what}: cuDNN {_common.version_text(v)} is excluded ({listed} are known-bad for this path)"]
    return []


def _bf16_reasons(q, k, v, layout, extra) -> List[str]:
    reasons = []
    dev = _common.first_device((q, k, v))
    reasons += _common.capability_reasons(dev, "cudnn graph SDPA (bf16, d_qk 192 / d_v 128)", min_cc=(9, 0))
    reasons += _version_reasons(MIN_CUDNN_BF16, "cudnn bf16 SDPA with head dim 192 (the frontend refuses the "
                                "9.10.0/9.10.1 backward)")
    return reasons + _bf16_graph_reasons(q, k, v, layout, (("q", q), ("k", k), ("v", v)) + tuple(extra))


def _bf16_graph_reasons(q, k, v, layout, bf16_tensors) -> List[str]:
    """The bf16 graph's conditions past device and version: bf16_tensors ((name, tensor) pairs) bf16 with
    usable strides, the MLA head dims, thd's int32 ragged offsets, a nonempty batch and sequence."""
    reasons = []
    for name, t in bf16_tensors:
        if t.dtype != torch.bfloat16:
            reasons.append(f"{name}: the cudnn graph SDPA path takes bfloat16, got {t.dtype}")
        reasons += _stride_reasons(name, t, layout, 8)
    if q.shape[-1] != D_QK or k.shape[-1] != D_QK or v.shape[-1] != D_V:
        reasons.append(f"cudnn serves the MLA head dims d_qk {D_QK} / d_v {D_V} only, got "
                       f"{q.shape[-1]} / {v.shape[-1]}")
    if layout == "thd":
        heads = q.shape[1]
        for name, t, d in (("q", q, D_QK), ("k", k, D_QK)):
            if t.shape[0] * heads * d >= 2**31:
                reasons.append(f"{name}: T * H * {d} = {t.shape[0] * heads * d} does not fit the int32 ragged "
                               f"offsets this backend builds")
    elif 0 in (q.shape[0], q.shape[1], k.shape[0], k.shape[1]):
        reasons.append("empty batch or sequence: nothing for cuDNN to do (use the torch backend)")
    return reasons


def _mxfp8_reasons(q, k, v, causal, layout, backward: bool, extra=()) -> List[str]:
    reasons = []
    what = "cudnn MXFP8 SDPA" + (" backward" if backward else "")
    dev = _common.first_device((q, k, v))
    reasons += _common.capability_reasons(dev, what, major_only=10)
    reasons += _version_reasons(MIN_CUDNN_MXFP8, what, EXCLUDED_CUDNN_MXFP8)
    fe = _common.frontend()
    need = "sdpa_mxfp8_backward" if backward else "sdpa_mxfp8"
    if fe is not None and not hasattr(getattr(fe, "pygraph", None), need):
        reasons.append(f"nvidia-cudnn-frontend {getattr(fe, '__version__', '?')} has no pygraph.{need}")
    if layout == "thd":
        reasons.append("MXFP8 attention in thd layout: cuDNN's per-(batch, head) F8_128x4 scale tensors would "
                       "need per-sequence padding; use bshd or sbhd")
        return reasons
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.elem != "e4m3":
            reasons.append(f"{name}: cuDNN MXFP8 SDPA takes e4m3 codes, got {t.elem}")
        reasons += _stride_reasons(name, t.data, layout, 16)
    for name, t in extra:
        if t.dtype != torch.bfloat16:
            reasons.append(f"{name}: cuDNN MXFP8 SDPA backward takes a bfloat16 {name}, got {t.dtype}")
        reasons += _stride_reasons(name, t, layout, 8)
    _, s_q = _seq_lengths(q, layout)
    _, s_kv = _seq_lengths(k, layout)
    if 0 in (s_q, s_kv):
        reasons.append("empty sequence: nothing for cuDNN to do (use the torch backend)")
    if causal and s_q < s_kv and (s_q % 64 or s_kv % 64):
        reasons.append(f"{what}: a bottom-right causal mask (S_q {s_q} < S_kv {s_kv}) needs S_q and S_kv "
                       f"multiples of 64 in cuDNN's FP8 SDPA")
    if backward and s_q % 32:
        reasons.append(f"{what}: S_q ({s_q}) must be a multiple of 32 (q and do are quantized along S "
                       f"for dK = dS^T q and dV = P^T dO)")
    return reasons


def _dequantized_reasons(q, k, v, layout, extra) -> List[str]:
    """Why the dequantized MXFP8 route cannot serve: the bf16 graph's conditions on the bf16 tensors the
    flat dequantize produces (fresh and contiguous, so only device, version, head dims and sizes apply)."""
    reasons = []
    dev = _common.first_device((q, k, v))
    reasons += _common.capability_reasons(dev, "cudnn graph SDPA on dequantized MXFP8 (bf16 graph)", min_cc=(9, 0))
    reasons += _version_reasons(MIN_CUDNN_BF16, "cudnn bf16 SDPA with head dim 192")
    return reasons + _bf16_graph_reasons(q, k, v, layout, tuple(extra))


def mx_route(q, k, v, causal, layout, backward: bool, extra=()) -> Tuple[Optional[str], List[str]]:
    """("native" | "dequantized" | None, reasons) for MXFP8 q, k, v. native: cuDNN's MXFP8 SDPA (sm100,
    unrun here). dequantized (sm90+, where native cannot serve): q, k, v dequantized exactly to bf16 by
    one flat pass each (RN_bf16(code * 2^(e-127)): spec's MXFP8 attention inputs), then the bf16 graph;
    the backward dequantizes again instead of keeping bf16 copies (the MXFP8 path's activation memory
    is the point of it) and returns bf16 gradients, as a bf16 backward of an MXFP8 forward does."""
    native = _mxfp8_reasons(q, k, v, causal, layout, backward, extra)
    if not native:
        return "native", []
    dequantized = _dequantized_reasons(q, k, v, layout, extra)
    if not dequantized:
        return "dequantized", []
    return None, native + [f"dequantized route: {r}" for r in dequantized]


def _native_mx(q, k, v, causal, layout, backward, extra=()) -> bool:
    """mx_route(...)[0] == "native", with the capability read first: off sm100 the answer is no without
    building every reason again (the op runs after dispatch checked; this is its per-call cost)."""
    dev = _common.first_device((q, k, v))
    if dev is None or _common.device_capability(dev)[0] != 10:
        return False
    return mx_route(q, k, v, causal, layout, backward, extra)[0] == "native"


def _dequantize_bf16(*ts: MXTensor) -> List[torch.Tensor]:
    """bf16 RN(code * 2^(e-127)) of each MXTensor at copy speed (Triton's flat pass, q, k and v in one
    launch), or the torch backend's dequantize where Triton is absent."""
    try:
        from backends.triton.quantize import dequantize_bf16_flat_many
    except ImportError:
        from backends.torch.quantize import mxfp8_dequantize

        return [mxfp8_dequantize(t, out_dtype="bfloat16") for t in ts]
    return dequantize_bf16_flat_many(ts)


def _operand_kind(q, k, v) -> Tuple[Optional[str], List[str]]:
    is_mx = [isinstance(t, MXTensor) for t in (q, k, v)]
    if all(is_mx):
        return "mxfp8", []
    if any(is_mx):
        return None, ["cudnn needs q, k, v all bfloat16 or all MXFP8 (MXFP8 SDPA takes no mixed operands)"]
    return "bf16", []


def attention_reasons(q, k, v, causal=False, softmax_scale=None, layout="bshd", cu_seqlens_q=None,
                      cu_seqlens_kv=None) -> List[str]:
    reasons = _common.frontend_reasons() or _common.cuda_reasons((q, k, v, cu_seqlens_q, cu_seqlens_kv))
    if reasons:
        return reasons
    kind, why = _operand_kind(q, k, v)
    if kind == "bf16":
        return why + _bf16_reasons(q, k, v, layout, ())
    if kind == "mxfp8":
        return why + mx_route(q, k, v, causal, layout, backward=False)[1]
    return why


def attention_backward_reasons(do, q, k, v, o, lse, causal=False, softmax_scale=None, layout="bshd",
                               cu_seqlens_q=None, cu_seqlens_kv=None) -> List[str]:
    reasons = _common.frontend_reasons() or _common.cuda_reasons((do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_kv))
    if reasons:
        return reasons
    kind, why = _operand_kind(q, k, v)
    if kind == "bf16":
        return why + _bf16_reasons(q, k, v, layout, (("o", o), ("do", do)))
    if kind == "mxfp8":
        return why + mx_route(q, k, v, causal, layout, backward=True, extra=(("o", o), ("do", do)))[1]
    return why


# --------------------------------------------------------------------------------------------------
# Graph cache
# --------------------------------------------------------------------------------------------------

class _Graph:
    """A built graph, its operand uids in the order `run` receives buffers, and its workspace size."""

    __slots__ = ("graph", "uids", "workspace")

    def __init__(self, graph, uids, workspace: int):
        self.graph, self.uids, self.workspace = graph, tuple(uids), int(workspace)

    def run(self, buffers, device: torch.device) -> None:
        handle, ws = _common.launch(device, self.workspace)
        # the ordered form (buffers + their uids): the frontend caches the binding metadata by value,
        # and its own torch SDPA op (cudnn/sdpa/fwd/torch_op.py) executes this way
        self.graph.execute(buffers, ws, handle=handle, tensor_uids=self.uids)


_graphs: Dict[tuple, _Graph] = {}
_build_lock = threading.Lock()
build_count = 0  # graphs made so far, built or loaded (tests and the benchmark read it to prove cache hits)


def _cached(key: tuple, build) -> _Graph:
    """The graph for `key` (its last item is the device index): kept in memory, else loaded from the
    on-disk plan cache (plan_cache), else built (and its plan written there)."""
    entry = _graphs.get(key)
    if entry is None:
        global build_count
        with _build_lock:
            entry = _graphs.get(key)
            if entry is None:
                entry = _load_or_build(key, build)
                _graphs[key] = entry
                build_count += 1
    return entry


def _load_or_build(key: tuple, build) -> _Graph:
    index = key[-1]
    use_disk = plan_cache.usable(index)
    if use_disk:
        device = torch.device("cuda", index) if index >= 0 else torch.device("cpu")
        loaded = plan_cache.load(key, index, _common.handle_for(device))
        if loaded is not None:
            return _Graph(*loaded)
    entry = build()
    if use_disk:
        plan_cache.store(key, index, entry.graph, entry.uids, entry.workspace)
    return entry


def clear_cache() -> None:
    _graphs.clear()


def _new_graph(fe, handle, io_type):
    dt = fe.data_type
    return fe.pygraph(io_data_type=io_type, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT,
                      handle=handle)


def _build(g, fe) -> int:
    g.build([fe.heur_mode.A, fe.heur_mode.FALLBACK])
    return g.get_workspace_size()


def _contig_strides(shape) -> Tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _geom(shape, stride, layout):
    """[B, H, S, D] dims and strides of a bshd / sbhd tensor's shape and strides."""
    p = _PERM[layout]
    return [shape[i] for i in p], [stride[i] for i in p]


def _bind(t: torch.Tensor, layout: str):
    """A buffer for graph.execute. A dense tensor goes as it is: the frontend re-describes a dense
    buffer covering exactly the declared bytes as the declaration, which is what our declarations
    say of it. A strided view goes as the [B, H, S, D] view matching its declaration."""
    if BIND == "ptr":
        return t.data_ptr()
    return t if t.is_contiguous() else t.permute(_PERM[layout])


def _bind_stats(lse: torch.Tensor):
    return lse.data_ptr() if BIND == "ptr" else lse  # dense [B, H, S] = the declared [B, H, S, 1]


def _mask_kwargs(fe, causal: bool, bottom_right: bool) -> dict:
    """Preferred spelling (bf16 graphs): a band with right bound 0 on the chosen diagonal."""
    if not causal:
        return {}
    align = fe.diagonal_alignment.BOTTOM_RIGHT if bottom_right else fe.diagonal_alignment.TOP_LEFT
    return {"diagonal_alignment": align, "diagonal_band_right_bound": 0}


def _mask_flags(causal: bool, bottom_right: bool) -> dict:
    """Spelling documented by every SDPA binding, the MXFP8 ones included."""
    if not causal:
        return {}
    return {"use_causal_mask_bottom_right": True} if bottom_right else {"use_causal_mask": True}


def _scale(softmax_scale) -> float:
    return DEFAULT_SOFTMAX_SCALE if softmax_scale is None else float(softmax_scale)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """cuDNN's kernels fault on a base address off a 16-byte boundary (equal strides do not help: a
    slice starting at an odd element has them); such an operand is copied, like the frontend's own
    torch op does (cudnn/sdpa/fwd/torch_op.py, _normalize_operand)."""
    return t if not t.data_ptr() % 16 else t.clone(memory_format=torch.contiguous_format)


def _aligned_all(*ts):
    for t in ts:  # a loop, not any(<generator>): this runs on every call of the cache-hit path
        if t.data_ptr() % 16:
            return tuple(_aligned(t) for t in ts)
    return ts


def _aligned_mx(t: MXTensor) -> MXTensor:
    return t if not t.data.data_ptr() % 16 else t.replace(data=_aligned(t.data))


def _do_like_o(do: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """dO in O's layout (the frontend's torch op requires dO to match O's strides), 16-byte aligned."""
    if do.stride() == o.stride() and not do.data_ptr() % 16:
        return do
    return torch.empty_strided(o.shape, o.stride(), dtype=do.dtype, device=do.device).copy_(do)


# --------------------------------------------------------------------------------------------------
# bf16, bshd / sbhd
# --------------------------------------------------------------------------------------------------

def _out_shape(x_shape, d: int):
    return tuple(x_shape[:-1]) + (d,)


def _build_dense_fwd(q, k, v, causal, scale, layout, bottom_right):
    fe = _common.frontend()
    handle = _common.handle_for(q.device)
    dt = fe.data_type
    g = _new_graph(fe, handle, dt.BFLOAT16)
    qd, qs = _geom(q.shape, q.stride(), layout)
    kd, ks = _geom(k.shape, k.stride(), layout)
    vd, vs = _geom(v.shape, v.stride(), layout)
    o_shape = _out_shape(q.shape, D_V)
    od, os_ = _geom(o_shape, _contig_strides(o_shape), layout)
    b, h, s_q = qd[0], qd[1], qd[2]
    tq = g.tensor(name="q", dim=qd, stride=qs, data_type=dt.BFLOAT16, uid=Q)
    tk = g.tensor(name="k", dim=kd, stride=ks, data_type=dt.BFLOAT16, uid=K)
    tv = g.tensor(name="v", dim=vd, stride=vs, data_type=dt.BFLOAT16, uid=V)
    o, stats = g.sdpa(tq, tk, tv, attn_scale=scale, generate_stats=True, name="mla_sdpa",
                      **_mask_kwargs(fe, causal, bottom_right))
    o.set_output(True).set_dim(od).set_stride(os_).set_data_type(dt.BFLOAT16).set_uid(O)
    stats.set_output(True).set_dim([b, h, s_q, 1]).set_stride([h * s_q, s_q, 1, 1]).set_data_type(dt.FLOAT).set_uid(STATS)
    return _Graph(g, (Q, K, V, O, STATS), _build(g, fe))


def _dense_forward(q, k, v, causal, scale, layout, b=None, s_q=None, s_kv=None):
    """cuDNN forward for bshd / sbhd with S_q <= S_kv when causal (b, s_q, s_kv: the caller's
    _seq_lengths, when it has them)."""
    q, k, v = _aligned_all(q, k, v)
    if b is None:
        b, s_q = _seq_lengths(q, layout)
        s_kv = _seq_lengths(k, layout)[1]
    bottom_right = causal and s_q != s_kv
    key = ("fwd", layout, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), causal, scale,
           bottom_right, q.get_device())
    entry = _cached(key, lambda: _build_dense_fwd(q, k, v, causal, scale, layout, bottom_right))
    o = torch.empty(_out_shape(q.shape, D_V), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((b, q.shape[2], s_q), dtype=torch.float32, device=q.device)
    entry.run((_bind(q, layout), _bind(k, layout), _bind(v, layout), _bind(o, layout), _bind_stats(lse)), q.device)
    return o, lse


def _build_dense_bwd(do, q, k, v, o, causal, scale, layout, bottom_right):
    fe = _common.frontend()
    handle = _common.handle_for(q.device)
    dt = fe.data_type
    g = _new_graph(fe, handle, dt.BFLOAT16)
    tensors = {}
    for name, uid, t in (("q", Q, q), ("k", K, k), ("v", V, v), ("o", O, o), ("dO", DO, do)):
        d, s = _geom(t.shape, t.stride(), layout)
        tensors[name] = g.tensor(name=name, dim=d, stride=s, data_type=dt.BFLOAT16, uid=uid)
    qd = _geom(q.shape, q.stride(), layout)[0]
    b, h, s_q = qd[0], qd[1], qd[2]
    stats = g.tensor(name="stats", dim=[b, h, s_q, 1], stride=[h * s_q, s_q, 1, 1], data_type=dt.FLOAT, uid=STATS)
    dq, dk, dv = g.sdpa_backward(tensors["q"], tensors["k"], tensors["v"], tensors["o"], tensors["dO"], stats,
                                 attn_scale=scale, name="mla_sdpa_bwd", **_mask_kwargs(fe, causal, bottom_right))
    for out, uid, like in ((dq, DQ, q), (dk, DK, k), (dv, DV, v)):
        d, s = _geom(like.shape, _contig_strides(like.shape), layout)
        out.set_output(True).set_dim(d).set_stride(s).set_data_type(dt.BFLOAT16).set_uid(uid)
    return _Graph(g, (Q, K, V, O, DO, STATS, DQ, DK, DV), _build(g, fe))


def _dense_backward(do, q, k, v, o, lse, causal, scale, layout, s_q=None, s_kv=None):
    if s_q is None:
        s_q = _seq_lengths(q, layout)[1]
        s_kv = _seq_lengths(k, layout)[1]
    bottom_right = causal and s_q != s_kv
    q, k, v, o = _aligned_all(q, k, v, o)
    do = _do_like_o(do, o)
    if not lse.is_contiguous() or lse.data_ptr() % 16:  # Stats: a packed, aligned [B, H, S, 1] (cuDNN < 9.26)
        lse = lse.clone(memory_format=torch.contiguous_format)
    key = ("bwd", layout, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), o.stride(),
           do.stride(), causal, scale, bottom_right, q.get_device())
    entry = _cached(key, lambda: _build_dense_bwd(do, q, k, v, o, causal, scale, layout, bottom_right))
    dq = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    dk = torch.empty(k.shape, dtype=torch.bfloat16, device=q.device)
    dv = torch.empty(v.shape, dtype=torch.bfloat16, device=q.device)
    entry.run((_bind(q, layout), _bind(k, layout), _bind(v, layout), _bind(o, layout), _bind(do, layout),
               _bind_stats(lse), _bind(dq, layout), _bind(dk, layout), _bind(dv, layout)), q.device)
    return dq, dk, dv


def _seq_slice(t, layout: str, start: int):
    """Rows start.. of the sequence axis (a view; MXTensors slice data and compact scales)."""
    axis = _SEQ_AXIS[layout]
    if isinstance(t, MXTensor):
        scale = compact_scales(t)
        return MXTensor(t.data.narrow(axis, start, t.shape[axis] - start),
                        scale.narrow(axis, start, scale.shape[axis] - start), t.axis, t.elem, "compact")
    return t.narrow(axis, start, t.shape[axis] - start)


def _forward_leading_masked(run_fwd, q, k, v, causal, scale, layout):
    """S_q > S_kv under a bottom-right causal mask: run the last S_kv query rows, mask the rest."""
    b, s_q = _seq_lengths(q, layout)
    s_kv = _seq_lengths(k, layout)[1]
    lead = s_q - s_kv if causal and s_q > s_kv else 0
    if not lead:
        if run_fwd is _dense_forward:
            return _dense_forward(q, k, v, causal, scale, layout, b, s_q, s_kv)
        return run_fwd(q, k, v, causal, scale, layout)
    o_run, lse_run = run_fwd(_seq_slice(q, layout, lead), k, v, causal, scale, layout)
    dev = o_run.device
    o = torch.zeros(_out_shape(q.shape, D_V), dtype=torch.bfloat16, device=dev)
    o.narrow(_SEQ_AXIS[layout], lead, s_kv).copy_(o_run)
    lse = torch.full((b, q.shape[2], s_q), float("-inf"), dtype=torch.float32, device=dev)
    lse[..., lead:] = lse_run
    return o, lse


def _backward_leading_masked(run_bwd, do, q, k, v, o, lse, causal, scale, layout):
    s_q = _seq_lengths(q, layout)[1]
    s_kv = _seq_lengths(k, layout)[1]
    lead = s_q - s_kv if causal and s_q > s_kv else 0
    if not lead:
        if run_bwd is _dense_backward:
            return _dense_backward(do, q, k, v, o, lse, causal, scale, layout, s_q, s_kv)
        return run_bwd(do, q, k, v, o, lse, causal, scale, layout)
    axis = _SEQ_AXIS[layout]
    dq_run, dk, dv = run_bwd(_seq_slice(do, layout, lead), _seq_slice(q, layout, lead), k, v,
                             _seq_slice(o, layout, lead), lse[..., lead:], causal, scale, layout)
    dq = torch.zeros(q.shape, dtype=torch.bfloat16, device=dq_run.device)
    dq.narrow(axis, lead, s_kv).copy_(dq_run)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------
# bf16, thd (ragged offsets + padding mask)
# --------------------------------------------------------------------------------------------------

THD_S_BUCKET = 128


def _bucket(n: int) -> int:
    return -(-n // THD_S_BUCKET) * THD_S_BUCKET


class _Thd:
    """Host view of the packed sequences: lengths, maxima, mask alignment, fully masked token rows."""

    __slots__ = ("batch", "s_max_q", "s_max_kv", "bottom_right", "masked_rows", "zero_q_seq", "zero_kv_seq")

    def __init__(self, cu_q: torch.Tensor, cu_kv: torch.Tensor, causal: bool):
        both = torch.cat([cu_q, cu_kv]).tolist()  # the one device->host copy of the thd path
        n = cu_q.shape[0]
        cq, ckv = both[:n], both[n:]
        lq = [b - a for a, b in zip(cq, cq[1:])]
        lkv = [b - a for a, b in zip(ckv, ckv[1:])]
        self.batch = n - 1
        # the graph's S_max is bucketed to 128: the padding mask carries the real lengths, and packed
        # batches whose longest sequence varies a little reuse one graph
        self.s_max_q, self.s_max_kv = _bucket(max(lq)), _bucket(max(lkv))
        self.bottom_right = causal and any(a != b for a, b in zip(lq, lkv))
        rows = []
        for start, nq, nkv in zip(cq, lq, lkv):
            masked = nq if nkv == 0 else (max(0, nq - nkv) if causal else 0)
            rows.extend(range(start, start + masked))
        self.masked_rows = rows
        self.zero_q_seq = 0 in lq
        self.zero_kv_seq = 0 in lkv


def _thd_geom(tokens_max: int, heads: int, d: int, batch: int):
    return [batch, heads, tokens_max, d], [tokens_max * heads * d, d, heads * d, 1]


def _thd_tensors(g, fe, batch: int, backward: bool):
    dt = fe.data_type
    shape = dict(dim=[batch + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.INT32)
    names = (("qk", RAG_QK), ("kk", RAG_KK), ("v", RAG_V), ("o", RAG_O))
    if backward:
        names += (("dq", RAG_DQ), ("dk", RAG_DK), ("dv", RAG_DV))
    rag = {name: g.tensor(name=f"ragged_{name}", uid=uid, **shape) for name, uid in names}
    lens = dict(dim=[batch, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.INT32)
    seq_q = g.tensor(name="seq_len_q", uid=SEQ_Q, **lens)
    seq_kv = g.tensor(name="seq_len_kv", uid=SEQ_KV, **lens)
    return rag, seq_q, seq_kv


def _thd_device_tensors(cu_q, cu_kv, heads: int):
    """Ragged element offsets and per-sequence lengths, on the device (no host round trip)."""
    cu_q32, cu_kv32 = cu_q.to(torch.int32), cu_kv.to(torch.int32)
    rag_qk = (cu_q32 * (heads * D_QK)).view(-1, 1, 1, 1)
    rag_kk = (cu_kv32 * (heads * D_QK)).view(-1, 1, 1, 1)
    rag_v = (cu_kv32 * (heads * D_V)).view(-1, 1, 1, 1)
    rag_o = (cu_q32 * (heads * D_V)).view(-1, 1, 1, 1)
    seq_q = (cu_q32[1:] - cu_q32[:-1]).view(-1, 1, 1, 1)
    seq_kv = (cu_kv32[1:] - cu_kv32[:-1]).view(-1, 1, 1, 1)
    return rag_qk, rag_kk, rag_v, rag_o, seq_q, seq_kv


def _token_coords(cu_q: torch.Tensor, tokens: int, batch: int):
    """(sequence index, position in sequence) of every packed query token, computed on the device."""
    cu = cu_q.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(batch, device=cu.device), lens, output_size=tokens)
    pos = torch.arange(tokens, device=cu.device) - cu[seq]
    return seq, pos


def _build_thd_fwd(q, k, v, causal, scale, thd: _Thd):
    fe = _common.frontend()
    handle = _common.handle_for(q.device)
    dt = fe.data_type
    g = _new_graph(fe, handle, dt.BFLOAT16)
    heads, batch = q.shape[1], thd.batch
    rag, seq_q, seq_kv = _thd_tensors(g, fe, batch, backward=False)
    qd, qs = _thd_geom(thd.s_max_q, heads, D_QK, batch)
    kd, ks = _thd_geom(thd.s_max_kv, heads, D_QK, batch)
    vd, vs = _thd_geom(thd.s_max_kv, heads, D_V, batch)
    od, os_ = _thd_geom(thd.s_max_q, heads, D_V, batch)
    tq = g.tensor(name="q", dim=qd, stride=qs, data_type=dt.BFLOAT16, uid=Q, ragged_offset=rag["qk"])
    tk = g.tensor(name="k", dim=kd, stride=ks, data_type=dt.BFLOAT16, uid=K, ragged_offset=rag["kk"])
    tv = g.tensor(name="v", dim=vd, stride=vs, data_type=dt.BFLOAT16, uid=V, ragged_offset=rag["v"])
    o, stats = g.sdpa(tq, tk, tv, attn_scale=scale, generate_stats=True, name="mla_sdpa_thd",
                      use_padding_mask=True, seq_len_q=seq_q, seq_len_kv=seq_kv,
                      **_mask_kwargs(fe, causal, thd.bottom_right))
    o.set_output(True).set_dim(od).set_stride(os_).set_data_type(dt.BFLOAT16).set_uid(O).set_ragged_offset(rag["o"])
    s = thd.s_max_q
    stats.set_output(True).set_dim([batch, heads, s, 1]).set_stride([heads * s, s, 1, 1]).set_data_type(dt.FLOAT)
    stats.set_uid(STATS)
    uids = (Q, K, V, O, STATS, RAG_QK, RAG_KK, RAG_V, RAG_O, SEQ_Q, SEQ_KV)
    return _Graph(g, uids, _build(g, fe))


def _round64(n: int) -> int:
    """The backward's packed token totals (they size its dq accumulator), rounded up to 64 tokens like
    the frontend's own torch op does."""
    return -(-n // 64) * 64


def _thd_key(kind, q, k, causal, scale, thd: _Thd):
    """Heads and the bucketed geometry; the backward also bakes the (rounded) token totals in."""
    totals = (_round64(q.shape[0]), _round64(k.shape[0])) if kind == "bwd_thd" else ()
    return (kind, q.shape[1], causal, scale, thd.batch, thd.s_max_q, thd.s_max_kv, thd.bottom_right, totals,
            q.get_device())


def _thd_forward(q, k, v, causal, scale, cu_q, cu_kv):
    q, k, v = _aligned_all(q, k, v)
    thd = _Thd(cu_q, cu_kv, causal)
    tokens, heads = q.shape[0], q.shape[1]
    o = torch.zeros((tokens, heads, D_V), dtype=torch.bfloat16, device=q.device)
    lse = torch.full((heads, tokens), float("-inf"), dtype=torch.float32, device=q.device)
    if tokens == 0 or thd.s_max_kv == 0:
        return o, lse  # no query, or no key anywhere: every row fully masked
    entry = _cached(_thd_key("fwd_thd", q, k, causal, scale, thd), lambda: _build_thd_fwd(q, k, v, causal, scale, thd))
    stats = torch.empty((thd.batch, heads, thd.s_max_q), dtype=torch.float32, device=q.device)
    entry.run((q, k, v, o, stats.unsqueeze(-1), *_thd_device_tensors(cu_q, cu_kv, heads)), q.device)
    seq, pos = _token_coords(cu_q, tokens, thd.batch)
    lse = stats[seq, :, pos].t().contiguous()  # [T, H] -> [H, T]
    if thd.masked_rows:
        rows = torch.tensor(thd.masked_rows, dtype=torch.int64, device=q.device)
        o.index_fill_(0, rows, 0)
        lse.index_fill_(1, rows, float("-inf"))
    return o, lse


def _build_thd_bwd(q, k, v, causal, scale, thd: _Thd):
    fe = _common.frontend()
    handle = _common.handle_for(q.device)
    dt = fe.data_type
    g = _new_graph(fe, handle, dt.BFLOAT16)
    heads, batch = q.shape[1], thd.batch
    rag, seq_q, seq_kv = _thd_tensors(g, fe, batch, backward=True)
    geo = {
        "q": (_thd_geom(thd.s_max_q, heads, D_QK, batch), rag["qk"], Q),
        "k": (_thd_geom(thd.s_max_kv, heads, D_QK, batch), rag["kk"], K),
        "v": (_thd_geom(thd.s_max_kv, heads, D_V, batch), rag["v"], V),
        "o": (_thd_geom(thd.s_max_q, heads, D_V, batch), rag["o"], O),
        "dO": (_thd_geom(thd.s_max_q, heads, D_V, batch), rag["o"], DO),
    }
    t = {name: g.tensor(name=name, dim=d, stride=s, data_type=dt.BFLOAT16, uid=uid, ragged_offset=r)
         for name, ((d, s), r, uid) in geo.items()}
    sm = thd.s_max_q
    stats = g.tensor(name="stats", dim=[batch, heads, sm, 1], stride=[heads * sm, sm, 1, 1], data_type=dt.FLOAT,
                     uid=STATS)
    dq, dk, dv = g.sdpa_backward(t["q"], t["k"], t["v"], t["o"], t["dO"], stats, attn_scale=scale,
                                 name="mla_sdpa_bwd_thd", use_padding_mask=True, seq_len_q=seq_q, seq_len_kv=seq_kv,
                                 max_total_seq_len_q=_round64(q.shape[0]), max_total_seq_len_kv=_round64(k.shape[0]),
                                 **_mask_kwargs(fe, causal, thd.bottom_right))
    for out, uid, src, rag_name in ((dq, DQ, "q", "dq"), (dk, DK, "k", "dk"), (dv, DV, "v", "dv")):
        (d, s), _, _ = geo[src]
        out.set_output(True).set_dim(d).set_stride(s).set_data_type(dt.BFLOAT16).set_uid(uid)
        out.set_ragged_offset(rag[rag_name])
    uids = (Q, K, V, O, DO, STATS, DQ, DK, DV, RAG_QK, RAG_KK, RAG_V, RAG_O, SEQ_Q, SEQ_KV, RAG_DQ, RAG_DK, RAG_DV)
    return _Graph(g, uids, _build(g, fe))


def _thd_backward(do, q, k, v, o, lse, causal, scale, cu_q, cu_kv):
    q, k, v, o = _aligned_all(q, k, v, o)
    do = _do_like_o(do, o)
    thd = _Thd(cu_q, cu_kv, causal)
    tokens, heads = q.shape[0], q.shape[1]
    # zeros: sequences without queries (or keys) must get zero gradients whether or not cuDNN visits them
    dq = torch.zeros(q.shape, dtype=torch.bfloat16, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.bfloat16, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.bfloat16, device=q.device)
    if tokens == 0 or thd.s_max_kv == 0:
        return dq, dk, dv
    entry = _cached(_thd_key("bwd_thd", q, k, causal, scale, thd), lambda: _build_thd_bwd(q, k, v, causal, scale, thd))
    seq, pos = _token_coords(cu_q, tokens, thd.batch)
    stats = torch.zeros((thd.batch, heads, thd.s_max_q), dtype=torch.float32, device=q.device)
    lse32 = lse.to(torch.float32)
    stats[seq, :, pos] = torch.where(lse32 == float("-inf"), MASKED_ROW_LSE, lse32).t()
    rag_qk, rag_kk, rag_v, rag_o, seq_q, seq_kv = _thd_device_tensors(cu_q, cu_kv, heads)
    # dq, dk, dv are packed like q, k, v: their ragged offsets are the same numbers
    entry.run((q, k, v, o, do, stats.unsqueeze(-1), dq, dk, dv, rag_qk, rag_kk, rag_v, rag_o, seq_q, seq_kv,
               rag_qk, rag_kk, rag_v), q.device)
    if thd.masked_rows:
        dq.index_fill_(0, torch.tensor(thd.masked_rows, dtype=torch.int64, device=q.device), 0)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------
# MXFP8 (sm100; written against the documented API, not run here)
# --------------------------------------------------------------------------------------------------

def _e8m0(t: torch.Tensor) -> torch.Tensor:
    """Scale bytes typed as E8M0 when torch has the dtype (the graph declares FP8_E8M0)."""
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    return t.view(e8m0) if e8m0 is not None else t


def _qk_scale_geom(b: int, h: int, s: int, d: int):
    sp, cp = -(-s // 128) * 128, -(-(d // 32) // 4) * 4
    return [b, h, sp, cp], [h * sp * cp, sp * cp, cp, 1]


def _s_scale_geom(b: int, h: int, s: int, d: int):
    ss, dp = -(-(s // 32) // 4) * 4, -(-d // 128) * 128
    return [b, h, ss, dp], list(v_role_strides(b, h, ss, dp))


def _fp8_tensor(g, dt, name, uid, t, layout):
    d, s = _geom(t.shape, t.stride(), layout)
    return g.tensor(name=name, dim=d, stride=s, data_type=dt.FP8_E4M3, uid=uid)


def _scale_tensor(g, dt, fe, name, uid, geom):
    d, s = geom
    return g.tensor(name=name, dim=d, stride=s, data_type=dt.FP8_E8M0, uid=uid,
                    reordering_type=fe.tensor_reordering.F8_128x4)


def _bind_scale(packed: torch.Tensor, role: str):
    if BIND == "ptr":
        return packed.data_ptr()
    return _e8m0(packed) if role == "qk" else _e8m0(v_role_view(packed))


def _bind_mx(t: MXTensor, layout: str):
    return _bind(t.data, layout)


def _build_mx_fwd(q, k, v, causal, scale, layout, bottom_right):
    fe = _common.frontend()
    handle = _common.handle_for(q.data.device)
    dt = fe.data_type
    g = _new_graph(fe, handle, dt.BFLOAT16)
    b, s_q = _seq_lengths(q, layout)
    s_kv = _seq_lengths(k, layout)[1]
    h = q.shape[2]
    tq = _fp8_tensor(g, dt, "q", Q, q.data, layout)
    tk = _fp8_tensor(g, dt, "k", K, k.data, layout)
    tv = _fp8_tensor(g, dt, "v", V, v.data, layout)
    sq = _scale_tensor(g, dt, fe, "descale_q", SF_Q, _qk_scale_geom(b, h, s_q, D_QK))
    sk = _scale_tensor(g, dt, fe, "descale_k", SF_K, _qk_scale_geom(b, h, s_kv, D_QK))
    sv = _scale_tensor(g, dt, fe, "descale_v", SF_V, _s_scale_geom(b, h, s_kv, D_V))
    o, stats, amax_o = g.sdpa_mxfp8(tq, tk, tv, sq, sk, sv, attn_scale=scale, generate_stats=True,
                                    name="mla_sdpa_mxfp8", **_mask_flags(causal, bottom_right))
    o_shape = _out_shape(q.shape, D_V)
    od, os_ = _geom(o_shape, _contig_strides(o_shape), layout)
    o.set_output(True).set_dim(od).set_stride(os_).set_data_type(dt.BFLOAT16).set_uid(O)
    stats.set_output(True).set_dim([b, h, s_q, 1]).set_stride([h * s_q, s_q, 1, 1]).set_data_type(dt.FLOAT)
    stats.set_uid(STATS)
    amax_o.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(dt.FLOAT).set_uid(AMAX_O)
    return _Graph(g, (Q, K, V, SF_Q, SF_K, SF_V, O, STATS, AMAX_O), _build(g, fe))


def _mx_key(t: MXTensor):
    return (t.data.shape, t.data.stride(), t.elem)


def _mx_forward(q, k, v, causal, scale, layout):
    q, k, v = _aligned_mx(q), _aligned_mx(k), _aligned_mx(v)
    b, s_q = _seq_lengths(q, layout)
    s_kv = _seq_lengths(k, layout)[1]
    bottom_right = causal and s_q != s_kv
    dev = q.data.device
    key = ("fwd_mx", layout, _mx_key(q), _mx_key(k), _mx_key(v), causal, scale, bottom_right, q.data.get_device())
    entry = _cached(key, lambda: _build_mx_fwd(q, k, v, causal, scale, layout, bottom_right))
    sf_q = pack_attention_scales(q, "qk", layout)
    sf_k = pack_attention_scales(k, "qk", layout)
    sf_v = pack_columnwise(v, layout)  # D_v = 128: spec's bytes
    o = torch.empty(_out_shape(q.shape, D_V), dtype=torch.bfloat16, device=dev)
    lse = torch.empty((b, q.shape[2], s_q), dtype=torch.float32, device=dev)
    amax = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=dev)
    entry.run((_bind_mx(q, layout), _bind_mx(k, layout), _bind_mx(v, layout), _bind_scale(sf_q, "qk"),
               _bind_scale(sf_k, "qk"), _bind_scale(sf_v, "v"), _bind(o, layout), _bind_stats(lse),
               amax if BIND != "ptr" else amax.data_ptr()), dev)
    return o, lse


def _requantize(x: torch.Tensor, axis):
    """e4m3 / rceil / saturate MXFP8 of x along `axis` (int or tuple), compact scales (SEMANTICS 1)."""
    from backends.torch.quantize import mxfp8_quantize  # the exact eager quantizer (byte-equal to spec)

    return mxfp8_quantize(x, axis=axis, elem="e4m3", scale_mode="rceil", nonfinite="saturate",
                          scale_layout="compact")


def _dequantize(t: MXTensor) -> torch.Tensor:
    from backends.torch.quantize import mxfp8_dequantize

    return mxfp8_dequantize(t, out_dtype="float32")


def _mx_backward_operands(do, q, k, v, layout):
    """The operand set cuDNN's MXFP8 backward reads, each quantized along its GEMM's contraction axis."""
    s_axis = _SEQ_AXIS[layout]
    q_t = _requantize(_dequantize(q), s_axis)  # dK = dS^T q contracts S_q
    k_t = _requantize(_dequantize(k), s_axis)  # dQ = dS k contracts S_kv
    v_d = _requantize(_dequantize(v), 3)       # dP = dO v^T contracts D_v
    do_d, do_t = _requantize(do, (3, s_axis))  # dP (along D) and dV = P^T dO (along S_q)
    return q_t, k_t, v_d, do_d, do_t


def _build_mx_bwd(do, q, k, v, o, ops, causal, scale, layout, bottom_right):
    q_t, k_t, v_d, do_d, do_t = ops
    fe = _common.frontend()
    handle = _common.handle_for(q.data.device)
    dt = fe.data_type
    g = _new_graph(fe, handle, dt.BFLOAT16)
    b, s_q = _seq_lengths(q, layout)
    s_kv = _seq_lengths(k, layout)[1]
    h = q.shape[2]
    fp8 = {name: _fp8_tensor(g, dt, name, uid, t.data, layout)
           for name, uid, t in (("q", Q, q), ("q_T", Q_T, q_t), ("k", K, k), ("k_T", K_T, k_t), ("v", V, v_d),
                                ("dO", DO_F8, do_d), ("dO_T", DO_T, do_t))}
    half = {}
    for name, uid, t in (("o_f16", O, o), ("dO_f16", DO, do)):
        d, s = _geom(t.shape, t.stride(), layout)
        half[name] = g.tensor(name=name, dim=d, stride=s, data_type=dt.BFLOAT16, uid=uid)
    stats = g.tensor(name="stats", dim=[b, h, s_q, 1], stride=[h * s_q, s_q, 1, 1], data_type=dt.FLOAT, uid=STATS)
    sf = {
        "descale_q": _scale_tensor(g, dt, fe, "descale_q", SF_Q, _qk_scale_geom(b, h, s_q, D_QK)),
        "descale_q_T": _scale_tensor(g, dt, fe, "descale_q_T", SF_Q_T, _s_scale_geom(b, h, s_q, D_QK)),
        "descale_k": _scale_tensor(g, dt, fe, "descale_k", SF_K, _qk_scale_geom(b, h, s_kv, D_QK)),
        "descale_k_T": _scale_tensor(g, dt, fe, "descale_k_T", SF_K_T, _s_scale_geom(b, h, s_kv, D_QK)),
        "descale_v": _scale_tensor(g, dt, fe, "descale_v", SF_V, _qk_scale_geom(b, h, s_kv, D_V)),
        "descale_dO": _scale_tensor(g, dt, fe, "descale_dO", SF_DO, _qk_scale_geom(b, h, s_q, D_V)),
        "descale_dO_T": _scale_tensor(g, dt, fe, "descale_dO_T", SF_DO_T, _s_scale_geom(b, h, s_q, D_V)),
    }
    outs = g.sdpa_mxfp8_backward(
        fp8["q"], fp8["q_T"], fp8["k"], fp8["k_T"], fp8["v"], half["o_f16"], half["dO_f16"], fp8["dO"],
        fp8["dO_T"], stats, sf["descale_q"], sf["descale_q_T"], sf["descale_k"], sf["descale_k_T"],
        sf["descale_v"], sf["descale_dO"], sf["descale_dO_T"], attn_scale=scale, name="mla_sdpa_mxfp8_bwd",
        **_mask_flags(causal, bottom_right))
    dq, dk, dv, amax_dq, amax_dk, amax_dv = outs
    for out, uid, like in ((dq, DQ, q), (dk, DK, k), (dv, DV, v)):
        d, s = _geom(like.shape, _contig_strides(like.shape), layout)
        out.set_output(True).set_dim(d).set_stride(s).set_data_type(dt.BFLOAT16).set_uid(uid)
    for out, uid in ((amax_dq, AMAX_DQ), (amax_dk, AMAX_DK), (amax_dv, AMAX_DV)):
        out.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(dt.FLOAT).set_uid(uid)
    uids = (Q, Q_T, K, K_T, V, O, DO, DO_F8, DO_T, STATS, SF_Q, SF_Q_T, SF_K, SF_K_T, SF_V, SF_DO, SF_DO_T,
            DQ, DK, DV, AMAX_DQ, AMAX_DK, AMAX_DV)
    return _Graph(g, uids, _build(g, fe))


def _mx_backward(do, q, k, v, o, lse, causal, scale, layout):
    s_q = _seq_lengths(q, layout)[1]
    s_kv = _seq_lengths(k, layout)[1]
    bottom_right = causal and s_q != s_kv
    dev = q.data.device
    q, k, v = _aligned_mx(q), _aligned_mx(k), _aligned_mx(v)
    (o,) = _aligned_all(o)
    do = _do_like_o(do, o)
    if not lse.is_contiguous() or lse.data_ptr() % 16:
        lse = lse.clone(memory_format=torch.contiguous_format)
    ops = _mx_backward_operands(do, q, k, v, layout)
    q_t, k_t, v_d, do_d, do_t = ops
    key = ("bwd_mx", layout, _mx_key(q), _mx_key(k), _mx_key(v), o.stride(), do.stride(), causal, scale,
           bottom_right, q.data.get_device())
    entry = _cached(key, lambda: _build_mx_bwd(do, q, k, v, o, ops, causal, scale, layout, bottom_right))
    packs = (
        (pack_attention_scales(q, "qk", layout), "qk"), (pack_columnwise(q_t, layout), "v"),
        (pack_attention_scales(k, "qk", layout), "qk"), (pack_columnwise(k_t, layout), "v"),
        (pack_attention_scales(v_d, "qk", layout), "qk"), (pack_attention_scales(do_d, "qk", layout), "qk"),
        (pack_columnwise(do_t, layout), "v"),
    )
    dq = torch.empty(q.shape, dtype=torch.bfloat16, device=dev)
    dk = torch.empty(k.shape, dtype=torch.bfloat16, device=dev)
    dv = torch.empty(v.shape, dtype=torch.bfloat16, device=dev)
    amax = [torch.empty((1, 1, 1, 1), dtype=torch.float32, device=dev) for _ in range(3)]
    buffers = (
        _bind_mx(q, layout), _bind_mx(q_t, layout), _bind_mx(k, layout), _bind_mx(k_t, layout),
        _bind_mx(v_d, layout), _bind(o, layout), _bind(do, layout), _bind_mx(do_d, layout), _bind_mx(do_t, layout),
        _bind_stats(lse), *(_bind_scale(p, role) for p, role in packs),
        _bind(dq, layout), _bind(dk, layout), _bind(dv, layout),
        *(a if BIND != "ptr" else a.data_ptr() for a in amax),
    )
    entry.run(buffers, dev)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------
# Ops
# --------------------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------------------
# Variants: registry entries (backends/registry.py) with their reasons and priorities. MXFP8 operands:
# "native" (the MXFP8 graph, sm100) before "dequantized" (the bf16 graph on the exact bf16
# dequantization, sm90+); bf16 operands: "bf16" (the bf16 graph).
# --------------------------------------------------------------------------------------------------
ATTENTION_VARIANTS = {"native": 30, "dequantized": 20, "bf16": 10}


def variant_reasons(variant, q, k, v, causal, layout, backward, extra=()) -> List[str]:
    """Why `variant` cannot serve these operands (empty: it can); the backend's own check
    (attention_reasons) comes first."""
    kind, why = _operand_kind(q, k, v)
    if why:
        return why
    if variant == "bf16":
        return [] if kind == "bf16" else ["MXFP8 q, k, v: the native or dequantized route serves them"]
    if kind != "mxfp8":
        return [f"q, k, v are bfloat16: the {variant} route takes MXFP8 operands"]
    if variant == "native":
        return _mxfp8_reasons(q, k, v, causal, layout, backward, extra)
    if variant == "dequantized":
        return _dequantized_reasons(q, k, v, layout, extra)
    raise ValueError(f"variant: expected one of {', '.join(ATTENTION_VARIANTS)}, got {variant!r}")


def _forward_check(variant):
    def check(q, k, v, causal=False, softmax_scale=None, layout="bshd", cu_seqlens_q=None, cu_seqlens_kv=None):
        return variant_reasons(variant, q, k, v, causal, layout, backward=False)
    return check


def _backward_check(variant):
    def check(do, q, k, v, o, lse, causal=False, softmax_scale=None, layout="bshd", cu_seqlens_q=None,
              cu_seqlens_kv=None):
        return variant_reasons(variant, q, k, v, causal, layout, backward=True, extra=(("o", o), ("do", do)))
    return check


for _name, _priority in ATTENTION_VARIANTS.items():
    register_variant("mla_attention", "cudnn", _name, _priority, check=_forward_check(_name))
    # the dequantized route's backward is the bf16 graph on _dequantize_bf16's outputs (spec's exact bf16
    # dequantization): a compiled backward may dequantize apart and let the saved codes go first
    register_variant("mla_attention_backward", "cudnn", _name, _priority, check=_backward_check(_name),
                     bf16_twin="bf16" if _name == "dequantized" else "")


@register("mla_attention", "cudnn", check=attention_reasons)
def mla_attention(q, k, v, causal=False, softmax_scale=None, layout="bshd", cu_seqlens_q=None,
                  cu_seqlens_kv=None, variant=None):
    """spec.mla_attention on cuDNN: (o bf16 in q's layout, lse fp32 [B, H, S_q] or thd [H, T_q]).
    variant: the ATTENTION_VARIANTS entry the dispatcher chose (None: decided here, as mx_route)."""
    scale = _scale(softmax_scale)
    if isinstance(q, MXTensor):
        native = variant == "native" if variant is not None else _native_mx(q, k, v, causal, layout, backward=False)
        if native:
            return _forward_leading_masked(_mx_forward, q, k, v, causal, scale, layout)
        q, k, v = _dequantize_bf16(q, k, v)
    if layout == "thd":
        return _thd_forward(q, k, v, causal, scale, cu_seqlens_q, cu_seqlens_kv)
    return _forward_leading_masked(_dense_forward, q, k, v, causal, scale, layout)


@register("mla_attention_backward", "cudnn", check=attention_backward_reasons)
def mla_attention_backward(do, q, k, v, o, lse, causal=False, softmax_scale=None, layout="bshd",
                           cu_seqlens_q=None, cu_seqlens_kv=None, variant=None):
    """spec.mla_attention_backward on cuDNN: (dq, dk, dv) bf16 in the layouts of q, k, v. variant: as
    mla_attention's."""
    scale = _scale(softmax_scale)
    if isinstance(q, MXTensor):
        extra = (("o", o), ("do", do))
        native = variant == "native" if variant is not None else _native_mx(q, k, v, causal, layout,
                                                                              backward=True, extra=extra)
        if native:
            return _backward_leading_masked(_mx_backward, do, q, k, v, o, lse, causal, scale, layout)
        q, k, v = _dequantize_bf16(q, k, v)
    if layout == "thd":
        return _thd_backward(do, q, k, v, o, lse, causal, scale, cu_seqlens_q, cu_seqlens_kv)
    return _backward_leading_masked(_dense_backward, do, q, k, v, o, lse, causal, scale, layout)
