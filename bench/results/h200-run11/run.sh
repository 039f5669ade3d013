set -u
mkdir -p /tmp/b && tar xzf .gpu/b.tgz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib UCX_MODULE_DIR=/tmp/b/lib/ucx HMOE_SOURCE_DIR=$PWD
mkdir -p /work/main/build && ln -sfn /tmp/b/bin /work/main/build/bin
B=/tmp/b/bin
# 1. The worker binary: --calibrate on the GPU, then a request served with hot experts.
grep -v '^%' tests/fixtures/corpus_heldout.txt | grep -v '^\s*$' | head -60 > /tmp/prompts.txt
rm -f /tmp/w.port
$B/hmoe-gpu-worker --model tests/fixtures/ds3_fortunes --backend cuda --listen 127.0.0.1:0 --port-file /tmp/w.port \
  --calibrate /tmp/prompts.txt --hot-experts-gb 0.002 > $OUT/worker-calibrate.txt 2>&1 &
WP=$!
for i in $(seq 1 60); do [ -s /tmp/w.port ] && break; sleep 1; done
if [ -s /tmp/w.port ]; then
  timeout 30 $B/hmoe generate --server 127.0.0.1:$(cat /tmp/w.port) -p "Old men are fond of" --max-tokens 24 --seed 1 >> $OUT/worker-calibrate.txt 2>&1; echo "generate rc=$?" >> $OUT/worker-calibrate.txt
  timeout 30 $B/hmoe stats --server 127.0.0.1:$(cat /tmp/w.port) >> $OUT/worker-calibrate.txt 2>&1
fi
kill $WP; wait $WP; echo "worker rc=$?" >> $OUT/worker-calibrate.txt
cat $OUT/worker-calibrate.txt | head -30
# 2. Decode with hot experts, zipf-skewed router, ds-v3 truncated int4.
timeout 330 $B/hmoe-bench-e2e --bin-dir $B --preset ds-v3 --layers 8 --format int4 --router-zipf 1 \
  --prompts 512 --batches 1 --hot-sweep 0,8,24 --json $OUT/e2e-ds3-hot.json > $OUT/e2e-ds3-hot.txt 2>&1; echo ds3 rc=$?
grep -v '^$' $OUT/e2e-ds3-hot.txt | grep -v "hmoe cuda backend: device" | tail -22
# 3. qwen3-30b (its router has no bias to skew: the random router's own skew).
timeout 200 $B/hmoe-bench-e2e --bin-dir $B --preset qwen3-30b --format int4 \
  --prompts 512 --batches 1 --hot-sweep 0,4,8,16 --no-probe-after --json $OUT/e2e-qwen3-hot.json > $OUT/e2e-qwen3-hot.txt 2>&1; echo qwen3 rc=$?
grep -v '^$' $OUT/e2e-qwen3-hot.txt | grep -v "hmoe cuda backend: device" | tail -14
