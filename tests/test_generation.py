import random

import pytest
import torch

from conftest import make_model
from gptoss_lite.generation import generate, generate_reference, stream_generate
from gptoss_lite.kv.mixed import MixedKVCache
from gptoss_lite.model import GPTOSS
from gptoss_lite.sampling import SamplingParams, greedy, probabilities, sample


@pytest.mark.parametrize("preset", ["lite-tiny", "gpt-oss-tiny"])
@pytest.mark.parametrize("B,T", [(1, 5), (1, 30), (2, 5), (2, 30)])  # window is 8
def test_cached_equals_uncached_64_tokens(preset, B, T):
    """Greedy cached generation equals the uncached O(T²) reference for 64 new tokens."""
    model = make_model(preset)
    ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(T + B))
    cached = generate(model, ids, 64, temperature=0)
    reference = generate_reference(model, ids, 64, temperature=0)
    assert cached.shape == (B, T + 64)
    assert torch.equal(cached, reference)


def test_random_chunked_prefill_matches_one_shot(tiny_model):
    """Prefill in random chunk sizes gives the same logits (<= 1e-5) and the same tokens as one shot."""
    ids = torch.randint(0, 256, (2, 90))
    full = tiny_model(ids).logits
    rng = random.Random(0)
    for _ in range(3):
        cache, pos, pieces = MixedKVCache(tiny_model.config, 2), 0, []
        while pos < 90:
            n = min(90 - pos, rng.randint(1, 20))
            pieces.append(tiny_model(ids[:, pos : pos + n], cache=cache, start_pos=pos).logits)
            pos += n
        torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=1e-5)
    one = generate(tiny_model, ids, 16, temperature=0, prefill_chunk=4096)
    for chunk in (1, 7, 13):
        assert torch.equal(generate(tiny_model, ids, 16, temperature=0, prefill_chunk=chunk), one)


def test_seeded_sampling_reproducible(tiny_model):
    """A seed makes temperature/top-p sampling reproducible; different seeds differ."""
    ids = torch.randint(0, 256, (1, 10))
    a = generate(tiny_model, ids, 32, temperature=1.5, top_p=0.95, seed=7)
    b = generate(tiny_model, ids, 32, temperature=1.5, top_p=0.95, seed=7)
    c = generate(tiny_model, ids, 32, temperature=1.5, top_p=0.95, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_sampling_params_and_shorthands_draw_the_same(tiny_model):
    """generate(sampling=SamplingParams(...)) equals the temperature/top_p/seed shorthands, and with
    neither it draws with SamplingParams' defaults (temperature 1.0, top_p 1.0), as the engine does;
    stream_generate and generate_reference take the same argument."""
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    out = generate(tiny_model, ids, 12, sampling=params)
    assert torch.equal(out, generate(tiny_model, ids, 12, temperature=0.8, top_p=0.9, seed=11))
    streamed = torch.stack(list(stream_generate(tiny_model, ids, 12, sampling=params)), dim=1)
    assert torch.equal(streamed, out[:, 10:])
    reference = generate_reference(tiny_model, ids, 12, sampling=params)
    assert torch.equal(reference, generate_reference(tiny_model, ids, 12, temperature=0.8, top_p=0.9, seed=11))
    defaults = SamplingParams(seed=5)
    assert (defaults.temperature, defaults.top_p) == (1.0, 1.0)
    plain = generate(tiny_model, ids, 12, seed=5)
    assert torch.equal(plain, generate(tiny_model, ids, 12, sampling=defaults))
    assert torch.equal(plain, generate(tiny_model, ids, 12, temperature=1.0, top_p=1.0, seed=5))
    greedy = generate(tiny_model, ids, 12, temperature=0)
    assert torch.equal(greedy, generate(tiny_model, ids, 12, sampling=SamplingParams(temperature=0)))
    # max_new_tokens is generate()'s length; SamplingParams.max_tokens is the engine's and not read.
    assert generate(tiny_model, ids, 3, sampling=SamplingParams(max_tokens=50, temperature=0)).shape == (2, 13)


@pytest.mark.parametrize("fn", [generate, stream_generate, generate_reference])
def test_sampling_and_a_shorthand_together_are_refused(tiny_model, fn):
    """sampling= with temperature=/top_p=/seed= is ambiguous; fields generate() does not act on are
    refused by name rather than ignored; a sampling= that is not a SamplingParams is a TypeError."""
    ids = torch.tensor([[1, 2, 3]])
    name = fn.__name__
    for shorthand in (dict(temperature=0.5), dict(top_p=0.5), dict(seed=1)):
        (key,) = shorthand
        with pytest.raises(ValueError, match=rf"{name}\(\): sampling= and {key}=.*give one of them"):
            fn(tiny_model, ids, 2, sampling=SamplingParams(), **shorthand)
    with pytest.raises(ValueError, match=r"stop_token_ids act only in the batched engine.*stop_tokens="):
        fn(tiny_model, ids, 2, sampling=SamplingParams(stop_token_ids=[5]))
    with pytest.raises(ValueError, match=r"logprobs, logit_bias, n act only in the batched engine"):
        fn(tiny_model, ids, 2, sampling=SamplingParams(logprobs=1, logit_bias={3: 1.0}, n=2))
    with pytest.raises(TypeError, match="expected a gptoss_lite.sampling.SamplingParams, got dict"):
        fn(tiny_model, ids, 2, sampling={"temperature": 0})


def test_greedy_consumes_no_randomness():
    """Greedy sampling leaves the global RNG untouched."""
    logits = torch.randn(3, 10)
    before = torch.get_rng_state()
    sample(logits, SamplingParams(temperature=0))
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_with_the_first_of_equal_logits(dtype):
    # 16-bit logits are widened before the argmax (a faster CPU path): the index must be argmax's own,
    # the first of tied maxima included (bf16 makes ties common).
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(16, 4099, generator=gen) * 3).to(dtype)
    logits[3, 10] = logits[3, 2000] = logits[3, 4000] = logits[3].max() + 1  # a three-way tie
    assert torch.equal(greedy(logits), logits.argmax(dim=-1))
    assert int(greedy(logits)[3]) == 10
    assert torch.equal(greedy(logits[0]), logits[0].argmax(dim=-1))  # one row, no batch dimension


def test_top_p_keeps_smallest_prefix():
    """Nucleus keeps the smallest prefix whose mass reaches top_p: here only the top token."""
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    g = torch.Generator().manual_seed(0)
    picks = {int(sample(logits, SamplingParams(temperature=1.0, top_p=0.55), g)) for _ in range(50)}
    assert picks == {0}
    picks = {int(sample(logits, SamplingParams(temperature=1.0, top_p=0.85), g)) for _ in range(200)}
    assert picks == {0, 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_top_p_and_temperature_the_api_allows_samples(dtype):
    """top_p down to 5e-324 (0 once in float32) keeps the most likely token; temperatures down to the
    smallest float and up to 2 give finite distributions; in each logits dtype."""
    logits = torch.randn(3, 264, generator=torch.Generator().manual_seed(0)).to(dtype)
    for top_p in (5e-324, 1e-46, 1e-8):
        picked = sample(logits, SamplingParams(temperature=1.0, top_p=top_p), torch.Generator().manual_seed(1))
        assert torch.equal(picked, logits.float().argmax(-1))
    for temperature in (5e-324, 1e-39, 1e-6, 2.0):
        for top_p in (1e-46, 0.5, 1.0):
            cfg = SamplingParams(temperature=temperature, top_p=top_p)
            assert torch.isfinite(probabilities(logits, cfg)).all()
            assert sample(logits, cfg, torch.Generator().manual_seed(2)).shape == (3,)


def test_stream_equals_generate_and_stop_tokens(tiny_model):
    """Streaming yields the same tokens as generate(); a stop token ends generation early."""
    ids = torch.randint(0, 256, (1, 12))
    full = generate(tiny_model, ids, 20, temperature=0)
    streamed = torch.stack(list(stream_generate(tiny_model, ids, 20, temperature=0)), dim=1)
    assert torch.equal(streamed, full[:, 12:])
    stop = int(full[0, 12 + 5])
    stopped = generate(tiny_model, ids, 20, temperature=0, stop_tokens=[stop])
    first = (full[0, 12:] == stop).nonzero()[0].item()
    assert stopped.shape[1] == 12 + first + 1 and int(stopped[0, -1]) == stop


def test_clamped_sinks_reused_until_the_weights_change(tiny_model):
    """Without autograd the clamped sinks are one tensor reused step after step; a weight update
    (in place or re-assigned) gives fresh values; with autograd they carry the gradient."""
    attn = tiny_model.blocks[0].attn
    with torch.inference_mode():
        first = attn.sink_logits()
        assert attn.sink_logits() is first
    with torch.no_grad():
        attn.sinks.add_(20.0)  # pushes some logits past the clamp's upper end
    with torch.inference_mode():
        updated = attn.sink_logits()
    assert updated is not first and torch.equal(updated, attn.sinks.detach().clamp(*attn.sink_clamp))
    attn.sinks.data = attn.sinks.data * 0.5
    with torch.inference_mode():
        assert torch.equal(attn.sink_logits(), attn.sinks.detach().clamp(*attn.sink_clamp))
    assert attn.sink_logits().requires_grad


def test_generate_leaves_the_model_alone(tiny_model):
    """generate() changes nothing on the model: mode, weights, their storage and packing."""
    before = {k: (v.data_ptr(), v.clone()) for k, v in tiny_model.state_dict().items()}
    generate(tiny_model, torch.randint(0, 256, (1, 10)), 8, temperature=0)
    after = tiny_model.state_dict()
    assert not tiny_model.training and tiny_model.inference_ready
    assert all(after[k].data_ptr() == ptr and torch.equal(after[k], v) for k, (ptr, v) in before.items())


def test_unprepared_model_is_rejected_with_the_fix():
    """A model in training mode or not packed for decode gets an error naming prepare_for_inference."""
    model = make_model("lite-tiny")
    ids = torch.tensor([[1, 2, 3]])
    model.train()
    with pytest.raises(ValueError, match=r"training mode.*prepare_for_inference"):
        generate(model, ids, 2)
    with pytest.raises(ValueError, match=r"training mode.*prepare_for_inference"):
        generate_reference(model, ids, 2)
    fresh = GPTOSS(model.config).eval()
    with pytest.raises(ValueError, match=r"not packed for decode.*prepare_for_inference"):
        generate(fresh, ids, 2)
    assert not fresh.inference_ready
    generate_reference(fresh, ids, 2, temperature=0)  # the reference needs no packing
    assert fresh.prepare_for_inference() is fresh and fresh.inference_ready
    generate(fresh, ids, 2, temperature=0.7, top_p=0.9)
    fresh.to(torch.float64)  # moving the weights undoes the packing
    assert not fresh.inference_ready


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "empty prompt"),
        (dict(input_ids=torch.tensor([[1, 999]])), "out of vocabulary"),
        (dict(input_ids=torch.tensor([[1, -1]])), "out of vocabulary"),
        (dict(max_new_tokens=-1), "max_new_tokens=-1"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(max_new_tokens=70_000), "exceeds the configured maximum"),
        (dict(input_ids=torch.tensor([1, 2])), r"\(B, T\)"),
        (dict(prefill_chunk=0), "prefill_chunk"),
    ],
)
def test_bad_input(tiny_model, kwargs, match):
    """Bad generate() arguments raise clear errors before any work."""
    args = dict(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        generate(tiny_model, **args)


def test_cache_holding_the_whole_prompt_or_wrong_batch_is_rejected(tiny_model):
    """A cache must hold fewer tokens than the prompt (there must be a token to prefill) and match B."""
    cache = MixedKVCache(tiny_model.config)
    generate(tiny_model, torch.tensor([[1, 2, 3]]), 2, temperature=0, cache=cache)  # now holds 4 tokens
    with pytest.raises(ValueError, match=r"num_tokens=4; .*fewer tokens than the 3-token prompt.*reset"):
        generate(tiny_model, torch.tensor([[1, 2, 3]]), 2, temperature=0, cache=cache)
    with pytest.raises(ValueError, match="batch_size=1, num_tokens=0; it must have batch_size=2"):
        generate(tiny_model, torch.tensor([[1, 2, 3]] * 2), 2, cache=MixedKVCache(tiny_model.config))


@pytest.mark.parametrize("P", [1, 7, 20, 39])  # window is 8: prefixes shorter and longer than it
def test_generation_resumes_from_a_cache_holding_a_prompt_prefix(P):
    """A cache prefilled with the first P prompt tokens generates exactly what a cold start does."""
    model = make_model("lite-tiny")
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(P))
    cold = generate(model, ids, 24, temperature=0)
    cache = MixedKVCache(model.config, batch_size=2)
    with torch.inference_mode():
        model(ids[:, :P], cache=cache, start_pos=0)
    warm = generate(model, ids, 24, temperature=0, cache=cache, prefill_chunk=5)
    assert torch.equal(warm, cold)
