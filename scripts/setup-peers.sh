#!/usr/bin/env bash
# Installs the peers that benchmarks/router_overhead.py (and routing_quality.py) compare lbd route with:
# vllm-router and sglang-router (Rust routers shipped as Python wheels) in their own venv .venv-peers/,
# nginx + wrk from Debian (wrk is the load generator when present), and guidellm (the outside load generator
# of benchmarks/outside_loadgen.py) in .venv-loadgen/. Every part is optional for the benchmarks: a peer that
# is not installed is skipped. Safe to re-run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv-peers/bin/python ]; then
  "$PY" -m venv .venv-peers || echo "setup-peers: cannot create .venv-peers" >&2
fi
if [ -x .venv-peers/bin/pip ]; then
  .venv-peers/bin/pip install -q --upgrade pip || true
  .venv-peers/bin/pip install -q vllm-router || echo "setup-peers: vllm-router not installed" >&2
  .venv-peers/bin/pip install -q sglang-router || echo "setup-peers: sglang-router not installed" >&2
fi
if [ ! -x .venv-loadgen/bin/python ]; then
  "$PY" -m venv .venv-loadgen || echo "setup-peers: cannot create .venv-loadgen" >&2
fi
if [ -x .venv-loadgen/bin/pip ]; then
  .venv-loadgen/bin/pip install -q guidellm || echo "setup-peers: guidellm not installed" >&2
fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  missing=""
  command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing="$missing nginx-light"
  command -v wrk >/dev/null 2>&1 || missing="$missing wrk"
  if [ -n "$missing" ]; then
    apt-get update -qq >/dev/null 2>&1 || true
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null \
      || echo "setup-peers: apt could not install:$missing" >&2
  fi
fi
for tool in .venv-peers/bin/vllm-router .venv-peers/bin/sglang-router .venv-loadgen/bin/guidellm; do
  [ -x "$tool" ] && echo "setup-peers: $tool ok"
done
(command -v nginx || ls /usr/sbin/nginx) >/dev/null 2>&1 && echo "setup-peers: nginx ok"
command -v wrk >/dev/null 2>&1 && echo "setup-peers: wrk ok"
exit 0
