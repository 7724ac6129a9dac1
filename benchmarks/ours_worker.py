"""gptoss-lite worker for `serve_vs_vllm.py`, in one of two modes (speaks the protocol of worker_protocol.py).

    python benchmarks/ours_worker.py MODEL_DIR --mode engine --dtype float32 --threads 2 \\
        --max-running 16 --max-batch-tokens 2048 --max-model-len 384

- `engine`: the serving engine, `gptoss_lite.engine.LLM(MODEL_DIR, dtype=..., max_batch_tokens=...,
  max_running=..., max_model_len=..., enable_prefix_caching=False)` and `llm.generate(prompts,
  SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))`: requests are scheduled, prefilled in
  chunks of the token budget and decoded together in one ragged batch per step. Prefix caching is off
  because the driver sends the same prompts every round (vLLM's is off too). With `--compile`
  (`LLM(compile_decode=True)`), all-decode steps run as the model's compiled decode step over the block
  tables, compiled when the worker starts.
- `static`: the baseline before the engine, `gptoss_lite.generation.generate` on one (B, T) tensor of the
  equal-length prompts: one static batch (no padding), prefilled together, decoded in lockstep. With
  `--compile`, its decode steps run as one compiled graph (`prepare_for_inference(compile_decode=True)`).

Both run greedy with the end-of-text token ignored, so every request generates exactly N tokens.
"""

from __future__ import annotations

import argparse
import time

from worker_protocol import protocol_stream, serve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="model directory (HF gpt-oss or native layout)")
    ap.add_argument("--mode", default="engine", choices=["engine", "static"])
    ap.add_argument("--compile", action="store_true", help="decode steps as one compiled graph (both modes)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--max-running", type=int, default=16, help="engine: requests decoded together (default 16)")
    ap.add_argument("--max-batch-tokens", type=int, default=2048, help="engine: tokens per step (default 2048)")
    ap.add_argument("--max-model-len", type=int, default=384, help="engine: prompt + new tokens (default 384)")
    ap.add_argument("--kv-cache-mib", type=int, default=None, help="engine: KV pool size (default: the engine's)")
    ap.add_argument(
        "--mxfp4-activations", default="exact", choices=["exact", "int8"], help="packed MXFP4 experts' decode rows"
    )
    args = ap.parse_args()
    channel = protocol_stream()

    import torch

    import gptoss_lite

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    info = {"dtype": args.dtype, "threads": torch.get_num_threads(), "torch": torch.__version__}
    info["mxfp4_activations"] = args.mxfp4_activations
    if args.mode == "engine":
        from gptoss_lite.engine import LLM, SamplingParams

        llm = LLM(
            args.model,
            dtype=dtype,
            max_batch_tokens=args.max_batch_tokens,
            max_running=args.max_running,
            max_model_len=args.max_model_len,
            enable_prefix_caching=False,
            compile_decode=args.compile,
            mxfp4_activations=args.mxfp4_activations,
            **({} if args.kv_cache_mib is None else {"kv_cache_bytes": args.kv_cache_mib << 20}),
        )
        info.update(
            engine=f"gptoss-lite {gptoss_lite.__version__} engine" + (", compiled decode" if args.compile else ""),
            compile_s=llm.compile_seconds,
            max_running=args.max_running,
            max_batch_tokens=args.max_batch_tokens,
            max_model_len=llm.max_model_len,
            kv_blocks=llm.stats().kv_blocks_total,
        )

        def run(prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]], dict]:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            before = llm.stats()
            start = time.monotonic()  # the clock of the requests' metrics
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - t0
            after = llm.stats()
            extra = {"preemptions": after.preemptions - before.preemptions, "prefix_hits": after.prefix_hits}
            # when each request's first token was out, from the start of the call (a decode rate measured
            # inside one request)
            extra["first_token_s"] = [o.metrics.ttft + (o.metrics.arrival_time - start) for o in outs]
            return wall, [list(o.token_ids) for o in outs], extra

    else:
        from gptoss_lite.checkpoint import load_model
        from gptoss_lite.generation import stream_generate

        model = load_model(args.model, dtype=dtype, mxfp4_activations=args.mxfp4_activations)
        info["engine"] = f"gptoss-lite {gptoss_lite.__version__} static batch (generation.generate)"
        if args.compile:  # compiled on the driver's untimed warm-up request
            model.prepare_for_inference(compile_decode=True)
            info["engine"] += ", compiled decode"

        def run(prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]], dict]:
            ids = torch.tensor(prompts, dtype=torch.long)  # (B, T): the prompts must have one length
            t0 = time.perf_counter()
            steps, first = [], None
            for step in stream_generate(model, ids, max_tokens, temperature=0):  # no stop token given
                steps.append(step)
                first = time.perf_counter() - t0 if first is None else first
            wall = time.perf_counter() - t0
            # first_token_s: when the first new token was out (the prompt's prefill), for a decode rate
            # measured inside one request
            return wall, torch.stack(steps, dim=1).tolist(), {"first_token_s": [first] * len(prompts)}

    from gptoss_lite.kernels import report

    info["kernels"] = report()  # which path each native kernel takes in this worker
    serve(channel, info, run)


if __name__ == "__main__":
    main()
