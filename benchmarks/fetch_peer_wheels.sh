#!/usr/bin/env bash
# Download, on a machine with internet, the wheels the benchmark needs on the GPU machine (no internet,
# Python 3.12, x86-64). They land in <repo>/.whl (git-ignored) and travel there with `carry: [".whl"]`.
#
# Why each one: the GPU image has torch, transformers, accelerate, safetensors, psutil, matplotlib, pyyaml,
# rich, scipy, numpy, huggingface_hub, but no diffusers and no pydantic.
#   - diffusers (+ importlib_metadata, lazy_importer): the `wan20`/`wan40` model and `apply_group_offloading`.
#   - pydantic (+ core, annotated-types, typing-inspection, a typing_extensions new enough for it): needed by ours and by flextensor 0.5.0.
#   - flextensor 0.5.0 and its own deps (beartype, proxytypes3, posix-ipc, shared-memory-dict): the peer.
#     It installs into its OWN --target folder because it shares the import name `flextensor` with ours.
#
# On the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
#       $(ls .whl/*.whl | grep -v '/flextensor-') && export PYTHONPATH=/tmp/site
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peer .whl/flextensor-0.5.0-*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
dl() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
        -d .whl "$@"
}
# Pinned: keep exactly one version of each (two versions of one package stop the whole install there).
dl diffusers==0.42.1 importlib_metadata==10.2.0 lazy_importer==0.1.0
dl pydantic==2.13.4 pydantic_core==2.46.4 annotated_types==0.7.0 typing_inspection==0.4.2 typing_extensions==4.16.0
dl flextensor==0.5.0 beartype==0.23.1 proxytypes3==1.0.2 posix_ipc==1.3.2 shared_memory_dict==0.7.2
ls -l .whl
du -sh .whl
