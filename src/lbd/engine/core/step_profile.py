"""Where a step's time goes: ``--profile-steps N`` logs a breakdown every N engine steps.

The core's loop marks the end of each phase of a step with ``lap(phase)``: receiving requests (ipc_in),
scheduling, input preparation, the forward pass, the lm_head, sampling, the scheduler's update, sending the
outputs (ipc_out); the time from one step's end to the next step's start is ``idle_or_loop``. Inside the
forward pass, ``OpTimer`` wraps the attention and linear kernels of ``lbd.kernels.ops`` (attention = the KV
write + paged attention; linear = every projection; other = norms, rotary, SiLU, embedding: the rest); a
forward run by the fused CPU decoder (``lbd.kernels.cpu.decoder``) reports the same groups from its C clocks.
Decode-only steps and steps with prefill tokens are summed apart (their costs differ by an order of magnitude:
benchmarks/RESULTS.md, "Step kinds"), and each kind that ran in the window gets one log line of ``key=value``
pairs (milliseconds per step), e.g.

    step profile [core] kind=decode steps=50 seqs=64.0 tokens=64.0 step_ms=118.2 ipc_in=0.05 schedule=0.31 ...

Off (the default), every hook is a no-op method of ``NO_PROFILE`` and the kernels are not wrapped. On CUDA
each lap synchronises the device first, so the figures are device times too (and the run is a little slower);
a forward replayed from a CUDA graph cannot be split and counts as ``forward_other``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("lbd.engine.profile")

CORE_PHASES = ("ipc_in", "schedule", "prepare", "forward", "lm_head", "sample", "update", "ipc_out")
OP_GROUPS = {"linear": "linear", "paged_attention": "attention", "write_kv_cache": "attention"}


@dataclass(slots=True)
class _Totals:
    steps: int = 0
    seqs: int = 0
    tokens: int = 0
    wall: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)

    def add(self, phases: dict[str, float], seqs: int, tokens: int, wall: float) -> None:
        self.steps += 1
        self.seqs += seqs
        self.tokens += tokens
        self.wall += wall
        for k, v in phases.items():
            self.phases[k] = self.phases.get(k, 0.0) + v


class NullProfiler:
    """What the hot path calls when profiling is off: nothing happens."""

    enabled = False
    in_step = False

    def begin(self) -> None:
        pass

    def lap(self, phase: str) -> None:
        pass

    def shape(self, seqs: int, tokens: int, decode_only: bool) -> None:
        pass

    def end(self) -> None:
        pass

    def idle(self) -> None:
        pass


NO_PROFILE = NullProfiler()


class StepProfiler(NullProfiler):
    """Accumulates one step's laps, then sums steps per kind and logs every ``every`` steps."""

    enabled = True

    def __init__(self, every: int, label: str = "core", sync: Callable[[], None] | None = None,
                 sink: Callable[[str], None] | None = None) -> None:
        self.every = max(1, every)
        self.label = label
        self.sync = sync
        self.sink = sink or logger.info
        self.ops: dict[str, float] = {}  # kernel groups timed since the last lap
        self._step: dict[str, float] = {}
        self._last = self._start = 0.0
        self._prev_end: float | None = None
        self.in_step = False
        self._shape: tuple[int, int, bool] | None = None
        self._window: dict[str, _Totals] = {}
        self._count = 0

    def _now(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    def begin(self) -> None:
        now = self._now()
        self._step = {} if self._prev_end is None else {"idle_or_loop": now - self._prev_end}
        self.ops.clear()
        self._last = now
        self._start = now
        self.in_step = True
        self._shape = None

    def lap(self, phase: str) -> None:
        if not self.in_step:
            return
        now = self._now()
        step = self._step
        step[phase] = step.get(phase, 0.0) + now - self._last
        if self.ops:
            for group, secs in self.ops.items():
                key = f"{phase}.{group}"
                step[key] = step.get(key, 0.0) + secs
            self.ops.clear()
        self._last = now

    def shape(self, seqs: int, tokens: int, decode_only: bool) -> None:
        """What the step ran (set by the core once it scheduled something)."""
        self._shape = (seqs, tokens, decode_only)

    def idle(self) -> None:
        """The loop waited for work: the gap to the next step is not loop overhead."""
        self._prev_end = None

    def end(self) -> None:
        if not self.in_step:
            return
        now = self._now()
        self.in_step = False
        if self._shape is None:  # nothing was scheduled: not a step
            self._prev_end = None
            return
        self._prev_end = now
        seqs, tokens, decode_only = self._shape
        kind = "decode" if decode_only else "mixed"
        self._window.setdefault(kind, _Totals()).add(self._step, seqs, tokens, now - self._start)
        self._count += 1
        if self._count >= self.every:
            self.flush()

    def flush(self) -> None:
        for kind, t in self._window.items():
            self.sink(format_line(self.label, kind, t))
        self._window.clear()
        self._count = 0


def format_line(label: str, kind: str, t: _Totals) -> str:
    n = max(1, t.steps)
    ph = {k: v / n * 1e3 for k, v in t.phases.items()}
    fwd = ph.get("forward", 0.0)
    attn, lin = ph.get("forward.attention", 0.0), ph.get("forward.linear", 0.0)
    parts = [f"kind={kind}", f"steps={t.steps}", f"seqs={t.seqs / n:.1f}", f"tokens={t.tokens / n:.1f}",
             f"step_ms={t.wall / n * 1e3:.2f}"]
    for phase in CORE_PHASES:
        if phase == "forward":
            parts += [f"forward={fwd:.2f}", f"forward_attention={attn:.2f}", f"forward_linear={lin:.2f}",
                      f"forward_other={max(0.0, fwd - attn - lin):.2f}"]
        elif phase in ph:
            parts.append(f"{phase}={ph[phase]:.2f}")
    if "idle_or_loop" in ph:
        parts.append(f"idle_or_loop={ph['idle_or_loop']:.2f}")
    return f"step profile [{label}] " + " ".join(parts)


def parse_line(line: str) -> dict[str, str]:
    """The key=value pairs of a ``step profile`` log line (for benchmarks), with ``label``."""
    head, sep, rest = line.partition("step profile [")
    if not sep:
        return {}
    label, _, pairs = rest.partition("] ")
    out = {"label": label}
    for item in pairs.split():
        k, eq, v = item.partition("=")
        if eq:
            out[k] = v
    return out


class OpTimer:
    """Wraps the attention and linear entry points of ``lbd.kernels.ops`` so their time lands in ``prof.ops``.

    The model calls ``ops.linear(...)`` etc. through the module, so replacing the module's attributes is
    enough; ``uninstall`` puts the originals back. Only installed while profiling.
    """

    def __init__(self, prof: StepProfiler) -> None:
        self.prof = prof
        self._saved: dict[str, Callable] = {}

    def install(self) -> None:
        from lbd.kernels import ops
        from lbd.kernels.cpu import decoder

        for name, group in OP_GROUPS.items():
            original = getattr(ops, name)
            self._saved[name] = original
            setattr(ops, name, self._wrap(original, group))
        acc = self.prof.ops

        def add(group: str, secs: float) -> None:  # the fused CPU decoder's own clocks, per forward
            acc[group] = acc.get(group, 0.0) + secs

        decoder.timing_sink = add

    def uninstall(self) -> None:
        from lbd.kernels import ops
        from lbd.kernels.cpu import decoder

        for name, original in self._saved.items():
            setattr(ops, name, original)
        self._saved.clear()
        decoder.timing_sink = None

    def _wrap(self, fn: Callable, group: str) -> Callable:
        prof, now = self.prof, self.prof._now
        acc = prof.ops

        def timed(*args, **kwargs):
            t = now()
            out = fn(*args, **kwargs)
            acc[group] = acc.get(group, 0.0) + now() - t
            return out

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed


class FrontendProfiler:
    """The front end's side, per window of ``every`` outputs messages from the core: time decoding those
    messages (ipc), detokenizing, and formatting + writing SSE chunks, per output token; and this process's
    CPU use over the window (1.0 = one core busy)."""

    enabled = True

    def __init__(self, every: int, label: str = "frontend",
                 sink: Callable[[str], None] | None = None) -> None:
        self.every = max(1, every)
        self.label = label
        self.sink = sink or logger.info
        self.times: dict[str, float] = {"ipc": 0.0, "detokenize": 0.0, "stream": 0.0}
        self.messages = 0
        self.tokens = 0
        self._wall0 = time.perf_counter()
        self._cpu0 = time.process_time()

    def add(self, what: str, secs: float) -> None:
        self.times[what] += secs

    def message(self, tokens: int) -> None:
        self.messages += 1
        self.tokens += tokens
        if self.messages >= self.every:
            self.flush()

    def flush(self) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        tokens = max(1, self.tokens)
        parts = [f"messages={self.messages}", f"tokens={self.tokens}"]
        parts += [f"{k}_us_per_token={v / tokens * 1e6:.1f}" for k, v in self.times.items()]
        parts.append(f"cpu_us_per_token={(cpu - self._cpu0) / tokens * 1e6:.1f}")
        parts.append(f"cpu_cores={(cpu - self._cpu0) / max(1e-9, wall - self._wall0):.2f}")
        self.sink(f"step profile [{self.label}] " + " ".join(parts))
        self.times = dict.fromkeys(self.times, 0.0)
        self.messages = self.tokens = 0
        self._wall0, self._cpu0 = wall, cpu
