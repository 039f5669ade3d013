#!/usr/bin/env bash
# The main job, from a fresh Debian 12 machine (as root): install what the
# programs need to build and run (deploy/install-deps.sh without --tests: no
# test tools, Bazel or Prometheus), build them, start the pair on the bundled
# tiny trained model (tests/fixtures/ds3_fortunes: DeepSeek-V3 architecture,
# trained on Debian's fortunes), generate text from a prompt, print it with
# tok/s, stop both.
#
#   bash deploy/quickstart.sh ["PROMPT"]
# Environment: MODEL (model dir), TRANSPORT (shm | grpc | ucx; default shm),
# MAX_TOKENS (default 60).
set -euo pipefail
cd "$(dirname "$0")/.."
prompt=${1:-"A wise man once said"}
model=${MODEL:-tests/fixtures/ds3_fortunes}
transport=${TRANSPORT:-shm}

bash deploy/install-deps.sh
echo "== building (first time: a few minutes)"
buildlog=$(mktemp)
if ! { cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo &&
       cmake --build build --target hmoe hmoe-gpu-worker hmoe-expert-service -j"$(nproc)" &&
       # The Python client's stubs (build/python), where grpc_tools are there.
       { ! cmake --build build --target help | grep -q hmoe_python_stubs ||
         cmake --build build --target hmoe_python_stubs; }; } >"$buildlog" 2>&1; then
  tail -n 40 "$buildlog"; echo "quickstart: build failed (full log: $buildlog)"; exit 1
fi
rm -f "$buildlog"

run=$(mktemp -d)
pids=()
stop() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$run"
}
trap stop EXIT
wait_file() {  # path, pid, what
  for _ in $(seq 300); do
    [ -s "$1" ] && return 0
    kill -0 "$2" 2>/dev/null || { echo "quickstart: $3 exited; its log:"; cat "$run/$3.log"; exit 1; }
    sleep 0.1
  done
  echo "quickstart: $3 did not start; its log:"; cat "$run/$3.log"; exit 1
}

echo "== hmoe inspect $model"
build/bin/hmoe inspect "$model" | sed -n '1,12p'

echo "== starting hmoe-expert-service (routed experts, int8 on the CPU)"
build/bin/hmoe-expert-service --model-dir "$model" --format int8 --listen 127.0.0.1:0 \
  --port-file "$run/expert.port" >"$run/expert.log" 2>&1 &
pids+=($!)
wait_file "$run/expert.port" "${pids[-1]}" expert
expert_port=$(cat "$run/expert.port")

echo "== starting hmoe-gpu-worker (attention, router, shared experts; experts over $transport)"
build/bin/hmoe-gpu-worker --model "$model" --listen 127.0.0.1:0 --port-file "$run/worker.port" \
  --experts "127.0.0.1:$expert_port" --transport "$transport" >"$run/worker.log" 2>&1 &
pids+=($!)
wait_file "$run/worker.port" "${pids[-1]}" worker
server=127.0.0.1:$(cat "$run/worker.port")

echo "== hmoe generate -p \"$prompt\""
build/bin/hmoe generate --server "$server" -p "$prompt" --add-special-tokens \
  --max-tokens "${MAX_TOKENS:-60}"
echo "== sampled (temperature 0.8, seed 7)"
build/bin/hmoe generate --server "$server" -p "$prompt" --add-special-tokens \
  --max-tokens "${MAX_TOKENS:-60}" --temperature 0.8 --seed 7
echo "== stopping"
