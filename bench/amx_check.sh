#!/usr/bin/env bash
# One pass of the CPU-expert checks that need an AMX machine, for a single
# device call: the AMX tests, the micro-kernel probe, the tuning knobs
# compared in one process (interleaved reps, same weights, each row with its
# phase profile), the kernel probe
# and the issue-4 table. Results go to OUT_DIR (text files, plus bench.json).
#
#   bench/amx_check.sh [BIN_DIR] [OUT_DIR]
#   TUNE="D:;T0:HMOE_AMX_TAIL16=0" REPS=3 bench/amx_check.sh /tmp/b/bin "$OUT"
#   MICRO=0 ROWS=0 PROBE=0 TABLE=0 ...: without the micro-probe / its --rows
#   case / the kernel probe / the table
#
# Every step has its own time limit and the script goes on after a failure,
# so one slow or failing step does not cost the rest of the call; the limits
# add up to 630 s: MICRO=0 (590 s) or PROBE=0 (590 s) stays under the
# device tool's 600 s per call. The AMX model's tests (*AmxEmulation*) are
# left to CI: the AMX machine runs the same code paths on the hardware
# (*AmxTuning*: every knob setting; MoeKernelTest, LongK included: the rest).
set -uo pipefail
bin=${1:-build/bin}
out=${2:-.}
reps=${REPS:-3}
# The open question of run 6 (bench/results/README.md): kc 512 (its other
# one, kc 512 + edge, went with the edge knob).
tune=${TUNE:-"D:;K5:HMOE_AMX_KC_BYTES=512"}
micro=${MICRO:-1}
rows=${ROWS:-1}
probe=${PROBE:-1}
table=${TABLE:-1}
mkdir -p "$out"

step() {  # step NAME SECONDS CMD...: runs CMD under a time limit, output to OUT/NAME.txt
  local name=$1 secs=$2
  shift 2
  echo "== $name: $*"
  timeout "$secs" "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  echo "rc=$rc" >>"$out/$name.txt"
  echo "   rc=$rc"
}

(lscpu; grep -m1 MHz /proc/cpuinfo) >"$out/machine.txt" 2>&1
step tests 160 "$bin/hmoe-tests" \
  --gtest_filter='*MoeKernelTest*amx*:LongK/MoeKernelTest*:Moe*:Dispatch*:*AmxTuning*'
grep -E "PASSED|FAILED|SKIPPED" "$out/tests.txt" | tail -3
[ "$micro" = 1 ] && step microprobe 40 "$bin/hmoe-amx-microprobe" 16 0.1
[ "$rows" = 1 ] && step rows 20 "$bin/hmoe-amx-microprobe" --rows 16 0.1 && cat "$out/rows.txt"
step tune "${TUNE_SECS:-200}" env HMOE_PROFILE=1 "$bin/hmoe-bench-moe" --preset "${TUNE_PRESET:-ds-v3}" --T 8192 \
  --format int8,bf16 --min-time 0.2 --no-onednn --reps "$reps" --tune "$tune" --row-limits
grep -E "^ds-v3|phases" "$out/tune.txt"
[ "$probe" = 1 ] && step kernel_probe 40 "$bin/hmoe-bench-moe" --preset ds-v3 --kernel-probe --min-time 0.15
[ "$table" = 1 ] && step table 170 "$bin/hmoe-bench-moe" --preset ds-v3,qwen3-30b --T 1,8,128,8192 \
  --format int4,int8,bf16 --min-time 0.3 --row-limits --json "$out/bench.json"
[ "$table" = 1 ] && grep -E "^(ds-v3|qwen3)" "$out/table.txt"
