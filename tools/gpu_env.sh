# Sourced by the tools/gpu_*.sh scripts (from the repository root): $OUT made, the wheels in .whl (the GPU
# machine has no network; tools/fetch_cudnn_frontend.sh fills it) installed to /tmp/site, the repository
# on PYTHONPATH.
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
