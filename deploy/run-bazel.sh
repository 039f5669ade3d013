#!/usr/bin/env bash
# The Bazel build beside CMake (bazel/README.md), offline: checks that both
# builds compile the same sources, builds every Bazel target (//...), then
# runs the common, kernels and model suites (or the test targets given as
# arguments). Needs a configured CMake tree for the source-list check
# (HMOE_CMAKE_BUILD, default build/). deploy/run-tests.sh calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
cmake_build=${HMOE_CMAKE_BUILD:-build}
if [[ ! -f $cmake_build/compile_commands.json ]]; then
  cmake -S . -B "$cmake_build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
tests=("$@")
((${#tests[@]})) || tests=(//tests:hmoe-tests-common //tests:hmoe-tests-kernels //tests:hmoe-tests-model)

echo "== bazel: CMake and Bazel source lists"
bash bazel/check_sources.sh "$cmake_build"
echo "== bazel build //..."
bazel build --noshow_progress //...
echo "== bazel test ${tests[*]}"
bazel test --noshow_progress "${tests[@]}"
echo "== run-bazel: passed in $(($(date +%s) - start)) s"
