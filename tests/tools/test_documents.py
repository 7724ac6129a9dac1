"""Corpus files as pages (gptoss_lite/tools/documents.py): titles, text and links by the display rules."""

from __future__ import annotations

import pytest

from gptoss_lite.tools.documents import Document, extract, path_of, strip_links, url_of


def test_html_becomes_markdown_like_text_with_links():
    """HTML rules: <title> is the title; script and style are dropped; entities decoded; h1-h6 are # lines;
    list items "  * " and "  1. ", two more spaces a level; <pre> indented 4; <br> a line break; table cells
    space-separated; images [Image n: alt]; a link into the corpus is 【i†text】, to the web 【i†text†domain】,
    to the same target the same id; a #fragment or mailto link is plain text; 【】 become 〖〗, † in a link's
    text ‡; blank-line runs are one."""
    html = (
        "<html><head><title> The  Guide </title><style>p {}</style></head><body>"
        "<h1>Guide &amp; notes</h1><script>alert(1)</script>"
        '<p>Read <a href="../intro.md#top">the intro</a>, the <a href="https://docs.example.org/x?y=1">docs</a>,'
        ' <a href="#here">here</a>, <a href="mailto:a@b.c">mail</a> and <a href="/intro.md">the†intro</a>.</p>'
        "<ul><li>one<ul><li>nested</li></ul></li><li>two 【x】</li></ul><ol><li>first</li><li>second</li></ol>"
        "<pre>\nline 1\n  line 2</pre><p>a<br>b</p><h3>Table</h3><table><tr><td>c1</td><td>c2</td></tr></table>"
        '<img src="p.png" alt="a cat"><img src="q.png"><div></div><div></div><p>end</p></body></html>'
    )
    doc = extract(html, "guide/page.html")
    assert doc.title == "The Guide"
    assert doc.links == ("file:///intro.md", "https://docs.example.org/x?y=1")
    assert doc.text == (
        "# Guide & notes\n\n"
        "Read 【0†the intro】, the 【1†docs†docs.example.org】, here, mail and 【0†the‡intro】.\n\n"
        "  * one\n    * nested\n  * two 〖x〗\n\n  1. first\n  2. second\n\n"
        "    line 1\n      line 2\n\n"
        "a\nb\n\n### Table\n\nc1 c2\n\n[Image 0: a cat][Image 1]\n\nend"
    )


def test_html_title_falls_back_to_the_first_h1_then_the_file_name():
    """Without <title> the first <h1> names the page; without either, the file name does."""
    assert extract("<h1>First</h1><h1>Second</h1>", "a.htm").title == "First"
    assert extract("<p>no heading</p>", "dir/b.html") == Document("b.html", "no heading")


def test_markdown_links_titles_and_code():
    """Markdown rules: the first level-1 heading is the title (a fenced '# comment' is not a heading);
    inline links become page links, except in code spans and fences; images stay as written."""
    md = (
        "```\n# not a heading\n[x](y.md)\n```\n## Sub\n# Main title #\n\n"
        'See [setup](setup.md "Setup"), `[code](z.md)`, ![pic](p.png) and [web](<https://x.org/a>).\n\n\n\nEnd.  \n'
    )
    doc = extract(md, "notes/readme.md")
    assert doc.title == "Main title"
    assert doc.links == ("file:///notes/setup.md", "https://x.org/a")
    assert doc.text == (
        "```\n# not a heading\n[x](y.md)\n```\n## Sub\n# Main title #\n\n"
        "See 【0†setup】, `[code](z.md)`, ![pic](p.png) and 【1†web†x.org】.\n\nEnd."
    )
    assert extract("## Only a subheading\n", "n.md").title == "Only a subheading"


def test_text_files_are_shown_as_they_are():
    """Text rules: the title is the file name; lines keep their text, trailing spaces and extra blank lines
    go, CRLF becomes LF; nothing is a link."""
    doc = extract("\r\nLine one  \r\n\r\n\r\n\tLine [two](x.md)\r\n", "notes/todo.txt")
    assert doc == Document("todo.txt", "Line one\n\n\tLine [two](x.md)")


def test_urls_and_paths():
    """A corpus path's URL is file:/// + the percent-encoded path, and back; other schemes, hosts and paths
    climbing out of the corpus name no document; strip_links leaves a link's text."""
    assert url_of("my notes/é.md") == "file:///my%20notes/%C3%A9.md"
    assert path_of("file:///my%20notes/%C3%A9.md") == path_of("file:///my notes/é.md") == "my notes/é.md"
    assert path_of("file://localhost/a.md") == "a.md"
    for url in ("https://x.org/a.md", "file://host/a.md", "file:///../etc/passwd", "file:///"):
        assert path_of(url) is None, url
    assert strip_links("see 【0†the intro】 and 【1†docs†x.org】") == "see the intro and docs"


def test_an_unknown_suffix_is_refused():
    """extract() names the suffixes it reads."""
    with pytest.raises(ValueError, match=r"a.pdf: not a corpus document \(the browser reads .htm, .html, .md, .txt\)"):
        extract("", "a.pdf")
