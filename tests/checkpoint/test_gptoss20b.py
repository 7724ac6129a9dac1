"""Full-size gpt-oss-20b (random weights, the released layout) on this machine: `-m slow`.

Writes the ~13 GB checkpoint with `benchmarks/gptoss20b_cpu.py write` into the user cache the first
time (about two minutes), then loads it as a user would. Peak RSS is the child process's VmHWM.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
pytestmark = pytest.mark.slow

LIMIT_GIB = 16.0


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    import gptoss20b_cpu

    gptoss20b_cpu.write(gptoss20b_cpu.DEFAULT_DIR)
    return gptoss20b_cpu.DEFAULT_DIR


def _peak(script: str) -> dict:
    code = script + (
        "\nimport json\n"
        "peak = [int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')][0] / 2**20\n"
        "print('RESULT ' + json.dumps({'peak_gib': peak, **out}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_20b_loads_packed_and_runs_4096_plus_64_under_16_gib(checkpoint):
    out = _peak(
        "import time, torch\n"
        "from gptoss_lite.checkpoint import load_model\n"
        "from gptoss_lite.generation import generate\n"
        f"model = load_model({str(checkpoint)!r})\n"
        "assert model.mxfp4_experts and model.embed.weight.dtype == torch.bfloat16\n"
        "ids = torch.randint(1, 200000, (1, 4096), generator=torch.Generator().manual_seed(0))\n"
        "t0 = time.perf_counter()\n"
        "new = generate(model, ids, max_new_tokens=64, temperature=0)[0, 4096:]\n"
        "out = {'new': len(new), 'seconds': time.perf_counter() - t0}\n"
    )
    assert out["new"] == 64
    assert out["peak_gib"] <= LIMIT_GIB, out


def test_20b_through_the_cli(checkpoint):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gptoss_lite.cli",
            "generate",
            "--model",
            str(checkpoint),
            "hello",
            "--max-new-tokens",
            "4",
            "--temperature",
            "0",
            "--no-stop",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["new_tokens"] == 4, result
