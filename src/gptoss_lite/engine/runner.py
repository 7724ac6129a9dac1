"""One engine step on the model: a flat batch of every scheduled token, one forward, then sampling.

The runner turns a `ScheduledStep` into the token ids, positions, write slots and block tables of a
`PagedBatch`, runs `GPTOSS.forward_batch` once, and samples one token for every request whose
scheduled tokens reach the end of what it holds (the last prompt chunk, or a decode step). Greedy
rows are one batched argmax; sampled rows draw one at a time with their own generator (seeded like
`generate()` seeds a single request's, so a seeded request draws the same tokens alone or batched).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from gptoss_lite.config import FULL
from gptoss_lite.engine.kv_manager import KVManager
from gptoss_lite.engine.paged_attention import PagedBatch, Segment
from gptoss_lite.engine.request import Request
from gptoss_lite.engine.scheduler import ScheduledStep
from gptoss_lite.model.transformer import GPTOSS
from gptoss_lite.sampling import sample

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs scheduled steps of `model` over the blocks of `kv` (see the module docstring)."""

    def __init__(self, model: GPTOSS, kv: KVManager) -> None:
        self.model = model
        self.kv = kv
        self.device = next(model.parameters()).device
        # Test-only fault injection: called with each request just before its token is sampled; what
        # it raises fails that request alone (tests/engine/test_isolation.py).
        self.fault_hook: Callable[[Request], None] | None = None

    def build_batch(self, step: ScheduledStep) -> tuple[torch.Tensor, PagedBatch, list[Request]]:
        """(input ids (N,), the batch, the requests that sample, in logits order). Advances each
        scheduled request's `num_computed` past the tokens it runs."""
        bs = self.kv.block_size
        ids: list[int] = []
        segments: list[Segment] = []
        write_slots: dict[str, list[int]] = {kind: [] for kind in self.kv.store.pools}
        logits_index: list[int] = []
        samplers: list[Request] = []
        for request, n, plans in step.scheduled:
            for kind, plan in plans.items():
                write_slots[kind].extend(block * bs + slot for block, slot in plan.slots)
            tables = {kind: self.kv.resident(request, kind) for kind in self.kv.store.pools}
            start = request.num_computed
            segments.append(Segment(offset=len(ids), length=n, start_pos=start, tables=tables))
            ids.extend(request.token_range(start, n))
            request.num_computed = start + n
            if request.num_computed == request.num_tokens:
                logits_index.append(len(ids) - 1)
                samplers.append(request)
        batch = PagedBatch(self.kv.store, segments, write_slots, logits_index, full_window=self.kv.windows[FULL])
        return torch.tensor(ids, dtype=torch.long, device=self.device), batch, samplers

    @torch.inference_mode()
    def forward(self, step: ScheduledStep) -> tuple[torch.Tensor, list[Request]]:
        """Run the step's one forward: (logits (M, V), the requests they belong to, in order)."""
        input_ids, batch, samplers = self.build_batch(step)
        return self.model.forward_batch(input_ids, batch), samplers

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, samplers: list[Request]) -> list[int | str]:
        """One token per row of logits (M, V), by each request's own sampling rule; where a request's
        own sampling raises, the reason (a str) instead of its token, and the other rows go on."""
        greedy = [i for i, r in enumerate(samplers) if r.config.greedy]
        tokens: list[int | str] = [0] * len(samplers)
        if greedy:
            rows = logits if len(greedy) == len(samplers) else logits[greedy]
            for i, token in zip(greedy, rows.argmax(dim=-1).tolist()):
                tokens[i] = token
        for i, request in enumerate(samplers):
            try:
                if self.fault_hook is not None:
                    self.fault_hook(request)
                if not request.config.greedy:
                    tokens[i] = int(sample(logits[i : i + 1], request.config, request.generator)[0])
            except Exception as exc:  # noqa: BLE001 - confined to this request (LLM.step fails it alone)
                logger.exception("sampling failed for request %s", request.request_id)
                tokens[i] = f"{type(exc).__name__} while sampling"
        return tokens

    def execute(self, step: ScheduledStep) -> tuple[list[tuple[Request, int]], list[tuple[Request, str]]]:
        """Run the step: ((request, sampled token) for every request that samples, (request, reason)
        for those whose sampling failed)."""
        logits, samplers = self.forward(step)
        sampled: list[tuple[Request, int]] = []
        failed: list[tuple[Request, str]] = []
        for request, token in zip(samplers, self.sample(logits, samplers) if samplers else []):
            (failed if isinstance(token, str) else sampled).append((request, token))  # type: ignore[arg-type]
        return sampled, failed
