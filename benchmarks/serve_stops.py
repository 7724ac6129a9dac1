"""Do long stop strings slow streaming? Wall time of --clients concurrent streaming clients without
`stop` (variant A) and with four stop strings of the maximum allowed length (variant B).

Acceptance target: four clients, each with four maximum-length stop strings, finish within 1.25x the
time of the same run without stop strings.

The script starts `gptoss-lite serve --model lite-tiny --port <free port> --threads 1` itself (or
uses --url), sends one greedy probe request, then runs --rounds rounds of A and B interleaved
(A, B, A, B, ...). In each round every client sends --requests streaming /v1/completions requests
one after another (temperature 0, ignore_eos, --max-tokens capped to the context). The stop strings
(--stop-chars long, default protocol.MAX_STOP_CHARS) are long runs that look like text: "a"
repeated, spaces, the prompt repeated, and random lowercase letters, each ended by a character
absent from the probe's output and the prompt, so a naive scan works hardest and no stop fires. B
must generate exactly as many tokens as A (usage chunk), else a stop fired and the run fails.
Prints the per-round wall times, the medians, median(B)/median(A) against --target, generated
tokens/s, time to first text and streamed text events per request (a server that holds back text
that may start a stop string sends fewer); --json prints one JSON object instead.

    python benchmarks/serve_stops.py --clients 4 --requests 2 --max-tokens 1500 --rounds 3

Only loopback servers (127.0.0.1) are ever contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlparse

import httpx
from serve_load import StreamError, sse_events

try:
    from gptoss_lite.server import protocol
except ImportError:  # an installation without the server extras: the limit is only a default then
    protocol = None

MAX_STOP_CHARS = getattr(protocol, "MAX_STOP_CHARS", 4096)
MAX_STOP_STRINGS = getattr(protocol, "MAX_STOP_STRINGS", 4)
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
PROMPT = "The quick brown fox jumps over the lazy dog. The pass key is 52718."
# Characters tried, in order, as the last character of each stop string (the first absent from the probe output).
TERMINATORS = "\x01\x02\x03\x04\x05\x06\x07\x0e\x0f\x10\x11\x12\x13\x14\x15\x16\x17\x18\x19\x1a\u2603\u2604\u2620"


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname
    if host not in LOOPBACK and not (host or "").startswith("127."):
        raise ValueError(f"--url {url}: only loopback servers (127.0.0.0/8, localhost, ::1) may be benchmarked")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command() -> list[str]:
    exe = shutil.which("gptoss-lite")
    return [exe, "serve"] if exe else [sys.executable, "-m", "gptoss_lite.cli", "serve"]


class ServerProcess:
    """`gptoss-lite serve` on a free loopback port as a subprocess (a context manager): waits for
    GET /health == 200, and on exit sends SIGTERM, then SIGKILL after `stop_timeout` seconds.
    Its stdout and stderr go to a log file (a pipe nobody reads would block it)."""

    def __init__(
        self,
        model: str = "lite-tiny",
        threads: int = 1,
        extra: list[str] | None = None,
        start_timeout: float = 120.0,
        stop_timeout: float = 15.0,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = serve_command() + ["--model", model, "--port", str(self.port), "--threads", str(threads)]
        self.cmd += list(extra or [])
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self.proc: subprocess.Popen | None = None
        self.log = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 20) -> str:
        if self.log is None:
            return ""
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def __enter__(self) -> ServerProcess:
        self.log = tempfile.NamedTemporaryFile("w", prefix="gptoss-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + self.start_timeout
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    why = f"no 200 from {self.url}/health in {self.start_timeout:.0f} s"
                    raise RuntimeError(f"{why}:\n{self.log_tail()}")
                time.sleep(0.2)
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None:
            self.log.close()
            if exc[0] is None:
                os.unlink(self.log.name)
            else:
                print(f"server log kept: {self.log.name}", file=sys.stderr)


def build_stops(length: int, prompt: str, reference: str, seed: int = 0) -> list[str]:
    """Four `length`-character stop strings that never occur in `reference` (the greedy output): a run
    of "a", a run of spaces, the prompt repeated, and random lowercase letters, each ended by a
    character that occurs in neither the output nor the prompt, so a scan that compares prefixes
    does the most work and the stop never fires."""
    seen = set(reference) | set(prompt)
    term = next((c for c in TERMINATORS if c not in seen), None)
    if term is None:
        raise RuntimeError("every terminator character occurs in the probe output; cannot build safe stops")
    rng = random.Random(seed)
    body = length - 1
    return [
        "a" * body + term,
        " " * body + term,
        (prompt * (body // len(prompt) + 1))[:body] + term,
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(body)) + term,
    ][:MAX_STOP_STRINGS]


async def one_request(client: httpx.AsyncClient, body: dict) -> dict:
    t0 = time.perf_counter()
    ttft, tokens, reason, error, events = None, None, None, None, 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:300]!r}", "seconds": 0.0}
            async for event in sse_events(r):
                if event["choices"]:
                    choice = event["choices"][0]
                    if choice["text"]:
                        events += 1
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                    reason = choice.get("finish_reason") or reason
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except StreamError as exc:
        error = str(exc)
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    if error is None and tokens is None:
        error = "no usage chunk"
    seconds = time.perf_counter() - t0
    return {
        "ttft": ttft,
        "tokens": tokens,
        "text_events": events,
        "finish_reason": reason,
        "error": error,
        "seconds": seconds,
    }


async def wait_idle(client: httpx.AsyncClient, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = (await client.get("/stats")).json()
        if s.get("num_running", 0) == 0 and s.get("num_waiting", 0) == 0:
            return
        await asyncio.sleep(0.05)


async def run_round(client: httpx.AsyncClient, body: dict, clients: int, requests: int) -> dict:
    async def run_client() -> list[dict]:
        return [await one_request(client, body) for _ in range(requests)]

    await wait_idle(client)
    t0 = time.perf_counter()
    per_client = await asyncio.gather(*(run_client() for _ in range(clients)))
    wall = time.perf_counter() - t0
    results = [r for rs in per_client for r in rs]
    errors = [r["error"] for r in results if r.get("error")]
    tokens = [r["tokens"] for r in results if r.get("tokens") is not None]
    ttfts = [r["ttft"] for r in results if r.get("ttft") is not None]
    return {
        "wall_s": wall,
        "generated_tokens": sum(tokens),
        "tokens_per_request": tokens,
        "finish_reasons": sorted({r.get("finish_reason") for r in results if r.get("finish_reason")}),
        "generated_tokens_per_s": sum(tokens) / wall if wall > 0 else float("nan"),
        "ttft_median_s": statistics.median(ttfts) if ttfts else None,
        # Events with text per request: a server that holds back text that may start a stop string sends fewer.
        "text_events_median": statistics.median(r.get("text_events", 0) for r in results),
        "errors": len(errors),
        "first_errors": errors[:3],
    }


async def bench(url: str, args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        card = (await client.get("/v1/models")).json()["data"][0]
        model, max_model_len = card["id"], card["max_model_len"]
        # The probe measures the prompt's length in tokens and gives the greedy text the stops must avoid.
        head = {"model": model, "prompt": args.prompt, "temperature": 0, "ignore_eos": True}
        r = await client.post("/v1/completions", json={**head, "max_tokens": 1})
        r.raise_for_status()
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        max_tokens = min(args.max_tokens, max_model_len - prompt_tokens)
        if max_tokens < 1:
            raise RuntimeError(f"the prompt ({prompt_tokens} tokens) fills the context ({max_model_len})")
        r = await client.post("/v1/completions", json={**head, "max_tokens": max_tokens})
        r.raise_for_status()
        reference = r.json()["choices"][0]["text"]
        stops = build_stops(args.stop_chars, args.prompt, reference, args.seed)
        body_a = {**head, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
        body_b = {**body_a, "stop": stops}
        rounds = []
        for i in range(args.rounds):
            a = await run_round(client, body_a, args.clients, args.requests)
            b = await run_round(client, body_b, args.clients, args.requests)
            rounds.append({"round": i + 1, "A": a, "B": b})
            if not args.json:
                print(
                    f"round {i + 1}: A (no stop) {a['wall_s']:7.2f} s {a['generated_tokens_per_s']:7.1f} tok/s | "
                    f"B ({len(stops)} stops of {max(map(len, stops))} chars) {b['wall_s']:7.2f} s "
                    f"{b['generated_tokens_per_s']:7.1f} tok/s",
                    flush=True,
                )
    expected = [max_tokens] * (args.clients * args.requests)
    # Rounds where B generated other token counts than A, or finished on a stop: a stop string fired.
    fired = [
        i + 1
        for i, r in enumerate(rounds)
        if r["B"]["tokens_per_request"] != r["A"]["tokens_per_request"] or "stop" in r["B"]["finish_reasons"]
    ]
    short = [i + 1 for i, r in enumerate(rounds) if sorted(r["A"]["tokens_per_request"]) != expected]
    med = {v: statistics.median(r[v]["wall_s"] for r in rounds) for v in ("A", "B")}
    tps = {v: statistics.median(r[v]["generated_tokens_per_s"] for r in rounds) for v in ("A", "B")}
    ttft = {
        v: statistics.median([r[v]["ttft_median_s"] for r in rounds if r[v]["ttft_median_s"] is not None] or [0.0])
        for v in ("A", "B")
    }
    events = {v: statistics.median(r[v]["text_events_median"] for r in rounds) for v in ("A", "B")}
    errors = sum(r[v]["errors"] for r in rounds for v in ("A", "B"))
    ratio = med["B"] / med["A"] if med["A"] > 0 else float("nan")
    ok = ratio <= args.target and not fired and not short and errors == 0
    return {
        "url": url,
        "model": model,
        "max_model_len": max_model_len,
        "prompt_tokens": prompt_tokens,
        "clients": args.clients,
        "requests_per_client": args.requests,
        "max_tokens": max_tokens,
        "stop_strings": len(stops),
        "stop_chars": [len(s) for s in stops],
        "rounds": rounds,
        "median_wall_s": med,
        "median_generated_tokens_per_s": tps,
        "median_ttft_s": ttft,
        "median_text_events_per_request": events,
        "ratio_b_over_a": ratio,
        "target": args.target,
        "stop_fired_rounds": fired,
        "a_short_rounds": short,
        "errors": errors,
        "first_errors": [e for r in rounds for v in ("A", "B") for e in r[v]["first_errors"]][:3],
        "pass": ok,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="use this running server (loopback only) instead of starting one")
    p.add_argument("--model", default="lite-tiny", help="--model for the started server (default: lite-tiny)")
    p.add_argument("--threads", type=int, default=1, help="--threads for the started server (default: 1)")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for the started server (repeatable)")
    p.add_argument("--clients", type=int, default=4, help="concurrent streaming clients (default: 4)")
    p.add_argument("--requests", type=int, default=2, help="requests per client, one after another (default: 2)")
    p.add_argument("--max-tokens", type=int, default=1500, help="tokens per request, capped to the context (1500)")
    p.add_argument("--prompt", default=PROMPT, help="the prompt of every request")
    p.add_argument(
        "--stop-chars", type=int, default=MAX_STOP_CHARS, help=f"length of each stop string (default: {MAX_STOP_CHARS})"
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds of A then B (default: 3)")
    p.add_argument("--target", type=float, default=1.25, help="pass if median(B)/median(A) <= this (default: 1.25)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random-letter stop string (default: 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request HTTP timeout in seconds (default: 600)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    for name in ("clients", "requests", "max_tokens", "rounds", "stop_chars", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.url is not None:
        check_loopback(args.url)
        out = asyncio.run(bench(args.url.rstrip("/"), args))
    else:
        with ServerProcess(args.model, args.threads, args.server_arg) as server:
            out = asyncio.run(bench(server.url, args))
            out["server_cmd"] = server.cmd
    if args.json:
        print(json.dumps(out))
    else:
        med, tps, ttft = out["median_wall_s"], out["median_generated_tokens_per_s"], out["median_ttft_s"]
        print(
            f"{out['model']} (context {out['max_model_len']}): {out['clients']} clients x {out['requests_per_client']} "
            f"requests, prompt {out['prompt_tokens']} tokens, max_tokens {out['max_tokens']}, "
            f"{out['rounds'][0]['A']['generated_tokens']} tokens a round"
        )
        print(f"median wall: A {med['A']:.2f} s, B {med['B']:.2f} s; ratio B/A {out['ratio_b_over_a']:.3f}")
        print(f"median generated tokens/s: A {tps['A']:.1f}, B {tps['B']:.1f}")
        print(f"median time to first text: A {1000 * ttft['A']:.1f} ms, B {1000 * ttft['B']:.1f} ms")
        ev = out["median_text_events_per_request"]
        print(f"median streamed events with text per request: A {ev['A']:g}, B {ev['B']:g}")
        if out["stop_fired_rounds"]:
            print(f"a stop string fired: B generated other token counts than A in rounds {out['stop_fired_rounds']}")
        if out["a_short_rounds"]:
            print(f"A generated fewer than max_tokens in rounds {out['a_short_rounds']}")
        if out["errors"]:
            print(f"errors: {out['errors']} {out['first_errors']}")
        verdict = "PASS" if out["pass"] else "FAIL"
        print(f"{verdict}: B/A {out['ratio_b_over_a']:.3f} vs target <= {out['target']}")
    return 0 if out["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
