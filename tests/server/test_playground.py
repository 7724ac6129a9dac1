"""The playground at / in a real headless Chromium: it loads, sends a prompt, and shows streamed text
and the server's live figures. Skipped (with the reason) where Playwright or Chromium is missing,
except in CI, which installs Chromium and fails without it."""

from __future__ import annotations

import contextlib
import os
import shutil

import live_server
import pytest
from live_server import tiny_llm

serve = live_server.serve  # the fixture

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str | None:
    """$CHROMIUM, else Debian's chromium (or another Chromium build) on PATH."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def launch(playwright):
    exe = chromium_path()
    if exe is None:
        if os.environ.get("CI"):  # .ci/run installs it: a CI run must not pass by skipping
            pytest.fail("no Chromium on PATH in CI; .ci/run should have installed Debian's chromium")
        pytest.skip("no Chromium on PATH (apt-get install chromium, or set $CHROMIUM)")
    return playwright.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])


@contextlib.contextmanager
def playground(url: str, model: str, mode: str, max_tokens: int):
    """A page of the playground at `url` in headless Chromium, loaded (its model id shown), with the
    mode and max_tokens set; closed afterwards."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (a test extra)")
    with sync_api.sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page()
            page.goto(url + "/")
            page.wait_for_function(f"document.getElementById('model').textContent.startsWith({model!r})")
            page.select_option("#mode", mode)
            page.fill("#max_tokens", str(max_tokens))
            yield page
        finally:
            browser.close()


def test_playground_streams_a_reply(serve):
    """Loading / shows the model id; sending a prompt streams a reply into the page (more than one
    update seen), then TTFT, tokens/s and the KV figures are filled in."""
    live = serve(tiny_llm())
    # 160 tokens: long enough that the page renders some of them before the last arrives even when
    # the machine is busy (40 from this tiny model once reached the page as one update under CI's load)
    with playground(live.url, "lite-tiny", "completion", 160) as page:
        page.fill("#prompt", "The pass key is 52718. The pass key is")
        # Record every length the reply takes while it streams.
        page.evaluate(
            """() => { window.lengths = [];
            new MutationObserver(() => {
              const b = document.querySelectorAll('.msg.assistant .body');
              if (b.length) window.lengths.push(b[b.length - 1].textContent.length);
            }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true}); }"""
        )
        page.click("#send")
        page.wait_for_selector(".msg.assistant[data-done='true']", timeout=60_000)
        lengths = page.evaluate("window.lengths")
        assert len(set(lengths)) > 2, lengths  # the text grew in steps: streamed, not all at once
        assert page.inner_text("#finish") == "length"
        assert page.inner_text("#ntok") == "160"
        assert page.inner_text("#ttft").endswith(" ms") and float(page.inner_text("#tps")) > 0
        page.wait_for_function("document.getElementById('kv').textContent.includes('/')")
        assert "healthy" in page.inner_text("#health")
