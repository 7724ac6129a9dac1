"""Logits -> token ids: greedy, temperature and nucleus (top-p) sampling (docs/kv-cache.md#generation).

`SamplingParams` is the package's one description of how tokens are chosen: `generate()` and the
batched engine (`gptoss_lite.engine`) take the same type, with the same defaults and checks.
`sample` and `probabilities` read its temperature and top_p only; the other fields are the engine's
(stops, logit adjustments, logprobs, n)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from gptoss_lite.kernels import rows as rows_kernel
from gptoss_lite.validation import check_int

MAX_SEED = 2**64 - 1  # largest seed torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20  # top alternatives a request may ask for per token
MAX_N = 128  # samples of one prompt per request
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (the OpenAI range)
MAX_LOGIT_BIAS = 100.0  # |bias| per token (the OpenAI range: -100 bans a token, +100 forces it)


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates. temperature <= 0 is greedy; generation stops after `max_tokens`,
    at the tokenizer's end-of-sequence token (unless `ignore_eos`), at any of `stop_token_ids`, or
    when the text contains one of the `stop` strings (the text is cut before it).

    Before a token is chosen its logits are adjusted, as the OpenAI API defines: `logit_bias` adds a
    bias to given token ids ({id: bias}, each in [-100, 100]); `presence_penalty` is subtracted once
    from every token already generated and `frequency_penalty` once per time it was generated (both
    in [-2, 2]). `logprobs` k (0..20) reports, for every generated token, its log-probability and
    the k most likely tokens' (log_softmax of the adjusted logits, before temperature and top-p).

    `logits_processor(token_ids, logits) -> logits` is called last, on every step of the request,
    with the tokens generated so far and that step's fp32 logits (V,); it returns the logits to draw
    from (for example -inf outside what a grammar allows). A processor that keeps state per sample
    defines `fork()`, which gives samples 1..n-1 their own. What it raises fails its request alone.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # also accepted as a {token id: bias} mapping
    n: int = 1  # samples of the prompt; sample i > 0 draws with seed + i (see `for_sample`)
    logits_processor: Callable[[list[int], torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, minimum=1)
        if self.seed is not None:  # torch generators take a 64-bit unsigned seed
            object.__setattr__(self, "seed", check_int("seed", self.seed, 0, MAX_SEED))
        if not _is_number(self.temperature) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature={self.temperature!r}: must be a finite number (<= 0 for greedy)")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1]")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Sequence):
            raise TypeError(f"stop_token_ids={self.stop_token_ids!r}: expected a sequence of ints")
        ids = tuple(check_int("stop_token_ids", t, 0) for t in self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", ids)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
            raise TypeError(f"stop={self.stop!r}: expected a non-empty string or a sequence of them")
        object.__setattr__(self, "stop", tuple(stop))
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos={self.ignore_eos!r}: expected a bool")
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name}={value!r}: must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        pairs = []
        for entry in bias:
            if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                raise TypeError(f"logit_bias: expected {{token id: bias}} or (id, bias) pairs, got {entry!r}")
            token, value = check_int("logit_bias token id", entry[0], 0), entry[1]
            if not _is_number(value) or not abs(value) <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{token}]={value!r}: must be a number in [-100, 100]")
            pairs.append((token, float(value)))
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs)))
        check_int("n", self.n, 1, MAX_N)
        if self.logits_processor is not None and not callable(self.logits_processor):
            raise TypeError(f"logits_processor={self.logits_processor!r}: expected a callable")

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters sample `index` of an n-sample request draws with: n=1, and the seed plus
        `index` (mod 2^64) when there is a seed. So sample i equals a single request with that seed."""
        seed = None if self.seed is None else (self.seed + index) % (MAX_SEED + 1)
        processor = self.logits_processor
        if index > 0 and hasattr(processor, "fork"):
            processor = processor.fork()
        return dataclasses.replace(self, n=1, seed=seed, logits_processor=processor)

    @property
    def greedy(self) -> bool:
        """temperature <= 0: the argmax, drawing no random number."""
        return self.temperature <= 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether logit_bias, a penalty or a logits processor changes the logits before a token is chosen."""
        return (
            bool(self.logit_bias)
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.logits_processor is not None
        )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits (..., V) -> the index of each row's largest logit (the first of equals). 16-bit logits are
    widened first (exact, so the same index): torch's CPU argmax over bf16 took 355 µs for 16 rows of
    12,288 logits against 98 µs for fp32, a conversion included (Zen 4). Rows of fp32 logits go to
    `kernels.rows.argmax` where it is built (the same index, a vectorised pass: ~19 µs for those 16
    rows where torch's argmax took ~80 µs)."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    fast = rows_kernel.argmax(logits) if logits.dim() == 2 else None
    return logits.argmax(dim=-1) if fast is None else fast


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> token ids (B,): the argmax when greedy, else one draw from `probabilities`."""
    if params.greedy:
        return greedy(logits)
    probs = _tempered(logits, params.temperature)
    if params.top_p < 1.0:
        sorted_p, sorted_idx = _nucleus(probs, params.top_p)
        choice = torch.multinomial(sorted_p, 1, generator=generator)  # (B, 1)
        return sorted_idx.gather(-1, choice).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (..., V) -> the distribution `sample` draws from, (..., V) fp32: softmax at the
    temperature, restricted to the top-p nucleus (the same keep rule as `sample`) and renormalised.
    Greedy parameters give the one-hot vector of the argmax. Speculative sampling needs the whole vector.
    """
    if params.greedy:
        return torch.nn.functional.one_hot(greedy(logits), logits.shape[-1]).float()
    probs = _tempered(logits, params.temperature)
    if params.top_p < 1.0:
        sorted_p, sorted_idx = _nucleus(probs, params.top_p)
        probs = torch.zeros_like(probs).scatter(-1, sorted_idx, sorted_p)
    return probs


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature), fp32, for any positive temperature and any logits dtype.

    The row maximum is subtracted first (in float64): a tiny temperature (1e-39) then sends every
    other logit to -inf instead of the maximum to +inf, so the result stays finite (at worst one-hot).
    """
    logits = logits.double()
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    return torch.softmax(scaled, dim=-1).float()


def _nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p nucleus of probs (..., V): (kept probabilities renormalised, in descending order;
    their token ids). A token is kept when the mass before it is < top_p, and the most likely token
    always is, so a top_p below float32's resolution (1e-46 rounds to 0) keeps exactly that one
    token instead of none."""
    sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    drop = mass_before >= top_p
    drop[..., 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return sorted_p / sorted_p.sum(dim=-1, keepdim=True), sorted_idx


def log_probs(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """logits (V,) -> (log-probability of `token`, the k most likely (id, log-probability), most likely
    first); log_softmax in fp32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if k:
        values, ids = logp.topk(k)
        top = list(zip(ids.tolist(), values.tolist()))
    return float(logp[token]), top
