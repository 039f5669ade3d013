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
# Bazel's action cache outlives a fresh clone (as ccache does for CMake):
# outputs are keyed by their inputs, not by the checkout's folder.
disk_cache=${HMOE_BAZEL_DISK_CACHE:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/hmoe-bazel-disk}
cache=(--disk_cache="$disk_cache")
# Bazel 4 never trims it: entries unread for two weeks go.
[[ -d $disk_cache ]] && find "$disk_cache" -type f -atime +14 -delete 2>/dev/null || true
# No Bazel server left behind when this ends (CI waits for its processes).
trap 'bazel shutdown 2>/dev/null || true' EXIT
tests=("$@")
((${#tests[@]})) || tests=(//tests:hmoe-tests-common //tests:hmoe-tests-kernels //tests:hmoe-tests-model)

echo "== bazel: CMake and Bazel source lists"
bash bazel/check_sources.sh "$cmake_build"
echo "== bazel build //..."
bazel build --noshow_progress "${cache[@]}" //...
echo "== bazel test ${tests[*]}"
bazel test --noshow_progress "${cache[@]}" "${tests[@]}"
echo "== run-bazel: passed in $(($(date +%s) - start)) s"
