"""One small call of each Triton kernel, for `compute-sanitizer --tool memcheck` (tools/gpu_run.sh).

Shapes are small but not tile multiples, so masked edges are exercised. Prints one line per case.
"""
from __future__ import annotations

import sys
import traceback

import torch

import dispatch


def cases():
    dev = "cuda"
    g = torch.Generator(device="cpu").manual_seed(1)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype).to(dev)

    yield "mxfp8_quantize rowwise+columnwise", lambda: dispatch.run(
        "mxfp8_quantize", randn(160, 96), axis=(-1, 0), backend="triton")
    yield "mxfp8_quantize swizzled", lambda: dispatch.run(
        "mxfp8_quantize", randn(160, 96), axis=-1, scale_layout="swizzled", backend="triton")
    T, H = 96, 3
    cos, sin = randn(T, 64, dtype=torch.float32), randn(T, 64, dtype=torch.float32)
    yield "rope thd", lambda: dispatch.run("rope", randn(T, H, 192), cos, sin, layout="thd", backend="triton")
    yield "rope_backward thd", lambda: dispatch.run(
        "rope_backward", randn(T, H, 192), cos, sin, layout="thd", backend="triton")
    yield "mla_q_uproj_rope_quant", lambda: dispatch.run(
        "mla_q_uproj_rope_quant", randn(T, 256), randn(H * 192, 256), cos, sin, backend="triton")
    from backends.triton import mla_q as triton_mla_q

    x128, w128 = randn(128, 256), randn(H * 192, 256)
    cos128, sin128 = randn(128, 64, dtype=torch.float32), randn(128, 64, dtype=torch.float32)
    if not triton_mla_q.gluon_reasons(x128, w128):
        yield "mla_q_uproj_rope_quant (Gluon warp-specialized)", lambda: triton_mla_q.mla_q_forward_launch(
            x128, w128, cos128, sin128, variant="gluon_ws")
        yield "mla_q_uproj_rope_quant (Gluon warp-specialized, 128-token tiles)", \
            lambda: triton_mla_q.mla_q_forward_launch(x128, w128, cos128, sin128, variant="gluon_ws128")
    q, k, v = randn(1, 80, 2, 192), randn(1, 80, 2, 192), randn(1, 80, 2, 128)
    yield "mla_attention causal", lambda: dispatch.run("mla_attention", q, k, v, causal=True, backend="triton")
    q2, k2, v2 = randn(1, 256, 2, 192), randn(1, 256, 2, 192), randn(1, 256, 2, 128)  # whole key blocks (EVEN_KV)
    yield "mla_attention causal, S = 256", lambda: dispatch.run("mla_attention", q2, k2, v2, causal=True,
                                                                backend="triton")

    def attn_bwd():
        o, lse = dispatch.run("mla_attention", q, k, v, causal=True, backend="triton")
        return dispatch.run("mla_attention_backward", randn(1, 80, 2, 128), q, k, v, o, lse, causal=True,
                            backend="triton")

    yield "mla_attention_backward causal", attn_bwd
    quant = dict(backend="triton")
    q_mx = dispatch.run("mxfp8_quantize", randn(1, 64, 2, 192), axis=-1, **quant)
    k_mx = dispatch.run("mxfp8_quantize", randn(1, 64, 2, 192), axis=-1, **quant)
    v_mx = dispatch.run("mxfp8_quantize", randn(1, 64, 2, 128), axis=1, **quant)  # v blocked along S
    yield "mla_attention MXFP8 (pre-dequantized q, k, v)", lambda: dispatch.run(
        "mla_attention", q_mx, k_mx, v_mx, causal=True, backend="triton")
    a_mx = dispatch.run("mxfp8_quantize", randn(96, 160), axis=-1, **quant)
    b_mx = dispatch.run("mxfp8_quantize", randn(72, 160), axis=-1, **quant)
    from backends.triton import gemm as triton_gemm

    nan_scale = b_mx.scale.clone()
    nan_scale[3, 1] = 255
    b_nan = b_mx.replace(scale=nan_scale)
    routes = ["bf16"] + (["gluon"] if not triton_gemm.gluon_reasons(a_mx, b_mx) else [])
    for route in routes:  # K = 160: an odd step count and a K tail; N = 72: a partial b tile
        yield f"mxfp8_gemm ({route} route)", lambda r=route: triton_gemm.mxfp8_gemm_tensors(
            a_mx, b_mx, torch.empty(96, 72, dtype=torch.bfloat16, device=dev), variant=r)
        yield f"mxfp8_gemm ({route} route, guard raised: exact fallback)", lambda r=route: \
            triton_gemm.mxfp8_gemm_tensors(a_mx, b_nan, torch.empty(96, 72, dtype=torch.bfloat16, device=dev),
                                           variant=r)
    yield "rmsnorm_mxfp8", lambda: dispatch.run(
        "rmsnorm_mxfp8", randn(96, 256), randn(256, dtype=torch.float32), backend="triton")


def main() -> int:
    failed = 0
    for name, fn in cases():
        try:
            fn()
            torch.cuda.synchronize()
            print(f"ran   {name}")
        except dispatch.BackendUnavailable as exc:
            print(f"skip  {name}: {str(exc).splitlines()[-1].strip()}")
        except Exception:  # noqa: BLE001 - report every case
            failed += 1
            print(f"FAIL  {name}")
            traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
