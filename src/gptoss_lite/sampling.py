"""Logits -> token ids: greedy, temperature and nucleus (top-p) sampling (docs/kv-cache.md#generation)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gptoss_lite.validation import check_int

MAX_SEED = 2**64 - 1  # largest seed torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class SamplingConfig:
    """How next tokens are chosen. temperature <= 0 means greedy argmax (consumes no randomness)."""

    temperature: float = 0.7  # softmax temperature; <= 0 is greedy
    top_p: float = 0.9  # nucleus mass in (0, 1]; 1.0 keeps every token
    seed: int | None = None  # seeds the single random draw per step; None: nondeterministic

    def __post_init__(self) -> None:
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
        ):
            raise ValueError(f"temperature={self.temperature!r}: must be a finite number (<= 0 for greedy)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1]")
        if self.seed is not None:  # torch generators take a 64-bit unsigned seed
            object.__setattr__(self, "seed", check_int("seed", self.seed, 0, MAX_SEED))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def sample(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> token ids (B,): the argmax when greedy, else one draw from `probabilities`."""
    if cfg.greedy:
        return logits.argmax(dim=-1)
    probs = _tempered(logits, cfg.temperature)
    if cfg.top_p < 1.0:
        sorted_p, sorted_idx = _nucleus(probs, cfg.top_p)
        choice = torch.multinomial(sorted_p, 1, generator=generator)  # (B, 1)
        return sorted_idx.gather(-1, choice).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits (..., V) -> the distribution `sample` draws from, (..., V) fp32: softmax at the
    temperature, restricted to the top-p nucleus (the same keep rule as `sample`) and renormalised.
    Greedy configs give the one-hot vector of the argmax. Speculative sampling needs the whole vector.
    """
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    probs = _tempered(logits, cfg.temperature)
    if cfg.top_p < 1.0:
        sorted_p, sorted_idx = _nucleus(probs, cfg.top_p)
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
