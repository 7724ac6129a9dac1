"""Shared fixtures: tiny seeded models on CPU in fp32."""

import pytest
import torch

from gptoss_lite.fixtures import resolve_config
from gptoss_lite.model import GPTOSS

# One intra-op thread: tiny models gain nothing from two, and on a shared 2-core machine (CI, or a
# developer training in the background) oversubscribed OpenMP threads make tests 10x slower.
torch.set_num_threads(1)


def make_model(preset: str = "lite-tiny", seed: int = 0, **changes) -> GPTOSS:
    """A tiny model with non-trivial sinks and biases (so sink/bias bugs cannot hide behind zeros)."""
    cfg = resolve_config(preset).replace(**changes) if changes else resolve_config(preset)
    torch.manual_seed(seed)
    model = GPTOSS(cfg)
    model.reset_parameters(seed)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen) * 2)
            elif "bias" in name.rsplit(".", 1)[-1]:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            elif "norm" in name:
                p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.1)
    return model.prepare_for_inference()


@pytest.fixture
def tiny_model() -> GPTOSS:
    return make_model("lite-tiny")


@pytest.fixture
def tiny_gptoss() -> GPTOSS:
    return make_model("gpt-oss-tiny")
