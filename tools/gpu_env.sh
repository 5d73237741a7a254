# Sourced by the tools/gpu_*.sh scripts (from the repository root): $OUT made, the wheels in .whl (the GPU
# machine has no network; tools/fetch_cudnn_frontend.sh fills it) installed to /tmp/site, the repository
# on PYTHONPATH.
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
# Bytecode caches are written as Python does by default: without them every process compiles the
# sources of what it imports again (sympy, imported by autograd's first backward: seconds of a first step)
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
