#!/usr/bin/env bash
# Sets up the venv (idempotent) and runs the whole test suite, slow tests and the import contracts included.
#   bash scripts/test.sh [pytest args]            on .venv, the locked versions (what CI runs)
#   bash scripts/test.sh --latest [pytest args]   on .venv-latest, the newest releases (drift, on purpose)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
if [ "${1:-}" = "--latest" ]; then
  shift
  VENV=.venv-latest
  bash scripts/setup.sh --latest
else
  bash scripts/setup.sh
fi
export TRITON_INTERPRET=1
[ -x .venv-vllm/bin/python ] || echo "test.sh: no .venv-vllm: the real-vLLM tests" \
  "(tests/supervisor/test_engines_vllm.py) skip; install vLLM's CPU build with: bash scripts/setup-peers.sh vllm" >&2
set +e
# Two workers (pytest-xdist), a file at a time in tests/conftest.py's order: the suite waits on processes it
# starts about half the time, so two cores run it in about two thirds of one worker's time. LBD_TEST_WORKERS=0
# runs it in one process.
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "${LBD_TEST_WORKERS:-2}" --dist loadfile \
  --no-loadscope-reorder "$@"
rc=$?
[ "$rc" = 5 ] && echo "test.sh: pytest collected no tests" >&2  # exit 5 fails CI on purpose
exit "$rc"
