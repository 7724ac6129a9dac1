"""The in-place block attention kernel (kernels/blocks.c) against masked_decode over a gathered copy."""

from __future__ import annotations

import ctypes

import pytest
import torch

from conftest import build_kernel_for
from gptoss_lite.kernels import blocks
from gptoss_lite.model.attention.decode import masked_decode
from gptoss_lite.model.attention.layer import gathered
from gptoss_lite.model.attention.plan import distance_bias

pytestmark = pytest.mark.skipif(not blocks.available(), reason="no C compiler: the layer gathers instead")


def oracle(rows, keys, values, table, distance, window, sinks, dtype):
    """masked_decode over the gathered blocks, the mask and sinks laid out as the layer lays them."""
    _, K, M, _ = rows.shape
    T = distance.shape[1]
    G, S = M // T, distance.shape[-1]
    bias = distance_bias(distance, None if window < 0 else window)[:, None, :, None, :]
    bias = bias.expand(-1, -1, -1, G, -1).reshape(distance.shape[0], 1, T * G, S)
    sink = sinks.view(1, K, 1, G, 1).expand(-1, -1, T, -1, -1).reshape(1, K, T * G, 1)
    return masked_decode(
        rows, gathered(keys, table).float(), gathered(values, table).float(), bias, sink, round_to=dtype
    ).float()


def case(R, K, T, G, D, N, bs, nb, per_row, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(K, N, bs, D, generator=g).to(dtype)
    values = torch.randn(K, N, bs, D, generator=g).to(dtype)
    table = torch.randint(0, N, (R, nb), generator=g)
    rows = (2 * torch.randn(R, K, T * G, D, generator=g)).to(dtype).float()
    # query positions past, inside and before the slots: some rows see every slot, some a few, one none
    query = torch.randint(-3, nb * bs + 5, (R if per_row else 1, T, 1), generator=g)
    distance = query - torch.arange(nb * bs)[None, None, :]
    sinks = torch.randn(K, G, generator=g)
    return rows, keys, values, table, distance, sinks


SHAPES = [  # R, K, T, G, D, N, bs, nb, per-row distances, window
    (16, 2, 1, 4, 32, 300, 16, 24, True, -1),  # the bench model's plain decode
    (5, 2, 3, 4, 32, 50, 16, 4, True, 40),  # a verification step, sliding window
    (3, 1, 2, 3, 13, 20, 4, 5, False, -1),  # odd head size, one distance row for every group
    (4, 8, 1, 8, 64, 40, 16, 6, True, 128),  # gpt-oss heads
    (2, 2, 9, 8, 64, 40, 16, 6, True, -1),  # a draft of 8 on gpt-oss heads
    (3, 2, 1, 3, 32, 30, 5, 3, True, 7),  # 3 query rows a group (a short row group), 15 slots (a tail of keys)
    (2, 1, 3, 2, 64, 12, 7, 2, False, 5),  # 6 rows: a full row group and a short one; 14 slots
]


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_equals_masked_decode_to_rounding(shape):
    *dims, per_row, window = shape
    rows, keys, values, table, distance, sinks = case(*dims, per_row, torch.float32, seed=len(SHAPES))
    got = blocks.attention(rows, keys, values, table, distance, window, sinks, False)
    want = oracle(rows, keys, values, table, distance, window, sinks, torch.float32)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_rounds_where_masked_decode_rounds(shape):
    *dims, per_row, window = shape
    rows, keys, values, table, distance, sinks = case(*dims, per_row, torch.bfloat16, seed=3)
    got = blocks.attention(rows, keys, values, table, distance, window, sinks, True)
    want = oracle(rows, keys, values, table, distance, window, sinks, torch.bfloat16)
    assert torch.equal(got.bfloat16().float(), got)  # bf16 values
    # the same bf16 value almost everywhere; where the sums' order tips a rounding, one bf16 step
    assert (got == want).float().mean().item() > 0.98
    assert (got - want).abs().max().item() <= 2**-7 * want.abs().max().item()


@pytest.mark.parametrize("arch", ["x86-64", "haswell"])
def test_other_cpus_builds_agree(tmp_path, arch):
    """The source as built for a CPU without AVX2 (plain C) and for an AVX2-only one (the generic path,
    with its prefetches of fp32 blocks while scoring and of bf16 blocks while widening) against
    masked_decode: machines unlike this one read their blocks correctly too."""
    lib = build_kernel_for("blocks", arch, tmp_path)
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.gl_block_attention.argtypes = [
        ptr, i64, i64, i64, i64, ptr, ptr, i32, i64, i64, ptr, i64, ptr, i64, i64, i64, ptr, i64,
        ctypes.c_float, i32, ptr,
    ]  # fmt: skip
    for shape in SHAPES:
        *dims, per_row, window = shape
        for dtype in (torch.float32, torch.bfloat16):
            rows, keys, values, table, distance, sinks = case(*dims, per_row, dtype, seed=5)
            R, K, M, D = rows.shape
            _, N, bs, _ = keys.shape
            out = torch.empty(R, K, M, D)
            code = lib.gl_block_attention(
                rows.data_ptr(), R, K, M, D, keys.data_ptr(), values.data_ptr(), int(dtype == torch.bfloat16), N, bs,
                table.data_ptr(), table.shape[1], distance.data_ptr(), distance.shape[0], distance.shape[1], window,
                sinks.data_ptr(), M // distance.shape[1], D**-0.5, int(dtype == torch.bfloat16), out.data_ptr(),
            )  # fmt: skip
            assert code == 0
            want = oracle(rows, keys, values, table, distance, window, sinks, dtype)
            tol = 1e-5 if dtype == torch.float32 else 2**-7
            assert (out - want).abs().max().item() <= tol * want.abs().max().item(), (arch, shape, dtype)


def test_a_row_that_sees_nothing_gets_zeros():
    rows, keys, values, table, distance, sinks = case(2, 2, 1, 4, 32, 10, 16, 2, True, torch.float32, seed=1)
    distance = torch.full_like(distance, -1)
    assert torch.equal(blocks.attention(rows, keys, values, table, distance, -1, sinks, False), torch.zeros_like(rows))


def test_bad_input_is_a_clear_error():
    rows, keys, values, table, distance, sinks = case(2, 2, 1, 4, 32, 10, 16, 2, True, torch.float32, seed=2)
    with pytest.raises(ValueError, match="block id"):
        blocks.attention(rows, keys, values, table + 10, distance, -1, sinks, False)
    with pytest.raises(ValueError, match="block attention"):
        blocks.attention(rows, keys, values, table[:1], distance, -1, sinks, False)
    assert not blocks.applies(keys.transpose(1, 2), values, torch.float32)  # not contiguous: the layer gathers
    assert not blocks.applies(keys, values, torch.float16)  # fp16 rounds differently from bf16


def test_a_compiled_graph_calls_it_as_one_node():
    rows, keys, values, table, distance, sinks = case(4, 2, 1, 4, 32, 30, 16, 3, True, torch.float32, seed=4)

    def step(rows, table, distance):
        return blocks.attention(rows, keys, values, table, distance, 128, sinks, False) * 2

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    want = blocks.attention(rows, keys, values, table, distance, 128, sinks, False) * 2
    assert torch.equal(compiled(rows, table, distance), want)


def test_a_decode_step_over_blocks_is_the_same_with_the_kernel_or_a_gathered_copy(monkeypatch):
    """The model's own decode step over the engine's block tables, the kernel reading the blocks in
    place against the layer's fallback (gather a copy, then masked_decode)."""
    from conftest import make_model
    from gptoss_lite.engine import LLM, SamplingParams
    from gptoss_lite.model.attention import layer

    model = make_model("gpt-oss-tiny").eval()
    model.pack_for_decode(input_major=False)  # the out-major weights decode_step reads
    llm = LLM(model, kv_blocks=200, max_batch_tokens=64)
    runner, forward, checked = llm.runner, llm.runner.forward, []

    def both_ways(step):
        input_ids, batch, _ = runner.build_batch(step)  # changes no request
        static = batch.static()
        if static is not None:
            ids = input_ids[static.order]
            with torch.inference_mode():
                in_place = model.decode_step(ids, static)
                with monkeypatch.context() as patch:
                    patch.setattr(layer.block_kernels, "applies", lambda *args: False)
                    copied = model.decode_step(ids, static)  # writes the same K/V again, then gathers
            checked.append(float((in_place - copied).abs().max() / copied.abs().max()))
        return forward(step)

    runner.forward = both_ways
    prompts = [[(7 * i + j) % 200 + 1 for j in range(20 + 9 * i)] for i in range(4)]
    llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert len(checked) > 5 and max(checked) < 1e-5
