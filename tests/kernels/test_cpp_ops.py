"""The kernels' ops dispatched from C++ (`kernels/ops.cpp`, `kernels/cpp_ops.py`): once a kernel's library
loads, its op's CPU implementation is the C++ one, which gives the Python implementation's results (the
same C function) and refuses what it refuses, with a ValueError naming the op; under
GPTOSS_LITE_NO_CPP_OPS=1 the Python implementations stay."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from gptoss_lite.kernels import bf16, blocks, cpp_ops, moe, mxfp4, rows

needs_cxx = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("c++", "g++", "clang++")) or os.environ.get("GPTOSS_LITE_NO_KERNELS") == "1",
    reason="no C++ compiler (or kernels off): the ops keep their Python implementations",
)


def _cpu_kernel(op: str) -> str:
    """The line of torch's dispatch table that says which CPU kernel `gptoss_lite::op` has."""
    table = torch._C._dispatch_dump(f"gptoss_lite::{op}")
    return next((line for line in table.splitlines() if line.startswith("CPU:")), "")


@needs_cxx
def test_each_op_is_bound_once_its_library_loads():
    assert rows._library() is not None and blocks._library() is not None and moe._library() is not None
    assert mxfp4._library() is not None and bf16._library() is not None
    gemv = {"bf16_gemv"} if bf16.available() else set()  # its kernel serves CPUs with AVX-512 BF16 only
    act = {"mxfp4_gate_up_act"} if mxfp4.gate_up_act_available() else set()  # and this one AVX-512 ones
    always = {"rows_mm", "block_attention", "moe_experts", "mxfp4_matvec", "mxfp4_matvec_int8"}
    assert cpp_ops.bound() == always | gemv | act
    for op in cpp_ops.bound():
        assert "ops.cpp" in _cpu_kernel(op), op
    assert cpp_ops.bind("rows_mm", rows._library().gl_rows_mm)  # again: a no-op


@needs_cxx
@pytest.mark.parametrize(
    "M,R,K,bias,strided", [(1, 40, 16, False, False), (5, 33, 64, True, True), (16, 256, 96, True, False)]
)
def test_rows_mm_cpp_equals_python(M, R, K, bias, strided):
    g = torch.Generator().manual_seed(M * R)
    x = torch.randn(M, 2 * K if strided else K, generator=g)[:, :K]
    w, b = torch.randn(R, K, generator=g), torch.randn(R, generator=g) if bias else None
    rows._library()
    assert "rows_mm" in cpp_ops.bound()
    got = torch.ops.gptoss_lite.rows_mm(x, w, b)
    assert torch.equal(got, rows.rows_mm._init_fn(x, w, b))
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="rows_mm"):
        torch.ops.gptoss_lite.rows_mm(x, w[:, :-1], b)
    with pytest.raises(ValueError, match="rows_mm"):
        torch.ops.gptoss_lite.rows_mm(x.double(), w, b)


@needs_cxx
@pytest.mark.parametrize("dtype,round_bf16", [(torch.float32, False), (torch.bfloat16, True)])
def test_block_attention_cpp_equals_python(dtype, round_bf16):
    g = torch.Generator().manual_seed(3)
    K, N, bs, D, R, G, T = 2, 12, 16, 32, 3, 4, 1
    keys, values = (torch.randn(K, N, bs, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(R, K, G * T, D, generator=g)
    table = torch.stack([torch.randperm(N, generator=g)[:4] for _ in range(R)])
    distance = (torch.tensor([50, 20, 63])[:, None] - torch.arange(4 * bs))[:, None, :]  # (R, 1, S)
    sinks = torch.randn(K, G, generator=g)
    blocks._library()
    assert "block_attention" in cpp_ops.bound()
    args = (q, keys, values, table, distance, 40, sinks, round_bf16)
    assert torch.equal(torch.ops.gptoss_lite.block_attention(*args), blocks.attention._init_fn(*args))
    with pytest.raises(ValueError, match="block id"):
        torch.ops.gptoss_lite.block_attention(q, keys, values, table + N, distance, 40, sinks, round_bf16)
    with pytest.raises(ValueError, match="block attention"):
        torch.ops.gptoss_lite.block_attention(q, keys, values, table[:, :3], distance, 40, sinks, round_bf16)
    with pytest.raises(ValueError, match="block attention"):  # storage of two dtypes
        torch.ops.gptoss_lite.block_attention(q, keys, values.double(), table, distance, 40, sinks, round_bf16)


@needs_cxx
@pytest.mark.skipif(not moe.dtypes(), reason="the grouped-expert kernel needs AVX-512")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_cpp_equals_python(dtype):
    if str(dtype).removeprefix("torch.") not in moe.dtypes():
        pytest.skip("bf16 tiles need AVX-512 BF16")
    g = torch.Generator().manual_seed(4)
    B, A, E, C, I = 6, 2, 5, 64, 48
    h = torch.randn(B, C, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(B)])
    weights = torch.softmax(torch.randn(B, A, generator=g), -1)
    gate_up, down = torch.randn(E, 2 * I, C, generator=g).to(dtype), torch.randn(E, C, I, generator=g).to(dtype)
    gb, db = torch.randn(E, 2 * I, generator=g).to(dtype), torch.randn(E, C, generator=g).to(dtype)
    assert "moe_experts" in cpp_ops.bound()
    for swiglu in (False, True):
        args = (h, idx, weights, gate_up, gb, down, db, swiglu, 7.0)
        assert torch.equal(torch.ops.gptoss_lite.moe_experts(*args), moe.experts._init_fn(*args))
    no_bias = (h, idx, weights, gate_up, None, down, None, False, 7.0)
    assert torch.equal(torch.ops.gptoss_lite.moe_experts(*no_bias), moe.experts._init_fn(*no_bias))
    with pytest.raises(ValueError, match="outside"):
        torch.ops.gptoss_lite.moe_experts(h, idx + E, weights, gate_up, gb, down, db, False, 7.0)
    with pytest.raises(ValueError, match="moe_experts"):
        torch.ops.gptoss_lite.moe_experts(h, idx, weights[:, :1], gate_up, gb, down, db, False, 7.0)
    with pytest.raises(ValueError, match="moe_experts"):
        torch.ops.gptoss_lite.moe_experts(h, idx, weights, gate_up, gb[:, :3], down, db, False, 7.0)


def _mxfp4_case(seed: int, dtype: torch.dtype, top_scale: int) -> tuple[torch.Tensor, ...]:
    """codes of 6 experts (R = 40 rows, 3 blocks a row, scales 118 .. top_scale), 5 rows x in dtype, three
    of them on one expert, and an fp32 bias"""
    g = torch.Generator().manual_seed(seed)
    E, R, G = 6, 40, 3
    blocks_ = torch.randint(0, 256, (E, R, G, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, top_scale, (E, R, G), dtype=torch.uint8, generator=g)
    x = torch.randn(5, 32 * G, generator=g).to(dtype)
    return blocks_, scales, x, torch.tensor([4, 0, 4, 5, 4]), torch.randn(E, R, generator=g)


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_matvec_cpp_equals_python(dtype):
    blocks_, scales, x, experts, bias = _mxfp4_case(5, dtype, 136)
    mxfp4._library()
    for name, op in (("mxfp4_matvec", mxfp4.matvec), ("mxfp4_matvec_int8", mxfp4.matvec_int8)):
        assert name in cpp_ops.bound()
        cpp = getattr(torch.ops.gptoss_lite, name)
        for b in (bias, None):
            assert torch.equal(cpp(x, blocks_, scales, experts, b), op._init_fn(x, blocks_, scales, experts, b)), name
        for bad_experts in (experts - 1, experts + 2):  # -1 and 6 lie outside [0, 6)
            with pytest.raises(ValueError, match="expert ids"):
                cpp(x, blocks_, scales, bad_experts, bias)
        with pytest.raises(ValueError, match="mxfp4 matvec"):  # K is not 32 G
            cpp(x[:, :-1], blocks_, scales, experts, bias)
        with pytest.raises(ValueError, match="mxfp4 matvec"):  # codes that are not bytes
            cpp(x, blocks_.int(), scales, experts, bias)
        with pytest.raises(ValueError, match="mxfp4 matvec"):
            cpp(x, blocks_, scales, experts, bias[:, :-1])
    with pytest.raises(ValueError, match="mxfp4 matvec"):  # the Python implementation refuses it too
        mxfp4.matvec._init_fn(x, blocks_.int(), scales, experts, bias)


@needs_cxx
@pytest.mark.skipif(not bf16.available(), reason="the bf16 GEMV needs AVX2 and FMA")
def test_bf16_gemv_cpp_equals_python():
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(3, 200, generator=g).bfloat16(), torch.randn(70, 200, generator=g).bfloat16()
    b = torch.randn(70, generator=g)
    assert "bf16_gemv" in cpp_ops.bound()
    for bias in (b, None):
        got = torch.ops.gptoss_lite.bf16_gemv(x, w, bias)
        assert torch.equal(got, bf16.gemv_fp32._init_fn(x, w, bias))
        torch.testing.assert_close(got, torch.nn.functional.linear(x.float(), w.float(), bias), atol=1e-3, rtol=1e-4)
    for bad in ((x.float(), w, b), (x, w[:, :-1], b), (x, w, b[:-1]), (x, w.t(), b)):
        with pytest.raises(ValueError, match="bf16 gemv"):
            torch.ops.gptoss_lite.bf16_gemv(*bad)
        with pytest.raises(ValueError, match="bf16 gemv"):
            bf16.gemv_fp32._init_fn(*bad)


def test_without_cpp_ops_the_python_implementations_serve():
    script = (
        "import torch\n"
        "from gptoss_lite.kernels import cpp_ops, rows\n"
        "x, w = torch.randn(3, 64), torch.randn(64, 64)\n"
        "out = torch.ops.gptoss_lite.rows_mm(x, w, None)\n"
        "assert cpp_ops.bound() == frozenset(), cpp_ops.bound()\n"
        "table = torch._C._dispatch_dump('gptoss_lite::rows_mm')\n"
        "assert not any(line.startswith('CPU:') for line in table.splitlines()), table\n"
        "torch.testing.assert_close(out, x @ w.T, atol=1e-4, rtol=1e-5)\n"
    )
    env = {**os.environ, "GPTOSS_LITE_NO_CPP_OPS": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@needs_cxx
def test_use_cpp_switches_a_compiled_graph_between_the_implementations(monkeypatch):
    # The switch works through the dispatcher, so a graph compiled with the C++ ops bound runs the Python
    # ones after use_cpp(False) (no recompiling), with the same output; use_cpp(True) brings them back.
    x, w = torch.randn(4, 128), torch.randn(160, 128)
    lib = rows._library()
    step = torch.compile(lambda x, w: torch.ops.gptoss_lite.rows_mm(x, w, None) * 2, fullgraph=True)
    want = step(x, w)
    calls = []

    def counted():  # the Python implementation asks for the library on every call
        calls.append(1)
        return lib

    monkeypatch.setattr(rows, "_library", counted)
    try:
        assert torch.equal(step(x, w), want) and not calls  # C++ served
        assert cpp_ops.use_cpp(False) == frozenset()
        assert "ops.cpp" not in _cpu_kernel("rows_mm")
        assert torch.equal(step(x, w), want) and len(calls) == 1  # the Python implementation served
    finally:
        assert "rows_mm" in cpp_ops.use_cpp(True)
    assert "ops.cpp" in _cpu_kernel("rows_mm") and torch.equal(step(x, w), want) and len(calls) == 1


def test_a_failed_cpp_build_says_so_and_keeps_the_python_implementations(tmp_path):
    # `false` stands for a C++ compiler that fails: one line on stderr, nothing half-written in the
    # cache, and the ops still answer (the C kernels build with the C compiler as before).
    script = (
        "import torch\n"
        "from gptoss_lite.kernels import cpp_ops, rows\n"
        "x, w = torch.randn(3, 64), torch.randn(64, 64)\n"
        "torch.testing.assert_close(torch.ops.gptoss_lite.rows_mm(x, w, None), x @ w.T, atol=1e-4, rtol=1e-5)\n"
        "assert cpp_ops.bound() == frozenset(), cpp_ops.bound()\n"
    )
    env = {**os.environ, "CXX": "false", "GPTOSS_LITE_KERNEL_DIR": str(tmp_path)}
    env.pop("GPTOSS_LITE_NO_CPP_OPS", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if os.environ.get("GPTOSS_LITE_NO_KERNELS") != "1" and shutil.which("cc"):
        assert "building the ops kernels failed" in done.stderr and "through Python" in done.stderr
    built = [p.name for p in tmp_path.rglob("*.so")]
    assert "libops.so" not in built and all(name.startswith("lib") for name in built), built  # no temporary left


@needs_cxx
@pytest.mark.skipif(not mxfp4.gate_up_act_available(), reason="the one-pass gate|up activation needs AVX-512")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_gate_up_act_cpp_equals_python(dtype):
    blocks_, scales, x, experts, bias = _mxfp4_case(7, dtype, 130)  # weights that keep gates near the clamp
    assert "mxfp4_gate_up_act" in cpp_ops.bound()
    cpp, py = torch.ops.gptoss_lite.mxfp4_gate_up_act, mxfp4.gate_up_act._init_fn
    for b in (bias, bias.bfloat16(), None):
        for swiglu, int8 in ((True, False), (False, False), (False, True)):
            got = cpp(x, blocks_, scales, experts, b, swiglu, 7.0, int8)
            assert got.dtype == dtype and torch.equal(got, py(x, blocks_, scales, experts, b, swiglu, 7.0, int8))
    with pytest.raises(ValueError, match="expert ids"):
        cpp(x, blocks_, scales, experts + 2, bias, True, 7.0, False)
    for bad in ((x.half(), blocks_, scales), (x, blocks_[:, :39], scales[:, :39])):  # fp16 rows; an odd R
        for op in (cpp, py):
            with pytest.raises(ValueError, match="gate_up_act"):
                op(*bad, experts, None, True, 7.0, False)
