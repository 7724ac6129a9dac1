"""gpt-oss-20b on this CPU: ours (MXFP4 experts kept packed) against llama.cpp on the same weights.

    python benchmarks/gptoss20b_cpu.py write [--dir DIR]   # ~13 GB seeded random gpt-oss-20b, released layout
    python benchmarks/gptoss20b_cpu.py gguf --hf-python VENV/bin/python --converter LLAMA_CPP/convert_hf_to_gguf.py
    python benchmarks/gptoss20b_cpu.py run --llama-python LLAMA_VENV/bin/python --rounds 3 \\
        --lengths 512 4096 8192 --out benchmarks/results/gptoss20b_cpu.json

`write` makes what a user downloads from the Hub, with random values: config.json of gpt-oss-20b
(the `gpt-oss-20b` preset through `config_to_hf`, plus the MXFP4 quantization_config), three
safetensors shards with their index (MXFP4 `*_blocks` / `*_scales` uint8 experts with gate and up
interleaved, every other tensor bf16), generation_config.json, and a byte-level BPE tokenizer.json of
exactly 201,088 ids (the 256 bytes, every byte pair, then byte triples: the benchmark feeds token
ids, so the vocabulary never affects a number; llama.cpp's converter and our CLI need one). Dense
weights are N(0, 0.02), biases and sinks N(0, 0.1); codes are uniform and scales 2^-9..2^-6, so
expert weights have a spread like the dense ones. Seeded: the same bytes every time. One shard is
built in memory at a time (~4.5 GB) and written atomically.

`gguf` runs llama.cpp's own `convert_hf_to_gguf.py` (from the llama-cpp-python sdist's
`vendor/llama.cpp`, with a Python that has torch, transformers and the sdist's `gguf-py`) on that
directory, with `--outtype bf16`: its gpt-oss converter keeps the MXFP4 experts as MXFP4 and writes
the rest in bf16, the same bytes we load. The one change to its behaviour: an unknown BPE
pre-tokenizer hash (ours is synthetic) is read as "gpt-2", the split the tokenizer was built with.

`run` measures the engines (`--engines`) in one sitting, 2 threads, rounds alternating the order. The
engines run one at a time, each in a worker process of its own, because two 20b models do not fit in
24 GB together: `ours` (`ours_worker.py --mode static`: `generate()`, MXFP4 experts packed),
`ours-compiled` (the same with the compiled decode step), `ours-engine` (the batched engine, its
compiled step, one request at a time), `ours-compiled-int8` and `ours-engine-int8` (those two with the
opt-in int8-activation experts, `--mxfp4-activations int8`: results change by that rounding) and
`llama.cpp` (`llama_worker.py`: llama-cpp-python over the GGUF). Per round and engine: load (process
start to ready, page cache as the other engine left it), one untimed warm-up with a prompt as long as
the shortest cell (so that every expert's pages are in memory), then for each prompt length L of `--lengths` (prompt
`numpy.random.default_rng(L).integers(1, 200000, L)`) a 1-token request (TTFT) and a `--new-tokens`
request: prefill tok/s = L / TTFT, decode tok/s at context L = (new - 1) / (its end - its first
token), both times taken inside that one request (two requests' prefills differ by more than a
whole decode takes). Peak RSS is the worker's VmHWM. The table gives medians over rounds, ours / llama.cpp, and
for decode the bytes a token reads (`decode_bytes`) with the GB/s that implies, beside this machine's
read bandwidth (before each round the median of 5 passes of `torch.sum` over 2 GiB, 2 threads; the
median over rounds); then each of ours / llama.cpp round by round with their median (engines of one
round ran minutes apart, where the medians over rounds compare figures up to half an hour apart), and
each round's read bandwidth (the memory's rate moves by ±15% in a sitting). Around each decode the
driver also reads 256 MiB with `torch.sum` just before and just after it; the table gives each
engine's decode GB/s over the mean of those two, round by round (the share of that minute's memory
rate a token used), and ours / llama.cpp of those shares. On Zen 5 those shares spread as widely as
the raw ratios (one engine 0.63-1.02 within a sitting): a 256 MiB sum does not track what a decode
meets, so they are context, not a correction. `table --out FILE` prints the same from a results file.

The default directory is `$XDG_CACHE_HOME/gptoss-lite/gpt-oss-20b-random` (~/.cache/...), outside
the repository; the GGUF goes beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from gptoss_lite.checkpoint.hf import MXFP4_QUANTIZATION_CONFIG, config_to_hf, hf_shapes
from gptoss_lite.config import PRESETS

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gptoss-lite"
DEFAULT_DIR = CACHE / "gpt-oss-20b-random"
SHARDS = 3
HERE = Path(__file__).resolve().parent


def _tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("_blocks"):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    if name.endswith("_scales"):
        return torch.randint(127 - 9, 127 - 5, shape, dtype=torch.uint8, generator=gen)
    if name.endswith("norm.weight") or "layernorm" in name:
        return torch.ones(shape, dtype=torch.bfloat16)
    std = 0.1 if name.endswith(("bias", "sinks")) else 0.02
    return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)


def _tokenizer(vocab_size: int) -> dict:
    """tokenizer.json of a byte-level BPE with exactly `vocab_size` ids, built without training."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    alphabet.sort()
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = []
    pairs = [(a, b) for a in alphabet for b in alphabet]
    for a, b in pairs:
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    for a, b in pairs:  # triples (ab, c): each string made once
        for c in alphabet:
            if len(vocab) == vocab_size:
                break
            vocab[a + b + c] = len(vocab)
            merges.append((a + b, c))
        if len(vocab) == vocab_size:
            break
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    assert tok.get_vocab_size() == vocab_size
    return json.loads(tok.to_str())


def write(directory: Path, seed: int = 0) -> None:
    cfg = PRESETS["gpt-oss-20b"]
    shapes = hf_shapes(cfg, mxfp4=True)
    if (directory / "config.json").is_file():
        print(f"{directory}: already written", file=sys.stderr)
        return
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    tmp.chmod(0o755)
    try:
        gen = torch.Generator().manual_seed(seed)
        per_shard = -(-cfg.n_layers // SHARDS)
        groups: list[list[str]] = [[] for _ in range(SHARDS)]
        for name in shapes:
            if name.startswith("model.layers."):
                groups[int(name.split(".")[2]) // per_shard].append(name)
            else:
                groups[0 if name.startswith("model.embed") else SHARDS - 1].append(name)
        weight_map, total = {}, 0
        for i, names in enumerate(groups, start=1):
            t0 = time.perf_counter()
            fname = f"model-{i:05d}-of-{SHARDS:05d}.safetensors"
            tensors = {n: _tensor(n, shapes[n], gen) for n in names}
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            (tmp / fname).chmod(0o644)
            del tensors
            weight_map.update({n: fname for n in names})
            total += size
            print(
                f"{fname}: {len(names)} tensors, {size / 1e9:.2f} GB, {time.perf_counter() - t0:.0f} s", file=sys.stderr
            )
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
        config = config_to_hf(cfg)
        config.update(
            dtype="bfloat16",
            quantization_config=dict(MXFP4_QUANTIZATION_CONFIG),
            eos_token_id=200002,
            pad_token_id=199999,
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": [200002, 199999, 200012]}, indent=2))
        (tmp / "tokenizer.json").write_text(json.dumps(_tokenizer(cfg.vocab_size)))
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"{directory}: {total / 1e9:.2f} GB of weights", file=sys.stderr)


# ---- gguf --------------------------------------------------------------------------------------------

_CONVERT = """
import logging, runpy, sys
from pathlib import Path
script = Path(sys.argv[1])
sys.path[:0] = [str(script.parent), str(script.parent / "gguf-py")]
from conversion import base
original = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        logging.warning("unknown BPE pre-tokenizer hash: using 'gpt-2', the split of the synthetic tokenizer")
        return "gpt-2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [str(script), *sys.argv[2:]]
runpy.run_path(str(script), run_name="__main__")
"""


def gguf_path(directory: Path) -> Path:
    return directory.with_suffix(".gguf")


def gguf(directory: Path, hf_python: str, converter: Path) -> None:
    out = gguf_path(directory)
    if out.is_file():
        print(f"{out}: already converted", file=sys.stderr)
        return
    tmp = out.with_suffix(".gguf.tmp")
    cmd = [hf_python, "-c", _CONVERT, str(converter), str(directory), "--outtype", "bf16", "--outfile", str(tmp)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    os.replace(tmp, out)
    print(f"{out}: {out.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


# ---- run ---------------------------------------------------------------------------------------------


def decode_bytes(context: int) -> dict[str, float]:
    """Bytes one decode token reads at `context` tokens: dense weights in bf16, the top-4 of 32 experts
    in MXFP4 (4.25 bits per weight), the K/V of each layer's window (bf16)."""
    cfg = PRESETS["gpt-oss-20b"]
    C, H, K, D, I = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.expert_hidden
    per_layer_attn = (C * H * D * 2 + C * 2 * K * D) * 2
    per_layer_experts = cfg.top_k * (3 * C * I) * 4.25 / 8
    router = C * cfg.n_experts * 2
    kv = sum(min(context, cfg.sliding_window if cfg.is_sliding(i) else context) for i in range(cfg.n_layers))
    parts = {
        "attention": cfg.n_layers * (per_layer_attn + router),
        "experts": cfg.n_layers * per_layer_experts,
        "head": cfg.vocab_size * C * 2,
        "kv": kv * 2 * K * D * 2,
    }
    parts["total"] = sum(parts.values())
    return parts


def read_bandwidth(threads: int, numel: int = 2**29) -> float:
    """GB/s of the median of 5 passes of torch.sum over `numel` fp32 (2 GiB; after one untimed pass)."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(numel)
    float(x.sum())
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        float(x.sum())
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


PROBE = 2**26  # fp32 elements of the read probe around each decode: 256 MiB, 8x the last-level cache here


def decode_efficiency(result: dict, engine: str, L: int) -> list[float]:
    """Per round, the GB/s engine's decode at L implies (`decode_bytes`) over the mean of the read rates
    measured just before and after it: how much of the memory's rate of that minute a token used.
    Empty for a results file without those probes."""
    b = result["decode_bytes"][L]["total"]
    rows = sorted((s for s in result["samples"] if s["engine"] == engine), key=lambda s: s["round"])
    cells = [s["cells"][L] for s in rows if "read_gb_s_around_decode" in s["cells"][L]]
    return [c["decode_tok_s"] * b / 1e9 / statistics.mean(c["read_gb_s_around_decode"]) for c in cells]


def _peak_rss_gib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


# Our engines: `generate()` with the eager or the compiled decode step, and the batched engine (`LLM`)
# with its compiled step, one request at a time.
OURS = {
    "ours": ["--mode", "static"],
    "ours-compiled": ["--mode", "static", "--compile"],
    "ours-engine": ["--mode", "engine", "--compile"],
    # the opt-in int8-activation experts (results change by that rounding: docs/mxfp4.md)
    "ours-compiled-int8": ["--mode", "static", "--compile", "--mxfp4-activations", "int8"],
    "ours-engine-int8": ["--mode", "engine", "--compile", "--mxfp4-activations", "int8"],
}


def _worker(engine: str, args: argparse.Namespace, max_len: int, log: Path):
    sys.path.insert(0, str(HERE))
    from serve_vs_vllm import Worker

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if engine in OURS:
        cmd = [sys.executable, str(HERE / "ours_worker.py"), str(args.dir), *OURS[engine]]
        cmd += ["--dtype", "bfloat16", "--threads", str(args.threads), "--max-model-len", str(max_len)]
        # one request at a time, in a KV pool of about two requests (24 layers x 8 heads x 64 x 2 x
        # 2 bytes: 48 KiB a token)
        cmd += ["--max-batch-tokens", str(min(512, max_len))]
        cmd += ["--kv-cache-mib", str(max(64, max_len * 48 // 1024 * 2))]
    else:
        env.pop("PYTHONPATH", None)
        cmd = [args.llama_python, str(HERE / "llama_worker.py"), str(gguf_path(args.dir)), "--dtype", "bfloat16"]
        cmd += ["--threads", str(args.threads), "--max-model-len", str(max_len)]
    return Worker(engine, cmd, env, log)


def machine() -> dict:
    """What ran the sitting, for the results file: `lscpu`, the commit, when it finished (UTC)."""

    def out(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, cwd=HERE, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {"lscpu": out(["lscpu"]), "commit": out(["git", "rev-parse", "HEAD"]), "finished_utc": stamp}


def run(args: argparse.Namespace) -> dict:
    engines = [e for e in args.engines if e != "llama.cpp" or args.llama_python]
    max_len = max(args.lengths) + args.new_tokens + 8
    logs = Path(tempfile.mkdtemp(prefix="gptoss20b-"))
    samples: list[dict] = []
    print(f"worker logs in {logs}", file=sys.stderr)
    round_bandwidth = []
    for r in range(args.rounds):
        round_bandwidth.append(read_bandwidth(args.threads))  # the memory's rate moves between rounds
        print(f"round {r}: read bandwidth {round_bandwidth[-1]:.1f} GB/s", file=sys.stderr)
        for engine in engines if r % 2 == 0 else engines[::-1]:
            t0 = time.perf_counter()
            worker = _worker(engine, args, max_len, logs / f"{engine}-{r}.log")
            try:
                info = worker.expect("READY")
                load_s = time.perf_counter() - t0
                # warm-up, untimed: a prompt as long as the shortest cell, so that every expert's
                # pages are in memory (both engines map their files) before anything is timed, and
                # enough new tokens that a compiled decode step is compiled (or loaded from the cache)
                warm = min(args.lengths)
                worker.run([[int(t) for t in np.random.default_rng(warm + 1).integers(1, 200000, warm)]], 3)
                row = {"round": r, "engine": engine, "info": info, "load_s": load_s, "cells": {}}
                for L in args.lengths:
                    prompt = [int(t) for t in np.random.default_rng(L).integers(1, 200000, L)]
                    first = worker.run([prompt], 1)
                    # the memory's rate just before and after the decode (seconds apart, where rounds are
                    # minutes apart): 256 MiB, so that it fits beside a worker holding a 20b model
                    around = [read_bandwidth(args.threads, PROBE)]
                    whole = worker.run([prompt], args.new_tokens)
                    around.append(read_bandwidth(args.threads, PROBE))
                    in_request = whole["wall_s"] - whole["first_token_s"][0]  # decode, inside one request
                    row["cells"][L] = {
                        "prefill_tok_s": L / first["wall_s"],
                        "decode_tok_s": (args.new_tokens - 1) / in_request,
                        "ttft_s": first["wall_s"],
                        "whole_s": whole["wall_s"],
                        "first_token_s": whole["first_token_s"][0],
                        "tokens": whole["tokens"][0],
                        "read_gb_s_around_decode": around,
                    }
                    print(
                        f"round {r} {engine} L={L}: {row['cells'][L]['prefill_tok_s']:.1f} prefill, "
                        f"{row['cells'][L]['decode_tok_s']:.2f} decode tok/s",
                        file=sys.stderr,
                    )
                row["peak_rss_gib"] = _peak_rss_gib(worker.proc.pid)
            finally:
                worker.close()
            print(f"round {r} {engine}: load {load_s:.0f} s, peak RSS {row['peak_rss_gib']:.1f} GiB", file=sys.stderr)
            samples.append(row)
    return {
        "machine": machine(),
        "bandwidth_gb_s": statistics.median(round_bandwidth),
        "round_bandwidth_gb_s": round_bandwidth,
        "threads": args.threads,
        "lengths": args.lengths,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "samples": samples,
        "decode_bytes": {L: decode_bytes(L) for L in args.lengths},
    }


def table(result: dict) -> str:
    seen = {s["engine"] for s in result["samples"]}
    engines = [e for e in [*OURS, "llama.cpp"] if e in seen]
    ours = [e for e in engines if e in OURS]
    vs = "llama.cpp" in seen

    def med(engine: str, key: str, L: int | None = None) -> float:
        rows = [s for s in result["samples"] if s["engine"] == engine]
        return statistics.median(s[key] if L is None else s["cells"][L][key] for s in rows)

    lines = [
        "| figure | " + " | ".join(engines) + " |" + "".join(f" {e} / llama.cpp |" for e in ours if vs),
        "|---|" + "---:|" * (len(engines) + len(ours) * vs),
    ]

    def add(label: str, values: list[float], fmt: str) -> None:
        ratios = "".join(f" {v / values[-1]:.2f}× |" for v in values[: len(ours)]) if vs else ""
        lines.append(f"| {label} | " + " | ".join(format(v, fmt) for v in values) + " |" + ratios)

    add("load s", [med(e, "load_s") for e in engines], ".0f")
    add("peak RSS GiB", [med(e, "peak_rss_gib") for e in engines], ".1f")
    for L in result["lengths"]:
        add(f"prefill tok/s, {L} tokens", [med(e, "prefill_tok_s", L) for e in engines], ".1f")
        add(f"decode tok/s at {L}", [med(e, "decode_tok_s", L) for e in engines], ".2f")
    bw = result["bandwidth_gb_s"]
    for L in result["lengths"]:
        b = result["decode_bytes"][L]["total"]
        gbs = ", ".join(f"{e} {med(e, 'decode_tok_s', L) * b / 1e9:.1f} GB/s" for e in engines)
        lines.append(f"\ndecode at {L}: {b / 1e9:.2f} GB per token: {gbs} (machine: {bw:.1f} GB/s read)")
    if vs:
        lines.append("")
        for L in result["lengths"]:
            for key, label in (("prefill_tok_s", "prefill"), ("decode_tok_s", "decode")):
                for e in ours:
                    r = per_round_ratios(result, e, key, L)
                    listed = ", ".join(f"{x:.2f}" for x in r)
                    median = statistics.median(r)
                    lines.append(f"{label} at {L}, {e} / llama.cpp per round: {listed} (median {median:.2f})")
    for L in result["lengths"]:
        shares = {e: decode_efficiency(result, e, L) for e in engines}
        if not all(shares.values()):
            continue
        lines.append("")
        rows = [(f"{e}: GB/s over the read rate around it", shares[e]) for e in engines]
        rows += [
            (f"{e} / llama.cpp of those shares", [a / b for a, b in zip(shares[e], shares["llama.cpp"])])
            for e in (ours if vs else [])
        ]
        for label, values in rows:
            listed = ", ".join(f"{x:.2f}" for x in values)
            lines.append(f"decode at {L}, {label}, per round: {listed} (median {statistics.median(values):.2f})")
    if result.get("round_bandwidth_gb_s"):
        lines.append("read bandwidth per round, GB/s: " + ", ".join(f"{x:.1f}" for x in result["round_bandwidth_gb_s"]))
    return "\n".join(lines)


def per_round_ratios(result: dict, engine: str, key: str, L: int) -> list[float]:
    """engine's figure `key` at length L over llama.cpp's in the same round, round by round: the two ran
    minutes apart, where the medians over rounds compare figures up to half an hour apart."""
    cells = {(s["round"], s["engine"]): s["cells"][L] for s in result["samples"]}
    rounds = sorted({r for r, e in cells if e == engine} & {r for r, e in cells if e == "llama.cpp"})
    return [cells[(r, engine)][key] / cells[(r, "llama.cpp")][key] for r in rounds]


def load_results(path: Path) -> dict:
    """A `run --out` file, its lengths (JSON object keys, so strings there) back to ints."""
    result = json.loads(path.read_text())
    for sample in result["samples"]:
        sample["cells"] = {int(L): cell for L, cell in sample["cells"].items()}
    result["decode_bytes"] = {int(L): b for L, b in result["decode_bytes"].items()}
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["write", "gguf", "run", "table"])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-python", help="gguf: Python with torch + transformers for the converter")
    parser.add_argument("--converter", type=Path, help="gguf: llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--llama-python", help="run: Python of a venv with llama-cpp-python (else ours alone)")
    parser.add_argument(
        "--engines",
        nargs="+",
        default=["ours", "ours-engine", "llama.cpp"],
        choices=[*OURS, "llama.cpp"],
        help="run: which engines (default: ours ours-engine llama.cpp)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 4096, 8192])
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--out", type=Path, help="run: write every sample as JSON; table: read them")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.what == "write":
        write(args.dir, args.seed)
    elif args.what == "table":
        if not (args.out and args.out.is_file()):
            parser.error("table needs --out, a results file that `run --out` wrote")
        print(table(load_results(args.out)))
    elif args.what == "gguf":
        if not (args.hf_python and args.converter):
            parser.error("gguf needs --hf-python and --converter")
        gguf(args.dir, args.hf_python, args.converter)
    else:
        if not (args.dir / "config.json").is_file():
            parser.error(f"{args.dir}: no checkpoint; run `write` first")
        result = run(args)
        print(table(result))
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
