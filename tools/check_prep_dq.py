"""Debug: the backward pre-pass's dequantized outputs and guard against the torch quantizer, on CUDA."""
import torch, sys
import backends; backends.load()
import backends.triton.mla_q as m
from backends.torch.quantize import mxfp8_quantize, mxfp8_dequantize
torch.manual_seed(0)
dev = "cuda"
def ref_dq(v32, axis):
    q = mxfp8_quantize(v32, axis=axis)
    return mxfp8_dequantize(q, out_dtype="bfloat16")
for (R, C, rope, tag) in [(256, 384, False, "plain"), (64, 64, False, "x-like"), (256, 384, True, "rope"), (4096, 24576, True, "ds")]:
    src = torch.randn(R, C, device=dev).to(torch.bfloat16)
    for mode in ("row", "col", "both"):
        flag = torch.zeros(1, dtype=torch.int32, device=dev)
        cos = torch.rand(R, 64, device=dev); sin = torch.rand(R, 64, device=dev)
        r16, c16 = m._prep_launch(src, cos if rope else None, sin if rope else None, rope=rope, row_dq=mode != "col", col_dq=mode != "row", flag=flag)
        torch.cuda.synchronize()
        msg = [f"{tag} R{R} C{C} {mode}: flag {int(flag.item())}"]
        if not rope:
            v32 = src.float()
            if r16 is not None:
                want = ref_dq(v32, 1); msg.append(f"row diff {(r16.view(torch.int16) != want.view(torch.int16)).sum().item()}")
            if c16 is not None:
                want = ref_dq(v32, 0); msg.append(f"col diff {(c16.view(torch.int16) != want.view(torch.int16)).sum().item()}")
        print("; ".join(msg), flush=True)
# the codes path for comparison
src = torch.randn(256, 384, device=dev).to(torch.bfloat16)
_, (rc, rs), (ct, cs) = m._prep_launch(src, row_q=True, col_q=True)
q = mxfp8_quantize(src.float(), axis=(1, 0))
print("codes row diff", (rc.view(torch.uint8) != q[0].data.view(torch.uint8)).sum().item(), "col diff", (ct.t().view(torch.uint8) != q[1].data.view(torch.uint8)).sum().item())
# the MXFP8 forward's pieces, timed
import triton.testing as tt
from backends.triton.quantize import dequantize_bf16_flat
from backends.triton.gemm import BF16_SAFE_SCALE_BYTES
T, K, H = 4096, 1536, 128
x = torch.randn(T, K, device=dev).to(torch.bfloat16); w = (torch.randn(H * 192, K, device=dev) * 0.02).to(torch.bfloat16)
xm = mxfp8_quantize(x, axis=1); wm = mxfp8_quantize(w, axis=1)
flag = torch.zeros(1, dtype=torch.int32, device=dev)
g = (flag, *BF16_SAFE_SCALE_BYTES["e4m3"])
print("x scale layout", xm.scale_layout, "dq x ms", tt.do_bench(lambda: dequantize_bf16_flat(xm, guard=g)), "dq w ms", tt.do_bench(lambda: dequantize_bf16_flat(wm, guard=g)), "flag", int(flag.item()))
cos = torch.rand(T, 64, device=dev); sin = torch.rand(T, 64, device=dev)
print("fwd mx ms", tt.do_bench(lambda: m.mla_q_forward_launch(xm, wm, cos, sin)), "fwd bf16 ms", tt.do_bench(lambda: m.mla_q_forward_launch(x, w, cos, sin)), "gemm", tt.do_bench(lambda: x @ w.t()))
dq = torch.randn(T, H, 192, device=dev).to(torch.bfloat16)
flag.zero_()
r16, c16 = m._prep_launch(dq.view(T, -1), cos, sin, rope=True, row_dq=True, col_dq=True, flag=flag)
torch.cuda.synchronize(); print("ds prep flag", int(flag.item()))
