"""GPTOSS_LITE_CPU=avx2: an AVX2-only CPU's paths on a wider CPU (kernels built for -march=haswell, the
flags Python decides by cut to what such a CPU has)."""

import json
import os
import platform
import shutil
import subprocess
import sys

import pytest

from gptoss_lite.kernels import build


def test_native_is_the_cpu_as_it_is(monkeypatch):
    monkeypatch.delenv("GPTOSS_LITE_CPU", raising=False)
    assert build.cpu_flags() == (build._cpu_flags() or None)
    assert build.kernel_flags() == build.FLAGS
    monkeypatch.setenv("GPTOSS_LITE_CPU", "native")
    assert build.kernel_flags() == build.FLAGS


def test_avx2_leaves_out_what_an_avx2_cpu_lacks(monkeypatch):
    wide = "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16 amx_tile avx_vnni f16c"
    monkeypatch.setattr(build, "_cpu_flags", lambda: wide)
    monkeypatch.setenv("GPTOSS_LITE_CPU", "avx2")
    assert build.cpu_flags() == "flags\t\t: fpu sse2 avx avx2 fma f16c"
    assert "-march=haswell" in build.kernel_flags() and "-march=native" not in build.kernel_flags()


@pytest.mark.parametrize("flags", ["flags\t\t: fpu sse2 sse4_2", ""])
def test_avx2_on_a_cpu_without_it_is_a_clear_error(monkeypatch, flags):
    """Kernels built for haswell would stop the process with an illegal instruction there (or where no
    flags can be read)."""
    monkeypatch.setattr(build, "_cpu_flags", lambda: flags)
    monkeypatch.setenv("GPTOSS_LITE_CPU", "avx2")
    with pytest.raises(ValueError, match="this one has no AVX2 and FMA"):
        build.kernel_flags()


def test_an_unknown_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("GPTOSS_LITE_CPU", "avx1024")
    with pytest.raises(ValueError, match="GPTOSS_LITE_CPU must be one of native, avx2, not 'avx1024'"):
        build.kernel_flags()
    with pytest.raises(ValueError, match="GPTOSS_LITE_CPU"):
        build.cpu_flags()


_PROBE = """
import json
from gptoss_lite.kernels import bf16, moe, prefill, report, rows
from gptoss_lite.model import matmul
print(json.dumps({"prefill": prefill.available(), "moe": list(moe.dtypes()), "bf16": bf16.available(),
                  "rows": rows._library().isa, "avx512": matmul.cpu_has_avx512(),
                  "native_bf16": matmul.cpu_has_native_bf16(), "report": report()}))
"""


@pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which("gcc") is None or " avx2" not in (build._cpu_flags() or ""),
    reason="needs gcc on an x86-64 CPU with AVX2",
)
def test_a_process_under_avx2_takes_the_avx2_paths(tmp_path):
    """Every kernel is built for haswell (no AVX-512 path: the prefill attention and the grouped experts
    are unavailable, the rows kernel and the bf16 GEMV take their AVX2 paths), and the model's rules read
    no AVX-512 and no native bf16."""
    env = {**os.environ, "GPTOSS_LITE_CPU": "avx2", "GPTOSS_LITE_KERNEL_DIR": str(tmp_path)}
    env.pop("GPTOSS_LITE_NO_KERNELS", None)
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    got = json.loads(done.stdout)
    said = got.pop("report")
    assert got == {
        "prefill": False, "moe": [], "bf16": True, "rows": "AVX2", "avx512": False, "native_bf16": False,
    }  # fmt: skip
    # and the report says so
    assert said["built for"] == "-march=haswell (GPTOSS_LITE_CPU=avx2)"
    assert (said["mxfp4"], said["blocks"], said["bf16"]) == ("AVX2 + FMA",) * 3 and said["rows"] == "AVX2"
    assert said["prefill"] == "a stub (no AVX-512)"
    assert said["moe"].startswith("grouped experts: none;")
    assert said["norm"] == said["rope"] == "plain C vectorised for -march=haswell"


def test_the_report_says_what_this_process_takes():
    """`report()` as `python -m gptoss_lite.kernels` prints it: every kernel named, and each answer the one
    its module gives (off under GPTOSS_LITE_NO_KERNELS=1, as CI's second run has it)."""
    from gptoss_lite.kernels import prefill, report, rows

    said = report()
    assert list(said) == ["built for", "PyTorch", "mxfp4", "bf16", "rows", "blocks", "prefill", "moe", "norm",
                          "rope", "C++ ops"]  # fmt: skip
    if os.environ.get("GPTOSS_LITE_NO_KERNELS") == "1":
        assert all(said[k].startswith("off: GPTOSS_LITE_NO_KERNELS=1") for k in ("mxfp4", "bf16", "rows", "moe"))
        return
    lib = rows._library()
    if lib is not None:
        assert said["rows"].startswith(lib.isa)
    assert (said["prefill"] == "AVX-512") == prefill.available()
    main = subprocess.run([sys.executable, "-m", "gptoss_lite.kernels"], capture_output=True, text=True, check=True)
    assert "built for" in main.stdout and "prefill" in main.stdout
