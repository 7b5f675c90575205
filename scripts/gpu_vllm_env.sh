# Source on the GPU machine, in the repo root: puts vLLM 0.26.0 into /tmp/site from the parts of .vllm_carry/
# that this call carried (built here by scripts/vllm_gpu_carry.sh; shared/vllm-notes.md says why two calls).
# /tmp/site outlives a call only while the machine is warm (30 s), so make the two calls back to back:
#   call 1: carry [".vllm_carry/p1"]          53 MiB: unpacks the full _C_stable_libtorch
#           command: source scripts/gpu_vllm_env.sh
#   call 2: carry [".vllm_carry/p2"]          28 MiB: unpacks the .py tree, FA3, xgrammar; installs the wheels
#           and flextensor (its vllm.general_plugins entry point)
#           command: PART=0 bash scripts/gpu_vllm_check.sh   (it sources this file)
# One call instead, if the sm_90-only _C works (untested: run one of its kernels, e.g. torch.ops._C.rms_norm):
#   carry [".vllm_carry/p2", ".vllm_carry/alt"]  52 MiB. If it fails, the next call carries p1.
# A full _C (p1) replaces the sm_90-only one (alt), which never replaces a full one already unpacked.
site=${SITE:-/tmp/site}
mkdir -p "$site"
unpack() { tar -xJf "$1" -C "$site" && echo "gpu_vllm_env: unpacked $1" || echo "gpu_vllm_env: FAILED $1" >&2; }
if [ -f .vllm_carry/p1/vllm-c.tar.xz ]; then unpack .vllm_carry/p1/vllm-c.tar.xz && touch "$site/.vllm_c_full"
elif [ -f .vllm_carry/alt/vllm-c-sm90.tar.xz ] && [ ! -f "$site/.vllm_c_full" ]; then
    unpack .vllm_carry/alt/vllm-c-sm90.tar.xz
fi
for t in .vllm_carry/p2/*.tar.xz; do [ -f "$t" ] && unpack "$t"; done
if ls .vllm_carry/p2/wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        .vllm_carry/p2/wheels/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
        --target "$site" . >/dev/null
fi
export PYTHONPATH="$PWD/src:$PWD/tests:$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# FlashInfer is not carried: its sampler is vLLM's default on CUDA and imports it at the first step.
export VLLM_USE_FLASHINFER_SAMPLER=0
for f in vllm/__init__.py vllm/_C_stable_libtorch.abi3.so vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so xgrammar \
    pydantic flextensor-0.1.0.dist-info/entry_points.txt; do
    [ -e "$site/$f" ] || echo "gpu_vllm_env: $site/$f missing (yet)" >&2
done
