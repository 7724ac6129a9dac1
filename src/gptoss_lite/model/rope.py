"""YaRN rotary position embeddings with half-split ("NeoX") rotation and pruned pairs (docs/model.md#yarn-rope)."""

from __future__ import annotations

import math

import torch
from torch import nn

from gptoss_lite.config import ModelConfig
from gptoss_lite.kernels import rope as rope_kernel


def yarn_inv_freq(
    head_dim: int, theta: float, factor: float, original_context: int, beta_fast: float = 32.0, beta_slow: float = 1.0
) -> torch.Tensor:
    """Inverse frequencies (D/2,) blended between extrapolation and interpolation by the YaRN ramp.

    NOTE: `low`/`high` are not rounded (gpt-oss's `truncate = false`); rounding them changes the
    frequencies of the pairs in the ramp.
    """
    half = head_dim // 2
    freq = theta ** (torch.arange(half, dtype=torch.float64) * 2 / head_dim)  # (D/2,)
    extrapolated = 1.0 / freq
    if factor == 1.0:
        return extrapolated.float()
    interpolated = 1.0 / (factor * freq)
    low = half * math.log(original_context / (beta_fast * 2 * math.pi)) / math.log(theta)
    high = half * math.log(original_context / (beta_slow * 2 * math.pi)) / math.log(theta)
    # Bounds clamped to [0, D-1] as in the gpt-oss reference and transformers. It only bites for
    # original contexts below beta_fast·2π ≈ 201 tokens (tiny test configs), never for real presets.
    low, high = max(low, 0.0), min(high, head_dim - 1.0)
    if high == low:  # degenerate ramp: a step at `low`
        high = low + 1e-3
    ramp = ((torch.arange(half, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
    return (interpolated * ramp + extrapolated * (1.0 - ramp)).float()


def yarn_concentration(factor: float) -> float:
    """cos and sin are scaled by 0.1 ln(s) + 1, so attention logits scale by its square."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1.0 else 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin tables on demand for one layer kind (windowed: no pruning; global: pruned pairs).

    The first `pruned_pairs` pairs (highest frequencies) are identity: cos = 1, sin = 0, with no
    concentration scaling, so those dimensions carry position-free content.
    """

    def __init__(self, cfg: ModelConfig, pruned_pairs: int = 0):
        super().__init__()
        inv_freq = yarn_inv_freq(
            cfg.head_dim,
            cfg.rope_theta,
            cfg.rope_factor,
            cfg.rope_original_context,
            cfg.rope_beta_fast,
            cfg.rope_beta_slow,
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (D/2,)
        self.pruned_pairs = pruned_pairs
        self.concentration = yarn_concentration(cfg.rope_factor)

    def _finish(self, angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = angles.cos() * self.concentration
        sin = angles.sin() * self.concentration
        if self.pruned_pairs:
            cos[..., : self.pruned_pairs] = 1.0
            sin[..., : self.pruned_pairs] = 0.0
        return cos, sin

    def forward(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (length, D/2) for absolute positions start … start+length-1 (fp32)."""
        if length == 1:
            # Decode fast path: one position is a scalar times the frequency vector,
            # no (T, D/2) outer-product temporaries.
            angles = self.inv_freq * float(start)  # (D/2,)
            cos, sin = self._finish(angles)
            return cos[None], sin[None]  # (1, D/2)
        pos = torch.arange(start, start + length, device=self.inv_freq.device, dtype=torch.float32)
        return self._finish(torch.outer(pos, self.inv_freq))  # (T, D/2)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (N, D/2) for arbitrary absolute positions (N,), e.g. a ragged batch;
        each row equals the row `forward(p, 1)` gives for its position."""
        pos = positions.to(device=self.inv_freq.device, dtype=torch.float32)
        return self._finish(pos[:, None] * self.inv_freq)  # (N, D/2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., T, D) by half-split pairs: (x1 cos - x2 sin, x2 cos + x1 sin); cos/sin (T, D/2).

    The readable form; the model runs `apply_rotary_tables`, which is bit-identical.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of shape (T, D/2) -> full-width (cos | cos, -sin | sin), each (T, D).

    Built once per forward and shared by every layer of a kind, so that rotating a tensor is four
    ops (`apply_rotary_tables`) instead of a dozen slices, casts and a concatenation per call.
    """
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rotary_tables(x: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` with tables from `rotary_tables`: x·(cos|cos) + swap_halves(x)·(-sin|sin).

    Bit-identical to `apply_rotary` (x1·cos + x2·(-sin) is x1·cos - x2·sin exactly in IEEE arithmetic).
    A prompt's (B, H, T, D) queries and keys take `kernels.rope.rotate` (one pass, the same bits) where it
    serves; PyTorch's four ops otherwise (and always in a trace).
    """
    fast = rope_kernel.rotate(x, cos_full, sin_signed)
    if fast is not None:
        return fast
    xf = x if x.dtype == torch.float32 else x.float()
    out = xf * cos_full + xf.roll(x.shape[-1] // 2, dims=-1) * sin_signed
    return out if out.dtype == x.dtype else out.to(x.dtype)
