"""One background thread that owns the LLM: it takes add/abort commands from a queue, runs
`llm.step()` while there is work, and hands each request's updates to that request's asyncio queue.

The LLM is not thread-safe, so nothing else calls it: the HTTP handlers (on the asyncio event loop)
only put commands on `_commands` and await what comes back. Results cross back with
`loop.call_soon_threadsafe`, once per engine step for the whole batch.

Each request's updates go into its `Channel`, which coalesces them: a handler that falls behind (its
client reads slowly) finds the text of every step it missed joined into one piece and the final
output, never a backlog of one object per step. Outputs carry deltas (the step's new tokens and text),
so what a slow reader's channel holds grows with the text it has not sent, not with the square of it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from gptoss_lite.engine import EngineStats, PreparedRequest, RequestOutput
from gptoss_lite.engine.tenants import DEFAULT_TENANT


class QueueFull(Exception):
    """The waiting queue already holds max_waiting requests."""


class ShuttingDown(Exception):
    """The engine loop has stopped (or is stopping) and takes no new requests."""


@dataclass
class Update:
    """What a request's channel holds since the handler last looked (see Channel.get), by sample index
    (0 .. n-1; a request without `n` has only 0)."""

    text: dict[int, str]  # the text deltas of the steps since, joined, per sample that had any
    finals: dict[int, RequestOutput]  # samples that finished since, with their final output
    failure: str | None  # the request was ended by the server (engine gone, stopping): why
    client_gone: bool  # the client disconnected
    logprobs: dict[int, list] = field(default_factory=dict)  # TokenLogprobs of those tokens, per sample
    tokens: dict[int, list[int]] = field(default_factory=dict)  # the token ids of those steps, per sample


class Channel:
    """One request's updates from the engine thread to its handler, coalesced (module docstring).
    Used on the event loop only: the engine thread reaches it through call_soon_threadsafe."""

    def __init__(self) -> None:
        self._parts: dict[int, list[str]] = {}
        self._logprobs: dict[int, list] = {}
        self._tokens: dict[int, list[int]] = {}
        self._finals: dict[int, RequestOutput] = {}
        self._failure: str | None = None
        self._gone = False
        self._wake = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        if out.text_delta:
            self._parts.setdefault(out.index, []).append(out.text_delta)
        if out.logprobs:
            self._logprobs.setdefault(out.index, []).extend(out.logprobs)
        if out.new_token_ids:
            self._tokens.setdefault(out.index, []).extend(out.new_token_ids)
        if out.finished:
            self._finals[out.index] = out
        self._wake.set()

    def fail(self, why: str) -> None:
        self._failure = why
        self._wake.set()

    def leave(self) -> None:
        """The client disconnected: wake the handler."""
        self._gone = True
        self._wake.set()

    async def get(self) -> Update:
        """Wait for something new, then take all of it."""
        await self._wake.wait()
        self._wake.clear()
        text = {i: "".join(parts) for i, parts in self._parts.items()}
        update = Update(text, self._finals, self._failure, self._gone, self._logprobs, self._tokens)
        self._parts, self._logprobs, self._tokens, self._finals = {}, {}, {}, {}
        return update


@dataclass
class _Route:
    loop: asyncio.AbstractEventLoop
    channel: Channel
    remaining: int  # samples not finished yet
    tenant: str


@dataclass
class _Add:
    request_id: str
    prepared: PreparedRequest
    scope: str
    tenant: str
    priority: int
    out: Channel
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Any  # fn(llm) -> result, run on the engine thread between steps
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass
class _FailAll:
    why: str


@dataclass
class _Stop:
    pass


@dataclass
class Snapshot:
    """What the HTTP side may read without touching the LLM: the stats after the last step."""

    stats: EngineStats | None = None
    steps: int = 0
    last_step_time: float = field(default_factory=time.monotonic)


class EngineLoop:
    """Owns `llm` on one thread. Use from the event loop: `await add(...)`, `abort(...)`, `stop()`.

    `on_finished(output, tenant)` is called on the engine thread for each sample that finishes (not
    for aborted or failed ones; for one that timed out in its tenant's queue, yes: its wait is a
    figure too), e.g. to record latency histograms.
    """

    def __init__(self, llm, *, max_waiting: int, on_finished=None):
        if max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting}: must be >= 1")
        self.llm = llm
        self.max_waiting = max_waiting
        self.on_finished = on_finished
        self.snapshot = Snapshot(stats=llm.stats())
        self.error: str | None = None  # the last failure (a request's or a whole step's), for /health
        self.failed_requests = 0  # requests the engine finished with an error, confined to them
        self.queue_timeouts = 0  # requests that waited past their tenant's max_queue_time (not failures)
        self.step_failures = 0  # steps that raised out of the engine (their running requests failed)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[str, _Route] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="gptoss-engine", daemon=True)

    # ---- event-loop side -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    async def add(
        self,
        request_id: str,
        prepared: PreparedRequest,
        scope: str,
        *,
        tenant: str = DEFAULT_TENANT,
        priority: int = 0,
    ) -> Channel:
        """Queue a request (tokenised and checked by `llm.prepare` in the caller's thread); returns its
        channel once the engine accepted it. `tenant` is whose share of the engine it runs on and
        `priority` its order within that share (lower first; engine/fairness.py).

        Raises the engine's ValueError for a request it refuses, QuotaExceeded when the tenant's quota
        refuses it now, QueueFull, or ShuttingDown.
        """
        if not self.alive:
            raise ShuttingDown("the server is shutting down")
        loop = asyncio.get_running_loop()
        out = Channel()
        done = loop.create_future()
        self._commands.put(_Add(request_id, prepared, scope, tenant, priority, out, done, loop))
        try:
            await done  # raises what add_request raised
        except asyncio.CancelledError:  # the client left while the add was queued: undo it
            self.abort(request_id)
            raise
        return out

    async def call(self, fn):
        """Run fn(llm) on the engine thread between two steps and return its result (or raise)."""
        if not self.alive:
            raise ShuttingDown("the server is shutting down")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(_Call(fn, done, loop))
        return await done

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished); its blocks are freed on the engine thread."""
        self._commands.put(_Abort(request_id))

    def fail_all(self, why: str) -> None:
        """End every request now (aborted in the engine, blocks freed); each handler gets `why`."""
        self._commands.put(_FailAll(why))

    @property
    def idle(self) -> bool:
        """No request is queued or running (as of the last step)."""
        s = self.snapshot.stats
        return not self._routes and (s is None or s.num_running + s.num_waiting == 0)

    def stop(self, timeout: float | None = None) -> None:
        """Abort everything still running, end the thread, and wait for it."""
        self._stopping = True
        self._commands.put(_Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- engine thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        llm = self.llm
        while True:
            try:  # block only when there is nothing to step
                cmd = self._commands.get_nowait() if llm.has_unfinished() else self._commands.get()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if isinstance(cmd, _Stop):
                    self._abort_all("the server stopped")
                    self.snapshot = Snapshot(llm.stats(), self.snapshot.steps)
                    return
                try:
                    self._handle(cmd)
                except Exception:  # noqa: BLE001 - one bad command must not end the engine thread
                    traceback.print_exc()
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if llm.has_unfinished():
                self._step()
            self.snapshot = Snapshot(llm.stats(), self.snapshot.steps + 1)

    def _handle(self, cmd) -> None:
        llm = self.llm
        if isinstance(cmd, _Add):
            try:
                if llm.num_waiting >= self.max_waiting:
                    raise QueueFull(f"{llm.num_waiting} requests are already waiting (max_waiting={self.max_waiting})")
                llm.add_request(
                    cmd.prepared, request_id=cmd.request_id, scope=cmd.scope, tenant=cmd.tenant, priority=cmd.priority
                )
            except Exception as exc:  # noqa: BLE001 - handed to the waiting handler, which maps it to a status
                cmd.loop.call_soon_threadsafe(_settle, cmd.done, exc)
                return
            self._routes[cmd.request_id] = _Route(cmd.loop, cmd.out, cmd.prepared.sampling.n, cmd.tenant)
            cmd.loop.call_soon_threadsafe(_settle, cmd.done, None)
        elif isinstance(cmd, _Call):
            try:
                result = cmd.fn(llm)
            except Exception as exc:  # noqa: BLE001 - raised again in the caller
                cmd.loop.call_soon_threadsafe(_settle, cmd.done, exc)
                return
            cmd.loop.call_soon_threadsafe(_settle, cmd.done, None, result)
        elif isinstance(cmd, _Abort):
            if self._routes.pop(cmd.request_id, None) is not None:
                llm.abort(cmd.request_id)
        elif isinstance(cmd, _FailAll):
            self._abort_all(cmd.why)

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except Exception as exc:  # noqa: BLE001 - a bug outside any one request: fail those running, keep serving
            self.step_failures += 1
            self.error = f"{type(exc).__name__} in an engine step"
            self._abort_all("the engine failed during a step; see the server log")
            traceback.print_exc()
            return
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:  # aborted by its client after this step began
                continue
            if out.finished:
                route.remaining -= 1
                if out.finish_reason == "error":
                    # A request that never got a slot in time is the load's doing, not a fault: its
                    # handler answers 429 and /health's failure figures stay for faults.
                    if out.error_code == "queue_timeout":
                        self.queue_timeouts += 1
                        if self.on_finished is not None:
                            self.on_finished(out, route.tenant)
                    else:
                        self.failed_requests += 1
                        self.error = out.error
                    del self._routes[out.request_id]
                    self.llm.abort(out.request_id)  # its other samples too: the request has failed
                else:
                    if route.remaining == 0:
                        del self._routes[out.request_id]
                    if self.on_finished is not None:
                        self.on_finished(out, route.tenant)
            batches.setdefault(route.loop, []).append((route.channel, out))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _abort_all(self, why: str) -> None:
        for rid, route in list(self._routes.items()):
            try:
                self.llm.abort(rid)
            except Exception:  # noqa: BLE001 - keep freeing the others
                traceback.print_exc()
            route.loop.call_soon_threadsafe(route.channel.fail, why)
        self._routes.clear()


def _settle(fut: asyncio.Future, exc: BaseException | None, value=None) -> None:
    if fut.done():  # the handler was cancelled (client gone) while the command was queued
        return
    if exc is None:
        fut.set_result(value)
    else:
        fut.set_exception(exc)


def _deliver(items: list[tuple[Channel, RequestOutput]]) -> None:
    for channel, out in items:
        channel.put(out)
