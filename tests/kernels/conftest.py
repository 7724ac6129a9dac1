"""What the kernel tests share: running a script with the native kernels off, as the suite's fallback
run and a machine without a compiler see them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.fixture
def without_kernels():
    """A function that runs a Python script in a fresh interpreter with GPTOSS_LITE_NO_KERNELS=1 and
    fails the test with the script's stderr if it fails."""

    def run(script: str) -> None:
        done = subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "GPTOSS_LITE_NO_KERNELS": "1"},
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr

    return run
