#!/usr/bin/env bash
# Serving throughput of one or more hmoe-gpu-worker binaries against one
# expert service (A/B of worker changes, same service, same model):
#
#   bench/serve_ab.sh MODEL_DIR WORKER_BIN [WORKER_BIN ...]
#
# Starts hmoe-expert-service once (FORMAT, default int8; SERVICE_THREADS),
# then for REPS rounds (default 2) each worker in turn (WORKER_THREADS,
# TRANSPORT default shm, WORKER_ARGS more flags, e.g. "--backend cpu") and
# `hmoe bench-serve` with CLIENTS concurrent
# clients, REQUESTS requests of MAX_TOKENS tokens. BIN_DIR holds hmoe and
# hmoe-expert-service (default build/bin). A model to try it on:
# bench/make_random_checkpoint.py /tmp/ds3-h2048-e64.
set -euo pipefail
model=$1
shift
bin=${BIN_DIR:-build/bin}
tmp=$(mktemp -d)
svc=
w=
trap 'kill -TERM $svc $w 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT
wait_port() {  # file pid log
  for _ in $(seq 6000); do
    [ -s "$1" ] && return 0
    kill -0 "$2" 2>/dev/null || { cat "$3"; exit 1; }
    sleep 0.05
  done
  cat "$3"; exit 1
}
"$bin/hmoe-expert-service" --model-dir "$model" --format "${FORMAT:-int8}" --listen 127.0.0.1:0 \
  ${SERVICE_THREADS:+--threads $SERVICE_THREADS} --port-file "$tmp/e.port" >"$tmp/e.log" 2>&1 &
svc=$!
wait_port "$tmp/e.port" $svc "$tmp/e.log"
grep -h "ready:" "$tmp/e.log" || true
echo "bench-serve: $(nproc) CPUs, ${CLIENTS:-16} clients, ${REQUESTS:-32} requests x ${MAX_TOKENS:-16} tokens"
for rep in $(seq "${REPS:-2}"); do
  for worker in "$@"; do
    rm -f "$tmp/w.port"
    # shellcheck disable=SC2086  # WORKER_ARGS: several flags
    "$worker" --model "$model" --listen 127.0.0.1:0 --port-file "$tmp/w.port" \
      ${WORKER_THREADS:+--threads $WORKER_THREADS} ${WORKER_ARGS:-} --experts "127.0.0.1:$(cat "$tmp/e.port")" \
      --transport "${TRANSPORT:-shm}" >"$tmp/w.log" 2>&1 &
    w=$!
    wait_port "$tmp/w.port" $w "$tmp/w.log"
    echo "== round $rep: $worker"
    "$bin/hmoe" bench-serve --server "127.0.0.1:$(cat "$tmp/w.port")" --clients "${CLIENTS:-16}" \
      --requests "${REQUESTS:-32}" --max-tokens "${MAX_TOKENS:-16}" -p "A wise man once said" \
      2>"$tmp/bench.err" | grep -E "completed|throughput|latency ms|first token|error" ||
      { echo "bench-serve printed no results:"; tr '\r' '\n' <"$tmp/bench.err" | tail -5; }
    kill -TERM $w
    wait $w || true
    w=
  done
done
