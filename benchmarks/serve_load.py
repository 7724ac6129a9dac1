"""Load test for `gptoss-lite serve`: concurrent streaming clients on loopback, bounded in count and time.

Each of --clients clients sends --requests streaming completions one after another, with prompt
lengths drawn (seeded) from --prompt-lengths; it records the time to the first streamed text (TTFT),
the generated tokens (from the usage chunk), and any error. At the end it waits for the server to go
idle, drops the prefix cache (POST /admin/reset_prefix_cache) and checks that every KV block is
free. Prints p50/p99 TTFT, generated tokens/s
and the leak check; --json prints one JSON object instead.

    gptoss-lite serve --model lite-tiny --port 8000 &
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --clients 64 --requests 4

Only loopback URLs are accepted: this script is for a server on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from urllib.parse import urlparse

import httpx

from gptoss_lite.engine.request import percentile

LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
WORDS = "the pass key is remember it grass sky sun water tree river stone cloud wind".split()


def make_prompt(rng: random.Random, n_chars: int) -> str:
    words = []
    while sum(len(w) + 1 for w in words) < n_chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:n_chars]


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, key: str | None) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    ttft, tokens, error = None, 0, None
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for event in sse_events(r):
                if ttft is None and event["choices"] and event["choices"][0]["text"]:
                    ttft = time.perf_counter() - t0
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except StreamError as exc:
        error = str(exc)
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"ttft": ttft, "tokens": tokens, "error": error, "seconds": time.perf_counter() - t0}


class StreamError(Exception):
    """A stream sent an error event, or ended without `data: [DONE]`."""


async def sse_events(response: httpx.Response):
    """The JSON events of a streamed completion, up to `data: [DONE]` (StreamError otherwise)."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise StreamError(event["error"]["message"])
        yield event
    raise StreamError("stream ended without [DONE]")


async def run_load(
    url: str,
    *,
    clients: int = 64,
    requests: int = 4,
    prompt_lengths: tuple[int, ...] = (8, 64, 256),
    max_tokens: int = 16,
    key: str | None = None,
    admin_key: str | None = None,
    seed: int = 0,
    timeout: float = 300.0,
) -> dict:
    """Run the load and return its figures (see the module docstring)."""
    host = urlparse(url).hostname
    if host not in LOOPBACK and not (host or "").startswith("127."):
        raise ValueError(f"--url {url}: only loopback servers (127.0.0.0/8, localhost, ::1) may be load-tested")
    rng = random.Random(seed)
    plans = [[rng.choice(prompt_lengths) for _ in range(requests)] for _ in range(clients)]
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        model = (await client.get("/v1/models", headers=headers)).json()["data"][0]["id"]

        async def run_client(i: int) -> list[dict]:
            crng = random.Random(seed * 1000 + i)
            return [await one_request(client, model, make_prompt(crng, n), max_tokens, key) for n in plans[i]]

        t0 = time.perf_counter()
        per_client = await asyncio.wait_for(asyncio.gather(*map(run_client, range(clients))), timeout)
        results = [r for rs in per_client for r in rs]
        wall = time.perf_counter() - t0
        deadline = time.monotonic() + 30
        while True:  # the last aborts and frees may trail the last response by a step
            stats = (await client.get("/stats")).json()
            if stats["num_running"] == 0 and stats["num_waiting"] == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        # Blocks still counted as used now are prefix-cache pins: drop the cache, then all must be free.
        admin = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        reset = await client.post("/admin/reset_prefix_cache", headers=admin)
        if reset.status_code != 200:
            raise RuntimeError(
                f"/admin/reset_prefix_cache: HTTP {reset.status_code} {reset.text[:200]}; pass --admin-key"
            )
        after = reset.json()
    ttfts = [r["ttft"] for r in results if r.get("ttft") is not None]
    errors = [r["error"] for r in results if r.get("error")]
    tokens = sum(r.get("tokens", 0) for r in results)
    return {
        "clients": clients,
        "requests": len(results),
        "errors": len(errors),
        "first_errors": errors[:3],
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "generated_tokens": tokens,
        "wall_s": wall,
        "generated_tokens_per_s": tokens / wall if wall > 0 else math.nan,
        "kv_blocks_used_idle": stats["kv_blocks_used"],
        "kv_blocks_used_after": after["kv_blocks_used"],
        "kv_blocks_free_after": after["kv_blocks_free"],
        "kv_blocks_total": after["kv_blocks_total"],
        "prefix_hit_rate": after["prefix_hit_rate"],
        "preemptions": after["preemptions"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback only)")
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients (default: 64)")
    p.add_argument("--requests", type=int, default=4, help="requests per client, one after another (default: 4)")
    p.add_argument(
        "--prompt-lengths", type=int, nargs="+", default=[8, 64, 256], help="prompt sizes in characters to mix"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per request (EOS ignored) (default: 16)")
    p.add_argument("--api-key", default=None, help="API key, if the server needs one")
    p.add_argument("--admin-key", default=None, help="admin key for the leak check, if the server has API keys")
    p.add_argument("--seed", type=int, default=0, help="seed for the prompt mix (default: 0)")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds (default: 300)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    out = asyncio.run(
        run_load(
            args.url,
            clients=args.clients,
            requests=args.requests,
            prompt_lengths=tuple(args.prompt_lengths),
            max_tokens=args.max_tokens,
            key=args.api_key,
            admin_key=args.admin_key,
            seed=args.seed,
            timeout=args.timeout,
        )
    )
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['requests']} requests from {out['clients']} streaming clients in {out['wall_s']:.2f} s")
        print(f"errors: {out['errors']} {out['first_errors'] or ''}")
        print(f"TTFT p50 {1000 * out['ttft_p50_s']:.1f} ms, p99 {1000 * out['ttft_p99_s']:.1f} ms")
        print(f"generated: {out['generated_tokens']} tokens, {out['generated_tokens_per_s']:.1f} tokens/s")
        print(
            f"KV blocks when idle: {out['kv_blocks_used_idle']} held (prefix cache); after dropping the cache "
            f"{out['kv_blocks_used_after']} used, {out['kv_blocks_free_after']}/{out['kv_blocks_total']} free"
        )
        print(f"prefix-cache hit rate {100 * out['prefix_hit_rate']:.1f}%, preemptions {out['preemptions']}")
    leaked = out["kv_blocks_used_after"] != 0
    return 1 if out["errors"] or leaked else 0


if __name__ == "__main__":
    sys.exit(main())
