"""Prefix caching over full KV blocks (docs/paged.md#prefix-caching), tensor-free.

Identity. A cached block is named by a chained hash over *full* blocks only,
`h_i = H(h_{i-1}, tokens of block i, extra_i)`, so a block's identity is its whole preceding prefix,
not its own tokens. The first block's extra key carries the access scope (tenant) and the model
revision: two requests hit only if scope, revision and every earlier token agree. `H` is SHA-256
over a canonical, length-prefixed byte encoding (never Python's `hash()`, which is salted per
process and collides by design). The scope must come from the server side (the authenticated
tenant), never from the client.

Two modes.
- Standalone (`pool=None`): tracks hashes only, for planners and demos; `max_blocks` optionally
  bounds it with least-recently-used eviction.
- Pool-backed: each cached hash names a physical block of a `PagedKVPool`, and the cache holds one
  *pin* on it (`pool.retain` / `pool.release_block`, with the cache itself as the pin's owner, so no
  one else can drop it), so a cached block outlives the sequence that computed it.
  `insert(..., seq_id=)` registers a sequence's full blocks; `attach(seq_id, ...)`
  creates a sequence whose page table starts with the cached blocks (reference counts rise — the
  blocks are shared, never copied). `evict(n)` frees up to `n` blocks held by nobody but the cache,
  least recently used first; a block any sequence references is never freed. A caller that gets
  `PoolExhaustedError` can avoid it with
  `cache.evict(pool.blocks_needed(seq, n) - pool.free_blocks)` before appending.

Recency. A lookup or insert touches its chain's blocks from last to first, so the first block of a
chain is the most recent and eviction trims chains from their tails (a chain whose head is evicted
cannot be matched any more, so its tail would be dead weight).
"""

from __future__ import annotations

import hashlib
import numbers
import struct
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from gptoss_lite.kv.block_pool import DEFAULT_BLOCK_SIZE, PagedKVPool
from gptoss_lite.validation import check_int

_DOMAIN = b"gptoss-lite/prefix-cache/v1"  # versions the encoding; change it if the encoding changes
_MAX_TOKEN = 2**63  # tokens are encoded as signed 64-bit little-endian integers


def _encode_bytes(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _check_tokens(tokens: Sequence[int]) -> tuple[int, ...]:
    """Return the token ids as a tuple of ints, raising on anything that is not a token id."""
    # The engine passes every running prompt here at every step: a list or tuple of plain ints is
    # checked with exact type tests and one min/max (the ABC test below is ~10x slower per token).
    if type(tokens) in (list, tuple) and all(type(t) is int for t in tokens):
        if not tokens or (min(tokens) >= 0 and max(tokens) < _MAX_TOKEN):
            return tuple(tokens)
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise TypeError(f"tokens: expected a sequence of ints (list, tuple, range), got {type(tokens).__name__}")
    out = []
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"tokens[{i}]={t!r}: token ids must be ints")
        if not 0 <= t < _MAX_TOKEN:
            raise ValueError(f"tokens[{i}]={t}: token ids must be in [0, 2**63)")
        out.append(int(t))
    return tuple(out)


def _check_key(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(
            f"{name}={value!r}: must be a str (e.g. the tenant id or checkpoint revision), not {type(value).__name__}"
        )
    return value


def chained_block_hashes(
    tokens: Sequence[int], scope: str, revision: str, block_size: int = DEFAULT_BLOCK_SIZE
) -> tuple[bytes, ...]:
    """SHA-256 chain over the full blocks of `tokens`; a trailing partial block gets no hash."""
    block_size = check_int("block_size", block_size, 1)
    tokens = _check_tokens(tokens)
    extra = _encode_bytes(_check_key("scope", scope).encode()) + _encode_bytes(
        _check_key("revision", revision).encode()
    )
    parent = b""  # the first block has no parent; its extra key carries scope and revision
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        payload = (
            _DOMAIN
            + _encode_bytes(parent)
            + _encode_bytes(struct.pack(f"<{block_size}q", *block))
            + _encode_bytes(extra)
        )
        parent = hashlib.sha256(payload).digest()
        hashes.append(parent)
        extra = b""
    return tuple(hashes)


@dataclass(frozen=True)
class PrefixCacheStats:
    """Hit statistics; request-hit and reused-token fractions are separate (docs/paged.md#prefix-caching)."""

    requests: int  # lookups recorded (match with record=True, attach)
    hit_requests: int  # lookups with >= 1 cached block
    input_tokens: int  # prompt tokens over all recorded lookups
    cached_tokens: int  # of those, tokens served from the cache
    cached_blocks: int  # blocks in the cache now
    evicted_blocks: int  # cache entries evicted so far

    @property
    def request_hit_fraction(self) -> float:
        """Requests with at least one cached block / requests (0.0 before any request)."""
        return self.hit_requests / self.requests if self.requests else 0.0

    @property
    def reused_token_fraction(self) -> float:
        """Cached tokens / input tokens (0.0 before any input)."""
        return self.cached_tokens / self.input_tokens if self.input_tokens else 0.0


class PrefixCache:
    """Chained-hash prefix cache with LRU eviction, optionally sharing a `PagedKVPool`'s blocks."""

    def __init__(
        self, block_size: int = DEFAULT_BLOCK_SIZE, pool: PagedKVPool | None = None, *, max_blocks: int | None = None
    ) -> None:
        block_size = check_int("block_size", block_size, 1)
        if pool is not None:
            if not isinstance(pool, PagedKVPool):
                raise TypeError(f"pool: expected a PagedKVPool or None, got {type(pool).__name__}")
            if pool.block_size != block_size:
                raise ValueError(
                    f"block_size={block_size}: differs from the pool's "
                    f"{pool.block_size}; pass block_size=pool.block_size"
                )
            if max_blocks is not None:
                raise ValueError(
                    "max_blocks: only for the standalone cache (pool=None); a "
                    "pool-backed cache is bounded by the pool, use evict()"
                )
        if max_blocks is not None:
            max_blocks = check_int("max_blocks", max_blocks, 0)
        self.block_size = block_size
        self.pool = pool
        self.max_blocks = max_blocks  # None means no limit
        # hash -> pool block id (None when standalone); order = LRU first, MRU last
        self._entries: OrderedDict[bytes, int | None] = OrderedDict()
        self._block_pins: dict[int, int] = {}  # pool block -> entries pinning it
        self._requests = self._hit_requests = self._input_tokens = self._cached_tokens = 0
        self._evicted = 0

    # ------------------------------------------------------------------ lookup

    def block_hashes(self, tokens: Sequence[int], scope: str, revision: str) -> tuple[bytes, ...]:
        """Chained hashes of the full blocks of `tokens` under this cache's block size."""
        return chained_block_hashes(tokens, scope, revision, self.block_size)

    def _hits(self, hashes: tuple[bytes, ...], n_tokens: int) -> int:
        """Leading cached blocks, leaving at least the last token to recompute."""
        limit = max(0, (n_tokens - 1) // self.block_size)
        k = 0
        while k < min(limit, len(hashes)) and hashes[k] in self._entries:
            k += 1
        return k

    def _touch(self, hashes: Sequence[bytes]) -> None:
        for h in reversed(hashes):  # the chain's first block ends up most recently used
            if h in self._entries:
                self._entries.move_to_end(h)

    def _record(self, n_tokens: int, hit_blocks: int) -> None:
        self._requests += 1
        self._hit_requests += hit_blocks > 0
        self._input_tokens += n_tokens
        self._cached_tokens += hit_blocks * self.block_size

    def match(self, tokens: Sequence[int], scope: str, revision: str, *, record: bool = True) -> int:
        """Cached leading tokens of a prompt: a block multiple, stopping at the first miss.

        Capped at `len(tokens) - 1` rounded down to a block multiple, so a fully cached prompt
        still recomputes its last token. With `record=True` the lookup counts in `stats()` and
        refreshes the hit blocks' recency; `record=False` is a pure probe.
        """
        tokens = _check_tokens(tokens)
        hashes = self.block_hashes(tokens, scope, revision)
        k = self._hits(hashes, len(tokens))
        if record:
            self._record(len(tokens), k)
            self._touch(hashes[:k])
        return k * self.block_size

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._entries

    # ------------------------------------------------------------------ insert / attach

    def insert(self, tokens: Sequence[int], scope: str, revision: str, *, seq_id: Hashable | None = None) -> int:
        """Cache the full blocks of `tokens`; return how many blocks were newly cached.

        Pool-backed: `seq_id` names the pool sequence holding these tokens (its length must be at
        least `len(tokens)`; leading blocks a sliding window released must be cached already, so a
        prompt prefilled in chunks can be inserted chunk by chunk); the cache pins each newly cached
        block. Blocks already cached keep their existing physical block.
        """
        tokens = _check_tokens(tokens)
        hashes = self.block_hashes(tokens, scope, revision)
        table: tuple[int | None, ...] = ()
        if self.pool is None:
            if seq_id is not None:
                raise ValueError(
                    f"seq_id={seq_id!r}: a standalone cache (pool=None) tracks "
                    "hashes only; drop seq_id or give the cache a pool"
                )
        else:
            if seq_id is None:
                raise ValueError(
                    "seq_id: required for a pool-backed cache, naming the pool sequence that holds these tokens"
                )
            length = self.pool.num_tokens(seq_id)
            if len(tokens) > length:
                raise ValueError(
                    f"tokens: {len(tokens)} tokens but sequence {seq_id!r} holds "
                    f"{length}; insert at most the sequence's tokens"
                )
            first = self.pool.first_block_index(seq_id)
            missing = [i for i, h in enumerate(hashes[:first]) if h not in self._entries]
            if missing:
                raise ValueError(
                    f"seq_id={seq_id!r}: its sliding window released leading blocks ({len(missing)} of them "
                    "not cached), so its prefix cannot be cached; insert before the window releases them"
                )
            table = (None,) * first + self.pool.page_table(seq_id)  # index i -> absolute block i
        added = 0
        for i, h in enumerate(hashes):
            if h in self._entries:
                continue
            block = None
            if self.pool is not None:
                block = table[i]
                assert block is not None  # released leading blocks are all cached (checked above)
                self.pool.retain(block, owner=self)
                self._block_pins[block] = self._block_pins.get(block, 0) + 1
            self._entries[h] = block
            added += 1
        self._touch(hashes)
        if self.max_blocks is not None and len(self._entries) > self.max_blocks:
            self.evict(len(self._entries) - self.max_blocks)
        return added

    def attach(self, seq_id: Hashable, tokens: Sequence[int], scope: str, revision: str) -> int:
        """Create pool sequence `seq_id` starting with the prompt's cached blocks (shared).

        Returns the cached token count; the caller appends the remaining
        `len(tokens) - cached` tokens and computes them. Counts as one request in `stats()`.
        """
        if self.pool is None:
            raise ValueError(
                "attach: needs a pool-backed cache; construct PrefixCache(pool=...) or use match() for planning"
            )
        tokens = _check_tokens(tokens)
        hashes = self.block_hashes(tokens, scope, revision)
        k = self._hits(hashes, len(tokens))
        self.pool.create(seq_id, blocks=[self._entries[h] for h in hashes[:k]])
        self._record(len(tokens), k)
        self._touch(hashes[:k])
        return k * self.block_size

    # ------------------------------------------------------------------ eviction

    def _evictable(self, block: int | None) -> bool:
        if self.pool is None or block is None:
            return True
        return self.pool.refcount(block) == self._block_pins[block]

    @property
    def evictable_blocks(self) -> int:
        """Distinct blocks `evict` could free now (held by nobody but this cache)."""
        if self.pool is None:
            return len(self._entries)
        return self.pool.held_only_by(self._block_pins)

    def _drop(self, h: bytes) -> bool:
        block = self._entries.pop(h)
        self._evicted += 1
        if block is None:
            return True
        self._block_pins[block] -= 1
        if self._block_pins[block] == 0:
            del self._block_pins[block]
        assert self.pool is not None
        return self.pool.release_block(block, owner=self)

    def evict(self, n_blocks: int) -> int:
        """Free up to `n_blocks` blocks held only by the cache, least recently used first.

        Returns the number freed (fewer when not enough are unreferenced). Standalone, each
        evicted entry counts as one freed block.
        """
        n_blocks = check_int("n_blocks", n_blocks, 0)
        self._check_own_pins()
        freed = 0
        for h in list(self._entries):
            if freed >= n_blocks:
                break
            if self._evictable(self._entries[h]):
                freed += self._drop(h)
        return freed

    def clear(self) -> None:
        """Forget every cached block, dropping the cache's pins (sequences keep theirs).

        The pins are checked first, so a cache whose pool lost one raises with nothing changed.
        """
        self._check_own_pins()
        for h in list(self._entries):
            self._drop(h)

    def _check_own_pins(self) -> None:
        if self.pool is None:
            return
        for block, count in self._block_pins.items():
            held = self.pool.pins(block, owner=self)
            if held != count:
                raise ValueError(
                    f"block {block}: the pool holds {held} pin(s) of this cache, its entries "
                    f"{count}; the pool was changed behind the cache's back (validate() names it)"
                )

    def __repr__(self) -> str:
        mode = "standalone" if self.pool is None else "pool-backed"
        return f"<PrefixCache {mode}, block_size={self.block_size}, at {id(self):#x}>"

    # ------------------------------------------------------------------ reporting

    def stats(self) -> PrefixCacheStats:
        """Request-hit and reused-token statistics since construction."""
        return PrefixCacheStats(
            requests=self._requests,
            hit_requests=self._hit_requests,
            input_tokens=self._input_tokens,
            cached_tokens=self._cached_tokens,
            cached_blocks=len(self._entries),
            evicted_blocks=self._evicted,
        )

    def validate(self) -> None:
        """Check the cache's invariants against its pool; raise AssertionError on a break."""
        pins: dict[int, int] = {}
        for h, block in self._entries.items():
            if (block is None) != (self.pool is None):
                raise AssertionError(
                    f"PrefixCache invariant broken: entry {h.hex()[:12]} has block {block} but pool is {self.pool!r}"
                )
            if block is not None:
                pins[block] = pins.get(block, 0) + 1
        if pins != self._block_pins:
            raise AssertionError("PrefixCache invariant broken: pin index disagrees with entries")
        if self.pool is not None:
            for block, count in pins.items():
                if self.pool.pins(block, owner=self) != count:
                    raise AssertionError(
                        f"PrefixCache invariant broken: block {block} has "
                        f"{self.pool.pins(block, owner=self)} pool pins of this cache "
                        f"!= {count} entries"
                    )
                if self.pool.block_fill(block) != self.block_size:
                    raise AssertionError(f"PrefixCache invariant broken: cached block {block} is not full")
        if self.max_blocks is not None and len(self._entries) > self.max_blocks:
            raise AssertionError(
                f"PrefixCache invariant broken: {len(self._entries)} entries > max_blocks={self.max_blocks}"
            )
