"""Sharing the engine between tenants: which waiting request is admitted next, which running request
yields its slot, and each tenant's quotas (docs/engine.md#sharing-between-tenants).

Every request belongs to a tenant (`LLM.add_request(..., tenant=...)`; the server's API key). Each
tenant has a share (a weight, 1 by default) and, optionally, limits (`TenantLimits`).

**Virtual time over tokens.** A tenant's virtual time grows by `tokens / share` for every token the
engine takes on for it: a prompt's uncached tokens when it is admitted (again after a preemption:
recomputing costs the same), and each generated token. A tenant that becomes active (its first
request after having none queued or running) starts level with the least-served active tenant: an
idle tenant banks no credit and carries no debt.

**Admission.** While requests wait, the next one comes from the tenant that is under its share of the
running slots (`max_running · share / Σ shares of the active tenants`) before one that is not, then
the smallest virtual time. Inside a tenant, the lowest `priority` value first, then first come first
served; a preempted request goes back to the front of its priority level.

**Slots.** With every slot taken, a waiting tenant under its slot share makes the running request of
the tenant furthest over its share (running / share) yield at the next step: the one with the largest
`priority` value, then the newest. Preemption for KV blocks picks its victim by the same rule. A
yielded request is preempted by recompute and keeps its tokens.

**Light tenants.** On a CPU a step's time grows with its rows (here 7.5 ms + 0.42 ms a row), so a
tenant with one request behind another's 63 would see every token take 4× its own step. While a
tenant that does not fill its share of the slots (a light one) runs, every other tenant runs at most
`share / light share · (light rows + F)` rows per step, F being a step's fixed cost counted in rows
(`StepCost`, fitted to the engine's own steps): the step then takes at most about (1 + share ratio)
times what the light rows would take alone, which is what an equal share of the engine's time
means for a tenant that can only use one row. The rows that sit a step out keep their slots and
blocks and take turns; the heavy tenant's throughput drops only while a light tenant runs.

**Quotas** (`TenantLimits`; engine/tenants.py holds the policy and counters): at most `max_running`
running and `max_waiting` waiting requests (a request beyond both is refused with `QuotaExceeded`),
`tokens_per_minute` (prompt + max_tokens per sample, charged when added, the unused part refunded
when it finishes), and `max_queue_time` seconds before a request that was never admitted ends with
an error.

With one tenant and no limits this is the engine's first-come-first-served order. `TenantPolicy(fair=
False)` keeps arrival order across tenants too (quotas still apply), for comparison.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from gptoss_lite.engine.tenants import QuotaExceeded, TenantCounters, TenantLimits, TenantPolicy

if TYPE_CHECKING:  # only for annotations: request.py imports nothing from here
    from gptoss_lite.engine.request import Request


class _TokenBucket:
    """tokens_per_minute as a bucket: holds up to a minute's tokens, refills continuously."""

    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.at = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait_for(self, cost: int, now: float) -> float:
        """0 if cost tokens are there now, else the seconds until they will be."""
        self._refill(now)
        return 0.0 if cost <= self.level else (cost - self.level) / self.rate

    def take(self, cost: int) -> None:
        self.level -= cost

    def refund(self, tokens: int, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + tokens)


class _Tenant:
    def __init__(self, name: str, limits: TenantLimits, now: float) -> None:
        self.name = name
        self.limits = limits
        self.vtime = 0.0
        self.waiting: list[tuple[int, int, Request]] = []  # heap of (priority, order, request)
        self.running = 0
        self.counters = TenantCounters()
        self.bucket = None if limits.tokens_per_minute is None else _TokenBucket(limits.tokens_per_minute, now)

    @property
    def active(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def head(self) -> Request:
        return self.waiting[0][2]


class StepCost:
    """A decode step's time as `fixed + per_row · rows`, fitted online to the engine's own decode-only
    steps (least squares, older steps weighing less: a weight of 0.99 per step). `fixed_rows()` is
    the fixed part in rows (fixed / per_row): how many rows a step could carry for the price of its
    fixed cost. Until the steps seen vary enough in rows to fit, `PRIOR_FIXED_ROWS`."""

    PRIOR_FIXED_ROWS = 16.0  # measured: 7.5 ms + 0.42 ms a row, gpt-oss-bench-20m, 2 threads, AMD EPYC
    DECAY = 0.99

    def __init__(self) -> None:
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def record(self, rows: int, seconds: float) -> None:
        d = self.DECAY
        self._n = d * self._n + 1.0
        self._x = d * self._x + rows
        self._y = d * self._y + seconds
        self._xx = d * self._xx + rows * rows
        self._xy = d * self._xy + rows * seconds

    def fixed_rows(self) -> float:
        n = self._n
        if n < 8:
            return self.PRIOR_FIXED_ROWS
        mean_x, mean_y = self._x / n, self._y / n
        var = self._xx / n - mean_x * mean_x
        if var < 4.0:  # the rows hardly varied: no slope to fit
            return self.PRIOR_FIXED_ROWS
        per_row = (self._xy / n - mean_x * mean_y) / var
        fixed = mean_y - per_row * mean_x
        if per_row <= 0 or fixed <= 0:
            return self.PRIOR_FIXED_ROWS
        return min(fixed / per_row, 1024.0)


class TenantQueues:
    """The waiting requests, per tenant, and each tenant's running count, virtual time, quotas and
    counters (the module docstring has the rule). The scheduler owns one; it iterates and sizes like
    the waiting queue it replaces."""

    def __init__(self, policy: TenantPolicy | None = None, *, clock=time.monotonic) -> None:
        self.policy = policy or TenantPolicy()
        self.clock = clock
        self._tenants: dict[str, _Tenant] = {}
        self._order = itertools.count()  # arrival order; preempted requests take -order to go first
        self._front = itertools.count(1)
        self._num_waiting = 0
        self._step = 0  # steps that held rows back so far (which held rows ran least recently)
        self.step_cost = StepCost()
        self._level = 0.0  # the virtual time a tenant activating with nobody active starts at

    # ---- the waiting queue ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._num_waiting

    def __bool__(self) -> bool:
        return self._num_waiting > 0

    def __iter__(self) -> Iterator[Request]:
        for tenant in self._tenants.values():
            for _, _, request in tenant.waiting:
                yield request

    def _tenant(self, name: str) -> _Tenant:
        tenant = self._tenants.get(name)
        if tenant is None:
            tenant = self._tenants[name] = _Tenant(name, self.policy.limits(name), self.clock())
        return tenant

    def _activate(self, tenant: _Tenant) -> None:
        """A tenant with nothing queued or running gets work: start it level with the active ones."""
        if tenant.active:
            return
        active = [t.vtime for t in self._tenants.values() if t.active]
        tenant.vtime = min(active) if active else self._level

    def add(self, request: Request) -> None:
        """Queue a new request at the back of its tenant's priority level."""
        tenant = self._tenant(request.tenant)
        self._activate(tenant)
        request.enqueue(next(self._order), self.clock())
        self._push(tenant, request)

    def requeue(self, request: Request) -> None:
        """Queue a preempted request at the front of its tenant's priority level."""
        tenant = self._tenants[request.tenant]
        tenant.running -= 1
        tenant.counters.running = tenant.running
        request.enqueue(-next(self._front))
        self._push(tenant, request)

    def _push(self, tenant: _Tenant, request: Request) -> None:
        heapq.heappush(tenant.waiting, (request.priority, request.queue_order, request))
        tenant.counters.waiting = len(tenant.waiting)
        self._num_waiting += 1

    def remove(self, request: Request) -> bool:
        """Take a waiting request out of the queue (aborted or expired); False if it is not waiting."""
        tenant = self._tenants.get(request.tenant)
        if tenant is None:
            return False
        for i, (_, _, queued) in enumerate(tenant.waiting):
            if queued is request:
                tenant.waiting[i] = tenant.waiting[-1]
                tenant.waiting.pop()
                heapq.heapify(tenant.waiting)
                tenant.counters.waiting = len(tenant.waiting)
                self._num_waiting -= 1
                self._note_idle(tenant)
                return True
        return False

    def _note_idle(self, tenant: _Tenant) -> None:
        if not tenant.active:
            self._level = max(self._level, tenant.vtime)

    # ---- admission -----------------------------------------------------------------------------------

    def slot_share(self, tenant: _Tenant, max_running: int) -> float:
        total = sum(t.limits.share for t in self._tenants.values() if t.active)
        return max_running * tenant.limits.share / total if total else float(max_running)

    def next_waiting(self, max_running: int) -> Request | None:
        """The request admission should try next (see the module docstring), or None when every
        waiting tenant is at its own max_running."""
        best, best_key = None, None
        for tenant in self._tenants.values():
            if not tenant.waiting:
                continue
            cap = tenant.limits.max_running
            if cap is not None and tenant.running >= cap:
                continue
            head = tenant.head
            if self.policy.fair:
                under = tenant.running < self.slot_share(tenant, max_running)
                key = (not under, tenant.vtime, head.metrics.arrival_time, head.queue_order)
            else:  # arrival order across tenants (a preempted request still goes first)
                key = (head.queue_order >= 0, head.queue_order)
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best

    def admit(self, request: Request, new_tokens: int) -> None:
        """The request at its tenant's head starts running, with new_tokens of its prompt to compute."""
        tenant = self._tenants[request.tenant]
        _, _, head = heapq.heappop(tenant.waiting)
        assert head is request, "admit: not the tenant's head"
        self._num_waiting -= 1
        tenant.running += 1
        c = tenant.counters
        c.waiting, c.running = len(tenant.waiting), tenant.running
        if request.mark_scheduled(self.clock()):
            c.admitted_requests += 1
        c.admitted_tokens += new_tokens
        tenant.vtime += new_tokens / tenant.limits.share

    def generated(self, request: Request, tokens: int) -> None:
        tenant = self._tenants[request.tenant]
        tenant.counters.generated_tokens += tokens
        tenant.vtime += tokens / tenant.limits.share

    def started(self, request: Request) -> None:
        """A request enters the running list without admission (a sample forked from a running one)."""
        tenant = self._tenants[request.tenant]
        tenant.running += 1
        tenant.counters.running = tenant.running
        request.mark_scheduled(self.clock())

    def left_running(self, request: Request) -> None:
        """A running request finished or was aborted."""
        tenant = self._tenants[request.tenant]
        tenant.running -= 1
        tenant.counters.running = tenant.running
        self._note_idle(tenant)

    def refund(self, request: Request) -> None:
        """A request ended (any way): give its tenant's bucket back the max_tokens it did not use."""
        tenant = self._tenants.get(request.tenant)
        if tenant is not None and tenant.bucket is not None:
            unused = request.sampling.max_tokens - len(request.output_token_ids)
            if unused > 0:
                tenant.bucket.refund(unused, self.clock())

    # ---- yielding ------------------------------------------------------------------------------------

    def over_share(self, name: str, max_running: int) -> float:
        """How far a tenant is over its slot share (running / share of slots; > 1 is over)."""
        tenant = self._tenants[name]
        return tenant.running / self.slot_share(tenant, max_running)

    def can_yield(self, name: str, max_running: int) -> bool:
        """Whether a tenant may give up a slot and still hold its share (no flapping: a share of 2.5
        slots keeps 3 against a tenant that would then hold more than its own)."""
        tenant = self._tenants[name]
        return tenant.running - 1 >= self.slot_share(tenant, max_running) - 1e-9

    def starved(self, max_running: int) -> list[str]:
        """Waiting tenants that one more slot keeps within their share, and under their own
        max_running, least served first (none when the policy is not fair). Paired with `can_yield`,
        a slot moves only from a tenant that stays at or above its share to one that stays at or
        below its own, so two tenants never take a slot back and forth."""
        out: list[tuple[float, str]] = []
        if not self.policy.fair:
            return []
        for tenant in self._tenants.values():
            cap = tenant.limits.max_running
            if tenant.waiting and (cap is None or tenant.running < cap):
                if tenant.running + 1 <= self.slot_share(tenant, max_running) + 1e-9:
                    out.append((tenant.vtime, tenant.name))
        return [name for _, name in sorted(out)]

    def held_back(self, running: list[Request], max_running: int) -> set[Request]:
        """The running requests that sit this step out so a light tenant's steps stay short (the module
        docstring, "Light tenants"): while a tenant that does not fill its share of the slots runs,
        every other tenant H runs at most `share_H / share_light · (rows_light + F)` rows, F being a
        step's fixed cost in rows (`StepCost`). The rows of H that ran least recently run first."""
        busy = [t for t in self._tenants.values() if t.running]
        if not self.policy.fair or len(busy) < 2:  # the common case: nothing to hold, no per-row work
            return set()
        total = sum(t.limits.share for t in self._tenants.values() if t.active)
        light = [t for t in busy if t.running + len(t.waiting) < max_running * t.limits.share / total]
        if not light or len(light) == len(busy):
            return set()
        rows, weight = sum(t.running for t in light), sum(t.limits.share for t in light)
        fixed = self.step_cost.fixed_rows()
        held: set[Request] = set()
        for tenant in busy:
            if tenant in light:
                continue
            allow = math.ceil(tenant.limits.share / weight * (rows + fixed))
            mine = [r for r in running if r.tenant == tenant.name]
            if len(mine) > allow:
                mine.sort(key=lambda r: r.last_step)
                held.update(mine[allow:])
        self._step += 1  # the turn order among held rows: stamped only while rows are held
        for request in running:
            if request not in held:
                request.ran_in(self._step)
        return held

    def victim(self, candidates: list[Request], max_running: int) -> Request:
        """Which of the candidates (running, in running order) yields: the one of the tenant furthest
        over its share, then the largest priority value, then the newest (last in running order)."""
        if not self.policy.fair:
            return max(enumerate(candidates), key=lambda ir: (ir[1].priority, ir[0]))[1]
        over = {name: self.over_share(name, max_running) for name in {r.tenant for r in candidates}}
        return max(enumerate(candidates), key=lambda ir: (over[ir[1].tenant], ir[1].priority, ir[0]))[1]

    # ---- quotas ----------------------------------------------------------------------------------------

    def check_quota(self, name: str, samples: int, tokens: int, max_running: int) -> None:
        """Raise QuotaExceeded if the tenant may not queue `samples` more requests costing `tokens`
        now; otherwise take the tokens from its per-minute bucket."""
        tenant = self._tenant(name)
        limits = tenant.limits
        if limits.max_waiting is not None:
            cap = (limits.max_running or max_running) + limits.max_waiting
            if tenant.running + len(tenant.waiting) + samples > cap:
                tenant.counters.rejected += 1
                raise QuotaExceeded(
                    name,
                    f"tenant {name!r} already has {tenant.running} running and {len(tenant.waiting)} waiting "
                    f"requests (its quota: {cap} at once); retry when one finishes",
                    retry_after=1.0,
                )
        if tenant.bucket is not None:
            if tokens > tenant.bucket.capacity:
                tenant.counters.rejected += 1
                raise ValueError(
                    f"the request needs {tokens} tokens (prompt + max_tokens per sample), more than tenant "
                    f"{name!r}'s tokens_per_minute={limits.tokens_per_minute}; lower max_tokens"
                )
            wait = tenant.bucket.wait_for(tokens, self.clock())
            if wait > 0:
                tenant.counters.rejected += 1
                raise QuotaExceeded(
                    name,
                    f"tenant {name!r} is over its tokens_per_minute={limits.tokens_per_minute}; "
                    f"{tokens} tokens are free again in {wait:.1f} s",
                    retry_after=wait,
                )
            tenant.bucket.take(tokens)

    def expired(self) -> list[Request]:
        """Take out the waiting requests that were never admitted and have waited longer than their
        tenant's max_queue_time."""
        now, out = self.clock(), []
        for tenant in self._tenants.values():
            limit = tenant.limits.max_queue_time
            if limit is None or not tenant.waiting:
                continue
            late = [r for _, _, r in tenant.waiting if r.metrics.scheduled_time is None and now - r.queued_at > limit]
            for request in late:
                self.remove(request)
                tenant.counters.expired += 1
                out.append(request)
        return out

    def expiry_reason(self, request: Request) -> str:
        limit = self._tenants[request.tenant].limits.max_queue_time
        waited = self.clock() - request.queued_at
        return (
            f"the request waited {waited:.1f} s for a slot, longer than the max_queue_time={limit:g} s of "
            f"tenant {request.tenant!r}; retry later"
        )

    def counters(self) -> dict[str, TenantCounters]:
        """Each tenant's counters (copies), by name."""
        return {name: dataclasses.replace(t.counters) for name, t in self._tenants.items()}

    def validate(self, running: list[Request]) -> None:
        """The counts agree with the queues: each tenant's running count is its requests in `running`."""
        counts: dict[str, int] = {}
        for request in running:
            counts[request.tenant] = counts.get(request.tenant, 0) + 1
        for name, tenant in self._tenants.items():
            assert tenant.running == counts.get(name, 0), (
                f"tenant {name!r}: running {tenant.running} != {counts.get(name, 0)}"
            )
        assert self._num_waiting == sum(len(t.waiting) for t in self._tenants.values())
