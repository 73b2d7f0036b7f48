"""The scheduler's queue order: vLLM's ``--scheduling-policy`` (``fcfs`` or ``priority``), one class each.

The scheduler keeps ``running`` sorted from the most to the least important request and ``waiting`` in the
order it admits from; an order decides where a request goes in each, and which running request, if any, a
waiting one may push out. The KV-pressure victim is the same rule under both: the tail of ``running`` (the
least important request not in flight), so it needs nothing here.

- ``fcfs``: admission order. New requests join the back of the queue; a preempted one goes back to its front
  (it was the latest admitted, so it re-enters before anyone admitted after it); nobody displaces anybody.
- ``priority``: by (``priority``, arrival time, admission order), lower first, as vLLM's ``Request.__lt__``.
  Both queues stay in that order, a preempted request included (vLLM: "no concept of prepending"). A waiting
  request that cannot be admitted (no seat under ``max_num_seqs``, or no KV room) preempts the least important
  running request if that one's priority is strictly lower (a larger number) and it is not in a batch in
  flight (pipeline parallelism: a stage may still write its KV). vLLM's v1 scheduler has no such
  displacement (only its v0 did); lbd has it so a high-priority request arriving behind a full batch does not
  wait for the batch to drain.
"""

from __future__ import annotations

import bisect
from collections import deque

from lbd.engine.core.request import Request
from lbd.engine.core.sched_output import ScheduledSeq

POLICIES = ("fcfs", "priority")


def priority_key(req: Request) -> tuple[int, float, int]:
    """Lower is more important: vLLM's (priority, arrival_time), then the core's admission order."""
    return req.priority, req.arrival_time, req.order


class FcfsOrder:
    """First come, first served; no displacement."""

    name = "fcfs"

    def enqueue(self, waiting: deque[Request], req: Request) -> None:
        waiting.append(req)

    def requeue(self, waiting: deque[Request], req: Request) -> None:
        waiting.appendleft(req)

    def admit(self, running: list[Request], req: Request) -> None:
        running.append(req)

    def displaceable(self, req: Request, running: list[Request], in_flight: set[str]) -> Request | None:
        return None


class PriorityOrder:
    """Both queues by ``priority_key``; a waiting request may displace a running one of lower priority."""

    name = "priority"

    def enqueue(self, waiting: deque[Request], req: Request) -> None:
        bisect.insort(waiting, req, key=priority_key)

    requeue = enqueue

    def admit(self, running: list[Request], req: Request) -> None:
        bisect.insort(running, req, key=priority_key)

    def displaceable(self, req: Request, running: list[Request], in_flight: set[str]) -> Request | None:
        """The running request ``req`` may preempt: the least important one not in flight, if its priority is
        strictly lower than ``req``'s; else None."""
        for victim in reversed(running):
            if victim.request_id not in in_flight:
                return victim if victim.priority > req.priority else None
        return None


def make_order(policy: str) -> FcfsOrder | PriorityOrder:
    if policy == "fcfs":
        return FcfsOrder()
    if policy == "priority":
        return PriorityOrder()
    raise ValueError(f"unknown scheduling policy {policy!r}; expected one of {', '.join(POLICIES)}")


def unschedule(req: Request, decodes: list[ScheduledSeq], prefills: list[ScheduledSeq]) -> tuple[int, int]:
    """Take ``req`` out of the step being built (it is being preempted); returns the (tokens, prefill
    tokens) it had been given, for the step's budgets. Call before the preemption resets its computed
    tokens: whether its chunk counted as prefill depends on them."""
    for seqs in (decodes, prefills):
        for k, seq in enumerate(seqs):
            if seq.request is req:
                del seqs[k]
                n = seq.num_new_tokens
                return n, (n if req.num_tokens - req.num_computed_tokens > 1 else 0)
    return 0, 0
