"""Screenshot of the playground (docs/img/playground.png) serving the shipped demo model.

Starts the server in-process on a free loopback port, drives headless Chromium (Playwright with
Debian's chromium) through two passkey completions (the second shows a prefix-cache hit), and saves
the page. Needs the test extras and a Chromium:

    python benchmarks/playground_screenshot.py [--out docs/img/playground.png] [--chromium /usr/bin/chromium]
"""

from __future__ import annotations

import argparse
import shutil
import time

import torch
from playwright.sync_api import sync_playwright

from gptoss_lite.checkpoint import default_model_source
from gptoss_lite.engine import LLM
from gptoss_lite.server import create_app
from gptoss_lite.server.background import BackgroundServer

PROMPT = (
    "The grass is green. The sky is blue. The pass key is 52718. Remember it. 52718 is the pass key. "
    "The sun is yellow. Here we go. What is the pass key? The pass key is"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/img/playground.png")
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    with BackgroundServer(create_app(LLM(default_model_source()))) as live, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1200, "height": 720})
        page.goto(live.url + "/")
        page.wait_for_function("document.getElementById('model').textContent.includes('context')")
        page.select_option("#mode", "completion")
        page.fill("#max_tokens", "8")
        for _ in range(2):
            page.fill("#prompt", PROMPT)
            page.click("#send")
            page.wait_for_function("!document.getElementById('send').disabled")
        time.sleep(1.2)  # one more poll of the live server figures
        reply = page.locator(".msg.assistant .body").last.inner_text()
        page.screenshot(path=args.out)
        print(f"reply {reply!r}; TTFT {page.inner_text('#ttft')}; cached {page.inner_text('#cached')}")
        print(f"wrote {args.out}")
        browser.close()


if __name__ == "__main__":
    main()
