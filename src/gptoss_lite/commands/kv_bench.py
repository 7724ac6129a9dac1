"""`gptoss-lite kv-bench`: mixed (ring + growing) vs all-full KV payload for the 502M preset
(docs/kv-cache.md#kv-arithmetic-of-the-502m-preset).

The table is computed payload (exact bytes of K and V). With `--measured`, two more columns come from
a real MixedKVCache of the preset's geometry filled in 2,048-token prefill chunks (BF16): the payload
it holds (must equal the computed mixed payload) and the bytes it has allocated (ring = W slots,
full-layer buffers within their 1.5x growth slack).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass

from gptoss_lite import plan as P

PRESET = "gptoss-lite-502m"
CONTEXTS = (4096, 8192, 32768, 65536, 131072)
PASS_CONTEXT = 131_072  # docs/kv-cache.md#kv-arithmetic-of-the-502m-preset: the benchmark passes at >= 1.8x here
PASS_RATIO = 1.8


@dataclass(frozen=True)
class KVBenchRow:
    """Payloads of one context length (bytes, exact)."""

    context_tokens: int
    all_full_bytes: int  # every layer full attention: keeps every token
    mixed_bytes: int  # sliding layers keep min(W, T)

    @property
    def ratio(self) -> float:
        return self.all_full_bytes / self.mixed_bytes


def bench_rows(geometry: P.AttentionKVGeometry, contexts: tuple[int, ...] = CONTEXTS) -> list[KVBenchRow]:
    """Mixed vs all-full payload of `geometry` at each context (contexts must be >= 1)."""
    all_full = P.AttentionKVGeometry(
        f"{geometry.name}-all-full",
        geometry.attention_layers,
        geometry.kv_heads,
        geometry.head_dim,
        geometry.bytes_per_element,
    )
    rows = []
    for t in contexts:
        if t < 1:
            raise ValueError(f"context={t}: must be >= 1 token")
        rows.append(KVBenchRow(t, P.kv_payload_bytes(all_full, t), P.kv_payload_bytes(geometry, t)))
    return rows


Column = tuple[str, Callable[[KVBenchRow], str]]
COLUMNS: list[Column] = [
    ("context", lambda r: f"{r.context_tokens:,}"),
    ("all-full payload B", lambda r: f"{r.all_full_bytes:,}"),
    ("GiB", lambda r: f"{r.all_full_bytes / P.GIB:.2f}"),
    ("GB", lambda r: f"{r.all_full_bytes / P.GB:.2f}"),
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


def measure_mixed_cache(contexts: tuple[int, ...], chunk: int = 2048) -> dict[int, tuple[int, int]]:
    """{context: (payload bytes, allocated bytes)} of a real 502M-geometry MixedKVCache after prefill."""
    import torch

    from gptoss_lite.config import get_preset
    from gptoss_lite.kv.mixed import MixedKVCache

    cfg = get_preset(PRESET)
    block = torch.zeros(1, cfg.n_kv_heads, chunk, cfg.head_dim, dtype=torch.bfloat16)  # (B, K, T, D)
    out = {}
    for t in contexts:
        cache = MixedKVCache(cfg)
        for start in range(0, t, chunk):
            piece = block[:, :, : min(chunk, t - start)]
            for layer in range(cfg.n_layers):
                cache[layer].append(piece, piece)
        out[t] = (cache.payload_bytes, cache.nbytes)
        cache.reset()
    return out


def measure_cache_bytes(config, settings, contexts: tuple[int, ...], chunk: int = 2048) -> dict[int, tuple[int, int]]:
    """{context: (payload bytes, allocated bytes)} of a real cache of `settings` (a KVSettings) for a
    model `config`, filled with random BF16 K/V in `chunk`-token prefill pieces (quantised full layers
    store codes, scales and zero points; the bytes do not depend on the values)."""
    import torch

    K, D = config.n_kv_heads, config.head_dim
    block = torch.randn(1, K, chunk, D, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # (B, K, T, D)
    out = {}
    for t in contexts:
        cache = settings.build(config)
        for start in range(0, t, chunk):
            piece = block[:, :, : min(chunk, t - start)]
            for layer in range(config.n_layers):
                cache.update(layer, piece, piece, start)  # a read is returned, not materialised
        out[t] = (cache.payload_bytes, cache.nbytes)
        cache.reset()
    return out


def measure_quantized_cache(contexts: tuple[int, ...], bits: int, chunk: int = 2048) -> dict[int, tuple[int, int]]:
    """{context: (payload bytes, allocated bytes)} of a real 502M-geometry QuantizedKVCache (int8/int4 full
    layers, scales and zero points included) after prefill in `chunk`-token pieces."""
    from gptoss_lite.config import get_preset
    from gptoss_lite.kv.settings import KVSettings
    from gptoss_lite.kvspec import kv_format

    return measure_cache_bytes(get_preset(PRESET), KVSettings(format=kv_format(bits)), contexts, chunk)


def quantized_rows(geometry: P.AttentionKVGeometry, contexts: tuple[int, ...]) -> list[dict]:
    """Planned (incl. scales) vs measured bytes of int8 / int4 full layers at each context."""
    from gptoss_lite.kvspec import kv_format

    rows = []
    for bits in (8, 4):
        measured = measure_quantized_cache(contexts, bits)
        for t in contexts:
            planned = P.quantized_kv_bytes(geometry, t, bits)
            if measured[t][0] != planned:
                raise AssertionError(f"int{bits} payload at {t} tokens: measured {measured[t][0]} != planned {planned}")
            rows.append(
                {
                    "context_tokens": t,
                    "kv_format": kv_format(bits).name,
                    "planned_bytes": planned,
                    "measured_payload_bytes": measured[t][0],
                    "measured_allocated_bytes": measured[t][1],
                    "vs_16_bit": P.kv_payload_bytes(geometry, t) / measured[t][1],
                }
            )
    return rows


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "kv-bench",
        help="mixed vs all-full KV payload of the 502M preset; PASS at >= 1.8x at 128K",
        description="Computed KV payload (bytes of K and V, BF16) of the gptoss-lite-502m preset with "
        "ring buffers on its 6 sliding layers vs every layer full.",
    )
    p.add_argument("--json", action="store_true", help="print rows and verdict as JSON (sorted keys)")
    p.add_argument(
        "--measured",
        action="store_true",
        help="also fill real caches (BF16 MixedKVCache, ~1.2 GB at 128K, and int8/int4 QuantizedKVCache) and "
        "report their payload and allocated bytes",
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    geometry = P.get_geometry(PRESET)
    rows = bench_rows(geometry)
    check = next(r for r in rows if r.context_tokens == PASS_CONTEXT)
    passed = check.ratio >= PASS_RATIO
    columns = COLUMNS
    measured = {}
    quantized: list[dict] = []
    if args.measured:
        quantized = quantized_rows(geometry, tuple(r.context_tokens for r in rows))
        measured = measure_mixed_cache(tuple(r.context_tokens for r in rows))
        mismatched = [t for t, r in zip(measured, rows) if measured[t][0] != r.mixed_bytes]
        if mismatched:
            raise AssertionError(f"measured payload differs from the formula at {mismatched} tokens")
        columns = COLUMNS + [
            ("measured payload B", lambda r: f"{measured[r.context_tokens][0]:,}"),
            ("measured allocated GiB", lambda r: f"{measured[r.context_tokens][1] / P.GIB:.3f}"),
        ]
    if args.json:
        print(
            json.dumps(
                {
                    "preset": PRESET,
                    "quantity": "payload",
                    "rows": [
                        {
                            "context_tokens": r.context_tokens,
                            "all_full_bytes": r.all_full_bytes,
                            "mixed_bytes": r.mixed_bytes,
                            "ratio": r.ratio,
                            **(
                                {
                                    "measured_payload_bytes": measured[r.context_tokens][0],
                                    "measured_allocated_bytes": measured[r.context_tokens][1],
                                }
                                if measured
                                else {}
                            ),
                        }
                        for r in rows
                    ],
                    "pass_context_tokens": PASS_CONTEXT,
                    "pass_ratio": PASS_RATIO,
                    "passed": passed,
                    **({"quantized": quantized} if quantized else {}),
                },
                sort_keys=True,
                indent=2,
            )
        )
    else:
        print(
            f"KV payload of {PRESET} (BF16, batch 1): {geometry.sliding_layers} sliding layers "
            f"(ring, W={geometry.sliding_window}) + {geometry.full_layers} full vs all {geometry.attention_layers} "
            "full; GiB = 2^30 B, GB = 10^9 B"
        )
        print(format_table(rows, columns))
        if quantized:
            print(
                "\nQuantised full layers (KIVI-style, scales and zero points counted; sliding layers BF16), "
                "planned vs measured (a real QuantizedKVCache filled in 2,048-token pieces)"
            )
            print(
                format_table(
                    quantized,  # type: ignore[arg-type]
                    [
                        ("context", lambda r: f"{r['context_tokens']:,}"),  # type: ignore[index]
                        ("kv-format", lambda r: str(r["kv_format"])),  # type: ignore[index]
                        ("planned B", lambda r: f"{r['planned_bytes']:,}"),  # type: ignore[index]
                        ("measured payload B", lambda r: f"{r['measured_payload_bytes']:,}"),  # type: ignore[index]
                        ("measured allocated B", lambda r: f"{r['measured_allocated_bytes']:,}"),  # type: ignore[index]
                        ("vs 16-bit mixed", lambda r: f"{r['vs_16_bit']:.2f}x"),  # type: ignore[index]
                    ],
                )
            )
        verdict = "PASS" if passed else "FAIL"
        print(
            f"{verdict}: mixed cache payload is {check.ratio:.2f}x smaller than all-full at "
            f"{PASS_CONTEXT:,} tokens (target >= {PASS_RATIO}x)"
        )
    return 0 if passed else 1
