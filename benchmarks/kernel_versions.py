"""A kernel source as another commit has it beside this checkout's, both built in one folder, and the
engine's batch cell timed with each, for the scripts that time two versions of one kernel in one
process (`prefill_attention_ab.py`, `bf16_gemv_ab.py`, `block_attention_ab.py`). Run from those
scripts (their folder is on `sys.path`)."""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(source: str, folder: Path, name: str, march: str | None = None) -> ctypes.CDLL:
    """`source` (C text) built with the flags the project builds its kernels with in this process
    (`kernels.build.kernel_flags()`: for the CPU `GPTOSS_LITE_CPU` imitates, else this one; the kernels'
    folder on the include path, for vec.h), or for the CPU `march` names (`haswell`: the AVX2-only
    path), into folder/name.so, loaded."""
    from gptoss_lite.kernels.build import _HERE, _compiler, kernel_flags

    src = folder / f"{name}.c"
    src.write_text(source)
    out = folder / f"{name}.so"
    flags = [f"-march={march}" if march and f.startswith("-march=") else f for f in kernel_flags() if f != "-shared"]
    subprocess.run([_compiler(), *flags, "-shared", "-I", str(_HERE), str(src), "-o", str(out), "-lm"], check=True)
    return ctypes.CDLL(str(out))


def base_and_here(revision: str, kernel: str, folder: Path, march: str | None = None) -> list[ctypes.CDLL]:
    """[kernels/`kernel`.c at git `revision`, this checkout's], built (`build`); exits with a message
    (status 2) where the revision has no such file."""
    path = f"src/gptoss_lite/kernels/{kernel}.c"
    base = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=ROOT, capture_output=True, text=True)
    if base.returncode:
        print(f"no {path} at {revision}: {base.stderr.strip()}", file=sys.stderr)
        raise SystemExit(2)
    return [build(base.stdout, folder, "base", march), build((ROOT / path).read_text(), folder, "here", march)]


@contextmanager
def switched(owner: object, name: str) -> Iterator[Callable[[bool], None]]:
    """For the block, owner.`name` (a function saying whether a kernel serves a call) also asks a setting,
    which the yielded function sets (on: as built; off: never, so callers take the path of a CPU without
    the kernel). The compiled step guards on the setting, so each setting keeps its own graph (the first
    call of each compiles it). The original is put back after."""
    original = getattr(owner, name)
    setting = {"on": True}
    setattr(owner, name, lambda *args: setting["on"] and original(*args))
    try:
        yield lambda on: setting.update(on=on)
    finally:
        setattr(owner, name, original)


def evicting() -> Callable[[], object]:
    """A write of 64 MB, to run before a timed call so that the call finds its inputs out of the caches (as
    the rest of a decode step leaves them)."""
    import torch

    buffer = torch.zeros(16 << 20)
    return lambda: buffer.add_(1.0)


def alternate(
    calls: int, builds: Sequence[Callable[[], object]], before: Callable[[], object] | None = None
) -> list[float]:
    """The median seconds of `builds[0]()` (the base build's call) and of `builds[1]()` (this checkout's)
    over `calls` calls each, alternating, the order swapped every round; `before()` runs untimed before
    each call."""
    times: list[list[float]] = [[], []]
    for r in range(calls):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            if before is not None:
                before()
            t0 = time.perf_counter()
            builds[i]()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def engine_batch(
    use: Callable[[int], None], model_dir: str, dtype: str, rounds: int, llm_kwargs: dict | None = None
) -> dict:
    """The peers' batch cell through `LLM` on model_dir in `dtype` (16 × 256 random prompt tokens × 128 new,
    greedy, the compiled step; `llm_kwargs` for the engine, e.g. a KV format) with build 0 (the base) and
    build 1 (this checkout's), `use(i)` switching the process to build i: one run each first (their
    tokens), then `rounds` rounds of both, the order alternating by round. Wall seconds, the median of the
    per-round ratios base / this, and how many of the 16 requests kept the same tokens (bf16 sums in
    another order may part near-ties on random weights)."""
    import numpy as np
    import torch

    from gptoss_lite.checkpoint import load_model
    from gptoss_lite.engine import LLM, SamplingParams

    model = load_model(model_dir, dtype=getattr(torch, dtype))
    model.prepare_for_inference(compile_decode=True)
    llm = LLM(model, enable_prefix_caching=False, **(llm_kwargs or {}))
    vocab = model.config.vocab_size
    prompts = [np.random.default_rng(10_000 + i).integers(1, vocab, 256).tolist() for i in range(16)]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    tokens = []
    for i in (0, 1):
        use(i)
        tokens.append([o.token_ids for o in llm.generate(prompts, params)])
    walls: list[list[float]] = [[], []]
    for r in range(rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            use(i)
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            walls[i].append(time.perf_counter() - t0)
    ratio = statistics.median(a / b for a, b in zip(*walls))
    same = sum(a == b for a, b in zip(*tokens))
    print(
        f"engine batch-16, {dtype}: base {statistics.median(walls[0]):.3f} s, "
        f"this {statistics.median(walls[1]):.3f} s, base / this {ratio:.3f} (median of {rounds} rounds); "
        f"{same} of 16 requests the same tokens"
    )
    return {"dtype": dtype, "base_s": walls[0], "this_s": walls[1], "median_ratio": ratio, "same_tokens": same}


def save(result: dict, out: Path | None) -> None:
    """result with this machine's `lscpu` and the date added, written to out as JSON (whole or not at all)."""
    result["lscpu"] = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out)


def ab_parser(doc: str, kernel: str, calls: int) -> argparse.ArgumentParser:
    """The arguments the A/B scripts with an engine cell share: --base, --calls, --threads, --engine,
    --rounds, --out."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help=f"git revision whose {kernel}.c is the baseline")
    ap.add_argument("--calls", type=int, default=calls)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", metavar="MODEL_DIR", help="also time the engine's batch cell on this model")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", type=Path)
    return ap
