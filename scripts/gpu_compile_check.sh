#!/usr/bin/env bash
# One call on the GPU machine for torch.compile and CUDA graphs: the GPU tests (all of them), then the
# compiled benchmarks. PART=1 (default): tests + wan20 regional compile against native compiled and
# flextensor 0.5.0's compile_fn. PART=2: llama32 prefill compiled whole, and llama32_decode_b1_static with CUDA
# graphs (reduce-overhead) against native with and without graphs. Each part fits a 10-minute call.
#   device tool: carry [".whl"], command: PART=1 bash scripts/gpu_compile_check.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
export FLEXTENSOR_BENCH_CACHE=${FLEXTENSOR_BENCH_CACHE:-/tmp/ftcache}
out=${OUT:-benchmarks/results}
start=$SECONDS
if [ "${PART:-1}" = 1 ]; then
    python3 -m pytest tests/test_gpu.py tests/test_gpu_compile.py -q -p no:cacheprovider -x 2>&1 | tail -15
    left=$((570 - (SECONDS - start)))
    python3 -m benchmarks.run --workload wan20 --device cuda --out "$out" --deadline "$left" --timeout 200 \
        --min-steps 5 --methods "native/compile=regional,ours_budget:5.7GB/compile=regional,flextensor050/compile=regional" 2>&1 | tail -6
else
    python3 -m benchmarks.run --workload llama32 --device cuda --out "$out" --deadline 250 --timeout 150 \
        --min-steps 5 --methods "native/compile=whole,ours_budget:8GiB/compile=whole" 2>&1 | tail -5
    left=$((570 - (SECONDS - start)))
    python3 -m benchmarks.run --workload llama32_decode_b1_static --device cuda --out "$out" --deadline "$left" \
        --timeout 150 --min-steps 5 \
        --methods "native,native/compile=graphs,ours_budget:8GiB,ours_budget:8GiB/compile=graphs" 2>&1 | tail -7
fi
