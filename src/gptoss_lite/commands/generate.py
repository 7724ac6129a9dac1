"""`gptoss-lite generate`: text in, text out, with prefill/decode speed and KV memory on request."""

from __future__ import annotations

import argparse
import json
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    from gptoss_lite.commands.common import add_model_arg, add_speculate_args

    p = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate a continuation of PROMPT (or of standard input).")
    p.add_argument("prompt", nargs="?", default=None, help="prompt text; omit or '-' to read standard input")
    add_model_arg(p)
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature; <= 0 is greedy (default: 0.7)")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus mass in (0, 1] (default: 0.9)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling (default: none)")
    p.add_argument("--stop", type=int, action="append", default=None,
                   help="stop token id (repeatable; default: the tokenizer's end-of-sequence id)")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="prompt tokens per prefill piece (default: 2048)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument("--stats", action="store_true",
                   help="print prefill/decode tokens/s and KV-cache bytes to standard error")
    p.add_argument("--json", action="store_true", help="print one JSON object (text and stats) instead of text")
    add_speculate_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from gptoss_lite.commands.common import (build_speculation, fmt_bytes, load_model_and_tokenizer,
                                             speculation_line)
    from gptoss_lite.generation import stream_generate
    from gptoss_lite.kv.mixed import MixedKVCache
    from gptoss_lite.speculative import SpeculationStats

    prompt = args.prompt
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    model, tokenizer, source = load_model_and_tokenizer(args)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError("empty prompt: give some text as an argument or on standard input")
    input_ids = torch.tensor([ids], dtype=torch.long, device=args.device)
    stops = args.stop if args.stop is not None else [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    speculate = build_speculation(args, model)
    spec_stats = SpeculationStats()
    cache = MixedKVCache(model.config, batch_size=1,
                         rollback_tokens=0 if speculate is None else speculate.k)  # slack for rejected drafts

    t0 = time.perf_counter()
    steps = stream_generate(model, input_ids, args.max_new_tokens, args.temperature, args.top_p,
                            seed=args.seed, stop_tokens=stops, prefill_chunk=args.prefill_chunk, cache=cache,
                            speculate=speculate, stats=spec_stats)
    new: list[int] = []
    t_first = None
    printed = ""
    for token in steps:
        if t_first is None:
            t_first = time.perf_counter()  # prefill done and the first token sampled
        new.append(int(token[0]))
        if args.stream and not args.json:
            text = tokenizer.decode(new)
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    t_end = time.perf_counter()
    text = tokenizer.decode([t for t in new if t not in stops])

    prefill_s = (t_first or t_end) - t0
    decode_steps = max(0, len(new) - 1)  # the first token comes out of the prefill pass
    decode_s = t_end - (t_first or t_end)
    cfg = model.config
    total_tokens = cache.num_tokens
    per_token_layer = 2 * cfg.n_kv_heads * cfg.head_dim * next(model.parameters()).element_size()
    stats = {
        "model": str(source),
        "prompt_tokens": len(ids),
        "new_tokens": len(new),
        "prefill_tokens_per_s": len(ids) / prefill_s if prefill_s > 0 else None,
        "decode_tokens_per_s": decode_steps / decode_s if decode_steps and decode_s > 0 else None,
        "kv_allocated_bytes": cache.nbytes,
        "kv_payload_bytes": cache.payload_bytes,
        "kv_all_global_payload_bytes": cfg.n_layers * total_tokens * per_token_layer,
        "speculation": None if speculate is None else {"mode": args.speculate, "draft_tokens": speculate.k,
                                                       **spec_stats.to_dict()},
    }
    if args.json:
        print(json.dumps({"text": text, **stats}, indent=2, sort_keys=True))
        return 0
    if args.stream:
        sys.stdout.write("\n")
    else:
        print(text, flush=True)  # before the stats on stderr, also when stdout is a pipe
    if args.stats:
        pf = stats["prefill_tokens_per_s"]
        dc = stats["decode_tokens_per_s"]
        print(f"prefill: {len(ids)} tokens, {pf:,.0f} tokens/s" if pf else "prefill: -", file=sys.stderr)
        print(f"decode:  {len(new)} tokens, {dc:,.1f} tokens/s" if dc else f"decode:  {len(new)} tokens",
              file=sys.stderr)
        print(f"KV cache: {fmt_bytes(cache.nbytes)} allocated, {fmt_bytes(cache.payload_bytes)} payload, "
              f"vs {fmt_bytes(stats['kv_all_global_payload_bytes'])} for an all-global cache of "
              f"{total_tokens} tokens", file=sys.stderr)
        if speculate is not None:
            print(f"{speculation_line(spec_stats)}; --speculate {args.speculate}, "
                  f"--draft-tokens {speculate.k}", file=sys.stderr)
    return 0
