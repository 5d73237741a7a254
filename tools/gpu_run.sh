#!/usr/bin/env bash
# The one GPU script: tests and times on the lent GPU (an H100 or an H200) in one call, printing a short table last.
#   tools/gpu_run.sh [phases...]    phases: info test sanitize bench block host record first profile hf titan
#                                   (default: info test sanitize bench)
#   `test` (the whole pytest, up to TEST_CAP = 530 s) fills one 600 s device command by itself.
#   block / first / hf / titan: the README's and BENCHMARKS' block, first-step, HF-layer and TorchTitan
#   tables (about 90 s per block shape, 170 s, 100 s and 100 s on an H100).
# Run through the device tool with `.whl` carried (tools/fetch_cudnn_frontend.sh fills it here).
# Writes logs and JSON under $OUT (or ./gpu_out when $OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/gpu_env.sh
PHASES=${*:-info test sanitize bench}
# .git does not travel to the device machine: pass MXMLA_COMMIT=<local hash> in the command.
COMMIT=${MXMLA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "commit $COMMIT  date $(date -u +%F)  phases: $PHASES"
summary=()

# script_phase NAME CAP LOG TAIL SCRIPT ARGS...: one benchmark script under a SIGINT cap, its output in
# LOG, its last TAIL lines shown, one summary line
script_phase() {
  local name=$1 cap=$2 log=$3 lines=$4 start=$SECONDS rc
  shift 4
  timeout -s INT "$cap" python3 "$@" > "$log" 2>&1
  rc=$?
  tail -"$lines" "$log"
  summary+=("$name: rc=$rc in $((SECONDS-start)) s; $log")
}

for phase in $PHASES; do
  case $phase in
  info)
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
    python3 -m dispatch.cli info -v 2>&1 | tee "$OUT/info.txt"
    ;;
  test)
    # The whole pytest (every file, as `pytest` alone collects them: each folder's files together, so
    # tests/conformance/conftest.py's fixtures hold) in TEST_WORKERS pytest-xdist processes sharing the
    # GPU (Triton compiles and spec references are CPU-bound), each test under pytest-timeout's
    # TEST_TIMEOUT, the whole run under TEST_CAP (SIGINT: pytest still reports and writes the XML).
    # Writes $OUT/tests_<commit>.log, the JUnit XML tests_<commit>.xml and tests_by_file_<commit>.txt.
    start=$SECONDS
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # 12 workers x NumPy / torch CPU threads on 16 cores
    timeout -s INT -k 30 "${TEST_CAP:-530}" python3 -m pytest -n "${TEST_WORKERS:-12}" --timeout "${TEST_TIMEOUT:-240}" \
      -q -p no:cacheprovider -rfE --durations 25 --junitxml="$OUT/tests_$COMMIT.xml" > "$OUT/tests_$COMMIT.log" 2>&1
    rc=$?
    tail -40 "$OUT/tests_$COMMIT.log"
    python3 tools/junit_summary.py "$OUT/tests_$COMMIT.xml" | tee "$OUT/tests_by_file_$COMMIT.txt"
    summary+=("pytest (whole suite, -n ${TEST_WORKERS:-12}): rc=$rc in $((SECONDS-start)) s: $(grep -E '(passed|failed|error)' "$OUT/tests_$COMMIT.log" | tail -1)")
    ;;
  sanitize)
    start=$SECONDS
    timeout -s INT "${SANITIZE_CAP:-120}" compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/sanitize_cases.py 2>&1 \
      | tee "$OUT/sanitize.log" | tail -15
    rc=${PIPESTATUS[0]}
    summary+=("compute-sanitizer memcheck: rc=$rc in $((SECONDS-start)) s: $(grep -E 'ERROR SUMMARY' "$OUT/sanitize.log" | tail -1)")
    ;;
  bench)
    # `mxmla bench` (benchmarks/run_all.py): every benchmarks/bench_*.py in its own subprocess under its
    # own cap (SIGINT at the cap: the script writes what it measured; killed after a grace), then
    # $OUT/bench/results.json, $OUT/bench/plots/*.png and one table printed last. Knobs:
    #   BENCH_MODE   --quick (default); "" = each script's full sweep; --smoke = tiny shapes
    #   BENCH_TOKENS token counts for every script with a token axis: "sweep" (1K..32K) or "1024,4096"
    #   BENCHES      which scripts (space or comma list of names: quantize mla_q ...); default all
    #   BENCH_CAP    seconds for every script; BENCH_CAPS per script: "quantize=90 mla_q=120"
    #   BENCH_BUDGET seconds for the whole phase (default 560: the device tool stops a command at 600)
    #   BENCH_ARGS   anything else for mxmla bench (e.g. --no-compile, or "" to echo every script's output)
    start=$SECONDS
    bench_args=(${BENCH_MODE---quick} --out "$OUT/bench" --budget "${BENCH_BUDGET:-560}" --commit "$COMMIT")
    [ -n "${BENCHES:-}" ] && bench_args+=(--benches "$(echo ${BENCHES} | tr ' ' ',')")
    [ -n "${BENCH_CAP:-}" ] && bench_args+=(--cap "$BENCH_CAP")
    [ -n "${BENCH_CAPS:-}" ] && bench_args+=(--caps "$BENCH_CAPS")
    [ -n "${BENCH_TOKENS:-}" ] && bench_args+=(--tokens "$BENCH_TOKENS")
    # --quiet: the scripts' own output goes to $OUT/bench/bench_<name>.log, so the tail the device tool
    # returns holds the per-script status and the table.
    python3 -m dispatch.cli bench "${bench_args[@]}" ${BENCH_ARGS---quiet} 2>&1 | tee "$OUT/bench.log"
    rc=${PIPESTATUS[0]}
    python3 benchmarks/summarize.py "$OUT/bench/results.json" --commit "$COMMIT" > "$OUT/summary.md" 2>&1
    n_ok=$(grep -cE '^  [a-z_0-9]+ +ok ' "$OUT/bench.log")
    not_ok=$(grep -E '^  [a-z_0-9]+ +(capped|killed|failed|skipped|interrupted)' "$OUT/bench.log" \
      | awk '{print $1 " " $2}' | paste -sd, -)
    summary+=("mxmla bench: rc=$rc in $((SECONDS-start)) s: $n_ok scripts ok${not_ok:+; $not_ok}; $OUT/bench")
    ;;
  block)
    # compiled, CUDA-graph and eager block paths in turns, per shape (BLOCK_SHAPES), with per-kernel tables
    start=$SECONDS
    shapes=${BLOCK_SHAPES:-B1S4096,B2S4096,B1S16384}
    timeout -s INT "${BLOCK_CAP:-400}" python3 benchmarks/bench_block.py --shapes "$shapes" --kernel-top 40 --launchers 16 \
      --paths mxfp8-compile,bf16-compile,compile,mxfp8-cudagraph,compile-cudagraph,mxfp8,torch \
      --json "$OUT/block_$COMMIT.json" > "$OUT/block_$COMMIT.txt" 2>&1
    rc=$?
    grep -A12 "^shape " "$OUT/block_$COMMIT.txt"
    summary+=("bench_block ($shapes): rc=$rc in $((SECONDS-start)) s; $OUT/block_$COMMIT.txt")
    ;;
  host)
    # the compiled block's host side at B1 S4096: where one forward's issue time goes, by function
    script_phase host_profile "${HOST_CAP:-170}" "$OUT/host_profile_$COMMIT.txt" 4 \
      benchmarks/bench_block.py --quick --paths mxfp8-compile,compile --host-profile
    ;;
  record)
    # the sm90 compile-ahead list recorded afresh (tools/record_pretuned.py: the block's eager and compiled
    # mxfp8 paths and bf16, the patched HF layer) into the working tree, which the later phases then use;
    # the list comes back as $OUT/<arch>.compile.json to be committed
    script_phase record_pretuned "${RECORD_CAP:-150}" "$OUT/record_$COMMIT.log" 12 \
      tools/record_pretuned.py --shapes "${RECORD_SHAPES:-B1S4096,B1S16384}"
    cp backends/triton/pretuned/*.compile.json "$OUT/"
    ;;
  first)
    # FIRST_CASES: a comma list of first_step.py's cases (default: all six)
    start=$SECONDS
    python3 benchmarks/first_step.py --budget "${FIRST_CAP:-300}" --breakdown --json "$OUT/first_step_$COMMIT.json" \
      ${FIRST_CASES:+--cases "$FIRST_CASES"} > "$OUT/first_step_$COMMIT.txt" 2>&1
    rc=$?
    grep -v "^  \[" "$OUT/first_step_$COMMIT.txt" | tail -9
    summary+=("first_step: rc=$rc in $((SECONDS-start)) s; $OUT/first_step_$COMMIT.txt")
    ;;
  profile)
    # the compiled paths' first steps in a fresh, a second and a profiled third process (torch.compile's
    # own timings and cProfile; benchmarks/first_step_profile.py)
    script_phase first_step_profile "${PROFILE_CAP:-150}" "$OUT/first_step_profile_$COMMIT.txt" 4 \
      benchmarks/first_step_profile.py mxfp8-compile,compile
    ;;
  hf)
    script_phase hf_layer "${HF_CAP:-200}" "$OUT/hf_layer_$COMMIT.log" 9 \
      benchmarks/hf_layer.py --out "$OUT/hf_layer_$COMMIT.json"
    ;;
  titan)
    script_phase titan_block "${TITAN_CAP:-300}" "$OUT/titan_block_$COMMIT.log" 6 \
      benchmarks/titan_block.py --out "$OUT/titan_block_$COMMIT.json"
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
echo
echo "== gpu_run summary (commit $COMMIT) =="
for line in "${summary[@]}"; do echo "  $line"; done
