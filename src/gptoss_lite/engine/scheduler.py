"""Which tokens of which requests the next step runs: continuous batching with chunked prefill.

Every step has a token budget (`max_batch_tokens`). Running requests come first, oldest first: a
decoding request takes one token, a request still in its prompt takes the next chunk (as much of the
budget as is left). Waiting requests are then admitted, oldest first, while budget, `max_running`
and free blocks allow. So a long prompt never holds running requests back for more than the one
chunk that shares their step, and requests join and leave between any two steps.

Admission never over-commits the pool: a request is admitted only when the blocks for its whole prompt
are free (or held only by the prefix cache, which gives them up) beside what the running prompts
still need. When a running request cannot get
a block for its next tokens, the newest running request is *preempted by recompute*: its blocks are
freed and it goes back to the front of the queue, to run its prompt and output so far again later
(most of it usually comes back from the prefix cache). Its output is unchanged: the tokens it
generated stay, and the next one is sampled after the recomputation reaches them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gptoss_lite.engine.kv_manager import KVManager
from gptoss_lite.engine.request import Request, RequestStatus
from gptoss_lite.kv.block_pool import AppendPlan


@dataclass
class ScheduledStep:
    """One step's work: (request, tokens to run, where they go per layer kind), in batch order."""

    scheduled: list[tuple[Request, int, dict[str, AppendPlan]]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n, _ in self.scheduled)


class Scheduler:
    """Waiting and running queues over a `KVManager` (see the module docstring)."""

    def __init__(self, kv: KVManager, *, max_batch_tokens: int, max_running: int, decode_reserve: int = 0) -> None:
        self.kv = kv
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.decode_reserve = decode_reserve  # decode tokens of growth kept free per running request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and free its blocks (finish or abort)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.draft = []
        self.kv.free(request)
        request.num_computed = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admissible(self, request: Request) -> bool:
        """Whether the request's whole prompt surely fits beside what the running requests still need
        to finish theirs (a prefix hit only needs fewer blocks), and, with a `decode_reserve`, beside
        the blocks every running request and this one will take for their next decode tokens (the
        watermark). Admitting on the first chunk alone would let new prompts take the blocks running
        ones are about to need, and preempt in circles; admitting on prompts alone lets long outputs
        outgrow the pool and preempt each other."""
        kv, step, reserve = self.kv, self.max_batch_tokens, self.decode_reserve
        for kind in kv.kinds:
            spare = kv.spare_blocks(kind)
            for running in self.running:
                left = running.num_tokens - running.num_computed
                if left > 1:  # still in its prompt
                    spare -= kv.prompt_blocks(kind, left, step)
                spare -= kv.growth_blocks(kind, running.max_total_tokens - running.num_tokens, reserve)
            # alone, it may always start
            own = kv.growth_blocks(kind, request.max_total_tokens - request.num_tokens, reserve) if self.running else 0
            if kv.prompt_blocks(kind, request.num_tokens, step) + own > spare:
                return False
        return True

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.max_batch_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_to_run, budget)
            if n < request.num_to_run and request.draft:  # the budget cuts the draft, never the token
                del request.draft[max(0, n - (request.num_tokens - request.num_computed)) :]
                n = request.num_to_run
            plans = self.kv.allocate(request, n)
            while plans is None:
                victim = self.running[-1]  # the newest; never one already scheduled (those sit before i)
                self._preempt(victim)
                step.preempted.append(victim)
                if victim is request:
                    break
                plans = self.kv.allocate(request, n)
            if plans is None:
                break  # the request preempted itself: everything after it is gone too
            step.scheduled.append((request, n, plans))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_running and not step.preempted:
            request = self.waiting[0]
            if not self._admissible(request):
                break
            hit = self.kv.start(request)
            if request.num_preemptions == 0:
                request.num_cached_tokens = hit
            request.num_computed = hit
            n = min(request.num_tokens - hit, budget)
            plans = self.kv.allocate(request, n)
            if plans is None:  # cannot happen after _admissible; stay safe and keep it queued
                self.kv.free(request)
                request.num_computed = 0
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.scheduled.append((request, n, plans))
            budget -= n
        return step
