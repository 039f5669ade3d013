#!/usr/bin/env bash
# Installs the Debian 12 packages hybridmoe needs. Idempotent: packages
# already present are left alone. Run as root.
#
#   bash deploy/install-deps.sh          the main job: build the programs and
#                                        run them (deploy/quickstart.sh)
#   bash deploy/install-deps.sh --tests  that, and what the tests need
#                                        (deploy/run-tests.sh): GoogleTest,
#                                        the sanitizer and fuzz toolchain,
#                                        Bazel, promtool, the OpenAI client's
#                                        venv, systemd-analyze, ip netns
set -euo pipefail
usage() { echo "usage: $0 [--tests]" >&2; exit 2; }
tests=0
case ${1:-} in
  "") ;;
  --tests) tests=1 ;;
  *) usage ;;
esac
(($# <= 1)) || usage
# Build and run: compilers and CMake, the libraries the programs link, the
# Python client's gRPC (sdk/python).
main=(
  build-essential cmake ninja-build ccache pkg-config git python3
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libdnnl-dev libucx-dev
  nlohmann-json3-dev libpcre2-dev libnuma-dev libhwloc-dev libsystemd-dev libcpp-httplib-dev
  libssl-dev
  python3-grpcio python3-protobuf
)
# The tests only.
test=(
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  clang libclang-rt-14-dev  # the ASan + UBSan build and the libFuzzer targets
  bazel-bootstrap           # the Bazel build beside CMake (bazel/README.md), offline
  prometheus                # promtool: tests check the rendered /metrics text
  python3-venv              # the official OpenAI client's venv (HTTP API test)
  systemd                   # systemd-analyze verify on deploy/systemd
  iproute2                  # ip netns: UCX across network namespaces
  procps ucx-utils
)
pkgs=("${main[@]}")
((tests)) && pkgs+=("${test[@]}")
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
  # Only prometheus' promtool is wanted (tests check /metrics with it): the
  # server the package enables on install is stopped and disabled again.
  if [[ " ${missing[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null &&
    systemctl is-system-running >/dev/null 2>&1; then
    systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
else
  echo "install-deps: all ${#pkgs[@]} packages present ($( ((tests)) && echo "main job and tests" || echo "main job"))"
fi
