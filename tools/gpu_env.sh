# Sourced by the tools/gpu_*.sh scripts (from the repository root): $OUT made, the wheels in .whl (the GPU
# machine has no network; tools/fetch_cudnn_frontend.sh fills it) installed to /tmp/site, the repository
# on PYTHONPATH.
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The GPU image sets PYTHONDONTWRITEBYTECODE=1 and ships sympy without bytecode, so every process compiled
# sympy's ~500 sources again on its first backward (1-2 s of every path's first step, the pure torch
# one's too). A pip-installed environment has that bytecode: write it once here, as pip would.
unset PYTHONDONTWRITEBYTECODE
python3 -c "import sympy" 2>/dev/null
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
