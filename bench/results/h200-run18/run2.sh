# Run 18, call 2: ds-v3 (8 layers, 5 MoE) int4, the 8192-token prefill per
# policy of the routed experts, with and without the next layer's upload ahead.
set -u
mkdir -p /tmp/b && tar xzf .gpu/b.tgz -C /tmp/b
export LD_LIBRARY_PATH=/tmp/b/lib UCX_MODULE_DIR=/tmp/b/lib/ucx HMOE_SOURCE_DIR=$PWD
B=/tmp/b/bin
timeout ${DS3_SECS:-585} $B/hmoe-bench-e2e --bin-dir $B --preset ds-v3 --layers 8 --format int4 \
  --prompts 128 --batches 1 --prefill-sweep cpu,stream,auto,stream-serial --prefill-sweep-prompt 8192 \
  --json $OUT/e2e-ds3.json > $OUT/e2e-ds3.txt 2>&1; echo ds3 rc=$?
grep -v '^$' $OUT/e2e-ds3.txt | grep -v "hmoe cuda backend: device\|routed experts through\|starting \|DRAM read," | tail -20
