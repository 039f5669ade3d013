#!/usr/bin/env bash
# On the development machine: packs what bench/gpu_suite.sh runs on the GPU
# machine (bench/README.md, "The whole suite on the GPU machine"), from a
# build tree made with -DCMAKE_CUDA_ARCHITECTURES=90 where hmoe-tests and the
# programs are built:
#
#   bench/gpu_bundle.sh [BUILD_DIR [OUT_DIR]]      (defaults: build, .gpu)
#
# OUT_DIR/b.txz       hmoe-tests and the programs its tests start, with their
#                     shared libraries (../shared/gpu-machine/bundle.sh, or
#                     BUNDLE_SH; debug info stripped), recompressed with xz
# OUT_DIR/extras.txz  what the tests that skip there lack: promtool (Debian's
#                     prometheus; a static Go binary), ip(8) and
#                     systemd-analyze (with Debian's target units) with their
#                     libraries, the Python stubs (BUILD_DIR/python), the
#                     wheels of the OpenAI client's venv
#                     (tests/e2e/openai_client/requirements.txt) and of the
#                     Python client's gRPC (bench/gpu_python_requirements.txt)
#                     for CPython 3.12 on x86-64 (pip download: needs PyPI),
#                     and paths.env: the source and build folders compiled
#                     into the tests (HMOE_SOURCE_DIR, HMOE_BINARY_DIR)
# Both, with the repository's files, must stay under the 64 MiB a device
# call carries: this prints the sizes and fails above 62 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
out=${2:-.gpu}
bundle_sh=${BUNDLE_SH:-../shared/gpu-machine/bundle.sh}
[ -f "$build/CMakeCache.txt" ] || { echo "gpu_bundle: no CMake tree in $build" >&2; exit 2; }
[ -f "$bundle_sh" ] || { echo "gpu_bundle: no $bundle_sh (set BUNDLE_SH)" >&2; exit 2; }
command -v promtool >/dev/null || { echo "gpu_bundle: no promtool (bash deploy/install-deps.sh --tests)" >&2; exit 2; }
mkdir -p "$out"
progs=()
for p in hmoe-tests hmoe-gpu-worker hmoe-expert-service hmoe-expert-bench hmoe hmoe-bench-e2e; do
  [ -x "$build/bin/$p" ] || { echo "gpu_bundle: $build/bin/$p not built" >&2; exit 2; }
  progs+=("$build/bin/$p")
done
bash "$bundle_sh" "$out/b.tgz" "${progs[@]}" >/dev/null
packed=" $(tar tzf "$out/b.tgz" | sed -n 's#^\./lib/##p' | tr '\n' ' ') "
gzip -dc "$out/b.tgz" | xz -T0 -6 >"$out/b.txz"
rm -f "$out/b.tgz"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/tools/bin" "$stage/tools/lib" "$stage/wheels/openai" "$stage/wheels/grpc"
cp "$(command -v promtool)" "$stage/tools/bin/promtool"
# ip(8) and systemd-analyze with the libraries they load beyond the C
# runtime and b.txz's, for wrappers that give them (alone) their own library
# path (then b.txz's, which bench/gpu_suite.sh sets); systemd-analyze with
# Debian's target units, the ones the service units are verified against.
carry_tool() {  # carry_tool PROGRAM [ENV=VALUE ...]: tools/bin/NAME wrapping tools/bin/NAME.real
  local prog name
  prog=$(command -v "$1") || { echo "gpu_bundle: no $1 here" >&2; exit 2; }
  name=$(basename "$1")
  shift
  cp -L "$prog" "$stage/tools/bin/$name.real"
  ldd "$prog" | awk '/=> \//{print $1, $3}' | while read -r lib path; do
    [[ $lib =~ ^(libc\.so|libm\.so|ld-linux|libpthread|libdl\.so|librt\.so) ]] && continue
    [[ $packed == *" $lib "* ]] && continue
    cp -L "$path" "$stage/tools/lib/$lib"
  done
  # shellcheck disable=SC2016  # expanded by the wrapper
  printf '#!/bin/sh\nd=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)\nexport %s LD_LIBRARY_PATH="$d/lib:${LD_LIBRARY_PATH:-}"\nexec "$d/bin/%s.real" "$@"\n' \
    "$*" "$name" >"$stage/tools/bin/$name"
  chmod +x "$stage/tools/bin/$name"
}
carry_tool ip
mkdir -p "$stage/tools/units"
cp /lib/systemd/system/*.target "$stage/tools/units/"
# shellcheck disable=SC2016  # expanded by the wrapper
carry_tool systemd-analyze 'SYSTEMD_UNIT_PATH="$d/units"'
[ -d "$build/python" ] && cp -r "$build/python" "$stage/python"
pip_dl() {  # pip_dl DIR -r FILE: wheels for CPython 3.12 x86-64, no deps resolved (all pinned)
  local dir=$1
  shift
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$@"
}
pip_dl "$stage/wheels/openai" -r tests/e2e/openai_client/requirements.txt
pip_dl "$stage/wheels/grpc" -r bench/gpu_python_requirements.txt
cache() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
printf 'HMOE_BUILT_SOURCE_DIR=%q\nHMOE_BUILT_BINARY_DIR=%q\n' \
  "$(cache CMAKE_HOME_DIRECTORY)" "$(cache CMAKE_CACHEFILE_DIR)" >"$stage/paths.env"
tar -cJf "$out/extras.txz" -C "$stage" .
# What a device call carries: tracked and untracked-not-ignored files, and these two.
repo=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null |
  awk '{s += $1} END {print s + 0}')
total=$((repo + $(stat -c %s "$out/b.txz") + $(stat -c %s "$out/extras.txz")))
ls -la "$out/b.txz" "$out/extras.txz"
echo "gpu_bundle: with the repository's $((repo / 1048576)) MiB: $((total / 1048576)) MiB carried"
if ((total > 62 * 1048576)); then
  echo "gpu_bundle: over 62 MiB: a device call carries 64 MiB at most" >&2
  exit 1
fi
