#!/usr/bin/env bash
# The MXFP8 training path on one GPU in one call: the CUDA tests of the ops the block runs, then
# bench_mla_q --mx (op level, in turns with cuBLAS) and bench_block (the block, in turns), a table last.
#   tools/gpu_block.sh [phases...]   phases: test mla_q block first lines pretune record cacheprobe host hf parallel
#   (default: test mla_q block)
# Knobs: BLOCK_ARGS (default --quick), LINES_ARGS, TEST_CAP, MLAQ_CAP, BLOCK_CAP, FIRST_CAP, LINES_CAP, PROBE_CAP, HOST_CAP,
# HF_CAP, PAR_CAP
# (seconds each, SIGINT at the cap), HF_ARGS (default --train 200). hf needs the wheels in .whl_hf carried.
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/gpu_env.sh
COMMIT=${MXMLA_COMMIT:-unknown}
echo "commit $COMMIT  date $(date -u +%F)  $(nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader)"
summary=()
for phase in ${*:-test mla_q block}; do
  start=$SECONDS
  case $phase in
  test)
    export OMP_NUM_THREADS=2
    # each folder's files together: pytest 9.1 loses tests/conformance/conftest.py's fixtures for a
    # conformance file listed after a file of tests/ that follows another conformance file
    timeout -s INT "${TEST_CAP:-180}" python3 -m pytest tests/conformance/test_mla_q_triton_routes.py \
      tests/conformance/test_mla_q_triton.py tests/conformance/test_mla_q.py tests/conformance/test_attention.py \
      tests/conformance/test_gemm_triton.py tests/conformance/test_deepseek_v3_cuda.py tests/conformance/test_quantize_triton.py \
      tests/conformance/test_attention_cudnn.py tests/conformance/test_mla_kv.py \
      tests/test_autograd_cuda.py tests/test_mx_concat.py tests/test_mla_kv.py tests/test_fast_launch.py \
      tests/test_cudnn_plan_cache.py tests/test_nn.py -k "cuda" -n 8 -q -p no:cacheprovider -rfE \
      > "$OUT/tests_$COMMIT.log" 2>&1
    rc=$?
    grep -E "^(FAILED|ERROR)" "$OUT/tests_$COMMIT.log" | head -20
    summary+=("tests rc=$rc $((SECONDS-start)) s: $(tail -1 "$OUT/tests_$COMMIT.log")")
    ;;
  mla_q)
    timeout -s INT "${MLAQ_CAP:-150}" python3 benchmarks/bench_mla_q.py --quick --mx --no-compile \
      --json "$OUT/mla_q_$COMMIT.json" > "$OUT/mla_q_$COMMIT.log" 2>&1
    summary+=("bench_mla_q rc=$? $((SECONDS-start)) s")
    grep -E "^(fwd-mx|bwd-mx|bwd-prep|fwd ).*(in turns|prep)" "$OUT/mla_q_$COMMIT.log" | cut -c1-200
    ;;
  block)
    timeout -s INT "${BLOCK_CAP:-240}" python3 benchmarks/bench_block.py ${BLOCK_ARGS:---quick} \
      --json "$OUT/block_$COMMIT.json" > "$OUT/block_$COMMIT.log" 2>&1
    summary+=("bench_block rc=$? $((SECONDS-start)) s")
    ;;
  first)
    timeout -s INT "${FIRST_CAP:-300}" python3 benchmarks/bench_block.py --quick --first-step --no-profile \
      --steps 1 --rounds 1 ${FIRST_ARGS:-} --json "$OUT/first${FIRST_TAG:-}_$COMMIT.json" \
      > "$OUT/first${FIRST_TAG:-}_$COMMIT.log" 2>&1
    summary+=("first steps${FIRST_TAG:-} rc=$? $((SECONDS-start)) s")
    tail -8 "$OUT/first${FIRST_TAG:-}_$COMMIT.log"
    ;;
  lines)
    # per line of the block's forward: host time to issue it and how far the GPU had got
    timeout -s INT "${LINES_CAP:-90}" python3 tools/forward_lines.py ${LINES_ARGS:---paths mxfp8,bf16,torch} \
      > "$OUT/lines_$COMMIT.log" 2>&1
    summary+=("forward_lines rc=$? $((SECONDS-start)) s")
    tail -60 "$OUT/lines_$COMMIT.log"
    ;;
  pretune)
    # record the autotuners' choices for the block's shapes (full autotuning), into the tree the later
    # phases run from and into $OUT (to compare with the heuristic tiles, or commit where they lose)
    MXMLA_TRITON_AUTOTUNE=1 MXMLA_TRITON_PRETUNED=0 timeout -s INT "${PRETUNE_CAP:-240}" python3 tools/record_pretuned.py \
      --what pretuned ${PRETUNE_ARGS:-} > "$OUT/pretune_$COMMIT.log" 2>&1
    summary+=("record_pretuned rc=$? $((SECONDS-start)) s")
    mkdir -p "$OUT/pretuned" && cp backends/triton/pretuned/*.json "$OUT/pretuned/" 2>/dev/null
    tail -20 "$OUT/pretune_$COMMIT.log"
    ;;
  record)
    # the block's launches per workload, for compile_ahead (heuristic tiles), into the tree
    # the later phases run from and into $OUT (to commit)
    timeout -s INT "${RECORD_CAP:-200}" python3 tools/record_pretuned.py --what compile ${RECORD_ARGS:-} \
      > "$OUT/record_$COMMIT.log" 2>&1
    summary+=("record compile lists rc=$? $((SECONDS-start)) s")
    mkdir -p "$OUT/pretuned" && cp backends/triton/pretuned/*.compile.json "$OUT/pretuned/" 2>/dev/null
    tail -8 "$OUT/record_$COMMIT.log"
    ;;
  cacheprobe)
    # cache keys a later process computes anew (a kernel compiled again), and the part of the key that differed
    timeout -s INT "${PROBE_CAP:-240}" python3 tools/triton_cache_probe.py > "$OUT/cache_probe_$COMMIT.log" 2>&1
    summary+=("cache probe rc=$? $((SECONDS-start)) s")
    tail -30 "$OUT/cache_probe_$COMMIT.log"
    ;;
  host)
    # where the MXFP8 forward's host time goes: each op's issue cost, then cProfile of one block forward
    timeout -s INT "${HOST_CAP:-120}" python3 tools/host_costs.py > "$OUT/host_costs_$COMMIT.log" 2>&1
    timeout -s INT "${HOST_CAP:-120}" python3 tools/profile_block_ops.py --cprofile > "$OUT/host_ops_$COMMIT.log" 2>&1
    timeout -s INT "${HOST_CAP:-120}" python3 benchmarks/bench_block.py --quick --paths mxfp8,bf16 --steps 3 --rounds 1 \
      --no-profile --host-profile --json "$OUT/host_$COMMIT.json" > "$OUT/host_$COMMIT.log" 2>&1
    summary+=("host profile rc=$? $((SECONDS-start)) s")
    cat "$OUT/host_costs_$COMMIT.log" "$OUT/host_ops_$COMMIT.log"
    ;;
  hf)
    # transformers (the [hf] extra) and its needs as wheels, in a separate target so the image's copies stay
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_hf .whl_hf/*.whl
    PYTHONPATH="$PWD:/tmp/site_hf:${PYTHONPATH#$PWD:}" timeout -s INT "${HF_CAP:-240}" python3 benchmarks/hf_layer.py \
      ${HF_ARGS:---train 200} --out "$OUT/hf_layer_$COMMIT.json" > "$OUT/hf_layer_$COMMIT.log" 2>&1
    summary+=("hf_layer rc=$? $((SECONDS-start)) s")
    tail -20 "$OUT/hf_layer_$COMMIT.log"
    ;;
  parallel)
    timeout -s INT "${PAR_CAP:-150}" torchrun --standalone --nproc_per_node 1 tools/parallel_check.py \
      --out "$OUT/parallel_$COMMIT.json" > "$OUT/parallel_$COMMIT.log" 2>&1
    summary+=("parallel_check (world 1) rc=$? $((SECONDS-start)) s")
    tail -15 "$OUT/parallel_$COMMIT.log"
    ;;
  esac
done
[ -f "$OUT/block_$COMMIT.log" ] && grep -E "GPU time by kernel|^ +[0-9.]+ ms" "$OUT/block_$COMMIT.log" | head -80
[ -f "$OUT/block_$COMMIT.log" ] && tail -8 "$OUT/block_$COMMIT.log"
printf '%s\n' "${summary[@]}"
