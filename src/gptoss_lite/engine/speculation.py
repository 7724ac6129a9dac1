"""When a decode-only step drafts (docs/engine.md#speculative-decoding): by the measured tokens per
second of the steps run each way."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gptoss_lite.speculative import PromptLookup

if TYPE_CHECKING:
    from gptoss_lite.engine.drafting import PagedDrafter
    from gptoss_lite.engine.request import Request

# A request whose running acceptance falls below SPEC_MIN_ACCEPTANCE stops drafting for a while; one
# decode-only step in SPEC_EXPLORE_EVERY tries the way the measured rates say is slower, so the choice
# follows the workload.
SPEC_MIN_ACCEPTANCE = 0.1
SPEC_EXPLORE_EVERY = 16
# A step whose drafts would fill less than this share of the rows it computes (requests without a
# draft are padded to the longest draft's rows) drafts nothing.
SPEC_MIN_FILL = 0.5


class DecodeChoice:
    """Whether a decode-only step drafts, chosen by measurement (docs/engine.md#speculative-decoding):
    the running mean tokens per second of decode-only steps run each way, the faster way taken, the
    other tried one decode-only step in SPEC_EXPLORE_EVERY. Until both ways have a figure, each is
    tried. Steps with prompt chunks always draft (for the requests already decoding)."""

    def __init__(self) -> None:
        self.rates: dict[str, float | None] = {"plain": None, "spec": None}
        self.current: str | None = None  # how this decode-only step runs (None: not one)
        self.steps = 0

    def choose(self, decode_only: bool) -> str:
        """ "spec" or "plain" for the coming step."""
        self.current = None
        if not decode_only:
            return "spec"
        self.steps += 1
        rates = self.rates
        if rates["plain"] is None or rates["spec"] is None:
            use = "spec" if rates["spec"] is None else "plain"
        else:
            use = "spec" if rates["spec"] > rates["plain"] else "plain"
            if self.steps % SPEC_EXPLORE_EVERY == 0:
                use = "plain" if use == "spec" else "spec"
        self.current = use
        return use

    def record(self, seconds: float, tokens: int) -> None:
        """Fold the step's tokens per second into its way's running mean (if it was decode-only)."""
        if self.current is None or seconds <= 0:
            return
        rate = tokens / seconds
        old = self.rates[self.current]
        self.rates[self.current] = rate if old is None else 0.8 * old + 0.2 * rate


def propose_drafts(running: list[Request], spec: PromptLookup | PagedDrafter, decode_only: bool) -> None:
    """A draft for every running request in decode that may speculate, no longer than it may still
    emit: by prompt lookup (up to k tokens that followed the latest earlier occurrence of its last
    n-gram) or by the draft model (k greedy tokens, every drafting request in one batch:
    `engine/drafting.py`).
    Requests with logprobs, penalties, a logit bias or a logits processor decode one token a step
    (their logits depend on every token before), as do seeded sampled requests (a verification
    draws from their generator differently, and they promise the same tokens alone or batched),
    and so does a request whose drafts have mostly been rejected (its running acceptance below
    SPEC_MIN_ACCEPTANCE; it drifts back up while it waits, so the request tries again later).

    Whether a decode-only step speculates at all is measured, not guessed (docs/engine.md
    #speculative-decoding): a step with drafts verifies k + 1 tokens a request (and a draft model
    costs its own forwards), which may cost more than the tokens it adds. The engine keeps the tokens
    per second of decode-only steps with and without drafts (`DecodeChoice`, running means) and drafts
    in the faster way, trying the other one step in SPEC_EXPLORE_EVERY: this runs only when it drafts."""
    wants: list[tuple[Request, int]] = []  # (request, draft tokens) for the draft model
    for request in running:
        sampling = request.sampling
        if (
            request.num_tokens - request.num_computed != 1
            or sampling.adjusts_logits
            or sampling.logprobs is not None
            or (request.generator is not None)  # seeded sampling: the same tokens however it is batched
        ):
            continue
        room = sampling.max_tokens - len(request.output_token_ids) - 1
        if room < 1:
            continue
        if request.pass_draft(SPEC_MIN_ACCEPTANCE):
            continue
        if isinstance(spec, PromptLookup):
            request.set_draft(request.lookup_index(spec).draft(min(spec.k, room)))
        else:
            wants.append((request, min(spec.k, room)))
    if not isinstance(spec, PromptLookup):
        spec.retain(r.request_id for r in running)
        if wants:
            drafts = spec.draft(wants)
            for request, _ in wants:
                request.set_draft(drafts.get(request.request_id, []))
    # The compiled step runs every request as a group of 1 + (longest draft) rows, the rows past a
    # request's own draft being padding: a decode-only step that would be mostly padding drafts
    # nothing. Eager steps keep the rule too: on random prompts they measured 0.84x without it,
    # 0.92-0.96x with it (docs/engine.md#speculative-decoding).
    if decode_only:
        rows = len(running) * (1 + max((len(r.draft) for r in running), default=0))
        if rows and sum(1 + len(r.draft) for r in running) < SPEC_MIN_FILL * rows:
            for request in running:
                request.set_draft([])
