"""Answer loss by document type of a training checkpoint: is copying / retrieval being learned?

The total training loss is dominated by filler the model predicts early; this prints the mean
next-token loss (nats per token) on the ANSWER tokens only, separately for passkey, key/value and
copy documents, on 48 fixed documents from the training generator (seeds disjoint from training).

    python benchmarks/answer_nll.py runs/demo_cpu/checkpoints/step_0002000
"""

from __future__ import annotations

import argparse
import random

import torch

from gptoss_lite.checkpoint import load_model
from gptoss_lite.tokenizer import ByteTokenizer
from gptoss_lite.train.config import load_train_config
from gptoss_lite.train.data import SyntheticRetrievalData


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a checkpoint or model directory")
    ap.add_argument("--config", default="configs/demo_cpu.yaml", help="the training config (data section)")
    ap.add_argument("--documents", type=int, default=48)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = load_model(args.checkpoint)
    data = SyntheticRetrievalData(load_train_config(args.config).data)
    tok = ByteTokenizer()
    by_kind: dict[str, list[float]] = {}
    for i in range(args.documents):
        tokens, answer_start = data.document(random.Random(f"diag/{i}"))
        text = tok.decode(tokens)
        kind = "copy" if "Repeat the sequence" in text else "kv" if "code for" in text else "passkey"
        x = torch.tensor([tokens])  # (1, T + 1)
        with torch.no_grad():
            logp = torch.log_softmax(model(x[:, :-1]).logits.float(), dim=-1)[0]  # (T, V)
        target = x[0, 1:]
        nll = -logp[torch.arange(len(target)), target]
        by_kind.setdefault(kind, []).append(nll[answer_start - 1 : -1].mean().item())  # answer, not EOS
    for kind, values in sorted(by_kind.items()):
        print(
            f"{args.checkpoint}: {kind:8s} {len(values):3d} documents, answer loss "
            f"{sum(values) / len(values):.3f} nats/token"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
