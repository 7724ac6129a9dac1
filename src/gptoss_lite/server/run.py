"""A `Run`: one queued request's life on the server, from its first token to its answer. It reads the
engine loop's channel, watches the client, parses harmony, runs built-in tool rounds for
/v1/responses, and builds the JSON body or the SSE events of all three endpoints."""

from __future__ import annotations

import asyncio
import sqlite3

from fastapi import Request

from gptoss_lite.engine import QuotaExceeded, SamplingParams
from gptoss_lite.server import bodies as B
from gptoss_lite.server import protocol as P
from gptoss_lite.server import response_events as RE
from gptoss_lite.server.builtin_tools import ToolLoop
from gptoss_lite.server.engine_loop import Channel, QueueFull, ShuttingDown
from gptoss_lite.server.harmony import chat_delta, chat_message, finish_reason
from gptoss_lite.server.sse import sse, sse_event
from gptoss_lite.server.state import BUSY_RETRY_AFTER, ServerState, busy_error


class Run:
    """One accepted request (its n samples): reads its channel, aborts it if its client goes away or
    stops reading."""

    def __init__(self, state: ServerState, tenant: str, rid: str, channel: Channel, n: int = 1):
        self.state, self.tenant, self.rid, self.channel, self.n = state, tenant, rid, channel, n
        self.done = False  # the engine finished it (or failed it): nothing to abort
        self.finals: dict[int, object] = {}  # sample index -> final output
        self.logprob_offset: dict[int, int] = {}  # per sample: characters of token text before the next entry
        self.parsers: dict[int, object] | None = None  # per sample, a HarmonyStream (a harmony chat)
        self.writer: RE.EventWriter | None = None  # a /v1/responses request: its items and events
        self.answer_n = n  # samples the answer shows (best_of generates more; the best n are shown)
        self.show_logprobs = True  # False: logprobs were computed only to rank best_of samples
        self.on_response = None  # /v1/responses: on_response(final body, output items) keeps it
        self.response: dict | None = None  # /v1/responses: the final Response body, once complete
        self.echo = ""  # what each completion choice begins with (`echo: true`: the prompt)
        self.metadata: dict | None = None  # a chat request's, echoed in its answer
        # A response with built-in tools: several rounds of generation, one engine request each.
        self.loop: ToolLoop | None = None
        self.engine_rid = rid  # the engine request of the round being generated
        self.req = None  # the request (its sampling fields and token limit, for later rounds)
        self.prompt_ids: list[int] = []  # the prompt of the round being generated
        self.scope, self.harmony_choice = "", None
        self.priority = 0  # the request's, for later rounds of a response with built-in tools
        self.client_gone = False
        self._held = None  # an update `started` took from the channel, for the stream to begin with

    async def _watch(self, request: Request) -> None:
        """Wake the reader when the server reports that the client disconnected (the body is already
        read, so the next ASGI message is the disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.client_gone = True
        self.channel.leave()

    async def started(self, request: Request) -> bool:
        """Wait for the request's first update (its first tokens, or its end), watching for the client
        leaving meanwhile; False if it left (the request is aborted). A request that timed out in the
        queue raises its 429 here; any other update is kept for the stream to begin with."""
        watcher = asyncio.ensure_future(self._watch(request))
        try:
            update = await self.channel.get()
        except BaseException:  # the handler was cancelled (the server stops): free the request
            self.abort()
            raise
        finally:
            watcher.cancel()
        if update.client_gone:
            self.abort()
            return False
        for final in update.finals.values():
            if final.error_code == "queue_timeout":
                self.done = True  # the engine loop has aborted the other samples
                raise _queue_timeout(final)
        self._held = update
        return True

    async def _next(self):
        """The next update; an APIError 500 if the server ended the request or the engine failed it,
        429 if it timed out in its tenant's queue."""
        update, self._held = self._held or await self.channel.get(), None
        if update.failure is not None:
            self.done = True
            code = "shutting_down" if self.state.draining else None
            raise P.APIError(503 if code else 500, update.failure, type="server_error", code=code)
        for index, final in update.finals.items():
            if final.finish_reason == "error":
                self.done = True  # the engine loop has aborted the other samples
                if final.error_code == "queue_timeout":
                    raise _queue_timeout(final)
                raise P.APIError(500, f"the engine failed on this request: {final.error}", type="server_error")
            self.finals[index] = final
        if len(self.finals) == self.n and not self.done:
            self.done = True
            first = self.finals[0]
            self.state.metrics.record_usage(self.tenant, len(first.prompt_token_ids), first.num_cached_tokens)
        return update

    @property
    def complete(self) -> bool:
        return len(self.finals) == self.n

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self.state.engine.abort(self.engine_rid)
            self.state.metrics.aborted.inc()

    def stalled(self) -> None:
        """The client stopped reading the stream for the stall timeout: abort, and count it."""
        if not self.done:
            self.state.metrics.stalled.inc()
        self.abort()

    def _usage(self) -> dict:
        first = self.finals[0]
        generated = sum(len(out.token_ids) for out in self.finals.values())
        return B.usage(len(first.prompt_token_ids), generated, first.num_cached_tokens)

    def _answered(self, entries: dict[int, list]) -> list[tuple[int, object]]:
        """(choice index, final output) of the samples the answer shows: all n, or with best_of the n
        whose tokens have the highest total logprob (ties: the earlier sample), numbered 0..n-1 in
        that order. `entries` (logprobs by sample) is renumbered to match, emptied where logprobs were
        computed only to rank."""
        finals = sorted(self.finals.items())
        if self.answer_n >= len(finals):
            return finals
        total = {i: sum(e.logprob for e in entries.get(i, [])) for i, _ in finals}
        chosen = sorted(finals, key=lambda item: (-total[item[0]], item[0]))[: self.answer_n]
        shown = {new: entries.get(i, []) if self.show_logprobs else [] for new, (i, _) in enumerate(chosen)}
        entries.clear()
        entries.update(shown)
        return [(new, out) for new, (_, out) in enumerate(chosen)]

    # ---- /v1/responses ----------------------------------------------------------------------------

    def _response_status(self) -> str:
        if self.loop is not None and self.loop.stopped is not None:
            return "incomplete"
        return "incomplete" if self.finals[0].finish_reason == "length" else "completed"

    def _response_usage(self) -> dict:
        """Tokens of the response: with built-in tools, every round's prompt and output summed (each
        round reads its whole prompt, mostly from the prefix cache: cached_tokens says how much)."""
        loop = self.loop
        if loop is not None:
            return RE.usage(loop.prompt_tokens, loop.output_tokens, loop.cached_tokens, loop.reasoning_tokens)
        first = self.finals[0]
        reasoning = self.parsers[0].reasoning_tokens if self.parsers is not None else 0
        return RE.usage(len(first.prompt_token_ids), len(first.token_ids), first.num_cached_tokens, reasoning)

    def _finish_response(self) -> list[dict]:
        """The last events of a Response (an empty message if it wrote nothing); `response` is its body."""
        writer = self.writer
        events = [] if writer.items else writer.open(RE.new_message_item())
        reason = self.loop.stopped if self.loop is not None else None
        events += writer.finish(self._response_status(), self._response_usage(), reason)
        self.response = events[-1]["response"]
        return events

    def _ends_in_builtin_call(self, final) -> bool:
        """The round ended in a call to a built-in tool (its <|call|>): the server runs it and goes on."""
        parser, harmony = self.parsers[0], self.state.harmony
        ids = final.token_ids
        return parser.ended_in_builtin and final.finish_reason == "stop" and bool(ids) and ids[-1] == harmony.call_token

    async def _tool_round(self):
        """Run the built-in call the last round ended in (yielding its item's events), then begin the
        next round on the prompt extended by the call and the tool's answer. When no round may follow
        (the bound on calls, the output budget or the context is spent), `loop.stopped` says why and
        the response is left to be finished; when the client has gone, nothing more is started."""
        loop = self.loop
        call = loop.take()
        async for events in loop.run(call, self.writer):
            yield events
        if self.client_gone:
            return
        if loop.ignored > 1:  # a second call past the bound: the model will not stop calling
            loop.stopped = "max_tool_calls"
            return
        ids = self.prompt_ids + list(self.finals[0].token_ids) + loop.tool_message(call, loop.answer)
        await self._start_round(ids)

    async def _start_round(self, ids: list[int]) -> None:
        """Queue the next round of a response with built-in tools (or set `loop.stopped`)."""
        state, loop, req = self.state, self.loop, self.req
        budget = state.llm.max_model_len - len(ids)
        if req.token_limit is not None:
            budget = min(budget, req.token_limit - loop.output_tokens)
        if budget < 1:
            loop.stopped = "max_output_tokens"
            return
        try:
            sampling = SamplingParams(max_tokens=budget, **req.sampling_kwargs(), **loop.round_extra())
            prepared = state.llm.prepare(ids, sampling)
            loop.rounds += 1
            engine_rid = f"{self.rid}-{loop.rounds}"
            channel = await state.engine.add(
                engine_rid, prepared, self.scope, tenant=self.tenant, priority=self.priority
            )
        except (QuotaExceeded, QueueFull) as exc:  # busy, not broken: the client may retry the response
            raise busy_error(state, self.tenant, exc) from None
        except (ShuttingDown, ValueError, TypeError) as exc:
            why = f"the next round of the response could not start: {exc}"
            raise P.APIError(503, why, type="server_error") from None
        self.engine_rid, self.channel, self.prompt_ids = engine_rid, channel, list(prepared.token_ids)
        self.finals, self.done = {}, False
        self.parsers = {0: state.harmony.stream(self.harmony_choice, loop.declared)}

    def _response_events(self, update) -> list[dict]:
        """The Response events of one update (output items open, grow and close as the text comes).
        With logprobs asked for, those of the tokens that wrote a message's text go with that text."""
        writer, events = self.writer, []
        final = update.finals.get(0)
        logprobs = update.logprobs.get(0, [])
        if self.parsers is not None:
            parser = self.parsers[0]
            tokens = update.tokens.get(0, [])
            # With logprobs, one token at a time: which of them are message text is the parser's to say.
            steps = list(zip(([t] for t in tokens), logprobs)) if len(logprobs) == len(tokens) else [(tokens, None)]
            for chunk, entry in steps:
                delta = parser.feed(chunk)
                if entry is not None and _writes_message_text(parser, chunk[0]):
                    writer.note_logprobs(self._logprob_entries([entry]))
                events += self._items_of(parser, delta)
            if final is not None:
                events += self._items_of(parser, self._finish_parse(parser))
                if self.loop is not None:
                    self.loop.add_round(final, parser)
                    if self._ends_in_builtin_call(final):
                        self.loop.pending = parser.parts[-1]
                        return events
        else:
            if logprobs:
                writer.note_logprobs(self._logprob_entries(logprobs))
            if update.text.get(0):
                if not writer.items:
                    events += writer.open(RE.new_message_item())
                events += writer.add(update.text[0])
        if final is not None:
            events += self._finish_response()
        return events

    async def _keep_response(self) -> None:
        """Store the complete response (off the event loop) before its client sees the end, so a
        `previous_response_id` sent right after finds it; an APIError 500 if the store fails."""
        transcript = self.loop.transcript if self.loop is not None else {}
        try:
            await asyncio.to_thread(self.on_response, self.response, self.writer.items, transcript)
        except sqlite3.Error as exc:
            why = f"the response could not be stored: {exc}"
            raise P.APIError(500, why, type="server_error", code="store_failed") from None

    def _items_of(self, parser, delta) -> list[dict]:
        """The events of what a harmony parse added: items opened ("" text) and text added. A call to a
        built-in tool gets its item when the call is complete (ToolLoop.run)."""
        events = []
        for index, text in delta.parts:
            if parser.parts[index].kind == "builtin":
                events += self.writer.close()  # what came before the call is done
            elif text == "":
                events += self.writer.open(RE.new_item(parser.parts[index]))
            else:
                events += self.writer.add(text)
        return events

    def _logprob_entries(self, entries: list) -> list[dict]:
        """TokenLogprobs as an output_text part lists them: token, logprob, bytes, top_logprobs."""
        return (self._logprobs(entries, True, 0) or {"content": []})["content"]

    async def _response_batches(self):
        """The events of a /v1/responses answer in the batches they become known: each engine update's,
        then, when a round ends in a built-in call, the call's and those of the end of the response."""
        while not self.complete:
            yield self._response_events(await self._next())
            if self.complete and self.loop is not None and self.loop.pending is not None:
                async for events in self._tool_round():
                    yield events
                if self.complete:  # no round may follow: the response ends here
                    yield self._finish_response()

    async def response_events(self):
        """The SSE stream of a /v1/responses request (named events, no [DONE], as the API sends). The
        response is stored before the client sees its last event."""
        try:
            for event in self.writer.start():  # sent before anything is added: its snapshot lists no output
                yield sse_event(event)
            for event in self.loop.list_items(self.writer) if self.loop is not None else []:
                yield sse_event(event)
            try:
                async for events in self._response_batches():
                    if self.response is not None:
                        await self._keep_response()
                    for event in events:
                        yield sse_event(event)
            except P.APIError as exc:
                yield sse_event(self.writer.event("error", message=exc.message, code=exc.code, param=None))
        finally:
            self.abort()

    def _finish_parse(self, parser):
        """End a sample's harmony parse; a stream the parser refused is counted (its text is content)."""
        delta = parser.finish()
        if parser.malformed is not None:
            self.state.metrics.harmony_malformed.inc()
        return delta

    def _logprobs(self, entries: list, chat: bool, index: int) -> dict | None:
        """The API's logprobs object for these TokenLogprobs of one sample (None when none were asked for)."""
        if not entries:
            return None
        tokenizer = self.state.llm.tokenizer
        rows = [
            (*_piece(tokenizer, e.token_id), e.logprob, [(*_piece(tokenizer, t), v) for t, v in e.top]) for e in entries
        ]
        if chat:
            return B.chat_logprobs(rows)
        offset = self.logprob_offset.get(index, 0)
        self.logprob_offset[index] = offset + sum(len(r[0]) for r in rows)
        return B.completion_logprobs(rows, offset)

    async def collect(self, request: Request, chat: bool) -> dict:
        """Wait for the whole answer (non-streaming); abort if the client disconnects meanwhile."""
        watcher = asyncio.ensure_future(self._watch(request))
        entries: dict[int, list] = {}
        if self.loop is not None:
            self.loop.list_items(self.writer)
        try:
            while True:
                update = await self._next()
                for index, lps in update.logprobs.items():
                    entries.setdefault(index, []).extend(lps)
                if self.writer is not None:
                    self._response_events(update)
                elif self.parsers is not None:
                    for index, tokens in update.tokens.items():
                        self.parsers[index].feed(tokens)
                if self.complete and self.loop is not None and self.loop.pending is not None:
                    async for _ in self._tool_round():
                        pass
                    if self.client_gone:
                        return {}
                    if not self.complete:
                        continue  # the next round
                    self._finish_response()  # no round may follow: the response ends here
                    break
                if self.complete:
                    break
                if update.client_gone:
                    return {}  # nobody to answer; the finally aborts the request
        finally:
            watcher.cancel()
            self.abort()
        if self.writer is not None:
            await self._keep_response()
            return self.response
        choice = B.chat_choice if chat else B.completion_choice
        choices = []
        for i, out in self._answered(entries):
            answer, reason = self.echo + out.text, out.finish_reason
            if self.parsers is not None:
                parser = self.parsers[i]
                self._finish_parse(parser)
                answer, reason = chat_message(parser), finish_reason(parser, reason)
            choices.append(choice(i, answer, reason, self._logprobs(entries.get(i, []), chat, i)))
        if chat:
            return B.chat_body(self.rid, self.state.model_name, choices, self._usage(), self.metadata)
        return B.completion_body(self.rid, self.state.model_name, choices, self._usage())

    async def events(self, chat: bool, include_usage: bool):
        """SSE events: deltas as tokens arrive (each chunk names its sample's `index`), the finish
        reasons, usage if asked, then [DONE]. Text the engine hands out is final (it holds back a
        possible stop string or a cut character), so the deltas join to the non-streamed text."""
        name = self.state.model_name
        pending: dict[int, list] = {}  # per sample: logprobs of tokens whose text has not been sent yet
        try:
            if chat:
                for i in range(self.n):
                    yield sse(B.chat_chunk(self.rid, name, {"role": "assistant", "content": ""}, None, index=i))
            elif self.echo:
                for i in range(self.n):
                    yield sse(B.completion_chunk(self.rid, name, self.echo, None, index=i))
            while not self.complete:
                try:
                    update = await self._next()
                except P.APIError as exc:
                    yield sse(exc.body())
                    break
                for index, lps in update.logprobs.items():
                    pending.setdefault(index, []).extend(lps)
                for index in sorted(set(update.text) | set(update.finals) | set(update.tokens)):
                    text = update.text.get(index, "")
                    final = update.finals.get(index)
                    reason = final.finish_reason if final is not None else None
                    delta = {"content": text} if text else {}
                    if self.parsers is not None:  # a harmony chat: the parsed pieces, not the raw text
                        parser = self.parsers[index]
                        parsed = parser.feed(update.tokens.get(index, ()))
                        if final is not None:
                            parsed.extend(self._finish_parse(parser))
                            reason = finish_reason(parser, reason)
                        delta = chat_delta(parsed)
                    elif not (text or reason):
                        continue
                    if not (delta or reason):
                        continue
                    logprobs = self._logprobs(pending.pop(index, []), chat, index)
                    if chat:
                        yield sse(B.chat_chunk(self.rid, name, delta, reason, logprobs=logprobs, index=index))
                    else:
                        yield sse(B.completion_chunk(self.rid, name, text, reason, logprobs=logprobs, index=index))
            if self.complete and include_usage:
                chunk = B.chat_chunk if chat else B.completion_chunk
                yield sse(chunk(self.rid, name, None, None, self._usage()))
            yield "data: [DONE]\n\n"
        finally:
            self.abort()  # a no-op unless the client left before the end


def _queue_timeout(final) -> P.APIError:
    """The 429 for a request that waited longer than its tenant's max_queue_time without a slot."""
    return P.APIError(
        429, final.error, type="server_error", code="queue_timeout", headers=P.retry_after(BUSY_RETRY_AFTER)
    )


def _writes_message_text(parser, token: int) -> bool:
    """Whether a token just fed to a harmony parse is text of a message (not reasoning, a call, a
    header or a control token): the tokens whose logprobs a Response's output_text reports."""
    if parser.malformed is not None:
        return True  # everything from the refused token on is answered as message text
    part = parser.parts[-1] if parser.parts else None
    return (
        parser.in_text and part is not None and part.kind == "content" and not parser.encoding.is_special_token(token)
    )


def _piece(tokenizer, token_id: int) -> tuple[str, bytes]:
    """A token's text and bytes, as logprobs show them (a byte that is part of a character shows as
    U+FFFD; its bytes say which)."""
    raw_of = getattr(tokenizer, "token_bytes", None)
    raw = raw_of(token_id) if raw_of is not None else tokenizer.decode([token_id]).encode("utf-8")
    return raw.decode("utf-8", errors="replace"), raw


# Characters JSON may leave raw that some line splitters (Python's str.splitlines, JavaScript before
# ES2019) take for line ends; escaped, an SSE `data:` line stays one line for every client.
