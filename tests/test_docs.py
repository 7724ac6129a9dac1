"""Citations in the code and the docs point at something a reader of the repository can open."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = [
    p
    for d in ("src", "tests", "benchmarks", "configs")
    for p in (ROOT / d).rglob("*")
    if p.suffix in (".py", ".yaml", ".yml")
]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITATION = re.compile(r"docs/([\w.-]+\.md)(#[\w-]+)?")
MD_LINK = re.compile(r"\]\(([\w./-]*\.md)?(#[\w-]+)?\)")


def _anchors(md: Path) -> set[str]:
    """GitHub-style anchors of a Markdown file's headings (lowercase, punctuation dropped, spaces -> '-')."""
    out, in_code = set(), False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
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


def test_markdown_links_between_docs_resolve():
    """Relative links in the README and docs/ (file and #anchor) point at existing files and headings."""
    broken = []
    for md in DOCS:
        in_code = False
        for n, line in enumerate(md.read_text().splitlines(), 1):
            if line.startswith("```"):
                in_code = not in_code
            if in_code:
                continue
            for name, anchor in MD_LINK.findall(line):
                target = md if not name else (md.parent / name).resolve()
                broken += _broken(target, anchor or None, f"{md.relative_to(ROOT)}:{n}")
    assert not broken, "\n".join(broken)


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
