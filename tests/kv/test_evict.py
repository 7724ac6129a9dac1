"""Eviction rules (gptoss_lite.kv.evict): heavy hitters and streaming sinks + recent window."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gptoss_lite.kv.evict import heavy_hitter_indices, streaming_keep_indices


def test_heavy_hitters_keep_top_mass_sorted():
    """The budget largest masses are kept, returned in ascending index order."""
    assert heavy_hitter_indices([0.1, 0.9, 0.3, 0.8, 0.05], 2) == (1, 3)


def test_heavy_hitters_ties_toward_lower_index():
    """Equal masses are broken toward the lower index."""
    assert heavy_hitter_indices([0.5, 0.5, 0.5, 0.5], 2) == (0, 1)
    assert heavy_hitter_indices([0.2, 0.7, 0.2, 0.7, 0.2], 3) == (0, 1, 3)


def test_heavy_hitters_full_budget_keeps_all():
    """A budget equal to the token count keeps every token."""
    assert heavy_hitter_indices([3.0, 1.0, 2.0], 3) == (0, 1, 2)


def test_heavy_hitters_accepts_tensor_like():
    """Anything with .tolist() (a torch tensor, a numpy array) is converted lazily."""
    torch = pytest.importorskip("torch")
    assert heavy_hitter_indices(torch.tensor([0.1, 0.4, 0.2]), 1) == (1,)


def test_streaming_keeps_sinks_and_recent():
    """Streaming keeps the first sink_tokens plus the most recent budget - sink_tokens."""
    assert streaming_keep_indices(10, 5, 2) == (0, 1, 7, 8, 9)
    assert streaming_keep_indices(10, 3, 3) == (0, 1, 2)
    assert streaming_keep_indices(10, 3, 0) == (7, 8, 9)


def test_streaming_keeps_all_when_it_fits():
    """A sequence no longer than the budget is kept whole."""
    assert streaming_keep_indices(4, 5, 2) == (0, 1, 2, 3)
    assert streaming_keep_indices(5, 5, 2) == (0, 1, 2, 3, 4)
    assert streaming_keep_indices(0, 5, 2) == ()


@pytest.mark.parametrize(
    "mass, budget, exc, match",
    [
        ([1.0, 2.0], 3, ValueError, "budget=3: larger than the 2 tokens"),
        ([1.0, 2.0], 0, ValueError, "budget=0: must be >= 1"),
        ([1.0, 2.0], True, TypeError, "budget=True"),
        ([1.0, 2.0], 1.0, TypeError, "budget=1.0"),
        ([1.0, math.nan], 1, ValueError, r"attention_mass\[1\]=nan"),
        ([math.inf], 1, ValueError, r"attention_mass\[0\]=inf"),
        ([1.0, -0.5], 1, ValueError, r"attention_mass\[1\]=-0.5: must be finite and >= 0"),
        ([1.0, True], 1, TypeError, r"attention_mass\[1\]=True"),
        ([[1.0], [2.0]], 1, TypeError, "the input must be 1-D"),
        ("abc", 1, TypeError, "expected a 1-D sequence"),
        (3.0, 1, TypeError, "expected a 1-D sequence"),
    ],
)
def test_heavy_hitter_validation(mass, budget, exc, match):
    """Heavy hitters reject a budget above the token count, bad budgets and non-finite/negative masses."""
    with pytest.raises(exc, match=match):
        heavy_hitter_indices(mass, budget)


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((10, 3, 4), ValueError, "sink_tokens=4: must be <= budget=3"),
        ((2, 3, 4), ValueError, "sink_tokens=4: must be <= budget=3"),
        ((-1, 3, 1), ValueError, "length=-1"),
        ((10, 0, 0), ValueError, "budget=0"),
        ((10, 3, -1), ValueError, "sink_tokens=-1"),
        ((True, 3, 1), TypeError, "length=True"),
        ((10, 3.0, 1), TypeError, "budget=3.0"),
    ],
)
def test_streaming_validation(args, exc, match):
    """Streaming rejects sinks above the budget, negative or zero sizes and non-ints."""
    with pytest.raises(exc, match=match):
        streaming_keep_indices(*args)


@given(st.lists(st.floats(0, 10, allow_nan=False).map(lambda x: round(x, 1)), min_size=1, max_size=60), st.data())
def test_heavy_hitters_property(masses, data):
    """Kept set has `budget` sorted indices; every kept mass beats every dropped one, ties to lower index."""
    budget = data.draw(st.integers(1, len(masses)))
    kept = heavy_hitter_indices(masses, budget)
    assert len(kept) == budget and list(kept) == sorted(set(kept))
    dropped = set(range(len(masses))) - set(kept)
    for i in kept:
        for j in dropped:
            assert masses[i] > masses[j] or (masses[i] == masses[j] and i < j)
    # Reference model: stable sort by descending mass.
    assert kept == tuple(sorted(sorted(range(len(masses)), key=lambda k: -masses[k])[:budget]))


@given(st.integers(0, 200), st.data())
def test_streaming_property(length, data):
    """Keeps min(length, budget) sorted indices: sinks [0, s) then the last budget - s, or everything."""
    budget = data.draw(st.integers(1, 100))
    sinks = data.draw(st.integers(0, budget))
    kept = streaming_keep_indices(length, budget, sinks)
    assert list(kept) == sorted(set(kept)) and len(kept) == min(length, budget)
    assert all(0 <= i < length for i in kept)
    if length > budget:
        assert kept[:sinks] == tuple(range(sinks))
        assert set(kept[sinks:]) == set(range(length - (budget - sinks), length))
    else:
        assert kept == tuple(range(length))


def test_streaming_priority_keeps_what_streaming_keep_indices_keeps():
    """The evicting cache's priority (tensors) never evicts a token the list rule keeps, and ranks
    the rest oldest first."""
    torch = pytest.importorskip("torch")
    from gptoss_lite.kv.evict import streaming_priority

    for length, budget, sinks in [(10, 5, 2), (10, 3, 0), (4, 5, 2), (9, 4, 4)]:
        pos = torch.arange(length)
        priority = streaming_priority(pos, length, budget, sinks)
        kept = tuple(i for i in range(length) if priority[i] == math.inf)
        assert kept == streaming_keep_indices(length, budget, sinks)
        evicted = [float(priority[i]) for i in range(length) if i not in kept]
        assert evicted == sorted(evicted)


def test_a_window_is_streaming_without_sink_tokens():
    """The engine's window (a KV group's window_start / release_target) is recent_start with no sinks."""
    from gptoss_lite.config import FULL
    from gptoss_lite.fixtures import resolve_config
    from gptoss_lite.kv.evict import recent_start
    from gptoss_lite.kv.groups import KVGroup
    from gptoss_lite.kv.paged_cache import PagedKVStore

    store = PagedKVStore(resolve_config("gpt-oss-tiny"), 64, 16, full_window=32)
    group = store.group(FULL)
    for n in (0, 5, 31, 32, 33, 100):
        assert group.window_start(n) == recent_start(n + 1, 32) == max(0, n - 31)
        assert group.release_target(n, slack=3) == max(0, recent_start(n + 1, 32) - 3)
        assert streaming_keep_indices(n + 1, 32, 0)[0] == group.window_start(n)
    assert isinstance(group, KVGroup)
