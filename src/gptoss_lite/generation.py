"""Generation (docs/kv-cache.md#generation), two functions that must agree token for token:

- `generate` / `stream_generate`: the cached path. The prompt is prefilled in bounded chunks into a
  KV cache (a `MixedKVCache` unless one is given), then each new token is one decode step.
- `generate_reference`: no cache at all. Every step runs the whole sequence so far through the model
  (O(T²)) with the dense reference attention; slow and obviously correct, the oracle for the tests.

`generate(..., speculate=PromptLookup(...) | DraftModel(...))` decodes speculatively
(`gptoss_lite.speculative`): k drafted tokens are verified in one target forward and the rejected ones
are truncated from the cache. Greedy output is identical to plain greedy; sampled output has the same
distribution (not the same tokens for a seed: the draws differ).

Neither changes the model. Getting a model ready (eval mode, device, dtype, decode packing) happens in
one place, `GPTOSS.prepare_for_inference()`, which `load_model` calls; these functions check it and
say so when it was not done.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import cast

import torch

from gptoss_lite.kv.base import KVCache, RollbackKVCache
from gptoss_lite.kv.mixed import MixedKVCache
from gptoss_lite.model.compiled_decode import CompiledDecoder
from gptoss_lite.model.transformer import GPTOSS
from gptoss_lite.sampling import SamplingParams, sample
from gptoss_lite.speculative import DraftModel, PromptLookup, Speculation, SpeculationStats, accept, make_drafter
from gptoss_lite.validation import check_int

DEFAULT_PREFILL_CHUNK = 2048  # tokens per prefill piece; bounds activation and score memory
ATTN_IMPLS = ("fast", "reference")


def _validate(model: GPTOSS, input_ids: torch.Tensor, max_new_tokens: int, attn_impl: str, need_packed: bool) -> None:
    """Eager checks of every argument the two paths share; nothing has run yet when they raise."""
    if not isinstance(model, GPTOSS):
        raise TypeError(f"model: expected a GPTOSS, got {type(model).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must be a (B, T) tensor of token ids; got "
            f"{type(input_ids).__name__} {tuple(getattr(input_ids, 'shape', ()))}"
        )
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids dtype {input_ids.dtype}: must be an integer tensor (int64)")
    B, T = input_ids.shape
    if B < 1 or T < 1:
        raise ValueError(f"empty prompt: input_ids has shape {(B, T)}; need at least one token per row")
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl={attn_impl!r}: must be one of {ATTN_IMPLS}")
    V = model.config.vocab_size
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= V:
        raise ValueError(f"token id out of vocabulary: ids span [{lo}, {hi}], vocab_size={V}")
    limit = model.config.max_position_embeddings
    if T + max_new_tokens > limit:
        raise ValueError(
            f"prompt of {T} tokens + max_new_tokens={max_new_tokens} exceeds the configured "
            f"maximum of {limit} positions (max_position_embeddings); shorten the prompt"
        )
    device = next(model.parameters()).device
    if input_ids.device != device:
        raise ValueError(
            f"input_ids are on {input_ids.device} but the model is on {device}; move the "
            f"ids, or the model with model.prepare_for_inference(device=...)"
        )
    if model.training:
        raise ValueError(
            "model is in training mode (dropout on); call model.prepare_for_inference() first (load_model does it)"
        )
    if need_packed and not model.inference_ready:
        raise ValueError(
            "model weights are not packed for decode (a model built by hand, or moved with "
            ".to(dtype) afterwards); call model.prepare_for_inference() first "
            "(load_model does it)"
        )


# SamplingParams fields only the batched engine acts on: generate() refuses them rather than ignore them.
ENGINE_ONLY_FIELDS = (
    "stop_token_ids",
    "stop",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "n",
    "logits_processor",
)


def _sampling_params(
    caller: str,
    sampling: SamplingParams | None,
    temperature: float | None,
    top_p: float | None,
    seed: int | None,
) -> SamplingParams:
    """The SamplingParams a generation draws with: `sampling`, or one built from the shorthands
    (a shorthand left None keeps SamplingParams' default). Giving both is refused, and so are fields
    generate() does not act on (ENGINE_ONLY_FIELDS); `max_tokens` is not read (max_new_tokens is)."""
    defaults = SamplingParams()
    if sampling is None:
        return SamplingParams(
            temperature=defaults.temperature if temperature is None else temperature,
            top_p=defaults.top_p if top_p is None else top_p,
            seed=seed,
        )
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling: expected a gptoss_lite.sampling.SamplingParams, got {type(sampling).__name__}")
    shorthands = {"temperature": temperature, "top_p": top_p, "seed": seed}
    given = [f"{name}={value!r}" for name, value in shorthands.items() if value is not None]
    if given:
        raise ValueError(
            f"{caller}(): sampling= and {', '.join(given)} both say how to sample; give one of them "
            "(temperature, top_p and seed go in the SamplingParams)"
        )
    unused = [name for name in ENGINE_ONLY_FIELDS if getattr(sampling, name) != getattr(defaults, name)]
    if unused:
        hint = "; stop token ids go in stop_tokens=" if "stop_token_ids" in unused else ""
        raise ValueError(
            f"{caller}(): SamplingParams {', '.join(unused)} act only in the batched engine "
            f"(gptoss_lite.engine.LLM); {caller}() reads temperature, top_p and seed{hint}"
        )
    return sampling


def stream_generate(
    model: GPTOSS,
    input_ids: torch.Tensor,
    max_new_tokens: int = 64,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_tokens: Sequence[int] | None = None,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    cache: KVCache | None = None,
    attn_impl: str = "fast",
    speculate: Speculation | None = None,
    stats: SpeculationStats | None = None,
    *,
    sampling: SamplingParams | None = None,
) -> Iterator[torch.Tensor]:
    """An iterator of the next token ids (B,) step by step; stops after max_new_tokens or when every
    row has produced a stop token (rows that stopped earlier keep repeating their stop token).

    How tokens are chosen: `sampling`, a `SamplingParams` (the engine's type), or its shorthands
    `temperature`, `top_p` and `seed`, not both. What is not given keeps SamplingParams' default:
    temperature 1.0 and top_p 1.0, a plain draw from the softmax; temperature <= 0 is greedy, a seed
    makes sampling reproducible. The length is `max_new_tokens` (SamplingParams.max_tokens is not
    read) and the stops are `stop_tokens`; the fields only the engine acts on (stop_token_ids, stop,
    logprobs, the penalties, logit_bias, n, logits_processor) are refused when set.

    A `cache` that already holds P tokens (a prefix-cache hit, or a shared system prompt prefilled
    once) is taken to hold the K/V of `input_ids[:, :P]`; only the rest of the prompt is prefilled.
    The caller vouches for that content: positions are checked, tokens cannot be.

    `speculate` (a `PromptLookup` or `DraftModel`) turns on speculative decoding; the cache must then
    be a `RollbackKVCache` (the default one is built with rollback slack k). `stats`, a
    `SpeculationStats`, is filled in as tokens are produced (with or without speculation).

    Arguments are validated here, eagerly, before any work starts.
    """
    sampling = _sampling_params("stream_generate", sampling, temperature, top_p, seed)
    _validate(model, input_ids, max_new_tokens, attn_impl, need_packed=True)
    check_int("prefill_chunk", prefill_chunk, minimum=1)
    B, T = input_ids.shape
    _validate_speculation(model, input_ids, max_new_tokens, attn_impl, speculate, cache, stats)
    if cache is None:
        capacity = T + max_new_tokens if model.compiled_decoder is not None else 0
        cache = MixedKVCache(
            model.config, batch_size=B, rollback_tokens=0 if speculate is None else speculate.k, capacity=capacity
        )
    elif not isinstance(cache, KVCache):
        raise TypeError(f"cache: expected a KV cache (gptoss_lite.kv.base.KVCache), got {type(cache).__name__}")
    elif cache.batch_size != B or not 0 <= cache.num_tokens < T:
        raise ValueError(
            f"cache has batch_size={cache.batch_size}, num_tokens={cache.num_tokens}; it must "
            f"have batch_size={B} and hold fewer tokens than the {T}-token prompt (empty, or "
            "the K/V of a prompt prefix such as a prefix-cache hit; call cache.reset() to "
            "start over)"
        )
    if speculate is not None:
        return _speculative_steps(
            model,
            input_ids.long(),
            max_new_tokens,
            sampling,
            stop_tokens,
            prefill_chunk,
            cache,
            attn_impl,
            speculate,
            stats,
        )
    # The compiled decode step runs over the cache's own storage where it has a static form
    # (`static_decode`: a mixed cache whose layers are plain rings and growing buffers).
    decoder = model.compiled_decoder if attn_impl == "fast" and hasattr(cache, "static_decode") else None
    if decoder is not None and not decoder.current(model):
        raise ValueError(
            "the model's weights changed after prepare_for_inference(compile_decode=True); call it "
            "again so that the compiled decoder reads the current weights"
        )
    if decoder is not None:
        cast(MixedKVCache, cache).reserve(T + max_new_tokens)  # full layers never move during decode
    return _cached_steps(
        model, input_ids.long(), max_new_tokens, sampling, stop_tokens, prefill_chunk, cache, attn_impl, stats, decoder
    )


def _validate_speculation(
    model: GPTOSS,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    attn_impl: str,
    speculate: Speculation | None,
    cache: KVCache | None,
    stats: SpeculationStats | None,
) -> None:
    if stats is not None and not isinstance(stats, SpeculationStats):
        raise TypeError(f"stats: expected a SpeculationStats, got {type(stats).__name__}")
    if speculate is None:
        return
    if not isinstance(speculate, (PromptLookup, DraftModel)):
        raise TypeError(f"speculate: expected None, a PromptLookup or a DraftModel, got {type(speculate).__name__}")
    if cache is not None and not isinstance(cache, RollbackKVCache):
        raise TypeError(
            f"speculate needs a cache that can roll back (gptoss_lite.kv.base.RollbackKVCache); "
            f"got {type(cache).__name__}; pass cache=None or a MixedKVCache "
            "(for paged batches, use the engine: gptoss_lite.engine.LLM)"
        )
    if isinstance(cache, MixedKVCache) and cache.rollback_tokens < speculate.k - 1:
        raise ValueError(
            f"cache has rollback_tokens={cache.rollback_tokens} but speculating {speculate.k} "
            f"tokens may take back {speculate.k - 1}; build it with "
            f"MixedKVCache(..., rollback_tokens={speculate.k}) or pass cache=None"
        )
    if isinstance(speculate, DraftModel):
        draft = speculate.model
        if draft.config.vocab_size != model.config.vocab_size:
            raise ValueError(
                f"draft model vocab_size={draft.config.vocab_size} differs from the target's "
                f"{model.config.vocab_size}; a draft must share the target's tokenizer"
            )
        try:  # the draft runs the same prompt: the target's checks apply to it too
            _validate(draft, input_ids, max_new_tokens, attn_impl, need_packed=True)
        except (TypeError, ValueError) as err:
            raise type(err)(f"draft model: {err}") from None


@torch.inference_mode()
def _cached_steps(
    model: GPTOSS,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_tokens: Sequence[int] | None,
    prefill_chunk: int,
    cache: KVCache,
    attn_impl: str,
    stats: SpeculationStats | None = None,
    decoder: CompiledDecoder | None = None,
) -> Iterator[torch.Tensor]:
    """Prefill, then one decode step per token: eager through the cache, or, with a `decoder`, the
    compiled step over the cache's own storage (`MixedKVCache.static_decode`), which it writes in
    place; a step the cache has no static form for runs eagerly."""
    B, T = input_ids.shape
    generator = _generator(sampling, input_ids.device)
    stops = _stop_ids(stop_tokens, input_ids.device)
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    if max_new_tokens == 0:
        return
    logits = model.prefill(input_ids, cache, prefill_chunk, attn_impl)
    prev = None
    for step in range(max_new_tokens):
        token = sample(logits[:, -1], sampling, generator)
        token, done = _apply_stops(token, done, stops, prev)
        if stats is not None:
            stats.new_tokens += 1
            stats.target_forwards += 1
        yield token
        prev = token
        if step + 1 == max_new_tokens or (stops.numel() and bool(done.all())):
            return
        static = None if decoder is None else cast(MixedKVCache, cache).static_decode()
        if static is not None:
            assert decoder is not None  # a static state is only asked for with a decoder
            logits = decoder.step(static, token)[:, None]
            cast(MixedKVCache, cache).advance(1)
        else:
            logits = model(token[:, None], cache=cache, start_pos=T + step, last_only=True, attn_impl=attn_impl).logits


@torch.inference_mode()
def _speculative_steps(
    model: GPTOSS,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_tokens: Sequence[int] | None,
    prefill_chunk: int,
    cache: RollbackKVCache,
    attn_impl: str,
    speculate: Speculation,
    stats: SpeculationStats | None,
) -> Iterator[torch.Tensor]:
    """Speculative decoding (gptoss_lite.speculative): per step, draft up to k tokens, verify them with
    one target forward over [pending token, drafts], emit the accepted drafts plus one target token,
    truncate the rest from the cache. Rows keep the minimum accepted count over the batch."""
    B, T = input_ids.shape
    device = input_ids.device
    generator = _generator(sampling, device)
    stops = _stop_ids(stop_tokens, device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    stats = SpeculationStats() if stats is None else stats
    if max_new_tokens == 0:
        return
    drafter = make_drafter(speculate, input_ids, prefill_chunk, attn_impl)
    logits = model.prefill(input_ids, cache, prefill_chunk, attn_impl)
    stats.target_forwards += 1
    pending = sample(logits[:, -1], sampling, generator)  # (B,) chosen, not yet in the cache
    new, accepted, prev = pending[:, None], 0, None
    emitted = 0
    while True:
        drafter.extend(new, accepted)
        for j in range(new.shape[1]):
            token, done = _apply_stops(new[:, j], done, stops, prev)
            stats.new_tokens += 1
            emitted += 1
            yield token
            prev = token
            if emitted == max_new_tokens or (stops.numel() and bool(done.all())):
                return
        pending = new[:, -1]
        k = min(speculate.k, max_new_tokens - emitted - 1)  # never draft past max_new_tokens
        drafts, lengths, q = drafter.propose(k, sampling, generator, device)
        start = cache.num_tokens
        stats.target_forwards += 1
        if drafts.shape[1] == 0:  # nothing drafted: a plain decode step
            logits = model(pending[:, None], cache=cache, start_pos=start, last_only=True, attn_impl=attn_impl).logits
            new, accepted = sample(logits[:, -1], sampling, generator)[:, None], 0
            continue
        x = torch.cat((pending[:, None], drafts), dim=1)  # (B, 1 + k)
        logits = model(x, cache=cache, start_pos=start, attn_impl=attn_impl).logits  # (B, 1 + k, V)
        new, accepted, _ = accept(logits, drafts, lengths, q, sampling, generator)
        cache.truncate(start + 1 + accepted)  # keep pending and the accepted drafts
        stats.drafted += int(lengths.sum())
        stats.accepted += accepted * B


def generate(
    model: GPTOSS,
    input_ids: torch.Tensor,
    max_new_tokens: int = 64,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_tokens: Sequence[int] | None = None,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    cache: KVCache | None = None,
    attn_impl: str = "fast",
    speculate: Speculation | None = None,
    stats: SpeculationStats | None = None,
    *,
    sampling: SamplingParams | None = None,
) -> torch.Tensor:
    """input_ids (B, T_prompt) -> (B, T_prompt + n_new) with n_new <= max_new_tokens (fewer only when
    every row hit a stop token). `sampling` or `temperature`/`top_p`/`seed` (SamplingParams'
    defaults when none is given: temperature 1.0, top_p 1.0), `speculate` and `stats`: see
    `stream_generate`. Greedy when temperature <= 0; a seed makes sampling reproducible."""
    steps = stream_generate(
        model,
        input_ids,
        max_new_tokens,
        stop_tokens=stop_tokens,
        prefill_chunk=prefill_chunk,
        cache=cache,
        attn_impl=attn_impl,
        speculate=speculate,
        stats=stats,
        sampling=_sampling_params("generate", sampling, temperature, top_p, seed),
    )
    return _collect(input_ids, max_new_tokens, steps)


def generate_reference(
    model: GPTOSS,
    input_ids: torch.Tensor,
    max_new_tokens: int = 64,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_tokens: Sequence[int] | None = None,
    attn_impl: str = "reference",
    *,
    sampling: SamplingParams | None = None,
) -> torch.Tensor:
    """`generate` without a KV cache: each step runs the model on the whole sequence so far and takes
    the last position's logits. Same arguments, sampling and stop rule; the model needs eval mode and
    the ids' device, not decode packing. input_ids (B, T) -> (B, T + n_new)."""
    sampling = _sampling_params("generate_reference", sampling, temperature, top_p, seed)
    _validate(model, input_ids, max_new_tokens, attn_impl, need_packed=False)
    return _collect(
        input_ids,
        max_new_tokens,
        _uncached_steps(model, input_ids.long(), max_new_tokens, sampling, stop_tokens, attn_impl),
    )


@torch.inference_mode()
def _uncached_steps(
    model: GPTOSS,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_tokens: Sequence[int] | None,
    attn_impl: str,
) -> Iterator[torch.Tensor]:
    B, T = input_ids.shape
    generator = _generator(sampling, input_ids.device)
    stops = _stop_ids(stop_tokens, input_ids.device)
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    seq = input_ids
    prev = None
    for _ in range(max_new_tokens):
        logits = model(seq, attn_impl=attn_impl).logits[:, -1]  # (B, V)
        token, done = _apply_stops(sample(logits, sampling, generator), done, stops, prev)
        yield token
        if stops.numel() and bool(done.all()):
            return
        seq = torch.cat((seq, token[:, None]), dim=1)  # (B, T + step + 1)
        prev = token


def _generator(sampling: SamplingParams, device: torch.device) -> torch.Generator | None:
    if sampling.greedy or sampling.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(sampling.seed)


def _stop_ids(stop_tokens: Sequence[int] | None, device: torch.device) -> torch.Tensor:
    return torch.tensor(sorted(set(stop_tokens or ())), dtype=torch.long, device=device)


def _apply_stops(
    token: torch.Tensor, done: torch.Tensor, stops: torch.Tensor, prev: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows already done repeat their previous (stop) token; mark rows that just hit a stop."""
    if not stops.numel():
        return token, done
    if prev is not None:
        token = torch.where(done, prev, token)
    return token, done | torch.isin(token, stops)


def _collect(input_ids: torch.Tensor, max_new_tokens: int, steps: Iterator[torch.Tensor]) -> torch.Tensor:
    """The prompt followed by every token the iterator yields, (B, T + n)."""
    B, T = input_ids.shape
    out = torch.empty(B, T + max_new_tokens, dtype=torch.long, device=input_ids.device)  # preallocated
    out[:, :T] = input_ids
    n = 0
    for token in steps:
        out[:, T + n] = token
        n += 1
    return out[:, : T + n]
