"""Seeded workloads: endless streams of sessions (one request is a one-turn session).

Lengths are in tokens of the real tokenizer. Text is drawn from the tokenizer's ordinary word tokens: a text
of n words is close to n tokens (and is trimmed to n when it encodes longer). Same seed, same stream.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

WORKLOADS = ("random", "shared-prefix", "multi-turn", "skew", "file")
_WORD = re.compile(r"^[\u0120\u2581][a-z]{2,12}$")  # byte-level BPE (Ġ) or sentencepiece (▁) + a word
_LOOSE = re.compile(r"^[\u0120\u2581]?[A-Za-z]+$")


class WorkloadError(ValueError):
    pass


@dataclass(slots=True)
class Turn:
    user: str
    max_tokens: int


@dataclass(slots=True)
class Session:
    session_id: str
    turns: list[Turn]
    system: str | None = None
    history: list[dict[str, str]] = field(default_factory=list)  # earlier messages given by a file
    group: int = -1  # shared-prefix group, or -1
    kind: str = ""  # "long" / "short" for skew


@dataclass(slots=True)
class WorkloadSpec:
    name: str = "random"
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    num_groups: int = 8
    system_prompt_len: int = 1024
    question_len: int = 128
    num_turns: int = 4
    long_fraction: float = 0.1
    long_input_len: int = 4096
    short_input_len: int = 128
    file: str | None = None
    prefix_seed: int | None = None  # system prompts from this seed (not the stream's): fixed across runs
    group_skew: float = 0.0  # Zipf exponent of the groups' popularity (0: uniform)
    group_burst: int = 1  # consecutive sessions of one drawn group (a group's sessions start together)

    def check(self) -> None:
        """Raise WorkloadError naming the flag of an impossible value."""
        positive = {
            "--input-len": self.input_len,
            "--output-len": self.output_len,
            "--num-groups": self.num_groups,
            "--question-len": self.question_len,
            "--num-turns": self.num_turns,
            "--long-input-len": self.long_input_len,
            "--short-input-len": self.short_input_len,
        }
        for flag, value in positive.items():
            if value <= 0:
                raise WorkloadError(f"{flag} must be positive, got {value}")
        if self.system_prompt_len < 0:
            raise WorkloadError(f"--system-prompt-len must be >= 0, got {self.system_prompt_len}")
        if self.group_burst < 1:
            raise WorkloadError(f"--group-burst must be >= 1, got {self.group_burst}")
        if self.group_skew < 0:
            raise WorkloadError(f"--group-skew must be >= 0, got {self.group_skew}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise WorkloadError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise WorkloadError(f"--long-fraction must be in [0, 1], got {self.long_fraction}")
        if self.name == "file" and not self.file:
            raise WorkloadError("--workload file needs --workload-file PATH (JSONL)")
        if self.file and not Path(self.file).is_file():
            raise WorkloadError(f"--workload-file {self.file!r} does not exist")

    @property
    def mean_turns(self) -> float:
        return float(self.num_turns) if self.name == "multi-turn" else 1.0


class TextSource:
    """Random text of a given token length from the tokenizer's word tokens."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.tok = tokenizer
        vocab = tokenizer.get_vocab()
        special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        usable = [(t, i) for t, i in vocab.items() if i not in special]
        words = sorted(i for t, i in usable if _WORD.match(t))
        if len(words) < 16:
            words = sorted(i for t, i in usable if _LOOSE.match(t)) or sorted(i for _, i in usable)
        self.words = words

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def text(self, rng: random.Random, n: int) -> str:
        if n <= 0:
            return ""
        text = self.tok.decode([rng.choice(self.words) for _ in range(n)]).strip()
        ids = self.tok.encode(text, add_special_tokens=False)
        return self.tok.decode(ids[:n]).strip() if len(ids) > n else text


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    if ratio <= 0:
        return mean
    return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))


def _random(spec: WorkloadSpec, src: TextSource, rng: random.Random) -> Iterator[Session]:
    for i in itertools.count():
        n_in = _length(rng, spec.input_len, spec.range_ratio)
        n_out = _length(rng, spec.output_len, spec.range_ratio)
        yield Session(f"r{i}", [Turn(src.text(rng, n_in), n_out)])


def _system_prompts(spec: WorkloadSpec, src: TextSource, rng: random.Random) -> list[str]:
    # A distinct opening per group, so groups share no prefix beyond the chat template.
    if spec.prefix_seed is not None:  # the same tenants whatever the stream's seed (runs in steps)
        rng = random.Random(spec.prefix_seed)
    return [f"Group {g}. " + src.text(rng, spec.system_prompt_len) for g in range(spec.num_groups)]


def _group_picker(spec: WorkloadSpec, rng: random.Random) -> Callable[[], int]:
    """Group g is drawn with weight 1 / (g + 1) ** group_skew; each draw serves ``group_burst`` sessions in a
    row (so a group's sessions start within a few session gaps of each other: a burst on one prefix)."""
    if spec.group_skew <= 0:
        draw: Callable[[], int] = lambda: rng.randrange(spec.num_groups)  # noqa: E731
    else:
        weights = list(itertools.accumulate(1.0 / (g + 1) ** spec.group_skew for g in range(spec.num_groups)))
        groups = range(spec.num_groups)
        draw = lambda: rng.choices(groups, cum_weights=weights)[0]  # noqa: E731
    if spec.group_burst <= 1:
        return draw
    left, current = [0], [0]

    def burst() -> int:
        if left[0] <= 0:
            current[0], left[0] = draw(), spec.group_burst
        left[0] -= 1
        return current[0]

    return burst


def _shared_prefix(spec: WorkloadSpec, src: TextSource, rng: random.Random) -> Iterator[Session]:
    systems = _system_prompts(spec, src, rng)
    pick = _group_picker(spec, rng)
    for i in itertools.count():
        g = pick()
        question = src.text(rng, _length(rng, spec.question_len, spec.range_ratio))
        yield Session(
            f"s{i}",
            [Turn(question, _length(rng, spec.output_len, spec.range_ratio))],
            system=systems[g],
            group=g,
        )


def _multi_turn(spec: WorkloadSpec, src: TextSource, rng: random.Random) -> Iterator[Session]:
    systems = _system_prompts(spec, src, rng)
    pick = _group_picker(spec, rng)
    for i in itertools.count():
        g = pick()
        turns = [
            Turn(
                src.text(rng, _length(rng, spec.question_len, spec.range_ratio)),
                _length(rng, spec.output_len, spec.range_ratio),
            )
            for _ in range(spec.num_turns)
        ]
        yield Session(f"m{i}-{rng.getrandbits(32):08x}", turns, system=systems[g], group=g)


def _skew(spec: WorkloadSpec, src: TextSource, rng: random.Random) -> Iterator[Session]:
    for i in itertools.count():
        long = rng.random() < spec.long_fraction
        n_in = spec.long_input_len if long else spec.short_input_len
        yield Session(
            f"k{i}",
            [
                Turn(
                    src.text(rng, _length(rng, n_in, spec.range_ratio)),
                    _length(rng, spec.output_len, spec.range_ratio),
                )
            ],
            kind="long" if long else "short",
        )


def _session_from_line(obj: dict[str, Any], index: int, default_out: int) -> Session:
    out = int(obj.get("max_tokens") or obj.get("output_len") or default_out)
    sid = str(obj.get("session_id") or f"f{index}")
    if "prompt" in obj:
        return Session(sid, [Turn(str(obj["prompt"]), out)])
    if "turns" in obj:
        turns = [Turn(str(t), out) for t in obj["turns"]]
        return Session(sid, turns, system=obj.get("system"))
    if "messages" in obj:
        msgs = [{"role": str(m["role"]), "content": str(m["content"])} for m in obj["messages"]]
        system = msgs[0]["content"] if msgs and msgs[0]["role"] == "system" else None
        body = msgs[1:] if system is not None else msgs
        if not body or body[-1]["role"] != "user":
            raise WorkloadError(f"line {index + 1}: the last message must be the user's")
        return Session(sid, [Turn(body[-1]["content"], out)], system=system, history=body[:-1])
    raise WorkloadError(f"line {index + 1}: needs 'prompt', 'messages' or 'turns'")


def read_file(path: str, default_out: int) -> list[Session]:
    sessions = []
    for index, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise WorkloadError(f"--workload-file {path}: line {index + 1} is not JSON ({e})") from e
        if not isinstance(obj, dict):
            raise WorkloadError(f"--workload-file {path}: line {index + 1} is not a JSON object")
        sessions.append(_session_from_line(obj, index, default_out))
    if not sessions:
        raise WorkloadError(f"--workload-file {path} holds no requests")
    return sessions


def _file(spec: WorkloadSpec, src: TextSource, rng: random.Random) -> Iterator[Session]:
    sessions = read_file(str(spec.file), spec.output_len)
    for lap in itertools.count():  # replay the file in order, as often as the run needs
        for s in sessions:
            yield Session(f"{s.session_id}.{lap}" if lap else s.session_id, s.turns, s.system, s.history)


_BUILDERS = {
    "random": _random,
    "shared-prefix": _shared_prefix,
    "multi-turn": _multi_turn,
    "skew": _skew,
    "file": _file,
}


def sessions(spec: WorkloadSpec, src: TextSource, seed: int) -> Iterator[Session]:
    """The endless, seeded stream of sessions of ``spec``."""
    spec.check()
    return _BUILDERS[spec.name](spec, src, random.Random(seed))


def chat_messages(session: Session, done: list[tuple[str, str]], user: str) -> list[dict[str, str]]:
    """Messages of the next turn: system, given history, earlier (user, assistant) turns, then ``user``."""
    msgs = [{"role": "system", "content": session.system}] if session.system is not None else []
    msgs += session.history
    for u, a in done:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    msgs.append({"role": "user", "content": user})
    return msgs


def completion_prompt(session: Session, done: list[tuple[str, str]], user: str) -> str:
    """The same conversation as one plain prompt, parts separated by blank lines (prefix-stable)."""
    parts = [session.system] if session.system is not None else []
    parts += [m["content"] for m in session.history]
    for u, a in done:
        parts += [u, a]
    parts.append(user)
    return "\n\n".join(parts)
