#!/bin/bash
# HTTP vs gRPC streaming chat tok/s at batch 1 on the fortunes fixture, cuda backend.
mkdir -p /tmp/b && tar xzf .gpu/h.tgz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib UCX_MODULE_DIR=/tmp/b/lib/ucx
bin=/tmp/b/bin
m=tests/fixtures/ds3_fortunes
nvidia-smi --query-gpu=name --format=csv,noheader
$bin/hmoe-expert-service --model-dir $m --format bf16 --listen 127.0.0.1:0 --port-file /tmp/ep > /tmp/es.log 2>&1 &
for i in $(seq 100); do [ -s /tmp/ep ] && break; sleep 0.1; done
for backend in cuda cpu; do
  rm -f /tmp/gp /tmp/hp
  $bin/hmoe-gpu-worker --model $m --experts 127.0.0.1:$(cat /tmp/ep) --transport shm --backend $backend \
    --listen 127.0.0.1:0 --port-file /tmp/gp --http-listen 127.0.0.1:0 --http-port-file /tmp/hp > /tmp/w-$backend.log 2>&1 &
  w=$!
  for i in $(seq 300); do [ -s /tmp/hp ] && [ -s /tmp/gp ] && break; sleep 0.1; done
  for mt in 64 256; do
    echo "backend $backend max_tokens $mt"
    $bin/hmoe bench-http --server 127.0.0.1:$(cat /tmp/gp) --http http://127.0.0.1:$(cat /tmp/hp) --requests 30 --max-tokens $mt | tee -a $OUT/bench_http.jsonl
  done
  kill $w; wait $w
  tail -3 /tmp/w-$backend.log
done
