"""Shared drivers for the engine tests: run requests arriving at given steps, compare with generate()."""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, field

import pytest
import torch

from gptoss_lite.checkpoint import default_model_source, load_model
from gptoss_lite.engine import LLM, RequestOutput, SamplingParams
from gptoss_lite.engine.runner import ModelRunner
from gptoss_lite.generation import generate

NEAR_TIE = 1e-4  # the bound: top-2 margin and logit drift of a tolerated flip


@pytest.fixture(scope="session")
def models():
    """Prepared models by name, loaded once (random-weight fixtures are seeded, so reproducible)."""
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "preset with RANDOM weights"
                cache[name] = load_model(default_model_source() if name == "shipped" else name)
        return cache[name]

    return get


class RecordingRunner(ModelRunner):
    """A runner that keeps every sampled row's logits per request, to explain a differing token."""

    def __init__(self, model, store, decoder=None):
        super().__init__(model, store, decoder)
        self.logits: dict[str, list[torch.Tensor]] = {}

    _burst: list | None = None  # the requests of the decode burst running, in row order

    def forward(self, step):
        logits, samplers = super().forward(step)
        self._keep(logits, samplers)
        return logits, samplers

    def decode_burst(self, step):
        self._burst = [entry.request for entry in step.scheduled]
        try:
            return super().decode_burst(step)
        finally:
            self._burst = None

    def _compiled(self, input_ids, static):
        logits = super()._compiled(input_ids, static)
        if self._burst is not None:  # each step of a burst (rows past a request's stop are kept too)
            self._keep(logits, self._burst)
        return logits

    def _keep(self, logits, samplers):
        for row, request in zip(logits, samplers):
            self.logits.setdefault(request.request_id, []).append(row.float().clone())


def recording(llm: LLM) -> RecordingRunner:
    llm.runner = RecordingRunner(llm.model, llm.runner.store, llm.runner.decoder)
    return llm.runner


@dataclass
class Workload:
    prompts: list[list[int]]
    params: list[SamplingParams]
    arrivals: list[int]  # step at which each request is added
    aborts: dict[int, int] = field(default_factory=dict)  # request index -> step at which it is aborted


def random_workload(rng: random.Random, vocab: int, n: int, max_len: int, max_new: int, spread: int) -> Workload:
    lengths = [1, max_len] + [rng.randint(1, max_len) for _ in range(n - 2)]
    prompts = [[rng.randrange(vocab) for _ in range(length)] for length in lengths]
    params = [SamplingParams(max_tokens=rng.randint(1, max_new), temperature=0, ignore_eos=True) for _ in prompts]
    return Workload(prompts, params, [rng.randrange(spread) for _ in prompts])


def run(llm: LLM, work: Workload) -> dict[int, RequestOutput]:
    """Drive the engine step by step; requests join at their arrival step. Returns finished outputs by
    request index (aborted ones are absent)."""
    ids: dict[str, int] = {}
    done: dict[int, RequestOutput] = {}
    step = 0
    while len(ids) < len(work.prompts) or llm.has_unfinished():
        for i, arrival in enumerate(work.arrivals):
            if arrival == step:
                ids[llm.add_request(work.prompts[i], work.params[i])] = i
        for i, at in work.aborts.items():
            if at == step:
                llm.abort(next(r for r, j in ids.items() if j == i))
        for out in llm.step():
            if out.finished:
                done[ids[out.request_id]] = out
        step += 1
        assert step < 100_000, "engine does not finish"
    return done


def assert_same_as_generate(model, llm: LLM, work: Workload, done: dict[int, RequestOutput], *, exact: bool) -> int:
    """Every finished request's tokens equal generate() on that request alone. With exact=False a
    difference is accepted only as a near-tie: the engine's logits within NEAR_TIE of generate()'s up to
    the first differing token, whose top-2 margin there is below NEAR_TIE. Returns the near-ties seen."""
    near_ties = 0
    runner = llm.runner
    for i, out in done.items():
        prompt, params = work.prompts[i], work.params[i]
        ref = generate(model, torch.tensor([prompt]), max_new_tokens=params.max_tokens, temperature=0)
        want = ref[0, len(prompt) :].tolist()
        if out.token_ids == want:
            continue
        assert not exact, f"request {i} (prompt {len(prompt)} tokens): engine {out.token_ids} != generate {want}"
        assert isinstance(runner, RecordingRunner), "record the engine's logits to judge a difference"
        d = next(j for j, (a, b) in enumerate(zip(out.token_ids, want)) if a != b)
        seq = torch.tensor([prompt + want[:d]])
        with torch.inference_mode():
            ref_logits = model(seq).logits[0, len(prompt) - 1 :].float()  # (d + 1, V)
        ours = torch.stack(runner.logits[out.request_id][: d + 1])
        drift = (ours - ref_logits).abs().max().item()
        top2 = ref_logits[d].topk(2).values
        margin = (top2[0] - top2[1]).item()
        assert drift < NEAR_TIE and margin < NEAR_TIE, (
            f"request {i}: token {d} differs and it is not a near-tie (logit drift {drift:.2e}, top-2 margin "
            f"{margin:.2e})"
        )
        near_ties += 1
    return near_ties


def assert_nothing_leaks(llm: LLM) -> None:
    """The pools' own checks hold and, once the prefix cache lets go, every block is free."""
    llm.validate()
    assert not llm.has_unfinished()
    llm.clear_prefix_cache()
    llm.validate()
    assert llm.all_blocks_free(), llm.kv.usage().blocks_used
