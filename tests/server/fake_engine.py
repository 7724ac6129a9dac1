"""A small, deterministic stand-in for `gptoss_lite.engine.LLM`, for fast server tests.

It keeps the engine's contract (add_request / step / abort / stats / generate, errors raised before
anything is queued, RequestOutput fields, block accounting, a scoped prefix cache) without a model:
the next token is a letter chosen from a hash of the sequence so far (greedy) or drawn from a seeded
generator. `step_delay` makes a step take wall time so tests can disconnect mid-stream.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass, field

from gptoss_lite.engine import EngineStats, PreparedRequest, RequestMetrics, RequestOutput, SamplingParams
from gptoss_lite.engine.config import EngineConfig
from gptoss_lite.tokenizer import ByteTokenizer

LETTERS = b"abcdefghijklmnopqrstuvwxyz   ."


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    scope: str
    rng: random.Random
    tokens: list[int] = field(default_factory=list)
    blocks: int = 0
    cached: int = 0
    text: str = ""
    sent: int = 0  # characters of text handed out as deltas
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))


class FakeLLM:
    """Engine-contract double: byte tokenizer, `kv_blocks` blocks of `block_size` tokens."""

    def __init__(
        self,
        *,
        max_model_len: int = 512,
        kv_blocks: int = 256,
        block_size: int = 4,
        max_running: int = 8,
        step_delay: float = 0.0,
        eos_after: int | None = None,
        chat_template: str | None = None,
        model_name: str = "fake",
    ):
        self.tokenizer = ByteTokenizer()
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.chat_template = chat_template
        self.block_size, self.kv_blocks, self.max_running = block_size, kv_blocks, max_running
        self.step_delay, self.eos_after = step_delay, eos_after
        self.engine_config = EngineConfig(max_running=max_running)  # no tenant policy: no quotas
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._all: dict[str, _Req] = {}
        self._cache: dict[str, set[str]] = {}
        self._counts = dict(prefix_queries=0, prefix_hits=0, finished=0, aborted=0, generated_tokens=0)
        self.steps = 0

    # -- contract ---------------------------------------------------------------------------------------

    def encode(self, prompt) -> list[int]:
        ids = (self.tokenizer.encode_prompt(prompt) if prompt else []) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("empty prompt")
        if any(not 0 <= i < self.tokenizer.vocab_size for i in ids):
            raise ValueError(f"prompt token ids must be in [0, {self.tokenizer.vocab_size})")
        return ids

    def prepare(self, prompt, sampling=None) -> PreparedRequest:
        sampling = sampling or SamplingParams()
        if sampling.n != 1:
            raise ValueError(f"n={sampling.n}: the fake engine draws one sample per request")
        ids = self.encode(prompt)
        if len(ids) + sampling.max_tokens > self.max_model_len:
            raise ValueError(f"prompt + max_tokens = {len(ids) + sampling.max_tokens} > max_model_len")
        return PreparedRequest(ids, sampling)

    def add_request(self, prompt, sampling=None, *, request_id=None, scope="default", tenant="default", priority=0):
        prepared = prompt if isinstance(prompt, PreparedRequest) else self.prepare(prompt, sampling)
        ids, sampling = prepared.token_ids, prepared.sampling
        rid = request_id or f"req-{len(self._all)}"
        if rid in self._all:
            raise ValueError(f"duplicate request_id {rid!r}")
        rng = random.Random(sampling.seed if sampling.seed is not None else random.random())
        req = _Req(rid, ids, sampling, scope, rng)
        self._all[rid] = req
        self._waiting.append(req)
        return rid

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        while self._waiting and len(self._running) < self.max_running:
            need = -(-(len(self._waiting[0].prompt) + 1) // self.block_size)
            if self._used() + need > self.kv_blocks:
                break
            req = self._waiting.pop(0)
            req.metrics.scheduled_time = time.monotonic()
            req.blocks = need
            req.cached = self._lookup(req)
            self._running.append(req)
        outs = []
        for req in list(self._running):
            tok = self._next_token(req)
            req.tokens.append(tok)
            now = time.monotonic()
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.token_times.append(now)
            self._counts["generated_tokens"] += 1
            req.blocks = -(-(len(req.prompt) + len(req.tokens)) // self.block_size)
            reason = self._finish(req, tok)
            outs.append(self._output(req, [tok], reason))
            if reason is not None:
                self._release(req, finished=True)
        return outs

    def abort(self, request_id) -> bool:
        req = self._all.get(request_id)
        if req is None or (req not in self._running and req not in self._waiting):
            return False
        if req in self._waiting:
            self._waiting.remove(req)
        self._release(req, finished=False)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def stats(self) -> EngineStats:
        used = self._used()
        q = self._counts["prefix_queries"]
        return EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_blocks_total=self.kv_blocks,
            kv_blocks_used=used,
            kv_blocks_free=self.kv_blocks - used,
            kv_blocks_cached=0,
            prefix_queries=q,
            prefix_hits=self._counts["prefix_hits"],
            prefix_hit_rate=self._counts["prefix_hits"] / q if q else 0.0,
            preemptions=0,
            finished=self._counts["finished"],
            aborted=self._counts["aborted"],
            generated_tokens=self._counts["generated_tokens"],
        )

    def validate(self) -> None:
        assert self._used() <= self.kv_blocks, "more blocks used than exist"

    def clear_prefix_cache(self) -> None:
        self._cache.clear()

    def generate(self, prompts, sampling=None, *, scope="default") -> list[RequestOutput]:
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        rids = [self.add_request(p, s, scope=scope) for p, s in zip(prompts, params)]
        final = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in rids]

    # -- internals --------------------------------------------------------------------------------------

    def _used(self) -> int:
        return sum(r.blocks for r in self._running)

    def _hashes(self, req: _Req) -> list[str]:
        """Chained hashes of the prompt's full blocks (the last prompt token is never served from cache)."""
        out, h = [], req.scope
        for i in range((len(req.prompt) - 1) // self.block_size):
            block = req.prompt[i * self.block_size : (i + 1) * self.block_size]
            h = hashlib.sha256((h + str(block)).encode()).hexdigest()
            out.append(h)
        return out

    def _lookup(self, req: _Req) -> int:
        known = self._cache.get(req.scope, set())
        hits = 0
        for h in self._hashes(req):
            if h not in known:
                break
            hits += 1
        self._counts["prefix_queries"] += len(req.prompt)
        self._counts["prefix_hits"] += hits * self.block_size
        self._cache.setdefault(req.scope, set()).update(self._hashes(req))
        return hits * self.block_size

    def _next_token(self, req: _Req) -> int:
        n = len(req.tokens)
        if self.eos_after is not None and n == self.eos_after and not req.sampling.ignore_eos:
            return self.tokenizer.eos_id
        if req.sampling.temperature <= 0:
            digest = hashlib.sha256(bytes(t % 256 for t in req.prompt[-8:] + req.tokens[-8:]) + bytes([n % 256]))
            return LETTERS[digest.digest()[0] % len(LETTERS)]
        return LETTERS[req.rng.randrange(len(LETTERS))]

    def _finish(self, req: _Req, tok: int) -> str | None:
        s = req.sampling
        text = self.tokenizer.decode(req.tokens)
        for stop in s.stop:
            if stop in text:
                req.text = text[: text.index(stop)]
                return "stop"
        req.text = text
        if (tok == self.tokenizer.eos_id and not s.ignore_eos) or tok in s.stop_token_ids:
            return "stop"
        return "length" if len(req.tokens) >= s.max_tokens else None

    def _output(self, req: _Req, new: list[int], reason: str | None) -> RequestOutput:
        """Deltas while running, everything on the final output (the engine's contract). The fake
        holds back nothing: its letters are ASCII, and a stop string is checked on the whole text."""
        done = reason is not None
        held = 0 if done else max((len(s) - 1 for s in req.sampling.stop), default=0)
        ready = req.text[: max(req.sent, len(req.text) - held)]
        delta, req.sent = ready[req.sent :], len(ready)
        return RequestOutput(
            request_id=req.rid,
            prompt_token_ids=list(req.prompt),
            token_ids=list(req.tokens) if done else [],
            new_token_ids=new,
            text=req.text if done else "",
            finished=done,
            finish_reason=reason,
            num_cached_tokens=req.cached,
            metrics=req.metrics,
            text_delta=delta,
            num_output_tokens=len(req.tokens),
        )

    def _release(self, req: _Req, *, finished: bool) -> None:
        if req in self._running:
            self._running.remove(req)
        req.blocks = 0
        self._counts["finished" if finished else "aborted"] += 1
