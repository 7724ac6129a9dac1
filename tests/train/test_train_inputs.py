"""Train config files and the train command under bad input: one clear error, nothing written ."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

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


@pytest.mark.parametrize(
    "name, text, match",
    [
        ("bad.yaml", "model: {preset: lite-tiny\n", r"bad.yaml': not valid YAML at line 2 column 1"),
        ("bad.json", '{"model": }', r"bad.json': not valid JSON: Expecting value: line 1 column 11"),
        ("bin.yaml", b"model: \xff\n", r"bin.yaml': not UTF-8 text \(byte 0xff at offset 7\)"),
        (
            "betas.yaml",
            "model: {preset: lite-tiny}\noptimizer: {betas: 0.9}\n",
            r"optimizer.betas=0.9: must be two numbers",
        ),
        ("list.yaml", "- 1\n- 2\n", "must be a mapping of sections"),
        ("model.yaml", "model: lite-tiny\n", "section 'model' must be a mapping"),
    ],
)
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


# ---- the train command and resume ---------------------------------------------------------------------


SRC = str(Path(__file__).resolve().parents[2] / "src")


def tiny(out_dir, **changes) -> TrainConfig:
    """lite-tiny with 2 layers on 224-token sequences, a checkpoint every 2 steps: a run of 4 steps takes ~1 s."""
    data = {
        "model": {"preset": "lite-tiny", "n_layers": 2},
        "data": {"seq_len": 224, "batch_size": 2, "seed": 7},
        "optimizer": {"lr": 3e-3},
        "schedule": {"warmup_steps": 1, "total_steps": 4},
        "checkpoint": {"out_dir": str(out_dir), "every_n_steps": 2, "keep": 3},
        "logging": {"every_n_steps": 1},
        "device": "cpu",
        **changes,
    }
    return TrainConfig.from_dict(data)


def run_train(cfg, **kwargs):
    from gptoss_lite.train.loop import train

    return train(cfg, progress=False, **kwargs)


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_train_out_naming_a_file_changes_nothing(tmp_path, capsys):
    """`train --out FILE` (or a path under a file) is one error line and creates nothing."""
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(tiny(tmp_path / "ignored").to_dict()))
    (tmp_path / "afile").write_text("keep me")
    before = _tree(tmp_path)
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub" / "run"):
        assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "afile" in err and "Traceback" not in err
    assert _tree(tmp_path) == before and not (tmp_path / "ignored").exists()


def _two_checkpoints(tmp_path):
    cfg = tiny(tmp_path / "run")
    run_train(cfg, max_steps=4)  # checkpoints at steps 2 and 4
    return cfg, tmp_path / "run" / "checkpoints"


@pytest.mark.parametrize(
    "damage, match",
    [
        (
            lambda d: (d / "optimizer.safetensors").write_bytes((d / "optimizer.safetensors").read_bytes()[:100]),
            r"optimizer.safetensors: not a readable safetensors file",
        ),
        (
            lambda d: (d / "rng.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "),
            r"rng.safetensors",
        ),
        (
            lambda d: (d / "trainer_state.json").write_text(
                json.dumps({k: v for k, v in json.loads((d / "trainer_state.json").read_text()).items() if k != "step"})
            ),
            r"trainer_state.json: 'step' is None",
        ),
        (lambda d: (d / "trainer_state.json").write_text("{not json"), r"trainer_state.json: unreadable trainer state"),
        (lambda d: (d / "model.safetensors").write_bytes(b""), r"model.safetensors: not a readable safetensors"),
    ],
)
def test_resume_with_only_a_corrupt_checkpoint_is_one_line(tmp_path, capsys, damage, match):
    """A truncated optimizer/rng file or a state without step: one error line naming the file, disk unchanged."""
    cfg = tiny(tmp_path / "run", checkpoint={"out_dir": str(tmp_path / "run"), "every_n_steps": 2, "keep": 1})
    run_train(cfg, max_steps=2)
    damage(tmp_path / "run" / "checkpoints" / "step_0000002")
    before = _tree(tmp_path / "run")
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert main(["train", "--config", str(path), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    error_lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(error_lines) == 1 and "Traceback" not in err
    assert pytest.importorskip("re").search(match, error_lines[0]), error_lines[0]
    assert _tree(tmp_path / "run") == before


def test_resume_falls_back_to_the_previous_checkpoint_and_reaches_the_same_weights(tmp_path, capsys):
    """A corrupt newest checkpoint is skipped with a warning; training redone from the previous one ends identical."""
    from safetensors.torch import load_file

    reference = run_train(tiny(tmp_path / "ref"), max_steps=4)
    cfg, ckpts = _two_checkpoints(tmp_path)
    newest = ckpts / "step_0000004"
    (newest / "optimizer.safetensors").write_bytes((newest / "optimizer.safetensors").read_bytes()[:64])
    capsys.readouterr()
    resumed = run_train(cfg, resume=True)
    err = capsys.readouterr().err
    assert "warning: checkpoint" in err and "step_0000004 is unusable" in err
    assert resumed.start_step == 2 and resumed.losses == reference.losses[2:]
    got, want = (load_file(str(d / "final" / "model.safetensors")) for d in (tmp_path / "run", tmp_path / "ref"))
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_resume_drops_a_partial_last_metrics_line(tmp_path, capsys):
    """A metrics.jsonl cut mid-line by a crash does not block resume; the partial line is dropped with a warning."""
    cfg, _ = _two_checkpoints(tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 5, "lo')
    run_train(cfg.replace(schedule=cfg.schedule.__class__(warmup_steps=1, total_steps=5)), resume=True)
    assert "dropped a partial last line" in capsys.readouterr().err
    assert [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_resume_with_a_damaged_middle_metrics_line_names_file_and_line(tmp_path):
    """A damaged metrics line that is not the last one is an error naming the file and the line number."""
    cfg, _ = _two_checkpoints(tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines[1] = "garbage"
    metrics.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a metrics line"):
        run_train(cfg, resume=True)


def test_ctrl_c_during_training_is_one_line_with_a_resume_hint(tmp_path):
    """SIGINT during `train` exits 130 with 'interrupted' and the newest checkpoint, no KeyboardInterrupt traceback."""
    cfg = tiny(
        tmp_path / "run",
        schedule={"warmup_steps": 1, "total_steps": 10_000},
        checkpoint={"out_dir": str(tmp_path / "run"), "every_n_steps": 1, "keep": 2},
    )
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg.to_dict()))
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gptoss_lite.cli", "train", "--config", str(path), "--no-progress", "--threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        # NOTE: a runner started in the background inherits SIGINT ignored, and Python installs its
        # KeyboardInterrupt handler only over the default disposition: restore it for the child.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not list((tmp_path / "run").glob("checkpoints/step_*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    err = err.decode()
    assert proc.returncode == 130, err
    assert "interrupted; the newest checkpoint is" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "text, match",
    [
        ("1: 2\nmodel: {preset: lite-tiny}\n", r"train config: key 1 is not a name"),
        ("model: {preset: lite-tiny}\ndata: {7: 1}\n", r"section 'data': key 7 is not a name"),
        ("model: {preset: lite-tiny, 3: 4}\n", r"section 'model': key 3 is not a name"),
    ],
)
def test_non_string_yaml_keys_are_named(tmp_path, text, match):
    """A YAML key that parses as a number is named, not a '<' not supported TypeError from sorting."""
    with pytest.raises(ValueError, match=match):
        load_train_config(_write(tmp_path / "k.yaml", text))


def test_config_path_that_is_a_directory_says_so(tmp_path):
    """--config DIR says it is a directory instead of claiming it does not exist."""
    with pytest.raises(ValueError, match="is a directory; pass --config PATH to a YAML or JSON file"):
        load_train_config(tmp_path)


def test_a_second_trainer_on_the_same_directory_is_refused(tmp_path):
    """While one run holds out_dir, another train() into it fails at once naming the holder; the lock dies with it."""
    import fcntl

    cfg = tiny(tmp_path / "run")
    (tmp_path / "run").mkdir()
    with open(tmp_path / "run" / ".train.lock", "a+") as held:
        held.write("4242\n")
        held.flush()
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match=r"another train run \(pid 4242\) is writing this directory"):
            run_train(cfg, max_steps=1)
        assert not (tmp_path / "run" / "checkpoints").exists()
    assert run_train(cfg, max_steps=1).end_step == 1  # released: the next run proceeds
