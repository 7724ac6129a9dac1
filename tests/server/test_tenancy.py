"""Tenant isolation: the prefix-cache scope is the API key's tenant (plus cache_salt), so a prefix
cached for one key is a hit for that key only."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import live_server
import pytest
from live_server import tiny_llm

from gptoss_lite.server.state import cache_scope

serve = live_server.serve  # the fixture

KEYS = {"key-a": "alice", "key-b": "bob"}
PREFIX = "Shared context: " + "the quick brown fox jumps over the lazy dog. " * 6  # ~280 bytes = tokens


def ask(live, key: str, question: str, **extra) -> dict:
    body = {"model": live.state.model_name, "prompt": PREFIX + question, "max_tokens": 2, "temperature": 0, **extra}
    r = httpx.post(live.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def metric(live, name: str, labels: str = "") -> float:
    """A /metrics value (read with a tenant's key: a keyed server's metrics need one)."""
    text = httpx.get(live.url + "/metrics", headers={"Authorization": "Bearer key-a"}).text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_prefix_hit_for_the_same_key_only(serve):
    """Key A twice: the second is a hit; key B with the same prompt: no hit; A with a new cache_salt:
    no hit. usage.cached_tokens and the per-tenant and engine metrics all agree."""
    live = serve(tiny_llm(), api_keys=KEYS)
    first = ask(live, "key-a", " Q1")
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    second = ask(live, "key-a", " Q2")
    hit = second["prompt_tokens_details"]["cached_tokens"]
    assert hit >= len(PREFIX) // 2, second  # most of the shared prefix came from the cache
    engine_hits = metric(live, "gptoss_prefix_cache_hits_total")
    assert engine_hits >= hit

    other = ask(live, "key-b", " Q2")  # byte-for-byte the prompt key A just had cached
    assert other["prompt_tokens_details"]["cached_tokens"] == 0
    assert metric(live, "gptoss_prefix_cache_hits_total") == engine_hits  # the engine saw no hit either
    salted = ask(live, "key-a", " Q2", cache_salt="s1")
    assert salted["prompt_tokens_details"]["cached_tokens"] == 0

    assert metric(live, "gptoss_prefix_cache_hit_tokens_total", '{tenant="alice"}') == hit
    assert metric(live, "gptoss_prefix_cache_hit_tokens_total", '{tenant="bob"}') == 0
    assert 0 < metric(live, "gptoss_prefix_cache_hit_rate") < 1


def test_scope_encoding_cannot_collide():
    """No (tenant, salt) pair spells another pair's scope, whatever characters they hold."""
    pairs = [("a", None), ("a", "b"), ("a/b", None), ('a", "b', None), ("a", 'b"'), ("", "a"), ("a", "")]
    scopes = [cache_scope(t, s) for t, s in pairs]
    assert len(set(scopes)) == len(pairs)


@pytest.mark.slow
def test_timing_shows_the_hit_for_the_same_key_only():
    """benchmarks/serve_tenancy.py on the demo model, 2,000-token prefixes: key A's repeat is at least
    twice as fast to its first token as A's first request; key B's identical request is not."""
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(root / "benchmarks" / "serve_tenancy.py"), "--trials", "3", "--json"]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    med = json.loads(out.stdout.splitlines()[-1])
    assert med["a_again"] < 0.5 * med["a_first"]
    assert med["b_same"] > 0.5 * med["a_first"]
