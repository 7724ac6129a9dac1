"""ModelConfig: the 502M parameter count (docs/model.md#the-502m-preset), presets by exact name, validation."""

import contextlib
import io
import json

import pytest
import torch

from gptoss_lite.config import PRESETS, ModelConfig, count_active_parameters, count_parameters, get_preset
from gptoss_lite.fixtures import resolve_config
from gptoss_lite.model import GPTOSS


def test_502m_parameter_count_on_meta():
    """gptoss-lite-502m has exactly 501,836,640 parameters, 247,032,672 active per token."""
    cfg = get_preset("gptoss-lite-502m")
    with torch.device("meta"):
        model = GPTOSS(cfg)
    assert sum(p.numel() for p in model.parameters()) == 501_836_640
    assert count_parameters(cfg) == 501_836_640
    assert count_active_parameters(cfg) == 247_032_672


@pytest.mark.parametrize("preset", ["lite-tiny", "gpt-oss-tiny", "gpt-oss-20b"])
def test_count_parameters_matches_model(preset):
    """count_parameters agrees with the built model for every kind of knob."""
    cfg = resolve_config(preset)
    with torch.device("meta"):
        model = GPTOSS(cfg)
    assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())


def test_unknown_preset_lists_valid_names():
    """An unknown preset name is an error listing the valid ones."""
    with pytest.raises(ValueError, match=r"unknown preset 'gpt-oss-7b'; valid presets: .*gptoss-lite-502m"):
        get_preset("gpt-oss-7b")


def test_product_presets_hold_no_test_fixtures():
    """config.PRESETS is the product table; a fixture name is not a preset and the error says where fixtures are."""
    assert set(PRESETS) == {"gptoss-lite-502m", "gpt-oss-20b", "gpt-oss-120b"}
    with pytest.raises(ValueError, match=r"unknown preset 'lite-tiny'.*gptoss_lite\.fixtures\.resolve_config"):
        get_preset("lite-tiny")


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(n_heads=6, n_kv_heads=4), ValueError, "n_heads=6 must be a multiple of n_kv_heads=4"),
        (dict(head_dim=7), ValueError, "head_dim=7: must be even"),
        (dict(top_k=9), ValueError, "top_k=9 must be <= n_experts=8"),
        (dict(activation="gelu"), ValueError, "activation='gelu'"),
        (dict(d_model=0), ValueError, "d_model=0: must be >= 1"),
        (dict(d_model=7.5), TypeError, "d_model=7.5: must be an int"),
        (dict(rope_factor=0.5), ValueError, "rope_factor=0.5"),
        (dict(sink_clamp=(5.0, -5.0)), ValueError, "sink_clamp"),
        (dict(layer_types=("full_attention",)), ValueError, "layer_types has 1 entries"),
        (dict(tie_embeddings=1), TypeError, "tie_embeddings=1: must be a bool"),
    ],
)
def test_bad_field_values(change, exc, match):
    """Bad field values are errors naming the field, its value and the limit."""
    with pytest.raises(exc, match=match):
        ModelConfig().replace(**change)


def test_from_dict_rejects_unknown_keys_and_round_trips():
    """from_dict(to_dict()) is the identity; an unknown key is named."""
    cfg = resolve_config("gpt-oss-tiny")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"unknown ModelConfig field\(s\) \['n_layer'\]"):
        ModelConfig.from_dict({**cfg.to_dict(), "n_layer": 3})


def test_with_rope_factor_stretches_positions_and_refuses_below_one():
    """A load-time YaRN override: the factor changes, positions up to twice the new target are accepted
    (never fewer than before), the other fields stay; a factor below 1 or not a number is refused."""
    cfg = resolve_config("lite-tiny")
    wide = cfg.with_rope_factor(512)
    assert wide.rope_factor == 512.0
    assert wide.max_position_embeddings == max(cfg.max_position_embeddings, 2 * cfg.rope_original_context * 512)
    assert wide.replace(rope_factor=cfg.rope_factor, max_position_embeddings=cfg.max_position_embeddings) == cfg
    assert cfg.with_rope_factor(1).max_position_embeddings == cfg.max_position_embeddings
    for bad in (0.5, float("nan"), True, "32"):
        with pytest.raises(ValueError, match="rope factor"):
            cfg.with_rope_factor(bad)


def test_rope_factor_reaches_the_model_through_every_loader():
    """load_model(rope_factor=), the engine's EngineConfig.rope_factor and the CLI's --rope-factor give the
    same stretched rotary tables; the engine refuses the knob for a model it did not load."""
    from gptoss_lite.checkpoint import default_model_source, load_model
    from gptoss_lite.cli import main
    from gptoss_lite.engine import LLM

    source = default_model_source()
    loaded = load_model(source, rope_factor=512)
    assert loaded.config.rope_factor == 512 and load_model(source).config.rope_factor != 512
    llm = LLM(source, kv_blocks=64, rope_factor=512)
    assert llm.model.config == loaded.config
    with pytest.raises(ValueError, match="rope_factor"):
        LLM(loaded, kv_blocks=64, rope_factor=64)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert (
            main(["passkey", "--rope-factor", "512", "--lengths", "300", "--trials", "1", "--json", "--no-progress"])
            == 0
        )
    result = json.loads(buf.getvalue())
    assert result["rope_factor"] == 512 and set(result["seconds"]) == {"300"} and result["peak_rss_bytes"]["300"] > 0
