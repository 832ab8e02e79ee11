#!/usr/bin/env bash
# Wheels the GPU machine's image lacks (it has torch, transformers, accelerate and peft; no network):
# optuna (the search) and torchao (fp8), for its Python 3.12, into .gpu_wheels/ (git-ignored), to carry
# with the device call. On the device:
#   python3 -m pip install -q --no-index --find-links .gpu_wheels optuna torchao && PYTHONPATH=src python3 benchmarks/gpu.py
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu_wheels
python3 -m pip download -q -d .gpu_wheels --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --implementation cp optuna alembic sqlalchemy colorlog mako tqdm pyyaml greenlet 'torchao<0.17'  # 0.16: the release after 0.15.1 (built against torch 2.10), for the image's torch 2.11
du -sh .gpu_wheels
