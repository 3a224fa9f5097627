#!/usr/bin/env bash
# raycl's torch-level code on a bare CUDA machine (torch, no Ray, no MLflow), in one go:
#   1. the torch-level test files, the CUDA-only tests among them included;
#   2. benchmarks/cuda_compare.py: CUDA against the CPU (LARS, per-view augmentation,
#      SyncBatchNorm, eval.linear_sgd heads, the export encoder);
#   3. benchmarks/gpu.py: raycl's epoch vs a plain loop, AMP, channels_last, method steps,
#      augmentation, embedding, k-means, torch.compile last (behind a time budget).
# Usage: OUT=/some/dir bash benchmarks/cuda_checks.sh [--quick]   (--quick: CPU smoke sizes)
# Wheels in .whl/ (pydantic and its needs, faiss-cpu) are installed to /tmp/site first when
# there (SKIP_WHEELS=1: not). Every step runs whatever the one before it did; the exit status counts the failures.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cuda_checks}
mkdir -p "$OUT"
QUICK=${1:-}
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
failures=0
stamp() { echo "=== $(date -u +%H:%M:%S) $*"; }

if [ -z "${SKIP_WHEELS:-}" ] && compgen -G ".whl/*.whl" >/dev/null; then
  stamp "installing carried wheels"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || failures=$((failures + 1))
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

stamp "machine"
"$PYTHON" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", torch.cuda.get_device_name(0), f"{p.total_memory / 2**30:.0f} GiB",
          p.multi_processor_count, "SMs", "bf16", torch.cuda.is_bf16_supported())
EOF
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null

# 1. Tests. Deselected: those that need Ray, MLflow or open_clip (not on a bare GPU machine).
TESTS="tests/test_augment.py tests/test_precision.py tests/test_queues.py tests/test_lars.py
  tests/test_linear_sgd.py tests/test_sync_batchnorm.py tests/test_losses.py
  tests/test_export_formats.py tests/test_moco_simsiam.py tests/test_methods.py
  tests/test_models.py"
NEEDS_RAY_OR_OPEN_CLIP=(
  --deselect tests/test_lars.py::test_lars_for_a_transformer_method_is_one_line_before_launch
  --deselect tests/test_linear_sgd.py::test_quickstart_with_the_papers_recipe_logs_the_sgd_linear_evaluation
  --deselect tests/test_export_formats.py::test_clip_trial_exports_to_open_clip
  --deselect tests/test_methods.py::test_checkpoint_state_round_trips_under_weights_only
)
stamp "tests"
# shellcheck disable=SC2086
timeout 180 "$PYTHON" -m pytest -q -p no:cacheprovider --continue-on-collection-errors \
  -rfEs --junitxml="$OUT/cuda_tests.xml" "${NEEDS_RAY_OR_OPEN_CLIP[@]}" $TESTS \
  || failures=$((failures + 1))

# 2. CUDA against the CPU.
stamp "cuda_compare"
DEVICE_ARGS=()
[ "$QUICK" = "--quick" ] && DEVICE_ARGS=(--device cpu)
timeout 120 "$PYTHON" benchmarks/cuda_compare.py "${DEVICE_ARGS[@]}" \
  --out "$OUT/cuda_compare.json" || failures=$((failures + 1))

# 3. The benchmark, its torch.compile variant last and skipped past the budget.
stamp "gpu.py"
if [ "$QUICK" = "--quick" ]; then
  GPU_ARGS=(--device cpu --quick --methods simclr nnclr mcl)
else
  GPU_ARGS=(--time-budget 200)
fi
timeout 300 "$PYTHON" benchmarks/gpu.py "${GPU_ARGS[@]}" --out "$OUT/gpu_results.json" \
  || failures=$((failures + 1))
stamp "done: $failures step(s) failed"
exit "$failures"
