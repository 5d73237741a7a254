"""Tiny random-init TorchTitan DeepSeek-V3 models with the real MLA head dims, for the TorchTitan
integration's CPU tests (no downloads).

`DenseFlexAttention` is the stock model's inner attention on the CPU: FlexAttention refuses a backward
on the CPU, so the tests give stock an inner attention that evaluates the same BlockMask's mask_mod
densely (or VarlenMetadata's documents) and runs SDPA's math on the result. It subclasses
FlexAttention's config, so `Decoder.get_attention_masks` builds the BlockMask it would build for flex.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, and_masks, create_block_mask, create_mask

from tests import titan_compat

titan_compat.install()  # before torchtitan's imports: torch 2.11 lacks names TorchTitan 0.3.0 imports

from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common.attention import (  # noqa: E402
    FlexAttention,
    VarlenAttention,
    VarlenMetadata,
    get_causal_mask_mod,
    get_efficient_causal_mask_mod_for_packed_document,
)
from torchtitan.models.common.config_utils import make_ffn_config  # noqa: E402
from torchtitan.models.deepseek_v3 import (  # noqa: E402
    _EMBEDDING_INIT,
    _LINEAR_INIT,
    _NORM_INIT,
    _depth_init,
    _output_linear_init,
    make_mla_attention_config,
)
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model, DeepSeekV3TransformerBlock  # noqa: E402


class DenseFlexAttention(FlexAttention):
    """FlexAttention's contract evaluated densely (CPU reference with a backward)."""

    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None, **kwargs):  # stock's names (TP's local_map)
        q, k, v = q_BLNH, k_BLNH, v_BLNH
        batch, seq = q.shape[:2]
        if isinstance(attention_masks, BlockMask):
            mask = create_mask(attention_masks.mask_mod, batch, 1, seq, seq, device=q.device)
        elif isinstance(attention_masks, VarlenMetadata):
            mask = varlen_mask(attention_masks.cu_seq_q, batch, seq)
        else:
            raise TypeError(f"attention_masks: {type(attention_masks).__name__}")
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=scale)
        return out.transpose(1, 2)


def varlen_mask(cu_seqlens, batch: int, seq: int):
    """bool [B, 1, S, S]: causal within the documents cu_seqlens cut the packed B * S tokens into."""
    tokens = torch.arange(batch * seq)
    doc = torch.searchsorted(cu_seqlens.long(), tokens, right=True).view(batch, seq)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def rope_config(max_seq_len: int = 512, yarn: bool = True, original_seq_len: int = 64) -> ComplexRoPE.Config:
    """DeepSeek-V3's ComplexRoPE (yarn, factor 40, as TorchTitan's flavors; original_seq_len 4096 there)."""
    extra = dict(scaling="yarn", rope_factor=40.0, beta_fast=32.0, beta_slow=1.0,
                 original_seq_len=original_seq_len) if yarn else {}
    return ComplexRoPE.Config(dim=64, max_seq_len=max_seq_len, theta=10000.0, **extra)


def deepseek_v3_config(*, dim: int = 64, heads: int = 2, q_lora_rank: int = 32, kv_lora_rank: int = 32,
                       layers: int = 2, ffn: int = 64, vocab: int = 128, mscale: float = 0.7,
                       inner_attention=None, rope=None) -> DeepSeekV3Model.Config:
    """A DeepSeek-V3 model config with dense MLPs (no MoE) and the real MLA head dims."""
    blocks = []
    for i in range(layers):
        attention = make_mla_attention_config(
            layer_id=i, dim=dim, n_heads=heads, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mscale=mscale, attn_backend="flex",
            linear_init=_LINEAR_INIT, norm_init=_NORM_INIT, depth_init=_depth_init,
            rope=rope if rope is not None else rope_config())
        attention.inner_attention = inner_attention if inner_attention is not None else DenseFlexAttention.Config()
        blocks.append(DeepSeekV3TransformerBlock.Config(
            attention=attention,
            attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
            feed_forward=make_ffn_config(dim=dim, hidden_dim=ffn, w1_param_init=_LINEAR_INIT,
                                         w2w3_param_init=_depth_init(i)),
            moe=None))
    return DeepSeekV3Model.Config(
        vocab_size=vocab, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=blocks, mtp_layers=[])


def build(config, seed: int = 0):
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    return model


def causal_block_mask(batch: int, seq: int) -> BlockMask:
    return create_block_mask(get_causal_mask_mod(), batch, None, seq, seq, device="cpu")


def document_block_mask(positions, block_size: int = 128) -> BlockMask:
    """TorchTitan's causal + packed-document mask (Decoder._create_flex_attention_mask_for_document, whose
    full blocks are kept apart as create_block_mask's default does), built uncompiled on positions'
    device."""
    batch, seq = positions.shape
    mods = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions))
    return create_block_mask(mods, batch, None, seq, seq, device=positions.device, BLOCK_SIZE=block_size)


def packed_positions(batch: int, seq: int, lengths) -> torch.Tensor:
    """int64 [B, S]: positions restarting at each document of `lengths` (cycled) along every row."""
    rows = []
    for b in range(batch):
        row, i = [], b
        while len(row) < seq:
            row.extend(range(lengths[i % len(lengths)]))
            i += 1
        rows.append(row[:seq])
    return torch.tensor(rows, dtype=torch.int64)


__all__ = ["DenseFlexAttention", "VarlenAttention", "deepseek_v3_config", "build", "causal_block_mask",
           "document_block_mask", "packed_positions", "rope_config", "varlen_mask"]
