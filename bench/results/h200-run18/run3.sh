# Run 18, call 3: why the upload ahead made ds-v3's streamed prefill slower
# (call 2): the streamed experts' timeline per pass, ds-v3 truncated to 6
# layers (3 MoE), stream with and without the upload ahead.
set -u
mkdir -p /tmp/b && tar xzf .gpu/b.tgz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib UCX_MODULE_DIR=/tmp/b/lib/ucx HMOE_SOURCE_DIR=$PWD
mkdir -p build && ln -sfn /tmp/b/bin build/bin
B=/tmp/b/bin
timeout 60 $B/hmoe-tests --gtest_filter='StreamedExperts.*:Fixtures/CudaStreamed*' > $OUT/streamed-tests.txt 2>&1; echo tests rc=$?
grep -E "^\[  (PASSED|FAILED)|prefetch \]" $OUT/streamed-tests.txt | head
timeout 420 $B/hmoe-bench-e2e --bin-dir $B --preset ds-v3 --layers 6 --format int4 \
  --prompts 64 --batches 1 --prefill-sweep stream,stream-serial --prefill-sweep-prompt 8192 \
  --log-prefill-plans on --json $OUT/e2e-ds3-l6.json > $OUT/e2e-ds3-l6.txt 2>&1; echo ds3 rc=$?
grep -v '^$' $OUT/e2e-ds3-l6.txt | grep -v "hmoe cuda backend: device\|routed experts through\|starting \|DRAM read,\|  layer [0-9]* stream\|  layer [0-9]* cpu" | tail -60
