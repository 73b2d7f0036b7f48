"""Parse the engine's Prometheus text (vLLM metric names) into the few numbers the policies use.

Only lines starting with ``vllm:`` and one of the wanted names are looked at; histograms and everything else
are skipped without splitting labels, so a scrape costs tens of microseconds per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_WANTED = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:cache_config_info",
    "vllm:prompt_tokens_total",  # progress: a rank whose counters move is not wedged (lbd.router.outlier)
    "vllm:generation_tokens_total",
    # vLLM < 0.10 names, so older engines work too
    "vllm:gpu_prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_hits_total",
    "vllm:gpu_cache_usage_perc",
)
_ALIASES = {
    "vllm:gpu_prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
    "vllm:gpu_cache_usage_perc": "vllm:kv_cache_usage_perc",
}


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


def _labels(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        eq = text.find("=", i)
        if eq < 0:
            break
        name = text[i:eq].strip().lstrip(",").strip()
        q = eq + 1  # opening quote
        j = q + 1
        chars: list[str] = []
        while j < n and text[j] != '"':
            if text[j] == "\\" and j + 1 < n:
                j += 1
                chars.append({"n": "\n"}.get(text[j], text[j]))
            else:
                chars.append(text[j])
            j += 1
        out[name] = "".join(chars)
        i = j + 1
    return out


def parse_metrics(text: str) -> Sample:
    """Sum each wanted metric over its samples (a rank may serve several model names)."""
    s = Sample()
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        name = line[:brace] if brace > 0 else line.split(" ", 1)[0]
        if name not in _WANTED:
            continue
        name = _ALIASES.get(name, name)
        labels: dict[str, str] = {}
        if brace > 0:
            close = line.rfind("}")
            labels = _labels(line[brace + 1 : close])
            value_text = line[close + 1 :].split()[0]
        else:
            value_text = line.split()[1]
        try:
            value = float(value_text)
        except ValueError:
            continue
        if "engine" in labels and labels["engine"].lstrip("-").isdigit():
            s.ranks.add(int(labels["engine"]))
        if labels.get("model_name"):
            s.models.add(labels["model_name"])
        _apply(s, name, value, labels)
    return s


def _apply(s: Sample, name: str, value: float, labels: dict[str, str]) -> None:
    if name == "vllm:num_requests_running":
        s.running += value
    elif name == "vllm:num_requests_waiting":
        s.waiting += value
    elif name == "vllm:kv_cache_usage_perc":
        s.kv_usage = max(s.kv_usage, value)
    elif name == "vllm:prefix_cache_queries_total":
        s.prefix_queries += value
    elif name == "vllm:prefix_cache_hits_total":
        s.prefix_hits += value
    elif name == "vllm:prompt_tokens_total":
        s.prompt_tokens += value
    elif name == "vllm:generation_tokens_total":
        s.generation_tokens += value
    elif name == "vllm:cache_config_info":
        s.block_size = int(labels.get("block_size", "0") or 0)
        s.num_blocks = int(labels.get("num_gpu_blocks", "0") or 0)
