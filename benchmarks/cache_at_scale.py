"""The mixed KV cache at true scale: one sequence of 131,072 tokens (by default) in a real `MixedKVCache`,
its bytes against the planner's exact count, and the model's prefill and decode at that depth.

    python benchmarks/cache_at_scale.py --model gptoss-lite-502m --dtype bfloat16 --threads 2
    python benchmarks/cache_at_scale.py --model DIR --dtype float32 --json out.json

What it does, in order (one process; each figure says what it measured):

1. fills the cache to `tokens - chunk` positions with random K/V in `chunk`-token pieces (the bytes do
   not depend on the values; the model does not run), then
2. prefills the last `chunk` tokens through the model over that cache: their queries attend to every
   key before them, so this is the prefill rate at that depth (tokens/s), and the process's peak RSS
   covers the whole cache plus one chunk's activations (a T×T matrix would be 64 GiB at 128K in fp32;
   what chunked prefill holds is chunk × keys per head at most);
3. times `--decode-steps` one-token decode steps at the full depth (eager, the cached path): tokens/s
   against the roofline the planner draws from this machine's measured copy bandwidth (weights read
   once per step, plus the KV payload);
4. reports the cache's payload and allocated bytes beside `kv_payload_bytes` of the model's geometry
   (exact), and the all-full cache's payload (every layer full) and the ratio.

A preset name gives seeded random weights (the 502M preset), which is what the bytes and times need.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gptoss-lite-502m", help="model directory or preset (default: the 502M)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--tokens", type=int, default=131_072, help="context length (default: 131,072)")
    p.add_argument("--chunk", type=int, default=2048, help="prefill piece and the timed last chunk (default: 2048)")
    p.add_argument("--decode-steps", type=int, default=8, help="timed decode steps (default: 8)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not 0 < args.chunk < args.tokens - args.decode_steps:
        p.error("--chunk must be positive and below --tokens minus --decode-steps")

    from gptoss_lite.checkpoint import load_model
    from gptoss_lite.config import count_active_parameters
    from gptoss_lite.evals.harness import peak_rss_bytes
    from gptoss_lite.kv.mixed import MixedKVCache
    from gptoss_lite.plan.core import kv_payload_bytes
    from gptoss_lite.plan.presets import geometry_from_model_config, measure_this_machine

    dtype = getattr(torch, args.dtype)
    model = load_model(args.model, dtype=dtype)
    cfg = model.config
    if args.tokens > cfg.max_position_embeddings:
        p.error(f"--tokens {args.tokens:,}: the model takes {cfg.max_position_embeddings:,} positions")
    prompt = args.tokens - args.decode_steps  # prefilled; the decode steps bring the cache to --tokens
    elem = torch.empty((), dtype=dtype).element_size()
    rss_loaded = peak_rss_bytes()
    cache = MixedKVCache(cfg, batch_size=1, capacity=args.tokens)
    filled = prompt - args.chunk
    gen = torch.Generator().manual_seed(0)
    piece = torch.randn(1, cfg.n_kv_heads, args.chunk, cfg.head_dim, generator=gen).to(dtype)
    t0 = time.perf_counter()
    for start in range(0, filled, args.chunk):
        n = min(args.chunk, filled - start)
        for layer in range(cfg.n_layers):
            cache[layer].append(piece[:, :, :n], piece[:, :, :n])
    fill_s = time.perf_counter() - t0

    ids = torch.randint(0, cfg.vocab_size, (1, prompt), generator=gen)
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = model.prefill(ids, cache, args.chunk)
        prefill_s = time.perf_counter() - t0
        rss_prefill = peak_rss_bytes()
        token = logits[:, -1].argmax(-1)
        t0 = time.perf_counter()
        for i in range(args.decode_steps):
            logits = model(token[:, None], cache=cache, start_pos=prompt + i, last_only=True).logits
            token = logits[:, -1].argmax(-1)
        decode_s = time.perf_counter() - t0
    held = cache.num_tokens

    geometry = geometry_from_model_config(cfg, elem, name=str(args.model))
    all_full = geometry_from_model_config(cfg.replace(layer_types=("full_attention",) * cfg.n_layers), elem)
    planned = kv_payload_bytes(geometry, held)
    full_payload = kv_payload_bytes(all_full, held)
    hw = measure_this_machine()
    weight_bytes = count_active_parameters(cfg) * elem
    roofline = hw.bandwidth_bytes_per_second / (weight_bytes + planned)
    out = {
        "model": str(args.model),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "tokens": held,
        "measured_payload_bytes": cache.payload_bytes,
        "planned_payload_bytes": planned,
        "equal": cache.payload_bytes == planned,
        "allocated_bytes": cache.nbytes,
        "all_full_payload_bytes": full_payload,
        "all_full_over_mixed": full_payload / planned,
        "fill_seconds": fill_s,
        "prefill_last_chunk_tokens_per_s": args.chunk / prefill_s,
        "decode_tokens_per_s": args.decode_steps / decode_s,
        "decode_roofline_tokens_per_s": roofline,
        "decode_over_roofline": (args.decode_steps / decode_s) / roofline,
        "bandwidth_bytes_per_s": hw.bandwidth_bytes_per_second,
        "weight_bytes_per_step": weight_bytes,
        "peak_rss_after_load_bytes": rss_loaded,
        "peak_rss_bytes": rss_prefill,
    }
    for k, v in out.items():
        shown = f"{v:,.3f}" if isinstance(v, float) else f"{v:,}" if type(v) is int else str(v)
        print(f"{k:>32}: {shown}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if out["equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
