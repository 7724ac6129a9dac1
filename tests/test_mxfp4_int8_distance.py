"""benchmarks/mxfp4_int8_distance.py on the shipped model (experts rounded to MXFP4): the figures it
reports are the ones its own comparison gives, and the int8 path is measured, not the exact one twice."""

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("mxfp4_int8_distance", REPO / "benchmarks" / "mxfp4_int8_distance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_distance_of_the_int8_path_on_the_shipped_model(tmp_path, capsys):
    script = load_script()
    out = tmp_path / "distance.json"
    args = ["--prompts", "3", "--prompt-tokens", "200", "--new-tokens", "6", "--prompts-kind", "passkey"]
    assert script.main([*args, "--threads", "1", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["experts_rounded"] and got["prompts"] == 3 and got["steps"] == 18
    assert 0 < got["max_abs_dlogit"] <= got["max_abs_logit"]  # the two paths differ, by less than the logits
    assert 0 <= got["argmax_agreement"] <= 1 and 0 <= got["same_greedy_answer"] <= 3
    assert len(got["first_divergence"]) == 3 - got["same_greedy_answer"]
    printed = capsys.readouterr().out
    assert "experts rounded to MXFP4" in printed and f"{got['same_greedy_answer']}/3 prompts" in printed


def test_teacher_forcing_feeds_the_given_tokens():
    import torch

    from gptoss_lite.fixtures import resolve_config
    from gptoss_lite.model import GPTOSS

    script = load_script()
    model = GPTOSS(resolve_config("gpt-oss-tiny"))
    model.reset_parameters(0)
    model.use_mxfp4_experts().prepare_for_inference()
    prompt = list(range(5, 15))
    logits, tokens = script.decode(model, prompt, 4)
    assert tokens == logits.argmax(-1).tolist()  # greedy: each token is its step's argmax
    forced = [7, 8, 9, 10]
    again, fed = script.decode(model, prompt, 4, forced=forced)
    assert fed == forced and torch.equal(again[0], logits[0])  # the prompt's step does not depend on forcing
