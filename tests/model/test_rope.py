import math

import pytest
import torch

from gptoss_lite.fixtures import resolve_config
from gptoss_lite.model.rope import (
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_tables,
    rotary_tables,
    yarn_concentration,
    yarn_inv_freq,
)


def test_yarn_inv_freq_by_hand():
    """YaRN frequencies follow docs/model.md#yarn-rope with unrounded low/high (truncate = false)."""
    D, theta, s, L0 = 96, 100_000.0, 32.0, 4096
    inv = yarn_inv_freq(D, theta, s, L0)
    half = D // 2
    low = half * math.log(L0 / (32 * 2 * math.pi)) / math.log(theta)
    high = half * math.log(L0 / (1 * 2 * math.pi)) / math.log(theta)
    for i in (0, 5, int(low) + 1, 20, int(high), 47):
        freq = theta ** (2 * i / D)
        ramp = min(1.0, max(0.0, (i - low) / (high - low)))
        expected = (1 / (s * freq)) * ramp + (1 / freq) * (1 - ramp)
        assert math.isclose(inv[i].item(), expected, rel_tol=1e-6), i
    assert not float(low).is_integer()  # the test would not catch rounding otherwise


def test_concentration_value():
    """cos/sin scale 0.1 ln(32) + 1 = 1.3466 (logits ≈ 1.813×)."""
    assert round(yarn_concentration(32.0), 4) == 1.3466
    assert round(yarn_concentration(32.0) ** 2, 3) == 1.813
    assert yarn_concentration(1.0) == 1.0


def test_pruned_pairs_are_identity():
    """On global layers the first pruned pairs have cos = 1, sin = 0 at every position."""
    cfg = resolve_config("gptoss-lite-502m")
    rope = RotaryEmbedding(cfg, pruned_pairs=cfg.rope_pruned_pairs)
    cos, sin = rope(1000, 5)
    assert cos.shape == (5, 48)
    assert (cos[:, :24] == 1).all() and (sin[:, :24] == 0).all()
    assert not (sin[:, 24:] == 0).all()


def test_single_position_matches_table():
    """The scalar decode path equals the row of the (T, D/2) table."""
    rope = RotaryEmbedding(resolve_config("gptoss-lite-502m"), pruned_pairs=24)
    cos_t, sin_t = rope(100, 40)
    cos_1, sin_1 = rope(117, 1)
    torch.testing.assert_close(cos_1[0], cos_t[17])
    torch.testing.assert_close(sin_1[0], sin_t[17])


def test_half_split_rotation():
    """Rotation is (x1 cos - x2 sin, x2 cos + x1 sin) on the two halves of the head vector."""
    x = torch.randn(3, 8)
    cos, sin = torch.rand(3, 4), torch.rand(3, 4)
    out = apply_rotary(x, cos, sin)
    x1, x2 = x[:, :4], x[:, 4:]
    torch.testing.assert_close(out, torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_rotation_is_bit_identical(dtype):
    """The model's four-op rotation (full-width tables) equals the readable form exactly."""
    rope = RotaryEmbedding(resolve_config("gptoss-lite-502m"), pruned_pairs=24)
    cos, sin = rope(300, 9)
    x = torch.randn(2, 3, 9, 2 * cos.shape[-1]).to(dtype)
    out = apply_rotary_tables(x, *rotary_tables(cos, sin))
    assert out.dtype == dtype
    assert torch.equal(out, apply_rotary(x, cos, sin))


def test_relative_positions():
    """Without YaRN scaling, q·k after rotation depends only on the position difference."""
    cfg = resolve_config("lite-tiny").replace(rope_factor=1.0)
    rope = RotaryEmbedding(cfg)
    q, k = torch.randn(16), torch.randn(16)

    def dot(pq, pk):
        cq, sq = rope(pq, 1)
        ck, sk = rope(pk, 1)
        return (apply_rotary(q[None], cq, sq) * apply_rotary(k[None], ck, sk)).sum().item()

    assert math.isclose(dot(10, 3), dot(1010, 1003), rel_tol=1e-3, abs_tol=1e-4)
