#!/usr/bin/env bash
# One device call: scripts/probe_generate.py natively twice (two processes), offloaded under 8 GiB and 6 GiB,
# then the comparison. The weights are generated once and cached in /tmp/ftcache (16 GB).
#   device tool: carry [".whl"], command: source scripts/gpu_env.sh; bash scripts/probe_generate.sh
set -u
export FLEXTENSOR_BENCH_CACHE=${FLEXTENSOR_BENCH_CACHE:-/tmp/ftcache}
rm -rf /tmp/probe_generate
probe() { python3 scripts/probe_generate.py "$@" 2>&1 | grep -v Warning; }
probe native --tag native_a
probe native --tag native_b
probe ours --tag ours_8g --budget 8GiB
probe ours --tag ours_6g --budget 6GiB
probe compare
