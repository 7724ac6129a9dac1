"""Which tokens of which requests the next step runs: continuous batching with chunked prefill.

Every step has a token budget (`max_batch_tokens`). Running requests come first, in the order they
were admitted: a decoding request takes one token, a request still in its prompt takes the next chunk
(as much of the budget as is left). Waiting requests are then admitted while budget, `max_running`
and free blocks allow, in the order `fairness.TenantQueues` gives: tenants in turn by their share of
the tokens, and first come first served within a tenant's priority level (with one tenant, simply
oldest first). So a long prompt never holds running requests back for more than the one chunk that
shares their step, and requests join and leave between any two steps. With every slot taken, a
waiting tenant under its share of the slots makes a request of the tenant furthest over its share
yield (preempted, as below).

Admission never over-commits the pool: a request is admitted only when the blocks for its whole prompt
are free (or held only by the prefix cache, which gives them up) beside what the running prompts
still need. When a running request cannot get
a block for its next tokens, a running request is *preempted by recompute* (the newest of the tenant
furthest over its share; with one tenant, the newest): its blocks are
freed and it goes back to the front of its tenant's queue, to run its prompt and output so far again later
(most of it usually comes back from the prefix cache). Its output is unchanged: the tokens it
generated stay, and the next one is sampled after the recomputation reaches them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from gptoss_lite.engine.config import EngineConfig
from gptoss_lite.engine.fairness import TenantQueues
from gptoss_lite.engine.kv_manager import BlockCopy, KVManager
from gptoss_lite.engine.request import Request, RequestOutput, TokenLogprobs
from gptoss_lite.kv.block_pool import AppendPlan
from gptoss_lite.speculative import SpeculationStats

logger = logging.getLogger(__name__)


class Scheduled(NamedTuple):
    """One request's part of a step: how many of its tokens run, where they go per layer kind, and per
    layer kind the blocks its keys are read from (`KVManager.tables`: its resident blocks and the
    position of the first)."""

    request: Request
    num_tokens: int
    plans: dict[str, AppendPlan]
    tables: dict[str, tuple[tuple[int, ...], int]]


@dataclass
class ScheduledBatch:
    """One step's work, in batch order; the copy-on-write block copies the runner makes before the
    step's forward, in the order the allocations asked for them; the requests preempted to make room
    for it (for blocks, or to give a tenant under its share a slot); and the waiting requests that ran
    out of queue time."""

    scheduled: list[Scheduled] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    expired: list[Request] = field(default_factory=list)
    # > 1: a decode burst, each request running this many tokens one compiled step after another,
    # each step fed the token the one before sampled (`Scheduler._burst_length`)
    decode_steps: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(entry.num_tokens for entry in self.scheduled)


# What a step's forward and sampling gave, in the runner's terms: (request, its token, or for a
# verified draft its list of tokens, and its logprobs or None); and (request, why its step failed).
Sampled = tuple[Request, "int | list[int]", "TokenLogprobs | None"]
Failed = tuple[Request, str]


@dataclass
class StepOutcome:
    """What `Scheduler.postprocess` made of a step: the outputs callers see; the requests that finished
    (stop, length or error: out of the queues, blocks freed); and the samples aborted because the
    request they were to fork from failed before its prompt was computed."""

    outputs: list[RequestOutput] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    aborted: list[Request] = field(default_factory=list)


# A decode burst's longest expected wall time: a request that arrives during one waits this long at
# most before the scheduler sees it (steps of a larger model are too slow to burst at all).
MAX_BURST_SECONDS = 0.03


class Scheduler:
    """Waiting and running queues over a `KVManager` (see the module docstring)."""

    def __init__(self, kv: KVManager, config: EngineConfig, bursts: bool = True) -> None:
        """`bursts` False: one decode token a round whatever `config.decode_steps` (the runner's bursts
        need the compiled step over 16-bit blocks, and speculation gives several tokens a step its own
        way, choosing by the tokens/s of its single steps)."""
        self.kv = kv
        self.max_batch_tokens = config.max_batch_tokens
        self.max_running = config.max_running
        self.decode_reserve = config.decode_reserve  # decode tokens of growth kept free per running request
        self.decode_steps = config.decode_steps if bursts else 1  # the longest decode burst
        self.decode_step_seconds: float | None = None  # a decode step's time, smoothed (`record_decode`)
        self.waiting = TenantQueues(config.tenants)  # the waiting requests, per tenant, and each tenant's share
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.speculation = SpeculationStats()  # drafts verified, kept and the tokens they gave

    def add(self, request: Request) -> None:
        self.waiting.add(request)

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and free its blocks (finish or abort)."""
        if request in self.running:
            self.running.remove(request)
            self.waiting.left_running(request)
        else:
            self.waiting.remove(request)
        self.waiting.refund(request)
        self.kv.free(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.requeue(preempted=True)
        self.num_preemptions += 1
        self.waiting.requeue(request)

    def _yield_slots(self, step: ScheduledBatch) -> None:
        """Every slot is taken and tenants under their share of the slots wait: for each, the running
        request of the tenant furthest over its share yields (fairness.py)."""
        queues = self.waiting
        if not queues or len(self.running) < self.max_running:
            return
        for tenant in queues.starved(self.max_running):
            victim = queues.victim(self.running, self.max_running)
            if victim.tenant == tenant or not queues.can_yield(victim.tenant, self.max_running):
                return
            self._preempt(victim)
            step.preempted.append(victim)

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

    def record_decode(self, seconds: float) -> None:
        """A decode-only step took `seconds` (a burst: per step): what `_burst_length` expects of the next."""
        last = self.decode_step_seconds
        self.decode_step_seconds = seconds if last is None else 0.8 * last + 0.2 * seconds

    def _burst_length(self) -> int:
        """How many tokens each running request decodes this round: up to `decode_steps` when every one
        is a plain greedy decode (its token drawn by argmax alone, no draft, no samples to fork),
        nothing waits (the caller asks only when no request is held back or expired), the burst is
        expected to end within MAX_BURST_SECONDS, no request would pass its max_tokens, and the pools
        surely hold every request's tokens (a burst never preempts); else 1. A request that stops
        inside a burst finishes there: the tokens computed after its stop are dropped with its blocks."""
        seconds = self.decode_step_seconds
        if self.decode_steps == 1 or seconds is None or self.waiting or not self.running:
            return 1
        steps = min(self.decode_steps, int(MAX_BURST_SECONDS / seconds), self.max_batch_tokens // len(self.running))
        for request in self.running:
            if not request.plain_greedy or request.draft or request.forks or request.num_to_run != 1:
                return 1
            steps = min(steps, request.sampling.max_tokens - len(request.output_token_ids))
        if steps < 2:
            return 1
        # each request takes at most a copy-on-write block and the blocks its tokens start: a bound
        # (the pools give blocks back to windows first) so that allocating never falls short
        need = len(self.running) * (1 + -(-steps // self.kv.block_size))
        return steps if all(self.kv.spare_blocks(kind) >= need for kind in self.kv.kinds) else 1

    def schedule(self) -> ScheduledBatch:
        step = ScheduledBatch(expired=self.waiting.expired())
        self._yield_slots(step)
        short_of_blocks = False
        budget = self.max_batch_tokens
        held = self.waiting.held_back(self.running, self.max_running)
        step.decode_steps = burst = 1 if held or step.expired else self._burst_length()
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request in held:
                i += 1
                continue
            to_run = burst if burst > 1 else request.num_to_run
            n = min(to_run, budget)
            if n < to_run and request.draft:  # the budget cuts the draft, never the token
                request.trim_draft(n - (request.num_tokens - request.num_computed))
                n = request.num_to_run
            plans = self.kv.allocate(request, n, step.copies)
            while plans is None:
                short_of_blocks = True
                # never one already scheduled (those sit before i)
                victim = self.waiting.victim(self.running[i:], self.max_running)
                self._preempt(victim)
                step.preempted.append(victim)
                if victim is request:
                    break
                plans = self.kv.allocate(request, n, step.copies)
            if plans is None:
                continue  # the request preempted itself: the one after it now sits at i
            step.scheduled.append(Scheduled(request, n, plans, self.kv.tables(request)))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_running and not short_of_blocks:
            request = self.waiting.next_waiting(self.max_running)
            if request is None or not self._admissible(request):
                break
            hit = self.kv.start(request)
            request.admit(hit)
            n = min(request.num_tokens - hit, budget)
            plans = self.kv.allocate(request, n, step.copies)
            if plans is None:  # cannot happen after _admissible; stay safe and keep it queued
                self.kv.free(request)
                request.requeue(preempted=False)
                break
            self.waiting.admit(request, request.num_tokens - hit)
            self.running.append(request)
            step.scheduled.append(Scheduled(request, n, plans, self.kv.tables(request)))
            budget -= n
        return step

    # ------------------------------------------------------------------ after a step

    def postprocess(self, batch: ScheduledBatch, sampled: list[Sampled], failed: list[Failed]) -> StepOutcome:
        """Apply a step's results to its requests, the one place they change after a step: what ran is
        computed; failed requests finish with finish reason "error"; computed prompt blocks go into
        the prefix cache; the samples of an n-sample request fork from its computed prompt; a verified
        draft's rejected tokens are rolled back; the new tokens are appended, and a request that
        meets a stop rule finishes and frees its blocks."""
        outcome = StepOutcome()
        for entry in batch.scheduled:  # their K/V is written: what the runner ran is computed
            entry.request.num_computed += entry.num_tokens
        for request in batch.expired:
            self._finish_failed(request, self.waiting.expiry_reason(request), outcome, "queue_timeout")
        for request, why in failed:
            self._finish_failed(request, why, outcome)
        for entry in batch.scheduled:
            if not entry.request.finished:
                self.kv.cache_prompt(entry.request)
        now = time.monotonic()
        for request, token, logprobs in sampled:
            if request.forks:
                self._fork(request)  # before its token: it may finish (and free its blocks) right here
            if logprobs is not None:
                request.new_logprobs.append(logprobs)
            tokens = token if isinstance(token, list) else [token]
            verified = bool(request.draft)
            if verified:
                self._roll_back_draft(request, len(tokens) - 1)
            try:
                appended = []
                for t in tokens:
                    reason = request.append(t, now)
                    appended.append(t)
                    if reason is not None:
                        self._finish(request, reason, outcome)
                        break
            except Exception as exc:  # noqa: BLE001 - this request's text or stop rules; the others go on
                logger.exception("request %s failed after sampling", request.request_id)
                self._finish_failed(request, f"{type(exc).__name__} while appending a token", outcome)
                continue
            self.waiting.generated(request, len(appended))
            if verified:
                self.speculation.new_tokens += len(appended)
            outcome.outputs.append(request.output(appended))
        for entry in batch.scheduled:
            entry.request.set_draft([])  # verified, or its request failed
        return outcome

    def _finish(self, request: Request, reason: str, outcome: StepOutcome, **why: str | None) -> None:
        request.finish(reason, **why)
        self.remove(request)
        outcome.finished.append(request)

    def _finish_failed(self, request: Request, why: str, outcome: StepOutcome, code: str | None = None) -> None:
        """Finish a request with finish reason "error" (and error code `code`) and give its final
        output. Samples still waiting to fork from it are aborted: its prompt will not be computed."""
        for fork in request.forks:
            fork.abort()
            outcome.aborted.append(fork)
        request.fork_later([])
        self._finish(request, "error", outcome, error=why, error_code=code)
        outcome.outputs.append(request.output([]))

    def _fork(self, request: Request) -> None:
        """The first sample's prompt is computed: samples 1..n-1 start from its blocks, each with the
        last prompt token still to run, so each draws its first token with its own generator."""
        for fork in request.forks:
            self.kv.fork(request, fork, len(request.prompt_token_ids) - 1)
            fork.start_as_fork(request)
            self.running.append(fork)
            self.waiting.started(fork)
        request.fork_later([])

    def _roll_back_draft(self, request: Request, accepted: int) -> None:
        """After verifying a draft: forget the K/V of its rejected tokens (the pools' `truncate`)."""
        rejected = len(request.draft) - accepted
        stats = self.speculation
        stats.drafted += len(request.draft)
        stats.accepted += accepted
        stats.target_forwards += 1
        request.verified(accepted)
        if rejected:
            self.kv.truncate(request, request.num_computed)
