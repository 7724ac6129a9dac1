"""The `browser` tool gpt-oss was trained with (`search`, `open`, `find`), over the user's own documents.

openai-harmony declares the tool (`SystemContent.with_browser_tool()`); `tool_config()` is that
declaration with its `sources=` line naming the local collection. A `BrowserSession` holds one
conversation's pages and answers each call with the text the model reads, in the display of OpenAI's
reference browser (docs/tools.md#the-browser-tool shows real output):

    [{cursor}] {title} ({url})
    **viewing lines [{first} - {last}] of {last line of the page}**

    L{n}: {line}

- every page shown gets the next cursor (the page stack only grows; scrolling shows a page again under a
  new cursor), and the model cites `【{cursor}†L{a}-L{b}】` (`resolve_citation` maps that back);
- a page's text is wrapped at 80 characters (`textwrap`, whitespace kept) before it is numbered, and
  a document page starts with an empty line and `URL: {url}`;
- without `num_lines`, a view ends with the line that holds its 1,024th token (`count_tokens`);
- a search results page is titled by the query, has no URL, and lists `  * 【{i}†{title}†{path}】 {snippet}`
  under `# Search Results`; the corpus path stands where the web's results show a domain;
- `find` lists `# 【{i}†match at L{n}】` and the four lines from each match (case-insensitive, at most
  50); opening one starts the view four lines above the match; opening a search result starts it four
  lines above the passage richest in the query's words, when the page does not fit in one view;
- a mistake (an unknown cursor, a bad link id, a line past the end, a URL outside the corpus) is answered
  with an error text the model reads, worded as the reference browser words it; no call raises.
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from urllib.parse import quote, unquote, urlsplit

from gptoss_lite.tools.corpus import Corpus, query_terms
from gptoss_lite.tools.documents import link_markup, path_of, strip_links, url_of

__all__ = ["BrowserSession", "Citation", "Corpus", "CITATION", "resolve_citation", "tool_config"]

# The reference browser's display constants (gpt-oss's simple_browser tool).
VIEW_TOKENS = 1024  # tokens in one view when `num_lines` is not given
WRAP_WIDTH = 80  # characters a page line is wrapped at
MAX_SEARCH_RESULTS = 20  # the most results one search shows, whatever `topn` asks
FIND_MAX_RESULTS = 50
FIND_SHOW_LINES = 4  # lines shown from each `find` match
PASSAGE_LEAD_LINES = 4  # a page opened at a passage starts this many lines above it
MAX_URL_CHARS = 1024  # a header's URL is cut to this, ending "..."
CHARS_PER_TOKEN = 3  # the default token estimate; measured 0.96-1.23x o200k's count on this repo's docs

# A citation the model writes: 【cursor†L10】 or 【cursor†L10-L15】.
CITATION = re.compile(r"【(?P<cursor>\d+)†L(?P<first>\d+)(?:-L(?P<last>\d+))?】")

# What each function accepts from the model (`source` and `top_n` are in the declaration or the
# reference and are accepted; `source` names the only collection there is and is not used).
ARGUMENTS = {
    "search": ("query", "topn", "top_n", "source"),
    "open": ("id", "cursor", "loc", "num_lines", "view_source", "source"),
    "find": ("pattern", "cursor"),
}
REQUIRED = {"search": ("query",), "open": (), "find": ("pattern",)}


class ToolError(Exception):
    """A mistake in a tool call: its message is the text the model reads."""


@dataclass
class Page:
    """One page on the stack. `links[i]` is the target of link `i`; `passages[i]`, where known, is the line
    that link's target should open at; `document_url` is the corpus document the page shows ("" for a
    search results page)."""

    url: str
    title: str
    text: str
    links: tuple[str, ...] = ()
    kind: str = "document"  # "document", "source" (view_source), "search" or "find"
    document_url: str = ""
    passages: dict[int, int] = field(default_factory=dict)
    query: tuple[str, ...] = ()  # a search page's words: they pick the passage a result opens at
    _lines: list[str] | None = None

    def lines(self) -> list[str]:
        """The page's text wrapped at WRAP_WIDTH: line n is what the display numbers L{n}."""
        if self._lines is None:
            self._lines = wrap_lines(self.text)
        return self._lines


def wrap_lines(text: str, width: int = WRAP_WIDTH) -> list[str]:
    """`text` split into lines, each wrapped at `width` characters with its whitespace kept."""
    return [
        piece
        for line in text.split("\n")
        for piece in (
            textwrap.wrap(line, width=width, replace_whitespace=False, drop_whitespace=False) if line else [""]
        )
    ]


def estimate_tokens(text: str) -> int:
    """A token count for `text` without a tokenizer: one token per CHARS_PER_TOKEN characters."""
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ToolError(f"`{name}` should be an integer, not `{type(value).__name__}`")
    return value


def _view_start(passage: int) -> int:
    """Where a view of a passage at line `passage` starts: PASSAGE_LEAD_LINES above it. NOTE: as in the
    reference, a passage within the first PASSAGE_LEAD_LINES + 1 lines starts its own view (not line 0)."""
    return passage - PASSAGE_LEAD_LINES if passage > PASSAGE_LEAD_LINES else passage


def _truncate(text: str, num_chars: int = MAX_URL_CHARS) -> str:
    return text if len(text) <= num_chars else text[: num_chars - 3] + "..."


class BrowserSession:
    """One conversation's browser: its page stack (cursor i is `pages[i]`) over a `Corpus`.

    `search`, `open` and `find` return the text the model reads, an error text included: none raises.
    `call(function, arguments)` takes a call as the model writes it (arguments as JSON text).
    `count_tokens` sizes a view (default: `estimate_tokens`); give the model's tokenizer for exact views,
    e.g. `lambda text: len(encoding.encode(text))`.
    """

    def __init__(
        self,
        corpus: Corpus,
        *,
        view_tokens: int = VIEW_TOKENS,
        count_tokens: Callable[[str], int] | None = None,
        max_search_results: int = MAX_SEARCH_RESULTS,
    ):
        if view_tokens < 1:
            raise ValueError(f"view_tokens={view_tokens}: must be >= 1")
        if max_search_results < 1:
            raise ValueError(f"max_search_results={max_search_results}: must be >= 1")
        self.corpus = corpus
        self.view_tokens = view_tokens
        self.count_tokens = count_tokens or estimate_tokens
        self.max_search_results = max_search_results
        self.pages: list[Page] = []
        self._opened: dict[str, Page] = {}  # URL -> the page first opened there (links open it again)

    # ---- the three functions ----------------------------------------------------------------------------

    def search(self, query: str, topn: int = 10) -> str:
        """Search the corpus for `query`; shows a page listing the best `topn` documents (at most
        max_search_results) as links, each with a snippet."""
        try:
            if not isinstance(query, str):
                raise ToolError(f"`query` should be a string, not `{type(query).__name__}`")
            topn = _integer("topn", topn)
            if topn < 1:
                raise ToolError(f"Invalid `topn`: `{topn}`. Must be at least 1.")
            if not query_terms(query):
                raise ToolError(f"Error during search for `{query}`: the query has no words to search for.")
            try:
                hits = self.corpus.search(query, min(topn, self.max_search_results))
            except (sqlite3.Error, OSError) as err:
                raise ToolError(f"Error during search for `{query}`: {_truncate(str(err))}") from err
            results = "".join(f"\n  * {link_markup(i, h.title, h.path)} {h.snippet}" for i, h in enumerate(hits))
            page = Page(
                url="",
                title=query,
                text="\nURL: \n# Search Results" + ("\n" + results if hits else ""),
                links=tuple(h.url for h in hits),
                kind="search",
                query=tuple(query_terms(query)),
            )
            return self._push_and_show(page, loc=0, num_lines=-1)
        except ToolError as err:
            return str(err)

    def open(self, id: int | str = -1, cursor: int = -1, loc: int = -1, num_lines: int = -1, view_source=False) -> str:
        """Open link `id` of the page at `cursor` (default: the latest), or the URL `id`, or (id -1) the page
        at `cursor` again; the view starts at line `loc` (default: the top, or the passage the link points
        at) and shows `num_lines` lines (default: VIEW_TOKENS tokens' worth)."""
        try:
            loc, num_lines = _integer("loc", loc), _integer("num_lines", num_lines)
            if not isinstance(view_source, bool):
                raise ToolError(f"`view_source` should be a boolean, not `{type(view_source).__name__}`")
            passage, query = None, ()
            if isinstance(id, str):
                page = self._load(id, reuse=False)  # a URL given directly is read afresh
            else:
                id = _integer("id", id)
                current = self._page(cursor)
                if id >= len(current.links):
                    raise ToolError(f"Invalid link id `{id}`.")
                if id >= 0:
                    page = self._load(current.links[id], reuse=True)
                    passage, query = current.passages.get(id), current.query
                else:
                    page = current
            if view_source:
                page = self._source(page)
                passage, query = None, ()
            if loc < 0:
                # A find result opens at its match (as the reference's do); a search result at the passage
                # that holds most of the query's words, when the page does not fit in one view.
                if passage is None and query and self._end(page.lines(), 0, -1) < len(page.lines()):
                    passage = self._passage(page, query)
                loc = 0 if passage is None else _view_start(passage)
            return self._push_and_show(page, loc, num_lines)
        except ToolError as err:
            return str(err)

    def find(self, pattern: str, cursor: int = -1) -> str:
        """Find `pattern` (case-insensitive, exact text) in the page at `cursor` (default: the latest);
        shows a page of the matches, each a link to its place."""
        try:
            if not isinstance(pattern, str):
                raise ToolError(f"`pattern` should be a string, not `{type(pattern).__name__}`")
            if not pattern.strip():
                raise ToolError("Invalid `pattern`: it is empty. Give the text to find.")
            page = self._page(cursor)
            if page.kind in ("search", "find"):
                raise ToolError("Cannot run `find` on search results page or find results page")
            pattern = pattern.lower()
            lines = strip_links("\n".join(page.lines())).split("\n")
            chunks, passages, n = [], {}, 0
            while n < len(lines) and len(chunks) < FIND_MAX_RESULTS:
                if pattern not in lines[n].lower():
                    n += 1
                    continue
                passages[len(chunks)] = n
                chunks.append(
                    f"# {link_markup(len(chunks), f'match at L{n}')}\n" + "\n".join(lines[n : n + FIND_SHOW_LINES])
                )
                n += FIND_SHOW_LINES
            found = Page(
                url=f"{page.url}/find?pattern={quote(pattern)}",
                title=f"Find results for text: `{pattern}` in `{page.title}`",
                text="\n\n".join(chunks) if chunks else f"No `find` results for pattern: `{pattern}`",
                links=(page.url,) * len(chunks),
                kind="find",
                document_url=page.document_url,
                passages=passages,
            )
            return self._push_and_show(found, loc=0, num_lines=-1)
        except ToolError as err:
            return str(err)

    def call(self, function: str, arguments: str | dict | None = None) -> str:
        """Run one call as the model wrote it: `function` is `search`, `open` or `find` (a `browser.` prefix
        is allowed) and `arguments` its JSON object (text or parsed). A call that cannot be run is answered
        with a JSON error object, as the reference browser answers it."""
        function = function.removeprefix("browser.")
        if function not in ARGUMENTS:
            return json.dumps({"error": f"Unknown function: {function}"})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                return json.dumps({"error": "Invalid function arguments"})
        arguments = {} if arguments is None else arguments
        if not isinstance(arguments, dict):
            return json.dumps({"error": "Invalid function arguments"})
        unknown = sorted(set(arguments) - set(ARGUMENTS[function]))
        if unknown:
            valid = ", ".join(f"`{a}`" for a in ARGUMENTS[function])
            return f"Invalid arguments for `{function}`: `{unknown[0]}` is not one of {valid}."
        missing = [a for a in REQUIRED[function] if a not in arguments]
        if missing:
            return f"Missing argument for `{function}`: `{missing[0]}` is required."
        arguments = dict(arguments)
        arguments.pop("source", None)
        if function == "search" and "top_n" in arguments:
            arguments.setdefault("topn", arguments["top_n"])
        arguments.pop("top_n", None)
        return getattr(self, function)(**arguments)

    # ---- pages --------------------------------------------------------------------------------------------

    def _page(self, cursor: Any) -> Page:
        cursor = _integer("cursor", cursor)
        if not self.pages:
            raise ToolError("No pages to access!")
        if cursor == -1:
            return self.pages[-1]
        if not 0 <= cursor < len(self.pages):
            raise ToolError(
                f"Cursor `{cursor}` is out of range. Available cursor indices: [0 - {len(self.pages) - 1}]."
            )
        return self.pages[cursor]

    def _load(self, url: str, reuse: bool) -> Page:
        """The page of the corpus document at `url`; the session's copy where `reuse` and one exists."""
        if reuse and url in self._opened:
            return self._opened[url]
        try:
            path = path_of(url) if urlsplit(url).scheme else url.lstrip("/")
        except ValueError as err:  # urlsplit refuses some strings (an unclosed IPv6 bracket)
            raise ToolError(f"Error fetching URL `{_truncate(url)}`: not a URL ({err}).") from err
        if path is None:
            raise ToolError(
                f"Error fetching URL `{_truncate(url)}`: not available offline. This browser reads only the "
                "documents of a local collection: search it, or open a file:/// URL from its results."
            )
        try:
            doc = self.corpus.document(path)
        except (sqlite3.Error, OSError) as err:
            raise ToolError(f"Error fetching URL `{_truncate(url)}`: {_truncate(str(err))}") from err
        if doc is None:
            raise ToolError(f"Error fetching URL `{_truncate(url)}`: no such document in the local collection.")
        url = url_of(path)
        page = Page(url=url, title=doc.title, text=f"\nURL: {url}\n{doc.text}", links=doc.links, document_url=url)
        self._opened[url] = page
        return page

    def _source(self, page: Page) -> Page:
        """The raw file behind a document page (`view_source`)."""
        url = f"view-source:{page.document_url or page.url}"
        raw = self.corpus.source(page.document_url) if page.kind == "document" else None
        if raw is None:
            raise ToolError(f"Error fetching URL `{_truncate(url)}`: no source to show for this page.")
        raw = raw.replace("【", "〖").replace("】", "〗")
        source = Page(url=url, title=page.title, text=f"\nURL: {url}\n{raw}", kind="source", document_url=page.url)
        self._opened[url] = source  # so that a `find` result on it opens it again
        return source

    def _passage(self, page: Page, words: tuple[str, ...]) -> int | None:
        """The first line holding the most of `words` (lower-cased substrings), or None if none does."""
        best, best_count = None, 0
        for n, line in enumerate(page.lines()):
            line = line.lower()
            count = sum(w in line for w in words)
            if count > best_count:
                best, best_count = n, count
        return best

    def _end(self, lines: list[str], loc: int, num_lines: int) -> int:
        """One past the last line a view from `loc` shows: `num_lines` lines, or (num_lines <= 0) up to and
        including the line that holds token number `view_tokens` of the numbered text."""
        if num_lines > 0:
            return min(loc + num_lines, len(lines))
        chars, tokens = -1, 0
        for n in range(loc, len(lines)):  # a numbered text no longer in characters than view_tokens fits
            chars += len(f"L{n}: {lines[n]}") + 1
            if chars > self.view_tokens:
                break
        else:
            return len(lines)
        for n in range(loc, len(lines)):
            tokens += self.count_tokens(f"L{n}: {lines[n]}\n")
            if tokens > self.view_tokens:
                return n + 1
        return len(lines)

    def _push_and_show(self, page: Page, loc: int, num_lines: int) -> str:
        """Put `page` on the stack under the next cursor and show it; nothing is pushed if it cannot be shown."""
        lines = page.lines()
        if loc >= len(lines):
            raise ToolError(f"Invalid location parameter: `{loc}`. Cannot exceed page maximum of {len(lines) - 1}.")
        end = self._end(lines, loc, num_lines)
        self.pages.append(page)
        header = page.title + (f" ({_truncate(unquote(page.url))})" if page.url else "")
        body = "\n".join(f"L{n}: {lines[n]}" for n in range(loc, end))
        return f"[{len(self.pages) - 1}] {header}\n**viewing lines [{loc} - {end - 1}] of {len(lines) - 1}**\n\n{body}"


class Citation(NamedTuple):
    """What a citation points at: the document's URL and the cited lines (links shown as their text)."""

    url: str
    text: str


def resolve_citation(session: BrowserSession, citation: str) -> Citation | None:
    """The document and lines a citation `【cursor†La-Lb】` (or `【cursor†La】`) names, or None when it names
    no page of this session, lines past the page's end, or a search results page (no document)."""
    m = CITATION.fullmatch(citation.strip())
    if m is None:
        return None
    cursor, first = int(m["cursor"]), int(m["first"])
    last = int(m["last"]) if m["last"] is not None else first
    if cursor >= len(session.pages) or last < first:
        return None
    page = session.pages[cursor]
    lines = page.lines()
    if page.kind == "search" or first >= len(lines):
        return None
    return Citation(page.document_url, strip_links("\n".join(lines[first : last + 1])))


def tool_config(source: str = "local documents"):
    """openai-harmony's declaration of the browser tool (`ToolNamespaceConfig.browser()`) with its
    `sources=` line naming `source`, so that the model does not take the collection for the web."""
    from openai_harmony import ToolNamespaceConfig

    config = ToolNamespaceConfig.browser()
    head, sep, _ = config.description.rpartition("sources=")
    config.description = f"{head}{sep}{source}" if sep else f"{config.description}\nsources={source}"
    return config
