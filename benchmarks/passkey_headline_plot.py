"""One heatmap (and one table) from several `gptoss-lite passkey --json` results of one model.

The headline protocol runs in two parts (4,096 to 65,536 tokens with 20 keys a cell, then 131,072 with
10: benchmarks/passkey_lite4k_headline.sh); this draws them as one length x depth grid and prints the
markdown table of accuracy, wall time and peak RSS per length that docs/passkey.md shows.

    python benchmarks/passkey_headline_plot.py OUT.png A.json B.json [...] [--title TEXT]
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

from gptoss_lite.commands.passkey import plot_heatmap


def merged(paths: list[str]) -> SimpleNamespace:
    """The results' lengths in order, with each length's cells, trial count, time and peak RSS."""
    parts = [json.load(open(path, encoding="utf-8")) for path in paths]
    depths = parts[0]["depths"]
    if any(part["depths"] != depths for part in parts) or len({part["model"] for part in parts}) != 1:
        raise SystemExit("passkey_headline_plot: the results differ in depths or model")
    out = SimpleNamespace(lengths=[], depths=depths, accuracy_by_depth={}, extrapolation={}, rows=[])
    for part in parts:
        for key in part["lengths"] if isinstance(part["lengths"][0], str) else map(str, part["lengths"]):
            n = int(key)
            out.lengths.append(n)
            out.accuracy_by_depth[n] = {float(d): v for d, v in part["accuracy_by_depth"][key].items()}
            out.extrapolation[n] = part["extrapolation"][key]
            cells = [round(v * part["n_trials"]) for v in part["accuracy_by_depth"][key].values()]
            out.rows.append(
                (
                    n,
                    part["extrapolation"][key],
                    part["accuracy"][key],
                    part["n_trials"],
                    cells,
                    part["seconds"][key],
                    part["peak_rss_bytes"][key] / 2**30,
                )
            )
    out.model = parts[0]["model"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("png")
    ap.add_argument("results", nargs="+")
    ap.add_argument("--title", default=None, help="the heatmap's title (default: the trials per cell)")
    args = ap.parse_args()
    result = merged(args.results)
    trials = sorted({row[3] for row in result.rows}, reverse=True)
    cells = " / ".join(f"{t}" for t in trials) + " trials per cell"
    title = f"{args.title}, {cells}" if args.title else f"passkey retrieval, {cells}"
    plot_heatmap(result, args.png, title=title)
    print(
        "| length | × training | passkey | hits by depth ("
        + " / ".join(f"{d:g}" for d in result.depths)
        + ") | wall time | peak RSS |"
    )
    print("|---:|---:|---:|---|---:|---:|")
    for n, x, acc, t, cells, seconds, rss in result.rows:
        hits = " / ".join(f"{c}/{t}" for c in cells)
        print(f"| {n:,} | {x:g}× | {100 * acc:.1f}% | {hits} | {seconds:,.0f} s | {rss:.2f} GiB |")


if __name__ == "__main__":
    main()
