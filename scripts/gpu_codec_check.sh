#!/usr/bin/env bash
# One call on the GPU machine that checks the lossless codec: the Triton decoder against the CPU reference
# bit for bit (and a GPU encode against the CPU one), then the decode throughput, decode next to compute,
# and compressed copy + decode behind the link. Needs no carried wheels (torch + triton are on the image,
# hypothesis only for tests/test_codec.py). Fits well inside a 10-minute device call.
#   device tool: command: bash scripts/gpu_codec_check.sh
set -u
export PYTHONPATH="$PWD/src:$PWD/tests:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== GPU tests"
python3 -m pytest tests/test_codec_gpu.py -m gpu -q -p no:cacheprovider 2>&1 | tail -6
echo "== decode benchmark"
python3 -m benchmarks.codec_decode 2>&1 | tail -40
