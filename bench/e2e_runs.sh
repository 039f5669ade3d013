#!/usr/bin/env bash
# hmoe-bench-e2e over several presets, one process each (its own DRAM probe,
# service and checkpoint), tables and JSON side by side:
#
#   bench/e2e_runs.sh BIN_DIR OUT_DIR [PRESET ...]     (default: qwen3-30b ds-v3)
#
# BIN_DIR holds hmoe-bench-e2e and hmoe-expert-service (e.g. /tmp/b/bin on the
# GPU machine, build/bin here). Environment: FORMAT (int4), TRANSPORT (shm),
# BACKEND (cuda), EXTRA (more flags for every run, e.g. "--gpu-mem-gb 40");
# SMOKE=1 runs a tiny truncated shape on the CPU backend instead (2 layers,
# a 4096 vocabulary, 16-token prompts: a check that the pair runs, not a
# measurement). Writes OUT_DIR/e2e-PRESET.txt and .json; exits non-zero if any
# run failed (the others still run).
set -uo pipefail
bin=$1
out=$2
shift 2
presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=(qwen3-30b ds-v3)
mkdir -p "$out"
flags=(--format "${FORMAT:-int4}" --transport "${TRANSPORT:-shm}" --backend "${BACKEND:-cuda}")
if [ "${SMOKE:-0}" = 1 ]; then
  flags=(--format "${FORMAT:-int4}" --transport "${TRANSPORT:-shm}" --backend cpu --vocab 4096
    --prompts 16 --batches 1,2 --decode-steps 4 --probe-bytes 512 --probe-reps 2)
fi
failed=0
for p in "${presets[@]}"; do
  layers=()
  if [ "${SMOKE:-0}" = 1 ]; then
    case $p in
      ds-v3 | glm-4.5) layers=(--layers 4) ;;  # 3 dense + 1 MoE
      ds-v2-lite) layers=(--layers 2) ;;
      *) layers=(--layers 2) ;;
    esac
  fi
  echo "== $p: $bin/hmoe-bench-e2e --preset $p ${layers[*]} ${flags[*]} ${EXTRA:-}"
  # shellcheck disable=SC2086
  "$bin/hmoe-bench-e2e" --preset "$p" "${layers[@]}" "${flags[@]}" ${EXTRA:-} \
    --json "$out/e2e-$p.json" 2>&1 | tee "$out/e2e-$p.txt"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || { echo "== $p failed (exit $rc)"; failed=1; }
done
exit $failed
