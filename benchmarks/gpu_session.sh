#!/usr/bin/env bash
# Issue 55's one GPU run, as the device tool runs it (about 9 minutes; writes under $OUT):
#   the wide workload and every other bench_gpu.py figure first (JSON rewritten per row, so
#   a cut run keeps what it measured), its tables, then the CUDA tests with their failures.
# The device image lacks cotengra (and galore-torch): carry them as wheels in .whl/
# (see the device tool's README), e.g. `pip download --no-deps -d .whl cotengra autoray galore-torch`.
set -u
cd "$(dirname "$0")/.." || exit 1   # the repository root
PY=${PY:-python3}
OUT=${OUT:-/tmp/gpu-run}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv
(cd benchmarks && timeout "${BENCH_S:-420}" $PY bench_gpu.py --budget-s "${BUDGET_S:-330}" --out "$OUT/gpu.json" \
    > "$OUT/bench.log" 2>&1; echo "bench rc=$?")
grep -v "passes\|TT-SVD\|it/s\]" "$OUT/bench.log" | cut -c1-400 | tail -40
(cd benchmarks && $PY bench_gpu.py --table "$OUT/gpu.json" > "$OUT/gpu_tables.md" 2>&1)
PER_TEST=$($PY -c "import pytest_timeout" 2>/dev/null && echo "--timeout 60")   # where pytest-timeout is installed
timeout "${TESTS_S:-150}" $PY -m pytest -q -rf --tb=short -p no:cacheprovider $PER_TEST \
    -m cuda tests/test_cuda.py tests/test_triton_kernels.py tests/test_train_step.py tests/test_step_ways.py tests/test_measured_report.py \
    > "$OUT/gpu_tests.log" 2>&1   # every test marked cuda
echo "tests rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -15
