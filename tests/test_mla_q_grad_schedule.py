"""The fused MXFP8 backward's work schedule (backends/triton/mla_q_grad_gluon.schedule): every dx and dw
tile exactly once, longest items first, and the programs' k-step loads within one short item of each
other; launch configs checked (host code; no GPU)."""
from __future__ import annotations

import pytest

pytest.importorskip("triton.experimental.gluon")
G = pytest.importorskip("backends.triton.mla_q_grad_gluon")


@pytest.mark.parametrize("n_dx,dx_steps,n_dw,dw_steps,programs", [
    (192, 384, 1152, 64, 132),   # DeepSeek-V3, T = 4096: dx alone would be 1.45 waves
    (768, 384, 1152, 256, 132),  # T = 16384
    (6, 9, 18, 2, 132),          # fewer items than programs
    (0, 4, 10, 2, 4),            # dw only
    (10, 4, 0, 2, 4),            # dx only
])
def test_schedule_covers_every_item_once_and_balances(n_dx, dx_steps, n_dw, dw_steps, programs):
    sched = G.schedule(n_dx, dx_steps, n_dw, dw_steps, programs, "cpu").tolist()
    assert len(sched) == programs
    seen = []
    loads = []
    for row in sched:
        count, items = row[0], row[1:1 + row[0]]
        assert all(v == 0 for v in row[1 + count:])
        seen += items
        loads.append(sum(dx_steps if i < n_dx else dw_steps for i in items))
        steps = [dx_steps if i < n_dx else dw_steps for i in items]
        assert steps == sorted(steps, reverse=True), "a program takes its longest items first"
    assert sorted(seen) == list(range(n_dx + n_dw))
    busy = [ld for ld in loads if ld]
    shortest = min(dw_steps if n_dw else dx_steps, dx_steps if n_dx else dw_steps)
    if n_dx + n_dw >= programs:
        assert max(busy) - min(busy) <= max(dx_steps if n_dx else 0, dw_steps if n_dw else 0)
        if n_dw * dw_steps >= programs * dx_steps:  # enough short items to level the long ones
            assert max(busy) - min(busy) <= shortest


def test_schedule_is_cached_per_shape():
    a = G.schedule(12, 6, 30, 2, 8, "cpu")
    assert G.schedule(12, 6, 30, 2, 8, "cpu") is a


def test_named_fused_route_raises_on_the_cpu_never_downgrades():
    # the fused backward's kernels need an sm90 GPU: naming the route on the CPU raises with its reason
    # (no other route runs in its place), and the automatic choice stays on "dequantized". Under the
    # interpreter the reason is the route's; on a CUDA machine without it the backend refuses CPU
    # inputs first.
    import numpy as np
    import torch

    import dispatch
    from backends.settings import interpret_mode

    rng = np.random.default_rng(3)
    tokens, heads, k = 32, 1, 32
    dq = torch.from_numpy(rng.standard_normal((tokens, heads, 192))).to(torch.bfloat16)
    x = torch.from_numpy(rng.standard_normal((tokens, k))).to(torch.bfloat16)
    w = torch.from_numpy(rng.standard_normal((heads * 192, k))).to(torch.bfloat16)
    cos = torch.ones(tokens, 64)
    sin = torch.zeros(tokens, 64)
    reason = "the fused backward's Gluon kernels run on CUDA" if interpret_mode() else "inputs are on the CPU"
    with pytest.raises(dispatch.BackendUnavailable, match=f"triton:fused: {reason}"):
        dispatch.run("mla_q_uproj_rope_quant_backward", dq, x, w, cos, sin, quantize_grad=True, backend="triton:fused")
    if not interpret_mode():
        return  # the variant table below is the interpreter's
    rows = dispatch.explain("mla_q_uproj_rope_quant_backward", dq, x, w, cos, sin, quantize_grad=True,
                            backend="triton", print_table=False)
    triton_row = next(r for r in rows if r["backend"] == "triton")
    assert "fused" in [v["variant"] for v in triton_row["variants"]]
    assert [v["variant"] for v in triton_row["variants"] if v["chosen"]] == ["dequantized"]


@pytest.mark.parametrize("config", [dict(STAGES=3, SS=1), dict(PROFILE=1), dict(STAGES=3, BITZ=0)])
def test_launch_refuses_unknown_or_missing_config_keys(config):
    # a launch config key the kernel does not take is an error, not ignored (raised before any launch)
    import torch

    g2 = torch.zeros(64, 192, dtype=torch.bfloat16)
    other = torch.zeros(32, 192, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="config: expected STAGES"):
        G.launch(G.FORM_DX, g2, other, torch.ones(64, 64), torch.zeros(64, 64), torch.empty(64, 32, dtype=torch.bfloat16),
                 torch.zeros(1, dtype=torch.int32), (10, 246), config=config)
