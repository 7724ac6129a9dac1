"""One prompt string, one reading: `gptoss-lite generate`, the engine's `LLM.generate`, the server's
/v1/completions and the passkey harness tokenise a passkey prompt to the same ids (BOS first, the
byte model's rule) on the shipped demo model in float32, and the logprobs of the generated tokens
agree with each other and with the model's own teacher-forced log_softmax
(docs/checkpoints.md#the-bos-rule).

NOTE: the demo model is sure of the passkey's tokens (logprob > -2e-3), so their own logprobs move
by only ~2e-4 without the BOS; the top-5 alternatives move by 0.1-0.8, so they are compared too.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from gptoss_lite.checkpoint import default_model_source, load_model
from gptoss_lite.cli import main
from gptoss_lite.engine import LLM, SamplingParams
from gptoss_lite.evals.passkey import PasskeyEvaluator, build_passkey_prompt
from gptoss_lite.server import create_app
from gptoss_lite.server.background import BackgroundServer
from gptoss_lite.tokenizer import load_tokenizer

LENGTH, KEY, DEPTH = 256, "52718", 0.5  # the demo model's training context; a middle needle
NEW_TOKENS = 8  # " 52718." and one more, stop tokens ignored on every path
TOL = 1e-4  # fp32 logprobs through different caches and batch shapes
TOP = 5  # alternatives per token: the most the completions API gives


@pytest.fixture(scope="module")
def source():
    return default_model_source()


@pytest.fixture(scope="module")
def prompt(source) -> str:
    return build_passkey_prompt(LENGTH, KEY, DEPTH, load_tokenizer(source))


@pytest.fixture(scope="module")
def engine_run(source, prompt):
    """The engine's greedy output for the prompt, with every generated token's logprob and top 5."""
    llm = LLM(source, dtype=torch.float32)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=TOP)
    return llm.generate([prompt], params)[0]


@torch.no_grad()
def teacher_forced(source, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """(len(generated), V): log_softmax of one dense fp32 forward over prompt + generated, at the
    position before each generated token."""
    model = load_model(source, dtype=torch.float32)
    logits = model(torch.tensor([prompt_ids + generated])).logits[0].float()  # (T, V)
    return torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)  # (len(generated), V)


def test_every_path_reads_the_prompt_the_same_way(source, prompt, engine_run, capsys):
    """The CLI, the engine, the server and the passkey harness give the prompt the same ids, BOS first;
    the CLI and the engine generate the same tokens; the engine's and the server's logprobs agree
    within 1e-4."""
    tok = load_tokenizer(source)
    ids = engine_run.prompt_token_ids
    assert ids == tok.encode_prompt(prompt) and ids[0] == tok.bos_id and tok.add_bos
    generated = engine_run.token_ids
    assert len(generated) == NEW_TOKENS and [g.token_id for g in engine_run.logprobs] == generated

    # (a) the CLI, greedy, stop tokens off like the engine's ignore_eos
    argv = ["generate", prompt, "--model", str(source), "--dtype", "float32", "--threads", "1"]
    argv += ["--temperature", "0", "--max-new-tokens", str(NEW_TOKENS), "--no-stop", "--json"]
    assert main(argv) == 0
    cli = json.loads(capsys.readouterr().out)
    assert cli["prompt_token_ids"] == ids and cli["token_ids"] == generated

    # (c) the server: the ids its handler prepared, and its logprobs
    llm = LLM(source, dtype=torch.float32)
    prepared = []
    prepare = llm.prepare
    llm.prepare = lambda prompt, sampling=None: prepared.append(prepare(prompt, sampling)) or prepared[-1]
    with BackgroundServer(create_app(llm)) as live:
        body = {"model": live.state.model_name, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
        r = httpx.post(live.url + "/v1/completions", json={**body, "ignore_eos": True, "logprobs": TOP}, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [p.token_ids for p in prepared] == [ids] and answer["usage"]["prompt_tokens"] == len(ids)
    assert answer["choices"][0]["text"] == engine_run.text
    served = answer["choices"][0]["logprobs"]
    assert served["token_logprobs"] == pytest.approx([g.logprob for g in engine_run.logprobs], abs=TOL)
    text = lambda t: tok.token_bytes(t).decode("utf-8", errors="replace")  # noqa: E731 - as the API shows a token
    for top, g in zip(served["top_logprobs"], engine_run.logprobs, strict=True):
        assert top == pytest.approx({text(t): v for t, v in g.top}, abs=TOL)

    # (d) the passkey harness
    harness = PasskeyEvaluator(load_model(source, dtype=torch.float32), tok, lengths=[LENGTH], n_trials=1)
    assert harness.prompt_ids(LENGTH, KEY, DEPTH) == ids


def test_engine_logprobs_are_the_models_teacher_forced_log_softmax(source, prompt, engine_run):
    """The engine's logprobs of its generated tokens and their top 5 equal log_softmax of one dense
    forward over prompt + generated within 1e-4; the same forward without the BOS moves the top 5 by
    far more than that, so the tolerance tells a prompt read without BOS apart."""
    ids, generated = engine_run.prompt_token_ids, engine_run.token_ids
    want = teacher_forced(source, ids, generated)  # (NEW_TOKENS, V)
    steps = torch.arange(len(generated))
    assert [g.logprob for g in engine_run.logprobs] == pytest.approx(want[steps, generated].tolist(), abs=TOL)
    top = want.topk(TOP, dim=-1)
    assert [[t for t, _ in g.top] for g in engine_run.logprobs] == top.indices.tolist()
    got = torch.tensor([[v for _, v in g.top] for g in engine_run.logprobs])  # (NEW_TOKENS, TOP)
    torch.testing.assert_close(got, top.values, atol=TOL, rtol=0)
    without_bos = teacher_forced(source, ids[1:], generated)
    moved = (want.gather(1, top.indices) - without_bos.gather(1, top.indices)).abs()  # (NEW_TOKENS, TOP)
    assert moved.max() > 100 * TOL
