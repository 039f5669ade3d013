#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/: clang, ASan + UBSan) in
# build-fuzz/ and runs each for FUZZ_SECONDS (default 30) from its seed
# corpus (tests/fuzz/corpus/<target>/, read only; what it finds goes to a
# scratch directory). Any crash, sanitizer report, leak, input slower than
# 10 s or RSS over 2 GiB fails the run; the input that did it is kept in
# FUZZ_ARTIFACTS (default build-fuzz/artifacts/) and its path printed.
#
#   bash deploy/run-fuzz.sh [TARGET ...]   (default: every target)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${FUZZ_SECONDS:-30}
artifacts=${FUZZ_ARTIFACTS:-$PWD/build-fuzz/artifacts}
targets=("$@")
((${#targets[@]})) || targets=(safetensors config tokenizer generate_request expert_protocol chat_template openai_request)
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DHMOE_FUZZ=ON -DHMOE_BUILD_BENCH=OFF -DHMOE_BUILD_TESTS=OFF \
  >/dev/null
cmake --build build-fuzz -j"$(nproc)" --target hmoe-fuzz-all
mkdir -p "$artifacts"
failed=0 passed=0
for t in "${targets[@]}"; do
  scratch=$(mktemp -d)
  log="$artifacts/$t.log"
  echo "== fuzz $t: ${secs} s"
  if ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    build-fuzz/bin/hmoe-fuzz-"$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$artifacts/$t-" "$scratch" "tests/fuzz/corpus/$t" \
    >"$log" 2>&1; then
    echo "   ok: $(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}') inputs, $(ls "$scratch" | wc -l) new corpus entries"
    passed=$((passed + 1))
  else
    echo "   FAILED ($log):"
    grep -E "ERROR|SUMMARY|Test unit written|==[0-9]+==" "$log" | head -20
    failed=$((failed + 1))
  fi
  rm -rf "$scratch"
done
echo "fuzz: $passed passed, $failed failed"
((failed == 0))
