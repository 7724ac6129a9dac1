"""Decode speed on the paged block store (PagedKVCache) against the MixedKVCache, same model and prompt.

The paged cache reads K/V through page tables (a gather per layer per step, plus pool bookkeeping
in Python); the mixed cache reads ring buffers and growing buffers in place. This measures what
that costs a single sequence: ms per decoded token on the random ~20M benchmark config (fixture
gpt-oss-bench-20m), fp32, one thread, after prefilling the prompt in 2,048-token chunks. Rounds
alternate the two caches; figures are medians over rounds, and the ratio is paged / mixed (> 1: paged is slower).

    python benchmarks/paged_vs_mixed_decode.py                    # 2048 and 8192 tokens, 3 rounds
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from gptoss_lite.checkpoint import load_model
from gptoss_lite.generation import stream_generate
from gptoss_lite.kv.mixed import MixedKVCache
from gptoss_lite.kv.paged_cache import PagedKVCache, PagedKVStore

BLOCK = 16
CHUNK = 2048


def ms_per_token(model, ids: torch.Tensor, cache, new_tokens: int) -> float:
    stamps = [
        time.perf_counter()
        for _ in stream_generate(model, ids, new_tokens + 1, temperature=0, cache=cache, prefill_chunk=CHUNK)
    ]
    return (stamps[-1] - stamps[0]) / new_tokens * 1e3  # first token = end of prefill


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the preset's "random weights" warning
        model = load_model("gpt-oss-bench-20m")
    cfg = model.config
    print(f"decode ms/token, gpt-oss-bench-20m (random weights), fp32, 1 thread; median of {args.rounds} rounds")
    print(f"{'prompt':>7} | {'mixed':>6} | {'paged':>6} | paged/mixed")
    for length in args.lengths:
        ids = torch.randint(1, cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        times: dict[str, list[float]] = {"mixed": [], "paged": []}
        for _ in range(args.rounds):
            times["mixed"].append(ms_per_token(model, ids, MixedKVCache(cfg), args.new_tokens))
            total = (length + args.new_tokens + 1) // BLOCK + 2
            store = PagedKVStore(
                cfg,
                total_blocks=total,
                block_size=BLOCK,
                sliding_blocks=min(total, (CHUNK + cfg.sliding_window) // BLOCK + 2),
            )
            times["paged"].append(ms_per_token(model, ids, PagedKVCache(cfg, store, ["seq"]), args.new_tokens))
        mixed, paged = statistics.median(times["mixed"]), statistics.median(times["paged"])
        print(f"{length:>7} | {mixed:>6.2f} | {paged:>6.2f} | {paged / mixed:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
