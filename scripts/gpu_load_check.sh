#!/usr/bin/env bash
# Loading from a checkpoint on the GPU machine (issue 15, Must 6), then the codec's GPU check: wan20's
# weights file (the suite's cache, built once per machine) loaded by offload(weights=) against native's
# load_file + .to(), warm and cold page cache, then with an 8 GiB host budget and 5.7 GB of GPU memory so
# that the units beyond the host budget stream from the file (the disk tier). Fits a 10-minute device call.
#   device tool: carry [".whl"], command: bash scripts/gpu_load_check.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
export FLEXTENSOR_BENCH_CACHE=${FLEXTENSOR_BENCH_CACHE:-/tmp/ftcache}
out=${OUT:-benchmarks/results}
echo "== load, warm page cache"
python3 -m benchmarks.load --workload wan20 --methods ours,native --result "$out/load-warm.json" \
    --touch-host-memory 64 2>&1 | grep -E "^(wan20|warming|ours|native|disk|host)|Error" | tail -8
echo "== load, cold page cache; the host budget with the disk tier"
python3 -m benchmarks.load --workload wan20 --cold --methods ours,native,ours_host:8GiB@5.7GB \
    --result "$out/load-cold.json" 2>&1 | grep -E "^(wan20|ours|native|disk)|Error" | tail -8
echo "== codec"
timeout 150 bash "$(dirname "$0")/gpu_codec_check.sh" 2>&1 | tail -45
