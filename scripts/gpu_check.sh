#!/usr/bin/env bash
# One call on the GPU machine that checks the engine after a change: the GPU tests, the host-side cost per
# streamed unit (and, when .old_src/src holds an earlier engine, the same for it), then our methods on
# llama32 (host RSS in steady state, step time against native and flextensor 0.5.0) and wan20 (the
# anchor target). Fits a 10-minute device call; results land in $OUT (default benchmarks/results).
#   device tool: carry [".whl", ".old_src"], command: bash scripts/gpu_check.sh
# Fill .whl first with `bash benchmarks/fetch_peer_wheels.sh` on a machine with internet.
set -u
source "$(dirname "$0")/gpu_env.sh"
export FLEXTENSOR_BENCH_CACHE=${FLEXTENSOR_BENCH_CACHE:-/tmp/ftcache}
out=${OUT:-benchmarks/results}
start=$SECONDS
python3 -m pytest tests/test_gpu.py tests/test_gpu_compile.py tests/test_gpu_host_budget.py tests/test_gpu_pipeline.py \
    tests/test_gpu_switch.py tests/test_mapped_units.py tests/test_cudart_calls.py \
    tests/test_checkpoint.py tests/test_editing.py tests/test_codec_gpu.py tests/test_cuda_graphs.py \
    tests/test_docs.py -m gpu -q -p no:cacheprovider --tb=short 2>&1 | tee "$out/gpu_tests.log" | tail -8
echo "== per-unit host overhead (this engine)"
python3 -m benchmarks.overhead --device cuda --compare-plain 2>&1 | tail -5
if [ -d .old_src/src/flextensor ]; then
    echo "== per-unit host overhead (the engine in .old_src)"
    PYTHONPATH="$PWD/.old_src/src:$PWD:/tmp/site" python3 -m benchmarks.overhead --device cuda --skip-scaling 2>&1 | tail -2
fi
python3 -m benchmarks.run --workload llama32 --device cuda --out "$out" --deadline 200 --timeout 90 \
    --min-steps 5 --methods native,ours,ours_budget:6GiB,flextensor050 2>&1 | tail -7
left=$((560 - (SECONDS - start)))
python3 -m benchmarks.run --workload wan20 --device cuda --out "$out" --deadline "$left" --timeout 120 \
    --min-steps 5 --methods native,ours,ours_budget:5.7GB 2>&1 | tail -6
