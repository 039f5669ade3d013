#!/usr/bin/env bash
# Transport cost per MoE request beyond compute: starts one
# hmoe-expert-service shard with --null-compute (validates, answers zeros) on
# a synthetic H=7168, k=8 model and drives it with hmoe-expert-bench over each
# transport at T=1 (decode), 128 and 1024 (prefill chunks). Each JSON row has
# the p50 / p99 round trip, the shard's own time and gb_per_s: the bytes one
# call moves (bf16 rows + ids + weights in, f32 rows out) over its p50.
#
#   bench/transport_overhead.sh [BIN_DIR] [OUT_DIR]
#
# UCX runs over loopback TCP alone (UCX_TLS=tcp: as across hosts) for every
# --ucx-fragment-bytes in FRAGS (on the default lanes), then for every
# --ucx-lanes in LANES (both sides; 1 = one connection and one progress
# thread a side, as before lanes; default fragments), then with shared
# memory allowed (tcp,sm,self). The denominator for UCX is UCX's own
# ucx_perftest in the same run (one connection, one thread a side):
# ucp_am_lat one-way times of the same two messages (request, answer)
# added up = the round trip UCX itself needs, and ucp_am_bw of 1 MiB
# messages (streaming). Targets (issues 5 and 33): shm <= 10 us at T=1; UCX
# <= 30 us at T=1 and >= 5 GB/s at T=128 and 1024; gRPC <= 200 us at T=1.
set -euo pipefail
bin=${1:-build/bin}
out=${2:-.}
hidden=${HIDDEN:-7168}
iters=${ITERS:-300}
tokens=${TOKENS:-1,128,1024}
frags=${FRAGS:-0 262144 1048576 4194304}
lanes=${LANES:-1 2 4 8}
perftest=${PERFTEST:-$(command -v ucx_perftest || echo "$bin/ucx_perftest")}
tmp=$(mktemp -d)
svc=
stop() { [ -n "$svc" ] && { kill "$svc" 2>/dev/null || true; wait "$svc" 2>/dev/null || true; }; svc=; }
trap 'stop; rm -rf "$tmp"' EXIT
start() {  # start [service flags...]: one null-compute shard; sets $port
  rm -f "$tmp/port"
  "$bin/hmoe-expert-service" --synthetic="hidden=$hidden,intermediate=8,experts=8,top_k=8,layers=1" \
    --null-compute --max-tokens=1024 --listen=127.0.0.1:0 --port-file="$tmp/port" "$@" \
    ${SERVICE_ARGS:-} >"$tmp/service.log" 2>&1 &
  svc=$!
  for _ in $(seq 200); do [ -s "$tmp/port" ] && break; sleep 0.05; done
  [ -s "$tmp/port" ] || { cat "$tmp/service.log"; exit 1; }
  port=$(cat "$tmp/port")
}
bench() {  # bench NAME FLAGS...
  local name=$1; shift
  "$bin/hmoe-expert-bench" --targets=127.0.0.1:$port --tokens="$tokens" --iters="$iters" \
    --warmup=20 "$@" | sed "s/^{/{\"run\": \"$name\", /" | tee -a "$out/transport.jsonl"
}
: >"$out/transport.jsonl"
echo "transport cost, H=$hidden, k=8, null compute, $iters iterations, $(nproc) CPUs"

export UCX_TLS=tcp
for f in $frags; do
  start --ucx-fragment-bytes="$f"
  bench "ucx-tcp-frag$f" --transport=ucx --ucx-fragment-bytes="$f"
  if [ "$f" = 1048576 ]; then
    bench "ucx-tcp-frag$f-waitspin50" --transport=ucx --ucx-fragment-bytes="$f" --ucx-wait-spin-us=50
  fi
  stop
done
for l in $lanes; do
  start --ucx-lanes="$l"
  bench "ucx-tcp-lanes$l" --transport=ucx --ucx-lanes="$l"
  stop
done
export UCX_TLS=tcp,sm,self
start
bench ucx-tcp-sm --transport=ucx
bench shm --transport=shm
bench grpc --transport=grpc
# Shared memory the way the GPU worker uses it: request written and answer read
# in place in the (cudaHostRegister-able) slot, no copies by the transport.
bench shm-zero-copy --transport=shm --zero-copy
stop

# UCX's own ceiling over loopback TCP for the same messages.
if [ -x "$perftest" ]; then
  export UCX_TLS=tcp UCX_NET_DEVICES=lo
  pt() {  # pt TEST BYTES [ITERS]: one JSON row (ucp_am_lat: one-way times)
    local p=$((20000 + RANDOM % 20000))
    "$perftest" -p $p >"$tmp/pt.log" 2>&1 &
    local s=$!
    sleep 1
    "$perftest" 127.0.0.1 -p $p -t "$1" -s "$2" -n "${3:-100}" 2>&1 | awk -v t="$1" -v b="$2" \
      '/Final/ {printf "{\"run\": \"ucx_perftest\", \"test\": \"%s\", \"bytes\": %s, \"p50_us\": %s, \"mean_us\": %s, \"mb_per_s\": %s}\n", t, b, $3, $4, $7}' |
      tee -a "$out/transport.jsonl"
    wait $s 2>/dev/null || true
  }
  for t in ${tokens//,/ }; do
    pt ucp_am_lat $((t * (2 * hidden + 64)))
    pt ucp_am_lat $((t * 4 * hidden))
  done
  pt ucp_am_bw 1048576 1000
else
  echo "no ucx_perftest ($perftest): no UCX ceiling"
fi
