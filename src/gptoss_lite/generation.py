"""Generation: prefill in bounded chunks into a MixedKVCache, then one-token decode steps (SPEC §3.2).

`use_cache=False` re-runs the whole prefix every step (O(T²)); it is the correctness reference that
cached generation must match token for token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from gptoss_lite.kv.mixed import MixedKVCache
from gptoss_lite.model.transformer import GPTOSS
from gptoss_lite.sampling import SamplingConfig, sample

DEFAULT_PREFILL_CHUNK = 2048  # tokens per prefill piece; bounds activation and score memory


def _validate(model: GPTOSS, input_ids: torch.Tensor, max_new_tokens: int, prefill_chunk: int) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a (B, T) tensor of token ids; got "
                         f"{type(input_ids).__name__} {tuple(getattr(input_ids, 'shape', ()))}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids dtype {input_ids.dtype}: must be an integer tensor (int64)")
    B, T = input_ids.shape
    if B < 1 or T < 1:
        raise ValueError(f"empty prompt: input_ids has shape {(B, T)}; need at least one token per row")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an int >= 0")
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk={prefill_chunk!r}: must be an int >= 1")
    V = model.config.vocab_size
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= V:
        raise ValueError(f"token id out of vocabulary: ids span [{lo}, {hi}], vocab_size={V}")
    limit = model.config.max_position_embeddings
    if T + max_new_tokens > limit:
        raise ValueError(f"prompt of {T} tokens + max_new_tokens={max_new_tokens} exceeds the configured "
                         f"maximum of {limit} positions (max_position_embeddings); shorten the prompt")


def stream_generate(model: GPTOSS, input_ids: torch.Tensor, max_new_tokens: int = 64,
                    temperature: float = 0.7, top_p: float = 0.9, use_cache: bool = True,
                    seed: int | None = None, stop_tokens: Sequence[int] | None = None,
                    prefill_chunk: int = DEFAULT_PREFILL_CHUNK, cache: MixedKVCache | None = None,
                    attn_impl: str = "fast") -> Iterator[torch.Tensor]:
    """An iterator of the next token ids (B,) step by step; stops after max_new_tokens or when every
    row has produced a stop token (rows that stopped earlier keep repeating their stop token).

    A `cache` that already holds P tokens (a prefix-cache hit, or a shared system prompt prefilled
    once) is taken to hold the K/V of `input_ids[:, :P]`; only the rest of the prompt is prefilled.
    The caller vouches for that content: positions are checked, tokens cannot be.

    Arguments are validated here, eagerly, before any work starts.
    """
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, seed=seed)
    _validate(model, input_ids, max_new_tokens, prefill_chunk)
    if attn_impl not in ("fast", "reference"):
        raise ValueError(f"attn_impl={attn_impl!r}: must be 'fast' or 'reference'")
    B = input_ids.shape[0]
    if use_cache:
        if cache is None:
            cache = MixedKVCache(model.config, batch_size=B)
        elif cache.batch_size != B or not 0 <= cache.position < input_ids.shape[1]:
            raise ValueError(f"cache has batch_size={cache.batch_size}, position={cache.position}; it must have "
                             f"batch_size={B} and hold fewer tokens than the {input_ids.shape[1]}-token prompt "
                             "(empty, or the K/V of a prompt prefix such as a prefix-cache hit; "
                             "call cache.reset() to start over)")
    model.eval()
    model.to(input_ids.device)
    model.pack_for_decode()  # one-time re-layout: decode GEMVs ~2x faster (no-op once done)
    return _steps(model, input_ids.long(), max_new_tokens, sampling, use_cache, stop_tokens,
                  prefill_chunk, cache, attn_impl)


@torch.inference_mode()
def _steps(model, input_ids, max_new_tokens, sampling, use_cache, stop_tokens, prefill_chunk, cache,
           attn_impl) -> Iterator[torch.Tensor]:
    B, T = input_ids.shape
    generator = None
    if not sampling.greedy and sampling.seed is not None:
        generator = torch.Generator(device=input_ids.device).manual_seed(sampling.seed)
    stops = torch.tensor(sorted(set(stop_tokens or ())), dtype=torch.long, device=input_ids.device)
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)

    if not use_cache:
        out = torch.empty(B, T + max_new_tokens, dtype=torch.long, device=input_ids.device)
        out[:, :T] = input_ids
        for step in range(max_new_tokens):
            logits = model(out[:, :T + step], last_only=True, attn_impl=attn_impl).logits[:, -1]  # (B, V)
            token = sample(logits, sampling, generator)
            token, done = _apply_stops(token, done, stops, out[:, T + step - 1] if step else None)
            out[:, T + step] = token
            yield token
            if stops.numel() and bool(done.all()):
                return
        return

    if max_new_tokens == 0:
        return
    logits = None
    for start in range(cache.position, T, prefill_chunk):  # skip a prefix the cache already holds
        piece = input_ids[:, start:start + prefill_chunk]
        logits = model(piece, cache=cache, start_pos=start, last_only=True, attn_impl=attn_impl).logits
    prev = None
    for step in range(max_new_tokens):
        token = sample(logits[:, -1], sampling, generator)
        token, done = _apply_stops(token, done, stops, prev)
        yield token
        prev = token
        if step + 1 == max_new_tokens or (stops.numel() and bool(done.all())):
            return
        logits = model(token[:, None], cache=cache, start_pos=T + step, last_only=True,
                       attn_impl=attn_impl).logits


def _apply_stops(token, done, stops, prev):
    """Rows already done repeat their previous (stop) token; mark rows that just hit a stop."""
    if not stops.numel():
        return token, done
    if prev is not None:
        token = torch.where(done, prev, token)
    return token, done | torch.isin(token, stops)


def generate(model: GPTOSS, input_ids: torch.Tensor, max_new_tokens: int = 64, temperature: float = 0.7,
             top_p: float = 0.9, use_cache: bool = True, seed: int | None = None,
             stop_tokens: Sequence[int] | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
             cache: MixedKVCache | None = None, attn_impl: str = "fast") -> torch.Tensor:
    """input_ids (B, T_prompt) -> (B, T_prompt + n_new) with n_new <= max_new_tokens (fewer only when
    every row hit a stop token). Greedy when temperature <= 0; a seed makes sampling reproducible."""
    steps = stream_generate(model, input_ids, max_new_tokens, temperature, top_p, use_cache, seed,
                            stop_tokens, prefill_chunk, cache, attn_impl)
    B, T = input_ids.shape
    out = torch.empty(B, T + max_new_tokens, dtype=torch.long, device=input_ids.device)  # preallocated
    out[:, :T] = input_ids
    n = 0
    for token in steps:
        out[:, T + n] = token
        n += 1
    return out[:, :T + n]
