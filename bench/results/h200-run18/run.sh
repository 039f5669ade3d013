# Run 18, call 1: the CUDA tests changed since run 17 (GEMM attention's
# three variants, streamed-expert prefetch) and the rest of the backend and
# serving checks, then qwen3-30b's 8192-token prefill sweep.
set -u
mkdir -p /tmp/b && tar xzf .gpu/b.tgz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib UCX_MODULE_DIR=/tmp/b/lib/ucx HMOE_SOURCE_DIR=$PWD
mkdir -p build && ln -sfn /tmp/b/bin build/bin
B=/tmp/b/bin
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/machine.txt; lscpu | head -20 >> $OUT/machine.txt
KERNEL_SECS=150 KERNELS=1 BACKEND=1 SERVE=1 \
  BACKEND_FILTER='StreamedExperts.*:*CudaVsCpu*:*CudaGemmAttention*:CudaBackend.*:ModelBackend.*:Backends/*:*CudaGraphs*:InProcessSlots*:DriverHealth*:Fixtures/CudaStreamed*:Fixtures/CudaHot*:GemmAttention.*:PrefillPlan*' \
  bash bench/gpu_check.sh $B $OUT 2>&1 | grep -v "^\[  PASSED\|OK \]" | head -60
grep -h "gemm attn\|held-out\|\[ prefetch \]" $OUT/kernels.txt $OUT/backend.txt | head -40
grep -h "Failure" -A6 $OUT/kernels.txt $OUT/backend.txt $OUT/serving.txt | head -40
timeout ${QWEN_SECS:-330} $B/hmoe-bench-e2e --bin-dir $B --preset qwen3-30b --format int4 \
  --prompts 128 --batches 1 --prefill-sweep cpu,stream,stream-serial,auto --prefill-sweep-prompt 8192 \
  --json $OUT/e2e-qwen3.json > $OUT/e2e-qwen3.txt 2>&1; echo qwen3 rc=$?
grep -v '^$' $OUT/e2e-qwen3.txt | grep -v "hmoe cuda backend: device\|routed experts through\|starting \|DRAM read," | tail -18
