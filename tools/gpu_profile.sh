#!/usr/bin/env bash
# The next GPU session's first call for the open performance questions (BENCHMARKS.md, 2026-11-30):
#   1. host time of a Triton quantize call at small T (cProfile by frame, host vs GPU per call);
#   2. Nsight Compute on one fused MLA Q launch at T = 4096 (speed of light, warp stalls, occupancy).
#   bash tools/gpu_profile.sh         # outputs under $OUT (or ./gpu_out); ~2-3 minutes on an H200
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== host time of Triton quantize, T=1024 and 8192"
for t in 1024 8192; do
  timeout 120 python3 tools/profile_cases.py host --tokens "$t" 2>&1 | tee "$OUT/host_quantize_$t.txt" | head -40
done

echo "== ncu: one fused MLA Q launch, T=4096"
if command -v ncu >/dev/null; then
  timeout 240 ncu --kernel-name regex:_mla_q_fwd --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
    --section LaunchStats python3 tools/profile_cases.py mla_q --tokens 4096 2>&1 | tee "$OUT/ncu_mla_q.txt" | tail -80
else
  echo "ncu not found on this machine"
fi
