"""When a decode-only step drafts (docs/engine.md#speculative-decoding): by the measured tokens per
second of the steps run each way."""

from __future__ import annotations

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
