"""One engine step on the model: a flat batch of every scheduled token, one forward, then sampling.

The runner is the device side of the engine: it owns the `PagedKVStore`'s tensors, which the
scheduler and `KVManager` never touch. It makes the step's copy-on-write copies, turns a
`ScheduledBatch` into the token ids, positions, write slots and block tables of a `PagedBatch`, runs
`GPTOSS.forward_batch` once, and samples one token for every request whose
scheduled tokens reach the end of what it holds (the last prompt chunk, or a decode step). Greedy
rows are one batched argmax; sampled rows draw one at a time with their own generator (seeded like
`generate()` seeds a single request's, so a seeded request draws the same tokens alone or batched).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from gptoss_lite.engine.paged_batch import DecodeBurst, PagedBatch, Segment, plain_decode
from gptoss_lite.engine.paged_decode import PagedDecode
from gptoss_lite.engine.request import Request, TokenLogprobs
from gptoss_lite.engine.scheduler import ScheduledBatch
from gptoss_lite.kv.paged_cache import PagedKVStore
from gptoss_lite.kv.paged_quant import QuantizedPagedStore
from gptoss_lite.kvspec import KVFormat
from gptoss_lite.model.compiled_decode import CompiledDecoder
from gptoss_lite.model.transformer import GPTOSS
from gptoss_lite.sampling import greedy, log_probs, sample
from gptoss_lite.speculative import verify

logger = logging.getLogger(__name__)


def make_store(
    model: GPTOSS,
    *,
    kv_blocks: int,
    sliding_blocks: int,
    block_size: int,
    kv_format: KVFormat,
    tail_blocks: int,
    full_window: int | None,
) -> PagedKVStore:
    """The engine's KV blocks on the model's device, in its dtype: 16-bit blocks, or quantised
    full-layer blocks with `tail_blocks` full-precision tails; the full layers' group keeps the last
    `full_window` keys, if given (docs/engine.md#full-layer-window)."""
    config, param = model.config, next(model.parameters())
    quant = {}
    store_type: type[PagedKVStore] = PagedKVStore
    if kv_format.quantized and config.full_layers:
        store_type, quant = QuantizedPagedStore, {"full_format": kv_format, "tail_blocks": tail_blocks}
    return store_type(
        config,
        kv_blocks,
        block_size,
        sliding_blocks=sliding_blocks,
        full_window=full_window,
        dtype=param.dtype,
        device=param.device,
        **quant,
    )


class ModelRunner:
    """Runs scheduled steps of `model` over the blocks of `store` (see the module docstring)."""

    #: rows per group of the warm-up step that compiles the draft-verifying graph: any size above 1
    #: gives that graph, and one unlike the warm-up's other sizes keeps them apart as symbols
    WARM_UP_GROUP_ROWS = 7

    def __init__(self, model: GPTOSS, store: PagedKVStore, decoder: CompiledDecoder | None = None) -> None:
        self.model = model
        self.store = store
        # With a decoder, a step whose every row samples (decode rows and verified drafts) runs as the
        # model's compiled decode step over the block tables, one row per token (`PagedBatch.static`);
        # prompt chunks stay on the eager forward (docs/engine.md#kv-format for quantised blocks).
        self.decoder = decoder
        self.compiled_steps = 0
        self.compiled_verifications = 0  # of those, steps that verified a draft
        self.device = next(model.parameters()).device
        # Test-only fault injection: called with each request just before its token is sampled; what
        # it raises fails that request alone (tests/engine/test_isolation.py).
        self.fault_hook: Callable[[Request], None] | None = None

    @property
    def kv_bytes(self) -> int:
        """Bytes allocated for K/V (both pools; scales and full-precision tails included)."""
        return self.store.nbytes

    @property
    def kv_tail_bytes(self) -> int:
        """Full-precision staging bytes of quantised blocks being filled (0 for 16-bit blocks)."""
        return getattr(self.store, "tail_bytes", 0)

    def build_batch(self, step: ScheduledBatch) -> tuple[torch.Tensor, PagedBatch, list[Request]]:
        """(input ids (N,), the batch, the requests that sample, in logits order: a request with a draft
        of k tokens has k + 1 rows). Changes no request: the engine advances `num_computed` after the
        step (`LLM.step`)."""
        bs = self.store.block_size
        ids: list[int] = []
        segments: list[Segment] = []
        write_slots: dict[str, list[int]] = {kind: [] for kind in self.store.kinds}
        logits_index: list[int] = []
        samplers: list[Request] = []
        for request, n, plans, tables in step.scheduled:
            for kind, plan in plans.items():
                write_slots[kind].extend(block * bs + slot for block, slot in plan.slots)
            start = request.num_computed
            segments.append(Segment(offset=len(ids), length=n, start_pos=start, tables=tables))
            ids.extend(request.token_range(start, n))
            if start + n == request.num_tokens + len(request.draft):
                # one row of logits per token a draft is verified on (the fed token and each draft)
                logits_index.extend(range(len(ids) - 1 - len(request.draft), len(ids)))
                samplers.append(request)
        batch = PagedBatch(self.store, segments, write_slots, logits_index, full_window=self.store.full_window)
        return torch.tensor(ids, dtype=torch.long, device=self.device), batch, samplers

    @torch.inference_mode()
    def warm_up(self, drafts: bool = False) -> float:
        """Compile the decode step (or load it from inductor's disk cache) on dummy steps at position
        0 of block 0 of each pool: one row (a lone request), two one-row groups (the graph of every
        batch from 2), and with `drafts` groups of several rows (the graph that verifies drafts); the
        wall time in seconds. It writes block 0: the engine calls it before admitting any request."""
        assert self.decoder is not None, "warm_up() compiles the decoder"
        t0 = time.perf_counter()
        shapes = [(1, 1), (2, 1)] + ([(2, self.WARM_UP_GROUP_ROWS)] if drafts else [])
        for groups, per_group in shapes:
            static = PagedDecode.warm_up(self.store, groups, per_group)
            ids = torch.zeros(static.positions.shape[0], dtype=torch.long, device=self.device)
            torch._dynamo.maybe_mark_dynamic(ids, 0)
            self.decoder.step(static, ids)
        return time.perf_counter() - t0

    @property
    def plain_steps(self) -> bool:
        """Whether plain decode steps go straight to the compiled step (`plain_decode`) and decode bursts
        run (`decode_burst`): there is a decoder and the blocks are 16-bit."""
        return self.decoder is not None and not isinstance(self.store, QuantizedPagedStore)

    def plain_decode(self, step: ScheduledBatch) -> tuple[torch.Tensor, PagedDecode, list[Request]] | None:
        """(input ids, the compiled step's state, the requests) of a step of plain decode rows (one token
        each, the last a request holds, no draft) on 16-bit blocks, with a decoder to run it: what
        `build_batch` and `PagedBatch.static` would give, built straight from the step
        (`paged_batch.plain_decode`); None for any other step."""
        if self.decoder is None or isinstance(self.store, QuantizedPagedStore):
            return None
        bs = self.store.block_size
        ids: list[int] = []
        rows = []
        samplers: list[Request] = []
        for request, n, plans, tables in step.scheduled:
            position = request.num_computed
            if n != 1 or request.draft or position + 1 != request.num_tokens:
                return None
            ids.append(request.last_token_id)
            rows.append(
                (position, {kind: plan.slots[0][0] * bs + plan.slots[0][1] for kind, plan in plans.items()}, tables)
            )
            samplers.append(request)
        if not rows:
            return None
        static = plain_decode(self.store, rows, self.store.full_window)
        return torch.tensor(ids, dtype=torch.long, device=self.device), static, samplers

    @torch.inference_mode()
    def decode_burst(self, step: ScheduledBatch) -> tuple[list[list[int]], list[Request]]:
        """Run a decode burst (`step.decode_steps` K > 1, every request plain greedy with K tokens
        allocated): K compiled steps, each fed the argmax of the one before, over one `DecodeBurst`
        advanced in place; (the K tokens each request drew, the requests). The tokens stay tensors
        until the burst ends: one `tolist` for the burst, where K single steps take one each."""
        for kind, src, dst, n in step.copies:
            self.store.apply_copies(kind, [(src, dst, n)])
        bs = self.store.block_size
        ids, rows, samplers = [], [], []
        for request, _, plans, tables in step.scheduled:
            ids.append(request.last_token_id)
            slots = {kind: [block * bs + slot for block, slot in plan.slots] for kind, plan in plans.items()}
            rows.append((request.num_computed, slots, tables))
            samplers.append(request)
        burst = DecodeBurst(self.store, rows, self.store.full_window)
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        drawn = []
        for j in range(step.decode_steps):
            if j:
                burst.advance(j)
            tokens = greedy(self._compiled(tokens, burst.state))
            drawn.append(tokens)
        return torch.stack(drawn, 1).tolist(), samplers

    @torch.inference_mode()
    def forward(self, step: ScheduledBatch) -> tuple[torch.Tensor, list[Request]]:
        """Make the step's copy-on-write copies, then run its one forward: (logits (M, V), the requests
        they belong to, in order). A step of plain decode rows goes straight to the compiled step
        (`plain_decode`); any other builds its `PagedBatch`."""
        for kind, src, dst, n in step.copies:
            self.store.apply_copies(kind, [(src, dst, n)])
        decode = self.plain_decode(step)
        if decode is not None:
            input_ids, static, samplers = decode
            return self._compiled(input_ids, static), samplers
        input_ids, batch, samplers = self.build_batch(step)
        logits, compiled = self.run(input_ids, batch)
        self.compiled_verifications += compiled and input_ids.shape[0] > len(samplers)
        return logits, samplers

    def run(self, input_ids: torch.Tensor, batch: PagedBatch) -> tuple[torch.Tensor, bool]:
        """One forward of a built batch: (the logits of its `logits_index` rows, whether it ran as the
        compiled step, which it does when there is a decoder and every row samples)."""
        static = batch.static() if self.decoder is not None else None
        if static is None:
            return self.model.forward_batch(input_ids, batch), False
        return self._compiled(input_ids, static), True

    def _compiled(self, input_ids: torch.Tensor, static: PagedDecode) -> torch.Tensor:
        """The compiled step over `static`: the logits of the batch's rows (each row once, in order)."""
        ids = input_ids if static.identity else input_ids[static.order]  # the rows in groups (padding repeats a row)
        torch._dynamo.maybe_mark_dynamic(ids, 0)  # the batch is dynamic, as in the state
        self.compiled_steps += 1
        logits = self.decoder.step(static, ids)
        return logits if static.identity else logits[static.real]

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, samplers: list[Request]
    ) -> tuple[list[int | list[int] | str], list[TokenLogprobs | None]]:
        """Tokens for the rows of logits (M, V), by each request's own sampling rule, and logprobs
        where the request asks for them. Where a request's own sampling raises: the reason (a str)
        instead of its token, and the other rows go on.

        A request with a draft of k tokens owns k + 1 rows and gets a list: the draft tokens the
        verification rule accepts, then its own next token (`speculative.verify`). Plain greedy rows
        (no logit bias, penalty or processor) are one batched argmax; every other row is adjusted
        and drawn alone, with its own generator."""
        if (
            self.fault_hook is None
            and len(logits) == len(samplers)
            and all(r.plain_greedy and not r.draft for r in samplers)
        ):  # the common step: every row greedy, one row each (the loop below would skip them all)
            return greedy(logits).tolist(), [None] * len(samplers)
        firsts, row = [], 0
        for request in samplers:
            firsts.append(row)
            row += 1 + len(request.draft)
        plain = [
            i for i, r in enumerate(samplers) if r.sampling.greedy and not r.sampling.adjusts_logits and not r.draft
        ]
        tokens: list[int | list[int] | str] = [0] * len(samplers)
        logprobs: list[TokenLogprobs | None] = [None] * len(samplers)
        if plain:
            rows = logits if len(plain) == len(samplers) == len(logits) else logits[[firsts[i] for i in plain]]
            for i, token in zip(plain, greedy(rows).tolist()):
                tokens[i] = token
        plain_set = set(plain)
        for i, request in enumerate(samplers):
            try:
                if self.fault_hook is not None:
                    self.fault_hook(request)
                if request.draft:
                    tokens[i] = self._verify(logits[firsts[i] : firsts[i] + 1 + len(request.draft)], request)
                    continue
                if i in plain_set and request.sampling.logprobs is None:
                    continue
                row = logits[firsts[i] : firsts[i] + 1]
                if request.sampling.adjusts_logits:
                    row = request.adjusted_logits(row)
                if i not in plain_set:
                    if request.sampling.greedy:
                        tokens[i] = int(greedy(row)[0])
                    else:
                        tokens[i] = int(sample(row, request.sampling, request.generator)[0])
                if request.sampling.logprobs is not None:
                    logprobs[i] = token_logprobs(row[0], int(tokens[i]), request.sampling.logprobs)
            except Exception as exc:  # noqa: BLE001 - confined to this request (LLM.step fails it alone)
                logger.exception("sampling failed for request %s", request.request_id)
                tokens[i] = f"{type(exc).__name__} while sampling"
        return tokens, logprobs

    @staticmethod
    def _verify(rows: torch.Tensor, request: Request) -> list[int]:
        """The tokens a draft gives (rows (k+1, V): the logits after the fed token and each draft token):
        the accepted drafts, then the request's own token at the first rejection (or after the last)."""
        draft = torch.tensor(request.draft, device=rows.device)
        lengths = torch.tensor([len(request.draft)], device=rows.device)
        accepted, own = verify(rows[None].float(), draft[None], lengths, None, request.sampling, request.generator)
        a = int(accepted[0])
        return [*request.draft[:a], int(own[0])]

    def execute(
        self, step: ScheduledBatch
    ) -> tuple[list[tuple[Request, int | list[int], TokenLogprobs | None]], list[tuple[Request, str]]]:
        """Run the step: ((request, sampled token, its logprobs or None) for every request that
        samples, (request, reason) for those whose sampling failed). A request that verified a draft
        gets the list of its new tokens instead of one token, and so does every request of a decode
        burst (`decode_burst`)."""
        if step.decode_steps > 1:
            drawn, samplers = self.decode_burst(step)
            return self._hooked([(request, tokens, None) for request, tokens in zip(samplers, drawn)])
        logits, samplers = self.forward(step)
        sampled: list[tuple[Request, int | list[int], TokenLogprobs | None]] = []
        failed: list[tuple[Request, str]] = []
        if samplers:
            tokens, logprobs = self.sample(logits, samplers)
            for request, token, lp in zip(samplers, tokens, logprobs):
                if isinstance(token, str):
                    failed.append((request, token))
                else:
                    sampled.append((request, token, lp))
        return sampled, failed

    def _hooked(self, sampled: list) -> tuple[list, list[tuple[Request, str]]]:
        """A burst's (sampled, failed): the fault hook, where set, fails the requests it raises for."""
        if self.fault_hook is None:
            return sampled, []
        kept, failed = [], []
        for entry in sampled:
            try:
                self.fault_hook(entry[0])
            except Exception as exc:  # noqa: BLE001 - confined to this request, as in sample()
                failed.append((entry[0], f"{type(exc).__name__} while sampling"))
                continue
            kept.append(entry)
        return kept, failed


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """logits (V,) -> the chosen token's log-probability and the k most likely (`sampling.log_probs`)."""
    chosen, top = log_probs(logits, token, k)
    return TokenLogprobs(token, chosen, top)
