#!/usr/bin/env bash
# Set-up and the whole test suite, twice: a normal build (CUDA enabled
# when nvcc is present; GPU tests skip without a GPU) and an ASan+UBSan build
# of the CPU code (clang, with the fuzz targets); then each libFuzzer target
# for a bounded time (deploy/run-fuzz.sh); then the Bazel build beside CMake:
# the same sources, //... built, the common, kernels and model suites run
# (deploy/run-bazel.sh).
# Run as root on Debian 12: installs what it needs first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh --tests
jobs=$(nproc)
start=$(date +%s)
stage_start=$start
stage_done() {  # stage_done NAME: the stage's own time and the total so far
  local now
  now=$(date +%s)
  echo "== run-tests: $1 took $((now - stage_start)) s ($((now - start)) s so far)"
  stage_start=$now
}
# ccache hits across checkouts in other folders (CI clones afresh each time).
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true

# The official OpenAI and Anthropic Python clients for the HTTP API's
# end-to-end tests (pinned; test-only, the product never needs them).
for client in openai anthropic; do
  if ! "build/$client-venv/bin/python" -c "import $client" 2>/dev/null; then
    echo "== $client client venv (tests/e2e/${client}_client/requirements.txt)"
    mkdir -p build
    python3 -m venv "build/$client-venv"
    "build/$client-venv/bin/pip" install -q --disable-pip-version-check \
      -r "tests/e2e/${client}_client/requirements.txt"
  fi
done

stage_done "set-up"

echo "== normal build"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$jobs"
ctest --test-dir build --output-on-failure --no-tests=error -j"$jobs" --timeout 300
stage_done "normal build and tests"

# One clang tree for the sanitizers and the fuzz targets: HMOE_FUZZ builds our
# code with ASan + UBSan and libFuzzer's coverage, the test suites and the
# fuzz targets (deploy/run-fuzz.sh runs them from this tree).
echo "== ASan + UBSan build (CPU code, clang; the fuzz targets too)"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DHMOE_FUZZ=ON -DHMOE_ENABLE_CUDA=OFF -DHMOE_BUILD_BENCH=OFF >/dev/null
cmake --build build-asan -j"$jobs"
# The soak (tests/e2e/soak_test.cc) runs 120 s in the normal build, 45 s here.
HMOE_SOAK_SECONDS=45 ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure --no-tests=error -j"$jobs" --timeout 300
stage_done "ASan + UBSan build and tests"

echo "== fuzz: libFuzzer targets (clang, ASan + UBSan), ${FUZZ_SECONDS:-30} s each"
FUZZ_BUILD=build-asan bash deploy/run-fuzz.sh
stage_done "fuzz runs"

echo "== Bazel build beside CMake"
HMOE_CMAKE_BUILD=build bash deploy/run-bazel.sh
stage_done "Bazel"

echo "== run-tests: both CMake builds, the fuzz targets and Bazel passed in $(( $(date +%s) - start )) s"
