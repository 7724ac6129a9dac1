"""One file of the browser's corpus as the page the model reads: its title, its text and its links.

The rules follow the pages the `browser` tool was trained on (the gpt-oss reference browser turns HTML
into Markdown-like text; see docs/tools.md#the-browser-tool):

- a link is written in the text as `【{id}†{text}】` when its target is on the same site, and as
  `【{id}†{text}†{domain}】` when it leaves it; ids count from 0 in order of first appearance, and two
  links to one target share an id;
- `【` and `】` in a document become `〖` and `〗` (no document text can pass for a link), zero-width
  spaces are dropped, and a `†` in a link's text becomes `‡` (it would end the link's text);
- HTML headings become `#` lines, list items `  * ` or `  1. ` (two more spaces a level), images
  `[Image {n}: {alt}]`, preformatted text is indented four spaces, and a run of blank lines is one.

The corpus is one site: a link from one of its documents to another carries no domain, a link to the
web keeps its domain (opening it answers that it is not available offline). A document's URL is
`file:///` and its path relative to the corpus directory, percent-encoded: it does not change when the
directory moves, and it does not show the model where the user keeps their files.

Text (.txt) is shown as it is, Markdown (.md) with its inline links `[text](target)` made links, HTML
(.html, .htm) as text extracted with the standard library's `html.parser`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import PurePosixPath
from urllib.parse import quote, unquote, urljoin, urlsplit

KINDS = {".txt": "text", ".md": "markdown", ".html": "html", ".htm": "html"}  # file suffix -> extractor

# A link as written in a page: 【id†text】 or 【id†text†domain】.
LINK = re.compile(r"【\d+†(?P<text>[^†】]+)(?:†[^†】]+)?】")


@dataclass(frozen=True)
class Document:
    """A corpus file as a page: `links[i]` is the target URL of the link written `【i†...】` in `text`."""

    title: str
    text: str
    links: tuple[str, ...] = ()


def url_of(path: str) -> str:
    """The URL of the document at `path` (relative to the corpus directory, '/'-separated)."""
    return "file:///" + quote(path)


def path_of(url: str) -> str | None:
    """The corpus path a `file:///` URL names (percent-encoded or not), or None for any other URL."""
    parts = urlsplit(url.strip())
    if parts.scheme != "file" or parts.netloc not in ("", "localhost"):
        return None
    path = PurePosixPath(unquote(parts.path).lstrip("/"))
    return None if ".." in path.parts or str(path) == "." else str(path)


def link_markup(i: int, text: str, domain: str = "") -> str:
    """Link `i` as a page writes it: `【i†text】`, or `【i†text†domain】` when it leaves the site."""
    text, domain = (" ".join(_escape(s).replace("†", "‡").split()) for s in (text, domain))
    return f"【{i}†{text}†{domain}】" if domain else f"【{i}†{text}】"


def strip_links(text: str) -> str:
    """`text` with every link `【i†text(†domain)】` replaced by its text."""
    return LINK.sub(lambda m: m.group("text"), text)


def extract(raw: str, path: str) -> Document:
    """The page of the corpus file at `path` (its suffix picks the extractor) whose content is `raw`."""
    kind = KINDS.get(PurePosixPath(path).suffix.lower())
    if kind is None:
        raise ValueError(f"{path}: not a corpus document (the browser reads {', '.join(sorted(KINDS))})")
    name = PurePosixPath(path).name
    raw = _escape(raw.replace("\r\n", "\n").replace("\r", "\n"))
    if kind == "text":
        return Document(title=name, text=_tidy(raw))
    links = _Links(url_of(path))
    if kind == "markdown":
        return Document(
            title=_markdown_title(raw) or name, text=_tidy(_markdown_links(raw, links)), links=links.tuple()
        )
    parser = _HTMLText(links)
    parser.feed(raw)
    parser.close()
    return Document(title=parser.title() or name, text=_tidy(parser.text()), links=links.tuple())


def _escape(text: str) -> str:
    return text.replace("【", "〖").replace("】", "〗").replace("\u200b", "")


def _tidy(text: str) -> str:
    """Trailing spaces dropped, runs of blank lines made one, no blank lines at either end."""
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


class _Links:
    """The links of one page: target URL -> id, in order of first appearance."""

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.ids: dict[str, int] = {}

    def render(self, text: str, href: str) -> str:
        """A link as the page shows it, or just its text where the target is nothing one can open."""
        target = _target(href, self.base_url)
        if target is None or not text.strip():
            return " ".join(text.split())
        url, domain = target
        return link_markup(self.ids.setdefault(url, len(self.ids)), text, domain)

    def tuple(self) -> tuple[str, ...]:
        return tuple(self.ids)  # dicts keep insertion order, which is id order


def _target(href: str, base_url: str) -> tuple[str, str] | None:
    """(URL, domain) a link leads to; the domain is "" for a corpus document. None for a link within
    the page (#...), to mail or script, or to a scheme the browser has no page for."""
    href = href.strip()
    if not href or href.startswith("#"):
        return None
    parts = urlsplit(urljoin(base_url, href))
    if parts.scheme == "file":
        path = path_of(f"file://{parts.netloc}{parts.path}")  # the document, without #fragment or ?query
        return None if path is None else (url_of(path), "")
    if parts.scheme in ("http", "https") and parts.netloc:
        return parts.geturl(), parts.netloc
    return None


# ---- Markdown ---------------------------------------------------------------------------------------------

_MD_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_MD_FENCE = re.compile(r"^\s*(```|~~~)")
# [text](target) or [text](<target> "title"), not an image ![alt](src).
_MD_LINK = re.compile(r"(?<!!)\[([^\[\]\n]+)\]\(\s*<?([^()\s<>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_MD_CODE_SPAN = re.compile(r"(`+[^`]*`+)")


def _markdown_title(text: str) -> str | None:
    """The first level-1 heading, else the first heading of any level, outside fenced code."""
    best = None
    for line in _outside_fences(text.split("\n")):
        m = _MD_HEADING.match(line)
        if m and len(m.group(1)) == 1:
            return m.group(2)
        if m and best is None:
            best = m.group(2)
    return best


def _outside_fences(lines: list[str]):
    fenced = False
    for line in lines:
        if _MD_FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            yield line


def _markdown_links(text: str, links: _Links) -> str:
    """Inline links made page links, except in fenced code and code spans."""
    out, fenced = [], False
    for line in text.split("\n"):
        if _MD_FENCE.match(line):
            fenced = not fenced
        elif not fenced and "](" in line:
            pieces = _MD_CODE_SPAN.split(line)  # odd pieces are code spans, left as written
            line = "".join(
                p if i % 2 else _MD_LINK.sub(lambda m: links.render(m.group(1), m.group(2)), p)
                for i, p in enumerate(pieces)
            )
        out.append(line)
    return "\n".join(out)


# ---- HTML -------------------------------------------------------------------------------------------------

_SKIP = {"script", "style", "noscript", "template", "svg", "math"}  # content that is not read
_PARAGRAPH = {
    "p", "div", "section", "article", "header", "footer", "main", "nav", "aside", "table", "form", "figure",
    "figcaption", "blockquote", "dl", "dd", "address", "details", "summary", "fieldset", "hr",
}  # fmt: skip
_LINE = {"tr", "dt", "br", "caption"}


class _HTMLText(HTMLParser):
    """HTML -> Markdown-like text, links written by `_Links` (the rules of the module docstring)."""

    def __init__(self, links: _Links):
        super().__init__(convert_charrefs=True)
        self.links = links
        self.parts: list[str] = []
        self.owed = 0  # newlines to write before the next text
        self.skip = 0  # depth inside elements whose content is not read
        self.lists: list[list] = []  # [tag, items so far] of each open <ul>/<ol>
        self.anchor: tuple[str, list[str]] | None = None  # (href, text so far) of the open <a href>
        self.pre: list[str] | None = None  # the text of the open <pre>
        self.images = 0
        self.title_parts: list[str] | None = None  # while inside <title>
        self.titles: list[str] = []  # of each <title>
        self.h1: list[str] | None = None  # while inside the first <h1>: the title when <title> has none
        self.h1_text: str | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in _SKIP:
            self.skip += 1
        elif tag == "title":
            self.title_parts = []
        elif tag == "a" and attrs.get("href") and self.anchor is None:
            self.anchor = (attrs["href"], [])
        elif tag == "img":
            alt = " ".join(_escape(attrs.get("alt") or attrs.get("title") or "").split())
            self._text(f"[Image {self.images}: {alt}]" if alt else f"[Image {self.images}]")
            self.images += 1
        elif tag in ("h1", "h2", "h3", "h4", "h5", "h6"):
            self._break(2)
            self._marker("#" * int(tag[1]) + " ")
            if tag == "h1" and self.h1_text is None:
                self.h1 = []
        elif tag in ("ul", "ol"):
            self._break(1 if self.lists else 2)
            self.lists.append([tag, 0])
        elif tag == "li":
            self._break(1)
            depth = max(len(self.lists), 1)
            if self.lists and self.lists[-1][0] == "ol":
                self.lists[-1][1] += 1
                self._marker("  " * depth + f"{self.lists[-1][1]}. ")
            else:
                self._marker("  " * depth + "* ")
        elif tag == "pre":
            self._break(2)
            self.pre = []
        elif tag in _PARAGRAPH:
            self._break(2)
        elif tag in _LINE:
            self._break(1)

    def handle_endtag(self, tag):
        if tag in _SKIP:
            self.skip = max(self.skip - 1, 0)
        elif tag == "title" and self.title_parts is not None:
            self.titles.append("".join(self.title_parts))
            self.title_parts = None
        elif tag == "a" and self.anchor is not None:
            href, text = self.anchor
            self.anchor = None
            self._text(self.links.render("".join(text), href))
        elif tag in ("h1", "h2", "h3", "h4", "h5", "h6"):
            self._break(2)
            if self.h1 is not None and tag == "h1":
                self.h1_text, self.h1 = "".join(self.h1), None
        elif tag in ("ul", "ol") and self.lists:
            self.lists.pop()
            self._break(1 if self.lists else 2)
        elif tag == "li":
            self._break(1)
        elif tag == "pre" and self.pre is not None:
            block = "".join(self.pre).removeprefix("\n").rstrip()
            self.pre = None
            self._break(2)
            self._write("\n".join("    " + line if line.strip() else "" for line in block.split("\n")))
            self._break(2)
        elif tag in ("td", "th"):
            self._text(" ")
        elif tag in _PARAGRAPH:
            self._break(2)
        elif tag in _LINE:
            self._break(1)

    def handle_data(self, data):
        data = _escape(data)
        if self.title_parts is not None:
            self.title_parts.append(data)
        elif not self.skip:
            if self.h1 is not None:
                self.h1.append(data)
            self._text(data if self.pre is not None else re.sub(r"\s+", " ", data))

    def _break(self, n: int) -> None:
        """At least `n` newlines before the next text (none before the first)."""
        if self.anchor is None and self.pre is None and self.parts:
            self.owed = max(self.owed, n)

    def _text(self, text: str) -> None:
        if self.anchor is not None:
            self.anchor[1].append(text)
        elif self.pre is not None:
            self.pre.append(text)
        else:
            at_start = self.owed or not self.parts or self.parts[-1].endswith((" ", "\n"))
            self._write(text.lstrip(" ") if at_start else text)

    def _marker(self, marker: str) -> None:
        """A line's prefix (list bullet, heading hashes): written as is, text after it starts trimmed."""
        if self.anchor is None and self.pre is None:
            self._write(marker)

    def _write(self, text: str) -> None:
        if not text:
            return
        if self.owed:
            self.parts.append("\n" * self.owed)
            self.owed = 0
        self.parts.append(text)

    def text(self) -> str:
        return "".join(self.parts)

    def title(self) -> str | None:
        for title in [*self.titles, self.h1_text or ""]:
            if title := " ".join(title.split()):
                return title
        return None
