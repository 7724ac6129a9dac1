"""Train config files and the train command under bad input: one clear error, nothing written (issue 11)."""

from __future__ import annotations

import json

import pytest

from gptoss_lite.cli import main
from gptoss_lite.train.config import TrainConfig, load_train_config


def _write(path, text: str | bytes):
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def test_config_without_model_section_is_an_error_not_the_502m_preset():
    """A config with no model: section is refused instead of silently training the 502M preset."""
    with pytest.raises(ValueError, match=r"no 'model' section.*preset: lite-tiny.*502M"):
        TrainConfig.from_dict({"data": {"seq_len": 256}})


def test_model_section_without_preset_must_give_every_size_field():
    """Fields without a preset are not completed from the 502M defaults: the missing ones are named."""
    with pytest.raises(ValueError, match=r"lacks \['vocab_size', 'n_layers'"):
        TrainConfig.from_dict({"model": {"d_model": 64}})


@pytest.mark.parametrize("name, text, match", [
    ("bad.yaml", "model: {preset: lite-tiny\n", r"bad.yaml': not valid YAML at line 2 column 1"),
    ("bad.json", '{"model": }', r"bad.json': not valid JSON: Expecting value: line 1 column 11"),
    ("bin.yaml", b"model: \xff\n", r"bin.yaml': not UTF-8 text \(byte 0xff at offset 7\)"),
    ("betas.yaml", "model: {preset: lite-tiny}\noptimizer: {betas: 0.9}\n",
     r"optimizer.betas=0.9: must be two numbers"),
    ("list.yaml", "- 1\n- 2\n", "must be a mapping of sections"),
    ("model.yaml", "model: lite-tiny\n", "section 'model' must be a mapping"),
])
def test_bad_config_files_name_the_file_and_the_problem(tmp_path, name, text, match):
    """Malformed YAML/JSON, non-UTF-8 bytes and mistyped values name the file and what is wrong."""
    with pytest.raises(ValueError, match=match):
        load_train_config(_write(tmp_path / name, text))


def test_cli_bad_config_is_one_line_without_traceback(tmp_path, capsys):
    """`train --config` on malformed YAML exits 2 with a single stderr line naming the file."""
    path = _write(tmp_path / "bad.yaml", "model: [\n")
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.yaml" in err and "Traceback" not in err
