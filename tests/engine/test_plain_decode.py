"""The engine's decode fast paths against its general ones: a step of plain decode rows goes to the
compiled step through `paged_batch.plain_decode` (not a `PagedBatch` and its `static()`), and a decode
token that fits in room its request already holds is appended by `PagedKVPool.append_in_place` (not
the general release / count / evict / append of `KVManager.allocate`). Both must give exactly what the
general paths give: the same tensors for the compiled step, the same plans and pools, the same tokens."""

import copy
import random
import re

import pytest
import torch

from gptoss_lite.engine import LLM, SamplingParams
from gptoss_lite.engine import kv_manager as kv_manager_module
from gptoss_lite.kv.block_pool import PagedKVPool
from tests.engine.conftest import random_workload, run


def _compiled(model, **kwargs) -> LLM:
    return LLM(copy.deepcopy(model).prepare_for_inference(compile_decode=True), **kwargs)


def _same_state(fast, general) -> None:
    """Two `PagedDecode`s hold the same tensors for the compiled step (the general one's rows in its
    own order, which for plain decode rows is theirs)."""
    assert fast.identity and general.identity
    assert torch.equal(general.order, torch.arange(len(general.order)))
    assert torch.equal(general.real, torch.arange(len(general.real)))
    assert torch.equal(fast.positions, general.positions)
    assert fast.kinds == general.kinds and fast._horizon == general._horizon
    for name in ("tables", "slots", "distances"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.keys() == b.keys()
        for kind in a:
            assert a[kind].dtype == b[kind].dtype and a[kind].is_contiguous() == b[kind].is_contiguous()
            assert torch.equal(a[kind], b[kind]), (name, kind)
    assert fast.quantized is None and general.quantized is None


@pytest.mark.parametrize(
    "knobs", [{}, {"full_window": 48, "enable_prefix_caching": False}], ids=["whole context", "full-layer window"]
)
def test_plain_decode_builds_what_the_batch_builds(models, knobs):
    """Every step the fast path serves, checked against `build_batch` + `static()` on the same step,
    over requests longer than the sliding window (their tables start past released blocks), arriving
    at random, some from the prefix cache."""
    model = models("gpt-oss-tiny")
    # one token a round: every decode step goes through forward (bursts: tests/engine/test_decode_burst.py)
    llm = _compiled(model, kv_blocks=400, max_batch_tokens=128, max_running=8, decode_steps=1, **knobs)
    runner, forward = llm.runner, llm.runner.forward
    served = []

    def both(step):
        fast = runner.plain_decode(step)
        if fast is not None:
            ids, state, samplers = fast
            general_ids, batch, general_samplers = runner.build_batch(step)  # changes no request
            _same_state(state, batch.static())
            assert torch.equal(ids, general_ids) and samplers == general_samplers
            served.append(len(samplers))
        return forward(step)

    runner.forward = both
    work = random_workload(random.Random(11), model.config.vocab_size, 10, 200, 90, 6)
    work.prompts[3] = work.prompts[2][:150] + work.prompts[3][:20]  # a prefix hit
    run(llm, work)
    assert len(served) > 30 and max(served) > 1


def test_steps_the_fast_path_leaves_to_the_batch(models):
    """Prompt chunks, drafts and a lone final prompt token are not plain decode rows."""
    model = models("gpt-oss-tiny")
    llm = _compiled(model, kv_blocks=200, max_batch_tokens=64)
    llm.add_request(list(range(1, 40)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    step = llm.scheduler.schedule()
    assert llm.runner.plain_decode(step) is None  # the prompt's first chunk
    eager = LLM(model, kv_blocks=200, compile_decode=False)
    eager.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
    eager.step()
    assert eager.runner.plain_decode(eager.scheduler.schedule()) is None  # no compiled step to run it


def _snapshots(llm: LLM) -> dict:
    """Each pool's snapshot, the pins' owners named without their addresses (another engine's cache)."""
    out = {}
    for group in llm.kv.groups:
        snap = group.pool.snapshot()
        snap["pin_owners"] = {
            b: [(re.sub(r" at 0x[0-9a-f]+", "", o), n) for o, n in owners] for b, owners in snap["pin_owners"].items()
        }
        out[group.name] = snap
    return out


def test_in_place_appends_match_the_general_allocation(models, monkeypatch):
    """The same workload with and without `append_in_place`: after every step, the same pools (page
    tables, counts, free lists) and at the end the same tokens; the fast path served most appends."""
    model = models("gpt-oss-tiny")
    work = random_workload(random.Random(4), model.config.vocab_size, 8, 170, 80, 5)
    work.prompts[5] = work.prompts[1][:100] + [7, 8, 9]  # a prefix hit: shared blocks, copy-on-write
    trails, outputs, fast_appends = {}, {}, []
    in_place = kv_manager_module.KVManager._in_place

    def counting(self, group, rid, num_computed):
        took = in_place(self, group, rid, num_computed)
        fast_appends.append(took)
        return took

    for fast in (True, False):
        monkeypatch.setattr(kv_manager_module.KVManager, "_in_place", counting if fast else lambda *a: False)
        llm = LLM(model, kv_blocks=60, max_batch_tokens=96, max_running=6, compile_decode=False)
        trail = trails[fast] = []
        step = llm.step

        def recorded(step=step, llm=llm, trail=trail):
            outs = step()
            trail.append(_snapshots(llm))
            return outs

        llm.step = recorded
        outputs[fast] = {i: out.token_ids for i, out in run(llm, work).items()}
    assert trails[True] == trails[False]
    assert outputs[True] == outputs[False]
    assert sum(fast_appends) > 0.5 * len(fast_appends)


def test_append_in_place_is_append_of_one():
    pool, twin = PagedKVPool(8, 4), PagedKVPool(8, 4)
    for p in (pool, twin):
        p.create("a")
        p.append("a", 2)
    for _ in range(2):  # the last block's two free slots
        assert pool.has_room("a")
        assert pool.append_in_place("a") == twin.append("a", 1)
        assert pool.snapshot() == twin.snapshot()
    assert not pool.has_room("a")  # full: the next token needs a block
    with pytest.raises(ValueError, match="full or shared"):
        pool.append_in_place("a")
    assert pool.snapshot() == twin.snapshot()
    pool.append("a", 1)
    pool.share_prefix("a", "b", 5)  # "b" shares the partly filled last block: copy-on-write
    assert not pool.has_room("a") and not pool.has_room("b")
    with pytest.raises(KeyError):
        pool.has_room("nobody")


def test_has_room_counts_blocks_a_window_would_release():
    pool = PagedKVPool(8, 4)
    pool.create("a")
    pool.append("a", 10)  # three blocks, two free slots in the last
    assert pool.has_room("a") and pool.has_room("a", keep_from=3)
    assert not pool.has_room("a", keep_from=4)  # the first block lies wholly before token 4
    assert pool.resident("a") == (pool.page_table("a"), 0)
    pool.release_before("a", 8)
    assert pool.has_room("a", keep_from=8) and not pool.has_room("a", keep_from=12)
    assert (
        pool.resident("a") == (pool.page_table("a"), pool.first_block_index("a")) and pool.first_block_index("a") == 2
    )
