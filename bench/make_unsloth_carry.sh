#!/usr/bin/env bash
# Builds .vllm/uns/slim.tgz: Unsloth 2026.10.9's install folder for the H200 (bench/probe_unsloth.py),
# small enough to travel with a device call (~10 MB). Run here, from the repository root (needs pip
# and the network); the H200 side unpacks it to /tmp/slim (bench/device.sh unsloth|vllm nf4).
# What is cut: unsloth's web UI (studio/, unsloth_cli/: 80 MB, never imported by FastLanguageModel)
# and every bitsandbytes library but CUDA 13.0's (the image's torch is cu130) and the CPU one.
set -euo pipefail
W=$(mktemp -d) && trap 'rm -rf "$W"' EXIT
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${TARGET[@]}" -d "$W/whl" unsloth==2026.10.9 unsloth_zoo==2026.10.9 bitsandbytes==0.50.2 \
  trl==1.15.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19
python3 -m pip install -q --no-index --no-deps --no-compile "${TARGET[@]}" --target "$W/slim" "$W"/whl/*.whl
rm -rf "$W/slim/studio" "$W/slim/unsloth/studio" "$W/slim/unsloth_cli" "$W/slim/bin"
find "$W/slim/bitsandbytes" -name 'libbitsandbytes_*.so' ! -name '*_cuda130.so' ! -name '*_cpu.so' -delete
mkdir -p .vllm/uns
if [ -e .vllm/uns/slim.tgz ]; then echo ".vllm/uns/slim.tgz exists: remove it first" >&2; exit 1; fi
tar -C "$W" -czf .vllm/uns/slim.tgz slim
ls -la .vllm/uns/slim.tgz
