"""The engine's draft model on its own paged blocks (`engine/drafting.py`): every drafting request in
one forward per draft token, each draft the draft model's own greedy continuation of the request's
tokens, whatever was accepted before; blocks released with the request."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gptoss_lite.checkpoint import load_model
from gptoss_lite.engine import LLM, SamplingParams
from gptoss_lite.engine.config import EngineConfig
from gptoss_lite.engine.drafting import PagedDrafter
from gptoss_lite.filler import sentence_generator
from gptoss_lite.generation import generate
from gptoss_lite.speculative import DraftModel
from gptoss_lite.tokenizer import ByteTokenizer
from tests.engine.conftest import Workload, assert_nothing_leaks, run

LITE_256 = Path(__file__).resolve().parents[2] / "models" / "lite-256"


@pytest.fixture(scope="module")
def draft_model():
    """The 256-token model: trained, the shipped model's vocabulary, a real draft for it."""
    return load_model(LITE_256)


def text_prompts(rng: random.Random, n: int, longest: int) -> list[list[int]]:
    """Prompts of the training filler (clear greedy margins), 1 to `longest` tokens after BOS."""
    tok, gen = ByteTokenizer(), sentence_generator("varied")
    out = []
    for _ in range(n):
        text = " ".join(gen(rng) for _ in range(40))
        out.append(tok.encode_prompt(text)[: rng.randint(2, longest)])
    return out


def greedy(model, tokens: list[int], k: int) -> list[int]:
    out = generate(model, torch.tensor([tokens]), k, temperature=0)
    return out[0, len(tokens) :].tolist()


def test_batched_drafts_are_the_draft_models_greedy_tokens(draft_model):
    """Six requests drafted together for eight rounds, each round accepting a random share of its draft
    and adding a token of its own (as a verification does): every draft equals the draft model's greedy
    continuation of the request's tokens computed alone, while the sequences are cut back, catch up in
    chunks and slide past the 128-token window; each round runs one catch-up forward per chunk of
    rows and one forward per further draft token, not one per request."""
    rng = random.Random(0)
    cfg = EngineConfig(block_size=16, max_batch_tokens=96, max_running=8)
    drafter = PagedDrafter(DraftModel(draft_model, k=4), cfg, full_blocks=300, max_model_len=4096)
    requests = [SimpleNamespace(request_id=f"r{i}", all_token_ids=p) for i, p in enumerate(text_prompts(rng, 6, 300))]
    for _ in range(8):
        wants = [(r, rng.randint(1, 4)) for r in requests]
        held = {
            r.request_id: len(drafter._seqs[r.request_id].held) if r.request_id in drafter._seqs else 0
            for r in requests
        }
        catch_up = sum(len(r.all_token_ids) - min(held[r.request_id], len(r.all_token_ids) - 1) for r in requests)
        before = drafter.forwards
        drafts = drafter.draft(wants)
        assert drafter.forwards - before <= -(-catch_up // cfg.max_batch_tokens) + max(k for _, k in wants) - 1
        for request, k in wants:
            assert drafts[request.request_id] == greedy(draft_model, request.all_token_ids, k), request.request_id
            kept = drafts[request.request_id][: rng.randint(0, k)]
            request.all_token_ids = [*request.all_token_ids, *kept, rng.randrange(32, 127)]
    drafter.validate({r.request_id for r in requests})
    drafter.retain(["r0"])  # the others left the running set
    assert set(drafter._seqs) == {"r0"}
    drafter.forget("r0")
    assert drafter.all_free


def test_a_full_draft_pool_drafts_less_and_leaks_nothing(draft_model):
    """A pool too small for every request's catch-up: the requests it cannot hold get no draft this
    step (drafting is optional) and hold no block; the others draft as usual."""
    rng = random.Random(1)
    cfg = EngineConfig(block_size=16, max_batch_tokens=512, max_running=4)
    drafter = PagedDrafter(DraftModel(draft_model, k=3), cfg, full_blocks=24, max_model_len=384)
    requests = [SimpleNamespace(request_id=f"r{i}", all_token_ids=p) for i, p in enumerate(text_prompts(rng, 4, 300))]
    for request in requests:
        request.all_token_ids = (request.all_token_ids * 3)[:300]
    drafts = drafter.draft([(r, 3) for r in requests])
    assert 0 < len(drafts) < len(requests)
    for rid, draft in drafts.items():
        request = next(r for r in requests if r.request_id == rid)
        assert draft == greedy(draft_model, request.all_token_ids, len(draft))
    assert set(drafter._seqs) == set(drafts)
    drafter.retain([])
    assert drafter.all_free


@pytest.mark.parametrize("kv_blocks", [60, 2000])
def test_engine_drafts_in_batches_and_keeps_outputs(models, draft_model, kv_blocks):
    """LLM(speculate=DraftModel(...)), with a pool tight enough to preempt and with a roomy one: the same
    tokens as without speculation and nothing left held in either pool; with room for every request,
    fewer draft forwards than drafts (they are batched)."""
    model = models("shipped")
    rng = random.Random(5)
    prompts = text_prompts(rng, 12, 200)
    params = [SamplingParams(max_tokens=rng.randint(20, 80), temperature=0, ignore_eos=True) for _ in prompts]
    work = Workload(prompts, params, [rng.randrange(3) for _ in prompts])
    engine = dict(kv_blocks=kv_blocks, max_batch_tokens=128, max_running=12)
    plain = run(LLM(model, **engine), work)
    llm = LLM(model, speculate=DraftModel(draft_model, k=4), **engine)
    spec = run(llm, work)
    assert {i: o.token_ids for i, o in spec.items()} == {i: o.token_ids for i, o in plain.items()}
    stats = llm.stats()
    assert stats.spec_verifications > 0 and stats.spec_accepted > 0
    if kv_blocks == 60:
        assert stats.preemptions > 0, "the pool was meant to force preemption"
    else:
        # one request drafting alone runs k forwards a draft (a catch-up, then k - 1 tokens)
        assert llm._drafter.forwards < stats.spec_verifications, (llm._drafter.forwards, stats.spec_verifications)
    assert_nothing_leaks(llm)
