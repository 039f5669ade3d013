#!/usr/bin/env bash
# The whole suite (every test of hmoe-tests, all areas) and the 10-minute
# soak on the CUDA backend, on the GPU machine, in two device calls made one
# right after the other (the machine goes back ~30 s after a call ends;
# bench/README.md, "The whole suite on the GPU machine"). From the repository
# root, with .gpu/ (bench/gpu_bundle.sh) carried:
#
#   bench/gpu_suite.sh start [OUT_DIR]    call 1, ~5 min: set-up, the soak started
#                                         in the background (setsid: it outlives
#                                         the call), every test in parallel,
#                                         counts per area
#   bench/gpu_suite.sh collect [OUT_DIR]  call 2: waits for the soak, brings
#                                         back its samples and summary
#
# OUT_DIR defaults to $OUT. Environment: BUNDLE (.gpu/b.txz), EXTRAS
# (.gpu/extras.txz), JOBS (tests at a time; default 8 on 16 cores: each test's
# expert service runs threads on every core, and the soak runs beside them), TEST_SECONDS (per test, as ctest's --timeout: 300),
# SUITE_SECONDS (all of them: 450, so that call 1 ends inside its 600 s),
# SOAK_SECONDS (600), SOAK=0 (no soak), FILTER (a gtest filter: a subset, for a
# re-run of what failed; default every test), COLLECT_SECONDS (call 2's wait: 570),
# ROOT (/tmp: where b/, bx/, hmoe-soak/ and hmoe-suite/ go).
# Files in OUT_DIR: machine.txt, setup.txt (what was brought for the tests
# that skip elsewhere, and what could not be), suite.txt (counts per area,
# each failure and skip with its reason), suite.json, suite-logs.tgz (the
# output of each failed or skipped test); after collect: soak.csv (a row
# every 10 s: RSS, descriptors, shm segments, KV blocks, requests running and
# waiting, shm slots in use, GPU memory), soak.txt (its summary and log tail).
set -uo pipefail
mode=${1:-}
out=${2:-${OUT:-}}
[[ ($mode == start || $mode == collect) && -n $out ]] ||
  { echo "usage: $0 start|collect [OUT_DIR] (OUT_DIR default: \$OUT)" >&2; exit 2; }
mkdir -p "$out"
root=${ROOT:-/tmp}
B=$root/b    # the programs and their libraries
X=$root/bx   # the extras
soak=$root/hmoe-soak  # outlives call 1, read by call 2
export LD_LIBRARY_PATH="$B/lib" UCX_MODULE_DIR="$B/lib/ucx" HMOE_SOURCE_DIR=$PWD

if [[ $mode == collect ]]; then
  wait_s=${COLLECT_SECONDS:-570}
  [ -f "$soak/started" ] || { echo "no soak was started on this machine (call 1 first, on the same machine)" | tee "$out/soak.txt"; exit 1; }
  for ((i = 0; i < wait_s; i += 5)); do
    [ -f "$soak/rc" ] && break
    sleep 5
  done
  {
    if [ -f "$soak/rc" ]; then
      echo "soak ended: exit status $(cat "$soak/rc") after $(($(stat -c %Y "$soak/rc") - $(cat "$soak/started"))) s"
    else
      echo "soak still running after $(($(date +%s) - $(cat "$soak/started"))) s: what it sampled so far"
    fi
    grep -E '^\[ soak|^\[  (PASSED|FAILED|SKIPPED) |Failure|Expected|Which is|actual|grew|at rest' \
      "$soak/soak.log"
    echo "== log tail"
    tail -n 60 "$soak/soak.log"
    echo "== nvidia-smi at rest"
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv
  } >"$out/soak.txt" 2>&1
  cp "$soak/samples.csv" "$out/soak.csv" 2>/dev/null
  cat "$out/soak.txt"
  exit 0
fi

t0=$(date +%s)
bundle=${BUNDLE:-.gpu/b.txz}
extras=${EXTRAS:-.gpu/extras.txz}
for f in "$bundle" "$extras"; do
  [ -f "$f" ] || { echo "no $f (bench/gpu_bundle.sh makes it; carry .gpu)" >&2; exit 2; }
done
rm -rf "$B" "$X" && mkdir -p "$B" "$X"
tar xJf "$bundle" -C "$B" && tar xJf "$extras" -C "$X" || exit 1
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; lscpu | head -20;
 uname -a) >"$out/machine.txt" 2>&1

# The tests find files through the folders compiled into them: the source
# tree (check.py, sdk/python, deploy/systemd) and the build tree (bin/,
# python/, openai-venv/). Both are made to lead here.
# shellcheck disable=SC1091
. "$X/paths.env"
{
  src=$HMOE_BUILT_SOURCE_DIR
  bin=$HMOE_BUILT_BINARY_DIR
  if [ ! -e "$src" ]; then
    mkdir -p "$(dirname "$src")" && ln -s "$PWD" "$src"
  elif [ "$(realpath "$src")" != "$(realpath "$PWD")" ]; then
    echo "warning: $src exists here and is not this checkout: tests read files from it"
  fi
  mkdir -p "$bin"
  [ -e "$bin/bin" ] || ln -s "$B/bin" "$bin/bin"
  [ -e "$bin/python" ] || { [ -d "$X/python" ] && cp -r "$X/python" "$bin/python"; }
  echo "source tree $src -> $(realpath "$src"); build tree $bin (bin -> $B/bin)"

  # promtool (Metrics.PromtoolAcceptsARenderedRegistry, the engine's and the
  # HTTP API's /metrics checks): a static binary, at the path the tests use.
  [ -x /usr/bin/promtool ] || install -m 755 "$X/tools/bin/promtool" /usr/bin/promtool
  /usr/bin/promtool --version 2>&1 | head -1

  # Carried tools go on PATH (through $X/path) only where missing and
  # working here. ip(8) for UcxNetns (which also needs root and network
  # namespaces with a veth pair).
  mkdir -p "$X/path"
  export PATH=$PATH:$X/path
  if ! command -v ip >/dev/null; then
    ln -s "$X/tools/bin/ip" "$X/path/ip"
    echo "ip: carried ($(ip -V 2>&1))"
  fi
  # systemd-analyze for Deploy.SystemdUnitsVerify: Debian's, with its
  # libraries and target units, where it verifies a trivial unit here.
  if ! command -v systemd-analyze >/dev/null; then
    probe=$(mktemp -d)
    printf '[Service]\nExecStart=/bin/true\n' >"$probe/hmoe-probe.service"
    if (cd "$probe" && "$X/tools/bin/systemd-analyze" verify --man=no hmoe-probe.service) \
      >"$probe/out" 2>&1; then
      ln -s "$X/tools/bin/systemd-analyze" "$X/path/systemd-analyze"
      echo "systemd-analyze: carried ($(systemd-analyze --version | head -1))"
    else
      echo "systemd-analyze: carried but does not run here, left off PATH (Deploy.SystemdUnitsVerify skips):"
      cat "$probe/out"
    fi
    rm -rf "$probe"
  fi

  # /usr/bin/python3 with gRPC for the Python client's tests (serving_test:
  # PythonClientAgrees and the token / TLS checks): the carried grpcio and
  # protobuf wheels, unpacked into its site-packages when it lacks them.
  [ -x /usr/bin/python3 ] || ln -s "$(command -v python3)" /usr/bin/python3
  if ! /usr/bin/python3 -c 'import grpc, google.protobuf' 2>/dev/null; then
    site=$(/usr/bin/python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mkdir -p "$site"
    for w in "$X"/wheels/grpc/*.whl; do /usr/bin/python3 -m zipfile -e "$w" "$site"; done
  fi
  /usr/bin/python3 -c 'import grpc, google.protobuf as p; print("python3 grpc", grpc.__version__, "protobuf", p.__version__)' 2>&1

  # The OpenAI client's venv (HttpApi.TheOfficialOpenAiClient): made here with
  # this machine's Python (a venv from the development machine names its
  # Python 3.11 by path), the pinned wheels unpacked into it.
  venv=$bin/openai-venv
  if ! "$venv/bin/python" -c 'import openai' 2>/dev/null; then
    rm -rf "$venv"
    if /usr/bin/python3 -m venv --without-pip "$venv"; then
      site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    else  # no venv module: a python that finds the same packages
      site=$venv/site
      mkdir -p "$venv/bin"
      printf '#!/bin/sh\nPYTHONPATH=%s exec /usr/bin/python3 "$@"\n' "$site" >"$venv/bin/python"
      chmod +x "$venv/bin/python"
    fi
    mkdir -p "$site"
    for w in "$X"/wheels/openai/*.whl; do /usr/bin/python3 -m zipfile -e "$w" "$site"; done
  fi
  "$venv/bin/python" -c 'import openai; print("openai venv:", openai.__version__)' 2>&1

} >"$out/setup.txt" 2>&1
cat "$out/setup.txt"

# The soak, 10 minutes on the CUDA backend over shm, in its own session.
if [ "${SOAK:-1}" = 1 ]; then
  soak_s=${SOAK_SECONDS:-600}
  rm -rf "$soak" && mkdir -p "$soak"
  date +%s >"$soak/started"
  # The GPU is the soak's alone once the suite has ended (suite-ended).
  HMOE_SOAK_SECONDS=$soak_s HMOE_SOAK_BACKEND=cuda HMOE_SOAK_SAMPLES=$soak/samples.csv \
    HMOE_SOAK_SAMPLE_SECONDS=10 HMOE_SOAK_GPU_QUIET_FILE=$soak/suite-ended setsid bash -c \
    "timeout -k 10 $((soak_s + 240)) $B/bin/hmoe-tests --gtest_filter='Soak.*' \
       --gtest_output=json:$soak/soak.json >$soak/soak.log 2>&1; echo \$? >$soak/rc" \
    </dev/null >/dev/null 2>&1 &
  echo "soak started (${soak_s} s, backend cuda): $soak"
fi

# Every test of hmoe-tests but the soak (above), one process each as ctest
# runs them, JOBS at a time.
res=$root/hmoe-suite
rm -rf "$res" && mkdir -p "$res"
"$B/bin/hmoe-tests" --gtest_list_tests --gtest_filter="${FILTER:-*}" | awk '
  /^[^ ]/ { suite = $1; next }
  /^  / { name = $1; if (suite != "Soak." && suite !~ /^DISABLED_/ && name !~ /^DISABLED_/) print suite name }
' >"$res/list"
echo "$(wc -l <"$res/list") tests, ${JOBS:-8} at a time"
run_one() {  # run_one INDEX NAME
  echo "$2" >"$res/$1.name"
  timeout -k 10 "${TEST_SECONDS:-300}" "$B/bin/hmoe-tests" --gtest_filter="$2" \
    --gtest_output="json:$res/$1.json" >"$res/$1.log" 2>&1
  echo $? >"$res/$1.rc"
}
export -f run_one
export res B
suite_t0=$(date +%s)
nl -ba -w1 -s' ' "$res/list" |
  timeout -k 10 "${SUITE_SECONDS:-450}" xargs -P "${JOBS:-8}" -L 1 bash -c 'run_one "$0" "$1"'
[ -d "$soak" ] && touch "$soak/suite-ended"
{
  echo "suite: $(($(date +%s) - suite_t0)) s on $(nproc) cores, ${JOBS:-8} tests at a time" \
    "$( [ "${SOAK:-1}" = 1 ] && echo "(the soak started $(($(date +%s) - $(cat "$soak/started"))) s ago)")"
  python3 bench/gpu_tests_summary.py "$res" --json "$out/suite.json"
} >"$out/suite.txt" 2>&1
cat "$out/suite.txt"
# The output of each failed or skipped test.
(cd "$res" && for rc in *.rc; do
   n=${rc%.rc}
   if [ "$(cat "$rc")" != 0 ] || grep -q '^\[  SKIPPED \]' "$n.log"; then echo "$n.log"; fi
 done | tar czf "$out/suite-logs.tgz" -T - 2>/dev/null)
echo "call 1 took $(($(date +%s) - t0)) s; now call 2: bench/gpu_suite.sh collect"
