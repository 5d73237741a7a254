#!/usr/bin/env bash
# GPU call for the open performance questions (BENCHMARKS.md, 2026-11-30):
#   1. the fused MLA Q forward's time by epilogue part and autotune config (tools/profile_cases.py mla_q_parts);
#   2. Nsight Compute on one autotuned fused MLA Q launch per token count (speed of light, warp stalls,
#      occupancy; NVTX-filtered so the autotuner's own launches are not the ones profiled);
#   3. host time of a Triton quantize call at small T (cProfile by frame, host vs GPU per call).
#   PROFILE="parts ncu host" bash tools/gpu_profile.sh      # outputs under $OUT (or ./gpu_out)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PROFILE=${PROFILE:-parts ncu host}

for what in $PROFILE; do
  case $what in
  parts)
    echo "== fused MLA Q forward by epilogue part"
    timeout "${PARTS_CAP:-200}" python3 tools/profile_cases.py mla_q_parts --tokens "${PARTS_TOKENS:-4096,16384}" 2>&1 \
      | tee "$OUT/mla_q_parts.txt" | grep -v Warning
    ;;
  ncu)
    if ! command -v ncu >/dev/null; then echo "ncu not found on this machine"; continue; fi
    for t in ${NCU_TOKENS:-4096 16384}; do
      echo "== ncu: one autotuned fused MLA Q launch, T=$t"
      timeout "${NCU_CAP:-150}" ncu --nvtx --nvtx-include "mla_q_profile/" --kernel-name regex:_mla_q_fwd --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
        --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis \
        python3 tools/profile_cases.py mla_q --tokens "$t" > "$OUT/ncu_mla_q_$t.txt" 2>&1
      grep -E "Duration|Throughput|Registers|Shared Memory Config|Achieved Occupancy|Theoretical Occupancy|Block Limit|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Stall|One or More|Grid Size|Block Size|Pipe" "$OUT/ncu_mla_q_$t.txt" | head -45
    done
    ;;
  host)
    for t in 1024 8192; do
      echo "== host time of Triton quantize, T=$t"
      timeout 120 python3 tools/profile_cases.py host --tokens "$t" 2>&1 | tee "$OUT/host_quantize_$t.txt" | head -30
    done
    ;;
  *) echo "unknown profile step $what"; exit 2 ;;
  esac
done
