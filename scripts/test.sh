#!/usr/bin/env bash
# Sets up .venv (idempotent) and runs the whole test suite, slow tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
