"""Two tenants on one server: does a flood from tenant A starve tenant B, and do shares hold?

Starts `gptoss-lite serve` (a subprocess, so this client's Python does not share the server's
interpreter) on the random `gpt-oss-bench-20m` model with two API keys, then measures:

1. **flood**: B's one streaming request of 16 tokens, alone; then sent 2 s after A opened N streaming
   completions of 200 tokens (default N = 300), under `--admission fcfs` (arrival order, the rule
   before fair sharing) and `--admission fair`. Also A's throughput over its whole flood, and the
   engine's prefill chunk: the time of one step that carries `--max-batch-tokens` prompt tokens
   (the slack the acceptance rule allows B for A's chunk in flight).
2. **shares**: both tenants keep C streams open (C = 2 × max_running each, refilled as they finish)
   for a minute; the generated tokens of each over the minute, read from /metrics, with shares
   1:1 and 3:1.

Every figure is the median of `--rounds` rounds, modes interleaved. Writes a JSON file:

    python benchmarks/serve_fairness.py [--rounds 3] [--flood 300] [--out benchmarks/results/serve_fairness.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

MODEL = "gpt-oss-bench-20m"
KEYS = {"a": "key-a", "b": "key-b"}
ADMIN = "key-admin"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`gptoss-lite serve` in a subprocess on a free loopback port (a context manager)."""

    def __init__(self, extra: list[str], threads: int, max_running: int) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable, "-m", "gptoss_lite.cli", "serve", "--model", MODEL, "--port", str(self.port),
            "--threads", str(threads), "--max-running", str(max_running), "--max-waiting", "4096",
            "--api-key", f"a={KEYS['a']}", "--api-key", f"b={KEYS['b']}", "--admin-key", ADMIN,
            "--log-level", "warning", *extra,
        ]  # fmt: skip

    def __enter__(self) -> Server:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not start in 180 s")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def ids(text: str) -> list[int]:
    """The benchmark model has no tokenizer: prompts go as token ids (the text's bytes)."""
    return [b + 1 for b in text.encode()]


async def stream(client: httpx.AsyncClient, tenant: str, prompt: str, max_tokens: int) -> dict:
    """One streaming completion (greedy, EOS ignored): seconds to finish and tokens generated."""
    body = {
        "model": MODEL, "prompt": ids(prompt), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    t0 = time.perf_counter()
    tokens, status = 0, None
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        status = r.status_code
        async for line in r.aiter_lines():
            if line.startswith('data: {"id"') and '"usage":{' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return {"seconds": time.perf_counter() - t0, "tokens": tokens, "status": status, "end": time.perf_counter()}


def _client(n: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    return httpx.AsyncClient(timeout=600, limits=limits)


async def b_alone(url: str) -> float:
    async with _client(4) as client:
        client.base_url = url
        await stream(client, "b", "warm up", 4)
        return (await stream(client, "b", "Tenant B asks one short question.", 16))["seconds"]


async def flood(url: str, n: int) -> dict:
    """A opens n streams of 200 tokens; 2 s later B sends 16 tokens."""
    async with _client(n) as client:
        client.base_url = url
        t0 = time.perf_counter()
        a_tasks = [asyncio.create_task(stream(client, "a", f"Tenant A request {i}: write on.", 200)) for i in range(n)]
        await asyncio.sleep(2.0)
        b = await stream(client, "b", "Tenant B asks one short question.", 16)
        a = await asyncio.gather(*a_tasks)
    bad = [r["status"] for r in a + [b] if r["status"] != 200]
    if bad:
        raise RuntimeError(f"flood: HTTP statuses {sorted(set(bad))}")
    a_tokens = sum(r["tokens"] for r in a)
    a_wall = max(r["end"] for r in a) - t0
    return {"b_seconds": b["seconds"], "a_tokens": a_tokens, "a_wall_s": a_wall, "a_tokens_per_s": a_tokens / a_wall}


def _tenant_tokens(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).text
    out = {}
    for m in re.finditer(r'^gptoss_tenant_generated_tokens_total\{tenant="([^"]+)"\} ([0-9.e+]+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


async def both_flooding(url: str, per_tenant: int, seconds: float, warmup: float = 10.0) -> dict:
    """Each tenant keeps per_tenant streams open; generated tokens per tenant over `seconds`."""
    stop = asyncio.Event()

    async def keep_open(client, tenant, i):
        while not stop.is_set():
            await stream(client, tenant, f"Tenant {tenant} stream {i}: write on.", 200)

    async with _client(2 * per_tenant) as client:
        client.base_url = url
        tasks = [asyncio.create_task(keep_open(client, t, i)) for t in "ab" for i in range(per_tenant)]
        await asyncio.sleep(warmup)
        before = await asyncio.to_thread(_tenant_tokens, url)
        await asyncio.sleep(seconds)
        after = await asyncio.to_thread(_tenant_tokens, url)
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    got = {t: after.get(t, 0) - before.get(t, 0) for t in "ab"}
    return {"a_tokens": got["a"], "b_tokens": got["b"], "ratio": got["a"] / got["b"] if got["b"] else float("inf")}


def prefill_chunk_seconds(threads: int, max_batch_tokens: int, repeats: int = 5) -> float:
    """Median time of one engine step that prefills max_batch_tokens prompt tokens (one request)."""
    import torch

    from gptoss_lite.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(MODEL, max_batch_tokens=max_batch_tokens, enable_prefix_caching=False)
    times = []
    for r in range(repeats + 1):
        llm.add_request([(r * 7 + i) % 200 + 1 for i in range(max_batch_tokens + 1)], SamplingParams(max_tokens=1))
        t0 = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - t0)
        while llm.has_unfinished():
            llm.step()
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--flood", type=int, default=300, help="A's streaming requests (default: 300)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--share-seconds", type=float, default=60.0)
    p.add_argument("--skip-shares", action="store_true")
    p.add_argument("--out", default="benchmarks/results/serve_fairness.json")
    args = p.parse_args(argv)
    base = ["--max-batch-tokens", str(args.max_batch_tokens)]
    rows: dict[str, list] = {"alone": [], "fcfs": [], "fair": []}
    for rnd in range(args.rounds):
        for mode in ("fcfs", "fair"):
            with Server([*base, "--admission", mode], args.threads, args.max_running) as server:
                if mode == "fair":
                    rows["alone"].append(asyncio.run(b_alone(server.url)))
                    print(f"round {rnd}: B alone {rows['alone'][-1]:.2f} s", flush=True)
                res = asyncio.run(flood(server.url, args.flood))
                rows[mode].append(res)
                print(
                    f"round {rnd}: {mode:4s} B behind A's {args.flood}: {res['b_seconds']:.2f} s; "
                    f"A {res['a_tokens']} tokens at {res['a_tokens_per_s']:.0f} tok/s",
                    flush=True,
                )
    chunk = prefill_chunk_seconds(args.threads, args.max_batch_tokens)
    med = statistics.median
    alone = med(rows["alone"])
    summary = {
        "b_alone_s": alone,
        "b_fcfs_s": med(r["b_seconds"] for r in rows["fcfs"]),
        "b_fair_s": med(r["b_seconds"] for r in rows["fair"]),
        "prefill_chunk_s": chunk,
        "b_fair_bound_s": 2 * alone + chunk,
        "a_fcfs_tok_s": med(r["a_tokens_per_s"] for r in rows["fcfs"]),
        "a_fair_tok_s": med(r["a_tokens_per_s"] for r in rows["fair"]),
    }
    summary["a_fair_over_fcfs"] = summary["a_fair_tok_s"] / summary["a_fcfs_tok_s"]
    print(
        f"B alone {alone:.2f} s | behind the flood: fcfs {summary['b_fcfs_s']:.2f} s, fair {summary['b_fair_s']:.2f} s "
        f"(bound 2 x alone + one {args.max_batch_tokens}-token prefill step {chunk * 1000:.0f} ms = "
        f"{summary['b_fair_bound_s']:.2f} s) | A's throughput fair/fcfs {summary['a_fair_over_fcfs']:.3f}"
    )
    shares = {}
    if not args.skip_shares:
        for label, extra in (("1:1", []), ("3:1", ["--tenant-share", "a=3", "--tenant-share", "b=1"])):
            results = []
            for rnd in range(args.rounds):
                with Server([*base, "--admission", "fair", *extra], args.threads, args.max_running) as server:
                    results.append(asyncio.run(both_flooding(server.url, 2 * args.max_running, args.share_seconds)))
                r = results[-1]
                print(
                    f"shares {label} round {rnd}: A {r['a_tokens']:.0f} B {r['b_tokens']:.0f} tokens, "
                    f"ratio {r['ratio']:.3f}",
                    flush=True,
                )
            shares[label] = {"rounds": results, "median_ratio": med(r["ratio"] for r in results)}
            print(f"shares {label}: median A/B generated-token ratio {shares[label]['median_ratio']:.3f}")
    out = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "threads": args.threads,
        "flood": args.flood,
        "rounds": rows,
        "summary": summary,
        "shares": shares,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")
    return 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


if __name__ == "__main__":
    sys.exit(main())
