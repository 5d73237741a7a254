#!/usr/bin/env bash
# Nsight Compute on the Gluon fused MLA Q forward at K = 64 (the main loop is one step, so the launch is
# its epilogue): stall reasons and the SASS lines that collect the stall samples.
#   OUT=dir NCU_K=64 bash tools/ncu_gluon_epilogue.sh [plain|ws|ws128]     (NCU_K: the GEMM depth)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
which=${1:-plain}
cat > /tmp/ncu_gluon_case.py <<PY
import torch
from backends.triton import mla_q_gluon as qg
t, k, h = 16384, ${NCU_K:-64}, 128
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(t, k, device="cuda", generator=g).to(torch.bfloat16)
w = (torch.randn(h * 192, k, device="cuda", generator=g) / 40).to(torch.bfloat16)
a = torch.rand(t, 64, device="cuda", generator=g)
cos, sin = torch.cos(a), torch.sin(a)
outs = (torch.empty(t, h, 192, dtype=torch.uint8, device="cuda"), torch.empty(t, h, 6, dtype=torch.uint8, device="cuda"),
        torch.empty(t, h, 192, dtype=torch.uint8, device="cuda"), torch.empty(t // 32, h, 192, dtype=torch.uint8, device="cuda"))
for _ in range(3):
    qg.launch(x, w, cos, sin, *outs, kind="$which")
torch.cuda.synchronize()
PY
timeout 240 ncu --kernel-name regex:gluon --launch-skip 2 --launch-count 1 --section WarpStateStats --section SourceCounters \
  --section SpeedOfLight --section Occupancy -f -o "$OUT/gluon_${which}_k${NCU_K:-64}" python3 /tmp/ncu_gluon_case.py > "$OUT/ncu_run_$which.txt" 2>&1
tail -3 "$OUT/ncu_run_$which.txt"
ncu -i "$OUT/gluon_${which}_k${NCU_K:-64}.ncu-rep" --print-summary none > "$OUT/ncu_gluon_${which}_k${NCU_K:-64}.txt" 2>&1
grep -E "Duration|Stall|Warp Cycles|Issue|Occupancy|Eligible|Registers" "$OUT/ncu_gluon_${which}_k${NCU_K:-64}.txt" | head -40
ncu -i "$OUT/gluon_${which}_k${NCU_K:-64}.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_${which}_k${NCU_K:-64}.csv" 2>/dev/null
python3 tools/ncu_sass_top.py "$OUT/sass_${which}_k${NCU_K:-64}.csv" 30
