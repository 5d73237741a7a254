set -u
timeout 150 python -m pytest -q -x tests/conformance/test_gemm_triton.py -k "gluon_route_guard" --tb=short 2>&1 | grep -E "Error|assert|passed|failed" | head -12
ncu --kernel-name regex:_mxfp8_gemm_gluon --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters -o $OUT/gg python tools/profile_cases.py gemm_gluon_launch > $OUT/ncu_log.txt 2>&1
ncu -i $OUT/gg.ncu-rep > $OUT/gg_details.txt 2>&1
grep -E "Duration|SM Frequency|Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Stall|Pipe|Issued Warp|Eligible Warps|Active Warps" $OUT/gg_details.txt | head -40
ncu -i $OUT/gg.ncu-rep --page source --csv --print-source sass > $OUT/gg_sass.csv 2>/dev/null
python tools/ncu_sass_top.py $OUT/gg_sass.csv 25 2>&1 | head -45
