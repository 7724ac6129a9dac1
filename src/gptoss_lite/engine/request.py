"""A request's life in the engine: its prompt, sampling rules, output so far, timings and status.

The sampling rules are `gptoss_lite.sampling.SamplingParams` (re-exported here and from
`gptoss_lite.engine`), the type `generate()` takes too.

The engine computes a request's tokens in order. `num_computed` tokens of `all_token_ids` have their
K/V in the cache; a step runs the next n of them (a prefill chunk, or the one token a decode step
feeds back) and, when that reaches the end of `all_token_ids`, samples one new token. Preemption by
recompute frees the request's blocks and sets `num_computed` back to 0 (or to a prefix-cache hit):
its prompt and output so far are simply run again, as one longer prompt.

A request is written in two places only (tests/test_import_graph.py): its own methods below, which
the scheduler, the queues and the facade call at each change of its life (admitted, preempted,
drafted, aborted, finished), and the scheduler's `postprocess`, which applies a step's results.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gptoss_lite.engine.detokenize import TextStream
from gptoss_lite.engine.tenants import TenantCounters
from gptoss_lite.sampling import SamplingParams  # re-exported: the engine's parameter type
from gptoss_lite.speculative import NgramIndex, PromptLookup


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and queued again
    RUNNING = "running"  # holds blocks and is scheduled every step
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Timestamps from `time.monotonic()`: arrival, first token, and every generated token."""

    arrival_time: float
    first_token_time: float | None = None
    scheduled_time: float | None = None  # first admitted to run (queue time = this - arrival_time)
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies, seconds (one fewer than the generated tokens)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class RequestOutput:
    """A request as a caller sees it after a step.

    While it runs, an output carries only what the step added: `new_token_ids` and `text_delta` (text
    that no later token can change; a piece that may still become a multi-byte character or a stop
    string waits for the next output). `token_ids` and `text` are filled on the final output only, so
    a consumer that falls behind holds O(new tokens) per output, never a copy of everything so far.
    The deltas of all outputs concatenate to the final `text` and `token_ids`.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated token, on the final output ([] before)
    new_token_ids: list[int]
    text: str  # the whole text, on the final output ("" before)
    finished: bool
    finish_reason: str | None  # None while running; "stop", "length", "abort" or "error"
    num_cached_tokens: int
    metrics: RequestMetrics
    text_delta: str = ""
    num_output_tokens: int = 0  # tokens generated so far
    error: str | None = None  # why the request failed (finish_reason "error")
    error_code: str | None = None  # what kind of failure: "queue_timeout" (it never got a slot), or None
    logprobs: list[TokenLogprobs] | None = None  # for new_token_ids, when the request asked for them
    index: int = 0  # which of the request's n samples (request_id is the request's, shared by all n)


@dataclass
class TokenLogprobs:
    """One generated token's log-probability and the `logprobs` most likely tokens' (most likely first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class Request:
    """Engine-side state of one request (see the module docstring)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        scope: str,
        eos_id: int | None,
        *,
        tenant: str = "default",
        priority: int = 0,
        stream: TextStream | None = None,
        group: str | None = None,
        index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling = sampling
        # greedy with nothing to adjust and no logprobs: one batched argmax gives its token (ModelRunner.sample)
        self.plain_greedy = sampling.greedy and not sampling.adjusts_logits and sampling.logprobs is None
        self.scope = scope  # the prefix cache's scope
        self.tenant = tenant  # whose share of the engine it runs on (engine/fairness.py)
        self.priority = priority  # lower runs first within its tenant's share
        self.queue_order = 0  # its place in its tenant's queue (set when queued)
        self.queued_at = 0.0  # when it was queued, by the queue's clock (for max_queue_time)
        self.last_step = 0  # the last step it was scheduled in (which held-back rows run first)
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.num_computed = 0  # tokens whose K/V the cache holds
        self.num_cached_tokens = 0  # prompt tokens the first prefix-cache hit supplied
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.error: str | None = None  # set with finish_reason "error"
        self.error_code: str | None = None  # "queue_timeout" for a request that never got a slot in time
        self.stream = stream  # the output text, when the engine has a tokenizer
        self.token_counts: dict[int, int] = {}  # generated token id -> times (for the penalties)
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None  # logit_bias as (ids, values) tensors
        # the id outputs carry: the request's, for each of its n samples
        self.group = request_id if group is None else group
        self.index = index  # which sample
        self.forks: list[Request] = []  # samples 1..n-1, waiting for this one's prompt to be computed
        self.new_logprobs: list[TokenLogprobs] = []  # since the last output, when sampling.logprobs is set
        # Speculative decoding (LLM(speculate=...)): the prompt-lookup index of its tokens (a draft model
        # keeps its sequences itself, engine/drafting.py), and the draft tokens this step verifies after
        # its last token (docs/engine.md#speculative-decoding).
        self.drafter: NgramIndex | None = None
        self.draft: list[int] = []
        self.acceptance = 0.5  # running estimate of the share of its draft tokens the verification keeps
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.stop_ids = set(sampling.stop_token_ids)
        if eos_id is not None and not sampling.ignore_eos:
            self.stop_ids.add(eos_id)
        # The same generator `generate()` seeds for a one-row batch, so a seeded request draws the
        # same tokens alone or in a batch.
        self.generator: torch.Generator | None = None
        if not sampling.greedy and sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling.seed)

    # ------------------------------------------------------------------ its life, step by step

    def fork_later(self, samples: list[Request]) -> None:
        """Samples 1..n-1 of this request start from its K/V once its prompt is computed."""
        self.forks = list(samples)

    def enqueue(self, order: int, at: float | None = None) -> None:
        """Its place in its tenant's queue (and, when first queued, the queue clock's time)."""
        self.queue_order = order
        if at is not None:
            self.queued_at = at

    def mark_scheduled(self, now: float) -> bool:
        """It runs (admitted, or forked from a running request); True the first time."""
        if self.metrics.scheduled_time is not None:
            return False
        self.metrics.scheduled_time = now
        return True

    def ran_in(self, step: int) -> None:
        """The last step it was scheduled in (held-back rows take turns by it)."""
        self.last_step = step

    def admit(self, hit: int) -> None:
        """It starts running with the first `hit` tokens from the prefix cache (on its first admission,
        the tokens it reports as cached)."""
        if self.num_preemptions == 0:
            self.num_cached_tokens = hit
        self.num_computed = hit
        self.status = RequestStatus.RUNNING

    def requeue(self, *, preempted: bool) -> None:
        """Back to waiting with nothing computed (its blocks are freed): preempted by recompute, or an
        admission that found no blocks after all."""
        self.draft = []
        self.num_computed = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions += preempted

    def start_as_fork(self, source: Request) -> None:
        """A sample starts on `source`'s computed prompt but its last token, which it runs itself so
        that it draws its first token with its own generator."""
        self.num_computed = len(source.prompt_token_ids) - 1
        self.num_cached_tokens = source.num_cached_tokens
        self.status = RequestStatus.RUNNING

    def set_draft(self, tokens: list[int]) -> None:
        """The draft tokens this step verifies after its last token ([] for none)."""
        self.draft = tokens

    def trim_draft(self, n: int) -> None:
        """Keep the first n draft tokens (a step's token budget cuts the draft, never the token)."""
        del self.draft[max(0, n) :]

    def pass_draft(self, min_acceptance: float) -> bool:
        """Whether it sits this step out of drafting: its running acceptance is below `min_acceptance`
        (most of its drafts were rejected). It drifts back up a little every step it waits."""
        if self.acceptance >= min_acceptance:
            return False
        self.acceptance += 0.01
        return True

    def lookup_index(self, spec: PromptLookup) -> NgramIndex:
        """Its prompt-lookup index, made on first use, brought up to date with its output."""
        if self.drafter is None:
            self.drafter = NgramIndex(spec.ngram, spec.min_ngram)
            self.drafter.tokens.extend(self.prompt_token_ids)
        index = self.drafter
        index.tokens.extend(self.output_token_ids[len(index.tokens) - len(self.prompt_token_ids) :])
        return index

    def verified(self, accepted: int) -> None:
        """A draft was verified and `accepted` of its tokens kept: the running acceptance moves toward
        that share, and the rejected tokens' K/V no longer counts (the pools roll back too)."""
        self.acceptance = 0.7 * self.acceptance + 0.3 * accepted / len(self.draft)
        self.num_computed -= len(self.draft) - accepted

    def finish(self, reason: str, error: str | None = None, error_code: str | None = None) -> None:
        """It ends with finish reason `reason` ("stop", "length", "abort" or "error", with why)."""
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        if error is not None:
            self.error = error
        if error_code is not None:
            self.error_code = error_code

    def abort(self) -> None:
        """Ended by the caller: finish reason "abort", and no sample forks from it any more."""
        self.finish("abort")
        self.forks = []

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_range(self, start: int, n: int) -> list[int]:
        """Tokens start … start + n - 1 of `all_token_ids` and then the draft, without building the
        whole list (the runner calls this for every request on every step)."""
        P = len(self.prompt_token_ids)
        if start >= P:
            out = self.output_token_ids[start - P : start - P + n]
        else:
            out = self.prompt_token_ids[start : start + n] + self.output_token_ids[: max(0, start + n - P)]
        if len(out) < n and self.draft:
            held = P + len(self.output_token_ids)
            out += self.draft[max(0, start - held) : start + n - held]
        return out

    @property
    def last_token_id(self) -> int:
        """The last token the request holds (what a plain decode step feeds)."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_to_run(self) -> int:
        """Tokens this request still has to run before it samples: the rest of its prompt (or the one
        token decode feeds back), plus its draft."""
        return self.num_tokens + len(self.draft) - self.num_computed

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        """Positions the request can reach: prompt + max_tokens."""
        return len(self.prompt_token_ids) + self.sampling.max_tokens

    def append(self, token: int, now: float) -> str | None:
        """Add a generated token (its time, its count for the penalties, its text); the finish reason
        it meets ("stop": a stop token or string, "length": max_tokens), or None to go on."""
        self.output_token_ids.append(token)
        self.token_counts[token] = self.token_counts.get(token, 0) + 1
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.token_times.append(now)
        stream = self.stream
        reason = None
        if stream is not None and stream.push(token):
            reason = "stop"  # a stop string: the text is cut before it
        elif token in self.stop_ids:
            reason = "stop"
        elif len(self.output_token_ids) >= self.sampling.max_tokens:
            reason = "length"
        if reason is not None and stream is not None and stream.finish():
            reason = "stop"  # the decoder's last characters completed a stop string
        return reason

    def output(self, new_token_ids: list[int]) -> RequestOutput:
        """This step's output (see RequestOutput): deltas while running, everything when finished."""
        stream, done = self.stream, self.finished
        if stream is not None and done:
            stream.finish()
        return RequestOutput(
            request_id=self.group,
            prompt_token_ids=self.prompt_token_ids,  # never changed by the engine: shared, not copied
            token_ids=list(self.output_token_ids) if done else [],
            new_token_ids=new_token_ids,
            text=stream.text if done and stream is not None else "",
            finished=done,
            finish_reason=self.finish_reason,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
            text_delta=stream.take() if stream is not None else "",
            num_output_tokens=len(self.output_token_ids),
            error=self.error,
            error_code=self.error_code,
            logprobs=self._take_logprobs(),
            index=self.index,
        )

    def _take_logprobs(self) -> list[TokenLogprobs] | None:
        if self.sampling.logprobs is None:
            return None
        taken, self.new_logprobs = self.new_logprobs, []
        return taken

    def adjusted_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (1, V) after logit_bias, the penalties and the logits processor (fp32; a new tensor).
        The engine has checked that every biased id is in the vocabulary."""
        out = logits.float().clone()
        sampling = self.sampling
        if sampling.logit_bias:
            if self._bias is None:  # built on the first token, reused for every other
                ids, values = zip(*sampling.logit_bias)
                self._bias = (torch.tensor(ids, device=out.device), torch.tensor(values, device=out.device))
            out[0, self._bias[0]] += self._bias[1]
        if self.token_counts and (sampling.presence_penalty or sampling.frequency_penalty):
            ids = torch.tensor(list(self.token_counts), device=out.device)
            counts = torch.tensor(list(self.token_counts.values()), dtype=torch.float32, device=out.device)
            out[0, ids] -= sampling.frequency_penalty * counts + sampling.presence_penalty
        if sampling.logits_processor is not None:
            processed = sampling.logits_processor(self.output_token_ids, out[0])
            if not isinstance(processed, torch.Tensor) or processed.shape != out[0].shape:
                raise TypeError(f"logits_processor returned {type(processed).__name__}, not a tensor of shape (V,)")
            out = processed.float().reshape(1, -1)
        return out


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


@dataclass(frozen=True)
class PreparedRequest:
    """A prompt's token ids and its sampling, checked once by `LLM.prepare`."""

    token_ids: list[int]
    sampling: SamplingParams


@dataclass
class EngineStats:
    """A snapshot of the engine for metrics and benchmarks. Blocks count the full-layer pool and the
    sliding-layer pool together; prefix figures count the engine's lookups (a request's first
    admission and every resumption after preemption) and the prompt tokens they reused."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int  # of the used blocks, those held by nobody but the prefix cache (reclaimable)
    prefix_queries: int
    prefix_hits: int  # prompt tokens served from the cache
    prefix_hit_rate: float  # prefix_hits / prompt tokens looked up
    preemptions: int
    finished: int
    aborted: int
    generated_tokens: int
    failed: int = 0  # requests finished with finish_reason "error" (a fault confined to them)
    kv_format: str = "dense"  # full-layer K/V storage: 'dense' (the model's dtype), 'int8' or 'int4'
    kv_bytes: int = 0  # bytes allocated for K/V (both pools, scales and full-precision tails included)
    spec_drafted: int = 0  # speculative decoding: draft tokens proposed
    spec_accepted: int = 0  # draft tokens the verification kept
    spec_verifications: int = 0  # drafts verified (one per request per step that had one)
    spec_tokens: int = 0  # tokens those verifications emitted (accepted drafts + one each)
    tenants: dict[str, TenantCounters] = field(default_factory=dict)  # per tenant: queues, tokens, refusals
