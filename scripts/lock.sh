#!/usr/bin/env bash
# Refreshes requirements/lock.txt from pyproject.toml's ranges and requirements/pins.txt: the newest versions
# that resolve together, for every platform and Python >= 3.11. Run it, then `bash scripts/test.sh` on a fresh
# clone, and commit the lock with what changed it.
set -euo pipefail
cd "$(dirname "$0")/.."
UV=.venv/bin/uv
[ -x "$UV" ] || { echo "lock.sh: no $UV: run bash scripts/setup.sh first" >&2; exit 2; }
exec "$UV" pip compile pyproject.toml --extra dev --extra ray --extra nixl --universal --python-version 3.11 \
  --constraint requirements/pins.txt --custom-compile-command "bash scripts/lock.sh" --annotation-style line \
  -o requirements/lock.txt "$@"
