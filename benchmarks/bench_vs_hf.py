"""Prefill/decode speed and peak memory: gptoss-lite vs Hugging Face transformers on the same weights.

Builds a random ~20M-parameter gpt-oss model with transformers (seeded), saves it in the HF layout,
loads those same files into both engines, and measures in separate worker processes (so peak RSS is
per engine and per length):

- prefill tokens/s: prompt tokens / time from the call to the first new token (one prefill pass);
- decode tokens/s: tokens after the first / time from the first to the last new token, timed inside
  one generation call (our token iterator; transformers' streamer hook, called once per token);
- peak RSS of the worker process, and its rise above the RSS after loading the model.

Each figure is the median of --repeats rounds in one sitting. A round runs every length on both
engines, alternating them, each run in a fresh process after a short warm-up generation, so that a
slow spell on a shared machine hits both engines. The ratio columns are ours / transformers' medians;
the decode range is the lowest and highest per-round ratio. transformers runs with eager attention and
its default cache (what it supports for gpt-oss on CPU).

    python benchmarks/bench_vs_hf.py                       # 256, 2048, 8192 tokens, 3 repeats
    python benchmarks/bench_vs_hf.py --lengths 256 --repeats 1 --json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HF_CONFIG = dict(  # the ~20M gpt-oss config of the inference-path issue (= fixture gpt-oss-bench-20m)
    vocab_size=12_288,
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    intermediate_size=256,
    sliding_window=128,
    max_position_embeddings=131_072,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150_000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "truncate": False,
    },
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=None,
    bos_token_id=None,
)


def build_checkpoint(directory: Path, seed: int) -> None:
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**HF_CONFIG)).eval()
    with torch.no_grad():  # non-trivial sinks and biases, so both engines really use them
        for name, p in model.named_parameters():
            if name.endswith("sinks") or name.endswith("bias"):
                p.normal_(0, 0.5 if name.endswith("sinks") else 0.02)
    model.save_pretrained(directory, safe_serialization=True)


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def worker(engine: str, ckpt: str, length: int, new_tokens: int, repeats: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(1, HF_CONFIG["vocab_size"], (1, length), generator=g)
    if engine == "ours":
        from gptoss_lite.checkpoint import load_model
        from gptoss_lite.generation import stream_generate

        model = load_model(ckpt)

        def run(ids: torch.Tensor, n: int) -> tuple[list[float], list[int]]:
            stamps, tokens = [time.perf_counter()], []
            for token in stream_generate(model, ids, n, temperature=0):
                stamps.append(time.perf_counter())
                tokens.append(int(token[0]))
            return stamps, tokens
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float32).eval()

        class Stamps:  # transformers calls put() with the prompt first, then once per new token
            def __init__(self):
                self.stamps, self.tokens = [], []

            def put(self, value):
                self.stamps.append(time.perf_counter())
                if len(self.stamps) > 1:
                    self.tokens.append(int(value.reshape(-1)[0]))

            def end(self):
                pass

        def run(ids: torch.Tensor, n: int) -> tuple[list[float], list[int]]:
            mask = torch.ones_like(ids)  # explicit: without it transformers masks every pad-id token
            streamer = Stamps()
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                    streamer=streamer,
                )
            return [t0] + streamer.stamps[1:], streamer.tokens

    run(ids[:, :16], 2)  # warm-up (one-time costs of either engine), on a short prompt
    base_rss = rss_mib()
    prefill, decode, tokens = [], [], None
    for _ in range(repeats):
        stamps, tokens = run(ids, 1 + new_tokens)
        prefill.append(stamps[1] - stamps[0])
        decode.append(stamps[-1] - stamps[1])
    return {
        "engine": engine,
        "length": length,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "prefill_tokens_per_s": length / statistics.median(prefill),
        "decode_tokens_per_s": new_tokens / statistics.median(decode),
        "peak_rss_mib": rss_mib(),
        "rss_rise_mib": rss_mib() - base_rss,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 2048, 8192], help="prompt lengths in tokens")
    ap.add_argument("--new-tokens", type=int, default=32, help="decoded tokens per run (default: 32)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is reported (default: 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for both engines (default: 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", nargs=2, metavar=("ENGINE", "CKPT"), help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(
            json.dumps(worker(args.worker[0], args.worker[1], args.length, args.new_tokens, args.repeats, args.threads))
        )
        return 0

    # Rounds interleave the engines (ours, transformers, ours, …), each run in a fresh process, so a
    # slow spell on this shared machine hits both engines rather than one engine's whole sample.
    runs: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(Path(tmp), args.seed)
        for r in range(args.repeats):
            for length in args.lengths:
                for engine in ("ours", "transformers"):
                    cmd = [
                        sys.executable,
                        __file__,
                        "--worker",
                        engine,
                        tmp,
                        "--length",
                        str(length),
                        "--new-tokens",
                        str(args.new_tokens),
                        "--repeats",
                        "1",
                        "--threads",
                        str(args.threads),
                    ]
                    print(
                        f"[bench] round {r + 1}/{args.repeats}: {engine} @ {length} tokens …",
                        file=sys.stderr,
                        flush=True,
                    )
                    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                    runs.setdefault((engine, length), []).append(json.loads(out.strip().splitlines()[-1]))

    def median_of(engine: str, length: int, key: str) -> float:
        return statistics.median(run[key] for run in runs[(engine, length)])

    table = []
    for length in args.lengths:
        o = {k: median_of("ours", length, k) for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "peak_rss_mib")}
        h = {k: median_of("transformers", length, k) for k in o}
        o["tokens"], h["tokens"] = runs[("ours", length)][0]["tokens"], runs[("transformers", length)][0]["tokens"]
        table.append(
            {
                "length": length,
                "prefill_ours": o["prefill_tokens_per_s"],
                "prefill_hf": h["prefill_tokens_per_s"],
                "prefill_ratio": o["prefill_tokens_per_s"] / h["prefill_tokens_per_s"],
                "decode_ours": o["decode_tokens_per_s"],
                "decode_hf": h["decode_tokens_per_s"],
                "decode_ratio": o["decode_tokens_per_s"] / h["decode_tokens_per_s"],
                "peak_rss_mib_ours": o["peak_rss_mib"],
                "peak_rss_mib_hf": h["peak_rss_mib"],
                "same_greedy_tokens": all(run["tokens"] == h["tokens"] for run in runs[("ours", length)]),
                "decode_ratio_per_round": [
                    a["decode_tokens_per_s"] / b["decode_tokens_per_s"]
                    for a, b in zip(runs[("ours", length)], runs[("transformers", length)])
                ],
            }
        )
    if args.json:
        print(
            json.dumps(
                {"threads": args.threads, "repeats": args.repeats, "new_tokens": args.new_tokens, "rows": table},
                indent=2,
            )
        )
        return 0
    print(
        f"gpt-oss ~20M (HF layout, fp32, CPU, {args.threads} threads); median of {args.repeats} rounds; "
        f"decode = {args.new_tokens} tokens after the prompt"
    )
    print(
        f"{'prompt':>7} | {'prefill tok/s ours':>18} {'HF':>9} {'ratio':>6} | {'decode tok/s ours':>17} "
        f"{'HF':>7} {'ratio':>6} {'range':>11} | {'peak RSS MiB ours':>17} {'HF':>7} | same tokens"
    )
    for r in table:
        print(
            f"{r['length']:>7} | {r['prefill_ours']:>18,.0f} {r['prefill_hf']:>9,.0f} {r['prefill_ratio']:>5.2f}x | "
            f"{r['decode_ours']:>17,.1f} {r['decode_hf']:>7,.1f} {r['decode_ratio']:>5.2f}x "
            f"{min(r['decode_ratio_per_round']):>5.2f}-{max(r['decode_ratio_per_round']):.2f}x | "
            f"{r['peak_rss_mib_ours']:>17,.0f} {r['peak_rss_mib_hf']:>7,.0f} | {r['same_greedy_tokens']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
