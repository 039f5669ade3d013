#!/usr/bin/env bash
# Transport overhead per MoE request beyond compute: starts one
# hmoe-expert-service shard with --null-compute (validates, answers zeros) on
# a synthetic H=7168 model and drives it with hmoe-expert-bench over each
# transport at T=1 and T=128.
#
#   bench/transport_overhead.sh [BIN_DIR] [OUT_DIR]
# Targets (issue 5): shm <= 10 us, UCX loopback <= 60 us, gRPC <= 200 us.
set -euo pipefail
bin=${1:-build/bin}
out=${2:-.}
hidden=${HIDDEN:-7168}
iters=${ITERS:-2000}
tmp=$(mktemp -d)
trap 'kill $svc 2>/dev/null || true; wait $svc 2>/dev/null || true; rm -rf "$tmp"' EXIT
export UCX_TLS=${UCX_TLS:-tcp,sm,self}
"$bin/hmoe-expert-service" --synthetic="hidden=$hidden,intermediate=8,experts=8,top_k=8,layers=1" \
  --null-compute --max-tokens=128 --listen=127.0.0.1:0 --port-file="$tmp/port" ${SERVICE_ARGS:-} \
  >"$tmp/service.log" 2>&1 &
svc=$!
for _ in $(seq 200); do [ -s "$tmp/port" ] && break; sleep 0.05; done
[ -s "$tmp/port" ] || { cat "$tmp/service.log"; exit 1; }
port=$(cat "$tmp/port")
echo "transport overhead, H=$hidden, k=8, null compute, $iters iterations, $(nproc) CPUs"
for t in shm ucx grpc; do
  "$bin/hmoe-expert-bench" --targets=127.0.0.1:$port --transport=$t \
    --tokens=1,128 --iters="$iters" --warmup=200 | tee "$out/transport_$t.json"
done
# Shared memory the way the GPU worker uses it: request written and answer read
# in place in the (cudaHostRegister-able) slot, no copies by the transport.
"$bin/hmoe-expert-bench" --targets=127.0.0.1:$port --transport=shm --zero-copy \
  --tokens=1,128 --iters="$iters" --warmup=200 | tee "$out/transport_shm_zero_copy.json"
