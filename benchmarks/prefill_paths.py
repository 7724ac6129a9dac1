"""A prompt's eager paths against what they replaced: a 2,048-token prompt through `generate()` (one
new token), one part of the model switched at a time, in one process.

    python benchmarks/prefill_paths.py MODEL_DIR --dtype float32 --rounds 5

Modes, taking turns in each round (the order alternating between rounds), each timed as the best of
`--reps` prefills:

- default: `Experts.grouped` (one gate|up GEMM per expert; `combine` reads each down-projection's
  output where its GEMM wrote it) with `kernels/moe.c`'s two passes (`activate_halves`, `combine`),
  and `kernels/norm.c`'s RMSNorm;
- topk-torch: the router's top k by torch.topk, not `kernels.moe.topk` (one pass, the same answer);
- moe-one-buffer: the same, the down-projections' outputs first copied into one buffer (as before
  `combine` read them in pieces);
- moe-torch-group: the same, the tokens grouped by expert with PyTorch's ops (stable argsort,
  bincount, index_select, a scatter) instead of `kernels/moe.c`'s counting sort and gather;
- moe-torch: the same MoE structure with PyTorch's ops for the three passes (the references, and
  what a machine without the kernel runs);
- moe-per-expert: each expert by `Experts.expert` (two GEMMs and PyTorch's activation), the outputs
  concatenated, weighted and `index_add_`-ed, as the prefill ran before these passes;
- norm-torch: RMSNorm by `F.rms_norm` (as before `kernels/norm.c`);
- rope-torch: the queries' and keys' rotation by PyTorch's four ops (as before `kernels/rope.c`);
- no-prompt-packs: the prompt's products by PyTorch's `addmm` on the weights as stored, the oneDNN
  copies `GPTOSS.pack_for_prompts` makes (`model/matmul.py`, `PromptPack`) kept but serving nothing;
- packs-from-64: the copies serving products of 64 rows or more only (`PACKED_ROWS` before 2026-12-07),
  where they now serve from `matmul.PACKED_ROWS` rows: an expert with fewer rows takes `addmm`.

`--modes` picks some of them (default is always timed). Under `GPTOSS_LITE_CPU=avx2
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` the process takes an AVX2-only CPU's paths
(docs/kernels.md#imitating-an-avx2-only-cpu), which is how a kernel's AVX2 path is held to PyTorch's on
a wider machine.

The table gives medians over rounds and the median of the per-round ratios default / mode (how much
faster the default is). `--out` keeps the samples with `lscpu`, those three variables and the path each
kernel took (`gptoss_lite.kernels.report`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = [
    "default",
    "topk-torch",
    "moe-one-buffer",
    "moe-torch-group",
    "moe-torch",
    "moe-per-expert",
    "norm-torch",
    "rope-torch",
    "no-prompt-packs",
    "packs-from-64",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="model directory (HF gpt-oss or native layout)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=MODES, help="the modes to time besides default")
    ap.add_argument("--out", type=Path, default=None, help="write every sample as JSON")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from gptoss_lite.checkpoint import load_model
    from gptoss_lite.generation import generate
    from gptoss_lite.kernels import moe as moe_kernel
    from gptoss_lite.kernels import norm as norm_kernel
    from gptoss_lite.kernels import report
    from gptoss_lite.kernels import rope as rope_kernel
    from gptoss_lite.model import matmul, moe

    model = load_model(args.model, dtype=getattr(torch, args.dtype))
    model.prepare_for_inference(compile_decode=True)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    library, grouped, combine, group = moe_kernel._prefill_library, moe.Experts.grouped, moe.combine, moe_kernel.group
    topk = moe_kernel.topk
    norm_applies, rotate = norm_kernel.applies, rope_kernel.rotate

    def index_add(pieces, at, weights):  # the weighting and index_add_ the prefill ran before `combine`
        rows = torch.cat(pieces)
        token = torch.arange(at.shape[0]).repeat_interleave(at.shape[1])
        order = torch.empty_like(token)
        order[at.reshape(-1)] = torch.arange(at.numel())
        w = weights.reshape(-1).index_select(0, order)
        out = torch.zeros(at.shape[0], rows.shape[1], dtype=rows.dtype)
        return out.index_add_(0, token.index_select(0, order), rows * w[:, None])

    def one_buffer(self, xs, counts):  # the outputs in one buffer, each copied in after its GEMM
        pieces = grouped(self, xs, counts)
        return [torch.cat(pieces)] if pieces else pieces

    model.pack_for_prompts(None)  # whatever the budget, so that the mode below has packs to turn off
    packed_rows = matmul.PACKED_ROWS

    def use(mode: str) -> None:
        # no product serves, or only those of 64 rows and more, or the default
        matmul.PACKED_ROWS = {"no-prompt-packs": 1 << 62, "packs-from-64": 64}.get(mode, packed_rows)
        moe_kernel._prefill_library = (lambda *t: None) if mode in ("moe-torch", "moe-per-expert") else library
        swapped = {"moe-per-expert": moe._grouped_by_expert, "moe-one-buffer": one_buffer}
        moe.Experts.grouped = swapped.get(mode, grouped)
        moe.combine = index_add if mode == "moe-per-expert" else combine
        torch_group = mode in ("moe-torch-group", "moe-torch", "moe-per-expert")
        moe_kernel.group = (lambda *a: None) if torch_group else group
        moe_kernel.topk = (lambda *a: None) if mode in ("topk-torch", "moe-torch", "moe-per-expert") else topk
        norm_kernel.applies = (lambda *a: False) if mode == "norm-torch" else norm_applies
        rope_kernel.rotate = (lambda *a: None) if mode == "rope-torch" else rotate

    def rate() -> float:
        best = float("inf")
        for _ in range(args.reps):
            t0 = time.perf_counter()
            generate(model, ids, 1, temperature=0)
            best = min(best, time.perf_counter() - t0)
        return args.tokens / best

    modes = ["default", *(m for m in MODES if m in args.modes and m != "default")]
    tokens = {}
    for mode in modes:  # warm-up, and the first token of each path
        use(mode)
        tokens[mode] = generate(model, ids, 1, temperature=0)[0, -1].item()
    samples: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            use(mode)
            samples[mode].append(rate())
        print(f"round {r + 1}: " + ", ".join(f"{m} {samples[m][-1]:,.0f}" for m in modes), file=sys.stderr)
    use("default")

    env = {k: os.environ.get(k) for k in ("GPTOSS_LITE_CPU", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    imitating = ", ".join(f"{k}={v}" for k, v in env.items() if v)
    print(f"{args.tokens}-token prefill, {args.dtype}, {args.threads} threads, {args.rounds} rounds (tok/s)"
          + (f", {imitating}" if imitating else ""))  # fmt: skip
    print("| mode | tok/s | default / mode | first token |")
    print("|---|---:|---:|---:|")
    for m in modes:
        ratio = statistics.median(a / b for a, b in zip(samples["default"], samples[m]))
        print(f"| {m} | {statistics.median(samples[m]):,.0f} | {ratio:.3f}x | {tokens[m]} |")
    if args.out:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "env": env, "lscpu": lscpu,
                                        "kernels": report(), "samples": samples, "first_token": tokens},
                                       indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
