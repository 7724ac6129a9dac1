"""`LLM`: the engine's facade, for a batch of prompts (`generate`) or a stream of them
(`add_request` / `step` / `abort`).

```python
from gptoss_lite.engine import LLM, SamplingParams

llm = LLM("path/to/model")
outs = llm.generate(["Hello", "The passkey is"], SamplingParams(max_tokens=32, temperature=0))
```

Each `step()` is schedule → execute → postprocess: the `Scheduler` picks a `ScheduledBatch`, the
`ModelRunner` runs one forward over every scheduled token and samples (changing no request), and
`Scheduler.postprocess` applies the results to the requests: computed tokens, appended tokens, stop
rules, rollback of rejected drafts, finished requests' blocks freed.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from gptoss_lite.checkpoint import load_model
from gptoss_lite.engine import sources
from gptoss_lite.engine.config import DEFAULT_MAX_BATCH_TOKENS, OFFLINE_STEP_BUDGETS, EngineConfig
from gptoss_lite.engine.detokenize import TextStream
from gptoss_lite.engine.drafting import PagedDrafter
from gptoss_lite.engine.kv_manager import KVManager, pool_blocks
from gptoss_lite.engine.request import (
    EngineStats,
    PreparedRequest,
    Request,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)
from gptoss_lite.engine.runner import ModelRunner, make_store
from gptoss_lite.engine.scheduler import ScheduledBatch, Scheduler
from gptoss_lite.engine.speculation import DecodeChoice, propose_drafts
from gptoss_lite.engine.tenants import DEFAULT_TENANT
from gptoss_lite.kv.paged_cache import PagedKVStore
from gptoss_lite.kvspec import model_kv_specs
from gptoss_lite.model.transformer import GPTOSS
from gptoss_lite.speculative import DraftModel, PromptLookup, SpeculationStats
from gptoss_lite.validation import check_int

logger = logging.getLogger(__name__)


class LLM:
    """Continuous-batching engine over a paged KV pool (see the module docstring and docs/engine.md).
    Its knobs are `EngineConfig`'s fields (engine/config.py): KV memory, bits and full-layer window,
    batch and step sizes, the admission watermark, speculation, compiled decode."""

    def __init__(self, model: GPTOSS | str | Path, *, tokenizer=None, config: EngineConfig | None = None, **knobs):
        """model: a prepared GPTOSS, a checkpoint directory or a preset name. knobs: EngineConfig
        fields, over `config` when both are given."""
        cfg = EngineConfig(**knobs) if config is None else dataclasses.replace(config, **knobs)
        model, model_dir, source = self._load(model, cfg)
        self.model, self.config = model, model.config
        self.tokenizer = tokenizer if tokenizer is not None else sources.own_tokenizer(model_dir, self.config)
        limit = self.config.max_position_embeddings
        self.max_model_len = check_int("max_model_len", cfg.max_model_len or limit, 1, limit)
        self.enable_prefix_caching, self.kv_format = cfg.enable_prefix_caching, cfg.kv_format
        self.full_window = cfg.full_window
        cfg, store, self.kv = self._kv_and_budget(cfg, model, source, model_dir)
        self.engine_config = cfg  # with its step budget settled
        if cfg.full_window is None:  # a request's whole length must fit in the (first) pool
            pool_tokens = self.kv.usage().blocks_total[self.kv.kinds[0]] * cfg.block_size
            self.max_model_len = min(self.max_model_len, pool_tokens)
        decoder = None if cfg.compile_decode is False else model.compiled_decoder
        self.runner = ModelRunner(model, store, decoder)
        self.scheduler = Scheduler(self.kv, cfg, bursts=self.runner.plain_steps and cfg.speculate is None)
        # compiling the decode step now, before any request holds a block (None: not compiled)
        compiled = self.runner.decoder is not None
        self.compile_seconds = self.runner.warm_up(cfg.speculate is not None) if compiled else None
        self._requests: dict[str, Request] = {}  # by each sample's own id
        self._groups: dict[str, list[Request]] = {}  # request id -> its n samples
        self._ids = itertools.count()
        self._finished = self._aborted = self._failed = self._generated = 0
        self.speculate = cfg.speculate
        self._spec_choice = DecodeChoice()  # whether decode-only steps draft, by measured tokens/s
        self._drafter = self._make_drafter(cfg)
        self.kv.check_step_fits(cfg.max_batch_tokens)

    # ------------------------------------------------------------------ setup helpers

    def _make_drafter(self, cfg: EngineConfig) -> PromptLookup | PagedDrafter | None:
        """What drafts: the prompt-lookup rule, or the draft model over blocks of its own, as many
        tokens as the full-layer pool (engine/drafting.py); None without speculation."""
        if not isinstance(cfg.speculate, DraftModel):
            return cfg.speculate
        full_blocks = max(self.kv.usage().blocks_total.values())
        return PagedDrafter(cfg.speculate, cfg, full_blocks=full_blocks, max_model_len=self.max_model_len)

    def _load(self, model: GPTOSS | str | Path, cfg: EngineConfig) -> tuple[GPTOSS, Path | None, str | None]:
        """(the prepared model, its checkpoint directory, the source it was loaded from), and the
        model's name and chat template; prepared for compiled decode when the config asks (None: as
        the model was prepared)."""
        self.chat_template: str | None = None
        source: str | None = None  # the checkpoint directory or preset the model was loaded from
        model_dir = None
        if isinstance(model, GPTOSS):
            if cfg.rope_factor is not None:
                raise ValueError("rope_factor applies when the engine loads a checkpoint; load_model(rope_factor=...)")
            if cfg.dtype is not None or cfg.device is not None:
                model.prepare_for_inference(cfg.device, cfg.dtype)
            elif not model.inference_ready:
                raise ValueError("model is not prepared for inference; call model.prepare_for_inference() first")
            if cfg.mxfp4_activations is not None:
                model.set_mxfp4_activations(cfg.mxfp4_activations)
            self.model_name = "model"
        else:
            source = str(model)
            model_dir = Path(source) if Path(source).is_dir() else None
            self.model_name = model_dir.name if model_dir is not None else source
            model = load_model(
                source,
                device=cfg.device,
                dtype=cfg.dtype,
                rope_factor=cfg.rope_factor,
                mxfp4_activations=cfg.mxfp4_activations or "exact",
            )
            self.chat_template = sources.read_chat_template(model_dir)
        if cfg.compile_decode and model.compiled_decoder is None:
            model.prepare_for_inference(compile_decode=True)  # out-major weights + the compiled step
        draft = cfg.speculate.model if isinstance(cfg.speculate, DraftModel) else None
        if draft is not None and draft.config.vocab_size != model.config.vocab_size:
            raise ValueError(
                f"speculate: the draft model's vocab_size {draft.config.vocab_size} differs from the model's "
                f"{model.config.vocab_size}; use a draft with the same tokenizer"
            )
        if draft is not None and not draft.inference_ready:
            raise ValueError("speculate: the draft model is not prepared; call draft.prepare_for_inference() first")
        return model, model_dir, source

    def _kv_and_budget(
        self, cfg: EngineConfig, model: GPTOSS, source: str | None, model_dir: Path | None
    ) -> tuple[EngineConfig, PagedKVStore, KVManager]:
        """The pools (`_make_kv`) and the config with its step budget a number: as given, or for the
        library's default (None) the first offline budget (`OFFLINE_STEP_BUDGETS`) whose step the pools
        hold, else 512 (the pools built again for each smaller budget: it sizes the sliding pool)."""
        store, kv = self._make_kv(cfg, model, source, model_dir)
        if cfg.max_batch_tokens is not None:
            return cfg, store, kv
        for budget in (*OFFLINE_STEP_BUDGETS, DEFAULT_MAX_BATCH_TOKENS):
            sized = dataclasses.replace(cfg, max_batch_tokens=budget)
            if budget != cfg.step_tokens:
                store, kv = self._make_kv(sized, model, source, model_dir)
            try:
                kv.check_step_fits(budget)
                return sized, store, kv
            except ValueError:
                pass
        return sized, store, kv  # not even 512 fits: `__init__`'s own check says so

    def _make_kv(
        self, cfg: EngineConfig, model: GPTOSS, source: str | None, model_dir: Path | None
    ) -> tuple[PagedKVStore, KVManager]:
        """The KV blocks, sized by the config (or by its memory and the context), for the runner; and
        the manager over their groups, for the scheduler."""
        param = next(model.parameters())
        specs = model_kv_specs(self.config, param.dtype.itemsize, cfg.kv_format, full_window=cfg.full_window)
        kv_blocks, sliding = pool_blocks(specs, cfg, self.max_model_len)
        store = make_store(
            model,
            kv_blocks=kv_blocks,
            sliding_blocks=sliding,
            block_size=cfg.block_size,
            kv_format=cfg.kv_format,
            tail_blocks=cfg.tail_blocks,
            full_window=cfg.full_window,
        )
        revision = cfg.revision if cfg.revision is not None else self._default_revision(model, source, model_dir)
        return store, KVManager(store, revision=revision, enable_prefix_caching=cfg.enable_prefix_caching)

    # ------------------------------------------------------------------ setup helpers

    @staticmethod
    def _default_revision(model: GPTOSS, source: str | None, model_dir: Path | None) -> str:
        """The checkpoint's identity when the engine loaded it; a checksum of an in-memory model."""
        if source is None:
            return sources.weights_revision(model)
        return sources.checkpoint_revision(source, model_dir, (model.config, model.embed.weight.dtype))

    # ------------------------------------------------------------------ requests

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids: a text is tokenised as a whole prompt (`encode_prompt`: BOS first
        where the tokenizer's rule adds one); ids are taken as they are. Either is checked against the
        vocabulary. Reads nothing the engine changes: safe from any thread."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as lists of token ids")
            ids = self.tokenizer.encode_prompt(prompt) if prompt else []  # NOTE: "" is no prompt, not a BOS alone
        elif isinstance(prompt, (list, tuple)) or (isinstance(prompt, torch.Tensor) and prompt.dim() == 1):
            ids = [check_int("prompt token id", int(t), 0) for t in prompt]
        else:
            raise TypeError(f"prompt: expected a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("empty prompt: need at least one token")
        bad = [t for t in ids if t >= self.config.vocab_size]
        if bad:
            raise ValueError(f"token id(s) {bad[:5]} out of vocabulary (vocab_size={self.config.vocab_size})")
        return ids

    def prepare(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None) -> PreparedRequest:
        """Tokenise and check a request once, without touching the engine's state (safe from any
        thread: the server prepares in its handlers, then the engine thread only queues). Raises
        ValueError / TypeError for what add_request would refuse."""
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling: expected SamplingParams, got {type(sampling).__name__}")
        ids = self.encode(prompt)
        vocab = self.config.vocab_size
        bad = [t for t, _ in sampling.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias: token id(s) {bad[:5]} out of vocabulary (vocab_size={vocab})")
        if len(ids) + sampling.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_tokens={sampling.max_tokens} exceeds max_model_len="
                f"{self.max_model_len}; shorten the prompt or lower max_tokens"
            )
        if sampling.n > self.scheduler.max_running:
            raise ValueError(f"n={sampling.n}: more samples than max_running={self.scheduler.max_running}")
        return PreparedRequest(ids, sampling)

    def add_request(
        self,
        prompt: str | Sequence[int] | PreparedRequest,
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        scope: str = "default",
        tenant: str = DEFAULT_TENANT,
        priority: int = 0,
    ) -> str:
        """Queue a request (a prompt and its sampling, or what `prepare` made of them); return its
        id. `scope` keeps prefix-cache hits apart; `tenant` is whose share of the engine it runs on,
        and `priority` orders it within that share (lower first; engine/fairness.py).
        Raises (nothing queued) on a bad prompt or parameters, and QuotaExceeded when the tenant's
        quota refuses it now."""
        if not isinstance(prompt, PreparedRequest):
            prompt = self.prepare(prompt, sampling)
        elif sampling is not None:
            raise ValueError("add_request(prepared): the prepared request carries its sampling; pass none")
        ids, sampling = prompt.token_ids, prompt.sampling
        if not isinstance(scope, str) or not scope:
            raise ValueError(f"scope={scope!r}: expected a non-empty string")
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"tenant={tenant!r}: expected a non-empty string")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority={priority!r}: expected an integer (lower runs first)")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self._requests or request_id in self._groups:
                request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id={request_id!r}: expected a non-empty string")
        elif request_id in self._requests or request_id in self._groups:
            raise ValueError(f"request_id={request_id!r}: already in use")
        names = [request_id] + [f"{request_id}#{i}" for i in range(1, sampling.n)]
        if any(name in self._requests for name in names[1:]):
            raise ValueError(f"request_id={request_id!r}: its sample ids are already in use")
        cost = (len(ids) + sampling.max_tokens) * sampling.n
        self.scheduler.waiting.check_quota(tenant, sampling.n, cost, self.scheduler.max_running)  # the last check
        samples = [
            self._new_request(name, ids, sampling.for_sample(i), scope, tenant, priority, request_id, i)
            for i, name in enumerate(names)
        ]
        first = samples[0]
        first.fork_later(samples[1:])  # they start from its K/V once its prompt is computed (_fork)
        self._groups[request_id] = samples
        self.scheduler.add(first)
        return request_id

    def _new_request(
        self,
        request_id: str,
        ids: list[int],
        sampling: SamplingParams,
        scope: str,
        tenant: str,
        priority: int,
        group: str,
        index: int,
    ) -> Request:
        """Sample `index` of request `group`, under its own id."""
        eos = None if self.tokenizer is None else getattr(self.tokenizer, "eos_id", None)
        stream = None if self.tokenizer is None else TextStream(self.tokenizer, sampling.stop)
        request = Request(
            request_id,
            ids,
            sampling,
            scope,
            eos,
            tenant=tenant,
            priority=priority,
            stream=stream,
            group=group,
            index=index,
        )
        self._requests[request_id] = request
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request (all n of its samples) now and free its blocks; False if it is unknown or
        already finished."""
        aborted = False
        for request in self._groups.pop(request_id, []):
            aborted |= self._abort_sample(request)
        return aborted

    def _abort_sample(self, request: Request) -> bool:
        """End one sample with finish reason "abort" and free its blocks (False if it had ended)."""
        if self._requests.pop(request.request_id, None) is None:
            return False
        self.scheduler.remove(request)  # (a sample still waiting to fork is in neither queue: a no-op)
        if isinstance(self._drafter, PagedDrafter):
            self._drafter.forget(request.request_id)
        request.abort()
        self._aborted += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def speculation(self) -> SpeculationStats:
        """Drafts verified so far, the tokens kept, and the tokens those verifications gave."""
        return self.scheduler.speculation

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Schedule, execute, postprocess: one scheduling round and one forward; the outputs of the
        requests that got a token or finished.

        A failure is kept to the requests it belongs to: one whose sampling or bookkeeping raises is
        finished alone (finish reason "error"), and a forward that raises is run again one request at
        a time, so only the request that makes it raise fails. The other requests of the step go on
        with the tokens they would have had without it.
        """
        started = time.perf_counter()
        if self.speculate is not None:
            self._propose_drafts()
        step = self.scheduler.schedule()
        if not step.scheduled and not step.expired:
            if self.scheduler.has_unfinished():
                raise RuntimeError(
                    "engine stuck: requests are waiting but none can be scheduled (the KV pool cannot hold "
                    "their first chunk); use more kv_blocks or a smaller max_batch_tokens"
                )
            return []
        executed = time.perf_counter()
        sampled, failed = self._execute(step) if step.scheduled else ([], [])
        if step.scheduled and (step.decode_steps > 1 or all(entry.num_tokens == 1 for entry in step.scheduled)):
            seconds = (time.perf_counter() - executed) / step.decode_steps  # a decode-only step's (a burst: per step)
            self.scheduler.waiting.step_cost.record(len(step.scheduled), seconds)
            self.scheduler.record_decode(seconds)
        outcome = self.scheduler.postprocess(step, sampled, failed)
        for sample in outcome.aborted:  # forks of a request that failed before its prompt was computed
            if self._requests.pop(sample.request_id, None) is not None:
                self._aborted += 1
        for request in outcome.finished:
            self._retire(request)
            if request.finish_reason == "error" and request.error_code != "queue_timeout":
                self._failed += 1  # a fault; a request that timed out in the queue is counted by its tenant
            else:
                self._finished += 1
        new_tokens = sum(len(o.new_token_ids) for o in outcome.outputs)
        self._generated += new_tokens
        if self.speculate is not None:
            self._spec_choice.record(time.perf_counter() - started, new_tokens)
        return outcome.outputs

    # ------------------------------------------------------------------ speculative decoding

    def _propose_drafts(self) -> None:
        """Drafts for the running requests, when this step speculates (`speculation.propose_drafts`:
        which requests draft, and how the engine decides whether a decode-only step drafts at all)."""
        running = self.scheduler.running
        decode_only = all(r.num_tokens - r.num_computed == 1 for r in running) and not self.scheduler.waiting
        if self._spec_choice.choose(decode_only) == "plain":
            return
        assert self._drafter is not None
        propose_drafts(running, self._drafter, decode_only)

    def _execute(self, step: ScheduledBatch) -> tuple[list[tuple[Request, int, TokenLogprobs | None]], list]:
        """The runner's (sampled, failed) for the step; if the batched forward raises, each request
        runs again alone (its K/V slots are rewritten with the same values) and fails only if it
        raises alone too. The runner changes no request, so a retry starts where the step did. Each
        retry makes the step's copy-on-write copies again (the forward may have failed before them):
        a copy reads slots no step writes, so making it twice gives the same block."""
        try:
            return self.runner.execute(step)
        except Exception as exc:  # noqa: BLE001 - told apart below
            logger.exception("engine step over %d request(s) failed", len(step.scheduled))
            first = exc
        if len(step.scheduled) == 1:
            return [], [(step.scheduled[0][0], f"{type(first).__name__} in the forward")]
        sampled, failed = [], []
        for entry in step.scheduled:
            try:
                one_sampled, one_failed = self.runner.execute(
                    ScheduledBatch([entry], copies=step.copies, decode_steps=step.decode_steps)
                )
            except Exception as exc:  # noqa: BLE001 - this request makes the forward raise
                logger.exception("request %s fails the forward alone", entry[0].request_id)
                failed.append((entry[0], f"{type(exc).__name__} in the forward"))
                continue
            sampled += one_sampled
            failed += one_failed
        return sampled, failed

    def _retire(self, request: Request) -> None:
        """Forget a finished sample, and its request once all n samples are done."""
        self._requests.pop(request.request_id, None)
        if isinstance(self._drafter, PagedDrafter):
            self._drafter.forget(request.request_id)
        group = self._groups.get(request.group)
        if group is not None and all(r.request_id not in self._requests for r in group):
            del self._groups[request.group]

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        scope: str = "default",
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. An output's `logprobs` (when its
        sampling asks for them) cover all its `token_ids`, not only the last step's."""
        if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence):
            raise TypeError("prompts: expected a list of prompts (texts or token-id lists)")
        if sampling is None or isinstance(sampling, SamplingParams):
            params = [sampling] * len(prompts)
        else:
            params = list(sampling)
            if len(params) != len(prompts):
                raise ValueError(f"sampling: {len(params)} SamplingParams for {len(prompts)} prompts")
        if any(p is not None and p.n > 1 for p in params):
            raise ValueError("generate() gives one output per prompt: for n > 1 use add_request() and step()")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.add_request(prompt, p, scope=scope))
        except Exception:
            for rid in ids:
                self.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {rid: [] for rid in ids}  # each step's, joined
        wanted = set(ids)
        while self.has_unfinished() and wanted - final.keys():
            for out in self.step():
                if out.request_id not in wanted:
                    continue
                if out.logprobs is not None:
                    logprobs[out.request_id].extend(out.logprobs)
                if out.finished:
                    whole = None if out.logprobs is None else logprobs[out.request_id]
                    final[out.request_id] = dataclasses.replace(out, logprobs=whole)
        return [final[rid] for rid in ids]

    # ------------------------------------------------------------------ introspection

    def stats(self) -> EngineStats:
        kv, usage = self.kv, self.kv.usage()
        used, total = sum(usage.blocks_used.values()), sum(usage.blocks_total.values())
        return EngineStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_blocks_total=total,
            kv_blocks_used=used,
            kv_blocks_free=total - used,
            kv_blocks_cached=usage.blocks_cached,
            prefix_queries=kv.lookups,
            prefix_hits=kv.hit_tokens,
            prefix_hit_rate=kv.hit_tokens / kv.lookup_tokens if kv.lookup_tokens else 0.0,
            preemptions=self.scheduler.num_preemptions,
            finished=self._finished,
            aborted=self._aborted,
            failed=self._failed,
            generated_tokens=self._generated,
            kv_format=self.kv_format.name,
            kv_bytes=self.runner.kv_bytes,
            spec_drafted=self.speculation.drafted,
            spec_accepted=self.speculation.accepted,
            spec_verifications=self.speculation.target_forwards,
            spec_tokens=self.speculation.new_tokens,
            tenants=self.scheduler.waiting.counters(),
        )

    def validate(self) -> None:
        """The pools' and prefix caches' consistency checks, plus: every block a live sequence holds
        belongs to a queued request."""
        live = {r.request_id for r in self.scheduler.running} | {r.request_id for r in self.scheduler.waiting}
        self.kv.validate(live)
        self.scheduler.waiting.validate(self.scheduler.running)
        if isinstance(self._drafter, PagedDrafter):
            self._drafter.validate(live)

    def clear_prefix_cache(self) -> None:
        self.kv.clear_prefix_cache()

    def all_blocks_free(self) -> bool:
        """Nothing held (after clearing the prefix cache, every block should be free), the draft
        model's blocks included."""
        drafts_free = not isinstance(self._drafter, PagedDrafter) or self._drafter.all_free
        return self.kv.usage().all_free and drafts_free
