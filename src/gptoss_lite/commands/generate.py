"""`gptoss-lite generate`: text in, text out, with prefill/decode speed and KV memory on request."""

from __future__ import annotations

import argparse
import json
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    from gptoss_lite.commands.common import add_compile_arg, add_kv_args, add_model_arg, add_speculate_args

    p = sub.add_parser(
        "generate",
        help="generate text from a prompt",
        description="Generate a continuation of PROMPT (or of standard input).",
    )
    p.add_argument("prompt", nargs="?", default=None, help="prompt text; omit or '-' to read standard input")
    add_model_arg(p)
    add_compile_arg(p)
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature; <= 0 is greedy (default: 0.7)")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus mass in (0, 1] (default: 0.9)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling (default: none)")
    p.add_argument(
        "--stop",
        type=int,
        action="append",
        default=None,
        help="stop token id (repeatable; default: the tokenizer's end-of-sequence id)",
    )
    p.add_argument("--no-stop", action="store_true", help="no stop token: always generate --max-new-tokens tokens")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="prompt tokens per prefill piece (default: 2048)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument(
        "--stats", action="store_true", help="print prefill/decode tokens/s and KV-cache bytes to standard error"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (text and stats) instead of text")
    add_speculate_args(p)
    add_kv_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from gptoss_lite.commands.common import (
        build_speculation,
        check_speculate_args,
        fmt_bytes,
        kv_settings,
        load_model_and_tokenizer,
        speculation_line,
    )
    from gptoss_lite.generation import stream_generate
    from gptoss_lite.kvspec import token_bytes
    from gptoss_lite.sampling import SamplingParams
    from gptoss_lite.speculative import SpeculationStats
    from gptoss_lite.validation import check_int

    # Everything checkable without the model is checked before it is loaded. The flags' defaults
    # (temperature 0.7, top-p 0.9) are this command's choice; the library's are SamplingParams'.
    try:
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    except (ValueError, TypeError) as exc:
        flag = next(
            (
                f
                for k, f in (("temperature", "--temperature"), ("top_p", "--top-p"), ("seed", "--seed"))
                if str(exc).startswith(k + "=")
            ),
            None,
        )
        if flag is None:
            raise
        raise type(exc)(f"{flag}: {exc}") from None
    check_int("--max-new-tokens", args.max_new_tokens, 0)
    check_int("--prefill-chunk", args.prefill_chunk, 1)
    check_speculate_args(args)
    kv = kv_settings(args)
    if args.compile and (kv.format.quantized or kv.budget is not None or args.speculate != "none"):
        what = f"--speculate {args.speculate}" if args.speculate != "none" else f"--kv-format/--kv-budget ({kv.label})"
        raise ValueError(f"--compile runs decode on the 16-bit mixed cache without speculation; {what} cannot")
    prompt = read_prompt(args.prompt)
    model, tokenizer, source = load_model_and_tokenizer(args)
    ids = tokenizer.encode_prompt(prompt) if prompt else []  # NOTE: an empty text is no prompt, not a BOS alone
    if not ids:
        raise ValueError("empty prompt: give some text as an argument or on standard input")
    vocab = model.config.vocab_size
    bad_stops = [s for s in args.stop or () if not 0 <= s < vocab]
    if bad_stops:
        raise ValueError(f"--stop {bad_stops[0]}: not a token id of this model; ids are 0..{vocab - 1}")
    input_ids = torch.tensor([ids], dtype=torch.long, device=args.device)
    if args.no_stop and args.stop:
        raise ValueError(f"--no-stop and --stop {args.stop[0]} contradict each other; give one of them")
    stops = (
        []
        if args.no_stop
        else args.stop
        if args.stop is not None
        else [tokenizer.eos_id]
        if tokenizer.eos_id is not None
        else []
    )
    speculate = build_speculation(args, model)
    spec_stats = SpeculationStats()
    cache = kv.build(model.config, batch_size=1, rollback_tokens=0 if speculate is None else speculate.k)

    t0 = time.perf_counter()
    steps = stream_generate(
        model,
        input_ids,
        args.max_new_tokens,
        stop_tokens=stops,
        prefill_chunk=kv.prefill_chunk(args.prefill_chunk),
        cache=cache,
        speculate=speculate,
        stats=spec_stats,
        sampling=sampling,
    )
    new: list[int] = []
    t_first = None
    streamer = StreamPrinter(tokenizer, stops) if args.stream and not args.json else None
    for token in steps:
        if t_first is None:
            t_first = time.perf_counter()  # prefill done and the first token sampled
        new.append(int(token[0]))
        if streamer is not None:
            streamer.push(new[-1])
    t_end = time.perf_counter()
    text = tokenizer.decode([t for t in new if t not in stops])
    if streamer is not None:
        streamer.finish()

    prefill_s = (t_first or t_end) - t0
    decode_steps = max(0, len(new) - 1)  # the first token comes out of the prefill pass
    decode_s = t_end - (t_first or t_end)
    compile_s = None if model.compiled_decoder is None else model.compiled_decoder.compile_seconds
    if compile_s is not None and decode_steps > 1:  # the first compiled step compiles (or loads) the graph
        decode_steps, decode_s = decode_steps - 1, decode_s - compile_s
    cfg = model.config
    total_tokens = cache.num_tokens
    K, D = cfg.n_kv_heads, cfg.head_dim
    per_token_layer = token_bytes(K, D, K, D, next(model.parameters()).element_size())
    stats = {
        "model": str(source),
        "threads": args.threads,
        "prompt_tokens": len(ids),
        "prompt_token_ids": ids,  # as the tokenizer's rule made them (BOS first where it adds one)
        "token_ids": new,  # every generated id, stop token included
        "new_tokens": len(new),
        "prefill_tokens_per_s": len(ids) / prefill_s if prefill_s > 0 else None,
        "decode_tokens_per_s": decode_steps / decode_s if decode_steps and decode_s > 0 else None,
        "kv_allocated_bytes": cache.nbytes,
        "kv_payload_bytes": cache.payload_bytes,
        "kv_setting": kv.label,
        "kv_all_global_payload_bytes": cfg.n_layers * total_tokens * per_token_layer,
        "decode_compile_s": compile_s,
        "speculation": None
        if speculate is None
        else {"mode": args.speculate, "draft_tokens": speculate.k, **spec_stats.to_dict()},
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
        print(
            f"decode:  {len(new)} tokens, {dc:,.1f} tokens/s" if dc else f"decode:  {len(new)} tokens", file=sys.stderr
        )
        print(
            f"KV cache: {fmt_bytes(cache.nbytes)} allocated, {fmt_bytes(cache.payload_bytes)} payload, "
            f"vs {fmt_bytes(stats['kv_all_global_payload_bytes'])} for an all-global cache of "
            f"{total_tokens} tokens ({kv.label} full layers)",
            file=sys.stderr,
        )
        print(f"threads: {args.threads}", file=sys.stderr)
        if stats["decode_compile_s"] is not None:
            print(
                f"compiled decode: first step {stats['decode_compile_s']:.1f} s (compile or cache load)",
                file=sys.stderr,
            )
        if speculate is not None:
            print(
                f"{speculation_line(spec_stats)}; --speculate {args.speculate}, --draft-tokens {speculate.k}",
                file=sys.stderr,
            )
    return 0


def read_prompt(arg: str | None) -> str:
    """The prompt argument, or standard input for None / '-'; non-UTF-8 bytes are a ValueError."""
    import os

    if arg is not None and arg != "-":
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            raw = os.fsencode(arg)  # the argument's own bytes (undecodable ones were kept as surrogates)
            _utf8_or_error(raw, "the prompt argument")
        return arg
    stream = sys.stdin
    if stream is None:
        raise ValueError("no prompt: give it as an argument or on standard input")
    buffer = getattr(stream, "buffer", None)
    if buffer is None:  # a text stream without bytes underneath (e.g. io.StringIO)
        return stream.read()
    return _utf8_or_error(buffer.read(), "standard input")


def _utf8_or_error(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{where}: not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start}); "
            "give UTF-8 text, e.g. convert it with iconv -t UTF-8"
        ) from None


class StreamPrinter:
    """Writes generated text to stdout as it grows, never a half-decoded character.

    The text is decoded from all ids so far; a trailing U+FFFD may be an incomplete multi-byte
    character, so it is held back until a later token completes it (or the stream ends). What is
    printed in total equals the non-streamed text, stop tokens excluded.
    """

    def __init__(self, tokenizer, stops, out=None) -> None:
        self.tokenizer = tokenizer
        self.stops = set(stops)
        self.out = out if out is not None else sys.stdout
        self.ids: list[int] = []
        self.printed = ""

    def _emit(self, text: str) -> None:
        chunk = text[len(self.printed) :]
        if chunk:
            self.out.write(chunk)
            self.out.flush()
            self.printed = text

    def push(self, token: int) -> None:
        """Add one generated id and print whatever text it completed."""
        if token in self.stops:
            return
        self.ids.append(token)
        self._emit(self.tokenizer.decode(self.ids).rstrip("\ufffd"))

    def finish(self) -> None:
        """Print what is left (a genuinely invalid byte sequence prints as U+FFFD, as without --stream)."""
        self._emit(self.tokenizer.decode(self.ids))
