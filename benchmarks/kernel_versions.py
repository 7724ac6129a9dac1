"""A kernel source as another commit has it beside this checkout's, both built in one folder, for the
scripts that time two versions of one kernel in one process (`prefill_attention_ab.py`,
`bf16_gemv_ab.py`). Run from those scripts (their folder is on `sys.path`)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(source: str, folder: Path, name: str) -> ctypes.CDLL:
    """`source` (C text) built with the project's flags (`kernels.build.FLAGS`; the kernels' folder on the
    include path, for vec.h) into folder/name.so, loaded."""
    from gptoss_lite.kernels.build import _HERE, FLAGS, _compiler

    src = folder / f"{name}.c"
    src.write_text(source)
    out = folder / f"{name}.so"
    flags = [f for f in FLAGS if f != "-shared"]
    subprocess.run([_compiler(), *flags, "-shared", "-I", str(_HERE), str(src), "-o", str(out), "-lm"], check=True)
    return ctypes.CDLL(str(out))


def base_and_here(revision: str, kernel: str, folder: Path) -> list[ctypes.CDLL]:
    """[kernels/`kernel`.c at git `revision`, this checkout's], built; exits with a message (status 2)
    where the revision has no such file."""
    path = f"src/gptoss_lite/kernels/{kernel}.c"
    base = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=ROOT, capture_output=True, text=True)
    if base.returncode:
        print(f"no {path} at {revision}: {base.stderr.strip()}", file=sys.stderr)
        raise SystemExit(2)
    return [build(base.stdout, folder, "base"), build((ROOT / path).read_text(), folder, "here")]
