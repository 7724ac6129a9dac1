"""Citations in the code and the docs point at something a reader of the repository can open."""

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = [
    p
    for d in ("src", "tests", "benchmarks", "configs")
    for p in (ROOT / d).rglob("*")
    if p.suffix in (".py", ".yaml", ".yml")
]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITATION = re.compile(r"docs/([\w.-]+\.md)(#[\w-]+)?")
# An inline link or image, [text](target) or ![alt](target "title"): the target, then its #anchor.
LINK = re.compile(r"!?\[[^\]]*\]\(<?([^)\s#>]*)(#[^)\s>]*)?>?(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`+[^`]*`+")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto: ...


def _anchors(md: Path) -> set[str]:
    """GitHub-style anchors of a Markdown file's headings (lowercase, punctuation dropped, spaces -> '-')."""
    out, in_code = set(), False
    for line in md.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add("#" + re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def _broken(target: Path, anchor: str | None, where: str) -> list[str]:
    if not target.is_file():
        return [f"{where}: {target.relative_to(ROOT)} does not exist"]
    if anchor and anchor not in _anchors(target):
        return [f"{where}: {target.relative_to(ROOT)} has no heading {anchor}"]
    return []


def test_code_citations_resolve():
    """Every docs/<name>.md#anchor named in src, tests, benchmarks and configs is a file with that heading."""
    broken = []
    for path in CODE:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for name, anchor in CITATION.findall(line):
                broken += _broken(ROOT / "docs" / name, anchor or None, f"{path.relative_to(ROOT)}:{n}")
    assert not broken, "\n".join(broken)


@cache
def _committed() -> frozenset[str]:
    """Paths git tracks in this checkout (relative to the root), or skip where this is no git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("git is not installed: cannot tell committed files from local ones")
    if out.returncode != 0:
        pytest.skip(f"{ROOT} is not a git checkout: cannot tell committed files from local ones")
    return frozenset(p for p in out.stdout.split("\0") if p)


def _links(md: Path) -> list[tuple[int, str, str | None]]:
    """(line, target, #anchor or None) of every inline link and image of a Markdown file, outside
    fenced code and code spans."""
    out, in_code = [], False
    for n, line in enumerate(md.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for target, anchor in LINK.findall(CODE_SPAN.sub("", line)):
            out.append((n, target, anchor or None))
    return out


def _unresolved(md: Path, target: str, anchor: str | None) -> str | None:
    """Why a relative link of `md` does not resolve to a committed file (and heading), or None."""
    path = (md.parent / target).resolve() if target else md
    if not path.is_relative_to(ROOT):
        return f"{target} lies outside the repository"
    rel = path.relative_to(ROOT).as_posix()
    committed = _committed()
    if rel not in committed and not any(p.startswith(rel + "/") for p in committed):
        return f"{rel} is not a committed file" + (" (it exists here, untracked)" if path.exists() else "")
    if anchor and path.suffix == ".md" and anchor not in _anchors(path):
        return f"{rel} has no heading {anchor}"
    return None


def test_markdown_links_and_images_resolve_to_committed_files():
    """Every relative link and image in the README and docs/ names a file (or folder) git tracks, and a
    link's #anchor names a heading of its Markdown target: a reader of a fresh clone finds it."""
    broken = []
    for md in DOCS:
        for n, target, anchor in _links(md):
            if EXTERNAL.match(target):
                continue
            why = _unresolved(md, target, anchor)
            if why:
                broken.append(f"{md.relative_to(ROOT)}:{n}: {why}")
    assert not broken, "\n".join(broken)


def test_the_link_check_sees_links_images_and_anchors(tmp_path):
    """The link check finds images, links with anchors and same-page anchors, and not code."""
    md = tmp_path / "x.md"
    md.write_text(
        "# Top\n![a](img/p.png) and [b](other.md#some-part) and [c](#top) `[d](code.md)`\n"
        "```\n[e](fenced.md)\n```\n[f](https://example.com/g.md)\n"
    )
    assert _links(md) == [
        (2, "img/p.png", None),
        (2, "other.md", "#some-part"),
        (2, "", "#top"),
        (6, "https://example.com/g.md", None),
    ]
    assert _unresolved(ROOT / "README.md", "docs/img/never-committed.png", None) == (
        "docs/img/never-committed.png is not a committed file"
    )
    assert _unresolved(ROOT / "README.md", "docs/passkey.md", "#no-such-heading") == (
        "docs/passkey.md has no heading #no-such-heading"
    )
    assert _unresolved(ROOT / "README.md", "../outside.md", None) == "../outside.md lies outside the repository"


def test_nothing_cites_a_document_outside_the_repository():
    """No code or doc cites the private specification the rules were first written in."""
    marker = "SPEC " + "\u00a7"
    hits = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in CODE + DOCS
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if marker in line or "\u00a7" in line
    ]
    assert not hits, hits
