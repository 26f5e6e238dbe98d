#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh installs on a GPU machine that has no network:
# Python 3.12, x86-64 Linux, a CUDA build of torch 2.11 preinstalled (torch is NOT fetched).
#
#   bash scripts/fetch_gpu_wheels.sh            # -> .gpu-wheels/ (ignored by git, ~16 MiB)
#
# The device tool carries at most 64 MiB of ignored paths: keep this folder well under that.
# Versions: what requirements/cpu.txt pins where the code depends on the API (megatron-core
# 0.16.1 has a cp312 wheel, so the API the code targets travels as is); the rest of what
# `import megatron_ba` and the checks need (numpy, safetensors, pyyaml, tokenizers,
# huggingface-hub, sympy, regex, typer, tqdm) is in the GPU image already (its package list:
# /work/.library/device/KINDS.md) and is checked by gpu_check.sh's environment stage.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.gpu-wheels
mkdir -p "$dest"
wheels=(
  megatron-core==0.16.1            # the API the project's code targets (requirements/cpu.txt)
  transformers==5.19.0             # the version the CPU suite runs (the image has 5.17.0)
  packaging==26.0                  # megatron-core needs >= 24.2; the image's is not pinned
  math-verify==0.9.0               # the math reward (rewards/math_answer.py)
  latex2sympy2_extended==1.11.0    # math-verify's LaTeX parser (== pin of math-verify 0.9.0)
  antlr4-python3-runtime==4.13.2   # latex2sympy2_extended's parser runtime (<= 4.13.2)
)
python3 -m pip download --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$dest" "${wheels[@]}"
du -sh "$dest"
