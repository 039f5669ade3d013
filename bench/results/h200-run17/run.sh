set -u
mkdir -p /tmp/b && tar xzf .gpu/b.tgz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib UCX_MODULE_DIR=/tmp/b/lib/ucx HMOE_SOURCE_DIR=$PWD
mkdir -p /work/main/build && ln -sfn /tmp/b/bin /work/main/build/bin
B=/tmp/b/bin
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/machine.txt; lscpu | head -20 >> $OUT/machine.txt
KERNELS=1 BACKEND=1 SERVE=0 \
  BACKEND_FILTER='*CudaVsCpu*:*CudaGemmAttention*:CudaBackend.*:*CudaGraphs*:Fixtures/CudaStreamed*:Fixtures/CudaHot*:GemmAttention.*:PrefillPlan*' \
  bash bench/gpu_check.sh $B $OUT 2>&1 | grep -v "^\[  PASSED\|OK \]" | head -30
grep -h "gemm attn\|held-out" $OUT/kernels.txt $OUT/backend.txt | head -30
grep -h "Failure" -A6 $OUT/kernels.txt $OUT/backend.txt | head -30
timeout 470 $B/hmoe-bench-e2e --bin-dir $B --preset ds-v3 --layers 8 --format int4 \
  --prompts 128 --batches 1 --prefill-sweep cpu,stream,auto --prefill-sweep-prompt 8192 \
  --json $OUT/e2e-ds3.json > $OUT/e2e-ds3.txt 2>&1; echo ds3 rc=$?
grep -v '^$' $OUT/e2e-ds3.txt | grep -v "hmoe cuda backend: device\|routed experts through\|starting \|DRAM read," | tail -14
