#!/usr/bin/env bash
# The main job, from a fresh Debian 12 machine (as root): install what the
# project needs, build it, and run it on the bundled tiny model.
#
# Today (until the serving issue lands) the job is `hmoe inspect`: it reads the
# bundled checkpoint strictly (safetensors + config + weight map), and sizes a
# real DeepSeek-V3 against this machine's class of DRAM bandwidth.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build --target hmoe -j"$(nproc)"

model=tests/fixtures/ds3_fortunes
[ -d "$model" ] || model=tests/fixtures/deepseek_v3_tiny
echo "== hmoe inspect $model"
build/bin/hmoe inspect "$model"
echo
echo "== hmoe inspect tests/fixtures/configs/deepseek_v3_published --dram-gbps ${DRAM_GBPS:-92}"
build/bin/hmoe inspect tests/fixtures/configs/deepseek_v3_published --dram-gbps "${DRAM_GBPS:-92}"
