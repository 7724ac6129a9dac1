"""Search latency of the browser tool on a generated corpus (docs/tools.md#the-browser-tool).

    PYTHONPATH=src python benchmarks/browser_search.py [--docs 1000] [--queries 100] [--json]

Writes `--docs` documents (Markdown, text and HTML, in 20 folders; made from a fixed seed, so every run
and every machine indexes the same corpus) to a temporary folder, indexes them (timed), then times
`BrowserSession.search` — the FTS5 query, its snippets and the rendered results page, what the model
waits for — over `--queries` queries of 1 to 4 words, and prints the median and the 90th percentile.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gptoss_lite.tools.browser import BrowserSession, Corpus

FIXED_MTIME_NS = 1_700_000_000 * 10**9  # November 2023: old enough that no scan hashes a file twice
SYLLABLES = "ka lo mi ne ru sa ti vo ze po la ri mu de fa go hi ju ke ny".split()


def vocabulary(n_words: int = 5000, seed: int = 0) -> list[str]:
    """`n_words` distinct made-up words, most frequent first (texts draw them Zipf-distributed)."""
    rng = random.Random(seed)
    words: dict[str, None] = {}
    while len(words) < n_words:
        words["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))] = None
    return list(words)


def write_corpus(directory: Path, n_docs: int = 1000, seed: int = 0) -> list[str]:
    """Write `n_docs` documents of about 300 words under `directory`; returns their corpus paths."""
    words = vocabulary(seed=seed)
    weights = [1 / (rank + 1) for rank in range(len(words))]  # Zipf: the k-th word is k times rarer
    cum = list(itertools.accumulate(weights))
    rng = random.Random(seed + 1)

    def sentence(n: int) -> str:
        return " ".join(rng.choices(words, cum_weights=cum, k=n)).capitalize() + "."

    paths = []
    for i in range(n_docs):
        title = " ".join(rng.choices(words[200:], k=4)).title()
        paragraphs = [" ".join(sentence(rng.randint(6, 18)) for _ in range(rng.randint(2, 5))) for _ in range(5)]
        kind = ("md", "txt", "html")[i % 3]
        path = f"folder{i % 20:02d}/doc{i:05d}.{kind}"
        if kind == "md":
            text = f"# {title}\n\n" + "\n\n".join(paragraphs) + "\n"
        elif kind == "txt":
            text = "\n\n".join(paragraphs) + "\n"
        else:
            body = "".join(f"<p>{p}</p>" for p in paragraphs)
            text = f"<html><head><title>{title}</title></head><body><h1>{title}</h1>{body}</body></html>\n"
        (directory / path).parent.mkdir(parents=True, exist_ok=True)
        (directory / path).write_text(text)
        os.utime(directory / path, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))  # the same corpus on every run
        paths.append(path)
    return paths


def make_queries(n_queries: int = 100, seed: int = 0) -> list[str]:
    """`n_queries` queries of 1 to 4 words, from common to rare, some with words no document has."""
    words = vocabulary(seed=seed)
    rng = random.Random(seed + 2)
    queries = []
    for _ in range(n_queries):
        picked = [words[int(rng.random() ** 2 * len(words))] for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.2:
            picked.append("what")  # in no document: costs a lookup, finds nothing
        queries.append(" ".join(picked))
    return queries


def measure(corpus: Corpus, queries: list[str], topn: int = 10) -> list[float]:
    """Milliseconds each `BrowserSession.search` took, one fresh session per query."""
    times = []
    for query in queries:
        session = BrowserSession(corpus)
        start = time.perf_counter()
        session.search(query, topn=topn)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=1000, help="documents in the generated corpus (default 1000)")
    parser.add_argument("--queries", type=int, default=100, help="queries timed (default 100)")
    parser.add_argument("--topn", type=int, default=10, help="results a search shows (default 10)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        docs, index = Path(tmp, "docs"), Path(tmp, "index.sqlite3")
        docs.mkdir()
        write_corpus(docs, args.docs)
        size = sum(p.stat().st_size for p in docs.rglob("*") if p.is_file())
        start = time.perf_counter()
        corpus = Corpus(docs, index, refresh_interval_s=None)
        build_s = time.perf_counter() - start
        queries = make_queries(args.queries)
        measure(corpus, queries[:5], args.topn)  # warm the page cache and SQLite's
        times = sorted(measure(corpus, queries, args.topn))
        start = time.perf_counter()
        corpus.refresh()
        rescan_ms = (time.perf_counter() - start) * 1e3
        corpus.close()
    result = {
        "docs": args.docs,
        "corpus_bytes": size,
        "index_build_s": round(build_s, 2),
        "unchanged_rescan_ms": round(rescan_ms, 1),
        "queries": len(times),
        "search_median_ms": round(statistics.median(times), 2),
        "search_p90_ms": round(times[int(0.9 * (len(times) - 1))], 2),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.docs} documents, {size / 1e6:.1f} MB: indexed in {build_s:.2f} s, rescanned in {rescan_ms:.1f} ms"
        )
        median, p90 = result["search_median_ms"], result["search_p90_ms"]
        print(f"search over {len(times)} queries: median {median} ms, p90 {p90} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
