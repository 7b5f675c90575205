#!/usr/bin/env bash
# Builds .vllm_carry/ (git-ignored) from scratch, here, on a machine that reaches PyPI: vLLM 0.26.0 for the GPU
# machine (Python 3.12, torch 2.11.0+cu130, no internet), stripped to what a dense Llama on Hopper needs, plus
# the small wheels `from vllm import LLM` needs there (the image lacks them). Re-runnable (downloads cached in
# $WORK, default /tmp/vllm_carry_build); ~3 min, mostly xz.
#   .vllm_carry/p1/   vllm-c.tar.xz       _C_stable_libtorch.abi3.so, all archs (imported unconditionally)
#   .vllm_carry/p2/   vllm-py.tar.xz      the .py tree, small .so files, dist-info (entry points)
#                     vllm-fa3.tar.xz     FlashAttention 3 (sm_90 only; without it vLLM picks Triton attention)
#                     xgrammar-slim.tar.xz  xgrammar 0.2.3 without its static library, headers, debug info
#                     wheels/*.whl        the other missing dependencies (cp312 / py3)
#   .vllm_carry/alt/  vllm-c-sm90.tar.xz  _C with every non-sm_90 SASS payload zeroed, offsets kept (NOT YET
#                                         TESTED on a GPU): with it p2 + alt fit in one call
# Dropped: FA2, the MoE/FlashMLA/qutlass kernels, deep_gemm, vllm-rs, the Rust tool parser, JIT headers.
# Use on the GPU machine: scripts/gpu_vllm_env.sh (its header says which carry on which call).
set -euo pipefail
cd "$(dirname "$0")/.."
work=${WORK:-/tmp/vllm_carry_build}
out=.vllm_carry
pip_get="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
# Newest releases before vLLM 0.26.0 (2026-07-25) within its pins; openai < 3 (3.x needs httpx2, not there).
# The pydantic set is the one in .whl/ (scripts/gpu_env.sh). Checked against the image's package list.
# llguidance and xgrammar: vllm.v1.structured_output's class annotations load them on `from vllm import LLM`.
wheels="pydantic==2.13.4 pydantic_core==2.46.4 annotated_types==0.7.0 typing_inspection==0.4.2
  typing_extensions==4.16.0 fastapi==0.136.3 starlette==1.7.0 openai==2.54.0 jiter==0.16.0 distro==1.9.0
  sniffio==1.3.1 openai_harmony==0.0.8 msgspec==0.21.1 pyzmq==27.1.0 cbor2==6.1.3 pybase64==1.4.3
  cachetools==7.2.0 partial_json_parser==0.2.1.1.post7 setproctitle==1.3.7 depyf==0.20.0 astor==0.8.1
  dill==0.4.1 llguidance==1.7.6 apache-tvm-ffi==0.1.10"
rm -rf "$out" "$work/x" && mkdir -p "$out/p1" "$out/p2/wheels" "$out/alt" "$work/x"
[ -f "$work"/vllm-0.26.0-*.whl ] || $pip_get -d "$work" vllm==0.26.0
[ -f "$work"/xgrammar-0.2.3-*.whl ] || $pip_get -d "$work" xgrammar==0.2.3
$pip_get -d "$out/p2/wheels" $wheels
unzip -q "$work"/vllm-0.26.0-*.whl -d "$work/x" -x 'vllm/vllm_flash_attn/_vllm_fa2_C*' 'vllm/_moe_C*' \
    'vllm/_flashmla*' 'vllm/_qutlass_C*' 'vllm/_rust_tool_parser*' 'vllm/vllm-rs' 'vllm/third_party/deep_gemm/_C*' \
    'vllm/third_party/deep_gemm/include/*' 'vllm/third_party/fmha_sm100/cutlass/*' \
    'vllm/third_party/fmha_sm100/csrc/*' '*.cu' '*/static/swagger-ui*' '*.jpg'
# xgrammar's wheel is 45 MB: a static library, C++ headers, and debug info in its bindings; 0.7 MiB without.
unzip -q "$work"/xgrammar-0.2.3-*.whl -d "$work/x" -x 'xgrammar/lib/*' 'xgrammar/include/*'
strip --strip-unneeded "$work/x/xgrammar/libxgrammar_bindings.so"
c=vllm/_C_stable_libtorch.abi3.so fa3=vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so
t() { local f=$1; shift; tar -C "$work/x" --sort=name --owner=0 --group=0 --numeric-owner -cf - "$@" | xz -9e -T0 >"$f"; }
t "$out/p1/vllm-c.tar.xz" "$c"
t "$out/p2/vllm-fa3.tar.xz" "$fa3"
t "$out/p2/vllm-py.tar.xz" --exclude="$c" --exclude="$fa3" vllm vllm-0.26.0.dist-info
t "$out/p2/xgrammar-slim.tar.xz" xgrammar xgrammar-0.2.3.dist-info
# The sm_90-only _C: walk .nv_fatbin's fatbinaries; zero the payload of SASS (kind 2) for another arch and of
# PTX (kind 1) for a newer one. Headers, sizes and offsets stay, so the ELF file is unchanged in layout.
python3 - "$work/x/$c" <<'EOF'
import struct, sys
d = bytearray(open(sys.argv[1], 'rb').read())
shoff, = struct.unpack_from('<Q', d, 0x28); shes, shn, shstr = struct.unpack_from('<HHH', d, 0x3A)
sh = [struct.unpack_from('<IIQQQQIIQQ', d, shoff + i * shes) for i in range(shn)]
name = lambda s: d[sh[shstr][4] + s[0]:d.index(b'\0', sh[shstr][4] + s[0])]
off, size = next((s[4], s[5]) for s in sh if name(s) == b'.nv_fatbin')
pos, zeroed = off, 0
while pos < off + size:
    magic, _, hs, fs = struct.unpack_from('<IHHQ', d, pos)
    if magic != 0xBA55ED50: pos += 8; continue
    e = pos + hs
    while e < pos + hs + fs:
        kind, _, ehs, n = struct.unpack_from('<HHIQ', d, e); sm, = struct.unpack_from('<I', d, e + 28)
        if (kind == 2 and sm != 90) or (kind == 1 and sm > 90): d[e + ehs:e + ehs + n] = bytes(n); zeroed += n
        e += ehs + n
    pos += hs + fs
open(sys.argv[1], 'wb').write(d); print('sm90-only _C: zeroed %.1f of %.1f MiB fatbin' % (zeroed / 2**20, size / 2**20))
EOF
t "$out/alt/vllm-c-sm90.tar.xz" "$c"
du -b "$out"/*/*.tar.xz "$out"/p2/wheels | awk '{printf "%7.2f MiB  %s\n", $1 / 2^20, $2}'
