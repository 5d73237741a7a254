#!/usr/bin/env bash
# The training comparison on one GPU: the CUDA autograd tests (CUDA-graph capture of forward + backward, block
# gradients vs the torch reference), then examples/train_compare.py: the MLA block's MXFP8 path and
# the pure-torch bf16 reference, 200 steps from one init on one data stream, DeepSeek-V3 head
# configuration (H 128, q_lora 1536, kv_lora 512, hidden 7168, 2 x 512 tokens).
#
#   bash tools/gpu_train.sh            # outputs under $OUT, else ./gpu_out; last line: the summary
#
# Budget (< 4 min on an H200): each stage runs under `timeout`; the MXFP8 run stops early after
# TRAIN_BUDGET_S seconds (the reference then trains as many steps and the summary says so).
set -u
cd "$(dirname "$0")/.."
# the carried wheels (nvidia-cudnn-frontend: without it the attention runs on the Triton kernels) and PYTHONPATH
source tools/gpu_env.sh
OUT_DIR="$OUT"
TESTS_TIMEOUT_S="${TESTS_TIMEOUT_S:-90}"
TRAIN_TIMEOUT_S="${TRAIN_TIMEOUT_S:-130}"
TRAIN_BUDGET_S="${TRAIN_BUDGET_S:-70}"
start=$(date +%s)

python - <<'EOF' 2>&1 | tee "$OUT_DIR/env.txt"
import torch, dispatch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA")
for b in dispatch.backends():
    print(f"  backend {b['backend']:7} available={b['available']} {b['version']} {'; '.join(b['reasons']) if not b['available'] else ''}")
EOF

if [ "${SKIP_TESTS:-0}" = 1 ]; then  # tools/gpu_run.sh test already ran them
  echo "== CUDA autograd tests skipped (SKIP_TESTS=1)"; tests_rc=0
else
  echo "== CUDA autograd tests (timeout ${TESTS_TIMEOUT_S}s)"
  # -v: one line per test as it finishes (a timeout still leaves the results so far); -rA -rP: the
  # summary and each passing test's printout (the backends the dispatcher chose) at the end.
  timeout "$TESTS_TIMEOUT_S" python -m pytest -v -m gpu tests/test_autograd_cuda.py -rA -rP -p no:cacheprovider \
      --junitxml="$OUT_DIR/test_autograd_cuda.xml" > "$OUT_DIR/test_autograd_cuda.log" 2>&1
  tests_rc=$?
  grep -E "::.* (PASSED|FAILED|ERROR|SKIPPED)|backends|gradient errors|^(FAILED|ERROR) |[0-9]+ (passed|failed)" \
      "$OUT_DIR/test_autograd_cuda.log" | tail -n 40
fi

echo "== train_compare: mxfp8 vs torch reference, deepseek config, 200 steps (timeout ${TRAIN_TIMEOUT_S}s)"
timeout "$TRAIN_TIMEOUT_S" python examples/train_compare.py --device cuda --config deepseek --steps 200 \
    --max-seconds "$TRAIN_BUDGET_S" --out "$OUT_DIR" > "$OUT_DIR/train_compare.log" 2>&1
train_rc=$?
grep -E "step +(1|2|3|50|100|150|200) |backends|plot|train_compare|Error|error" "$OUT_DIR/train_compare.log" | tail -n 30

elapsed=$(( $(date +%s) - start ))
OUT_DIR="$OUT_DIR" TESTS_RC="$tests_rc" TRAIN_RC="$train_rc" ELAPSED="$elapsed" python - <<'EOF'
import json, os, re
out = os.environ["OUT_DIR"]
# per-test outcomes from the -v lines (present even when the timeout cut the run short)
try:
    log = open(os.path.join(out, "test_autograd_cuda.log")).read()
except OSError:
    log = ""
outcomes = dict(re.findall(r"::(\S+) (PASSED|FAILED|ERROR|SKIPPED)", log))
counts = {k: list(outcomes.values()).count(k) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
tests = f"tests {counts['PASSED']}/{len(outcomes)} passed"
failed = [name for name, o in outcomes.items() if o in ("FAILED", "ERROR")]
if failed:
    tests += f" (failed: {', '.join(failed)})"
if counts["SKIPPED"]:
    tests += f", {counts['SKIPPED']} skipped"
if os.environ["TESTS_RC"] == "124":
    tests += ", TIMED OUT"
elif not outcomes:
    tests += f" (no results, rc {os.environ['TESTS_RC']})"
train = "train_compare: no result (rc %s)" % os.environ["TRAIN_RC"]
try:
    sm = json.load(open(os.path.join(out, "train_compare.json")))["summary"]
    fl = sm["final_loss_mean_last10"]
    train = (f"train {sm['steps_done']}/{sm['steps_requested']} steps, last-10 loss "
             f"{sm['candidate']} {fl[sm['candidate']]:.4f} vs {sm['reference']} {fl[sm['reference']]:.4f}, "
             f"rel diff {sm['rel_diff_mean_last10']:.2%} ({'within' if sm['within_target'] else 'NOT within'} 2%)")
except Exception as exc:  # noqa: BLE001
    train += f" ({type(exc).__name__})"
print(f"SUMMARY gpu_train: {tests}; {train}; {os.environ['ELAPSED']} s; outputs in {out}")
EOF
