"""Shared fixtures: tiny seeded models on CPU in fp32; and no test reaches the network."""

import ctypes
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gptoss_lite.fixtures import resolve_config
from gptoss_lite.model import GPTOSS
from gptoss_lite.model.compiled_decode import use_inductor_cache_per_isa

# Every graph a test compiles (not only the model's decode step) is cached per vector ISA: a run under
# ATEN_CPU_CAPABILITY=avx2 must not load graphs generated for AVX-512 (model/compiled_decode.py).
use_inductor_cache_per_isa()

# One intra-op thread: tiny models gain nothing from two, and on a shared 2-core machine (CI, or a
# developer training in the background) oversubscribed OpenMP threads make tests 10x slower.
torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): one worker per core this process may use, at most 4.

    Each worker runs on one thread (above), so two workers on 2 cores halve the suite. More than 4
    gains little (a few long files set the end) and multiplies the memory of the model fixtures."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores))


def make_model(preset: str = "lite-tiny", seed: int = 0, **changes) -> GPTOSS:
    """A tiny model with non-trivial sinks and biases (so sink/bias bugs cannot hide behind zeros)."""
    cfg = resolve_config(preset).replace(**changes) if changes else resolve_config(preset)
    torch.manual_seed(seed)
    model = GPTOSS(cfg)
    model.reset_parameters(seed)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen) * 2)
            elif "bias" in name.rsplit(".", 1)[-1]:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            elif "norm" in name:
                p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.1)
    return model.prepare_for_inference()


# what a CPU needs to run a build for `-march=ARCH` (a build that is only loaded runs anywhere)
_ARCH_NEEDS = {"x86-64": (), "haswell": ("avx2", "fma"), "skylake-avx512": ("avx512f",)}


def build_kernel_for(kernel: str, arch: str, folder: Path, *, run: bool = True, flags: tuple[str, ...] = ()):
    """kernels/`kernel`.c built for another CPU than this one (`-march=arch`: x86-64 for the plain-C paths,
    haswell for AVX2 without AVX-512, skylake-avx512 for AVX-512 without BF16) into folder, loaded. The
    test is skipped without gcc on x86-64, and, when it will `run` the build's code, where this CPU
    lacks what the build needs."""
    from gptoss_lite.kernels.build import _HERE, cpu_flags

    if platform.machine() != "x86_64" or shutil.which("gcc") is None:
        pytest.skip("needs gcc on x86-64")
    cpu = cpu_flags() or ""
    if run and not all(f" {flag}" in cpu for flag in _ARCH_NEEDS[arch]):
        pytest.skip(f"this CPU cannot run a build for {arch}")
    lib = folder / f"{kernel}-{arch}.so"
    cmd = ["gcc", "-O3", f"-march={arch}", "-fopenmp", "-fPIC", "-shared", "-std=c11", *flags, "-I", str(_HERE)]
    subprocess.run([*cmd, str(_HERE / f"{kernel}.c"), "-o", str(lib), "-lm"], check=True)
    return ctypes.CDLL(str(lib))


@pytest.fixture
def tiny_model() -> GPTOSS:
    return make_model("lite-tiny")


@pytest.fixture
def tiny_gptoss() -> GPTOSS:
    return make_model("gpt-oss-tiny")


# ---- no network -------------------------------------------------------------------------------------------
# The package must run offline (nothing downloads weights, vocabularies or data), so no test may open a
# socket to anything but this machine. Every connect of this process goes through the guard: a
# non-loopback address is refused (nothing leaves the machine) and the test that tried fails, even if
# the code caught the error and went on.

_LOOPBACK_NAMES = {"localhost", "::1", "0:0:0:0:0:0:0:1"}
_network_attempts: list[str] = []
_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex


def _is_local(sock: socket.socket, address) -> bool:
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return True  # Unix sockets (multiprocessing, forkserver)
    host = str(address[0]).strip("[]").lower()
    return host in _LOOPBACK_NAMES or host.startswith("127.") or host.startswith("::ffff:127.")


def _guarded(real):
    def connect(self, address):
        if not _is_local(self, address):
            _network_attempts.append(repr(address))
            raise ConnectionRefusedError(f"tests run offline: a connection to {address!r} was refused")
        return real(self, address)

    return connect


socket.socket.connect = _guarded(_real_connect)  # type: ignore[method-assign]
socket.socket.connect_ex = _guarded(_real_connect_ex)  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _offline():
    """Fails the test that tried to reach a non-loopback address (see above)."""
    start = len(_network_attempts)
    yield
    tried = _network_attempts[start:]
    if tried:
        pytest.fail(f"the test tried to reach the network (refused): {', '.join(tried[:5])}")


@pytest.fixture
def without_kernels():
    """A function that runs a Python script in a fresh interpreter with GPTOSS_LITE_NO_KERNELS=1 (the
    suite's fallback run, a machine without a compiler) and fails the test with the script's stderr if
    it fails."""

    def run(script: str) -> None:
        done = subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "GPTOSS_LITE_NO_KERNELS": "1"},
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr

    return run
