"""Read an engine's Prometheus text into the few numbers the policies use: vLLM's and SGLang's names (and
lbd's engines' JSON /telemetry: the same numbers at a small fraction of the engine's cost, advertised by
/metrics; benchmarks/RESULTS.md, "JSON telemetry").

Parsing is prometheus_client's text parser (``text_string_to_metric_families``), fed only the sample lines of
the wanted families: an engine exports many families (hundreds of lines, most of them histogram buckets) and
the policies need six numbers. Each wanted family is found with ``str.find`` (C speed; a family's samples are
contiguous in an exposition, so nothing past them is read), its lines are parsed properly (escapes, NaN,
exponents, timestamps), and a line seen in the previous scrapes (cache_config_info's never changes) is not
parsed again. ``benchmarks/telemetry.py`` measures the choice: the parser on the whole text costs far more per
scrape (benchmarks/RESULTS.md, "Telemetry parsing").

Engines and their names (the first name of a row that the engine exports wins: vLLM before 0.10 exported both
``gpu_cache_usage_perc`` and ``kv_cache_usage_perc``, and summing both counted everything twice):

| field | vLLM | vLLM < 0.10 | SGLang |
|---|---|---|---|
| running | num_requests_running | | num_running_reqs |
| waiting | num_requests_waiting | | num_queue_reqs |
| kv_usage (0..1) | kv_cache_usage_perc | gpu_cache_usage_perc | token_usage |
| prefix_queries | prefix_cache_queries_total | gpu_prefix_cache_queries_total | prompt_tokens_total |
| prefix_hits (tokens) | prefix_cache_hits_total | gpu_prefix_cache_hits_total | cached_tokens_total |
| block_size | cache_config_info{block_size} | | page_size |
| num_blocks | cache_config_info{num_gpu_blocks} | | max_total_num_tokens / page_size |
| prompt_tokens, generation_tokens (progress) | prompt_tokens_total, generation_tokens_total | | the same |

Adapters (``--enable-lora``, issue 44) become ``Sample.lora`` (a ``LoraView``): from the JSON's ``lora``
section, or on /metrics from ``lbd:lora_resident``/``lbd:lora_free_slots`` (lbd's engines: exact), else
from vLLM's ``lora_requests_info`` (its newest series: the adapters with running or waiting requests, taken
as on device). That last one cannot see an idle adapter still in a slot: a vLLM rank's view is inexact.

``ranks`` come from vLLM's ``engine`` label or SGLang's ``dp_rank`` (``lbd supervise --rank-engine sglang``
adds it; a router also learns ranks from the supervisor's /status); ``models`` from ``model_name``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import orjson

from lbd.policies.base import LoraView

# field -> sample names in order of preference (vLLM, vLLM < 0.10); SGLang's apart (checked only on its text)
_VLLM: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "cache_config": ("vllm:cache_config_info",),
    # progress: a rank whose counters move is not wedged (lbd.router.outlier)
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
}
_SGLANG: dict[str, tuple[str, ...]] = {
    "running": ("sglang:num_running_reqs",),
    "waiting": ("sglang:num_queue_reqs",),
    "kv_usage": ("sglang:token_usage",),
    "prefix_queries": ("sglang:prompt_tokens_total",),
    "prefix_hits": ("sglang:cached_tokens_total",),
    "page_size": ("sglang:page_size",),
    "max_total_tokens": ("sglang:max_total_num_tokens",),
    "prompt_tokens": ("sglang:prompt_tokens_total",),
    "generation_tokens": ("sglang:generation_tokens_total",),
}
_MEMO_MAX = 256
_memo: dict[str, list[tuple[dict[str, str], float]]] = {}  # sample line -> its parsed (labels, value)


@dataclass(slots=True)
class Sample:
    """One scrape of one rank. Counters are cumulative; the scraper turns them into rates."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    block_size: int = 0
    num_blocks: int = 0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    ranks: set[int] = field(default_factory=set)
    models: set[str] = field(default_factory=set)
    load_stream: object = None  # the pushed load stream the rank advertises (lbd.router.load_feed)
    lora: LoraView | None = None  # its adapters, where an --enable-lora rank reports them


def family_lines(text: str, name: str) -> list[str]:
    """The sample lines of ``name``: found with ``str.find``, read while they last (they are contiguous)."""
    n, i = len(name), 0
    if not (text.startswith(name) and text[n:n + 1] in ("{", " ")):
        key = "\n" + name
        i = text.find(key)
        while i >= 0 and text[i + 1 + n:i + 2 + n] not in ("{", " "):  # e.g. ..._waiting_by_reason
            i = text.find(key, i + 1)
        if i < 0:
            return []
        i += 1
    out = []
    while True:
        end = text.find("\n", i)
        out.append(text[i:end] if end >= 0 else text[i:])
        if end < 0 or not text.startswith(name, end + 1) or text[end + 1 + n:end + 2 + n] not in ("{", " "):
            return out
        i = end + 1


def _samples(lines: list[str]) -> list[tuple[dict[str, str], float]]:
    # imported here: importing prometheus_client fixes its value class, and `lbd route --workers N` must set
    # PROMETHEUS_MULTIPROC_DIR first (lbd.router.cli), after the config (which imports this module) is read
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for line in lines:
        parsed = _memo.get(line)
        if parsed is None:
            parsed = [(s.labels, s.value) for f in text_string_to_metric_families(line) for s in f.samples]
            if len(_memo) >= _MEMO_MAX:
                _memo.clear()
            _memo[line] = parsed
        out.extend(parsed)
    return out


def parse_metrics(text: str) -> Sample:
    """Sum each field over its samples (a rank may serve several model names; KV usage takes the max)."""
    s = Sample()
    names = _SGLANG if text.startswith("sglang:") or "\nsglang:" in text else _VLLM
    extra: dict[str, float] = {}
    for fld, candidates in names.items():
        samples: list[tuple[dict[str, str], float]] = []
        for name in candidates:
            samples = _samples(family_lines(text, name))
            if samples:
                break
        for labels, value in samples:
            engine = labels.get("engine") or labels.get("dp_rank", "")
            if engine.lstrip("-").isdigit():
                s.ranks.add(int(engine))
            if labels.get("model_name"):
                s.models.add(labels["model_name"])
            if fld == "cache_config":
                s.block_size = _int(labels.get("block_size"))
                s.num_blocks = _int(labels.get("num_gpu_blocks"))
            elif fld in ("page_size", "max_total_tokens"):
                extra[fld] = value
            elif fld == "kv_usage":
                s.kv_usage = max(s.kv_usage, value)
            else:
                setattr(s, fld, getattr(s, fld) + value)
    page = extra.get("page_size", 0.0)
    if page > 0:
        s.block_size = int(page)
        s.num_blocks = int(extra.get("max_total_tokens", 0.0) // page)
    if "lora_requests_info" in text:
        s.lora = _metrics_lora(text)
    return s


def _names(value: str | None) -> frozenset[str]:
    return frozenset(n for n in (value or "").split(",") if n)


def _metrics_lora(text: str) -> LoraView | None:
    """The adapters on /metrics: lbd's resident/free-slot gauges (exact), else vLLM's newest
    ``lora_requests_info`` series (adapters with requests only; the rest of ``max_lora`` counted free)."""
    info = _samples(family_lines(text, "vllm:lora_requests_info"))
    if not info:
        return None
    labels, _ = max(info, key=lambda lv: lv[1])  # the value is the time it was set: the newest is current
    busy = _names(labels.get("running_lora_adapters")) | _names(labels.get("waiting_lora_adapters"))
    max_loras = _int(labels.get("max_lora"))
    resident = _samples(family_lines(text, "lbd:lora_resident"))
    free = _samples(family_lines(text, "lbd:lora_free_slots"))
    if not free:
        return LoraView(device=busy, free_slots=max(0, max_loras - len(busy)), max_loras=max_loras,
                        exact=False, known=busy, busy=busy)
    device = frozenset(lv[0].get("lora_name", "") for lv in resident if lv[1] > 0 and lv[0].get("where") ==
                       "device") - {""}
    cpu = frozenset(lv[0].get("lora_name", "") for lv in resident if lv[1] > 0 and lv[0].get("where") ==
                    "cpu") - {""}
    loads = _samples(family_lines(text, "lbd:lora_load_seconds"))
    evicts = [lv[0].get("lora_name", "") for lv in _samples(family_lines(text, "lbd:lora_next_evicted"))
              if lv[1] > 0]
    return LoraView(device=device, cpu=cpu, free_slots=int(sum(v for _, v in free)), max_loras=max_loras,
                    known=device | cpu | busy, load_s=_mean_load(v for _, v in loads), busy=busy,
                    evicts=evicts[0] if evicts else "")


def with_cards(view: LoraView | None, cards: list[dict]) -> LoraView | None:
    """``view`` knowing the adapters a rank's /v1/models ``cards`` list (a card with a ``parent``)."""
    named = frozenset(str(c["id"]) for c in cards if c.get("parent") and c.get("parent") != c.get("id"))
    if not named or view is not None and named <= view.known:
        return view
    if view is None:
        return LoraView(exact=False, known=named)
    return replace(view, known=view.known | named)


def lora_view(data: object) -> LoraView | None:
    """An lbd ``LoraState`` as plain data (/telemetry's ``lora`` section, the pushed state's) -> LoraView;
    None when absent or not one."""
    if not isinstance(data, dict):
        return None

    def names(key: str) -> frozenset[str]:
        value = data.get(key)
        return frozenset(str(n) for n in value if n) if isinstance(value, list) else frozenset()

    def count(key: str) -> int:
        value = data.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    device, cpu, busy = names("device"), names("cpu"), names("running") | names("waiting")
    loaded = data.get("load_seconds")
    loaded = loaded if isinstance(loaded, dict) else {}
    evicts = data.get("evicts")
    return LoraView(device=device, cpu=cpu, free_slots=count("free_slots"), max_loras=count("max_lora"),
                    known=frozenset(map(str, loaded)) | device | cpu | busy,
                    load_s=_mean_load(loaded.values()), busy=busy,
                    evicts=evicts if isinstance(evicts, str) else None)


def _mean_load(values: object) -> float:
    """The mean of the positive load times among ``values`` (0.0: none)."""
    times = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool) and v > 0]
    return round(sum(times) / len(times), 6) if times else 0.0


# GET /telemetry of lbd's engines (engine/server/routes.py): the same numbers as JSON, far smaller than the
# Prometheus text and far cheaper to render (benchmarks/RESULTS.md, "JSON telemetry"). /metrics advertises it.
TELEMETRY_HEADER = b"x-lbd-telemetry"
_JSON_FIELDS = (
    ("running", "num_requests_running"),
    ("waiting", "num_requests_waiting"),
    ("kv_usage", "kv_cache_usage_perc"),
    ("prefix_queries", "prefix_cache_queries_total"),
    ("prefix_hits", "prefix_cache_hits_total"),
    ("prompt_tokens", "prompt_tokens_total"),
    ("generation_tokens", "generation_tokens_total"),
)


def parse_telemetry(body: bytes) -> Sample:
    """A /telemetry answer -> Sample; ValueError when it is not one (e.g. another server at that path)."""
    data = orjson.loads(body)
    if not isinstance(data, dict) or "num_requests_running" not in data:
        raise ValueError("not an lbd /telemetry answer")
    s = Sample()
    for fld, key in _JSON_FIELDS:
        value = data.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            setattr(s, fld, float(value))
    s.block_size = _int(str(data.get("block_size", 0)))
    s.num_blocks = _int(str(data.get("num_gpu_blocks", 0)))
    engine = data.get("engine")
    if isinstance(engine, int) and not isinstance(engine, bool):
        s.ranks.add(engine)
    s.models.update(str(m) for m in data.get("model_names") or () if m)
    s.load_stream = data.get("load_stream")
    s.lora = lora_view(data.get("lora"))
    return s


def _int(text: str | None) -> int:
    try:
        return int(text or 0)
    except ValueError:
        return 0
