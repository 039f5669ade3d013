set -u
mkdir -p /tmp/b && tar xzf .gpu/b.tgz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib UCX_MODULE_DIR=/tmp/b/lib/ucx HMOE_SOURCE_DIR=$PWD
mkdir -p /work/main/build && ln -sfn /tmp/b/bin /work/main/build/bin
BACKEND_FILTER='*CudaVsCpu*:CudaBackend.*:ModelBackend.*:Backends/*:*CudaGraphs*:InProcessSlots*:DriverHealth*:PoolRoutedExperts.*:Fixtures/CudaHot*:*RoutingStats*' \
SERVE_FILTER='Serving*:TrainedModel*:*Worker*:E2e*' E2E_RUNS="" bash bench/gpu_check.sh /tmp/b/bin $OUT
grep -E "Failure|FAILED" $OUT/*.txt | head -30
timeout 200 /tmp/b/bin/hmoe-bench-e2e --bin-dir /tmp/b/bin --preset qwen3-30b --format int4 --prompts 256 --batches 1,8 --path-sweep device,copy --defer-sweep 0,2 --json $OUT/e2e-qwen3.json > $OUT/e2e-qwen3.txt 2>&1; echo e2e rc=$?
grep -v '^$' $OUT/e2e-qwen3.txt | tail -30
