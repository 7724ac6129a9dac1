"""PoSE-style position skipping (docs/training.md#position-skipping): the full layers see a training
sequence's tokens at positions spread over a longer range, the documents stay seq_len tokens long."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from gptoss_lite.model import GPTOSS
from gptoss_lite.train.data import pose_positions
from tests.train.test_train import tiny_config, train_run


@pytest.mark.parametrize("seq_len, length, chunks", [(64, 64, 1), (64, 4096, 2), (100, 131072, 3), (8, 9, 8)])
def test_pose_positions_are_runs_of_the_documents_own_order_within_the_range(seq_len, length, chunks):
    for seed in range(20):
        pos = pose_positions(seq_len, length, chunks, random.Random(seed))
        assert pos.shape == (seq_len,) and pos.dtype == torch.long
        steps = pos[1:] - pos[:-1]
        assert bool((steps >= 1).all()) and int(pos[0]) >= 0 and int(pos[-1]) < length
        assert int((steps > 1).sum()) <= chunks - 1  # at most one gap between two runs
    spread = [int(pose_positions(seq_len, length, chunks, random.Random(s))[-1]) for s in range(50)]
    if length > seq_len and chunks > 1:
        assert max(spread) > length // 2  # the far positions are reached


def test_anchored_runs_span_the_whole_range_and_anchor_zero_draws_as_before():
    """pose_anchor=1 pins the first run to 0 and the last to length - 1 (the farthest distance is
    trained every time); 0 draws exactly the positions of a run without the option; 0.5 pins about half."""
    for seed in range(20):
        pos = pose_positions(100, 131072, 2, random.Random(seed), anchor=1.0)
        assert int(pos[0]) == 0 and int(pos[-1]) == 131071 and int(((pos[1:] - pos[:-1]) > 1).sum()) == 1
        plain = pose_positions(100, 131072, 2, random.Random(seed))
        assert torch.equal(pose_positions(100, 131072, 2, random.Random(seed), anchor=0.0), plain)
    ends = [pose_positions(64, 4096, 2, random.Random(s), anchor=0.5) for s in range(400)]
    pinned = sum(int(p[0]) == 0 and int(p[-1]) == 4095 for p in ends)
    assert 150 < pinned < 250


def test_full_positions_rotate_only_the_full_layers_and_match_the_plain_forward():
    """0 … T-1 given explicitly is the plain forward; a common shift of every position leaves the
    logits as they were (rotary is relative), and positions with a gap change them."""
    cfg = tiny_config(Path("unused")).model
    torch.manual_seed(0)
    model = GPTOSS(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 48))
    with torch.no_grad():
        plain = model(ids).logits
        same = model(ids, full_positions=torch.arange(48)).logits
        shifted = model(ids, full_positions=torch.arange(48) + 1000).logits
        gap = model(ids, full_positions=torch.cat([torch.arange(24), torch.arange(24) + 3000])).logits
    torch.testing.assert_close(same, plain, rtol=0, atol=0)
    torch.testing.assert_close(shifted, plain, rtol=1e-4, atol=1e-4)
    rounding = (shifted - plain).abs().max()
    assert (gap[:, 24:] - plain[:, 24:]).abs().max() > 20 * rounding  # the gap is seen after it
    torch.testing.assert_close(gap[:, :24], plain[:, :24], rtol=1e-5, atol=1e-5)  # causal: before the gap
    with pytest.raises(ValueError, match="full_positions"):
        model(ids, full_positions=torch.arange(47))


def test_a_pose_run_trains_resumes_identically_and_records_the_document_length(tmp_path):
    """With pose_length the run still records seq_len as its trained context, and a resumed run draws
    the same positions (its losses equal the uninterrupted run's)."""
    from gptoss_lite.checkpoint import load_model

    pose = {"data": {"pose_length": 4096, "pose_chunks": 2}}
    full = train_run(tiny_config(tmp_path / "full", **pose), max_steps=4)
    cfg = tiny_config(tmp_path / "split", **pose)
    train_run(cfg, max_steps=2)
    resumed = train_run(cfg, resume=True)
    assert resumed.losses == pytest.approx(full.losses[2:], rel=1e-6)
    plain = train_run(tiny_config(tmp_path / "plain"), max_steps=4)
    assert full.losses != pytest.approx(plain.losses, rel=1e-6)  # the positions did change something
    assert load_model(tmp_path / "full" / "final").config.train_context_length == 224


@pytest.mark.parametrize(
    "data, message",
    [
        ({"pose_length": 100}, "data.pose_length"),  # shorter than seq_len (224)
        ({"pose_length": 4096, "pose_chunks": 0}, "data.pose_chunks"),
        ({"pose_length": 4096, "pose_anchor": 1.5}, "data.pose_anchor"),
        ({"pose_length": 10**9}, "exceeds model.max_position_embeddings"),
    ],
)
def test_bad_pose_settings_say_what_is_wrong(tmp_path, data, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(tmp_path, data=data)
