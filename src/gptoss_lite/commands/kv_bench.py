"""`gptoss-lite kv-bench`: mixed (ring + growing) vs all-global KV payload for the 502M preset (SPEC §3.1).

The table is computed payload (exact bytes of K and V), not measured occupancy. Columns are a list of
(header, cell function) pairs so that a measured column from the real MixedKVCache can be appended
without touching the rest.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Callable

from gptoss_lite import plan as P

PRESET = "gptoss-lite-502m"
CONTEXTS = (4096, 8192, 32768, 65536, 131072)
PASS_CONTEXT = 131_072  # SPEC §3.1: the benchmark passes at >= 1.8x here
PASS_RATIO = 1.8


@dataclass(frozen=True)
class KVBenchRow:
    """Payloads of one context length (bytes, exact)."""

    context_tokens: int
    all_global_bytes: int  # every layer keeps every token
    mixed_bytes: int  # sliding layers keep min(W, T)

    @property
    def ratio(self) -> float:
        return self.all_global_bytes / self.mixed_bytes


def bench_rows(geometry: P.AttentionKVGeometry, contexts: tuple[int, ...] = CONTEXTS) -> list[KVBenchRow]:
    """Mixed vs all-global payload of `geometry` at each context (contexts must be >= 1)."""
    all_global = P.AttentionKVGeometry(f"{geometry.name}-all-global", geometry.attention_layers,
                                       geometry.kv_heads, geometry.head_dim, geometry.bytes_per_element)
    rows = []
    for t in contexts:
        if t < 1:
            raise ValueError(f"context={t}: must be >= 1 token")
        rows.append(KVBenchRow(t, P.kv_payload_bytes(all_global, t), P.kv_payload_bytes(geometry, t)))
    return rows


Column = tuple[str, Callable[[KVBenchRow], str]]
COLUMNS: list[Column] = [
    ("context", lambda r: f"{r.context_tokens:,}"),
    ("all-global payload B", lambda r: f"{r.all_global_bytes:,}"),
    ("GiB", lambda r: f"{r.all_global_bytes / P.GIB:.2f}"),
    ("GB", lambda r: f"{r.all_global_bytes / P.GB:.2f}"),
    ("mixed payload B", lambda r: f"{r.mixed_bytes:,}"),
    ("GiB", lambda r: f"{r.mixed_bytes / P.GIB:.2f}"),
    ("GB", lambda r: f"{r.mixed_bytes / P.GB:.2f}"),
    ("ratio", lambda r: f"{r.ratio:.2f}x"),
]


def format_table(rows: list[KVBenchRow], columns: list[Column] = COLUMNS) -> str:
    cells = [[fn(r) for _, fn in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _) in enumerate(columns)]
    lines = ["  ".join(h.rjust(w) for (h, _), w in zip(columns, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "kv-bench", help="mixed vs all-global KV payload of the 502M preset (SPEC §3.1); PASS at >= 1.8x at 128K",
        description="Computed KV payload (bytes of K and V, BF16) of the gptoss-lite-502m preset with "
                    "ring buffers on its 6 sliding layers vs every layer global.")
    p.add_argument("--json", action="store_true", help="print rows and verdict as JSON (sorted keys)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    geometry = P.get_geometry(PRESET)
    rows = bench_rows(geometry)
    check = next(r for r in rows if r.context_tokens == PASS_CONTEXT)
    passed = check.ratio >= PASS_RATIO
    if args.json:
        print(json.dumps({"preset": PRESET, "quantity": "payload",
                          "rows": [{"context_tokens": r.context_tokens, "all_global_bytes": r.all_global_bytes,
                                    "mixed_bytes": r.mixed_bytes, "ratio": r.ratio} for r in rows],
                          "pass_context_tokens": PASS_CONTEXT, "pass_ratio": PASS_RATIO, "passed": passed},
                         sort_keys=True, indent=2))
    else:
        print(f"KV payload of {PRESET} (BF16, batch 1): {geometry.sliding_window_layers} sliding layers "
              f"(ring, W={geometry.window}) + {geometry.global_layers} global vs all {geometry.attention_layers} "
              "global; GiB = 2^30 B, GB = 10^9 B")
        print(format_table(rows))
        verdict = "PASS" if passed else "FAIL"
        print(f"{verdict}: mixed cache payload is {check.ratio:.2f}x smaller than all-global at "
              f"{PASS_CONTEXT:,} tokens (target >= {PASS_RATIO}x)")
    return 0 if passed else 1
