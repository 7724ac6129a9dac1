"""Build a kernel's C source into a shared library once per machine, and load it with ctypes.

The library is cached under `$GPTOSS_LITE_KERNEL_DIR`, else `$XDG_CACHE_HOME/gptoss-lite/kernels`,
else `~/.cache/gptoss-lite/kernels`, in a folder named by a hash of the source, the compiler's
version, the flags and this CPU's feature flags, so an edited source or another CPU builds anew.
A build writes a temporary file and renames it into place: two processes building at once both
succeed, and a crash leaves no half-written library. Compiling takes about a second.

No compiler or a failed build gives None and one line on stderr; `GPTOSS_LITE_NO_KERNELS=1` gives
None silently (it was asked for). The callers then use their PyTorch fallbacks.

`GPTOSS_LITE_CPU=avx2` takes the paths an AVX2-only CPU takes, on a wider one: every kernel is built for
`-march=haswell`, and `cpu_flags()`, the CPU flags the Python side decides by, leaves out AVX-512, AMX and
AVX-VNNI. Set `ATEN_CPU_CAPABILITY=avx2` and `ONEDNN_MAX_CPU_ISA=AVX2` with it, so that PyTorch's own
kernels do the same (docs/kernels.md#imitating-an-avx2-only-cpu). Unset, or `native`, it changes nothing.

`load_torch_ops` builds a C++ source against torch's own headers (`ops.cpp`: the kernels' torch ops
implemented in C++, so a compiled step calls them without entering Python), keyed also by torch's
version; `GPTOSS_LITE_NO_CPP_OPS=1` leaves the ops' Python implementations in place.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")
_HERE = Path(__file__).resolve().parent

# GPTOSS_LITE_CPU's values: the -march a kernel is built for, and the CPU flags such a CPU lacks
_IMITATE = {
    "native": ("native", None),
    "avx2": ("haswell", re.compile(r"avx512\w*|amx\w*|avx_vnni\w*|avx_ifma|avx_ne_convert")),
}


def imitated() -> str:
    """`GPTOSS_LITE_CPU`: `native` (the default: this CPU as it is) or `avx2` (an AVX2-only CPU); a
    ValueError names the values where it holds another."""
    name = os.environ.get("GPTOSS_LITE_CPU") or "native"
    if name not in _IMITATE:
        raise ValueError(f"GPTOSS_LITE_CPU must be one of {', '.join(_IMITATE)}, not {name!r}")
    if name == "avx2" and not {"avx2", "fma"} <= set(_cpu_flags().partition(":")[2].split()):
        # kernels built for haswell would stop the process with an illegal instruction
        raise ValueError(
            "GPTOSS_LITE_CPU=avx2 takes an AVX2-only CPU's paths on a wider CPU; this one has no AVX2 and FMA"
        )
    return name


def kernel_flags() -> tuple[str, ...]:
    """The compiler flags a kernel is built with: `FLAGS`, for the CPU `GPTOSS_LITE_CPU` names."""
    march = _IMITATE[imitated()][0]
    return tuple(f"-march={march}" if f.startswith("-march=") else f for f in FLAGS)


def cache_dir() -> Path:
    if os.environ.get("GPTOSS_LITE_KERNEL_DIR"):
        return Path(os.environ["GPTOSS_LITE_KERNEL_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "gptoss-lite" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def cpu_flags() -> str | None:
    """The `flags` line of /proc/cpuinfo (None where there is none), less the flags of what
    `GPTOSS_LITE_CPU` says this CPU lacks: what every choice of a path in Python reads."""
    line = _cpu_flags()
    lacks = _IMITATE[imitated()][1]
    if not line or lacks is None:
        return line or None
    head, _, flags = line.partition(":")
    return f"{head}: " + " ".join(f for f in flags.split() if not lacks.fullmatch(f))


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _say(message: str) -> None:
    print(f"gptoss-lite: {message}", file=sys.stderr)


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_text(path: Path, seen: set[Path] | None = None) -> str:
    """A source's text followed by that of every local header it includes (`#include "x.h"`, from its own
    folder, recursively, each once): what a build depends on, so an edited header builds anew too."""
    seen = set() if seen is None else seen
    seen.add(path)
    text = path.read_text()
    parts = [text]
    for header in _LOCAL_INCLUDE.findall(text):
        child = path.parent / header
        if child not in seen and child.is_file():
            parts.append(source_text(child, seen))
    return "\0".join(parts)


def _built(
    name: str, source: Path, compiler: str, flags: list[str], key_parts: tuple[str, ...], fallback: str
) -> Path | None:
    """`source` built by `compiler` with `flags` into lib{name}.so under a folder keyed by the sources, the
    compiler's version, the flags, this CPU and `key_parts`; None (with a notice) where the build fails."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        b"\0".join(x.encode() for x in (source_text(source), version, " ".join(flags), _cpu_flags(), *key_parts))
    ).hexdigest()[:16]
    target = cache_dir() / key / f"lib{name}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        args = [compiler, *flags[:-1], str(source), "-o", tmp, *flags[-1].split()]  # libraries after the source
        done = subprocess.run(args, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(tmp)
            errors = [line for line in (done.stderr or done.stdout).splitlines() if "error" in line]
            reason = errors[0] if errors else compiler
            _say(f"building the {name} kernels failed ({reason}); {fallback}")
            return None
        os.replace(tmp, target)
    return target


@cache
def load(name: str) -> ctypes.CDLL | None:
    """The shared library built from `kernels/NAME.c`, or None (with a notice) where it cannot be built."""
    if os.environ.get("GPTOSS_LITE_NO_KERNELS") == "1":
        return None
    cc = _compiler()
    if cc is None:
        _say(f"no C compiler (cc, gcc or clang) found; the {name} kernels use the slower PyTorch fallback")
        return None
    target = _built(name, _HERE / f"{name}.c", cc, [*kernel_flags(), "-lm"], (), "using the PyTorch fallback")
    if target is None:
        return None
    # torch is imported first, so libgomp.so.1 resolves to the OpenMP runtime torch already loaded.
    import torch  # noqa: F401

    return ctypes.CDLL(str(target))


@cache
def load_torch_ops(name: str) -> ctypes.CDLL | None:
    """`kernels/NAME.cpp`, C++ against this torch's headers and libraries (torch ops implemented in C++),
    built and loaded into torch's dispatcher; None (with a notice) where there is no C++ compiler or the
    build fails, and silently under `GPTOSS_LITE_NO_KERNELS=1` or `GPTOSS_LITE_NO_CPP_OPS=1`. Building
    takes 5-10 s (torch's headers), once per source, torch version and machine."""
    if "1" in (os.environ.get("GPTOSS_LITE_NO_KERNELS"), os.environ.get("GPTOSS_LITE_NO_CPP_OPS")):
        return None
    cxx = next((c for c in (os.environ.get("CXX"), "c++", "g++", "clang++") if c and shutil.which(c)), None)
    if cxx is None:
        _say(f"no C++ compiler (c++, g++ or clang++) found; the {name} ops are called through Python")
        return None
    import torch

    # torch's own headers and libraries (the paths torch.utils.cpp_extension names; importing that module
    # needs setuptools, which a fresh virtual environment may not have)
    root = Path(torch.__file__).resolve().parent
    flags = [
        "-O2", "-fPIC", "-shared", "-std=c++17", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-L{root / 'lib'} -Wl,-rpath,{root / 'lib'} -lc10 -ltorch_cpu",
    ]  # fmt: skip
    target = _built(name, _HERE / f"{name}.cpp", cxx, flags, (torch.__version__,), "calling the ops through Python")
    if target is None:
        return None
    torch.ops.load_library(str(target))
    return ctypes.CDLL(str(target))
