"""MXFP4 expert weights, as stored by the released gpt-oss checkpoints (docs/checkpoints.md).

`*_blocks` uint8 (E, out, in/32, 16): 32 E2M1 4-bit codes per block, two per byte, the LOW nibble
holding the even element. `*_scales` uint8 (E, out, in/32): one power-of-two exponent per block,
biased by 127 (value = code_value · 2^(scale - 127)).

The blocks run along the INPUT dimension of an (out, in) matrix; the HF parameter layout is
input-major (E, in, out), hence the transpose after dequantising.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per scale (OCP MX spec)
# E2M1 code -> value. Source: OCP Microscaling Formats spec, FP4 E2M1 table; codes 8-15 are the negatives.
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_SCALE_BIAS = 127
_MAX_CODE_VALUE = 6.0


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks (E, out, G, 16) uint8 + scales (E, out, G) uint8 -> weights (E, in = 32·G, out) in `dtype`.

    The result is in the HF input-major layout (transposed from the stored (out, in)).
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks/scales must be uint8; got {blocks.dtype} / {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != BLOCK // 2 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"MXFP4 shapes: blocks {list(blocks.shape)} must be (E, out, G, 16) and scales "
            f"{list(scales.shape)} must be (E, out, G)"
        )
    E, out, G, _ = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # (E, out, G, 16, 2): low nibble first
    values = lut[codes].reshape(E, out, G, BLOCK)  # (E, out, G, 32)
    exponent = scales.to(torch.int32) - _SCALE_BIAS  # (E, out, G)
    values = torch.ldexp(values, exponent[..., None].to(torch.float32))
    return values.reshape(E, out, G * BLOCK).transpose(1, 2).contiguous().to(dtype)  # (E, in, out)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weights (E, in, out) in the HF layout -> (blocks (E, out, in/32, 16), scales (E, out, in/32)) uint8.

    Each block's scale is the smallest power of two that brings its max |value| to <= 6; every value
    is then rounded to the nearest E2M1 code. Values that are already code·2^k within a block pack
    exactly. Intended for tests and for writing compact checkpoints.
    """
    if weight.dim() != 3 or weight.shape[1] % BLOCK:
        raise ValueError(f"quantize_mxfp4: weight {list(weight.shape)} must be (E, in, out) with in % {BLOCK} == 0")
    E, n_in, out = weight.shape
    w = weight.detach().float().transpose(1, 2).reshape(E, out, n_in // BLOCK, BLOCK)  # (E, out, G, 32)
    amax = w.abs().amax(dim=-1)  # (E, out, G)
    # exponent k with amax / 2^k <= 6, smallest such k; all-zero blocks get k = -127 (scale code 0).
    k = torch.ceil(torch.log2(amax.clamp_min(1e-38) / _MAX_CODE_VALUE))
    k = torch.where(amax > 0, k, torch.full_like(k, -_SCALE_BIAS)).clamp(-_SCALE_BIAS, 255 - _SCALE_BIAS)
    scaled = w / torch.exp2(k)[..., None]  # (E, out, G, 32), |scaled| <= 6
    lut = torch.tensor(FP4_VALUES[:8], dtype=torch.float32)
    magnitude_code = (scaled.abs()[..., None] - lut).abs().argmin(dim=-1)  # nearest |value|, (E, out, G, 32)
    codes = (magnitude_code | ((scaled < 0).long() << 3)).to(torch.uint8)
    codes = codes.reshape(E, out, n_in // BLOCK, BLOCK // 2, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)  # even element in the low nibble
    scales = (k + _SCALE_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()
