"""The prefill attention kernel (`kernels/prefill.c`, `gptoss_lite::prefill_attention`) against the
dense oracle `attention_reference`, its place in `blocks.attend`, the paths that must not take it, and
the machines without it (an AVX2 build reports itself unusable; GPTOSS_LITE_NO_KERNELS=1 falls back)."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess

import pytest
import torch

from conftest import build_kernel_for, make_model
from gptoss_lite.kernels import prefill
from gptoss_lite.kernels.build import cpu_flags
from gptoss_lite.kv.base import KVRead
from gptoss_lite.model.attention import attention_fast, attention_reference
from gptoss_lite.model.attention import blocks as blocks_module


def _has_avx512() -> bool:
    return " avx512f" in (cpu_flags() or "")


needs_kernel = pytest.mark.skipif(not prefill.available(), reason="the prefill kernel needs AVX-512 and a C compiler")


def _inputs(B, K, G, T, S, D, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, K * G, T, D, generator=g) * scale).to(dtype)
    k = (torch.randn(B, K, S, D, generator=g) * scale).to(dtype)
    v = torch.randn(B, K, S, D, generator=g).to(dtype)
    sinks = torch.randn(K * G, generator=g) * 2
    return q, k, v, sinks


def _check(got, q, k, v, sinks, q_offset, window, tol=2e-6):
    """got equals the oracle on the same (widened) inputs: within `tol` in fp32 (the order of the fp32
    sums differs), within one bf16 rounding of the oracle's fp32 result in bf16."""
    want = attention_reference(q.float(), k.float(), v.float(), sinks, q_offset, window)
    assert got.shape == q.shape and got.dtype == q.dtype
    if q.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    else:
        assert ((got.float() - want).abs() <= 2**-8 * want.abs() + 1e-6).all()


def test_kernel_is_built_here():
    # gcc is on every machine the tests run on; on an AVX-512 CPU a silent fallback would hide a break.
    if platform.machine() != "x86_64" or not _has_avx512():
        pytest.skip("the kernel is built for x86-64 CPUs with AVX-512")
    if os.environ.get("GPTOSS_LITE_NO_KERNELS") == "1":
        pytest.skip("GPTOSS_LITE_NO_KERNELS=1: the kernels are off on purpose (the suite's fallback run)")
    assert prefill.available()


@needs_kernel
@pytest.mark.parametrize("D", [32, 64])
@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize(
    "T,past",
    [(16, 0), (17, 0), (100, 0), (300, 0), (31, 45), (64, 700)],  # a prompt, then a chunk after a cached past
)
@pytest.mark.parametrize("window", [None, 1, 8, 100, 128])
def test_equals_the_reference(D, G, T, past, window):
    q, k, v, sinks = _inputs(2 if G == 1 else 1, 2, G, T, T + past, D, torch.float32, seed=T * G + D)
    for s in (sinks, None):
        _check(prefill.attention(q, k, v, s, past, window), q, k, v, s, past, window)


@needs_kernel
@pytest.mark.parametrize("window", [None, 128])
def test_bf16_long_prompt_equals_the_reference(window):
    # 2,100 queries: many 16-query tasks and 64-key tiles, ragged at both ends
    q, k, v, sinks = _inputs(1, 2, 4, 2100, 2100, 32, torch.bfloat16, seed=3)
    _check(prefill.attention(q, k, v, sinks, 0, window), q, k, v, sinks, 0, window)


@needs_kernel
def test_large_scores_do_not_overflow():
    # scores of a few hundred: the running max keeps every exponent <= 0 (a score's own fp32 rounding,
    # ~1e-7 of its size, is what both sides may differ by)
    q, k, v, sinks = _inputs(1, 1, 4, 80, 80, 32, torch.float32, seed=5, scale=6.0)
    out = prefill.attention(q, k, v, sinks, 0, None)
    assert out.isfinite().all()
    _check(out, q, k, v, sinks, 0, None, tol=1e-4)
    _check(prefill.attention(q, k, v, None, 0, 8), q, k, v, None, 0, 8, tol=1e-4)


@needs_kernel
def test_strided_keys_and_queries():
    # keys that are a slice of a larger store (the cache's buffer), queries a transposed view
    q, k, v, sinks = _inputs(1, 2, 4, 40, 90, 32, torch.float32, seed=7)
    store_k, store_v = torch.zeros(1, 2, 200, 32), torch.zeros(1, 2, 200, 32)
    store_k[:, :, 10:100], store_v[:, :, 10:100] = k, v
    kv = store_k[:, :, 10:100], store_v[:, :, 10:100]
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, T, D) with tokens outermost
    _check(prefill.attention(qt, *kv, sinks, 50, None), q, k, v, sinks, 50, None)


@needs_kernel
def test_attend_takes_the_kernel_for_dense_prompts(monkeypatch):
    calls = []
    real = prefill.attention
    monkeypatch.setattr(prefill, "attention", lambda *a: calls.append(a[0].shape) or real(*a))
    q, k, v, sinks = _inputs(1, 2, 4, 64, 64, 32, torch.float32, seed=1)
    with torch.inference_mode():
        out = attention_fast(q, k, v, sinks, 0, 16)
    assert calls == [q.shape]
    _check(out, q, k, v, sinks, 0, 16)


@needs_kernel
def test_paths_that_keep_other_kernels(monkeypatch):
    calls = []
    monkeypatch.setattr(prefill, "attention", lambda *a: calls.append(1))
    q, k, v, sinks = _inputs(1, 2, 4, 64, 64, 32, torch.float32, seed=2)
    attention_fast(q[..., :16], k[..., :16], v[..., :16], sinks, 0, None)  # a head size it does not serve
    attention_fast(q[:, :, :8], k, v, sinks, 56, None)  # fewer than MIN_QUERIES queries
    attention_fast(q, k, v, sinks, 0, None, q_block=16)  # forced blocks: the online softmax under test
    q9, k9, v9, s9 = _inputs(1, 1, 9, 32, 32, 32, torch.float32, seed=3)  # 9 heads per KV head
    attention_fast(q9, k9, v9, s9, 0, None)
    leaf = q.clone().requires_grad_()  # a recorded forward: gradients through the oracle's ops
    attention_fast(leaf, k, v, sinks, 0, None).sum().backward()
    read = KVRead.dense(k, v, 0)  # H2O's attention mass needs the probabilities
    read.mass = torch.zeros(1, 2, 64)
    blocks_module.attend(q, read, sinks, 0, None)
    assert not calls and read.mass.sum() > 0 and leaf.grad is not None


@needs_kernel
@pytest.mark.parametrize(
    "changes",
    [
        {"head_dim": 32, "n_heads": 8, "n_kv_heads": 2, "sliding_window": 32},  # the 20M benchmark's heads
        {"head_dim": 64, "n_heads": 16, "n_kv_heads": 2, "sliding_window": 32},  # gpt-oss's D and G = 8
    ],
)
def test_whole_model_prefill_equals_the_reference(changes, monkeypatch):
    """A model's prompt forward without autograd, which takes the kernel in every layer, gives the
    logits of the oracle attention (full and windowed layers, sinks, biases), in fp32: in bf16 the
    two round differently and a router near-tie then picks other experts (the kernel's bf16 results
    are held to the oracle above, call by call)."""
    calls = []
    real = prefill.attention
    monkeypatch.setattr(prefill, "attention", lambda *a: calls.append(1) or real(*a))
    model = make_model("gpt-oss-tiny", **changes)
    x = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        fast = model(x).logits
        assert len(calls) == model.config.n_layers
        want = model(x, attn_impl="reference").logits
    torch.testing.assert_close(fast, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["x86-64", "haswell"])
def test_builds_without_avx512_report_themselves_unusable(tmp_path, arch):
    """Built for a CPU without AVX-512 (plain x86-64, an AVX2-only CPU) the library compiles and says
    it has no kernel, so those machines keep PyTorch's path."""
    assert build_kernel_for("prefill", arch, tmp_path, run=False).gl_has_prefill_attention() == 0


def test_fallback_without_kernels_agrees(without_kernels):
    script = (
        "import torch; from gptoss_lite.kernels import prefill; "
        "from gptoss_lite.model.attention import attention_fast, attention_reference; "
        "assert not prefill.available(); g = torch.Generator().manual_seed(0); "
        "q, k, v = torch.randn(1, 8, 40, 32, generator=g), torch.randn(1, 2, 40, 32, generator=g), "
        "torch.randn(1, 2, 40, 32, generator=g); s = torch.randn(8, generator=g); "
        "assert not prefill.applies(q, k, v); "
        "torch.testing.assert_close(attention_fast(q, k, v, s, 0, 8), attention_reference(q, k, v, s, 0, 8), "
        "atol=1e-5, rtol=1e-5)"
    )
    without_kernels(script)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tasks_filling_their_own_tiles_give_the_shared_tiles_result(tmp_path, dtype):
    """Without a window the tasks read tiles filled once per call; past SHARED_MAX bytes (or when that
    memory cannot be had) each fills its own, as windowed calls do. A build with SHARED_MAX 0 always
    takes that fallback: the same sums in the same order, so the same bits."""
    from gptoss_lite.kernels.build import _HERE, _compiler, kernel_flags

    lib_path = tmp_path / "prefill-own-tiles.so"
    flags = [f for f in kernel_flags() if f != "-shared"]
    src = str(_HERE / "prefill.c")
    subprocess.run(
        [_compiler(), *flags, "-shared", "-DSHARED_MAX=0", "-I", str(_HERE), src, "-o", str(lib_path), "-lm"],
        check=True,
    )
    own = ctypes.CDLL(str(lib_path))
    own.gl_prefill_attention.argtypes = prefill._library().gl_prefill_attention.argtypes
    for T, past in ((300, 0), (64, 700)):
        q, k, v, sinks = _inputs(1, 2, 4, T, T + past, 32, dtype, seed=T + past)
        shared = prefill.prefill_attention(q, k, v, sinks, past, -1)
        out = torch.empty_like(shared)
        own.gl_prefill_attention(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), int(dtype == torch.bfloat16), 1, 2, 4, T, T + past, 32,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], past, -1, sinks.data_ptr(), 32**-0.5, out.data_ptr(),
        )  # fmt: skip
        assert torch.equal(out, shared)
