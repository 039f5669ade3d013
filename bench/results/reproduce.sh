#!/usr/bin/env bash
# Reproduces the figures of bench/results/README.md on the GPU machine
# (../shared/gpu-machine/README.md), one subject per device call (each stays
# under the 600 s a call may run). From the repository root:
#
#   bench/results/reproduce.sh SUBJECT [OUT_DIR]        (OUT_DIR default: $OUT)
#
#   kernels        hmoe-tests (AMX / MoE kernels), hmoe-bench-moe tables
#   gpu-tests      bench/gpu_check.sh: hmoe-tests-cuda (the whole GPU suite), serving tests
#   decode-qwen3   hmoe-bench-e2e qwen3-30b decode, deferral and path sweeps
#   decode-ds3     the same for ds-v3 truncated to 8 layers
#   hot-ds3        hot experts on the GPU, ds-v3 8 layers, Zipf-biased router
#   prefill-qwen3  8192-token prefill per routed-expert policy, qwen3-30b
#   prefill-ds3    the same for ds-v3 truncated to 7 layers
#   transport      bench/transport_overhead.sh (shm / UCX lanes / gRPC)
#   grpc-ab        gRPC data plane, BASELINE's binaries against BUNDLE's,
#                  alternately, twice (BASELINE: a bundle of the commit before)
#   http           hmoe bench-http: HTTP vs gRPC streaming at batch 1
#   accuracy       hmoe-bench-accuracy on the ds3_fortunes held-out text
#   serve          bench/serve_ab.sh: hmoe bench-serve, CPU reference worker
#
# BUNDLE (default .gpu/b.tgz) is unpacked to /tmp/b first: the build/bin
# programs the subject runs (hmoe-tests, hmoe-tests-cuda, hmoe-bench-moe, hmoe-bench-e2e,
# hmoe-bench-accuracy, hmoe-expert-service, hmoe-expert-bench,
# hmoe-gpu-worker, hmoe, ucx_perftest), packed on the development machine by
#   cmake -S . -B build -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90 && ninja -C build
#   ../shared/gpu-machine/bundle.sh .gpu/b.tgz build/bin/hmoe-tests build/bin/...
set -uo pipefail
subjects=" kernels gpu-tests decode-qwen3 decode-ds3 hot-ds3 prefill-qwen3 prefill-ds3 transport grpc-ab http accuracy serve "
subject=${1:-}
[[ -n $subject && $subjects == *" $subject "* ]] || { echo "usage: $0 SUBJECT [OUT_DIR], SUBJECT one of:$subjects"; exit 2; }
out=${2:-${OUT:?give OUT_DIR or set OUT}}
bundle=${BUNDLE:-.gpu/b.tgz}
[ -f "$bundle" ] || { echo "no bundle $bundle (set BUNDLE)"; exit 2; }
mkdir -p "$out" /tmp/b
tar xzf "$bundle" -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib UCX_MODULE_DIR=/tmp/b/lib/ucx HMOE_SOURCE_DIR=$PWD
B=/tmp/b/bin
# Tests that start helper programs look for them in build/bin.
[ -e build/bin ] || { mkdir -p build && ln -s "$B" build/bin; }
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; lscpu | head -20) \
  >"$out/machine.txt" 2>&1

run() {  # run NAME SECONDS CMD...: CMD's output to OUT/NAME.txt and here
  local name=$1 secs=$2
  shift 2
  echo "== $name: $*" | tee "$out/$name.txt"
  timeout "$secs" "$@" 2>&1 | tee -a "$out/$name.txt"
  echo "rc=${PIPESTATUS[0]}" | tee -a "$out/$name.txt"
}
e2e() {  # e2e NAME SECONDS FLAGS...: one hmoe-bench-e2e process, JSON beside
  local name=$1 secs=$2
  shift 2
  run "$name" "$secs" "$B/hmoe-bench-e2e" --bin-dir "$B" "$@" --json "$out/$name.json"
}
wait_file() {  # wait_file FILE: up to 30 s for a port file
  for _ in $(seq 300); do [ -s "$1" ] && return 0; sleep 0.1; done
  return 1
}

case $subject in
  kernels)  # run 22 (final kernels), then the decode rows of H200 run 8
    run tests 200 "$B/hmoe-tests" \
      --gtest_filter='AmxInt4Stage*:*MoeKernelTest*amx*:LongK/MoeKernelTest*:Moe*:Dispatch*:*AmxTuning*:*KernelTuning*'
    run table-ds3 200 "$B/hmoe-bench-moe" --preset ds-v3 --T 1,8192 --format int4,int8,bf16 \
      --min-time 0.2 --reps 2 --row-limits --json "$out/table-ds3.json"
    run table-qwen3 120 "$B/hmoe-bench-moe" --preset qwen3-30b --T 1,8192 --format int4,int8,bf16 \
      --min-time 0.2 --row-limits --json "$out/table-qwen3.json"
    run decode-int4g64 60 "$B/hmoe-bench-moe" --preset qwen3-30b,ds-v3 --T 1,8 --format int4 \
      --group 64 --routing random --no-onednn
    ;;
  gpu-tests)  # H200 run 18, call 1
    SERVE=1 E2E_RUNS="" bash bench/gpu_check.sh "$B" "$out"
    grep -h "held-out\|\[ cuda/cpu \]" "$out/cuda.txt"
    ;;
  decode-qwen3)  # H200 run 10
    e2e e2e-qwen3 300 --preset qwen3-30b --format int4 --prompts 256 --batches 1,8 \
      --path-sweep device,copy --defer-sweep 0,2
    ;;
  decode-ds3)  # H200 run 8
    e2e e2e-ds3 500 --preset ds-v3 --layers 8 --format int4 --prompts 512 --batches 1,8 \
      --path-sweep device,copy --defer-sweep 0,2
    ;;
  hot-ds3)  # H200 run 14 (its prefill sweep left out: device time ran out there)
    e2e e2e-ds3-hot 500 --preset ds-v3 --layers 8 --format int4 --router-zipf 1 \
      --prompts 512 --batches 1 --hot-sweep 0,8,24
    ;;
  prefill-qwen3)  # H200 run 18, call 1
    e2e e2e-qwen3-prefill 400 --preset qwen3-30b --format int4 --prompts 128 --batches 1 \
      --prefill-sweep cpu,stream,stream-serial,auto --prefill-sweep-prompt 8192
    ;;
  prefill-ds3)  # H200 run 18, call 4
    e2e e2e-ds3-l7-prefill 500 --preset ds-v3 --layers 7 --format int4 --prompts 128 --batches 1 \
      --prefill-sweep cpu,auto,stream-serial --prefill-sweep-prompt 8192 --log-prefill-plans on
    ;;
  transport)  # H200 run 19 (lanes); 4 lanes x 256 KiB fragments are the defaults now
    PERFTEST=$B/ucx_perftest ITERS=200 FRAGS="262144 1048576" LANES="1 2 4 8 16" \
      run transport 450 bash bench/transport_overhead.sh "$B" "$out"
    # The one extra row of the table: defaults with the waiting thread spinning.
    rm -f /tmp/hmoe-t.port
    UCX_TLS=tcp "$B/hmoe-expert-service" --synthetic="hidden=7168,intermediate=8,experts=8,top_k=8,layers=1" \
      --null-compute --max-tokens=1024 --listen=127.0.0.1:0 --port-file=/tmp/hmoe-t.port >"$out/spin-service.log" 2>&1 &
    svc=$!
    wait_file /tmp/hmoe-t.port &&
      UCX_TLS=tcp "$B/hmoe-expert-bench" --targets="127.0.0.1:$(cat /tmp/hmoe-t.port)" --transport=ucx \
        --tokens=1,128,1024 --iters=200 --warmup=20 --ucx-wait-spin-us=50 |
      sed 's/^{/{"run": "ucx-tcp-waitspin50", /' | tee -a "$out/transport.jsonl"
    kill "$svc"
    wait "$svc" 2>/dev/null
    ;;
  grpc-ab)  # H100 run 20: before / after the gRPC copy removal
    base=${BASELINE:?set BASELINE to a bundle of the binaries to compare against}
    mkdir -p /tmp/base && tar xzf "$base" -C /tmp/base
    ab() {  # ab DIR NAME: one null-compute shard of DIR's, driven over gRPC
      rm -f /tmp/hmoe-t.port
      LD_LIBRARY_PATH=$1/lib "$1/bin/hmoe-expert-service" \
        --synthetic="hidden=7168,intermediate=8,experts=8,top_k=8,layers=1" --null-compute \
        --max-tokens=1024 --listen=127.0.0.1:0 --port-file=/tmp/hmoe-t.port >"$out/ab-service.log" 2>&1 &
      local svc=$!
      wait_file /tmp/hmoe-t.port &&
        LD_LIBRARY_PATH=$1/lib "$1/bin/hmoe-expert-bench" --targets="127.0.0.1:$(cat /tmp/hmoe-t.port)" \
          --transport=grpc --tokens=1,128,1024 --iters=150 --warmup=20 |
        sed "s/^{/{\"run\": \"$2\", /" | tee -a "$out/grpc_ab.jsonl"
      kill "$svc"
      wait "$svc" 2>/dev/null
    }
    for _ in 1 2; do
      ab /tmp/base grpc-before
      ab /tmp/b grpc-after
    done
    ;;
  http)  # H200 run 19
    m=tests/fixtures/ds3_fortunes
    rm -f /tmp/hmoe-e.port
    "$B/hmoe-expert-service" --model-dir $m --format bf16 --listen 127.0.0.1:0 \
      --port-file /tmp/hmoe-e.port >"$out/service.log" 2>&1 &
    svc=$!
    wait_file /tmp/hmoe-e.port || { cat "$out/service.log"; exit 1; }
    for backend in cuda cpu; do
      rm -f /tmp/hmoe-g.port /tmp/hmoe-h.port
      "$B/hmoe-gpu-worker" --model $m --experts "127.0.0.1:$(cat /tmp/hmoe-e.port)" --transport shm \
        --backend $backend --listen 127.0.0.1:0 --port-file /tmp/hmoe-g.port \
        --http-listen 127.0.0.1:0 --http-port-file /tmp/hmoe-h.port >"$out/worker-$backend.log" 2>&1 &
      w=$!
      wait_file /tmp/hmoe-g.port && wait_file /tmp/hmoe-h.port
      for mt in 64 256; do
        echo "backend $backend max_tokens $mt"
        "$B/hmoe" bench-http --server "127.0.0.1:$(cat /tmp/hmoe-g.port)" \
          --http "http://127.0.0.1:$(cat /tmp/hmoe-h.port)" --requests 30 --max-tokens $mt |
          tee -a "$out/bench_http.jsonl"
      done
      kill $w
      wait $w
    done
    kill $svc
    wait $svc 2>/dev/null
    ;;
  accuracy)  # H200 run 5
    run accuracy 300 "$B/hmoe-bench-accuracy" --threads 16 --json "$out/accuracy.json"
    ;;
  serve)  # emr16 run 17c's setup, the current worker only (CPU reference backend)
    python3 bench/make_random_checkpoint.py /tmp/hmoe-ds3-h2048-e64
    BIN_DIR=$B SERVICE_THREADS=8 WORKER_THREADS=8 WORKER_ARGS="--backend cpu" CLIENTS=16 \
      REQUESTS=128 MAX_TOKENS=32 REPS=2 run serve 300 bash bench/serve_ab.sh /tmp/hmoe-ds3-h2048-e64 \
      "$B/hmoe-gpu-worker"
    ;;
esac
