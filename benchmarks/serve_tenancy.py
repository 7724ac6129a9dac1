"""Tenant isolation seen from outside: time to first token of a long shared prefix sent by key A,
again by key A (a prefix-cache hit), then by key B (no hit: another tenant's scope).

Starts the server in-process (demo model by default) on a free loopback port and prints, per trial,
each request's TTFT and usage.prompt_tokens_details.cached_tokens, then the medians:

    python benchmarks/serve_tenancy.py [--model DIR|PRESET] [--prefix-tokens 2000] [--trials 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx
import torch

from gptoss_lite.checkpoint import default_model_source
from gptoss_lite.engine import LLM
from gptoss_lite.server import create_app
from gptoss_lite.server.background import BackgroundServer

KEYS = {"key-a": "alice", "key-b": "bob"}


def timed(url: str, model: str, key: str, prompt: str) -> tuple[float, int]:
    """(seconds to the first streamed event with text, cached prompt tokens) of one greedy request."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, cached = None, None
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and event["choices"]:
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
    return ttft, cached


def run(model_source, prefix_tokens: int, trials: int) -> dict:
    torch.set_num_threads(1)
    app = create_app(LLM(model_source), api_keys=KEYS)
    name = app.state.server.model_name
    rows = []
    with BackgroundServer(app) as live:
        url = live.url
        timed(url, name, "key-a", "warm up")
        for trial in range(trials):
            prefix = (
                f"Document {trial}: " + ("the grass is green and the sky is blue. " * prefix_tokens)[:prefix_tokens]
            )
            a1 = timed(url, name, "key-a", prefix + " First question?")
            a2 = timed(url, name, "key-a", prefix + " Second question?")
            b = timed(url, name, "key-b", prefix + " Second question?")
            rows.append({"a_first": a1, "a_again": a2, "b_same": b})
            print(
                f"trial {trial}: A first {1000 * a1[0]:7.1f} ms (cached {a1[1]:5d}) | A again {1000 * a2[0]:7.1f} ms "
                f"(cached {a2[1]:5d}) | B same prompt {1000 * b[0]:7.1f} ms (cached {b[1]:5d})"
            )
    med = {k: statistics.median(r[k][0] for r in rows) for k in ("a_first", "a_again", "b_same")}
    print(
        f"median TTFT: A first {1000 * med['a_first']:.1f} ms, A again {1000 * med['a_again']:.1f} ms, "
        f"B {1000 * med['b_same']:.1f} ms"
    )
    return {"rows": rows, "median": med}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory or preset (default: the shipped demo model)")
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="end with one JSON line of the medians (seconds)")
    args = ap.parse_args()
    out = run(args.model or default_model_source(), args.prefix_tokens, args.trials)
    if args.json:
        print(json.dumps(out["median"]))


if __name__ == "__main__":
    main()
