"""The engine's draft model on paged blocks of its own, every drafting request in one batch.

`PagedDrafter` serves `LLM(speculate=DraftModel(...))` (docs/engine.md#speculative-decoding). It keeps,
for every running request that drafts, a sequence in a `PagedKVStore` of the draft model's geometry
(its own `KVManager`, no prefix cache): the draft model's K/V of a prefix of the request's tokens.
A step's drafts are made together:

1. each request's sequence is cut back to the longest prefix it shares with the request's tokens
   (only the drafts fed last time can differ: what the verification rejected);
2. one forward over every request's tokens not yet held (a whole prompt the first time; at most
   `max_batch_tokens` rows a forward, so a long catch-up takes several) gives each request's first
   draft token from its last row;
3. one forward per further draft token, a row per request still drafting.

Drafts are greedy, so a draft's q is the one-hot vector the verification rule assumes (as for prompt
lookup): a sampled request still draws every token from the target's distribution. A request the
draft pool cannot hold this step gets no draft (or a shorter one): drafting is optional, and the
target step never waits for it. Sequences of requests that left the running set are released at the
next drafting step, or when the engine retires or aborts them (`forget`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gptoss_lite.engine.kv_manager import BlockCopy, KVManager, pool_blocks
from gptoss_lite.engine.paged_batch import PagedBatch, Segment
from gptoss_lite.engine.runner import ModelRunner, make_store
from gptoss_lite.kvspec import DENSE, model_kv_specs

if TYPE_CHECKING:
    from gptoss_lite.engine.config import EngineConfig
    from gptoss_lite.engine.request import Request
    from gptoss_lite.kv.paged_cache import PagedKVStore
    from gptoss_lite.model.compiled_decode import CompiledDecoder
    from gptoss_lite.model.transformer import GPTOSS
    from gptoss_lite.speculative import DraftModel


@dataclass
class _Sequence:
    """A request's tokens in the draft pool (a `kv_manager.Sequenced`): `held`, the tokens whose K/V it
    holds, in order; `floor`, the request's own token count at this step, which a later step never
    cuts the sequence back below (only the drafts fed after it can be rejected); `num_computed`, what
    `KVManager.allocate` releases a window's old blocks by: the next query's position, but never past
    `floor`, so the blocks the next step's first query needs stay (derived, never assigned)."""

    request_id: Hashable
    held: list[int] = field(default_factory=list)
    floor: int = 0
    scope: str = "draft"

    @property
    def all_token_ids(self) -> list[int]:
        return self.held

    @property
    def num_computed(self) -> int:
        return min(len(self.held), self.floor)


class PagedDrafter:
    """Draft tokens for many requests at once from a draft model over its own block pool (see the
    module docstring)."""

    def __init__(self, spec: DraftModel, cfg: EngineConfig, *, full_blocks: int, max_model_len: int) -> None:
        """A pool holding as many tokens as the target's full-layer pool (`full_blocks` blocks of
        `cfg.block_size`), in the draft model's dtype and geometry."""
        model: GPTOSS = spec.model
        self.model, self.k = model, spec.k
        self.max_batch_tokens = cfg.max_batch_tokens
        param = next(model.parameters())
        specs = model_kv_specs(model.config, param.dtype.itemsize, DENSE)
        own = dataclasses.replace(cfg, kv_blocks=full_blocks, sliding_blocks=None, enable_prefix_caching=False)
        blocks, sliding = pool_blocks(specs, own, max_model_len)
        store = make_store(
            model,
            kv_blocks=blocks,
            sliding_blocks=sliding + cfg.max_running,  # a block of slack per request mid catch-up
            block_size=cfg.block_size,
            kv_format=DENSE,
            tail_blocks=0,
            full_window=None,
        )
        self.kv = KVManager(store, revision="draft", enable_prefix_caching=False)
        self.device = param.device
        self._seqs: dict[Hashable, _Sequence] = {}
        self.forwards = 0  # draft-model forwards run (each over every drafting request)
        # A runner of its own over the draft store: with the engine's compiled decode, the one-token
        # forwards run as the draft model's compiled step over the block tables (catch-ups stay eager).
        if cfg.compile_decode and model.compiled_decoder is None:
            model.prepare_for_inference(compile_decode=True)
        self.runner = ModelRunner(model, store, None if cfg.compile_decode is False else model.compiled_decoder)
        if self.runner.decoder is not None:  # compile now, while no sequence holds a block (it writes block 0)
            self.runner.warm_up()

    @property
    def store(self) -> PagedKVStore:
        return self.runner.store

    @property
    def decoder(self) -> CompiledDecoder | None:
        """The draft model's compiled step, when the engine compiles decode."""
        return self.runner.decoder

    # ------------------------------------------------------------------ sequences

    def forget(self, request_id: Hashable) -> None:
        """Release the request's sequence, if it has one."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)

    def retain(self, live: Iterable[Hashable]) -> None:
        """Release the sequences of requests not in `live` (finished, aborted or preempted ones)."""
        keep = set(live)
        for rid in [rid for rid in self._seqs if rid not in keep]:
            self.forget(rid)

    def _sequence(self, request_id: Hashable, tokens: Sequence[int]) -> tuple[_Sequence, int]:
        """The request's sequence cut back to the longest prefix of `tokens` it holds (the last token is
        always fed: its logits give the first draft), and that prefix's length."""
        seq = self._seqs.get(request_id)
        if seq is None:
            seq = self._seqs[request_id] = _Sequence(request_id)
            self.kv.start(seq)
            return seq, 0
        held = seq.held
        limit = min(len(held), len(tokens) - 1)
        same = min(max(0, len(held) - self.k), limit)  # only the drafts fed last time can differ
        while same < limit and held[same] == tokens[same]:
            same += 1
        if same < len(held):
            try:
                self.kv.truncate(seq, same)
            except ValueError:  # before the window's retained blocks: start the sequence over
                self.forget(request_id)
                return self._sequence(request_id, tokens)
            del held[same:]
        return seq, same

    # ------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def draft(self, wants: Sequence[tuple[Request, int]]) -> dict[Hashable, list[int]]:
        """Up to k greedy draft tokens for each (request, k) of `wants`, by request id (a request the
        pool could not hold this step is missing, or has fewer than k)."""
        pending: dict[Hashable, list[int]] = {}  # tokens still to feed, per request
        limits: dict[Hashable, int] = {}
        seqs: dict[Hashable, _Sequence] = {}
        for request, k in wants:
            tokens = request.all_token_ids
            seq, same = self._sequence(request.request_id, tokens)
            seq.floor = len(tokens)
            seqs[request.request_id], limits[request.request_id] = seq, k
            pending[request.request_id] = list(tokens[same:])
        out: dict[Hashable, list[int]] = {}
        # 1. catch up: every request's unheld tokens, at most max_batch_tokens rows a forward
        while pending:
            budget, feeds = self.max_batch_tokens, []
            for rid in list(pending):
                n = min(len(pending[rid]), budget)
                if n == 0:
                    break
                feeds.append((seqs[rid], pending[rid][:n], n == len(pending[rid])))
                budget -= n
            logits, fed = self._forward(feeds)
            for (seq, tokens, last), row in zip(fed, logits):
                rid = seq.request_id
                del pending[rid][: len(tokens)]
                if last:
                    del pending[rid]
                    out[rid] = [int(row.argmax())]
            fed_ids = {seq.request_id for seq, _, _ in fed}
            for seq, _, _ in feeds:  # a request the pool could not hold drafts nothing
                if seq.request_id not in fed_ids:
                    pending.pop(seq.request_id, None)
                    self.forget(seq.request_id)
        # 2. one forward per further draft token
        for i in range(1, max(limits.values(), default=0)):
            feeds = [(seqs[rid], [d[-1]], True) for rid, d in out.items() if limits[rid] > i and len(d) == i]
            if not feeds:
                break
            logits, fed = self._forward(feeds)
            for (seq, _, _), row in zip(fed, logits):
                out[seq.request_id].append(int(row.argmax()))
        return out

    def _forward(
        self, feeds: list[tuple[_Sequence, list[int], bool]]
    ) -> tuple[list[torch.Tensor | None], list[tuple[_Sequence, list[int], bool]]]:
        """Append each feed's tokens to its sequence and run them in one forward: (per fed feed, the
        logits of its last row when the feed asks for them (else None), the feeds that fit the pool)."""
        copies: list[BlockCopy] = []
        bs = self.store.block_size
        ids: list[int] = []
        segments: list[Segment] = []
        write_slots: dict[str, list[int]] = {kind: [] for kind in self.store.kinds}
        logits_index: list[int] = []
        fed = []
        for seq, tokens, want in feeds:
            plans = self.kv.allocate(seq, len(tokens), copies)
            if plans is None:
                continue
            for kind, plan in plans.items():
                write_slots[kind].extend(block * bs + slot for block, slot in plan.slots)
            tables = self.kv.tables(seq)
            segments.append(Segment(offset=len(ids), length=len(tokens), start_pos=len(seq.held), tables=tables))
            ids.extend(tokens)
            seq.held.extend(tokens)
            if want:
                logits_index.append(len(ids) - 1)
            fed.append((seq, tokens, want))
        if not fed:
            return [], []
        assert not copies, "the draft pool shares no block (no prefix cache, no fork): nothing to copy"
        batch = PagedBatch(self.store, segments, write_slots, logits_index)
        logits, _ = self.runner.run(torch.tensor(ids, dtype=torch.long, device=self.device), batch)
        self.forwards += 1
        rows: list[torch.Tensor | None] = []
        at = 0
        for _, _, want in fed:
            rows.append(logits[at] if want else None)
            at += want
        return rows, fed

    # ------------------------------------------------------------------ checks

    def validate(self, live: set[Hashable]) -> None:
        """The draft pool's own checks hold, and it holds sequences of live requests only."""
        self.kv.validate(set(self._seqs))
        orphans = set(self._seqs) - live
        assert not orphans, f"draft sequences without a request: {sorted(map(str, orphans))}"

    @property
    def all_free(self) -> bool:
        return self.kv.usage().all_free
