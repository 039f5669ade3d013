#!/usr/bin/env bash
# One device call of the CUDA backend's checks on the GPU machine
# (../shared/gpu-machine/README.md): hmoe-tests-cuda, the whole GPU suite (the
# CUDA kernels against the CPU reference ops, the CUDA backend against the CPU
# backend on every fixture, graphs, hot and streamed experts, the expert-call
# paths over a real service, the feature matrix, and the cuda instances of
# the suites that run on every backend); the serving tests with the cuda
# backend (they run the programs); then the hmoe-bench-e2e runs named in E2E_RUNS
# (space-separated PRESET:FORMAT[:LAYERS], e.g. "qwen3-30b:int4 ds-v3:int4:5";
# E2E_SECS bounds each). Output per step in OUT/NAME.txt (and
# OUT/e2e-PRESET-FORMAT.json); each test step ends with its pass / fail /
# skip counts per test area (bench/gpu_tests_summary.py, from its JSON
# report in OUT/NAME/). CUDA=0 / SERVE=0 leave a step out. The whole suite
# and the CUDA soak: bench/gpu_suite.sh.
#
#   bench/gpu_check.sh BIN_DIR OUT_DIR
set -uo pipefail
bin=${1:-build/bin}
out=${2:-.}
mkdir -p "$out"
export HMOE_SOURCE_DIR=${HMOE_SOURCE_DIR:-$PWD}
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2
  shift 2
  echo "== $name: $*"
  timeout "$secs" "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  echo "rc=$rc" >>"$out/$name.txt"
  echo "   rc=$rc"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests ran|\[ cuda/cpu \]|\[ graphs   \]" "$out/$name.txt" | head -40
  if [ -f "$out/$name/report.json" ]; then  # a test step: counts per area
    python3 "$(dirname "$0")/gpu_tests_summary.py" "$out/$name" --log "$out/$name.txt" |
      tee -a "$out/$name.txt"
  fi
}
mkdir -p "$out/cuda" "$out/serving"
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; lscpu | head -20) \
  >"$out/machine.txt" 2>&1
[ "${CUDA:-1}" = 1 ] && step cuda "${CUDA_SECS:-420}" "$bin/hmoe-tests-cuda" \
  --gtest_output="json:$out/cuda/report.json"
[ "${SERVE:-1}" = 1 ] && step serving "${SERVE_SECS:-240}" "$bin/hmoe-tests" \
  --gtest_filter="${SERVE_FILTER:-Serving*:*Worker*:E2e*}" \
  --gtest_output="json:$out/serving/report.json"
for run in ${E2E_RUNS:-}; do
  IFS=: read -r preset format layers <<<"$run"
  name="e2e-$preset-$format"
  step "$name" "${E2E_SECS:-300}" "$bin/hmoe-bench-e2e" --preset "$preset" --format "$format" \
    ${layers:+--layers "$layers"} ${E2E_FLAGS:-} --json "$out/$name.json"
  grep -v '^$' "$out/$name.txt" | tail -24
done
exit 0
