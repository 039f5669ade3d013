#!/usr/bin/env bash
# Installs every Debian 12 package hybridmoe needs to build, test and run.
# Idempotent: packages already present are left alone. Run as root.
set -euo pipefail
pkgs=(
  build-essential cmake ninja-build ccache pkg-config git python3
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libdnnl-dev libucx-dev ucx-utils
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  prometheus  # promtool: tests check the rendered /metrics text
  nlohmann-json3-dev libpcre2-dev libnuma-dev libhwloc-dev libsystemd-dev libcpp-httplib-dev
  systemd iproute2 procps
  python3-grpcio python3-protobuf python3-venv
  clang libclang-rt-14-dev
  bazel-bootstrap  # the Bazel build beside CMake (bazel/README.md), offline
)
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
  echo "install-deps: all ${#pkgs[@]} packages present"
fi
