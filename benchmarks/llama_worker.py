"""llama.cpp worker for `bench_vs_peers.py` (run with the Python of a virtual environment that has
llama-cpp-python; this package is not needed there).

    python benchmarks/llama_worker.py MODEL.gguf --threads 2 --max-model-len 2176 [--flash-attn]

The GGUF file decides the weights' type (`--dtype` only labels the run). One request at a time: the
prompt's token ids go in as they are, greedy (temperature 0, top-k 1, no repetition penalty), end of
text ignored (generation stops after max_tokens tokens). The KV cache is cleared before every request.
`--flash-attn` turns llama.cpp's flash attention on and keeps only the window on sliding layers (what its
command-line tools do); without it, llama-cpp-python's defaults. Speaks the protocol of worker_protocol.py.
"""

from __future__ import annotations

import argparse
import time

from worker_protocol import protocol_stream, serve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", help="the model as a GGUF file")
    ap.add_argument("--dtype", default="float32", help="label only: the file's tensor types are what runs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=2176, help="context size: prompt + new tokens")
    ap.add_argument("--flash-attn", action="store_true")
    args = ap.parse_args()
    channel = protocol_stream()

    import llama_cpp
    from llama_cpp import Llama

    options = {
        "model_path": args.gguf,
        "n_ctx": args.max_model_len,
        "n_batch": 2048,
        "n_ubatch": 512,
        "n_threads": args.threads,
        "n_threads_batch": args.threads,
        "logits_all": False,
        "verbose": False,
    }
    if args.flash_attn:
        options.update(flash_attn=True, swa_full=False)
    llm = Llama(**options)

    def clear() -> None:
        llm.reset()
        ctx = llm._ctx  # the KV cache survives reset(); each request starts from an empty one
        if hasattr(ctx, "kv_cache_clear"):
            ctx.kv_cache_clear()
        elif hasattr(ctx, "memory_clear"):  # newer llama-cpp-python
            ctx.memory_clear(True)

    def run(prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]], dict]:
        outputs, first = [], []
        t0 = time.perf_counter()
        for ids in prompts:
            clear()
            new: list[int] = []
            sampling = {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}
            for token in llm.generate(ids, reset=True, **sampling):
                new.append(int(token))
                if len(new) == 1:
                    first.append(time.perf_counter() - t0)  # the prompt's prefill, for a decode rate in one request
                if len(new) == max_tokens:
                    break
            outputs.append(new)
        return time.perf_counter() - t0, outputs, {"first_token_s": first}

    info = {
        "engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})",
        "dtype": args.dtype,
        "gguf": args.gguf,
        "threads": args.threads,
        "flash_attn": args.flash_attn,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
    }
    serve(channel, info, run)


if __name__ == "__main__":
    main()
