# Run 18, call 4: after the fix (no upload for a layer the GPU took whole):
# the streamed-expert tests, then ds-v3 truncated to 7 layers (4 MoE), int4,
# the 8192-token prefill on the service alone, auto (which streams ds-v3's
# layers, with the upload ahead) and stream without the upload ahead.
set -u
mkdir -p /tmp/b && tar xzf .gpu/b.tgz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib UCX_MODULE_DIR=/tmp/b/lib/ucx HMOE_SOURCE_DIR=$PWD
mkdir -p build && ln -sfn /tmp/b/bin build/bin
B=/tmp/b/bin
timeout 45 $B/hmoe-tests --gtest_filter='StreamedExperts.*:Fixtures/CudaStreamed*' > $OUT/streamed-tests.txt 2>&1; echo tests rc=$?
grep -E "^\[  (PASSED|FAILED)|prefetch \]|stream   \]" $OUT/streamed-tests.txt | head -40
timeout 370 $B/hmoe-bench-e2e --bin-dir $B --preset ds-v3 --layers 7 --format int4 \
  --prompts 128 --batches 1 --prefill-sweep cpu,auto,stream-serial --prefill-sweep-prompt 8192 \
  --log-prefill-plans on --json $OUT/e2e-ds3-l7.json > $OUT/e2e-ds3-l7.txt 2>&1; echo ds3 rc=$?
grep -v '^$' $OUT/e2e-ds3-l7.txt | grep -v "hmoe cuda backend: device\|routed experts through\|starting \|DRAM read,\|  layer [0-9]* stream\|  layer [0-9]* cpu" | tail -45
