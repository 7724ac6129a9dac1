"""A KV group owns one layer kind's layers, block pool, prefix cache and window rule.

All layers of one kind (`LayerKind.FULL` or `LayerKind.SLIDING`, `gptoss_lite.kvspec`) see the same
positions, so they share block ids: one `PagedKVPool` per kind hands them out, a block id names the
same slots in the K/V tensors of every layer of the kind, and one `PrefixCache` over that pool pins
cached prompts.
A `KVGroup` is that unit:

- the sliding layers' group: every query attends to the last W keys (`config.sliding_window`), so
  blocks that fall behind the window are released;
- the full layers' group: every query sees every key, unless the group has a *full-layer window* N
  (docs/engine.md#full-layer-window): then its queries attend to their last N keys and its blocks are
  released exactly as a sliding group's are.

Everything that differs between the kinds is the window (W, N or none), which the layers'
`LayerKVSpec` carries, so there is one group type and the rules below are written once in terms of
`window`: a group without one holds every token of a sequence, a windowed
group holds a window plus the blocks still being filled.

- `release_window(seq_id, num_computed)`: release the blocks no query from `num_computed` on needs.
- `prompt_blocks(n_tokens, max_batch_tokens)`: the blocks a prompt of n tokens needs, computed from
  scratch one step at a time (all of them, or at most a window plus one step).
- `growth_blocks(tokens_left, reserve)`: the blocks the admission watermark keeps for a request's next
  decode tokens (none on a windowed group: it releases blocks as fast as it takes new ones).
- `chain_intact(seq_id, tokens, ...)`: whether a prompt can still be cached: nothing released yet, or
  every released block still in the prefix cache (a chain of hashes broken at an evicted block
  cannot be continued).

`attach_prefix` starts a sequence in every group from the cached prompt blocks; the hit is the
shortest over the groups (a sliding layer at position n needs the keys of the W - 1 tokens before n,
which cannot be recomputed without everything before them, so every group must hit).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence

from gptoss_lite.kv.block_pool import PagedKVPool
from gptoss_lite.kv.evict import recent_start
from gptoss_lite.kv.prefix import PrefixCache
from gptoss_lite.kvspec import LayerKVSpec


def step_blocks(step_tokens: int, window: int | None, block_size: int) -> int:
    """The fewest blocks a pool needs for one sequence to run a step of step_tokens beside its window:
    the step's blocks, one more where it starts mid-block, the window's, and the block the window's
    oldest token may straddle."""
    return math.ceil(step_tokens / block_size) + 1 + math.ceil((window or 0) / block_size) + 1


class KVGroup:
    """The layers of one kind, with their pool, prefix cache and window (see the module docstring).

    Built from the layers' `LayerKVSpec` (`gptoss_lite.kvspec`): its kind names the group and its
    window (W on sliding layers; None, or the full-layer window N, on full ones) is the group's rule."""

    def __init__(self, spec: LayerKVSpec, layers: Iterable[int], total_blocks: int, block_size: int) -> None:
        if not isinstance(spec, LayerKVSpec):
            raise TypeError(f"spec: expected a LayerKVSpec, got {type(spec).__name__}")
        #: what every layer of the group stores: kind, window, format, bytes
        self.spec = spec
        #: the layer kind: the key of AppendPlan dicts, stats and tables
        self.name: str = spec.kind  # a LayerKind, which is a str
        #: 'sliding-layer' or 'full-layer', for messages
        self.word = spec.kind.word
        self.layers: tuple[int, ...] = tuple(layers)
        if not self.layers:
            raise ValueError(f"{self.word} group: no layers; a group holds at least one layer")
        self.block_size = block_size
        self.pool = PagedKVPool(total_blocks, block_size)
        self.prefix = PrefixCache(block_size, pool=self.pool)
        self.window = spec.window

    def __repr__(self) -> str:
        window = "none" if self.window is None else self.window
        return f"{type(self).__name__}(layers={self.layers}, blocks={self.pool.total_blocks}, window={window})"

    # ------------------------------------------------------------------ the window rule

    def window_start(self, position: int) -> int:
        """The first position a query at `position` attends to (0 without a window): `recent_start` of
        the sequence up to that query, a window being StreamingLLM's rule with no sink tokens."""
        return 0 if self.window is None else recent_start(position + 1, self.window)

    def release_target(self, num_computed: int, slack: int = 0) -> int:
        """Tokens before this index are needed by no query from `num_computed` on, keeping `slack` more
        (0 without a window: everything is needed): StreamingLLM's rule (`kv.evict.recent_start`) with
        no sink tokens over the window, for the sequence with its next token."""
        if self.window is None:
            return 0
        return max(0, recent_start(num_computed + 1, self.window) - slack)

    def release_window(self, seq_id: Hashable, num_computed: int, *, slack: int = 0) -> tuple[int, ...]:
        """Release the sequence's blocks every slot of which precedes the window of the next query (at
        `num_computed`), keeping `slack` tokens more; return the freed block ids. Nothing without a
        window."""
        if self.window is None:
            return ()
        return self.pool.release_before(seq_id, self.release_target(num_computed, slack))

    # ------------------------------------------------------------------ block arithmetic

    def prompt_blocks(self, n_tokens: int, max_batch_tokens: int) -> int:
        """Blocks a request needs to run n_tokens of prompt from scratch (no prefix hit), at most
        max_batch_tokens a step: all of them without a window, at most a window plus one step's
        tokens with one (plus a block for a step that starts mid-block)."""
        if self.window is not None:
            n_tokens = min(n_tokens, self.window + max_batch_tokens)
        return -(-n_tokens // self.block_size) + 1

    def growth_blocks(self, tokens_left: int, reserve: int) -> int:
        """Blocks the admission watermark keeps for a request's next decode tokens: up to `reserve` of
        the `tokens_left` it may still generate; none on a windowed group, whose blocks are released as
        fast as new ones are taken."""
        if not reserve or self.window is not None:
            return 0
        return -(-max(0, min(reserve, tokens_left)) // self.block_size)

    def min_blocks(self, max_batch_tokens: int) -> int:
        """The fewest blocks the pool needs for one sequence to run a step of max_batch_tokens beside
        its window (`step_blocks`)."""
        return step_blocks(max_batch_tokens, self.window, self.block_size)

    # ------------------------------------------------------------------ prefix caching

    def released_tokens(self, seq_id: Hashable) -> int:
        """Leading tokens whose blocks the window released (0 without a window)."""
        return self.pool.first_block_index(seq_id) * self.block_size

    def resident(self, seq_id: Hashable) -> tuple[tuple[int, ...], int]:
        """(the sequence's resident blocks, `released_tokens`) from one pool lookup (the engine asks
        every request's for every step)."""
        blocks, first = self.pool.resident(seq_id)
        return blocks, first * self.block_size

    def chain_intact(self, seq_id: Hashable, tokens: Sequence[int], scope: str, revision: str) -> bool:
        """Whether the sequence's prompt `tokens` can still go into the prefix cache: nothing released
        yet, or every released block still cached (an evicted one breaks the chain of hashes there, and
        nothing after it can be cached)."""
        released = self.released_tokens(seq_id)
        if not released:
            return True
        return self.prefix.match(tokens[: released + 1], scope, revision, record=False) >= released

    def validate(self) -> None:
        """The pool's and the prefix cache's own consistency checks."""
        self.pool.validate()
        self.prefix.validate()


def attach_prefix(groups: Sequence[KVGroup], seq_id: Hashable, tokens: Sequence[int], scope: str, revision: str) -> int:
    """Create `seq_id` in every group's pool on the prompt's cached blocks; return the hit, the shortest
    over the groups (a longer hit in one group is cut back to it, so every layer holds the same tokens)."""
    hit = min(group.prefix.attach(seq_id, tokens, scope, revision) for group in groups)
    for group in groups:
        group.pool.truncate(seq_id, hit)
    return hit
