#!/usr/bin/env bash
# One call on the GPU machine that checks the lossless codec: the Triton decoder against the CPU reference
# bit for bit (and a GPU encode against the CPU one), then the decode throughput, decode next to compute,
# and compressed copy + decode behind the link. Fits well inside a 10-minute device call.
# MICRO=0 skips the decoder's own benchmark. ENGINE=1 (default) then benchmarks offload() with
# compression on llama32_decode_b1 and llama32. WAN=1 adds wan20 at 5.7 GB with and without compression
# (issue 16's "unchanged" target; up to 420 s: run it with MICRO=0 ENGINE=0 to fit one call).
#   device tool: carry [".whl"] (pydantic), command: bash scripts/gpu_codec_check.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== GPU tests"
python3 -m pytest tests/test_codec_gpu.py -m gpu -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tail -${TEST_TAIL:-6}
if [ "${MICRO:-1}" = 1 ]; then
    echo "== decode benchmark"
    python3 -m benchmarks.codec_decode 2>&1 | tail -40
fi
if [ "${ENGINE:-1}" = 1 ]; then
    # Compressed streaming end to end (issue 16, Must 4): decode at batch 1 and prefill under a budget,
    # with and without compression, in one invocation each (the same process order every time).
    out=${OUT:-benchmarks/results}
    export FLEXTENSOR_BENCH_CACHE=${FLEXTENSOR_BENCH_CACHE:-/tmp/ftcache}
    python3 -m benchmarks.run --workload llama32_decode_b1 --device cuda --out "$out" --deadline 200 \
        --timeout 120 --min-steps 5 --methods "native,ours_budget:8GiB,ours_budget:8GiB/compression=lossless" \
        2>&1 | tail -6
    python3 -m benchmarks.run --workload llama32 --device cuda --out "$out" --deadline 200 --timeout 120 \
        --min-steps 5 --methods "native,ours_budget:6GiB,ours_budget:6GiB/compression=lossless" 2>&1 | tail -6
fi
if [ "${WAN:-0}" = 1 ]; then
    out=${OUT:-benchmarks/results}
    export FLEXTENSOR_BENCH_CACHE=${FLEXTENSOR_BENCH_CACHE:-/tmp/ftcache}
    python3 -m benchmarks.run --workload wan20 --device cuda --out "$out" --deadline 420 --timeout 150 \
        --min-steps 5 --methods "native,ours_budget:5.7GB,ours_budget:5.7GB/compression=lossless" 2>&1 | tail -6
fi
