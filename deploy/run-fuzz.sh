#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/: clang, ASan + UBSan) in
# build-fuzz/ (or in FUZZ_BUILD, an HMOE_FUZZ tree configured already: the
# test command's build-asan) and runs each for FUZZ_SECONDS (default 30) from its seed
# corpus (tests/fuzz/corpus/<target>/, read only; what it finds goes to a
# scratch directory). Any crash, sanitizer report, leak, input slower than
# 10 s or RSS over 2 GiB fails the run (targets run FUZZ_JOBS at a time,
# default one per core); the input that did it is kept in
# FUZZ_ARTIFACTS (default build-fuzz/artifacts/) and its path printed.
#
#   bash deploy/run-fuzz.sh [TARGET ...]   (default: every target)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${FUZZ_SECONDS:-30}
build=${FUZZ_BUILD:-build-fuzz}
artifacts=${FUZZ_ARTIFACTS:-$PWD/$build/artifacts}
targets=("$@")
((${#targets[@]})) || targets=(safetensors config tokenizer tiktoken generate_request expert_protocol chat_template openai_request tool_calls)
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true
if [[ -z ${FUZZ_BUILD:-} ]]; then
  cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
    -DCMAKE_CXX_COMPILER=clang++ -DHMOE_FUZZ=ON -DHMOE_BUILD_BENCH=OFF -DHMOE_BUILD_TESTS=OFF \
    >/dev/null
fi
cmake --build "$build" -j"$(nproc)" --target hmoe-fuzz-all
mkdir -p "$artifacts"
# Each target is one process on one core: run as many at once as there are
# cores (FUZZ_JOBS), each for its full FUZZ_SECONDS; print in target order.
jobs=${FUZZ_JOBS:-$(nproc)}
fuzz_one() {  # fuzz_one TARGET: runs it, writes its verdict to $artifacts/TARGET.verdict
  local t=$1 scratch log="$artifacts/$1.log"
  scratch=$(mktemp -d)
  if ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    "$build"/bin/hmoe-fuzz-"$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$artifacts/$t-" "$scratch" "tests/fuzz/corpus/$t" \
    >"$log" 2>&1; then
    echo "   ok: $(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}') inputs, $(ls "$scratch" | wc -l) new corpus entries" >"$artifacts/$t.verdict"
  else
    { echo "   FAILED ($log):"; grep -E "ERROR|SUMMARY|Test unit written|==[0-9]+==" "$log" | head -20; } >"$artifacts/$t.verdict"
  fi
  rm -rf "$scratch"
}
echo "== fuzz ${targets[*]}: ${secs} s each, $jobs at a time"
running=0
for t in "${targets[@]}"; do
  rm -f "$artifacts/$t.verdict"
  if ((running >= jobs)); then
    wait -n
    running=$((running - 1))
  fi
  fuzz_one "$t" &
  running=$((running + 1))
done
wait
failed=0 passed=0
for t in "${targets[@]}"; do
  echo "== fuzz $t"
  cat "$artifacts/$t.verdict"
  if grep -q "^   ok:" "$artifacts/$t.verdict"; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
done
echo "fuzz: $passed passed, $failed failed"
((failed == 0))
