"""gptoss_lite.fixtures: tiny test/benchmark configs live apart from the product presets, one lookup finds both."""

import pytest

from gptoss_lite.config import PRESETS
from gptoss_lite.fixtures import FIXTURES, resolve_config


def test_fixture_table_holds_the_test_and_benchmark_configs():
    """The three tiny configs are fixtures, and no fixture name shadows a product preset."""
    assert set(FIXTURES) == {"lite-tiny", "gpt-oss-tiny", "gpt-oss-bench-20m"}
    assert not set(FIXTURES) & set(PRESETS)


def test_resolve_config_finds_presets_then_fixtures():
    """resolve_config returns the product preset or the fixture of that exact name."""
    assert resolve_config("gptoss-lite-502m") is PRESETS["gptoss-lite-502m"]
    assert resolve_config("lite-tiny") is FIXTURES["lite-tiny"]
    assert resolve_config("gpt-oss-bench-20m").sliding_window == 128


def test_unknown_name_lists_presets_and_fixtures_apart():
    """An unknown name is a ValueError listing product presets and test fixtures under their own labels."""
    with pytest.raises(
        ValueError,
        match=r"unknown preset 'lite-small'; valid presets: gpt-oss-120b, "
        r"gpt-oss-20b, gptoss-lite-502m; test fixtures: gpt-oss-bench-20m, "
        r"gpt-oss-tiny, lite-tiny$",
    ):
        resolve_config("lite-small")
