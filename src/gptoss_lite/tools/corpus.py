"""The browser's corpus: a directory of the user's documents, indexed in SQLite FTS5 and ranked by BM25.

The directory is only ever read. The index (a single SQLite file) lives at `index_path`, by default in
the user's cache directory, and is refused inside the corpus directory. It is built on first use and
then refreshed: a file whose size and modification time are unchanged is skipped, a file whose content
hash is unchanged keeps its entry, and added, changed and deleted files are indexed or dropped. What a
page shows is the text stored at indexing time, so a search result and the page it opens always agree.

Searching takes the words of the query (any of them may match: a question's words rarely all occur in
one document), stems them (FTS5's porter tokenizer), and ranks documents by BM25 over their title
(weight 4), path (2) and text (1); each hit comes with FTS5's snippet of its best passage.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from gptoss_lite.tools.documents import KINDS, Document, extract, path_of, strip_links, url_of

# The index is rebuilt when this changes: bump it with any change to the tables or to what
# documents.extract returns for a file.
SCHEMA_VERSION = "1"
BM25_WEIGHTS = (4.0, 2.0, 1.0)  # title, path, text
SNIPPET_TOKENS = 32  # the length of a hit's snippet, in FTS5 tokens (words)
# A file modified this close to a scan may change again within the file system's timestamp resolution
# without its modification time moving (git's "racily clean" entries): its content is hashed next time.
RACY_NS = 2_000_000_000


class _Stored(NamedTuple):
    """What the index remembers of a file, to tell whether it changed."""

    id: int
    mtime_ns: int  # 0: hash the file next time (it was modified close to the scan that read it)
    size: int
    sha256: str


_STORED = ", ".join(_Stored._fields)


@dataclass(frozen=True)
class SearchHit:
    """One search result: the document's URL, corpus path and title, and a snippet of its best passage."""

    url: str
    path: str
    title: str
    snippet: str


@dataclass(frozen=True)
class RefreshReport:
    """What one refresh of the index did: corpus paths added, changed and removed, how many files kept
    their entry, and the paths skipped (unreadable or larger than `max_file_bytes`) with the reason."""

    added: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    unchanged: int = 0
    skipped: tuple[tuple[str, str], ...] = ()


def default_index_path(directory: str | os.PathLike) -> Path:
    """Where a corpus keeps its index unless told: `$XDG_CACHE_HOME` (or ~/.cache)/gptoss-lite/browser/,
    one file per corpus directory."""
    root = Path(directory).expanduser().resolve()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    key = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    return cache / "gptoss-lite" / "browser" / f"{root.name or 'root'}-{key}.sqlite3"


def query_terms(query: str) -> list[str]:
    """The words of a search query, lower-cased, each once, in order."""
    return list(dict.fromkeys(re.findall(r"\w+", query.lower())))


class Corpus:
    """The documents (.txt, .md, .html, .htm) under `directory`, hidden files and folders excepted.

    `refresh_interval_s`: a search or a document lookup first refreshes the index when the last scan is
    older than this (None: only `refresh()` does). `max_file_bytes`: larger files are skipped.
    Safe to share between threads (one lock around the index).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        index_path: str | os.PathLike | None = None,
        *,
        refresh_interval_s: float | None = 5.0,
        max_file_bytes: int = 10_000_000,
    ):
        root = Path(directory).expanduser().resolve()
        if not root.is_dir():
            raise ValueError(f"directory={str(directory)!r}: not a directory; give the folder of documents to search")
        index = Path(index_path).expanduser() if index_path is not None else default_index_path(root)
        if index.resolve().is_relative_to(root):
            raise ValueError(
                f"index_path={str(index)!r} lies inside the corpus directory {str(root)!r}, which the browser "
                "never writes to; give an index_path outside it"
            )
        if refresh_interval_s is not None and refresh_interval_s < 0:
            raise ValueError(f"refresh_interval_s={refresh_interval_s}: must be >= 0 (or None: never on its own)")
        if max_file_bytes < 1:
            raise ValueError(f"max_file_bytes={max_file_bytes}: must be >= 1")
        self.root, self.index_path = root, index
        self.refresh_interval_s, self.max_file_bytes = refresh_interval_s, max_file_bytes
        index.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(index, check_same_thread=False)  # every use holds self._lock
        self._create_tables()
        self._last_scan = float("-inf")
        self.last_refresh = self.refresh()

    def _create_tables(self) -> None:
        db = self._db
        with db:
            db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            row = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
            if row is not None and row[0] == SCHEMA_VERSION:
                return
            db.execute("DROP TABLE IF EXISTS documents")
            db.execute("DROP TABLE IF EXISTS fts")
            db.execute(
                "CREATE TABLE documents (id INTEGER PRIMARY KEY, path TEXT UNIQUE NOT NULL, mtime_ns INTEGER NOT NULL,"
                " size INTEGER NOT NULL, sha256 TEXT NOT NULL, title TEXT NOT NULL, text TEXT NOT NULL,"
                " links TEXT NOT NULL)"
            )
            # fts.rowid = documents.id; the text column holds the page text with links as their text.
            db.execute("CREATE VIRTUAL TABLE fts USING fts5(title, path, text, tokenize='porter unicode61')")
            db.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))

    def _files(self, folder: str = "", prefix: str = ""):
        """(corpus path, directory entry) of every document under the root, in sorted order; hidden
        entries, and symbolic links that lead out of the root, left out."""
        with os.scandir(folder or self.root) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.is_symlink() and not Path(entry.path).resolve().is_relative_to(self.root):
                continue
            if entry.is_dir():
                yield from self._files(entry.path, f"{prefix}{entry.name}/")
            elif Path(entry.name).suffix.lower() in KINDS and entry.is_file():
                yield prefix + entry.name, entry

    def refresh(self) -> RefreshReport:
        """Bring the index up to date with the directory; returns what changed."""
        with self._lock:
            scan_ns = time.time_ns()
            known = {row[0]: _Stored(*row[1:]) for row in self._db.execute(f"SELECT path, {_STORED} FROM documents")}
            added, changed, skipped, unchanged, seen = [], [], [], 0, set()
            with self._db:
                for path, entry in self._files():
                    stored = known.get(path)
                    try:
                        st = entry.stat()
                        if st.st_size > self.max_file_bytes:
                            skipped.append((path, f"{st.st_size} bytes > max_file_bytes={self.max_file_bytes}"))
                            continue
                        if stored is not None and (stored.mtime_ns, stored.size) == (st.st_mtime_ns, st.st_size):
                            seen.add(path)
                            unchanged += 1
                            continue
                        data = Path(entry.path).read_bytes()
                    except OSError as err:
                        skipped.append((path, f"unreadable: {err.strerror or err}"))
                        continue
                    seen.add(path)
                    # NOTE: a time this close to the scan is stored as 0, so the next scan hashes the file.
                    mtime_ns = st.st_mtime_ns if st.st_mtime_ns < scan_ns - RACY_NS else 0
                    sha = hashlib.sha256(data).hexdigest()
                    if stored is not None and stored.sha256 == sha:
                        self._db.execute(
                            "UPDATE documents SET mtime_ns = ?, size = ? WHERE id = ?", (mtime_ns, len(data), stored.id)
                        )
                        unchanged += 1
                        continue
                    doc = extract(data.decode("utf-8-sig", errors="replace"), path)
                    self._store(path, stored.id if stored else None, mtime_ns, len(data), sha, doc)
                    (changed if stored else added).append(path)
                removed = sorted(set(known) - seen)  # deleted, or now skipped
                for path in removed:
                    self._db.execute("DELETE FROM documents WHERE id = ?", (known[path].id,))
                    self._db.execute("DELETE FROM fts WHERE rowid = ?", (known[path].id,))
            self._last_scan = time.monotonic()
            return RefreshReport(tuple(added), tuple(changed), tuple(removed), unchanged, tuple(skipped))

    def _store(self, path: str, doc_id: int | None, mtime_ns: int, size: int, sha: str, doc: Document) -> None:
        row = (path, mtime_ns, size, sha, doc.title, doc.text, json.dumps(doc.links))
        if doc_id is None:
            doc_id = self._db.execute(
                "INSERT INTO documents (path, mtime_ns, size, sha256, title, text, links) VALUES (?, ?, ?, ?, ?, ?, ?)",
                row,
            ).lastrowid
        else:
            self._db.execute(
                "UPDATE documents SET path = ?, mtime_ns = ?, size = ?, sha256 = ?, title = ?, text = ?, links = ?"
                " WHERE id = ?",
                (*row, doc_id),
            )
            self._db.execute("DELETE FROM fts WHERE rowid = ?", (doc_id,))
        words = path.replace("/", " ").replace(".", " ")
        self._db.execute(
            "INSERT INTO fts (rowid, title, path, text) VALUES (?, ?, ?, ?)",
            (doc_id, doc.title, words, strip_links(doc.text)),
        )

    def _refresh_if_due(self) -> None:
        if self.refresh_interval_s is not None and time.monotonic() - self._last_scan >= self.refresh_interval_s:
            self.last_refresh = self.refresh()

    def search(self, query: str, limit: int = 10) -> list[SearchHit]:
        """The best `limit` documents for `query`, best first (BM25); [] when nothing matches."""
        terms = query_terms(query)
        if not terms:
            raise ValueError(f"query={query!r}: has no words to search for")
        if limit < 1:
            raise ValueError(f"limit={limit}: must be >= 1")
        match = " OR ".join(f'"{t}"' for t in terms)
        weights = ", ".join(map(str, BM25_WEIGHTS))
        with self._lock:
            self._refresh_if_due()
            # ORDER BY rank LIMIT n lets FTS5 rank first, so only the n hits pay for a snippet.
            rows = self._db.execute(
                f"SELECT rowid, snippet(fts, 2, '', '', '...', {SNIPPET_TOKENS}) FROM fts"
                f" WHERE fts MATCH ? AND rank MATCH 'bm25({weights})' ORDER BY rank LIMIT ?",
                (match, limit),
            ).fetchall()
            docs = {
                row[0]: row[1:]
                for row in self._db.execute(
                    f"SELECT id, path, title FROM documents WHERE id IN ({', '.join('?' * len(rows))})",
                    [r[0] for r in rows],
                )
            }
        return [SearchHit(url_of(docs[i][0]), docs[i][0], docs[i][1], " ".join(snippet.split())) for i, snippet in rows]

    def document(self, url: str) -> Document | None:
        """The page of the corpus document at `url` (`file:///path`, or the bare corpus path), or None."""
        path = path_of(url) if url.startswith("file:") else url
        with self._lock:
            self._refresh_if_due()
            row = self._db.execute("SELECT title, text, links FROM documents WHERE path = ?", (path,)).fetchone()
        return None if row is None else Document(row[0], row[1], tuple(json.loads(row[2])))

    def source(self, url: str) -> str | None:
        """The raw text of the corpus document at `url`, read from the file now, or None where the index
        has no such document (or the file is gone)."""
        path = path_of(url) if url.startswith("file:") else url
        with self._lock:
            known = self._db.execute("SELECT 1 FROM documents WHERE path = ?", (path,)).fetchone()
        if known is None:
            return None
        try:
            return (self.root / path).read_bytes()[: self.max_file_bytes].decode("utf-8-sig", errors="replace")
        except OSError:
            return None

    def paths(self) -> list[str]:
        """The corpus paths of every indexed document, sorted."""
        with self._lock:
            return [row[0] for row in self._db.execute("SELECT path FROM documents ORDER BY path")]

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT count(*) FROM documents").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Corpus:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
