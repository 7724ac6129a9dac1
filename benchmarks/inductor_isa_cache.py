"""torch's FX graph cache and the vector ISA: a graph cached by a process that generated AVX-512 code is
loaded, unchanged, by a process whose inductor targets AVX2 (`ATEN_CPU_CAPABILITY=avx2`), and computes
wrong values. The cache key leaves the ISA out. This script shows it in two child processes over one
fresh cache folder; `gptoss_lite.model.compiled_decode.use_inductor_cache_per_isa` is the project's
workaround (one folder per ISA).

    python benchmarks/inductor_isa_cache.py          # prints the max |compiled - eager| of each child

Needs a CPU with AVX-512 (on an AVX2-only CPU both children generate AVX2 code and agree).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

CHILD = """
import torch
torch.manual_seed(0)
def f(x):
    return torch.softmax(x * 2, -1) + x.sum(-1, keepdim=True)
x = torch.randn(5, 1000)
from torch._inductor.cpu_vec_isa import pick_vec_isa
got = torch.compile(f, dynamic=True)(x)
print(f"isa {str(pick_vec_isa()).split()[0]:>7}: max |compiled - eager| = {(got - f(x)).abs().max().item():.3g}")
"""


def main() -> int:
    with tempfile.TemporaryDirectory() as cache:
        for capability in (None, "avx2"):
            env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
            env.update(TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1")
            if capability:
                env["ATEN_CPU_CAPABILITY"] = capability
            print(f"ATEN_CPU_CAPABILITY={capability or '(unset)'}", end="  ", flush=True)
            subprocess.run([sys.executable, "-c", CHILD], env=env, check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
