"""benchmarks/decode_profile.py's `--ab-base`: the weight kernels' ops rebound step by step between a
revision's build and this checkout's, then bound back to what served them before (steps here are
calls of the MXFP4 op, not a model's)."""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from gptoss_lite.kernels import cpp_ops, mxfp4

REPO = Path(__file__).resolve().parent.parent


def _profile_module():
    spec = importlib.util.spec_from_file_location("decode_profile", REPO / "benchmarks" / "decode_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _in_git_checkout() -> bool:
    if shutil.which("git") is None:
        return False
    run = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True)
    return run.returncode == 0


@pytest.mark.skipif(not _in_git_checkout(), reason="needs the project's git history")
def test_ab_base_alternates_the_two_builds_and_binds_back(capsys):
    if mxfp4._library() is None or "mxfp4_matvec" not in cpp_ops.bound():
        pytest.skip("the MXFP4 kernel is not served from C++ here")
    before = dict(cpp_ops._functions)
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (4, 64, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 130, (4, 64, 2), dtype=torch.uint8, generator=g)
    x = torch.randn(2, 64, generator=g)
    experts = torch.tensor([1, 3])
    reference = mxfp4.matvec._init_fn(x, blocks, scales, experts, None)  # the Python implementation
    seen: list[int] = []

    def steps():
        while True:
            seen.append(ctypes.cast(cpp_ops._functions["mxfp4_matvec"][0], ctypes.c_void_p).value)
            out = torch.ops.gptoss_lite.mxfp4_matvec(x, blocks, scales, experts, None)
            torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
            yield

    _profile_module().ab_base(steps(), "HEAD", 3)
    # 3 pairs: each build served 3 steps, and neither is the library the op had before
    assert len(seen) == 6 and len(set(seen)) == 2
    assert all(seen.count(a) == 3 for a in set(seen))
    original = ctypes.cast(before["mxfp4_matvec"][0], ctypes.c_void_p).value
    assert original not in seen
    assert cpp_ops._functions == before and "mxfp4_matvec" in cpp_ops.bound()
    assert "of this checkout: median step" in capsys.readouterr().out


def test_ab_bf16_gemv_compiles_a_graph_each_way_and_puts_the_switch_back(capsys):
    """`--ab-bf16-gemv`: the same compiled product with the bf16 GEMV op and without it (the profile of
    each setting's first step must show the op called, or not), equal to fp64 products either way, and
    `kernels.bf16.traceable` as it was after."""
    from gptoss_lite.kernels import bf16
    from gptoss_lite.model.matmul import decode_linear

    if not bf16.available():
        pytest.skip("no bf16 GEMV built here (it needs AVX2 and FMA)")
    original = bf16.traceable
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 64, generator=g).bfloat16(), torch.randn(48, 64, generator=g).bfloat16()
    want = x.double() @ w.double().T
    torch._dynamo.reset()
    step = torch.compile(decode_linear, dynamic=False)
    calls = []

    def steps():
        while True:
            out = step(x, w, None)
            calls.append(out)
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
            yield

    _profile_module().ab_bf16_gemv(steps(), 3)
    assert len(calls) == 4 + 6  # two untimed steps of each setting, then 3 pairs
    assert bf16.traceable is original
    assert "dense bf16 projections through the bf16 GEMV: median step" in capsys.readouterr().out


def test_ab_replay_alternates_the_decoders_replay_and_puts_it_back(capsys):
    """`--ab-replay`: steps of a tiny compiled model, every other one run straight (the decoder's count
    of such steps goes up by one a pair), the decoder's `replay` on again after, the same tokens as with
    every step through dynamo."""
    from conftest import make_model
    from gptoss_lite.generation import stream_generate

    model = make_model("lite-tiny").prepare_for_inference(compile_decode=True)
    prompt = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    decoder = model.compiled_decoder
    decoder.replay = False
    expected = torch.cat(list(stream_generate(model, prompt, 10, temperature=0)))
    decoder.replay = True
    got = []
    steps = (got.append(t) for t in stream_generate(model, prompt, 10, temperature=0))
    next(steps), next(steps)  # prefill, then a step through dynamo
    before = decoder.replayed
    _profile_module().ab_replay(steps, decoder, 4)
    list(steps)
    assert decoder.replay is True and decoder.replayed - before >= 4
    assert torch.equal(torch.cat(got), expected)
    assert "compiled step run straight: median step" in capsys.readouterr().out
