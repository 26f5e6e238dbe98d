#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh installs on a GPU machine that has no network:
# Python 3.12, x86-64 Linux, a CUDA build of torch (>= 2.6) preinstalled (torch is NOT fetched).
#
#   bash scripts/fetch_gpu_wheels.sh            # -> .gpu-wheels/ (ignored by git, ~2.5 MB)
#
# Copy the checkout with this folder to the GPU machine. megatron-core 0.19.2 needs Python >= 3.12
# and Requires-Dist torch>=2.6.0, numpy, packaging>=24.2 (its METADATA, read with `unzip -p`;
# everything else there is an optional extra): numpy and torch come with the GPU's Python,
# packaging is fetched in case its own is older. The rest of what the stages import (safetensors,
# PyYAML, tokenizers, transformers, sympy, regex, triton for megatron-core's MoE kernels) must be
# the GPU machine's; gpu_check.sh's env stage records versions and `pip check` there.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.gpu-wheels
mkdir -p "$dest"
wheels=(
  megatron-core==0.19.2   # the newest megatron-core the code is tested against (Python 3.12)
  packaging==26.0         # megatron-core needs >= 24.2
)
python3 -m pip download --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$dest" "${wheels[@]}"
du -sh "$dest"
