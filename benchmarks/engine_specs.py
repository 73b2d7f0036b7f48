"""The engines benchmarks/engine_vs_vllm.py compares: how each is started, which of its processes are the
front end and which the engine, and how long it took to serve its first answer.

lbd: `python -m lbd.engine` from this checkout (the benchmark's interpreter). vLLM: its OpenAI server
from the venv of `scripts/setup-peers.sh vllm` (`.venv-vllm/`), with the CPU settings vLLM documents:
VLLM_CPU_KVCACHE_SPACE (GiB), VLLM_CPU_OMP_THREADS_BIND on the same CPUs lbd gets, HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import free_port, spawn, stop, wait_http  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
_CORE_PID = re.compile(r"core ready on \S+ \(pid (\d+)\)")


@dataclass(slots=True)
class EngineSpec:
    """One server to compare: ``kind`` is "lbd" or "vllm"; ``name`` labels its rows."""

    name: str
    kind: str
    dtype: str = "float32"
    extra: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    src: Path | None = None  # an lbd source tree other than this one (it runs there, see procs.spawn)

    @property
    def flat_layout(self) -> bool:
        """Whether ``src`` is a tree from before the src layout (top-level ``engine`` package)."""
        return self.src is not None and (self.src / "engine" / "__main__.py").is_file()

    def import_root(self) -> Path | None:
        """What PYTHONPATH must hold for ``src``'s own packages to win over the installed ``lbd``."""
        if self.src is None:
            return None
        return self.src if self.flat_layout else self.src / "src"

    def argv(self, model: Path, port: int, max_model_len: int, kv_gib: float, python: Path) -> list[str]:
        """``kv_gib`` 0: the engine sizes its KV cache itself (on CUDA, from --gpu-memory-utilization)."""
        common = ["--host", "127.0.0.1", "--port", str(port), "--model", str(model), "--dtype", self.dtype,
                  "--max-model-len", str(max_model_len)]
        if self.kind == "lbd":
            kv = ["--kv-cache-memory-bytes", f"{kv_gib}GiB"] if kv_gib > 0 else []
            module = "engine" if self.flat_layout else "lbd.engine"
            return [sys.executable, "-m", module, *common, *kv, "--disable-log-requests", *self.extra]
        return [str(python), "-m", "vllm.entrypoints.openai.api_server", *common, *self.extra]

    def environment(self, cpus: str, threads: int, kv_gib: float, device: str) -> dict[str, str]:
        if self.kind == "lbd":
            base = {"OMP_NUM_THREADS": str(threads)} if device == "cpu" else {}
        else:
            base = {"VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                    "DO_NOT_TRACK": "1"}
            if device == "cpu":
                base |= {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": f"{kv_gib:g}",
                         "VLLM_CPU_OMP_THREADS_BIND": cpus}
        return base | self.env


class RunningEngine:
    """A started server: its URL, served model name, start-up time and process roles."""

    def __init__(self, spec: EngineSpec, model: Path, log: Path, *, cpus: str, threads: int, kv_gib: float,
                 max_model_len: int, device: str, python: Path, ready_timeout: float) -> None:
        self.spec = spec
        self.log = log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        t0 = time.perf_counter()
        argv = spec.argv(model, self.port, max_model_len, kv_gib, python)
        env = spec.environment(cpus, threads, kv_gib, device)
        if spec.src is not None:
            env["PYTHONPATH"] = str(spec.import_root())
        self.proc = spawn(argv, env=env, log=log, cwd=spec.src)
        try:
            wait_http(self.url + "/health", timeout=ready_timeout, proc=self.proc)
            self.model = httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]
            self._first_answer()
        except Exception:
            self.close()
            raise
        self.startup_s = time.perf_counter() - t0

    def _first_answer(self) -> None:
        body = {"model": self.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()

    def processes(self) -> tuple[list[psutil.Process], list[psutil.Process]]:
        """(front-end processes, engine processes) of this server right now."""
        try:
            root = psutil.Process(self.proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            return [], []
        if self.spec.kind == "lbd":
            m = _CORE_PID.search(self.log.read_text(errors="replace"))
            core = int(m.group(1)) if m else -1
            engine = [p for p in tree if p.pid == core]
            return [p for p in tree if p.pid != core], engine
        engine, front = [], []
        for p in tree:
            try:
                name = p.name() + " ".join(p.cmdline()[:1])
            except psutil.Error:
                continue
            (engine if "VLLM::" in name or "EngineCore" in name or "Worker" in name else front).append(p)
        return front, engine

    def close(self) -> None:
        stop(self.proc, timeout=30)


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def vllm_available(python: Path) -> str | None:
    """None when vLLM can be started with ``python``, else why not (and the command that fixes it)."""
    if not python.exists():
        return f"{python} not found: run `bash scripts/setup-peers.sh vllm` (or pass --vllm-python)"
    return None
