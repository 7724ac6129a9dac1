"""`gptoss-lite bench-serve`: the batched engine under a request workload (docs/engine.md#benchmarks).

Prints generated tokens/s, TTFT and inter-token latency percentiles, KV blocks in use, the prefix hit
rate and preemptions, with the planner's prediction for the same pool beside them. `--sequential`
also runs the same requests one by one through `generate()` and prints the throughput ratio;
`--long-prompt N` runs the head-of-line experiment instead: `--decoders` requests decode alone, then
again while one N-token prompt arrives, and the rise of their p99 inter-token latency is compared with
the time of one prefill chunk.
"""

from __future__ import annotations

import argparse
import json
import sys


def _range(text: str) -> tuple[int, int]:
    """'256' -> (256, 256); '16:1024' -> (16, 1024)."""
    try:
        lo, _, hi = text.partition(":")
        pair = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N or LO:HI (integers)") from None
    if not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LO <= HI")
    return pair


def register(sub: argparse._SubParsersAction) -> None:
    from gptoss_lite.commands.common import add_decode_steps_arg, add_engine_kv_args, add_model_arg

    p = sub.add_parser(
        "bench-serve",
        help="benchmark the batched serving engine on a request workload",
        description="Run N requests through the batched engine (random token prompts) and report throughput, "
        "latency percentiles, KV blocks and prefix hits, beside the planner's prediction.",
    )
    add_model_arg(p)
    p.add_argument("--requests", type=int, default=64, help="number of requests (default: 64)")
    p.add_argument("--prompt-len", type=_range, default=(16, 1024), help="prompt tokens, N or LO:HI (default: 16:1024)")
    p.add_argument("--max-tokens", type=_range, default=(16, 128), help="tokens to generate, N or LO:HI (16:128)")
    p.add_argument("--rate", type=float, default=float("inf"), help="arrivals per second, Poisson (default: inf)")
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with (default: 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default: 0)")
    p.add_argument("--kv-blocks", type=int, default=None, help="full-layer pool blocks (default: engine sizing)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="token budget per step (default: 512)")
    p.add_argument("--max-running", type=int, default=64, help="most requests running at once (default: 64)")
    add_decode_steps_arg(p)
    p.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    add_engine_kv_args(p)
    p.add_argument("--sequential", action="store_true", help="also run the requests one by one through generate()")
    p.add_argument("--long-prompt", type=int, default=0, help="head-of-line experiment: this many prompt tokens")
    p.add_argument("--decoders", type=int, default=8, help="decoding requests for --long-prompt (default: 8)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:

    from gptoss_lite.commands.common import (
        configure_threads,
        engine_kv_kwargs,
        resolve_device,
        speculation_label,
        torch_dtype,
    )
    from gptoss_lite.engine import LLM
    from gptoss_lite.validation import check_int

    check_int("--requests", args.requests, 1)
    check_int("--shared-prefix", args.shared_prefix, 0)
    check_int("--long-prompt", args.long_prompt, 0)
    check_int("--decode-steps", args.decode_steps, 1)
    check_int("--decoders", args.decoders, 1)
    if not args.rate > 0:
        raise ValueError(f"--rate={args.rate}: must be > 0 (inf: all at once)")
    kv_kwargs = engine_kv_kwargs(args, load_draft=True)
    args.threads = configure_threads(args.threads)
    from gptoss_lite.checkpoint import default_model_source

    source = args.model if args.model is not None else default_model_source()
    llm = LLM(
        source,
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_batch_tokens=args.max_batch_tokens,
        max_running=args.max_running,
        decode_steps=args.decode_steps,
        dtype=torch_dtype(args.dtype),
        rope_factor=args.rope_factor,
        mxfp4_activations=args.mxfp4_activations,
        device=resolve_device(args.device),
        enable_prefix_caching=not args.no_prefix_caching,
        **kv_kwargs,
    )
    result = _head_of_line(llm, args) if args.long_prompt else _workload(llm, args)
    spec = kv_kwargs.pop("speculate")
    result = {
        "model": str(source),
        "dtype": args.dtype,
        "threads": args.threads,
        **kv_kwargs,
        "speculate": None if spec is None else speculation_label(args, llm),
        "compile_s": llm.compile_seconds,
        "decode_steps": args.decode_steps,
        **result,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)
    return 0


def _items(llm, args):
    from gptoss_lite.engine import SamplingParams
    from gptoss_lite.engine.bench import WorkItem, poisson_arrivals, random_prompts

    vocab = llm.config.vocab_size
    prompts = random_prompts(args.requests, args.prompt_len, vocab, args.seed)
    if args.shared_prefix:
        prefix = random_prompts(1, (args.shared_prefix, args.shared_prefix), vocab, args.seed + 99)[0]
        prompts = [prefix + p for p in prompts]
    import random

    rng = random.Random(args.seed + 2)
    lengths = [rng.randint(*args.max_tokens) for _ in prompts]
    arrivals = poisson_arrivals(len(prompts), args.rate, args.seed)
    return [
        WorkItem(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), a)
        for p, n, a in zip(prompts, lengths, arrivals)
    ]


def _progress(done: int, total: int) -> None:
    print(f"\r  {done}/{total} requests", end="" if done < total else "\n", file=sys.stderr, flush=True)


def _workload(llm, args) -> dict:
    from gptoss_lite.engine.bench import planner_figures, run_workload

    work = _items(llm, args)
    # Warm-up (allocator, thread pool) on a copy of the first few requests, not measured.
    run_workload(llm, work[: min(4, len(work))])
    llm.clear_prefix_cache()
    before = llm.stats()
    report = run_workload(llm, work, progress=_progress)
    after = llm.stats()
    contexts = [len(w.prompt) + w.params.max_tokens for w in work]
    out = {
        "engine": report.summary(),
        "planner": planner_figures(llm, round(sum(contexts) / len(contexts))),
    }
    if llm.speculate is not None:
        drafted = after.spec_drafted - before.spec_drafted
        verified = after.spec_verifications - before.spec_verifications
        out["speculation"] = {
            "drafted": drafted,
            "accepted": after.spec_accepted - before.spec_accepted,
            "acceptance_rate": round((after.spec_accepted - before.spec_accepted) / drafted, 3) if drafted else 0.0,
            "tokens_per_verification": round((after.spec_tokens - before.spec_tokens) / verified, 2)
            if verified
            else 0.0,
        }
    if args.sequential:
        out["sequential"] = _sequential(llm, work)
        out["speedup_vs_sequential"] = round(report.generated_tps / out["sequential"]["generated_tok_s"], 2)
    return out


def _sequential(llm, work) -> dict:
    """The same requests one at a time through generate() (no engine), generated tokens/s."""
    import time

    import torch

    from gptoss_lite.generation import generate

    device = next(llm.model.parameters()).device
    start = time.perf_counter()
    generated = 0
    for i, item in enumerate(work):
        ids = torch.tensor([item.prompt], device=device)
        out = generate(llm.model, ids, max_new_tokens=item.params.max_tokens, temperature=0)
        generated += out.shape[1] - len(item.prompt)
        _progress(i + 1, len(work))
    wall = time.perf_counter() - start
    return {"wall_s": round(wall, 3), "generated_tok_s": round(generated / wall, 1)}


def _head_of_line(llm, args) -> dict:
    """Decoders alone, then decoders with one long prompt arriving; the long prompt's chunks alone."""
    from gptoss_lite.engine import SamplingParams
    from gptoss_lite.engine.bench import WorkItem, random_prompts, run_workload

    vocab = llm.config.vocab_size
    decode_params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    decoders = [WorkItem(p, decode_params) for p in random_prompts(args.decoders, (256, 256), vocab, args.seed)]
    long_item = WorkItem(
        random_prompts(1, (args.long_prompt, args.long_prompt), vocab, args.seed + 7)[0],
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        arrival=0.0,
    )
    run_workload(llm, decoders[:2])  # warm-up
    llm.clear_prefix_cache()
    alone = run_workload(llm, decoders)
    llm.clear_prefix_cache()
    # The long prompt arrives once the decoders are decoding: after about a tenth of their run.
    long_item.arrival = alone.wall_seconds / 10
    mixed = run_workload(llm, decoders + [long_item])
    llm.clear_prefix_cache()
    chunk_times = _chunk_times(llm, long_item)
    llm.clear_prefix_cache()
    decoder_itl_mixed = mixed.itl  # the long request produces one token: it adds no gap
    from gptoss_lite.engine.request import percentile

    p99_alone = percentile(alone.itl, 99)
    p99_mixed = percentile(decoder_itl_mixed, 99)
    worst_chunk = max(chunk_times)
    return {
        "decoders": args.decoders,
        "long_prompt": args.long_prompt,
        "max_batch_tokens": args.max_batch_tokens,
        "itl_p99_ms_alone": round(p99_alone * 1e3, 2),
        "itl_p99_ms_with_long_prompt": round(p99_mixed * 1e3, 2),
        "itl_p99_rise_ms": round((p99_mixed - p99_alone) * 1e3, 2),
        "chunk_prefill_ms_max": round(worst_chunk * 1e3, 2),
        "chunk_prefill_ms_median": round(sorted(chunk_times)[len(chunk_times) // 2] * 1e3, 2),
        "chunks": len(chunk_times),
        "within_one_chunk": p99_mixed - p99_alone <= worst_chunk,
    }


def _chunk_times(llm, item) -> list[float]:
    """Wall time of each engine step that runs a chunk of `item`'s prompt alone."""
    import time

    llm.add_request(item.prompt, item.params)
    times = []
    while llm.has_unfinished():
        t = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - t)
    return times


def _print(result: dict) -> None:
    if "engine" not in result:
        print(f"head-of-line: {result['decoders']} decoding requests, one {result['long_prompt']:,}-token prompt")
        for key, value in result.items():
            if key not in (
                "model",
                "dtype",
                "threads",
                "kv_format",
                "full_window",
                "compile_decode",
                "speculate",
                "decode_reserve",
            ):
                print(f"  {key:32s} {value}")
        return
    e, p = result["engine"], result["planner"]
    kv = "16-bit KV" if result["kv_format"] == "dense" else f"{result['kv_format']} KV"
    if result["full_window"] is not None:
        kv += f", full-layer window {result['full_window']:,} tokens"
    compiled = "eager decode"
    if result["compile_s"] is not None:
        compiled = f"compiled decode ({result['compile_s']:.1f} s to compile)"
    watermark = f"decode reserve {result['decode_reserve']} tokens" if result["decode_reserve"] else "no decode reserve"
    setup = f"{result['dtype']}, {result['threads']} threads, {kv}, {compiled}, {watermark}"
    print(f"bench-serve: {e['requests']} requests, {result['model']} ({setup})")
    rows = [
        ("generated tok/s", f"{e['generated_tok_s']:,.1f}"),
        ("prompt tok/s", f"{e['prompt_tok_s']:,.1f}"),
        ("wall s", f"{e['wall_s']:.2f}"),
        ("TTFT p50 / p99 ms", f"{e['ttft_p50_ms']:,.1f} / {e['ttft_p99_ms']:,.1f}"),
        ("ITL p50 / p90 / p99 ms", f"{e['itl_p50_ms']:.2f} / {e['itl_p90_ms']:.2f} / {e['itl_p99_ms']:.2f}"),
        ("KV blocks peak / mean / total", _blocks(e)),
        ("prefix hit rate", f"{e['prefix_hit_rate']:.1%}"),
        ("preemptions", f"{e['preemptions']}"),
        ("most requests running", f"{e['peak_running']}"),
        (f"planner: max resident @ {p['context_tokens']:,} tok", f"{p['max_resident_requests']:,}"),
        ("planner: batch knee", f"{p['batch_knee']:,.1f}"),
    ]
    if "speculation" in result:
        s = result["speculation"]
        rows.append((f"speculation ({result['speculate']}): accepted", f"{s['acceptance_rate']:.1%}"))
        rows.append(("speculation: tokens per verification", f"{s['tokens_per_verification']:.2f}"))
    if "sequential" in result:
        rows.append(("sequential generate() tok/s", f"{result['sequential']['generated_tok_s']:,.1f}"))
        rows.append(("engine / sequential", f"{result['speedup_vs_sequential']:.2f}x"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value:>14}")


def _blocks(e: dict) -> str:
    return f"{e['kv_blocks_peak']:,} / {e['kv_blocks_mean']:,.0f} / {e['kv_blocks_total']:,}"
