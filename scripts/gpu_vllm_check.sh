#!/usr/bin/env bash
# vLLM on the GPU machine (issue 13, Must 6). Needs vLLM 0.26.0 (the newest release pinning the image's torch
# 2.11) and its small dependencies, carried in .vllm_carry (built by scripts/vllm_gpu_carry.sh; two calls,
# see the header of scripts/gpu_vllm_env.sh, which this script sources: it unpacks what the call carried into
# /tmp/site and installs flextensor there with its entry point, so vLLM finds the plugin).
#   PART=0: import check + the vLLM tests on the GPU (tiny Llama; compiled mode without CUDA graphs);
#           TESTS="-k expr" picks some.
#   PART=save: save the random Llama-3.1-8B checkpoint (once per machine, while it stays warm).
#   PART=1: batch 1 and 32 (BATCHES) for each of METHODS (default: native flextensor uva prefetch;
#           flextensor_lossless: flextensor with compression="lossless"), one engine per method.
#           BENCH_ARGS go to benchmarks.vllm_serve (e.g. "--decode-tokens 16 --warmup 1").
set -u
source "$(dirname "$0")/gpu_vllm_env.sh"
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0} HF_HUB_OFFLINE=1
model=${MODEL:-/tmp/llama8b}
out=${OUT:-benchmarks/results}/vllm_serve.jsonl
case "${PART:-0}" in
0)
    python3 -c "import vllm, vllm._C_stable_libtorch; from vllm import LLM; print('vllm', vllm.__version__)" || exit 1
    python3 -c "from importlib.metadata import entry_points as e; print([p.value for p in e(group='vllm.general_plugins')])"
    python3 -m pytest tests/test_vllm.py -q -p no:cacheprovider -x ${TESTS:-} 2>&1 | tail -15
    ;;
save)
    [ -f "$model/config.json" ] || python3 -m benchmarks.vllm_serve --save "$model"
    du -sh "$model"
    ;;
*)
    [ -f "$model/config.json" ] || python3 -m benchmarks.vllm_serve --save "$model"
    batch=${BATCHES:-1,32}
    for method in ${METHODS:-native flextensor uva prefetch}; do
        # native at a utilization where the whole model fits; the others where it does not
        util=$([ "$method" = native ] && echo 0.3 || echo 0.11)
        extra=""
        if [ "$method" = flextensor_lossless ]; then method=flextensor; extra="--compression lossless"; fi
        timeout "${METHOD_TIMEOUT:-170}" python3 -m benchmarks.vllm_serve --model "$model" --method "$method" $extra \
            --batch "$batch" --gpu-memory-utilization "$util" --out "$out" ${BENCH_ARGS:-} 2>&1 \
            | grep -E '^\{|Error|error:' | tail -3
    done
    ;;
esac
