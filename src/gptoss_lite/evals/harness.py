"""What the long-context evaluations share: greedy answers of a batch through the cached path, batching
prompts of equal token length, the progress bar and the model checks.

`evals.passkey` and `evals.ruler` build their prompts and score their answers; everything between
(cache, chunked prefill, greedy decode, speculation counters) happens here once.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from gptoss_lite.kv.mixed import MixedKVCache
    from gptoss_lite.kv.settings import KVSettings
    from gptoss_lite.speculative import Speculation, SpeculationStats
    from gptoss_lite.tokenizer import Tokenizer


def greedy_new_texts(
    model,
    tokenizer: Tokenizer,
    ids: torch.Tensor,
    max_new_tokens: int,
    kv: KVSettings,
    prefill_chunk: int,
    speculate: Speculation | None = None,
    stats: SpeculationStats | None = None,
    cache: MixedKVCache | None = None,
) -> tuple[list[str], MixedKVCache]:
    """Decoded new text of each row of a (B, T) batch of equal-length prompts, greedy, at most
    `max_new_tokens` tokens (stopping at the tokenizer's EOS); and the cache used.

    The cache is built by `kv` (bits or a token budget); with `speculate` it keeps `speculate.k`
    tokens of rollback room and `stats` (a SpeculationStats) accumulates the counters. A `cache` given
    (built the same way) may already hold a prefix of every row: only the rest is prefilled.
    """
    from gptoss_lite.generation import generate

    eos = tokenizer.eos_id
    slack = 0 if speculate is None else speculate.k
    if cache is None:
        cache = kv.build(model.config, batch_size=ids.shape[0], rollback_tokens=slack)
    spec = {} if speculate is None else {"speculate": speculate, "stats": stats}  # plain call unchanged
    out = generate(
        model,
        ids,
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        top_p=1.0,
        stop_tokens=None if eos is None else [eos],
        prefill_chunk=kv.prefill_chunk(prefill_chunk),
        cache=cache,
        **spec,
    )  # (B, T + n)
    return [tokenizer.decode(row) for row in out[:, ids.shape[1] :].tolist()], cache


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (getrusage: KiB on Linux, bytes on macOS)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def equal_length_batches(prompts: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:
    """Indices of prompts grouped into batches of equal token length (a batch needs no padding),
    in order of their first index."""
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    groups = []
    for idx in by_len.values():
        groups.extend(idx[j : j + batch_size] for j in range(0, len(idx), batch_size))
    return sorted(groups, key=lambda g: g[0])


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar on stderr counting trials, or None when not `enabled`."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="trial", file=sys.stderr, dynamic_ncols=True)


def check_model_fits(model, tokenizer: Tokenizer, n_tokens: int, max_new_tokens: int) -> None:
    """A prompt of `n_tokens` plus `max_new_tokens` fits the model's positions, and the tokenizer's ids
    fit its vocabulary; ValueError saying which limit and the fix otherwise."""
    limit = model.config.max_position_embeddings - max_new_tokens
    if n_tokens > limit:
        raise ValueError(
            f"context length {n_tokens}: the model accepts {model.config.max_position_embeddings} "
            f"positions, i.e. prompts up to {limit} tokens plus {max_new_tokens} new; "
            f"drop the length or raise max_position_embeddings"
        )
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{model.config.vocab_size}; use the tokenizer the model was trained with"
        )
