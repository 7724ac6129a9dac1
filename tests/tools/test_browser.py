"""The browser tool's display, errors and citations (gptoss_lite/tools/browser.py).

The golden strings below were written by hand from the display rules of OpenAI's reference browser
(gpt-oss's simple_browser tool), as browser.py's docstring lists them; each test names the rules it
checks. Where our output could only be compared by running that browser, it was (see docs/tools.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gptoss_lite.tools.browser import BrowserSession, Citation, Corpus, estimate_tokens, resolve_citation, tool_config

# The small fixed corpus of the golden tests: Markdown with a same-site and a web link and a line longer
# than 80 characters, a text file, and HTML with a title, a script, links and a list.
GOLDEN = {
    "guide/install.md": (
        "# Installing the server\n\nRun `pip install gptoss-lite`, then [start it](serve.txt).\n"
        "The server listens on port 8000 unless told otherwise; see the [FAQ](https://example.com/faq#port)"
        " for the rest.\n"
    ),
    "guide/serve.txt": "Start the server with gptoss-lite serve.\nStop it with Ctrl-C.\n",
    "notes.html": (
        "<html><head><title>Release notes</title><script>var x = 1;</script></head><body><h1>Release 0.1</h1>"
        '<p>Adds the <a href="guide/install.md">installer</a> and a <a href="https://example.com/blog">blog</a>.</p>'
        "<ul><li>fast search</li><li>works offline</li></ul></body></html>\n"
    ),
}


def write_files(directory: Path, files: dict[str, str]) -> Path:
    for path, text in files.items():
        (directory / path).parent.mkdir(parents=True, exist_ok=True)
        (directory / path).write_text(text)
    return directory


@pytest.fixture
def corpus(tmp_path):
    docs = write_files(tmp_path / "docs", GOLDEN)
    with Corpus(docs, tmp_path / "index.sqlite3") as c:
        yield c


@pytest.fixture
def session(corpus):
    return BrowserSession(corpus)


# Rules: a search page is titled by the query and has no URL (so no "(url)" in its header); its text is
# an empty line, "URL: ", "# Search Results", an empty line, then one "  * 【i†title†path】 snippet" a
# result, best first; every page line is wrapped at 80 characters with its whitespace kept (L4 ends in a
# space, L6 starts with one) and numbered "L{n}: "; the scrollbar counts the last line's number.
SEARCH_GOLDEN = "\n".join(
    [
        "[0] install server",
        "**viewing lines [0 - 10] of 10**",
        "",
        "L0: ",
        "L1: URL: ",
        "L2: # Search Results",
        "L3: ",
        "L4:   * 【0†Installing the server†guide/install.md】 # Installing the server Run `pip ",
        "L5: install gptoss-lite`, then start it. The server listens on port 8000 unless told",
        "L6:  otherwise; see the FAQ for the rest.",
        "L7:   * 【1†serve.txt†guide/serve.txt】 Start the server with gptoss-lite serve. Stop ",
        "L8: it with Ctrl-C.",
        "L9:   * 【2†Release notes†notes.html】 # Release 0.1 Adds the installer and a blog. * ",
        "L10: fast search * works offline",
    ]
)

# Rules: "[cursor] title (url)"; a document page starts with an empty line and "URL: {url}"; a link to
# another corpus document is 【i†text】, a link to the web 【i†text†domain】; the line past 80 characters
# wraps after the last whole word that fits, its trailing space kept.
OPEN_GOLDEN = "\n".join(
    [
        "[1] Installing the server (file:///guide/install.md)",
        "**viewing lines [0 - 6] of 6**",
        "",
        "L0: ",
        "L1: URL: file:///guide/install.md",
        "L2: # Installing the server",
        "L3: ",
        "L4: Run `pip install gptoss-lite`, then 【0†start it】.",
        "L5: The server listens on port 8000 unless told otherwise; see the ",
        "L6: 【1†FAQ†example.com】 for the rest.",
    ]
)

# Rules: find matches case-insensitively on the page's lines with links shown as their text; each match
# is "# 【k†match at L{n}】" and the 4 lines from it; the next search starts after those 4 lines (so L5's
# "server" is not a second match); the page's URL is the document's + "/find?pattern=", its title names
# the pattern (lower-cased) and the page.
FIND_GOLDEN = "\n".join(
    [
        "[2] Find results for text: `server` in `Installing the server` (file:///guide/install.md/find?pattern=server)",
        "**viewing lines [0 - 4] of 4**",
        "",
        "L0: # 【0†match at L2】",
        "L1: # Installing the server",
        "L2: ",
        "L3: Run `pip install gptoss-lite`, then start it.",
        "L4: The server listens on port 8000 unless told otherwise; see the ",
    ]
)


def test_search_open_find_show_the_reference_display(session):
    """search -> open a result -> find: each answer is the golden page, under cursors 0, 1, 2."""
    assert session.search("install server") == SEARCH_GOLDEN
    assert session.open(id=0) == OPEN_GOLDEN
    assert session.find("SERVER") == FIND_GOLDEN


def test_html_page_and_find_without_matches(session):
    """An HTML page: <title> is the title, the script is gone, the h1 is a # line, list items are "  * "
    lines; a find with no match says so on a page of its own."""
    assert session.open(id="file:///notes.html") == (
        "[0] Release notes (file:///notes.html)\n**viewing lines [0 - 7] of 7**\n\n"
        "L0: \nL1: URL: file:///notes.html\nL2: # Release 0.1\nL3: \n"
        "L4: Adds the 【0†installer】 and a 【1†blog†example.com】.\nL5: \nL6:   * fast search\nL7:   * works offline"
    )
    assert session.find("zebra") == (
        "[1] Find results for text: `zebra` in `Release notes` (file:///notes.html/find?pattern=zebra)\n"
        "**viewing lines [0 - 0] of 0**\n\nL0: No `find` results for pattern: `zebra`"
    )


def test_opening_a_find_result_starts_at_the_match(session):
    """A find result opens its page at the match (four lines above it past line 4, as the reference)."""
    session.open(id="file:///guide/install.md")
    session.find("server")
    assert session.open(id=0).split("\n")[:4] == [
        "[2] Installing the server (file:///guide/install.md)",
        "**viewing lines [2 - 6] of 6**",
        "",
        "L2: # Installing the server",
    ]


def test_scrolling_shows_the_page_again_under_a_new_cursor(session):
    """open without id, with cursor/loc/num_lines: the same page from `loc`, `num_lines` lines, next cursor."""
    session.search("install server")
    session.open(id=0)
    assert session.open(cursor=1, loc=4, num_lines=2) == (
        "[2] Installing the server (file:///guide/install.md)\n**viewing lines [4 - 5] of 6**\n\n"
        "L4: Run `pip install gptoss-lite`, then 【0†start it】.\n"
        "L5: The server listens on port 8000 unless told otherwise; see the "
    )
    assert session.open(id=0, cursor=2).startswith("[3] serve.txt (file:///guide/serve.txt)\n")  # a link of page 2


def test_a_view_ends_with_the_line_holding_token_view_tokens(tmp_path):
    """Without num_lines a view shows the lines up to and including the one that holds token number
    view_tokens (here 10 tokens a line, 95 tokens: lines 0-9); a search result in a page longer than a
    view opens four lines above the line richest in the query's words."""
    lines = [f"filler line number {k}" for k in range(300)]
    lines[200] = "the zebra crossing"
    write_files(tmp_path / "docs", {"long.txt": "\n".join(lines)})
    with Corpus(tmp_path / "docs", tmp_path / "index") as corpus:
        session = BrowserSession(corpus, view_tokens=95, count_tokens=lambda text: 10)
        assert session.open(id="long.txt").split("\n")[1] == "**viewing lines [0 - 9] of 301**"
        session.search("zebra")
        shown = session.open(id=0).split("\n")
        assert shown[1] == "**viewing lines [198 - 207] of 301**"  # file line 200 is page line 202
        assert shown[7] == "L202: the zebra crossing"
    assert estimate_tokens("abcdefg") == 3  # the default: 3 characters a token, rounded up


# ---- errors: what the model reads, never an exception ------------------------------------------------------


def test_errors_are_texts_in_the_reference_wording(session):
    """Each mistake is answered with its error text, and a failed call leaves the page stack as it was."""
    assert session.open() == "No pages to access!"
    assert session.find("x") == "No pages to access!"
    assert session.search("") == "Error during search for ``: the query has no words to search for."
    assert session.search(" ?! ") == "Error during search for ` ?! `: the query has no words to search for."
    assert session.search("server", topn=0) == "Invalid `topn`: `0`. Must be at least 1."
    session.search("server")
    session.open(id=0)
    assert len(session.pages) == 2
    assert session.open(cursor=7) == "Cursor `7` is out of range. Available cursor indices: [0 - 1]."
    assert session.open(cursor="1") == "`cursor` should be an integer, not `str`"
    assert session.open(id=9) == "Invalid link id `9`."
    assert session.open(loc=50) == "Invalid location parameter: `50`. Cannot exceed page maximum of 6."
    assert session.find("server", cursor=0) == "Cannot run `find` on search results page or find results page"
    assert session.find("  ") == "Invalid `pattern`: it is empty. Give the text to find."
    assert session.open(id="file:///missing.md") == (
        "Error fetching URL `file:///missing.md`: no such document in the local collection."
    )
    assert session.open(id="http://[::1") == "Error fetching URL `http://[::1`: not a URL (Invalid IPv6 URL)."
    assert len(session.pages) == 2  # none of these pushed a page


def test_a_url_outside_the_corpus_is_not_available_offline(session):
    """A web URL (opened directly, or as a page's link) is an error saying it is not available offline."""
    assert session.open(id="https://example.com/faq") == (
        "Error fetching URL `https://example.com/faq`: not available offline. This browser reads only the "
        "documents of a local collection: search it, or open a file:/// URL from its results."
    )
    session.open(id="file:///guide/install.md")
    assert session.open(id=1).startswith("Error fetching URL `https://example.com/faq#port`: not available offline.")


def test_nothing_in_the_tools_imports_an_http_client():
    """The browser has no way to fetch: none of its modules imports an HTTP, TLS or socket library. (The
    python tool's sandbox uses a socket only for interface ioctls inside its own network namespace.)"""
    banned = {"socket", "ssl", "http", "urllib3", "requests", "httpx", "aiohttp"}
    tools = Path(__file__).resolve().parents[2] / "src" / "gptoss_lite" / "tools"
    imported = set()
    for name in ("browser.py", "corpus.py", "documents.py", "__init__.py"):
        path = tools / name
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported |= {f"{node.module}.{a.name}" for a in node.names}
    assert "urllib.parse.urlsplit" in imported  # the scan sees imports
    assert not {m for m in imported if m.split(".")[0] in banned or m.startswith("urllib.request")}


def test_call_runs_the_models_json_and_answers_bad_calls(session):
    """call() takes the model's JSON arguments (same answer as the method) and answers a call it cannot run
    with a JSON error (unparsable, unknown function) or an error text (unknown or missing argument)."""
    assert session.call("browser.search", '{"query": "install server", "source": "web"}') == SEARCH_GOLDEN
    assert session.call("open", {"id": 0}) == OPEN_GOLDEN
    assert session.call("search", '{"query": "serve", "top_n": 1}').count("  * 【") == 1
    assert session.call("open", "{not json") == '{"error": "Invalid function arguments"}'
    assert session.call("open", "[1]") == '{"error": "Invalid function arguments"}'
    assert session.call("browse", "{}") == '{"error": "Unknown function: browse"}'
    assert session.call("search", {"q": "x"}) == (
        "Invalid arguments for `search`: `q` is not one of `query`, `topn`, `top_n`, `source`."
    )
    assert session.call("find", "") == "Missing argument for `find`: `pattern` is required."


@pytest.fixture(scope="module")
def shared_corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("browser")
    with Corpus(write_files(tmp / "docs", GOLDEN), tmp / "index") as c:
        yield c


VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 12),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from(["file:///guide/install.md", "https://example.com", "notes.html", "http://[x", "server"]),
    st.lists(st.integers(), max_size=2),
)
CALLS = st.tuples(
    st.sampled_from(["search", "open", "find", "nope"]),
    st.dictionaries(st.sampled_from(["query", "pattern", "id", "cursor", "loc", "num_lines", "topn", "x"]), VALUES),
)


@settings(max_examples=150, deadline=None)
@given(calls=st.lists(CALLS, max_size=6))
def test_no_call_raises(shared_corpus, calls):
    """Any sequence of calls with any argument values is answered with text: nothing escapes to the server."""
    session = BrowserSession(shared_corpus)
    for function, arguments in calls:
        assert isinstance(session.call(function, arguments), str)


# ---- citations --------------------------------------------------------------------------------------------


def test_a_citation_maps_back_to_its_document_and_lines(session):
    """【cursor†La-Lb】 gives the URL of the page's document and lines a..b (links as their text); a range
    past the end is cut at the last line; a search page, an unknown cursor or a first line past the end
    give None. A find page's citation points at the document it searched."""
    session.search("install server")
    session.open(id=0)
    session.find("server")
    url = "file:///guide/install.md"
    assert resolve_citation(session, "【1†L4-L5】") == Citation(
        url,
        "Run `pip install gptoss-lite`, then start it.\n"
        "The server listens on port 8000 unless told otherwise; see the ",
    )
    assert resolve_citation(session, "【1†L6】") == (url, "FAQ for the rest.")
    assert resolve_citation(session, "【1†L6-L40】") == (url, "FAQ for the rest.")
    assert resolve_citation(session, "【2†L1】") == (url, "# Installing the server")
    for bad in ("【0†L4】", "【3†L1】", "【1†L7】", "【1†L5-L4】", "【1†start it】", "1†L4"):
        assert resolve_citation(session, bad) is None, bad


def test_tool_config_is_harmonys_browser_with_our_source():
    """tool_config() is openai-harmony's browser declaration, its sources line naming the local collection."""
    config = tool_config()
    assert config.name == "browser"
    assert [tool.name for tool in config.tools] == ["search", "open", "find"]
    assert "`【{cursor}†L{line_start}(-L{line_end})?】`" in config.description
    assert config.description.endswith("\nsources=local documents")
