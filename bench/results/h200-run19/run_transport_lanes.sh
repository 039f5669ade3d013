#!/bin/bash
mkdir -p /tmp/b && tar xzf .gpu/t3.tgz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib UCX_MODULE_DIR=/tmp/b/lib/ucx
bin=/tmp/b/bin
PERFTEST=$bin/ucx_perftest ITERS=200 FRAGS="262144 1048576" LANES="1 2 4 8" timeout 400 bash bench/transport_overhead.sh $bin $OUT > $OUT/transport.txt 2>&1
# Lanes x smaller fragments (more fragments to stripe at T=128).
run() {  # run NAME SERVICE_FLAGS BENCH_FLAGS
  rm -f /tmp/port
  UCX_TLS=tcp $bin/hmoe-expert-service --synthetic="hidden=7168,intermediate=8,experts=8,top_k=8,layers=1" --null-compute --max-tokens=1024 --listen=127.0.0.1:0 --port-file=/tmp/port $2 > /tmp/svc.log 2>&1 &
  local s=$!
  for _ in $(seq 200); do [ -s /tmp/port ] && break; sleep 0.05; done
  UCX_TLS=tcp $bin/hmoe-expert-bench --targets=127.0.0.1:$(cat /tmp/port) --transport=ucx --tokens=1,128,1024 --iters=200 --warmup=20 $3 | sed "s/^{/{\"run\": \"$1\", /" >> $OUT/transport.jsonl
  kill $s; wait $s 2>/dev/null
}
run lanes8-frag256k "--ucx-lanes=8 --ucx-fragment-bytes=262144" "--ucx-lanes=8 --ucx-fragment-bytes=262144"
run lanes16-frag256k "--ucx-lanes=16 --ucx-fragment-bytes=262144" "--ucx-lanes=16 --ucx-fragment-bytes=262144"
run lanes4-frag256k-waitspin "--ucx-lanes=4 --ucx-fragment-bytes=262144" "--ucx-lanes=4 --ucx-fragment-bytes=262144 --ucx-wait-spin-us=50"
python3 - <<'PY'
import json, os
for l in open(os.environ["OUT"] + "/transport.jsonl"):
    j = json.loads(l)
    print(j.get("run"), j.get("tokens", j.get("bytes")), j.get("p50_us"), j.get("gb_per_s", j.get("mb_per_s")))
PY
