"""The block attention kernel reading quantised blocks in place (every format of `kv.quant.CODECS`) and
a tail per group, against masked_decode over the store's own dequantised copy (`static_keys_values`)."""

from __future__ import annotations

import pytest
import torch

from gptoss_lite.kernels import blocks
from gptoss_lite.kv.base import QuantizedBlocks, StaticRead
from gptoss_lite.kv.paged_quant import static_keys_values
from gptoss_lite.kv.quant import CODECS, QuantSpec, quantize_keys, quantize_values
from gptoss_lite.model.attention.decode import masked_decode
from gptoss_lite.model.attention.plan import distance_bias

pytestmark = pytest.mark.skipif(not blocks.available(), reason="no C compiler: the layer dequantises instead")


def case(fmt, R, K, T, G, D, N, bs, nb, vg, dtype, seed):
    """Random blocks quantised as a `QuantizedPagedStore` holds them, tails, tables and distances."""
    g = torch.Generator().manual_seed(seed)
    spec = QuantSpec(fmt, key_group=bs, value_group=vg, residual=0)
    dense_k = (3 * torch.randn(K, N, bs, D, generator=g)).to(dtype)
    dense_v = torch.randn(K, N, bs, D, generator=g).to(dtype)
    codes = (*quantize_keys(dense_k, spec), *quantize_values(dense_v, spec))
    NT = 5
    tail_k = torch.randn(K, NT, bs, D, generator=g).to(dtype)
    tail_v = torch.randn(K, NT, bs, D, generator=g).to(dtype)
    table = torch.randint(0, N, (R, nb), generator=g)
    tails = torch.randint(0, NT, (R,), generator=g)
    S = (nb + 1) * bs
    query = torch.randint(-3, S + 5, (R, T, 1), generator=g)
    distance = query - torch.arange(S)[None, None, :]
    distance[0, :, nb * bs + 3 :] = -1  # a tail filled to 3 slots
    rows = (2 * torch.randn(R, K, T * G, D, generator=g)).to(dtype).float()
    sinks = torch.randn(K, G, generator=g)
    read = StaticRead(tail_k, tail_v, distance, table, QuantizedBlocks(codes, fmt, vg, tails, static_keys_values))
    return rows, read, sinks


def oracle(rows, read, window, sinks, dtype):
    _, K, M, _ = rows.shape
    T = read.distance.shape[1]
    G, S = M // T, read.distance.shape[-1]
    keys, values = read.quantized.dequantize(read, read.keys.dtype)
    bias = distance_bias(read.distance, None if window < 0 else window)[:, None, :, None, :]
    bias = bias.expand(-1, -1, -1, G, -1).reshape(read.distance.shape[0], 1, T * G, S)
    sink = sinks.view(1, K, 1, G, 1).expand(-1, -1, T, -1, -1).reshape(1, K, T * G, 1)
    return masked_decode(rows, keys.float(), values.float(), bias, sink, round_to=dtype).float()


def kernel(rows, read, window, sinks, round_bf16):
    q = read.quantized
    return blocks.quantized_attention(
        rows, list(q.codes), q.format, q.value_group, read.keys, read.values, read.table, q.tails, read.distance,
        window, sinks, round_bf16,
    )  # fmt: skip


SHAPES = [  # R, K, T, G, D, N, bs, nb, value group, window
    (16, 2, 1, 4, 32, 60, 16, 6, 32, -1),  # the bench model's plain decode
    (5, 2, 3, 4, 32, 50, 16, 4, 16, 40),  # a verification step, a window, two value groups
    (4, 8, 1, 8, 64, 40, 16, 2, 64, -1),  # gpt-oss heads
]


@pytest.mark.parametrize("fmt", sorted(CODECS))
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_equals_masked_decode_over_the_dequantised_blocks(fmt, shape):
    *dims, window = shape
    rows, read, sinks = case(fmt, *dims, torch.float32, seed=7)
    got = kernel(rows, read, window, sinks, False)
    want = oracle(rows, read, window, sinks, torch.float32)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("fmt", sorted(CODECS))
def test_bf16_dequantises_to_bf16_and_rounds_where_masked_decode_rounds(fmt):
    rows, read, sinks = case(fmt, *SHAPES[1][:-1], torch.bfloat16, seed=3)
    got = kernel(rows, read, 40, sinks, True)
    want = oracle(rows, read, 40, sinks, torch.bfloat16)
    assert torch.equal(got.bfloat16().float(), got)
    assert (got == want).float().mean().item() > 0.98
    assert (got - want).abs().max().item() <= 2**-7 * want.abs().max().item()


def test_a_changed_code_changes_the_output():
    """The kernel reads the codes themselves: flipping one block's codes moves the rows that see it."""
    rows, read, sinks = case("int8", *SHAPES[0][:-1], torch.float32, seed=1)
    before = kernel(rows, read, -1, sinks, False)
    read.quantized.codes[3][:, read.table[0, 0]] ^= 0x55  # value codes of group 0's first block
    after = kernel(rows, read, -1, sinks, False)
    assert not torch.equal(before[0], after[0])
    assert torch.allclose(after, oracle(rows, read, -1, sinks, torch.float32), atol=1e-5, rtol=1e-5)


def test_bad_input_is_a_clear_error():
    rows, read, sinks = case("int4", *SHAPES[0][:-1], torch.float32, seed=2)
    q = read.quantized
    with pytest.raises(ValueError, match="block id"):
        bad = read.table.clone()
        bad[0, 0] = 10**6
        blocks.quantized_attention(
            rows, list(q.codes), "int4", q.value_group, read.keys, read.values, bad, q.tails, read.distance, -1,
            sinks, False,
        )  # fmt: skip
    with pytest.raises(ValueError, match="quantised block attention"):
        blocks.quantized_attention(
            rows, list(q.codes), "int3", q.value_group, read.keys, read.values, read.table, q.tails,
            read.distance, -1, sinks, False,
        )  # fmt: skip
