set -u
mkdir -p /tmp/b && tar xzf .gpu/b.tgz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib UCX_MODULE_DIR=/tmp/b/lib/ucx HMOE_SOURCE_DIR=$PWD
mkdir -p /work/main/build && ln -sfn /tmp/b/bin /work/main/build/bin
B=/tmp/b/bin
timeout 150 $B/hmoe-tests --gtest_filter='GpuKernelTest.*:Fixtures/CudaHot*:Fixtures/CudaStreamed*:CudaStreamedExpertsOptions.*:*CudaGraphs*:Backends/RoutingStats*' > $OUT/tests.txt 2>&1; echo tests rc=$?
grep -E "^\[  (PASSED|FAILED|SKIPPED)|Failure|\[ hot|\[ stream" $OUT/tests.txt | head -40
timeout 400 $B/hmoe-bench-e2e --bin-dir $B --preset ds-v3 --layers 8 --format int4 --router-zipf 1 \
  --prompts 8192 --batches 1 --hot-sweep 0,8,24 --prefill-sweep cpu,stream,auto \
  --json $OUT/e2e-ds3.json > $OUT/e2e-ds3.txt 2>&1; echo ds3 rc=$?
grep -v '^$' $OUT/e2e-ds3.txt | grep -v "hmoe cuda backend: device\|routed experts through" | tail -30
