"""benchmarks/gpu_check.py, dry-run on the CPU: every check passes and reports its figures, with none of
the packages a bare GPU box lacks importable (the server's, the plots', the progress bar's)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What a GPU box here has: torch, numpy, safetensors, tokenizers, PyYAML. Everything else is hidden.
HIDDEN = ("fastapi", "uvicorn", "jinja2", "openai_harmony", "llguidance", "tqdm", "prometheus_client", "pydantic")
HIDDEN += ("starlette", "matplotlib", "anyio", "h11", "scipy", "transformers", "httpx", "openai")

BARE_BOX = f"""
import importlib.abc, importlib.machinery, runpy, sys

class Hide(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name.split(".")[0] in {HIDDEN!r} else None
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {{spec.name!r}} (not on a bare GPU box)", name=spec.name)
    def exec_module(self, module):
        pass

sys.meta_path.insert(0, Hide())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_gpu_check_dry_runs_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    args = ["--device", "cpu", "--lengths", "512", "--trials", "1", "--prompt-tokens", "400", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-c", BARE_BOX, str(REPO / "benchmarks" / "gpu_check.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert set(report["checks"]) == {"exact", "bf16", "generate", "engine", "passkey"}
    assert all(c["ok"] for c in report["checks"].values())
    assert report["checks"]["engine"]["same_as_generate"] == "8/8"
    assert report["checks"]["passkey"]["lengths"][0]["accuracy"] == 1.0
    assert "5 passed, 0 failed" in done.stdout


def test_gpu_check_says_when_there_is_no_gpu():
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "no CUDA device" not in done.stderr:
        assert done.returncode in (0, 1)  # a GPU is here: the check ran
    else:
        assert done.returncode == 2
