#!/usr/bin/env python
"""A DeepSeek-V3-style MLA attention block trained on a synthetic copy task through dispatch.autograd.

    python examples/mla_block.py --device cpu --steps 3                     # small config, seconds
    python examples/mla_block.py --device cuda --config deepseek --steps 50 --path mxfp8 --plot loss.png

The block (DeepSeek-V3 MLA, no residual, no KV cache):
    h_n   = RMSNorm(h)                                       attn_norm, bf16
    c_q   = h_n @ W_DQ^T                                     [T, q_lora]      bf16 GEMM
    q     = RoPE(RMSNorm(c_q) @ W_UQ^T)                      [T, H, 192]      the path's Q up-projection
    kv    = h_n @ W_DKV^T = [c_kv | k_pe]                    [T, kv_lora + 64]
    k_pe  = RoPE(k_pe)                                       one 64-feature RoPE key shared by all heads
    [k_nope | v] = RMSNorm(c_kv) @ W_UKV^T                   [T, H, 128 + 128]
    o     = causal attention(q, [k_nope | k_pe], v)          [B, S, H, 128]
    out   = o @ W_O^T                                        [T, hidden]

Paths (--path):
- mxfp8: q is `dispatch.nn.mla_q_projection`: RMSNorm(c_q) is `rmsnorm_mxfp8` (MXFP8 rowwise +
  columnwise), W_UQ's MXFP8 copies (rowwise and columnwise, straight-through gradient) are the block's
  persistent `dispatch.weights.WeightCopies`, refreshed in place after every optimizer step (and when
  made), the Q up-projection is the fused `mla_q_uproj_rope_quant` (MXFP8 q; --quantize-grad picks
  its MXFP8 backward, on by default; with it the three are one autograd node), k is
  MXFP8 along D and v along S (`mla_kv_mxfp8`: one `mla_kv_quantize` writing k from k_nope and the
  shared k_pe broadcast over the heads, the bytes of quantizing the bf16 k), and `mla_attention`
  takes MXFP8 q, k, v.
  The other GEMMs (W_DQ, W_DKV, W_UKV, W_O) stay bf16: this project provides MXFP8 kernels for the Q path and attention only.
- bf16: the same block in bf16 through the mxmla autograd ops: bf16 matmul for the Q up-projection,
  `rope` for q and k_pe, `mla_attention` with bf16 q, k, v.
- torch: a pure torch bf16 reference, nothing from mxmla: RMSNorm, matmuls, the mla-style RoPE
  written in torch, and torch.nn.functional.scaled_dot_product_attention.
All paths keep fp32 master weights (cast to bf16 each step) and use AdamW with a linear warm-up
and gradient-norm clipping at 1.

Task: tokens from a small vocabulary, embedded by a fixed random table whose rows share one offset
vector (a content-free component the block can use to find positions through RoPE). The block's
output at position t must reproduce the embedding of token t-1 (zero at t = 0), plus Gaussian label
noise (std 0.3, ~8% of the targets' power) that no model can predict: the loss plateaus at a known floor
(the noise's share of the target power, recorded per step) instead of vanishing, so comparing two
paths' final losses compares trained models rather than round-off near zero. The loss is the mean
squared error divided by the mean square of the targets, so it starts near 1. Every step draws a
fresh batch from a generator seeded by (seed, step): two runs with one seed see the same data.

Configs: small (hidden 256, H 2, q_lora 64, kv_lora 64, batch 2 x seq 32 = 64 tokens; CPU) and deepseek
(the DeepSeek-V3 attention shapes: hidden 7168, H 128, q_lora 1536, kv_lora 512, head dims 128 + 64 / 128;
batch 2 x seq 512 tokens by default). --hidden / --heads / --batch / --seq override either.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root: dispatch, spec

import dispatch  # noqa: E402
import dispatch.autograd as mxag  # noqa: E402
from dispatch.nn import mla_q_projection  # noqa: E402
from dispatch.weights import WeightCopies  # noqa: E402

NOPE_DIM, ROPE_DIM, V_DIM = 128, 64, 128
QK_DIM = NOPE_DIM + ROPE_DIM
PATHS = ("mxfp8", "bf16", "torch")


@dataclass(frozen=True)
class Config:
    hidden: int
    heads: int
    q_lora: int
    kv_lora: int
    batch: int
    seq: int
    vocab: int = 32
    label_noise: float = 0.3  # std of the Gaussian noise on the targets (embeddings have mean square ~1)
    lr: float = 3e-3
    warmup: int = 10
    clip: float = 1.0  # gradient-norm clip
    rope_theta: float = 10000.0
    eps: float = 1e-6

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


CONFIGS = {
    "small": Config(hidden=256, heads=2, q_lora=64, kv_lora=64, batch=2, seq=32),
    # DeepSeek-V3 attention (config.json of deepseek-ai/DeepSeek-V3): hidden_size 7168, 128 heads,
    # q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128.
    "deepseek": Config(hidden=7168, heads=128, q_lora=1536, kv_lora=512, batch=2, seq=512, lr=1e-4),
}


# --------------------------------------------------------------------------------------------------
# Pieces shared by the paths
# --------------------------------------------------------------------------------------------------

def rope_tables(cfg: Config, device) -> tuple:
    """fp32 cos/sin [seq, 64] in the mla layout cat([f, f]) (frequency k in both halves)."""
    inv_freq = cfg.rope_theta ** (-torch.arange(0, ROPE_DIM, 2, dtype=torch.float64) / ROPE_DIM)
    angles = torch.arange(cfg.seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def torch_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, result in x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + eps) * weight).to(x.dtype)


def torch_rope_mla(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The mla-style RoPE (SEMANTICS 4: interleaved pairs in, halves out) of the last 64 features of
    bshd x, in fp32, result in x's dtype. cos/sin [S, 64] indexed by position in the sequence."""
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    rot = x[..., -ROPE_DIM:].float()
    even, odd = rot[..., 0::2], rot[..., 1::2]
    half = ROPE_DIM // 2
    left = even * c[..., :half] - odd * s[..., :half]
    right = odd * c[..., half:] + even * s[..., half:]
    return torch.cat([x[..., :-ROPE_DIM], left.to(x.dtype), right.to(x.dtype)], dim=-1)


class MLABlock(torch.nn.Module):
    """Parameters in fp32 (master weights); `forward(h)` runs the chosen path in bf16 / MXFP8."""

    def __init__(self, cfg: Config, path: str, quantize_grad: bool = True, backend: Optional[str] = None):
        super().__init__()
        if path not in PATHS:
            raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
        self.cfg, self.path, self.quantize_grad, self.backend = cfg, path, quantize_grad, backend
        p = torch.nn.Parameter
        self.attn_norm = p(torch.ones(cfg.hidden))
        self.w_dq = p(torch.empty(cfg.q_lora, cfg.hidden))
        self.q_norm = p(torch.ones(cfg.q_lora))
        self.w_uq = p(torch.empty(cfg.heads * QK_DIM, cfg.q_lora))
        self.w_dkv = p(torch.empty(cfg.kv_lora + ROPE_DIM, cfg.hidden))
        self.kv_norm = p(torch.ones(cfg.kv_lora))
        self.w_ukv = p(torch.empty(cfg.heads * (NOPE_DIM + V_DIM), cfg.kv_lora))
        self.w_o = p(torch.empty(cfg.hidden, cfg.heads * V_DIM))
        # W_UQ's MXFP8 copies: buffers a compiled forward reads as they are (refreshed outside it)
        self.uq_copies = WeightCopies(self.w_uq.shape, backend=backend) if path == "mxfp8" else None

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> "MLABlock":
        """Deterministic init on the CPU (same values on every device): N(0, 1/fan_in) weights, W_O
        scaled by 1/2, norms at 1."""
        gen = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm"):
                param.fill_(1.0)
                continue
            std = (0.5 if name == "w_o" else 1.0) / math.sqrt(param.shape[1])
            param.copy_(torch.randn(param.shape, generator=gen) * std)
        self.requantize_weights()
        return self

    def requantize_weights(self) -> None:
        """Make the mxfp8 path's weight copies now (after a weight update), so the next forward reuses
        them; training loops register `refresh_after` instead (see train)."""
        if self.uq_copies is not None:
            self.uq_copies.refresh(self.w_uq)

    def refresh_after(self, optimizer) -> None:
        """Refresh the mxfp8 path's weight copies after every step of `optimizer`."""
        if self.uq_copies is not None:
            self.uq_copies.refresh_after(optimizer, self.w_uq)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if self.uq_copies is not None and self.w_uq.device == self.uq_copies.row_codes.device:
            self.requantize_weights()  # .to(): the copies follow the weight (its bf16 values may change)
        return out

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg, bf16 = self.cfg, torch.bfloat16
        b, s = cfg.batch, cfg.seq
        hn = torch_rmsnorm(h.to(bf16), self.attn_norm, cfg.eps)                          # [T, hidden]
        c_q = hn @ self.w_dq.to(bf16).T                                                  # [T, q_lora]
        kv = hn @ self.w_dkv.to(bf16).T                                                  # [T, kv_lora+64]
        c_kv, k_pe = kv[:, :cfg.kv_lora], kv[:, cfg.kv_lora:].reshape(b, s, 1, ROPE_DIM)
        kv_up = (torch_rmsnorm(c_kv, self.kv_norm, cfg.eps) @ self.w_ukv.to(bf16).T)
        kv_up = kv_up.view(b, s, cfg.heads, NOPE_DIM + V_DIM)
        k_nope, v = kv_up[..., :NOPE_DIM], kv_up[..., NOPE_DIM:]

        # Launch order: each path's q first, then the shared k_pe's RoPE and k (one op on the mxfp8
        # path). The q path's mxmla ops cost more host time than GPU time; launched while the GPU still
        # runs the kv GEMMs above, and with the small k_pe RoPE after the (GPU-heavy) q projection, the
        # GPU waits less for the host. Every path keeps this order so the paths compare like with like.
        if self.path == "torch":
            q = (torch_rmsnorm(c_q, self.q_norm, cfg.eps) @ self.w_uq.to(bf16).T).view(b, s, cfg.heads, QK_DIM)
            q = torch_rope_mla(q, cos, sin)
            k_pe = torch_rope_mla(k_pe, cos, sin)
            k = torch.cat([k_nope, k_pe.expand(b, s, cfg.heads, ROPE_DIM)], dim=-1)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, scale=1.0 / math.sqrt(QK_DIM)).transpose(1, 2)
        elif self.path == "bf16":
            q = (torch_rmsnorm(c_q, self.q_norm, cfg.eps) @ self.w_uq.to(bf16).T).view(b, s, cfg.heads, QK_DIM)
            q = mxag.rope(q, cos, sin, layout="bshd", backend=self.backend)
            k_pe = mxag.rope(k_pe, cos, sin, layout="bshd", backend=self.backend)
            k = torch.cat([k_nope, k_pe.expand(b, s, cfg.heads, ROPE_DIM)], dim=-1)
            o, _ = mxag.mla_attention(q, k, v, causal=True, layout="bshd", backend=self.backend)
        else:
            # RMSNorm to MXFP8, W_UQ's copies (made once per optimizer step) and the fused up-projection
            # + RoPE + quantize: one autograd node for plain tensors (host time). cos / sin [S, 64] are
            # the per-token rows of one sequence, broadcast over the batch
            q = mla_q_projection(c_q.view(b, s, cfg.q_lora), self.w_uq, cos, sin, norm_weight=self.q_norm,
                                 eps=cfg.eps, quantize_grad=self.quantize_grad, backend=self.backend,
                                 weight_copies=self.uq_copies)
            # k = [k_nope | rope(k_pe)] along D and v along S, from k_nope and v (slices of kv_up, read
            # in place) and the one shared k_pe, rotated in the same op: byte-equal to rope, then
            # quantizing the bf16 concatenation, which is never written
            k, v = mxag.mla_kv_mxfp8(k_nope, k_pe, v, layout="bshd", cos=cos, sin=sin, backend=self.backend)
            o, _ = mxag.mla_attention(q, k, v, causal=True, layout="bshd", backend=self.backend)
        return o.reshape(cfg.tokens, cfg.heads * V_DIM) @ self.w_o.to(bf16).T           # [T, hidden]


# --------------------------------------------------------------------------------------------------
# Task and training loop
# --------------------------------------------------------------------------------------------------

class CopyTask:
    """Embeddings of random tokens; the target at position t is the embedding of token t-1."""

    def __init__(self, cfg: Config, seed: int, device):
        gen = torch.Generator().manual_seed(seed + 1)
        offset = torch.randn(cfg.hidden, generator=gen) * 0.6
        self.table = (torch.randn(cfg.vocab, cfg.hidden, generator=gen) * 0.8 + offset).to(device)
        self.cfg, self.seed, self.device = cfg, seed, device

    def batch(self, step: int):
        cfg = self.cfg
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), generator=gen).to(self.device)
        h = self.table[tokens]                                          # [B, S, hidden]
        target = torch.zeros_like(h)
        target[:, 1:] = h[:, :-1]
        noise = (torch.randn(h.shape, generator=gen) * cfg.label_noise).to(self.device)
        target = target + noise
        self.last_floor = float(noise.square().mean() / target.square().mean())  # loss of the ideal model
        return h.reshape(cfg.tokens, cfg.hidden), target.reshape(cfg.tokens, cfg.hidden)


def normalized_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target).square().mean() / target.square().mean()


@contextlib.contextmanager
def recording_backends(table: Dict[str, str]):
    """Record which backend dispatch chooses for each op run inside the block."""
    real_run = dispatch.run

    def run(op, *args, backend=None, **kwargs):
        if op not in table:
            table[op] = dispatch.select(op, *args, backend=backend, **kwargs)
        return real_run(op, *args, backend=backend, **kwargs)

    dispatch.run = run
    try:
        yield table
    finally:
        dispatch.run = real_run


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def train(cfg: Config, path: str, steps: int, device="cpu", seed: int = 0, quantize_grad: bool = True,
          backend: Optional[str] = None, max_seconds: Optional[float] = None, log=print) -> dict:
    """Train one block from the seed's init on the seed's data; returns losses, step times, backends."""
    model = MLABlock(cfg, path, quantize_grad, backend).reset_parameters(seed).to(device)
    task = CopyTask(cfg, seed, device)
    cos, sin = rope_tables(cfg, device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / max(1, cfg.warmup)))
    model.refresh_after(opt)  # mxfp8: the projection weight's MXFP8 copies made in each optimizer step
    losses: List[float] = []
    floors: List[float] = []
    times: List[float] = []
    backends: Dict[str, str] = {}
    start = time.perf_counter()
    for step in range(steps):
        h, target = task.batch(step)
        floors.append(task.last_floor)
        t0 = time.perf_counter()
        with recording_backends(backends) if step == 0 else contextlib.nullcontext():
            loss = normalized_mse(model(h, cos, sin), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        sched.step()
        value = loss.detach().item()  # synchronises: the step's time below is wall time of the whole step
        times.append(time.perf_counter() - t0)
        losses.append(value)
        log(f"[{path}] step {step + 1:4d}  loss {value:.6f}  ({times[-1] * 1e3:.1f} ms)")
        if not math.isfinite(value):
            log(f"[{path}] non-finite loss, stopping")
            break
        if max_seconds is not None and time.perf_counter() - start > max_seconds and step + 1 < steps:
            log(f"[{path}] time budget of {max_seconds:.0f} s spent after {step + 1} steps, stopping")
            break
    _sync(device)
    return {"path": path, "losses": losses, "loss_floor": floors[:len(losses)], "step_seconds": times, "backends": backends,
            "quantize_grad": quantize_grad if path == "mxfp8" else None}


# --------------------------------------------------------------------------------------------------
# Plotting
# --------------------------------------------------------------------------------------------------

PLOT_SKIPPED = "not drawn: matplotlib is not installed (pip install matplotlib, or the package's [plot] extra)"


def plot_losses(curves: Dict[str, List[float]], png_path: str, title: str) -> str:
    """Loss curves into a PNG through matplotlib. Returns "matplotlib" when drawn; without matplotlib
    nothing is written and the returned text says why."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return PLOT_SKIPPED
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name, values in curves.items():
        ax.plot(range(1, len(values) + 1), values, label=name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (normalized MSE)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return "matplotlib"


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------

def config_from_args(args) -> Config:
    cfg = CONFIGS[args.config]
    overrides = {k: getattr(args, k) for k in ("hidden", "heads", "batch", "seq", "lr") if getattr(args, k) is not None}
    return replace(cfg, **overrides)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--hidden", type=int, help="override the config's hidden size")
    parser.add_argument("--heads", type=int, help="override the config's head count")
    parser.add_argument("--batch", type=int, help="override the config's batch (sequences per step)")
    parser.add_argument("--seq", type=int, help="override the config's sequence length (a multiple of 32)")
    parser.add_argument("--lr", type=float, help="override the config's learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-quantize-grad", dest="quantize_grad", action="store_false",
                        help="mxfp8 path: 16-bit backward of the fused Q up-projection (default: MXFP8 backward)")
    parser.add_argument("--backend", default=None,
                        help="backend for every mxmla op (default: MXMLA_BACKEND or the automatic choice)")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop a run early after this much time")
    parser.add_argument("--json", dest="json_path", help="write losses, times and chosen backends here")
    parser.add_argument("--plot", dest="plot_path", help="write the loss curve(s) to this PNG")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", choices=PATHS, default="mxfp8")
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    torch.manual_seed(args.seed)
    print(f"config {args.config}: {asdict(cfg)}; path {args.path}; device {args.device}")
    result = train(cfg, args.path, args.steps, args.device, args.seed, args.quantize_grad, args.backend,
                   args.max_seconds)
    print(f"backends: {result['backends'] or 'none (pure torch)'}")
    result.update(config=asdict(cfg), config_name=args.config, device=str(args.device))
    if args.plot_path:
        result["plot"] = plot_losses({args.path: result["losses"]}, args.plot_path,
                                     f"MLA block, {args.config} config, {args.path}")
        print(f"plot: {args.plot_path} ({result['plot']})")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=1)
    print(f"final loss {result['losses'][-1]:.6f} after {len(result['losses'])} steps")
    return 0 if result["losses"] and math.isfinite(result["losses"][-1]) else 1


if __name__ == "__main__":
    sys.exit(main())
