"""HF config.json under bad values: a ValueError naming the HF key and the file, never a bare Python error."""

from __future__ import annotations

import json

import pytest

from gptoss_lite.checkpoint import config_from_hf, config_to_hf, load_model
from gptoss_lite.fixtures import resolve_config

HF_TINY = resolve_config("gpt-oss-tiny")


def _hf(**changes):
    hf = config_to_hf(HF_TINY)
    hf.update(changes)
    return hf


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"num_attention_heads": 0}, r"^num_attention_heads=0: must be >= 1"),
        ({"hidden_size": -64}, r"^hidden_size=-64: must be >= 1"),
        ({"num_key_value_heads": 0}, r"^num_key_value_heads=0: must be >= 1"),
        ({"num_key_value_heads": 3}, r"num_attention_heads=4 must be a multiple of num_key_value_heads=3"),
        ({"head_dim": 0}, r"^head_dim=0: must be >= 1"),
        ({"vocab_size": "264"}, r"^vocab_size='264': must be an integer"),
        ({"num_hidden_layers": True}, r"^num_hidden_layers=True: must be an integer"),
        ({"quantization_config": ["mxfp4"]}, r"^quantization_config=\['mxfp4'\]: must be an object"),
        ({"rope_scaling": [1, 2]}, r"rope_scaling/rope_parameters=\[1, 2\]: must be an object"),
        ({"rms_norm_eps": "tiny"}, r"^rms_norm_eps='tiny': must be a finite number"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be <= num_local_experts=4"),
        ({"layer_types": "full_attention"}, r"^layer_types='full_attention': must be a list"),
    ],
)
def test_bad_hf_values_name_the_hf_key(changes, match):
    """ZeroDivision, AttributeError and our field names are gone: each bad value is named by its HF key."""
    with pytest.raises(ValueError, match=match):
        config_from_hf(_hf(**changes))


def test_missing_yarn_factor_is_named():
    """A yarn rope block without 'factor' is a ValueError naming it, not a KeyError."""
    hf = _hf()
    for key in ("rope_scaling", "rope_parameters"):
        del hf[key]["factor"]
    with pytest.raises(ValueError, match=r"lacks 'factor'"):
        config_from_hf(hf)


def test_loading_an_hf_directory_names_the_config_file(tmp_path):
    """load_model on an HF directory with a bad config names config.json and the HF key."""
    (tmp_path / "config.json").write_text(json.dumps(_hf(num_attention_heads=0)))
    with pytest.raises(ValueError, match=r"config.json: num_attention_heads=0: must be >= 1"):
        load_model(tmp_path)


def test_cli_bad_hf_config_is_one_line(tmp_path, capsys):
    """`generate --model HFDIR` with a bad HF config: one line naming the file, the key and the limit."""
    from gptoss_lite.cli import main

    (tmp_path / "config.json").write_text(json.dumps(_hf(quantization_config=["mxfp4"])))
    assert main(["generate", "x", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json: quantization_config=" in err and "Traceback" not in err
