"""`gptoss-lite plan`: KV bytes, decode ceilings, capacity and prefill floors for a model on a chip.

Pure Python (no torch): the handler builds a report dict from `gptoss_lite.plan`, then prints it as
tables or as JSON (schema in docs/plan.md). matplotlib is imported only for `--plot`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from fractions import Fraction
from typing import Any

from gptoss_lite import plan as P

SCHEMA_VERSION = 2  # 2: layer kinds named sliding/full (was sliding_window_layers/window/all_global)
DEFAULT_CONTEXTS = (4096, 8192, 32768, 65536, 131072)
DEFAULT_BATCHES = (1, 8, 32)
DEFAULT_KV_BITS = (16, 8, 4)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="KV payload, decode ceilings, capacity and prefill floors (pure arithmetic)",
        description="Serving arithmetic for one model on one chip. Payloads are exact; ceilings and "
        "capacities are upper bounds from spec sheets; only --hardware this-machine is measured.",
    )
    p.add_argument(
        "--model",
        default="gptoss-lite-502m",
        help=f"model preset ({', '.join(P.GEOMETRY_PRESETS)}; default: gptoss-lite-502m)",
    )
    p.add_argument(
        "--hardware",
        default="a100-80gb",
        help=f"{', '.join(P.HARDWARE_PRESETS)} or {P.THIS_MACHINE} (measured now); default a100-80gb",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=1,
        help="devices serving one model replica, ideal tensor parallelism (default: 1)",
    )
    p.add_argument(
        "--weight-bits",
        type=float,
        default=16.0,
        help="bits per stored dense weight (default: 16 = BF16)",
    )
    p.add_argument(
        "--expert-bits",
        type=float,
        default=None,
        help="bits per routed-expert weight (default: as the model is stored: 4.25 = MXFP4 for gpt-oss-20b "
        "and -120b, else --weight-bits)",
    )
    p.add_argument(
        "--context",
        type=int,
        nargs="+",
        default=list(DEFAULT_CONTEXTS),
        help="context lengths in tokens (default: 4096 8192 32768 65536 131072)",
    )
    p.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=list(DEFAULT_BATCHES),
        help="decode batch sizes in requests (default: 1 8 32)",
    )
    p.add_argument(
        "--kv-bits",
        type=int,
        nargs="+",
        default=list(DEFAULT_KV_BITS),
        help="KV storage bits per element for the compression scenarios (default: 16 8 4)",
    )
    p.add_argument("--chunk", type=int, default=2048, help="chunked-prefill chunk size in tokens (default: 2048)")
    p.add_argument(
        "--measured",
        action="store_true",
        help="fill a real cache (16-bit, int8, int4 full layers; needs torch and one of our model presets) for "
        "each compression scenario and print its allocated bytes beside the computed ones",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON (sorted keys)")
    p.add_argument(
        "--plot",
        metavar="OUT.png",
        default=None,
        help="write a PNG with KV-vs-context and roofline panels (needs matplotlib)",
    )
    p.set_defaults(handler=run)


# ---- model resolution ---------------------------------------------------------------------------------


def _weight_format(m: dict[str, Any]) -> str:
    dense = f"{m['bytes_per_parameter'] * 8:g}-bit"
    if not m["expert_parameters"] or m["expert_bytes_per_parameter"] == m["bytes_per_parameter"]:
        return dense
    bits = m["expert_bytes_per_parameter"] * 8
    return f"{dense}, routed experts {'MXFP4 ' if bits == 4.25 else ''}{bits:g}-bit"


def resolve_model(name: str) -> tuple[P.KVGeometry, P.ModelWeights]:
    """A geometry preset (our model presets included) or a test fixture config, by exact name."""
    if name in P.GEOMETRY_PRESETS:
        return P.GEOMETRY_PRESETS[name], P.MODEL_WEIGHTS[name]
    from gptoss_lite.fixtures import FIXTURES  # pure Python

    if name in FIXTURES:
        cfg = FIXTURES[name]
        return P.geometry_from_model_config(cfg, name=name), P.weights_from_model_config(cfg, name=name)
    raise ValueError(f"unknown model {name!r}; valid: {', '.join(sorted(P.GEOMETRY_PRESETS))}")


def _measure(
    model: str, geometry: P.KVGeometry, kv_bits: list[int], contexts: list[int], native_bits: int
) -> dict[tuple[int, int], int]:
    """{(kv_bits, context): allocated bytes} of real caches of `model` (one of our presets or fixtures)
    filled to each context, for the bits a cache can store (16, 8, 4); torch is imported only here."""
    from gptoss_lite.commands.kv_bench import measure_cache_bytes
    from gptoss_lite.config import PRESETS
    from gptoss_lite.fixtures import FIXTURES
    from gptoss_lite.kv.settings import KVSettings
    from gptoss_lite.kvspec import kv_format

    config = PRESETS.get(model) or FIXTURES.get(model)
    if config is None or native_bits != 16:
        raise ValueError(
            f"--measured: {model!r} is not one of our model presets with a 16-bit cache "
            f"({', '.join(sorted(PRESETS))}); drop --measured"
        )
    out = {}
    for bits in kv_bits:
        if bits in (16, 8, 4):
            for n, (_, allocated) in measure_cache_bytes(
                config, KVSettings(format=kv_format(bits)), tuple(contexts)
            ).items():
                out[(bits, n)] = allocated
    return out


def _attention_split(geometry: P.KVGeometry) -> tuple[int, int, int | None]:
    """(full layers, sliding layers, sliding window) for FLOP counting."""
    if isinstance(geometry, P.AttentionKVGeometry):
        return geometry.full_layers, geometry.sliding_layers, geometry.sliding_window
    return geometry.attention_layers, 0, None


def _prefill_chunk_flops(geometry: P.KVGeometry, w: P.ModelWeights, queries: int, prefix: int) -> int:
    """Window-aware FLOPs of prefilling `queries` tokens after `prefix`: projections + attention."""
    full, sliding, sliding_window = _attention_split(geometry)
    flops = 2 * w.active_parameters * queries
    if full:
        flops += P.attention_flops(full, w.query_heads, w.attention_head_dim, queries, prefix)
    if sliding:
        flops += P.attention_flops(
            sliding, w.query_heads, w.attention_head_dim, queries, prefix, sliding_window=sliding_window
        )
    return flops


def _worst_chunk_flops(geometry: P.KVGeometry, w: P.ModelWeights, context: int, chunk: int) -> int:
    """FLOPs of the costliest chunk when `context` tokens are prefilled `chunk` at a time.

    A chunk's work never falls as its prefix grows (projections are fixed, attention pairs only
    rise), so the costliest chunk is the last full one or the final partial one: two evaluations,
    not one per chunk (a loop over chunks never ended at --context 10**30).
    """
    full, rest = divmod(context, chunk)
    candidates = []
    if full:
        candidates.append(_prefill_chunk_flops(geometry, w, chunk, (full - 1) * chunk))
    if rest:
        candidates.append(_prefill_chunk_flops(geometry, w, rest, full * chunk))
    return max(candidates, default=0)


def _geometry_dict(g: P.KVGeometry) -> dict[str, Any]:
    if isinstance(g, P.MLAKVGeometry):
        return {
            "kind": "mla",
            "attention_layers": g.attention_layers,
            "latent_dim": g.latent_dim,
            "rope_dim": g.rope_dim,
            "bytes_per_element": g.bytes_per_element,
            "bytes_per_token": g.bytes_per_token,
        }
    return {
        "kind": "attention",
        "attention_layers": g.attention_layers,
        "kv_heads": g.kv_heads,
        "head_dim": g.head_dim,
        "bytes_per_element": g.bytes_per_element,
        "sliding_layers": g.sliding_layers,
        "sliding_window": g.sliding_window,
        "bytes_per_token": g.bytes_per_token,
    }


# ---- the report -------------------------------------------------------------------------------------


def build_report(
    model: str,
    hardware: str,
    contexts: list[int],
    batches: list[int],
    kv_bits: list[int],
    chunk: int,
    devices: int = 1,
    weight_bits: float = 16.0,
    measure: bool = False,
    expert_bits: float | None = None,
) -> dict[str, Any]:
    """Every figure `plan` prints, as a JSON-ready dict (schema: docs/plan.md). `measure` fills real
    caches for the compression scenarios (`measured_bytes`)."""
    for name, values in (("--context", contexts), ("--batch", batches), ("--kv-bits", kv_bits)):
        if not values:
            raise ValueError(f"{name}: give at least one value")
    for bits in kv_bits:
        if bits < 1:
            raise ValueError(f"--kv-bits {bits}: must be >= 1")
    if chunk < 1:
        raise ValueError(f"--chunk {chunk}: must be >= 1 token")
    if not (isinstance(weight_bits, (int, float)) and 0 < weight_bits <= 64):
        raise ValueError(f"--weight-bits {weight_bits}: must be in (0, 64]")
    if expert_bits is not None and not (isinstance(expert_bits, (int, float)) and 0 < expert_bits <= 64):
        raise ValueError(f"--expert-bits {expert_bits}: must be in (0, 64]")
    geometry, weights = resolve_model(model)
    experts = weights.expert_bytes_per_parameter if expert_bits is None else expert_bits / 8
    weights = dataclasses.replace(weights, bytes_per_parameter=weight_bits / 8, expert_bytes_per_parameter=experts)
    spec = P.get_hardware(hardware)
    hw = P.serving_hardware(spec, weights, devices)
    native_bits = 8 * geometry.bytes_per_element
    all_full = (
        P.AttentionKVGeometry(
            geometry.name, geometry.attention_layers, geometry.kv_heads, geometry.head_dim, geometry.bytes_per_element
        )
        if isinstance(geometry, P.AttentionKVGeometry)
        else geometry
    )

    ladder = []
    for n in contexts:
        mixed, full = P.kv_payload_bytes(geometry, n), P.kv_payload_bytes(all_full, n)
        ladder.append(
            {
                "context_tokens": n,
                "payload_bytes": mixed,
                "all_full_payload_bytes": full,
                "mixed_reduction": full / mixed if mixed else None,
            }
        )

    ceilings = []
    for n in contexts:
        for b in batches:
            c = P.decode_ceiling(hw, geometry, n, b)
            intensity = P.arithmetic_intensity(hw, geometry, n, b)
            ceilings.append(
                {
                    "context_tokens": n,
                    "batch_size": b,
                    "kv_bytes": c.kv_bytes,
                    "total_bytes_per_step": c.total_bytes_per_step,
                    "aggregate_tokens_per_second": c.aggregate_tokens_per_second,
                    "per_request_tokens_per_second": c.per_request_tokens_per_second,
                    "arithmetic_intensity_flops_per_byte": intensity,
                    "memory_bound": intensity < hw.ridge_flops_per_byte,
                }
            )

    capacity = []
    measured = _measure(model, geometry, kv_bits, contexts, native_bits) if measure else {}
    for bits in kv_bits:
        scale = Fraction(bits, native_bits)
        for n in contexts:
            payload = P.kv_payload_bytes(geometry, n, 1, scale)
            with_scales = payload if bits == native_bits else None
            if bits in (8, 4) and isinstance(geometry, P.AttentionKVGeometry) and native_bits == 16:
                with_scales = P.quantized_kv_bytes(geometry, n, bits)
            resident = P.max_resident_requests(hw, geometry, n, scale) if payload else None
            at_capacity = (
                P.decode_ceiling(hw, geometry, n, resident, scale).aggregate_tokens_per_second if resident else None
            )
            capacity.append(
                {
                    "context_tokens": n,
                    "kv_bits": bits,
                    "kv_scale": float(scale),
                    "payload_bytes": payload,
                    "batch_knee": P.batch_knee(hw, geometry, n, scale) if payload else None,
                    "max_resident_requests": resident,
                    "aggregate_tokens_per_second_at_capacity": at_capacity,
                    "with_scales_bytes": with_scales,
                    **({"measured_bytes": measured.get((bits, n))} if measure else {}),
                }
            )

    prefill = []
    for n in contexts:
        floor = P.prefill_floor_seconds(weights.active_parameters, n, hw.peak_flops_per_second)
        compute = _prefill_chunk_flops(geometry, weights, n, 0) / hw.peak_flops_per_second
        worst_chunk = _worst_chunk_flops(geometry, weights, n, chunk) / hw.peak_flops_per_second
        step = P.decode_ceiling(hw, geometry, n, 1).total_bytes_per_step / hw.bandwidth_bytes_per_second
        prefill.append(
            {
                "context_tokens": n,
                "floor_seconds": floor,
                "compute_floor_seconds": compute,
                "monolithic_stall_seconds": compute,
                "chunk_tokens": chunk,
                "chunked_stall_seconds": worst_chunk + step,
            }
        )

    return {
        "schema_version": SCHEMA_VERSION,
        "model": {
            "name": model,
            "geometry": _geometry_dict(geometry),
            "total_parameters": weights.total_parameters,
            "active_parameters": weights.active_parameters,
            "bytes_per_parameter": weights.bytes_per_parameter,
            "expert_parameters": weights.expert_parameters,
            "active_expert_parameters": weights.active_expert_parameters,
            "expert_bytes_per_parameter": weights.expert_bytes,
            "streamed_weight_bytes": hw.weight_bytes,
            "resident_weight_bytes": hw.resident_bytes,
            "query_heads": weights.query_heads,
            "attention_head_dim": weights.attention_head_dim,
        },
        "hardware": {
            "name": spec.name,
            "source": spec.source,
            "devices": devices,
            "bandwidth_bytes_per_second": hw.bandwidth_bytes_per_second,
            "peak_flops_per_second": hw.peak_flops_per_second,
            "device_capacity_bytes": hw.device_capacity_bytes,
            "runtime_reserve_bytes": hw.runtime_reserve_bytes,
            "ridge_flops_per_byte": hw.ridge_flops_per_byte,
        },
        "native_kv_bits": native_bits,
        "kv_ladder": ladder,
        "decode_ceilings": ceilings,
        "capacity": capacity,
        "prefill": prefill,
    }


# ---- text output --------------------------------------------------------------------------------------


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    lines = ["  " + "  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _opt(value: Any, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def format_text(r: dict[str, Any]) -> str:
    m, h, g = r["model"], r["hardware"], r["model"]["geometry"]
    measured_col = any("measured_bytes" in x for x in r["capacity"])
    label = "measured" if h["source"].startswith("measured") else "spec sheet"
    if g["kind"] == "mla":
        shape = f"MLA, {g['attention_layers']} layers, latent {g['latent_dim']} + rope {g['rope_dim']}"
    else:
        sliding = f" ({g['sliding_layers']} sliding, W={g['sliding_window']})" if g["sliding_layers"] else ""
        shape = f"{g['attention_layers']} attention layers{sliding}, {g['kv_heads']} KV heads, D={g['head_dim']}"
    out = [
        f"gptoss-lite plan: {m['name']} on {h['name']}"
        + (f" x{h['devices']}" if h["devices"] > 1 else "")
        + f" ({h['source']})",
        f"  model: {shape}, {r['native_kv_bits']}-bit KV; {m['total_parameters']:,} parameters total, "
        f"{m['active_parameters']:,} active per token",
        f"  weights ({_weight_format(m)}): {m['streamed_weight_bytes'] / P.GB:.3f} GB read per "
        "decode step (active parameters), "
        f"{m['resident_weight_bytes'] / P.GB:.3f} GB resident",
        f"  hardware ({label}): {h['bandwidth_bytes_per_second'] / P.GB:,.0f} GB/s, "
        f"{h['peak_flops_per_second'] / 1e12:,.4g} TFLOP/s, {h['device_capacity_bytes'] / P.GB:,.2f} GB memory; "
        f"ridge {h['ridge_flops_per_byte']:.1f} FLOP/B",
        "",
        f"KV ladder (payload, {r['native_kv_bits']}-bit): {g['bytes_per_token'] / P.KIB:.2f} KiB/token "
        f"({g['bytes_per_token']:,} B) if every layer kept every token",
        _table(
            ["context", "payload B", "GB", "GiB", "all-full GiB", "reduction"],
            [
                [
                    f"{x['context_tokens']:,}",
                    f"{x['payload_bytes']:,}",
                    f"{x['payload_bytes'] / P.GB:.2f}",
                    f"{x['payload_bytes'] / P.GIB:.2f}",
                    f"{x['all_full_payload_bytes'] / P.GIB:.2f}",
                    _opt(x["mixed_reduction"], ".2f") + ("x" if x["mixed_reduction"] else ""),
                ]
                for x in r["kv_ladder"]
            ],
        ),
        "",
        f"Decode ceilings (upper bound: weights once + every request's KV per step, "
        f"{r['native_kv_bits']}-bit KV); intensity is projection-only, ridge {h['ridge_flops_per_byte']:.1f} FLOP/B",
        _table(
            ["context", "batch", "KV GB", "step GB", "agg tok/s", "per-req tok/s", "FLOP/B", "bound"],
            [
                [
                    f"{x['context_tokens']:,}",
                    str(x["batch_size"]),
                    f"{x['kv_bytes'] / P.GB:.2f}",
                    f"{x['total_bytes_per_step'] / P.GB:.2f}",
                    f"{x['aggregate_tokens_per_second']:,.0f}",
                    f"{x['per_request_tokens_per_second']:,.1f}",
                    f"{x['arithmetic_intensity_flops_per_byte']:.1f}",
                    "memory" if x["memory_bound"] else "compute",
                ]
                for x in r["decode_ceilings"]
            ],
        ),
        "",
        f"Batch knee (KV traffic = weight traffic) and capacity (upper bound: "
        f"(memory - resident weights - reserve) // KV per request), {r['native_kv_bits']}-bit KV",
        _table(
            ["context", "KV/request GiB", "knee B*", "max resident requests"],
            [
                [
                    f"{x['context_tokens']:,}",
                    f"{x['payload_bytes'] / P.GIB:.3f}",
                    _opt(x["batch_knee"], ".2f"),
                    _opt(x["max_resident_requests"], ","),
                ]
                for x in r["capacity"]
                if x["kv_bits"] == r["native_kv_bits"]
            ],
        ),
        "",
        f"Prefill (compute floors = FLOPs / peak, lower bounds); chunked stall = costliest "
        f"{r['prefill'][0]['chunk_tokens']:,}-token chunk + one batch-1 decode step",
        _table(
            ["context", "2PN/peak s", "with attention s", "monolithic stall s", "chunked stall s"],
            [
                [
                    f"{x['context_tokens']:,}",
                    f"{x['floor_seconds']:.4f}",
                    f"{x['compute_floor_seconds']:.4f}",
                    f"{x['monolithic_stall_seconds']:.4f}",
                    f"{x['chunked_stall_seconds']:.4f}",
                ]
                for x in r["prefill"]
            ],
        ),
        "",
        "Compression scenarios (KV/request: payload only, scales/zero points not counted; with scales: "
        "KIVI-style int8/int4 full layers incl. scales, zero points and the 64-token residual window"
        + ("; measured: allocated bytes of a real filled cache" if measured_col else "")
        + "; capacity and ceilings are upper bounds)",
        _table(
            ["context", "kv-bits", "KV/request GiB", "with scales GiB"]
            + (["measured GiB"] if measured_col else [])
            + ["knee B*", "max resident", "agg tok/s at capacity"],
            [
                [
                    f"{x['context_tokens']:,}",
                    str(x["kv_bits"]),
                    f"{x['payload_bytes'] / P.GIB:.3f}",
                    "-" if x["with_scales_bytes"] is None else f"{x['with_scales_bytes'] / P.GIB:.3f}",
                ]
                + (
                    ["-" if x["measured_bytes"] is None else f"{x['measured_bytes'] / P.GIB:.3f}"]
                    if measured_col
                    else []
                )
                + [
                    _opt(x["batch_knee"], ".2f"),
                    _opt(x["max_resident_requests"], ","),
                    _opt(x["aggregate_tokens_per_second_at_capacity"], ",.0f"),
                ]
                for x in r["capacity"]
            ],
        ),
    ]
    longest = max(r["decode_ceilings"], key=lambda x: (x["context_tokens"], -x["batch_size"]))
    out += [
        "",
        f"Upper bound at {longest['context_tokens']:,} tokens, batch {longest['batch_size']}: "
        f"{longest['per_request_tokens_per_second']:,.1f} tokens/s per request ({label} hardware figures)",
    ]
    return "\n".join(out)


# ---- plot ---------------------------------------------------------------------------------------------


def write_plot(r: dict[str, Any], path: str) -> None:
    """PNG with two panels: KV payload vs context, and the decode roofline with this plan's points."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazily: plotting is optional
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(fig)
    kv, roof = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    contexts = [x["context_tokens"] for x in r["kv_ladder"]]
    for bits in sorted({x["kv_bits"] for x in r["capacity"]}, reverse=True):
        rows = [x for x in r["capacity"] if x["kv_bits"] == bits]
        kv.plot(contexts, [x["payload_bytes"] / P.GIB for x in rows], marker="o", label=f"{bits}-bit KV")
    kv.plot(
        contexts,
        [x["all_full_payload_bytes"] / P.GIB for x in r["kv_ladder"]],
        "k--",
        label=f"all-full, {r['native_kv_bits']}-bit",
    )
    kv.set(
        xscale="log",
        xlabel="context (tokens)",
        ylabel="KV payload per request (GiB)",
        title=f"{r['model']['name']}: KV payload",
    )
    kv.legend()
    h = r["hardware"]
    ridge, peak, bw = h["ridge_flops_per_byte"], h["peak_flops_per_second"], h["bandwidth_bytes_per_second"]
    points = r["decode_ceilings"]
    xs = [p["arithmetic_intensity_flops_per_byte"] for p in points]
    lo, hi = min(min(xs), ridge) / 4, max(max(xs), ridge) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    roof.plot(grid, [min(peak, i * bw) / 1e12 for i in grid], "k-", label="roofline (upper bound)")
    roof.axvline(ridge, color="grey", linestyle=":", label=f"ridge {ridge:.0f} FLOP/B")
    for b in sorted({p["batch_size"] for p in points}):
        sel = [p for p in points if p["batch_size"] == b]
        roof.scatter(
            [p["arithmetic_intensity_flops_per_byte"] for p in sel],
            [min(peak, p["arithmetic_intensity_flops_per_byte"] * bw) / 1e12 for p in sel],
            label=f"decode, batch {b}",
        )
    roof.set(
        xscale="log",
        yscale="log",
        xlabel="arithmetic intensity (FLOP/byte, projection-only)",
        ylabel="attainable TFLOP/s",
        title=f"decode roofline: {h['name']}",
    )
    roof.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)


def run(args: argparse.Namespace) -> int:
    report = build_report(
        args.model,
        args.hardware,
        args.context,
        args.batch,
        args.kv_bits,
        args.chunk,
        args.devices,
        args.weight_bits,
        measure=args.measured,
        expert_bits=args.expert_bits,
    )
    if args.json:
        print(json.dumps(report, sort_keys=True, indent=2))
    else:
        print(format_text(report))
    if args.plot:
        write_plot(report, args.plot)
        # Keep stdout pure JSON under --json.
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0
