"""Every command under bad input, signals and pipes: one stderr line, exit != 0, no traceback."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gptoss_lite.cli import main

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
    return env


def _one_error_line(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ---- devices --------------------------------------------------------------------------------------------


def test_device_bogus_is_one_line(capsys):
    """--device bogus names the value and the device kinds that exist."""
    assert main(["generate", "x", "--model", "lite-tiny", "--device", "bogus"]) == 2
    _one_error_line(capsys, "--device 'bogus'", "cpu, cuda")


def test_device_cuda_on_cpu_only_torch_is_one_line(monkeypatch, capsys):
    """--device cuda on a CPU-only torch build says so and points at the CUDA build or --device cpu."""
    monkeypatch.setattr(torch.version, "cuda", None)
    for command in (["generate", "x", "--model", "lite-tiny"], ["passkey", "--model", "lite-tiny"]):
        assert main([*command, "--device", "cuda"]) == 2
        _one_error_line(capsys, "--device cuda", "CPU-only build", "--device cpu")


def test_device_cuda_without_a_visible_gpu_is_one_line(monkeypatch, capsys):
    """A CUDA build with no visible device says so instead of a torch traceback."""
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", "x", "--model", "lite-tiny", "--device", "cuda:0"]) == 2
    _one_error_line(capsys, "no CUDA device is visible")


# ---- generate values ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--seed", str(2**70)], f"--seed: seed={2**70}: must be in [0, {2**64 - 1}]"),
        (["--seed", "-1"], "--seed: seed=-1"),
        (["--stop", "-1"], "--stop -1: not a token id of this model; ids are 0..263"),
        (["--stop", "264"], "--stop 264"),
        (["--temperature", "nan"], "--temperature: temperature=nan"),
        (["--top-p", "1.5"], "--top-p: top_p=1.5"),
        (["--prefill-chunk", "0"], "--prefill-chunk=0: must be >= 1"),
        (["--threads", "0"], "--threads=0: must be in [1, 1024]"),
        (["--threads", str(10**6)], "--threads=1000000: must be in [1, 1024]"),
        (["--max-new-tokens", str(10**12)], "exceeds the configured maximum"),
    ],
)
def test_generate_bad_values_are_one_line(flags, needle, capsys):
    """Out-of-range generate flags name the flag, the value and the allowed range."""
    assert main(["generate", "x", "--model", "lite-tiny", *flags]) == 2
    _one_error_line(capsys, needle)


def test_tiny_temperature_samples_the_argmax_not_nan(capsys):
    """--temperature 1e-39 generates (the softmax stays finite) and equals greedy decoding."""
    runs = []
    for temp in ("1e-39", "0"):
        assert (
            main(
                [
                    "generate",
                    "hello",
                    "--model",
                    "lite-tiny",
                    "--max-new-tokens",
                    "6",
                    "--temperature",
                    temp,
                    "--seed",
                    "1",
                    "--json",
                    "--no-stop",
                ]
            )
            == 0
        )
        runs.append(json.loads(capsys.readouterr().out)["text"])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("temperature", [1e-39, 1e-300, 5e-324])
def test_sample_with_tiny_temperature_is_the_argmax(temperature):
    """sample() at a subnormal temperature returns the argmax rather than raising on inf/nan probabilities."""
    from gptoss_lite.sampling import SamplingParams, sample

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 10
    for top_p in (1.0, 0.9):
        got = sample(logits, SamplingParams(temperature=temperature, top_p=top_p), torch.Generator().manual_seed(1))
        assert torch.equal(got, logits.argmax(dim=-1))


def test_non_utf8_stdin_is_one_line(monkeypatch, capsys):
    """A prompt on stdin that is not UTF-8 names the byte and its offset."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ab\xffcd")))
    assert main(["generate", "--model", "lite-tiny"]) == 2
    _one_error_line(capsys, "standard input: not UTF-8 text (byte 0xff at offset 2)")


def test_non_utf8_prompt_argument_is_one_line(capsys):
    """A prompt argument with undecodable bytes (kept by Python as surrogates) names the byte."""
    assert main(["generate", "ab" + os.fsdecode(b"\xfe") + "c", "--model", "lite-tiny"]) == 2
    _one_error_line(capsys, "the prompt argument: not UTF-8 text (byte 0xfe at offset 2)")


# ---- models the tokenizer cannot serve -----------------------------------------------------------------


def test_big_vocab_preset_fails_before_building_the_model(monkeypatch, capsys):
    """--model gptoss-lite-502m (vocab 128,000) fails at once: the byte tokenizer could not decode its ids."""
    import gptoss_lite.checkpoint as checkpoint

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the tokenizer check")

    monkeypatch.setattr(checkpoint, "load_model", no_load)
    for command in (["generate", "x"], ["passkey"]):
        assert main([*command, "--model", "gptoss-lite-502m"]) == 2
        _one_error_line(capsys, "--model gptoss-lite-502m: vocab_size=128,000", "tokenizer.json")


def test_hf_directory_without_tokenizer_json_fails_before_loading(tmp_path, capsys):
    """An HF gpt-oss directory with a non-byte vocabulary and no tokenizer.json is refused up front."""
    from gptoss_lite.checkpoint import save_hf
    from gptoss_lite.fixtures import resolve_config
    from gptoss_lite.model import GPTOSS

    model = GPTOSS(resolve_config("gpt-oss-tiny").replace(vocab_size=512))
    save_hf(model, tmp_path / "hf")
    assert main(["generate", "x", "--model", str(tmp_path / "hf")]) == 2
    _one_error_line(capsys, "vocab_size=512", "has no tokenizer.json")


# ---- threads ------------------------------------------------------------------------------------------


def test_threads_flag_sets_torch_threads_and_is_reported(capsys):
    """generate --threads 1 runs with one intra-op thread and says so in --json."""
    before = torch.get_num_threads()
    try:
        assert main(["generate", "x", "--model", "lite-tiny", "--max-new-tokens", "1", "--threads", "1", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["threads"] == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_default_threads_respect_omp_num_threads_and_the_affinity_mask(monkeypatch):
    """OMP_NUM_THREADS wins when set; otherwise never more threads than CPUs this process may use."""
    from gptoss_lite.commands.common import available_cpus, default_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads()[0] == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    n, _ = default_threads()
    assert 1 <= n <= len(available_cpus())
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='lots': must be an int >= 1"):
        default_threads()


def test_default_threads_leave_busy_cores_alone(monkeypatch):
    """With every available core busy (load average), the default is one thread, not one per core."""
    import gptoss_lite.commands.common as common

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(common, "available_cpus", lambda: {0, 1, 2, 3})
    monkeypatch.setattr(common, "physical_cores", lambda cpus: 4)
    monkeypatch.setattr(common.os, "getloadavg", lambda: (4.2, 0.0, 0.0))
    assert common.default_threads()[0] == 1
    monkeypatch.setattr(common.os, "getloadavg", lambda: (0.1, 0.0, 0.0))
    assert common.default_threads()[0] == 4


def test_training_threads_do_not_follow_the_load(monkeypatch):
    """train's default thread count depends on the cores alone (its sums round by thread count)."""
    import gptoss_lite.commands.common as common

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(common, "available_cpus", lambda: {0, 1, 2, 3})
    monkeypatch.setattr(common, "physical_cores", lambda cpus: 4)
    monkeypatch.setattr(common.os, "getloadavg", lambda: (4.2, 0.0, 0.0))
    assert common.default_threads(load_aware=False)[0] == 4


# ---- pipes and signals -------------------------------------------------------------------------------


def test_generate_json_into_a_closed_pipe_exits_quietly(tmp_path):
    """`generate --json | head` with the reader gone: no BrokenPipeError traceback, exit 141."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gptoss_lite.cli",
            "generate",
            "x",
            "--model",
            "lite-tiny",
            "--max-new-tokens",
            "2",
            "--json",
            "--threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
    )
    proc.stdout.close()  # the reader leaves before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err


# ---- passkey ------------------------------------------------------------------------------------------


def test_passkey_bad_plot_path_fails_before_the_evaluation(monkeypatch, tmp_path, capsys):
    """--plot into a missing directory is refused before any model is loaded or trial is run."""
    import gptoss_lite.commands.common as common

    monkeypatch.setattr(
        common, "load_model_and_tokenizer", lambda args: (_ for _ in ()).throw(AssertionError("evaluation started"))
    )
    assert main(["passkey", "--plot", str(tmp_path / "missing" / "x.png")]) == 2
    _one_error_line(capsys, "--plot", "missing does not exist")
    assert main(["passkey", "--plot", str(tmp_path)]) == 2
    _one_error_line(capsys, "is a directory")
    assert not (tmp_path / "missing").exists()


def test_passkey_default_lengths_fit_the_model():
    """The default lengths are those of the default ladder that fit max_position_embeddings (16,384: 4096 8192)."""
    from gptoss_lite.commands.passkey import default_lengths

    assert default_lengths(16_384) == [4096, 8192]
    assert default_lengths(131_072 + 16) == [4096, 8192, 32768, 65536, 131072]
    assert default_lengths(1000) == [512]


def test_passkey_with_default_lengths_runs_on_a_16k_model(monkeypatch, capsys):
    """`passkey` without --lengths no longer fails at once on a 16,384-position model: it caps and says so."""
    from gptoss_lite.evals import passkey as evals

    seen = {}

    class Stop(Exception):
        pass

    def fake_run(self, progress=True):
        seen["lengths"] = self.lengths
        raise Stop

    monkeypatch.setattr(evals.PasskeyEvaluator, "run", fake_run)
    with pytest.raises(Stop):
        main(["passkey", "--model", "lite-tiny", "--trials", "1"])  # lite-tiny: 65,536 positions
    assert seen["lengths"] == [4096, 8192, 32768]
    assert "default lengths capped at the model's 65,536 positions" in capsys.readouterr().err


# ---- files ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b'{"garbage": ', b"\xff\xfe not utf-8"])
def test_corrupt_tokenizer_json_is_one_line(tmp_path, capsys, content):
    """A corrupt tokenizer.json in a model directory: one line naming the file (tokenizers raises bare Exception)."""
    from gptoss_lite.checkpoint import save_model
    from gptoss_lite.fixtures import resolve_config
    from gptoss_lite.model import GPTOSS

    save_model(GPTOSS(resolve_config("lite-tiny")), tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_bytes(content)
    assert main(["generate", "x", "--model", str(tmp_path / "m")]) == 2
    _one_error_line(capsys, "tokenizer.json: not a readable tokenizer.json")
