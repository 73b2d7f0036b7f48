"""A stand-in for the outside engine binaries (``vllm serve`` and ``python -m sglang.launch_server``), so the
supervisor's --rank-engine paths run here without vLLM or SGLang installed. Not a stand-in for our own code.

    standin_engine.py vllm serve MODEL [vLLM's flags]
    standin_engine.py sglang [SGLang's flags]

It accepts the flags lbd passes under each engine's own names (argparse: anything else exits 2, as the real
CLIs do) and refuses what vLLM refuses at config time: ``--data-parallel-*`` for a dense model (config.json
without an expert count, or no config.json to read) exits 1 with vLLM's ValueError, traceback frame
included. It writes its argv and CUDA_VISIBLE_DEVICES to ``$LBD_STANDIN_DIR/<engine>-<port>-<pid>.json``, and
serves the OpenAI API (completions and chat, streamed or not; answers take ``$LBD_STANDIN_DELAY_S``), /health,
and /metrics in that engine's metric names (vLLM: ``vllm:num_requests_running{engine=R}``...; SGLang:
``sglang:num_running_reqs{dp_rank=R}``... from --extra-metric-labels); an answer's text names the port that
served it. SIGTERM finishes in-flight answers, after ``$LBD_STANDIN_STOP_DELAY_S``.

With ``$LBD_STANDIN_DAEMON`` set it first starts a daemon, as engines that start their own helpers may
(vLLM's EngineCore and workers have no death signal towards its API server): a grandchild detached by double
fork and ``setsid``, in a session and process group of its own, ignoring SIGTERM, SIGHUP and SIGINT, that
outlives the server unless someone kills it; its pid goes to ``$LBD_STANDIN_DIR/daemon-<port>-<pid>.pid``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

from aiohttp import web


def vllm_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm serve")
    p.add_argument("model")
    for flag in ("--port", "--data-parallel-rank", "--data-parallel-size", "--max-model-len",
                 "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--max-num-queued-reqs",
                 "--max-num-queued-tokens", "--max-logprobs", "--api-server-count", "--tensor-parallel-size",
                 "--pipeline-parallel-size", "--seed", "--data-parallel-rpc-port",
                 "--data-parallel-size-local"):
        p.add_argument(flag, type=int)
    for flag in ("--host", "--tokenizer", "--chat-template", "--dtype", "--kv-cache-dtype", "--log-level",
                 "--otlp-traces-endpoint", "--data-parallel-address", "--kv-cache-memory-bytes"):
        p.add_argument(flag)
    for flag in ("--gpu-memory-utilization", "--shutdown-timeout"):
        p.add_argument(flag, type=float)
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--enable-expert-parallel", action="store_true")
    return p


EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def vllm_refusal(args: argparse.Namespace) -> str | None:
    """vLLM's refusal of external DP (a DP rank, size > 1) for a dense model, else None."""
    external = args.data_parallel_rank is not None and (args.data_parallel_size or 1) > 1
    try:
        config = json.loads((Path(args.model) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    moe = any(isinstance(config.get(k), int) and config[k] > 0 for k in EXPERT_KEYS)
    if not external or moe:
        return None
    return ("Non-MoE models do not support external data parallel mode. For external load balancing, launch "
            "independent vLLM instances without --data-parallel-* arguments.")


def sglang_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang.launch_server")
    p.add_argument("--model-path", "--model", required=True)
    for flag in ("--port", "--dp-size", "--tp-size", "--pp-size", "--base-gpu-id", "--gpu-id-step",
                 "--context-length", "--random-seed", "--max-running-requests", "--chunked-prefill-size",
                 "--page-size", "--max-queued-requests"):
        p.add_argument(flag, type=int)
    for flag in ("--host", "--served-model-name", "--tokenizer-path", "--chat-template", "--dtype",
                 "--kv-cache-dtype", "--log-level", "--otlp-traces-endpoint", "--extra-metric-labels"):
        p.add_argument(flag)
    p.add_argument("--mem-fraction-static", type=float)
    for flag in ("--enable-metrics", "--disable-radix-cache", "--disable-cuda-graph", "--enable-trace"):
        p.add_argument(flag, action="store_true")
    return p


class Standin:
    def __init__(self, engine: str, args: argparse.Namespace) -> None:
        self.engine = engine
        self.args = args
        if engine == "vllm":
            self.model = (args.served_model_name or [args.model])[0]
            self.rank = str(args.data_parallel_rank or 0)  # vLLM's engine index: 0 outside a DP group
        else:
            self.model = args.served_model_name or args.model_path
            self.rank = json.loads(args.extra_metric_labels or "{}").get("dp_rank", "")
        self.running = 0
        self.served = 0
        self.delay = float(os.environ.get("LBD_STANDIN_DELAY_S", "0"))
        self.port = 0

    async def metrics(self, request: web.Request) -> web.Response:
        if self.engine == "vllm":
            lab = f'engine="{self.rank}",model_name="{self.model}"'
            text = (f"# TYPE vllm:num_requests_running gauge\n"
                    f"vllm:num_requests_running{{{lab}}} {self.running}\n"
                    f"vllm:num_requests_waiting{{{lab}}} 0.0\nvllm:kv_cache_usage_perc{{{lab}}} 0.1\n"
                    f"vllm:request_success_total{{{lab},finished_reason=\"length\"}} {self.served}\n")
        else:
            lab = (f'dp_rank="{self.rank}",engine_type="unified",model_name="{self.model}",moe_ep_rank="0",'
                   'pp_rank="0",tp_rank="0"')
            text = (f"# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{{{lab}}} {self.running}\n"
                    f"sglang:num_queue_reqs{{{lab}}} 0.0\nsglang:token_usage{{{lab}}} 0.1\n"
                    f"sglang:num_requests_total{{{lab}}} {self.served}\n")
        return web.Response(text=text, content_type="text/plain")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.running += 1
        try:
            await asyncio.sleep(self.delay)
            text, chat = f"port {self.port}", "messages" in body
            if not body.get("stream"):
                choice = {"index": 0, "finish_reason": "length"}
                choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
                usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
                kind = "chat.completion" if chat else "text_completion"
                return web.json_response({"id": "x", "object": kind, "model": self.model, "choices": [choice],
                                          "usage": usage})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for piece in text.split():
                delta = {"delta": {"content": piece}} if chat else {"text": piece}
                choice = {"index": 0, **delta, "finish_reason": None}
                event = {"id": "x", "model": self.model, "choices": [choice]}
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.running -= 1
            self.served += 1


async def serve(s: Standin, host: str, port: int) -> None:
    app = web.Application()
    app.router.add_get("/health", s.health)
    app.router.add_get("/metrics", s.metrics)
    app.router.add_get("/v1/models", s.models)
    app.router.add_post("/v1/completions", s.generate)
    app.router.add_post("/v1/chat/completions", s.generate)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await asyncio.sleep(float(os.environ.get("LBD_STANDIN_STOP_DELAY_S", "0")))
    deadline = time.monotonic() + 10
    while s.running and time.monotonic() < deadline:  # a drain: answers in flight finish
        await asyncio.sleep(0.05)
    await runner.cleanup()


def daemonize(folder: str | None, port: int) -> None:
    """Start a detached grandchild that ignores the polite signals and sleeps until killed."""
    server = os.getpid()
    child = os.fork()
    if child:
        os.waitpid(child, 0)  # the middle process exits at once: the daemon is re-parented
        return
    os.setsid()
    if os.fork():
        os._exit(0)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    if folder:
        with open(os.path.join(folder, f"daemon-{port}-{server}.pid"), "w") as f:
            f.write(str(os.getpid()))
    while True:
        time.sleep(3600)


def main() -> int:
    engine, argv = sys.argv[1], sys.argv[2:]
    if engine == "vllm":
        if argv[:1] != ["serve"]:
            print("usage: vllm serve MODEL ...", file=sys.stderr)
            return 2
        args = vllm_parser().parse_args(argv[1:])
        host, port = args.host or "0.0.0.0", args.port or 8000
        refusal = vllm_refusal(args)
        if refusal:  # the shape of vLLM's traceback, whose frame tells a config error from a crash
            print("Traceback (most recent call last):\n"
                  '  File "/standin/vllm/engine/arg_utils.py", line 2420, in create_engine_config\n'
                  f"    raise ValueError(\nValueError: {refusal}", file=sys.stderr)
            return 1
    else:
        args = sglang_parser().parse_args(argv)
        host, port = args.host or "127.0.0.1", args.port or 30000
    record = {"engine": engine, "argv": argv, "pid": os.getpid(),
              "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    folder = os.environ.get("LBD_STANDIN_DIR")
    if folder:
        with open(os.path.join(folder, f"{engine}-{port}-{os.getpid()}.json"), "w") as f:
            json.dump(record, f)
    if os.environ.get("LBD_STANDIN_DAEMON"):
        daemonize(folder, port)
    standin = Standin(engine, args)
    standin.port = port
    asyncio.run(serve(standin, host, port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
