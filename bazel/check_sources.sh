#!/usr/bin/env bash
# Fails when CMake and Bazel do not compile the same C++ sources: a .cc file
# added to one build and not the other, or tracked by git and compiled by
# neither. CMake's list is its compile database (CMAKE_EXPORT_COMPILE_COMMANDS,
# written at configure time); Bazel's is the source files that //... depends
# on. The CUDA backend (gpu_worker/cuda, tests/cuda) and the libFuzzer targets
# (tests/fuzz) are CMake's only and are left out of all three lists.
# Usage: bazel/check_sources.sh CMAKE_BUILD_DIR   (run from the source root)
set -euo pipefail
build=${1:?usage: $0 CMAKE_BUILD_DIR}
[[ -f $build/compile_commands.json ]] || {
  echo "check_sources: $build/compile_commands.json missing (configure with CMake first)" >&2
  exit 2
}
only_ours='^(gpu_worker/cuda|tests/cuda|tests/fuzz)/'
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

python3 - "$build/compile_commands.json" "$PWD" >"$tmp/cmake" <<'PY'
import json, os, sys
root = os.path.realpath(sys.argv[2])
for entry in json.load(open(sys.argv[1])):
    path = os.path.realpath(os.path.join(entry.get("directory", ""), entry["file"]))
    rel = os.path.relpath(path, root)
    if not rel.startswith("..") and rel.endswith(".cc"):
        print(rel)
PY
# Generated files (e.g. the protobuf code) live in the build trees.
grep -vE "$only_ours" "$tmp/cmake" | grep -vE '^(build|bazel-)' | sort -u >"$tmp/cmake.sorted"

bazel query --noshow_progress --output=label 'kind("source file", deps(//...))' 2>/dev/null |
  sed -n 's|^//\([^:]*\):\(.*\.cc\)$|\1/\2|p' | sed 's|^/||' | grep -vE "$only_ours" |
  sort -u >"$tmp/bazel.sorted"

status=0
report() {  # report TITLE FILE
  if [[ -s $2 ]]; then
    echo "check_sources: $1:"
    sed 's/^/  /' "$2"
    status=1
  fi
}
comm -23 "$tmp/cmake.sorted" "$tmp/bazel.sorted" >"$tmp/a"
comm -13 "$tmp/cmake.sorted" "$tmp/bazel.sorted" >"$tmp/b"
report "compiled by CMake, not by Bazel (add it to a BUILD file)" "$tmp/a"
report "compiled by Bazel, not by CMake (add it to a CMakeLists.txt)" "$tmp/b"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git ls-files '*.cc' | grep -vE "$only_ours" | sort -u >"$tmp/git.sorted"
  sort -u "$tmp/cmake.sorted" "$tmp/bazel.sorted" | comm -23 "$tmp/git.sorted" - >"$tmp/c"
  report "tracked by git, compiled by neither build" "$tmp/c"
fi
[[ $status == 0 ]] && echo "check_sources: CMake and Bazel compile the same $(wc -l <"$tmp/cmake.sorted") files"
exit $status
