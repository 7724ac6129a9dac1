"""Replay a multi-tenant chat trace through PrefixCache + PagedKVPool (bookkeeping only).

Three tenants each have a system prompt and few-shot templates; users of a tenant open
conversations (system prompt + one template + a question) and continue them over several turns
(previous prompt + answer + a new question). Requests are served FIFO with up to `--concurrency`
live at once. Three policies are compared on the same trace:

- no sharing:   every request allocates its whole prompt and computes it (prefill);
- tenant scope: prefix-cache scope = tenant, so users of a tenant share its templates;
- user scope:   scope = user id (per-user isolation), so only a user's own earlier turns hit.

A request attaches to its cached prefix (shared blocks), prefills the rest, decodes its answer,
inserts prompt + answer into the cache and, once `concurrency` later requests have started,
releases its sequence (cached blocks stay pinned until evicted, least recently used first).

Usage: PYTHONPATH=src python benchmarks/prefix_trace.py [--requests 40] [--seed 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass, field

from gptoss_lite.kv.block_pool import PagedKVPool, PoolExhaustedError
from gptoss_lite.kv.prefix import PrefixCache

REVISION = "trace-rev"  # model revision in the prefix-cache key; constant for the whole trace


@dataclass
class Request:
    tenant: str
    user: str
    prompt: list[int]
    answer: list[int]


def make_trace(
    n_requests: int, seed: int, tenants: int = 3, users_per_tenant: int = 4, vocab: int = 50_000
) -> list[Request]:
    """A seeded trace: shared per-tenant templates, multi-turn conversations per user."""
    rng = random.Random(seed)
    toks = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    system = {f"t{t}": toks(rng.randint(300, 500)) for t in range(tenants)}
    shots = {t: [toks(rng.randint(150, 250)) for _ in range(2)] for t in system}
    history: dict[str, list[int]] = {}  # user -> the conversation so far (prompt + answer)
    trace = []
    for _ in range(n_requests):
        tenant = f"t{rng.randrange(tenants)}"
        user = f"{tenant}-u{rng.randrange(users_per_tenant)}"
        if user in history and rng.random() < 0.6:
            prompt = history[user] + toks(rng.randint(20, 60))  # next turn of the conversation
        else:
            prompt = system[tenant] + rng.choice(shots[tenant]) + toks(rng.randint(20, 80))
        answer = toks(rng.randint(30, 120))
        history[user] = prompt + answer
        trace.append(Request(tenant, user, prompt, answer))
    return trace


@dataclass
class Result:
    policy: str
    input_tokens: int = 0
    prefill_computed: int = 0
    prefill_skipped: int = 0
    hit_requests: int = 0
    peak_live_blocks: int = 0  # distinct blocks referenced by live sequences, at the peak
    peak_logical_blocks: int = 0  # what the live sequences would hold without sharing
    evicted_blocks: int = 0
    notes: list[str] = field(default_factory=list)


def replay(trace: list[Request], policy: str, concurrency: int, total_blocks: int, block_size: int) -> Result:
    """Run the trace under one policy ('none', 'tenant', 'user') and collect the figures."""
    pool = PagedKVPool(total_blocks, block_size)
    cache = None if policy == "none" else PrefixCache(block_size, pool=pool)
    res = Result(policy)
    live: list[int] = []

    def append(seq: int, n: int) -> None:
        short = pool.blocks_needed(seq, n) - pool.free_blocks
        if short > 0 and cache is not None:
            cache.evict(short)
        pool.append(seq, n)

    for i, req in enumerate(trace):
        if len(live) == concurrency:
            pool.release(live.pop(0))
        scope = req.tenant if policy == "tenant" else req.user
        hit = 0 if cache is None else cache.attach(i, req.prompt, scope, REVISION)
        if cache is None:
            pool.create(i)
        append(i, len(req.prompt) - hit)  # prefill: only the uncached suffix is computed
        append(i, len(req.answer))  # decode
        if cache is not None:
            cache.insert(req.prompt + req.answer, scope, REVISION, seq_id=i)
        live.append(i)
        res.input_tokens += len(req.prompt)
        res.prefill_computed += len(req.prompt) - hit
        res.prefill_skipped += hit
        res.hit_requests += hit > 0
        held = len({b for s in live for b in pool.page_table(s)})
        logical = sum(-(-pool.num_tokens(s) // block_size) for s in live)
        if held > res.peak_live_blocks:
            res.peak_live_blocks, res.peak_logical_blocks = held, logical
    pool.validate()
    if cache is not None:
        cache.validate()
        res.evicted_blocks = cache.stats().evicted_blocks
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="requests in the trace (default 40)")
    parser.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    parser.add_argument("--concurrency", type=int, default=8, help="live requests at once (default 8)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument(
        "--total-blocks",
        type=int,
        default=2048,
        help="pool size in blocks; cached blocks are evicted LRU when it is full (default 2048)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    trace = make_trace(args.requests, args.seed)
    try:
        results = [
            replay(trace, p, args.concurrency, args.total_blocks, args.block_size) for p in ("none", "tenant", "user")
        ]
    except PoolExhaustedError as e:
        print(f"error: the pool is too small for this trace ({e}); raise --total-blocks", file=sys.stderr)
        return 1
    base = results[0].peak_live_blocks
    rows = []
    for r in results:
        rows.append(
            {
                "policy": {"none": "no sharing", "tenant": "tenant scope", "user": "user scope"}[r.policy],
                "requests": len(trace),
                "hit_requests": r.hit_requests,
                "input_tokens": r.input_tokens,
                "prefill_computed_tokens": r.prefill_computed,
                "prefill_skipped_tokens": r.prefill_skipped,
                "prefill_skipped_fraction": round(r.prefill_skipped / r.input_tokens, 4),
                "peak_live_blocks": r.peak_live_blocks,
                "peak_live_tokens": r.peak_live_blocks * args.block_size,
                "memory_saved_vs_no_sharing": round(1 - r.peak_live_blocks / base, 4),
                "evicted_blocks": r.evicted_blocks,
            }
        )
    if args.json:
        print(json.dumps({"args": vars(args), "results": rows}, indent=2))
        return 0
    cols = [
        ("policy", 13),
        ("hit_requests", 5),
        ("prefill_computed_tokens", 9),
        ("prefill_skipped_tokens", 9),
        ("prefill_skipped_fraction", 8),
        ("peak_live_blocks", 6),
        ("peak_live_tokens", 7),
        ("memory_saved_vs_no_sharing", 7),
        ("evicted_blocks", 7),
    ]
    heads = ["policy", "hits", "computed", "skipped", "skip %", "peak", "peak", "saved", "evicted"]
    units = ["", "(req)", "(tok)", "(tok)", "", "(blk)", "(tok)", "(mem)", "(blk)"]
    for line in (heads, units):
        print(" ".join(h.rjust(w) if i else h.ljust(w) for i, (h, (_, w)) in enumerate(zip(line, cols))))
    for row in rows:
        cells = []
        for i, (key, w) in enumerate(cols):
            val = row[key]
            if key in ("prefill_skipped_fraction", "memory_saved_vs_no_sharing"):
                val = f"{100 * val:.1f}%"
            cells.append(str(val).rjust(w) if i else str(val).ljust(w))
        print(" ".join(cells))
    print(
        f"\n{len(trace)} requests, {results[0].input_tokens} prompt tokens, concurrency "
        f"{args.concurrency}, block size {args.block_size}, seed {args.seed}. Peak = distinct "
        "blocks referenced by live sequences (pinned cache-only blocks excluded)."
    )
    best = results[1]
    print(
        f"tenant scope skips {best.prefill_skipped / best.input_tokens:.1%} of prefill and "
        f"holds {best.peak_live_blocks}/{base} blocks at peak "
        f"({1 - best.peak_live_blocks / base:.1%} less memory than no sharing)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
