"""The GPU check: one script that says whether this project is right and how fast it is on a GPU.

    python benchmarks/gpu_check.py                       # on a GPU box: cuda, the default model
    python benchmarks/gpu_check.py --device cpu --lengths 512 1024 --trials 1   # a dry run on a CPU

It needs only torch, numpy, safetensors, tokenizers and PyYAML (what a bare GPU box has), reads the
package from this checkout's `src/` (no install), and reaches no network. Each check runs on its own
and is reported PASS or FAIL with its figures; the exit status is 1 if any failed:

1. exact: the model's teacher-forced logits on `--device` in float32 (TF32 off) against the CPU
   float32 reference, through the cached path (chunked prefill), on a passkey prompt;
2. bf16: the same in bfloat16 on the device, against the CPU float32 reference: argmax agreement and
   the greedy answer;
3. generate: the greedy answer on the device equals the CPU's; prefill and decode tokens/s;
4. engine: the batched engine on the device gives each prompt the text `generate()` gives it alone;
   its throughput;
5. passkey: the evaluation at `--lengths` (default 4,096 to 131,072 tokens) on the device: accuracy,
   wall time and peak device memory per length.

`--out FILE` writes every figure as JSON. `--budget-s` (default 420) skips the passkey lengths that
would not finish in time (it extrapolates from the last length's time, T² for full layers).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

DEFAULT_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompt(tok, length: int, key: str = "52718") -> list[int]:
    from gptoss_lite.evals.passkey import build_passkey_prompt

    return tok.encode_prompt(build_passkey_prompt(length, key, 0.5, tok))


def _cached_logits(model, ids: list[int], device: torch.device, chunk: int = 512) -> torch.Tensor:
    """Teacher-forced logits (T, V) in float32 through the cached path, prefilled `chunk` tokens a time."""
    from gptoss_lite.kv.mixed import MixedKVCache

    x = torch.tensor([ids], device=device)
    cache = MixedKVCache(model.config, batch_size=1)
    out = []
    with torch.inference_mode():
        for start in range(0, x.shape[1], chunk):
            piece = x[:, start : start + chunk]
            out.append(model(piece, cache=cache, start_pos=start).logits[0].float().cpu())
    return torch.cat(out)


def check_exact(ctx) -> dict:
    ref = _cached_logits(ctx.cpu_model, ctx.ids, torch.device("cpu"))
    got = _cached_logits(ctx.model(torch.float32), ctx.ids, ctx.device)
    scale = ref.abs().max().item()
    err = (got - ref).abs().max().item()
    return {"ok": err <= 1e-4 * scale, "max_abs_diff": err, "logit_scale": scale, "tolerance": 1e-4 * scale}


def check_bf16(ctx) -> dict:
    from gptoss_lite.generation import generate

    ref = _cached_logits(ctx.cpu_model, ctx.ids, torch.device("cpu"))
    model = ctx.model(torch.bfloat16)
    got = _cached_logits(model, ctx.ids, ctx.device)
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    x = torch.tensor([ctx.ids], device=ctx.device)
    answer = generate(model, x, max_new_tokens=8, temperature=0, stop_tokens=[ctx.tok.eos_id])[0, x.shape[1] :]
    text = ctx.tok.decode(answer.tolist())
    return {"ok": agree >= 0.98 and ctx.cpu_answer in text, "argmax_agreement": agree, "answer": text}


def check_generate(ctx) -> dict:
    from gptoss_lite.generation import generate

    model = ctx.model(torch.float32)
    x = torch.tensor([ctx.ids], device=ctx.device)
    answer = generate(model, x, max_new_tokens=8, temperature=0, stop_tokens=[ctx.tok.eos_id])
    text = ctx.tok.decode(answer[0, x.shape[1] :].tolist())
    _sync(ctx.device)
    t0 = time.perf_counter()
    generate(model, x, max_new_tokens=1, temperature=0)
    _sync(ctx.device)
    prefill_s = time.perf_counter() - t0
    n = 64
    t0 = time.perf_counter()
    generate(model, x, max_new_tokens=n, temperature=0)
    _sync(ctx.device)
    decode_s = max(1e-9, time.perf_counter() - t0 - prefill_s)
    return {
        "ok": text == ctx.cpu_text,
        "answer": text,
        "cpu_answer": ctx.cpu_text,
        "prefill_tokens_per_s": len(ctx.ids) / prefill_s,
        "decode_tokens_per_s": (n - 1) / decode_s,
    }


def check_engine(ctx) -> dict:
    from gptoss_lite.engine import LLM, SamplingParams
    from gptoss_lite.generation import generate

    model = ctx.model(torch.float32)
    keys = ["52718", "90210", "31337", "44160", "10293", "77777", "60417", "12121"]
    prompts = [_prompt(ctx.tok, 600, k) for k in keys]
    llm = LLM(model, tokenizer=ctx.tok, kv_blocks=512)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    _sync(ctx.device)
    seconds = time.perf_counter() - t0
    same = 0
    for ids, out in zip(prompts, outs):
        x = torch.tensor([ids], device=ctx.device)
        alone = generate(model, x, max_new_tokens=16, temperature=0, stop_tokens=[ctx.tok.eos_id])
        same += ctx.tok.decode(alone[0, x.shape[1] :].tolist()) == out.text
    generated = sum(len(o.token_ids) for o in outs)
    return {
        "ok": same == len(prompts),
        "same_as_generate": f"{same}/{len(prompts)}",
        "tokens_per_s": generated / seconds,
    }


def check_passkey(ctx) -> dict:
    from gptoss_lite.evals.passkey import PasskeyEvaluator

    model = ctx.model(ctx.passkey_dtype)
    rows, spent, last = [], 0.0, None
    for length in ctx.lengths:
        if length > model.config.max_position_embeddings - 16:
            rows.append({"length": length, "skipped": "beyond the model's positions"})
            continue
        if last is not None:
            guess = last[1] * (length / last[0]) ** 2
            if spent + guess > ctx.budget_s:
                rows.append(
                    {"length": length, "skipped": f"about {guess:.0f} s would pass the {ctx.budget_s:.0f} s budget"}
                )
                continue
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        ev = PasskeyEvaluator(model, ctx.tok, lengths=[length], n_trials=ctx.trials, batch_size=ctx.trials)
        t0 = time.perf_counter()
        result = ev.run()
        _sync(ctx.device)
        seconds = time.perf_counter() - t0
        spent += seconds
        last = (length, seconds)
        peak = (
            torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else result.peak_rss_bytes[length]
        )
        rows.append(
            {
                "length": length,
                "accuracy": result.accuracy[length],
                "by_depth": {str(d): a for d, a in result.accuracy_by_depth[length].items()},
                "seconds": seconds,
                "peak_memory_bytes": peak,
            }
        )
    measured = [r for r in rows if "accuracy" in r]
    return {"ok": bool(measured), "lengths": rows}


CHECKS = (
    ("exact", check_exact),
    ("bf16", check_bf16),
    ("generate", check_generate),
    ("engine", check_engine),
    ("passkey", check_passkey),
)


class Context:
    """What the checks share: the CPU float32 reference, its answer, and the device models (built once)."""

    def __init__(self, args):
        from gptoss_lite.checkpoint import default_model_source, load_model
        from gptoss_lite.generation import generate
        from gptoss_lite.tokenizer import load_tokenizer

        self.device = torch.device(args.device)
        self.source = args.model or default_model_source()
        self.tok = load_tokenizer(self.source)
        self.lengths, self.trials, self.budget_s = args.lengths, args.trials, args.budget_s
        self.passkey_dtype = torch.bfloat16 if args.passkey_dtype == "bfloat16" else torch.float32
        self._load = load_model
        self._models: dict[torch.dtype, object] = {}
        self.cpu_model = load_model(self.source, device="cpu", dtype=torch.float32)
        self.ids = _prompt(self.tok, args.prompt_tokens)
        x = torch.tensor([self.ids])
        out = generate(self.cpu_model, x, max_new_tokens=8, temperature=0, stop_tokens=[self.tok.eos_id])
        self.cpu_text = self.tok.decode(out[0, x.shape[1] :].tolist())
        self.cpu_answer = self.cpu_text.strip().rstrip(".")

    def model(self, dtype: torch.dtype):
        if dtype not in self._models:
            self._models[dtype] = self._load(self.source, device=self.device, dtype=dtype)
        return self._models[dtype]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="the device under test (default: cuda)")
    p.add_argument("--model", default=None, help="model directory (default: the shipped model)")
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), help="passkey lengths")
    p.add_argument("--trials", type=int, default=3, help="passkey trials per length and depth (default: 3)")
    p.add_argument("--passkey-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="the exactness prompt's length (default: 1024)")
    p.add_argument("--budget-s", type=float, default=420.0, help="time for the passkey lengths (default: 420)")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here; pass --device cpu for a dry run")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 for the exactness check
    torch.backends.cudnn.allow_tf32 = False
    started = time.perf_counter()
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor() or "cpu",
        "python": platform.python_version(),
    }
    print(f"gpu_check: torch {env['torch']}, CUDA {env['cuda']}, device {env['device']}", flush=True)
    ctx = Context(args)
    print(f"gpu_check: model {ctx.source}; CPU float32 answer {ctx.cpu_text!r}", flush=True)
    report: dict = {"env": env, "model": str(ctx.source), "checks": {}}
    for name, check in CHECKS:
        t0 = time.perf_counter()
        try:
            result = check(ctx)
        except Exception as e:  # noqa: BLE001 - a failing check is a result, the others still run
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - t0, 2)
        report["checks"][name] = result
        figures = {k: v for k, v in result.items() if k not in ("ok", "traceback", "lengths")}
        print(f"{'PASS' if result['ok'] else 'FAIL'} {name:<9} {json.dumps(figures, default=str)}", flush=True)
        for row in result.get("lengths", []):
            print(f"    {json.dumps(row)}", flush=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    failed = [n for n, r in report["checks"].items() if not r["ok"]]
    print(f"gpu_check: {len(CHECKS) - len(failed)} passed, {len(failed)} failed in {report['seconds']} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
