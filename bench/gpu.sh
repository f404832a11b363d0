#!/usr/bin/env bash
# shardlab on an NVIDIA GPU, in one command:
#
#   bash bench/gpu.sh
#
# 1. a Python with JAX on the GPU: $GPU_PYTHON if set (a Python whose jax already sees the
#    GPU; shardlab is installed into it without dependencies when it lacks it), else a venv
#    at $GPU_VENV (default .venv-gpu) with shardlab and jax[cuda12] installed;
# 2. the cuDNN fused attention path against the plain one, values and gradients
#    (bench/gpu_checks.py attention);
# 3. a bundled model (tiny) trained on the GPU against the same run on the CPU, in fp32 and
#    bf16 (bench/gpu_checks.py step);
# 4. the peer config's tokens/s and compiled memory on the GPU, with MaxText's beside it
#    where MaxText imports ($MT_VENV, as bench/peer.py; or its wheels on $MAXTEXT_PYTHONPATH)
#    (bench/gpu_checks.py peer);
# 5. the planner's tokens/s and memory against bundled models trained on the GPU
#    (bench/gpu_checks.py planner).
# Every check runs even when one before it failed; the exit status is 1 if any failed.
# Their output (tables, then one `GPU_CHECK {json}` line each) also goes to $GPU_LOG_DIR
# (default gpu-logs/) as one log per check.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${GPU_LOG_DIR:-gpu-logs}
mkdir -p "$LOGS"

if [ -n "${GPU_PYTHON:-}" ]; then
  PY=$GPU_PYTHON
  if ! "$PY" -c "import shardlab.models" 2>/dev/null; then
    "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1
  fi
else
  VENV=${GPU_VENV:-.venv-gpu}
  if [ ! -x "$VENV/bin/python" ]; then python3 -m venv "$VENV" || exit 1; fi
  PY=$VENV/bin/python
  # The jax pin is pyproject's; the CUDA plugin follows it.
  JAX=$(grep -o '"jax==[^"]*"' pyproject.toml | head -n1 | tr -d '"')
  "$PY" -m pip install --quiet --disable-pip-version-check -e '.[test]' "${JAX/jax/jax[cuda12]}" \
    || exit 1
fi

"$PY" - <<'PYEOF' || { echo "JAX does not see a GPU with $PY: nothing checked" >&2; exit 1; }
import jax
print(f"jax {jax.__version__}: {jax.devices()}")
assert jax.default_backend() == "gpu"
PYEOF
status=0
for check in attention step peer planner; do
  echo "== $check"
  # The step and peer checks start other processes on the GPU beside their own, so none may
  # take most of its memory up front; the planner's runs are timed as a training run runs:
  # alone, with JAX's default allocator.
  prealloc=false
  if [ "$check" = planner ]; then prealloc=true; fi
  XLA_PYTHON_CLIENT_PREALLOCATE=$prealloc "$PY" bench/gpu_checks.py "$check" 2>&1 \
    | tee "$LOGS/$check.log" || status=1
done
exit $status
