"""Serving one request: render the prompt (chat template, harmony, or a Responses transcript),
prepare its sampling (structured output, stops, logprobs), queue it on the engine loop and answer
JSON or SSE through a `Run` (server/run.py)."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from gptoss_lite.engine import PreparedRequest, QuotaExceeded, SamplingParams
from gptoss_lite.grammar import GrammarError, HarmonyConstraint, JsonConstraint, compile_schema, lltokenizer, schema_of
from gptoss_lite.harmony.render import function_tools
from gptoss_lite.server import protocol as P
from gptoss_lite.server import response_events as RE
from gptoss_lite.server import responses as R
from gptoss_lite.server.builtin_tools import ToolLoop
from gptoss_lite.server.chat import ChatTemplateError
from gptoss_lite.server.engine_loop import QueueFull, ShuttingDown
from gptoss_lite.server.harmony import RenderError, chained
from gptoss_lite.server.run import Run
from gptoss_lite.server.sse import SSEResponse
from gptoss_lite.server.state import ServerState, busy_error, cache_scope


async def serve_harmony(state: ServerState, request: Request, tenant: str, req: P.ChatCompletionRequest):
    harmony = state.harmony
    tools, choice = req.requested_tools, req.requested_tool_choice
    legacy = {"tools": req.tools_param, "tool_choice": "function_call" if req.function_call is not None else None}
    try:
        prompt = harmony.prompt(
            [m.as_dict() for m in req.messages],
            tools=tools,
            tool_choice=choice,
            effort=req.effort,
            response_format=req.structured,
        )
    except RenderError as exc:
        raise P.APIError(400, str(exc), param=legacy.get(exc.param) or exc.param) from None
    constraint = structured(state, req.structured, "response_format", tools, req.tools_param).get("logits_processor")
    extra = {
        "stop_token_ids": harmony.stop_token_ids,
        "logits_processor": chained(harmony.tool_choice_processor(tools, choice), constraint),
    }
    return await serve(state, request, tenant, req, prompt, chat=True, extra=extra, harmony_choice=choice)


async def serve_response(state: ServerState, request: Request, tenant: str, req: R.ResponsesRequest):
    """POST /v1/responses: the stored conversation (previous_response_id), then this input; with
    `truncation: "auto"` its oldest items are dropped until it fits the context. Built-in tools the
    request enables run inside the response (a ToolLoop)."""
    functions, enabled = state.tools.parse(req.tools)
    rid = RE.response_id()
    history, chain = [], rid
    if req.previous_response_id:
        history = await asyncio.to_thread(state.responses.conversation, tenant, req.previous_response_id)
        if history is None:
            raise P.APIError(
                404,
                f"Previous response with id {req.previous_response_id[:80]!r} not found",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        chain = await asyncio.to_thread(state.responses.chain, tenant, req.previous_response_id) or chain
    messages = history + R.input_messages(req, unseal=lambda sealed: state.sealer.open(tenant, sealed))
    head = [{"role": "system", "content": req.instructions}] if req.instructions else []
    builtin = await enabled.declarations() if enabled and state.harmony is not None else None
    render = _response_renderer(state, req, messages, functions, builtin)
    kept = messages
    if req.truncation == "auto":
        kept = R.fit_conversation(head, messages, lambda shown: _fits(state, render(shown), req.token_limit))
    prompt = render(head + kept)
    loop = None
    if state.harmony is not None:
        constraint = structured(state, req.structured, "text.format", functions).get("logits_processor")
        extra = {
            "stop_token_ids": state.harmony.stop_token_ids,
            "logits_processor": chained(state.harmony.tool_choice_processor(functions, req.tool_choice), constraint),
        }
        if builtin and req.tool_choice != "none":
            loop = ToolLoop(
                state.tools,
                enabled,
                builtin,
                encoding=state.harmony.encoding,
                tenant=tenant,
                chain=chain,
                max_calls=req.max_tool_calls,
                include=tuple(req.include or ()),
            )
            loop.round_extra = lambda: {  # later rounds: a fresh constraint, no tool_choice prefix
                "stop_token_ids": state.harmony.stop_token_ids,
                "logits_processor": constraint.fork() if constraint is not None else None,
            }
    else:
        extra = structured(state, req.structured, "text.format")

    def store(body: dict, items: list[dict], transcript: dict) -> None:
        if req.store:
            state.responses.put(tenant, body["id"], messages + R.output_messages(items, transcript), body, chain)

    seal = (lambda text: state.sealer.seal(tenant, text)) if req.wants_encrypted_reasoning else None
    return await serve(
        state,
        request,
        tenant,
        req,
        prompt,
        chat=True,
        extra=extra,
        harmony_choice=req.tool_choice,
        on_response=store,
        seal=seal,
        rid=rid,
        loop=loop,
    )


def _response_renderer(state: ServerState, req: R.ResponsesRequest, messages: list[dict], functions, builtin):
    """render(chat-shaped messages) -> the prompt of a /v1/responses request: harmony ids (declaring
    the function tools and the built-in ones), or the chat template's text (tools and effort being a
    400 on a model without harmony)."""
    if state.harmony is not None:

        def render(shown: list[dict]):
            try:
                return state.harmony.prompt(
                    shown,
                    tools=functions,
                    tool_choice=req.tool_choice,
                    effort=req.effort,
                    response_format=req.structured,
                    builtin=builtin,
                )
            except RenderError as exc:
                raise P.APIError(400, str(exc), param="input" if exc.param == "messages" else exc.param) from None

        return render
    params = ("tools", "tool_choice", "reasoning")
    refuse_harmony_fields(req.uses_tools(messages), req.tool_choice, req.effort, params=params)

    def render(shown: list[dict]):
        try:
            return state.template.render([{"role": m["role"], "content": m.get("content", "")} for m in shown])
        except ChatTemplateError as exc:
            raise P.APIError(400, str(exc), param="input") from None

    return render


def prompt_text(state: ServerState, prompt: str | list[int]) -> str:
    """A completions prompt as `echo: true` shows it: the text sent, or the text of the ids sent."""
    if isinstance(prompt, str):
        return prompt
    if state.llm.tokenizer is None:
        P.refuse("echo", "this model has no tokenizer to show the prompt's ids as text")
    try:
        return state.llm.tokenizer.decode(prompt)
    except (ValueError, TypeError, IndexError) as exc:
        raise P.APIError(400, f"prompt: {exc}", param="prompt") from None


def _fits(state: ServerState, prompt, max_tokens: int | None) -> bool:
    """Whether a prompt leaves room in the context for max_tokens (None: for at least one token)."""
    try:
        n_prompt = len(state.llm.encode(prompt))
    except (ValueError, TypeError):
        return True  # not a prompt at all: _prepare says why
    return n_prompt + (max_tokens or 1) <= state.llm.max_model_len


def structured(
    state: ServerState, response_format: dict | None, param: str, tools=None, tools_param: str = "tools"
) -> dict:
    """{"logits_processor": ...} that keeps JSON where JSON belongs ({} when nothing does; a 400 for a
    schema that does not compile). A plain model: the whole completion follows `response_format`. A
    harmony model: a final message's text follows it, and a call's arguments follow its tool's
    `parameters` (a strict tool's schema must compile; another's is constrained where it does)."""
    harmony = state.harmony
    if response_format is None and (harmony is None or not tools):
        return {}
    tokenizer = state.llm.tokenizer
    if tokenizer is None:
        raise P.APIError(400, f"{param}: structured output needs a model with a tokenizer", param=param)
    end = harmony.return_token if harmony is not None else tokenizer.eos_id
    try:
        lltok = lltokenizer(tokenizer, state.llm.config.vocab_size, end)
        final = None if response_format is None else compile_schema(schema_of(response_format), lltok)
    except GrammarError as exc:
        raise P.APIError(400, f"{param}: {exc}", param=param) from None
    if harmony is None:
        return {"logits_processor": JsonConstraint(lltok, final, end_token=end)}
    calls = {}
    for tool in function_tools(tools):
        if tool["parameters"] is None:
            continue
        try:
            calls[tool["name"]] = compile_schema(tool["parameters"], lltok)
        except GrammarError as exc:
            if tool["strict"]:
                raise P.APIError(400, f"{tools_param}: {tool['name']}: {exc}", param=tools_param) from None
    if final is None and not calls:
        return {}
    ends = (harmony.return_token, harmony.call_token)
    return {"logits_processor": HarmonyConstraint(lltok, harmony.encoding, final=final, calls=calls, ends=ends)}


def _prepare(state: ServerState, req, prompt, extra: dict | None = None) -> PreparedRequest:
    """The request tokenised and checked once (`LLM.prepare`), after checking that prompt +
    max_tokens fits the context (400 if not, or for anything the engine would refuse)."""
    limit = state.llm.max_model_len
    if isinstance(prompt, str) and state.llm.tokenizer is None:
        raise P.APIError(400, "this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
    try:
        ids = state.llm.encode(prompt)
    except (ValueError, TypeError) as exc:
        raise P.APIError(400, str(exc), param=getattr(req, "prompt_param", "prompt")) from None
    n_prompt = len(ids)
    max_tokens = req.token_limit
    if max_tokens is None:  # chat without a limit: the rest of the context
        max_tokens = limit - n_prompt
    if n_prompt + max_tokens > limit or max_tokens < 1:
        if req.token_limit is None:  # no limit asked: the prompt alone leaves no room to answer
            asked = f"the prompt has {n_prompt} tokens, which leaves no room for an answer; shorten the prompt"
        else:
            asked = (
                f"the prompt has {n_prompt} tokens and {max_tokens} more were requested ({n_prompt + max_tokens} "
                "in all); shorten the prompt or lower max_tokens"
            )
        raise P.APIError(
            400,
            f"This model's maximum context length is {limit} tokens; {asked}",
            param="messages" if isinstance(req, P.ChatCompletionRequest) else getattr(req, "prompt_param", "prompt"),
            code="context_length_exceeded",
        )
    try:
        sampling = SamplingParams(max_tokens=max_tokens, **req.sampling_kwargs(), **(extra or {}))
        return state.llm.prepare(ids, sampling)
    except (ValueError, TypeError) as exc:
        raise P.APIError(400, str(exc)) from None


async def serve(
    state: ServerState,
    request: Request,
    tenant: str,
    req,
    prompt,
    *,
    chat: bool,
    extra=None,
    harmony_choice=None,
    on_response=None,
    seal=None,
    echo: str = "",
    rid: str | None = None,
    loop: ToolLoop | None = None,
):
    """Queue the request and answer it. extra: more SamplingParams fields (a harmony chat's: its
    answer is then parsed); harmony_choice: its tool_choice; on_response(body, output items): the
    request is a /v1/responses one, answered as a Response, and this runs (in a worker thread) once
    it is complete, before the client sees the end; seal: reasoning text -> encrypted_content; echo:
    text every completion choice begins with (the prompt, for `echo: true`); rid: the response's id
    (made here if None); loop: a response's built-in tools, run between rounds of generation."""
    if state.draining:
        raise P.APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
    prepared = _prepare(state, req, prompt, extra)
    sampling = prepared.sampling
    if rid is None:
        rid = RE.response_id() if on_response is not None else f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    try:
        channel = await state.engine.add(
            rid, prepared, cache_scope(tenant, req.cache_salt), tenant=tenant, priority=req.priority
        )
    except (QuotaExceeded, QueueFull) as exc:
        raise busy_error(state, tenant, exc) from None
    except ShuttingDown as exc:
        raise P.APIError(503, str(exc), type="server_error", code="shutting_down") from None
    except (ValueError, TypeError) as exc:  # the engine refused the request (nothing was queued)
        raise P.APIError(400, str(exc)) from None
    run = Run(state, tenant, rid, channel, sampling.n)
    run.priority = req.priority
    if sampling.n > req.n:  # completions' best_of
        run.answer_n, run.show_logprobs = req.n, req.logprobs is not None
    if extra and state.harmony is not None:  # a harmony chat: parse each sample's tokens
        builtin = loop.declared if loop is not None else None
        run.parsers = {i: state.harmony.stream(harmony_choice, builtin) for i in range(sampling.n)}
    if loop is not None:
        run.loop, run.req, run.prompt_ids = loop, req, list(prepared.token_ids)
        run.scope, run.harmony_choice = cache_scope(tenant, req.cache_salt), harmony_choice
    if on_response is not None:
        run.writer, run.on_response = RE.EventWriter(rid, state.model_name, req, seal=seal), on_response
    run.echo, run.metadata = echo, getattr(req, "metadata", None)
    if req.stream and state.max_queue_time(tenant) is not None:
        # Until the request is admitted it may still time out in the queue: a 429 then, not a stream
        # that began with 200 and ends in an error event, so its first tokens are awaited first.
        if not await run.started(request):
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    if req.stream:
        return SSEResponse(
            run.response_events() if run.writer is not None else run.events(chat, req.include_usage),
            on_close=run.abort,
            on_stall=run.stalled,
            stall_timeout=state.stall_timeout,
            media_type="text/event-stream",
        )
    return JSONResponse(await run.collect(request, chat))


def refuse_harmony_fields(
    uses_tools: bool, tool_choice, effort: str | None, params=("tools", "tool_choice", "reasoning_effort")
) -> None:
    """What only a harmony model does: tools and reasoning effort are a 400 on any other model, naming
    the field the request used (`params`: its tools, tool choice and effort fields)."""
    tools_param, choice_param, effort_param = params
    if uses_tools:
        why = f"{tools_param}: this model does not call tools (it is not a harmony model)"
        raise P.APIError(400, why, param=tools_param)
    if tool_choice not in (None, "none", "auto"):
        raise P.APIError(400, f"{choice_param}: this model does not call tools", param=choice_param)
    if effort is not None:
        why = f"{effort_param}: this model does not reason (it is not a harmony model)"
        raise P.APIError(400, why, param=effort_param)
