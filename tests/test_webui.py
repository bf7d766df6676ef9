"""The chat page, driven in a real headless Chromium (Playwright) against `turbospark serve`.

Chromium is Debian's `chromium` package (Playwright's own browser builds are never downloaded):
the browser tests skip, with the reason, where it is not installed; CI installs it and sets
TURBOSPARK_REQUIRE_CHROMIUM, so there they fail instead. The scripted backend (a reply file,
decoded at a capped rate so a stream lasts long enough to watch and stop) proves the page's
behaviour; SmolLM2 proves it on a real model.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from turbospark.testing import ServerProcess

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
WAIT_MS = 60_000  # an upper bound for a page event on a loaded machine, not a timing assertion

THINK_REPLY = 'Hello **there**! A code block:\n\n```python\nprint("hi")\n```\n'
HOSTILE_REPLY = (
    "Look: <script>alert(1)</script> and <img src=/x-onerror onerror=alert(2)> and "
    "![pic](/x-markdown-image.png) and [link](javascript:alert(3)) end."
)


def chromium_path() -> str | None:
    for candidate in ("chromium", "chromium-browser"):
        found = shutil.which(candidate)
        if found:
            return found
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    executable = chromium_path()
    missing = None
    if executable is None:
        missing = "Debian's chromium is not installed (apt-get install chromium)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            missing = "playwright is not installed (pip install -e '.[test]')"
    if missing:
        if os.environ.get("TURBOSPARK_REQUIRE_CHROMIUM"):
            pytest.fail(f"TURBOSPARK_REQUIRE_CHROMIUM is set but {missing}")
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        chromium = driver.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context()
    context.set_default_timeout(WAIT_MS)
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.errors = errors
    try:
        yield tab
    finally:
        context.close()
    assert not errors, f"the page threw: {errors}"


def scripted(
    tmp_path: Path, *replies: str, rate: float | None = None, args: tuple[str, ...] = ()
) -> ServerProcess:
    script = tmp_path / "replies.txt"
    script.write_text("\n---\n".join(replies), encoding="utf-8")
    extra = ("--max-decode-rate", str(rate)) if rate else ()
    return ServerProcess("--model", f"scripted:{script}", *extra, *args)


def open_page(page: Any, url: str) -> None:
    page.goto(url + "/")
    page.wait_for_selector("body[data-models='loaded']")


def send(page: Any, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def wait_idle(page: Any) -> None:
    page.wait_for_selector("body[data-state='idle'] .msg.assistant", state="attached")


def running_sequences(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "turbospark_running_sequences":
                return float(sample.value)
    raise AssertionError("turbospark_running_sequences missing from /metrics")


def tiny_png() -> bytes:
    """A 1x1 white PNG."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0\xff\xff\xff"))
        + chunk(b"IEND", b"")
    )


def poll(condition: Callable[[], bool], what: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.05)


# ---- without a browser ------------------------------------------------------------------


def test_root_serves_the_page_to_browsers_and_ollamas_answer_to_everyone_else(tmp_path: Path) -> None:
    with scripted(tmp_path, "ok") as server:
        probe = httpx.get(server.url + "/")
        assert probe.status_code == 200 and probe.text == "Ollama is running"
        head = httpx.head(server.url + "/")
        assert head.status_code == 200 and head.content == b""
        browser_get = httpx.get(server.url + "/", headers={"Accept": "text/html,*/*;q=0.8"})
        chat = httpx.get(server.url + "/chat")
        for reply in (browser_get, chat):
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("text/html")
            csp = reply.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe" not in csp
            assert reply.headers["x-content-type-options"] == "nosniff"
            assert '<script src="/webui/app.js"' in reply.text
            assert "<script>" not in reply.text  # no inline script: the CSP would refuse it
        assert (
            httpx.get(server.url + "/webui/vendor/markdown-it.min.js")
            .headers["content-type"]
            .startswith("text/javascript")
        )
        assert "MIT" in httpx.get(server.url + "/webui/vendor/LICENSES.txt").text
        assert httpx.get(server.url + "/webui/../server.py").status_code == 404
        assert httpx.get(server.url + "/webui/nope.js").status_code == 404


def test_no_webui_turns_the_page_off(tmp_path: Path) -> None:
    with scripted(tmp_path, "ok", args=("--no-webui",)) as server:
        assert httpx.get(server.url + "/chat").status_code == 404
        root = httpx.get(server.url + "/", headers={"Accept": "text/html"})
        assert root.status_code == 200 and root.text == "Ollama is running"
        assert httpx.get(server.url + "/webui/app.js").status_code == 404


# ---- in the browser ---------------------------------------------------------------------


def test_a_streamed_reply_with_markdown_folded_reasoning_and_usage(
    page: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    reply = "<think>The user greets me.</think>" + THINK_REPLY
    with scripted(tmp_path, reply, rate=60) as server:
        open_page(page, server.url)
        assert page.locator("#model option").all_inner_texts()[0] == "scripted"
        send(page, "Hi there")
        answer = page.locator(".msg.assistant .content").last
        # streamed: part of the answer is on the page while the reply is still running
        page.wait_for_function(
            "() => document.body.dataset.state === 'streaming' &&"
            " document.querySelector('.msg.assistant .content').textContent.includes('Hello')"
        )
        assert "print" not in answer.inner_text()
        wait_idle(page)
        assert answer.locator("strong").inner_text() == "there"
        code = answer.locator("div.code")
        assert code.locator("pre code").inner_text().strip() == 'print("hi")'
        assert code.locator("button.copy").is_visible()
        reasoning = page.locator(".msg.assistant details.reasoning")
        assert reasoning.get_attribute("open") is None  # folded
        assert "The user greets me." in reasoning.locator(".reasoning-body").text_content()
        assert "greets" not in answer.inner_text()  # apart from the answer
        assert not reasoning.locator(".reasoning-body").is_visible()
        reasoning.locator("summary").click()
        assert reasoning.locator(".reasoning-body").is_visible()
        stats = page.locator(".msg.assistant .stats").inner_text()
        assert "tokens/s" in stats and "prompt tokens cached" in stats
        artifact = tmp_path / "webui.png"
        page.screenshot(path=str(artifact))
        assert artifact.stat().st_size > 0


def test_stop_mid_stream_frees_the_sequence(page: Any, tmp_path: Path) -> None:
    long_reply = " ".join(f"word{i}" for i in range(2000))
    with scripted(tmp_path, long_reply, rate=30) as server:
        open_page(page, server.url)
        send(page, "Tell me everything")
        page.wait_for_function(
            "() => document.querySelector('.msg.assistant .content').textContent.length > 10"
        )
        assert running_sequences(server.url) == 1
        page.click("#stop")
        wait_idle(page)
        poll(lambda: running_sequences(server.url) == 0, "the server's running sequences drop to 0")
        assert "stopped" in page.locator(".msg.assistant .stats").inner_text()
        shown = page.locator(".msg.assistant .content").inner_text()
        assert shown.startswith("word0 word1") and "word1999" not in shown
        assert page.locator("#send").is_visible() and not page.locator("#stop").is_visible()


def test_conversations_survive_a_reload_and_can_be_renamed_exported_and_deleted(
    page: Any, tmp_path: Path
) -> None:
    with scripted(tmp_path, "First answer.", "Second answer.") as server:
        open_page(page, server.url)
        send(page, "Remember me")
        wait_idle(page)
        page.click("#new-chat")
        send(page, "Another chat")
        wait_idle(page)
        page.reload()
        page.wait_for_selector("body[data-models='loaded']")
        titles = page.locator("#conversations .open").all_inner_texts()
        assert titles == ["Another chat", "Remember me"]
        page.locator("#conversations .open", has_text="Remember me").click()
        assert page.locator(".msg.user .content").inner_text() == "Remember me"
        assert page.locator(".msg.assistant .content").inner_text() == "First answer."
        page.locator("#conversations li.current .rename").click()
        page.fill(".rename-input", "Renamed")
        page.press(".rename-input", "Enter")
        with page.expect_download() as download:
            page.click("#export")
        exported = Path(download.value.path()).read_text(encoding="utf-8")
        assert '"title": "Renamed"' in exported and "First answer." in exported
        page.reload()
        page.wait_for_selector("body[data-models='loaded']")
        assert page.locator("#conversations .open").all_inner_texts() == ["Another chat", "Renamed"]
        page.locator("#conversations li", has_text="Another chat").locator(".delete").click()
        assert page.locator("#conversations .open").all_inner_texts() == ["Renamed"]
        page.reload()
        page.wait_for_selector("body[data-models='loaded']")
        assert page.locator("#conversations .open").all_inner_texts() == ["Renamed"]


def test_regenerate_and_edit_resend(page: Any, tmp_path: Path) -> None:
    with scripted(tmp_path, "one", "two", "three") as server:
        open_page(page, server.url)
        send(page, "Count")
        wait_idle(page)
        assert page.locator(".msg.assistant .content").inner_text() == "one"
        page.click(".msg.assistant .regenerate")
        wait_idle(page)
        assert page.locator(".msg.assistant .content").all_inner_texts() == ["two"]
        page.click(".msg.user .edit")
        page.fill(".edit-input", "Count again")
        page.click(".resend")
        wait_idle(page)
        assert page.locator(".msg.user .content").all_inner_texts() == ["Count again"]
        assert page.locator(".msg.assistant .content").all_inner_texts() == ["three"]


def test_system_prompt_temperature_and_max_tokens_reach_the_request(page: Any, tmp_path: Path) -> None:
    with scripted(tmp_path, "A reply that is longer than five tokens.") as server:
        open_page(page, server.url)
        page.click("#settings summary")
        page.fill("#system", "You are terse.")
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "5")
        with page.expect_request("**/v1/chat/completions") as sent:
            send(page, "Hi")
        body = sent.value.post_data_json
        assert body["messages"][0] == {"role": "system", "content": "You are terse."}
        assert body["temperature"] == 0 and body["max_tokens"] == 5 and body["stream"] is True
        wait_idle(page)
        assert page.locator(".msg.assistant .content").inner_text() == "A rep"
        assert "cut at max tokens" in page.locator(".msg.assistant .stats").inner_text()


def test_model_html_renders_as_text(page: Any, tmp_path: Path) -> None:
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    with scripted(tmp_path, HOSTILE_REPLY) as server:
        open_page(page, server.url)
        send(page, "Say something nasty")
        wait_idle(page)
        answer = page.locator(".msg.assistant .content")
        text = answer.inner_text()
        assert "<script>alert(1)</script>" in text
        assert "<img src=/x-onerror onerror=alert(2)>" in text
        assert "[link](javascript:alert(3))" in text  # an unsafe link stays text
        # a Markdown picture is a link to it, never loaded
        assert (
            answer.locator("a[href='/x-markdown-image.png'][rel='noopener noreferrer']").inner_text() == "pic"
        )
        assert answer.locator("script, img, iframe").count() == 0
        assert answer.locator("a[href^='javascript']").count() == 0
        page.wait_for_timeout(300)  # give a stray image load or handler its chance to show up
    assert dialogs == []
    assert not [u for u in requests if "/x-" in u], requests


def test_a_key_protected_server_asks_for_the_key(page: Any, tmp_path: Path) -> None:
    with scripted(tmp_path, "Welcome in.", args=("--api-key", "sesame")) as server:
        page.goto(server.url + "/")
        page.wait_for_selector("#key-panel:not([hidden])")
        assert "401" in page.locator("#key-message").inner_text()
        page.fill("#api-key", "wrong")
        page.click("#key-form button")
        page.wait_for_function("() => document.getElementById('key-message').textContent.includes('invalid')")
        assert page.locator("#key-panel").is_visible()
        page.fill("#api-key", "sesame")
        page.click("#key-form button")
        page.wait_for_selector("body[data-models='loaded']")
        assert page.locator("#key-panel").is_hidden()
        send(page, "Hello")
        wait_idle(page)
        assert page.locator(".msg.assistant .content").inner_text() == "Welcome in."
        assert page.evaluate("() => sessionStorage.getItem('turbospark.apiKey')") == "sesame"
        stored = page.evaluate("() => JSON.stringify(Object.assign({}, localStorage))")
        assert "sesame" not in stored
        # a key that stops working mid-session shows the 401 as such
        page.evaluate("() => sessionStorage.setItem('turbospark.apiKey', 'revoked')")
        send(page, "Again")
        wait_idle(page)
        assert page.locator(".msg.assistant .error").last.inner_text().startswith("401 Unauthorized")
        assert page.locator("#key-panel").is_visible()


def test_an_image_for_a_model_without_vision_shows_the_servers_refusal(page: Any, tmp_path: Path) -> None:
    png = tmp_path / "dot.png"
    png.write_bytes(tiny_png())
    with scripted(tmp_path, "never") as server:
        open_page(page, server.url)
        page.wait_for_function("() => document.getElementById('vision-hint').textContent !== ''")
        assert "no vision" in page.locator("#vision-hint").inner_text()
        page.set_input_files("#attach", str(png))
        # the page reads the file asynchronously (FileReader): wait for its preview to appear
        page.locator("#attachments img").first.wait_for(state="attached", timeout=10_000)
        assert page.locator("#attachments img").count() == 1
        send(page, "What is in this picture?")
        wait_idle(page)
        error = page.locator(".msg.assistant .error").inner_text()
        assert error.startswith("Error 400") and "image" in error, error
        assert page.locator(".msg.user .images img").count() == 1


@pytest.mark.slow
def test_smollm2_streams_and_stops(page: Any, tmp_path: Path) -> None:
    with ServerProcess("--model", "smollm2") as server:
        open_page(page, server.url)
        page.click("#settings summary")
        page.fill("#temperature", "0")  # greedy: the answer test_real_serve pins
        page.fill("#max-tokens", "24")
        send(page, "What is the capital of France? Answer in one word.")
        wait_idle(page)
        assert "Paris" in page.locator(".msg.assistant .content").inner_text()
        assert "tokens/s" in page.locator(".msg.assistant .stats").inner_text()
        page.fill("#max-tokens", "400")
        send(page, "Write a long story about a dragon who learns to cook.")
        page.wait_for_function(
            "() => [...document.querySelectorAll('.msg.assistant .content')].at(-1).textContent.length > 20"
        )
        assert running_sequences(server.url) == 1
        page.click("#stop")
        wait_idle(page)
        poll(lambda: running_sequences(server.url) == 0, "the server's running sequences drop to 0")
        assert "stopped" in page.locator(".msg.assistant .stats").last.inner_text()


def test_tool_calls_show_as_calls(page: Any, tmp_path: Path) -> None:
    # The page declares no tools; this test adds one to the page's own request on its way out,
    # so the real server parses the scripted model's call and streams it as a tool call.
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }

    def add_tool(route: Any) -> None:
        body = route.request.post_data_json
        route.continue_(post_data=json.dumps({**body, "tools": [tool]}))

    page.route("**/v1/chat/completions", add_tool)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    with scripted(tmp_path, "Checking. " + call) as server:
        open_page(page, server.url)
        send(page, "Weather in Paris?")
        wait_idle(page)
        shown = page.locator(".msg.assistant .tool-call")
        assert shown.locator(".tool-name").inner_text() == "get_weather"
        assert json.loads(shown.locator(".tool-args").inner_text()) == {"city": "Paris"}
        assert "tool_call" not in page.locator(".msg.assistant .content").inner_text()
