"""Browser tests of the built-in chat UI (``xinfer --ui-server``).

They start ``python -m xinfer.server --ui-server --port P`` on the default model
(API on P, UI on P+1), open the page in Debian's Chromium through Playwright and
chat with the real model. Tests about how the page renders untrusted output or
error states replace the ``/v1/chat/completions`` answer with ``page.route``, so
they are deterministic.

Needs: ``pip install playwright`` (the wheel ships the driver; no ``playwright
install``) and ``apt-get install chromium`` (``/usr/bin/chromium``).

Environment:
  XINFER_CHROMIUM                 browser binary (default /usr/bin/chromium)
  XINFER_UI_TEST_URL              use a UI server that is already running
                                  (e.g. http://127.0.0.1:8001/) instead of starting one
  XINFER_UI_TEST_API_URL          its API server, if not the same origin
  XINFER_UI_TEST_SERVER_ARGS      extra flags for the server (e.g. "--m /path/to/model")
  XINFER_UI_TEST_STARTUP_TIMEOUT  seconds to wait for /health (default 300)
  XINFER_UI_UPDATE_SCREENSHOT=1   also copy the screenshot over docs/ui.png
                                  (it is copied anyway when docs/ui.png is missing)
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
expect = sync_api.expect

# The Prometheus gauge of requests being generated, and the counter of those the server aborted.
METRIC_RUNNING = "xinfer_num_requests_running"
METRIC_ABORTED = 'xinfer_requests_finished_total{finish_reason="abort"}'
# How long to wait for the server to drop the request after Stop: only a bound on the wait (the
# abort counter, not the time, tells an abort from a reply that ran to its end), generous for a busy CPU.
STOP_WAIT_S = 60.0

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "test-output" / "ui"
DOCS_SCREENSHOT = REPO / "docs" / "ui.png"
CHROMIUM = os.environ.get("XINFER_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
STARTUP_TIMEOUT_S = float(os.environ.get("XINFER_UI_TEST_STARTUP_TIMEOUT", "300"))
REPLY_TIMEOUT_MS = 180_000
SETTINGS_KEY = "xinfer.ui.settings.v1"
FRANCE = "What is the capital of France? Answer in one sentence."


# --------------------------------------------------------------- helpers ---


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


def _free_port_pair() -> int:
    """A port P such that P and P+1 are both free (API on P, UI on P+1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free pair of ports")


def _tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class Server:
    def __init__(self, ui: str, api: str):
        self.ui = ui.rstrip("/") + "/"
        self.api = api.rstrip("/") + "/"

    def metrics(self) -> str:
        last = None
        for base in dict.fromkeys([self.ui, self.api]):
            status, body = _get(base + "metrics")
            if status == 200:
                return body
            last = status
        raise AssertionError(f"/metrics answered {last}")

    def running(self) -> float | None:
        """The value of METRIC_RUNNING (summed over label sets), or None if absent."""
        total = None
        pat = re.compile(rf"^{re.escape(METRIC_RUNNING)}(\{{[^}}]*\}})?\s+(\S+)")
        for line in self.metrics().splitlines():
            m = pat.match(line)
            if m:
                total = (total or 0.0) + float(m.group(2))
        return total

    def aborted(self) -> float:
        """The value of METRIC_ABORTED (0 before the first abort)."""
        prefix = METRIC_ABORTED + " "
        return sum(float(line[len(prefix) :]) for line in self.metrics().splitlines() if line.startswith(prefix))


@pytest.fixture(scope="module")
def server():
    url = os.environ.get("XINFER_UI_TEST_URL")
    if url:
        yield Server(url, os.environ.get("XINFER_UI_TEST_API_URL", url))
        return
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    port = _free_port_pair()
    log_path = OUT_DIR / "server.log"
    log = open(log_path, "w")  # noqa: SIM115 - the server writes it until the fixture ends
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "xinfer.server", "--ui-server", "--port", str(port)]
    cmd += shlex.split(os.environ.get("XINFER_UI_TEST_SERVER_ARGS", ""))
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    srv = Server(f"http://127.0.0.1:{port + 1}/", f"http://127.0.0.1:{port}/")
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}:\n{_tail(log_path)}")
            try:
                ok = _get(srv.api + "health", 2)[0] == 200 and _get(srv.ui, 2)[0] == 200
            except OSError:
                ok = False
            if ok:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S:.0f} s:\n{_tail(log_path)}")
            time.sleep(0.5)
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        msg = f"{CHROMIUM} not found: apt-get install -y chromium"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@contextlib.contextmanager
def _open_page(server, browser, settings: dict | None):
    """The page in a fresh browser profile (empty localStorage), with `settings` saved unless None."""
    context = browser.new_context(viewport={"width": 1280, "height": 860}, color_scheme="light", accept_downloads=True)
    if settings is not None:
        # Only seeds settings when none are saved, so reloads keep what a test changed.
        context.add_init_script(
            f"if (!localStorage.getItem({SETTINGS_KEY!r})) localStorage.setItem({SETTINGS_KEY!r}, "
            + json.dumps(json.dumps(settings))
            + ");"
        )
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(server.ui)
    _wait_ready(pg)
    yield pg
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


@pytest.fixture
def page(server, browser):
    """A fresh browser profile (empty localStorage) with greedy, short replies by default."""
    with _open_page(server, browser, {"temperature": 0, "topP": 1, "maxTokens": 64}) as pg:
        yield pg


@pytest.fixture
def bare_page(server, browser):
    """A fresh browser profile with the page's own default settings."""
    with _open_page(server, browser, None) as pg:
        yield pg


def _wait_ready(pg) -> None:
    pg.wait_for_selector("html[data-ready='true']")
    # The header shows the model once /v1/models has listed it.
    pg.wait_for_selector("#model-name[data-model]", state="attached", timeout=30_000)


def _send(pg, text: str) -> None:
    pg.fill("#input", text)
    pg.press("#input", "Enter")


def _last_reply(pg):
    return pg.locator(".msg.assistant").last


def _wait_reply_done(pg, timeout: float = REPLY_TIMEOUT_MS) -> None:
    pg.wait_for_function(
        "() => { const m = [...document.querySelectorAll('.msg.assistant')].pop();"
        " return m && !m.classList.contains('streaming') }",
        timeout=timeout,
    )


def _sse(chunks: list[dict], usage: dict | None = None) -> str:
    base = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0, "model": "test"}
    events = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}]
    for delta in chunks:
        events.append({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    if usage:
        events.append({**base, "choices": [], "usage": usage})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def _answer_json(page, url: str, status: int, body: str) -> None:
    """Requests to ``url`` answered ``status`` with the JSON ``body``, not by the server."""
    page.route(url, lambda route: route.fulfill(status=status, content_type="application/json", body=body))


def _fulfill_sse(route, body: str) -> None:
    route.fulfill(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}, body=body)


def _mock_replies(pg, replies: list[str]) -> list[dict]:
    """Answer the next chat requests with `replies` (the last one repeats); returns the request bodies."""
    bodies: list[dict] = []

    def handle(route):
        bodies.append(json.loads(route.request.post_data or "{}"))
        text = replies[min(len(bodies) - 1, len(replies) - 1)]
        pieces = [{"content": text[i : i + 5]} for i in range(0, len(text), 5)]
        _fulfill_sse(
            route,
            _sse(pieces, {"prompt_tokens": 10, "completion_tokens": len(pieces), "total_tokens": 10 + len(pieces)}),
        )

    pg.route("**/v1/chat/completions", handle)
    return bodies


# Chat requests answered by streams the test feeds, for states a fulfilled route cannot
# reach (a reply still streaming, a connection cut mid-reply): window.__push(i, text),
# __end(i) (finish_reason and [DONE]), __cut(i) (a network error); __streams[i].request
# is the i-th request's body. Other requests go to the server. (Wait on the page with
# functions, "() => ...": a bare expression is polled through eval, which the page's CSP refuses.)
HELD_STREAMS = """() => {
  const realFetch = window.fetch;
  const encode = (text) => new TextEncoder().encode(text);
  window.__streams = [];
  window.fetch = (url, init) => {
    if (!String(url).includes('chat/completions')) return realFetch(url, init);
    let controller;
    const body = new ReadableStream({ start(c) { controller = c; } });
    init.signal.addEventListener('abort', () => controller.error(new DOMException('aborted', 'AbortError')));
    window.__streams.push({ controller, request: JSON.parse(init.body) });
    return Promise.resolve(new Response(body, { headers: { 'Content-Type': 'text/event-stream' } }));
  };
  const send = (i, chunk) => window.__streams[i].controller.enqueue(encode(`data: ${JSON.stringify(chunk)}\\n\\n`));
  window.__push = (i, text) => send(i, { choices: [{ index: 0, delta: { content: text }, finish_reason: null }] });
  window.__end = (i) => {
    send(i, { choices: [{ index: 0, delta: {}, finish_reason: 'stop' }] });
    window.__streams[i].controller.enqueue(encode('data: [DONE]\\n\\n'));
    window.__streams[i].controller.close();
  };
  window.__cut = (i) => window.__streams[i].controller.error(new TypeError('network error'));
}"""


# ----------------------------------------------------------------- tests ---


@pytest.mark.timeout(600)
def test_a_reply_renders_as_it_streams(page):
    """The page draws a streaming reply once an animation frame: a reply of some 60 tokens is seen at
    several lengths before it is done (a one-sentence one can arrive within a frame on a loaded machine)."""
    page.evaluate(
        """() => {
          window.__seen = [];
          new MutationObserver(() => {
            const m = document.querySelector('.msg.assistant.streaming .msg-content');
            if (m) window.__seen.push(m.textContent.length);
          }).observe(document.querySelector('#messages'), {subtree: true, childList: true, characterData: true});
        }"""
    )
    _send(page, "Count from 1 to 40, separated by commas.")
    _wait_reply_done(page)
    seen = [n for n in page.evaluate("window.__seen") if n > 0]
    final = len(_last_reply(page).locator(".msg-content").inner_text())
    assert len(set(seen)) >= 3 and min(seen) < final, f"the reply did not stream in (rendered lengths: {seen})"


def test_chat_reply_with_stats(page):
    header = page.locator("#model-ctx")
    assert header.is_visible(), "the header should show the model's max context"
    assert re.search(r"\d+(\.\d+)?K? context", header.inner_text()), header.inner_text()

    _send(page, FRANCE)
    _wait_reply_done(page)
    reply = _last_reply(page)
    text = reply.locator(".msg-content").inner_text()
    assert "Paris" in text, text

    tps = reply.locator(".stat-tps").inner_text()
    assert re.fullmatch(r"\d+(\.\d+)? tok/s", tps), tps
    assert re.fullmatch(r"TTFT \d+(\.\d+)? m?s", reply.locator(".stat-ttft").inner_text())
    assert re.fullmatch(r"[\d,]+ in", reply.locator(".stat-in").inner_text())
    assert re.fullmatch(r"[\d,]+ out", reply.locator(".stat-out").inner_text())
    assert re.fullmatch(r"[\d,]+ cached", reply.locator(".stat-cached").inner_text())

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    shot = OUT_DIR / "chat.png"
    page.screenshot(path=str(shot))
    if os.environ.get("XINFER_UI_UPDATE_SCREENSHOT") == "1" or not DOCS_SCREENSHOT.exists():
        DOCS_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, DOCS_SCREENSHOT)


@pytest.mark.timeout(600)
def test_stop_aborts_generation(page, server):
    # A long reply: raise max tokens through the settings dialog.
    page.click("#open-settings")
    page.fill("#set-max-tokens", "2048")
    page.click("#settings .settings-foot .primary")
    assert json.loads(page.evaluate(f"localStorage.getItem({SETTINGS_KEY!r})"))["maxTokens"] == 2048

    _send(page, "Write a 500-word story about a lighthouse keeper.")
    content = _last_reply(page).locator(".msg-content")
    page.wait_for_function(
        "() => { const m = document.querySelector('.msg.assistant.streaming .msg-content');"
        " return m && m.textContent.length > 40 }",
        timeout=REPLY_TIMEOUT_MS,
    )
    running = server.running()
    assert running is not None, f"{METRIC_RUNNING} is not in /metrics:\n" + "\n".join(
        line for line in server.metrics().splitlines() if "running" in line
    )
    assert running >= 1, f"{METRIC_RUNNING} is {running} while a reply streams"

    assert re.fullmatch(r"~[\d.]+ tok/s", _last_reply(page).locator(".stat-tps").inner_text())  # live speed
    assert re.fullmatch(r"~[\d,]+ out", _last_reply(page).locator(".stat-out").inner_text())  # counted live too
    aborted = server.aborted()
    page.click("#stop")
    deadline = time.monotonic() + STOP_WAIT_S
    while (value := server.running()) != 0:
        assert time.monotonic() < deadline, f"{METRIC_RUNNING} still {value} {STOP_WAIT_S:.0f} s after Stop"
        time.sleep(0.05)
    assert server.aborted() == aborted + 1  # dropped by the server, not run to its end

    # The page stopped too: no streaming message, Send is back, the reply is marked.
    assert page.locator(".msg.assistant.streaming").count() == 0
    assert page.locator("#stop").is_hidden()
    assert page.locator("#send").is_visible()
    assert _last_reply(page).locator(".stat-stopped").is_visible()
    before = content.inner_text()
    assert len(before) > 40
    page.wait_for_timeout(1000)
    assert content.inner_text() == before, "text kept arriving after Stop"


@pytest.mark.timeout(600)
def test_conversation_survives_reload(page):
    _send(page, FRANCE)
    _wait_reply_done(page)
    reply = _last_reply(page).locator(".msg-content").inner_text()
    assert reply.strip()

    page.reload()
    _wait_ready(page)
    item = page.locator(".conv-item", has_text="What is the capital of France")
    assert item.count() == 1
    # Leave it, then open it again from the list.
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0
    item.locator(".conv-open").click()
    assert page.locator(".msg.user .bubble").inner_text() == FRANCE
    assert _last_reply(page).locator(".msg-content").inner_text() == reply
    assert _last_reply(page).locator(".stat-tps").is_visible()


@pytest.mark.timeout(120)
def test_conversations_stream_on_their_own_and_a_cut_reply_keeps_its_text(page):
    # On a phone the header gives the model's whole name the room (the context size yields).
    page.set_viewport_size({"width": 375, "height": 740})
    name = page.locator("#model-name")
    assert name.is_visible()
    assert name.evaluate("el => el.scrollWidth <= el.clientWidth"), "the model's name is cut on a phone"
    page.set_viewport_size({"width": 1280, "height": 860})

    page.evaluate(HELD_STREAMS)
    reply = _last_reply(page).locator(".msg-content")
    # Enter that picks an input method's candidate does not send (isComposing, or
    # Safari's keyCode 229 after compositionend).
    page.fill("#input", "First chat")
    for flags in ("isComposing: true", "keyCode: 229"):
        page.eval_on_selector(
            "#input",
            f"t => t.dispatchEvent(new KeyboardEvent('keydown', {{key: 'Enter', {flags}, bubbles: true, cancelable: true}}))",
        )
    assert page.locator(".msg").count() == 0
    page.press("#input", "Enter")
    page.wait_for_function("() => window.__streams.length === 1")
    page.evaluate("window.__push(0, 'Hello')")
    expect(reply).to_have_text("Hello")

    # Another conversation can be opened and sent to while the first one streams.
    page.click("#new-chat")
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#stop")).to_be_hidden()
    expect(page.locator(".conv-item.streaming")).to_have_text("First chat")
    _send(page, "Second chat")
    page.wait_for_function("() => window.__streams.length === 2")
    page.evaluate("window.__push(1, 'Two.'); window.__end(1)")
    _wait_reply_done(page, 10_000)
    expect(reply).to_have_text("Two.")
    expect(page.locator(".conv-item.streaming")).to_have_text("First chat")

    # A conversation another tab saves meanwhile shows here, and this tab's saves keep it.
    other = page.context.new_page()
    other.goto(page.url)
    _wait_ready(other)
    _mock_replies(other, ["From the other tab."])
    other.click("#new-chat")
    _send(other, "Other tab")
    _wait_reply_done(other, 10_000)
    other.close()
    expect(page.locator(".conv-item", has_text="Other tab")).to_have_count(1)

    # Back in the first one it still streams; a network drop keeps the text and says so.
    page.locator(".conv-item", has_text="First chat").locator(".conv-open").click()
    expect(page.locator("#stop")).to_be_visible()
    page.evaluate("window.__push(0, ' world')")
    expect(reply).to_have_text("Hello world")
    page.evaluate("window.__cut(0)")
    error = _last_reply(page).locator(".msg-error")
    expect(error).to_contain_text("The reply was interrupted")
    expect(reply).to_have_text("Hello world")
    expect(page.locator(".conv-item.streaming")).to_have_count(0)
    expect(page.locator("#send")).to_be_visible()

    # Retry asks again (the cut reply is not sent back); a reload mid-reply keeps what came.
    error.locator("button", has_text="Retry").click()
    page.wait_for_function("() => window.__streams.length === 3")
    assert page.evaluate("window.__streams[2].request.messages") == [{"role": "user", "content": "First chat"}]
    page.evaluate("window.__push(2, 'Again')")
    expect(reply).to_have_text("Again")
    page.reload()
    _wait_ready(page)
    expect(reply).to_have_text("Again")
    expect(_last_reply(page).locator(".stat-stopped")).to_be_visible()
    expect(_last_reply(page).locator(".msg-error")).to_be_hidden()
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator(".conv-item")).to_have_count(3)

    # The reply follows the stream to the bottom until the user scrolls up; the jump
    # button brings it back. Escape stops it, and the next message sends the stopped text.
    page.evaluate(HELD_STREAMS)
    _send(page, "Count")
    page.wait_for_function("() => window.__streams.length === 1")
    gap = "(() => { const s = document.querySelector('#scroller'); return s.scrollHeight - s.scrollTop - s.clientHeight })()"
    page.evaluate("for (let i = 1; i <= 60; i++) window.__push(0, `${i}\\n\\n`)")
    expect(reply).to_contain_text("60")
    page.wait_for_function(f"() => {gap} < 5")
    page.mouse.move(640, 400)
    page.mouse.wheel(0, -600)
    page.wait_for_function(f"() => {gap} > 500")
    page.evaluate("for (let i = 61; i <= 80; i++) window.__push(0, `${i}\\n\\n`)")
    expect(reply).to_contain_text("80")
    assert page.evaluate(f"() => {gap}") > 500, "the page scrolled down while the user read above"
    expect(page.locator("#jump")).to_be_visible()
    page.click("#jump")
    page.wait_for_function(f"() => {gap} < 5")
    page.evaluate("window.__push(0, '81 and more')")
    expect(reply).to_contain_text("81 and more")
    page.wait_for_function(f"() => {gap} < 5")
    page.press("#input", "Escape")
    expect(_last_reply(page).locator(".stat-stopped")).to_be_visible()
    _send(page, "Next")
    page.wait_for_function("() => window.__streams.length === 2")
    sent = page.evaluate("window.__streams[1].request.messages")
    assert [m["role"] for m in sent] == ["user", "assistant", "user", "assistant", "user"], sent
    assert sent[-2]["content"].endswith("81 and more") and sent[-1]["content"] == "Next"
    page.evaluate("window.__push(1, 'Done.'); window.__end(1)")
    expect(reply).to_have_text("Done.")


@pytest.mark.timeout(120)
def test_untrusted_markdown_is_shown_as_text(page, server):
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    origin = "/".join(server.ui.split("/")[:3]) + "/"
    outside: list[str] = []

    def on_request(r):
        if not r.url.startswith((origin, "data:", "blob:")):
            outside.append(r.url)

    page.on("request", on_request)

    evil = (
        'Look: <img src=x onerror="window.__xss=1;alert(1)"> here.\n\n'
        "<script>window.__xss=2;alert(2)</script>\n\n"
        "**Bold** and [bad link](javascript:window.__xss=3) and [good link](https://example.com/a) "
        'and ![pic](https://example.invalid/pic.png) and <a href="javascript:alert(4)">raw</a>\n\n'
        '<iframe src="javascript:alert(5)"></iframe> <b onmouseover=alert(6)>hover</b>\n\n'
        "```html\n<script>window.__xss=7</script>\n```\n\n"
        "Math as written: $a_1 * b_2 * c_3$ and \\(x_i\\), not $5 and $6.\n"
    )
    # Split so that tags also arrive across chunk boundaries.
    pieces = [{"content": evil[i : i + 7]} for i in range(0, len(evil), 7)]
    body = _sse(
        [{"reasoning_content": "<img src=y onerror=alert(8)> thinking"}] + pieces,
        {"prompt_tokens": 12, "completion_tokens": len(pieces), "total_tokens": 12 + len(pieces)},
    )
    page.route("**/v1/chat/completions", lambda route: _fulfill_sse(route, body))

    _send(page, "Show me some HTML")
    _wait_reply_done(page, 30_000)
    msg = _last_reply(page)
    content = msg.locator(".msg-content")
    text = content.inner_text()
    assert '<img src=x onerror="window.__xss=1;alert(1)">' in text
    assert "<script>window.__xss=2;alert(2)</script>" in text
    assert "<script>window.__xss=7</script>" in msg.locator(".code-block code").inner_text()
    for sel in ("img", "script", "iframe", "b", "[onerror]", "[onmouseover]", "[src]"):
        assert msg.locator(sel).count() == 0, f"{sel} element created from model output"
    assert content.locator("strong").inner_text() == "Bold"  # markdown still works
    assert content.locator(".math").all_inner_texts() == ["$a_1 * b_2 * c_3$", "\\(x_i\\)"]
    hrefs = content.locator("a").evaluate_all("els => els.map(a => a.getAttribute('href'))")
    assert hrefs and all(h.startswith(("https://", "http://")) for h in hrefs), hrefs
    assert "https://example.com/a" in hrefs
    assert "bad link" in text and not any(h.startswith("javascript") for h in hrefs)
    # Reasoning is collapsed and also text only.
    details = msg.locator("details.reasoning")
    assert details.is_visible() and details.get_attribute("open") is None
    details.locator("summary").click()
    assert "<img src=y onerror=alert(8)>" in details.inner_text()

    msg.locator("text=raw").hover()
    page.wait_for_timeout(300)
    assert page.evaluate("window.__xss") is None
    assert dialogs == []
    assert outside == [], f"the page fetched outside resources: {outside}"


@pytest.mark.timeout(120)
def test_error_states(page):
    def overflow(route):
        route.fulfill(
            status=400,
            content_type="application/json",
            body=json.dumps(
                {
                    "error": {
                        "message": "The prompt is too long: 9000 tokens, but the model's context is 8192 tokens.",
                        "type": "invalid_request_error",
                        "param": "messages",
                        "code": None,
                    }
                }
            ),
        )

    page.route("**/v1/chat/completions", overflow)
    _send(page, "A very long prompt")
    err = _last_reply(page).locator(".msg-error")
    err.wait_for()
    assert "too long for this model" in err.inner_text()
    assert "9000 tokens" in err.inner_text()
    page.unroute("**/v1/chat/completions")

    # max_tokens (64 here) leaves no room: the page offers to clear it and retry.
    bodies: list[dict] = []

    def no_room(route):
        bodies.append(json.loads(route.request.post_data or "{}"))
        if "max_tokens" in bodies[-1]:
            route.fulfill(
                status=400,
                content_type="application/json",
                body=json.dumps(
                    {
                        "error": {
                            "message": "the model's context is 8192 tokens; the prompt has 8150 and 64 more were asked for",
                            "type": "invalid_request_error",
                            "param": "max_tokens",
                            "code": "context_length_exceeded",
                        }
                    }
                ),
            )
        else:
            _fulfill_sse(route, _sse([{"content": "Short."}]))

    page.route("**/v1/chat/completions", no_room)
    _send(page, "Another long prompt")
    err = _last_reply(page).locator(".msg-error")
    err.wait_for()
    # The refused prompt stays in view but is not sent again (every request would fail on it).
    expect(page.locator(".msg.user.unsent")).to_have_count(1)
    expect(page.locator(".msg.user.unsent .unsent-note")).to_contain_text("too long")
    assert [m["content"] for m in bodies[0]["messages"]] == ["Another long prompt"], bodies[0]["messages"]
    assert '"Max tokens" does not fit' in err.inner_text()
    err.locator("button", has_text="Clear").click()
    _wait_reply_done(page, 30_000)
    assert _last_reply(page).locator(".msg-content").inner_text() == "Short."
    assert bodies[-1].get("max_tokens") is None
    assert json.loads(page.evaluate(f"localStorage.getItem({SETTINGS_KEY!r})"))["maxTokens"] is None
    page.unroute("**/v1/chat/completions")
    page.click("#new-chat")

    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=400,
            content_type="application/json",
            body=json.dumps(
                {
                    "error": {
                        "message": "top_p must be in (0, 1]",
                        "type": "invalid_request_error",
                        "param": "top_p",
                        "code": None,
                    }
                }
            ),
        ),
    )
    _send(page, "hello")
    err = _last_reply(page).locator(".msg-error")
    err.wait_for()
    assert "returned an error (400)" in err.inner_text()
    assert "top_p must be in (0, 1]" in err.inner_text()
    page.unroute("**/v1/chat/completions")

    # A stream that ends without finish_reason and [DONE] was cut: not shown as a whole reply.
    cut = "data: ".join(_sse([{"content": "Half a rep"}]).split("data: ")[:3])
    page.route("**/v1/chat/completions", lambda route: _fulfill_sse(route, cut))
    page.locator(".msg-error button", has_text="Retry").click()
    expect(_last_reply(page).locator(".msg-error")).to_contain_text("The reply was interrupted")
    expect(_last_reply(page).locator(".msg-content")).to_have_text("Half a rep")
    page.unroute("**/v1/chat/completions")
    # A proxy's HTML error page is shown as its text.
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=502, content_type="text/html", body="<html><body><h1>502 Bad Gateway</h1><hr>nginx</body></html>"
        ),
    )
    page.locator(".msg-error button", has_text="Retry").click()
    expect(_last_reply(page).locator(".err-detail")).to_have_text("502 Bad Gateway nginx")
    page.unroute("**/v1/chat/completions")

    page.route("**/v1/chat/completions", lambda route: route.abort("connectionrefused"))
    page.locator(".msg-error button", has_text="Retry").click()
    page.wait_for_function("() => document.querySelector('.msg-error')?.textContent.includes('Cannot reach')")
    assert page.locator("#status-dot.offline").count() == 1
    page.unroute("**/v1/chat/completions")
    # The page keeps polling and comes back by itself: first to a server still loading
    # its model (/health 503), then to a ready one.
    _answer_json(page, "**/health", 503, '{"status": "loading"}')
    page.wait_for_selector("#status-dot.online.loading", timeout=15_000)
    expect(page.locator("#banner")).to_contain_text("loading the model")
    page.unroute("**/health")
    page.wait_for_selector("#status-dot.online:not(.loading)", timeout=15_000)
    assert page.locator("#banner").is_hidden()
    # The failed exchange is not sent back: the request has alternating roles.
    bodies = _mock_replies(page, ["Fine."])
    _send(page, "again")
    _wait_reply_done(page, 30_000)
    roles = [m["role"] for m in bodies[0]["messages"]]
    assert roles == ["user"], roles
    assert bodies[0]["messages"][0]["content"] == "hello\n\nagain"
    page.unroute("**/v1/chat/completions")

    # An empty reply says so rather than showing nothing.
    page.route("**/v1/chat/completions", lambda route: _fulfill_sse(route, _sse([])))
    _send(page, "say nothing")
    expect(_last_reply(page).locator(".msg-empty")).to_be_visible()


@pytest.mark.timeout(120)
def test_settings_edit_regenerate_and_manage(page):
    _answer_json(page, "**/ui/config.json", 200, '{"api_key": "sk-test-123"}')
    page.reload()
    _wait_ready(page)
    auth: list[str | None] = []
    page.on(
        "request", lambda r: auth.append(r.headers.get("authorization")) if "/v1/chat/completions" in r.url else None
    )
    bodies = _mock_replies(page, ["First **answer**.", "Second answer.", "Third answer.", "Fourth.", "Fifth."])

    page.click("#open-settings")
    page.fill("#set-system", "You are terse.")
    page.fill("#set-temperature-num", "0.3")
    page.fill("#set-top-p-num", "0")  # the API takes top_p in (0, 1]: not a setting that fails every request
    assert json.loads(page.evaluate(f"localStorage.getItem({SETTINGS_KEY!r})"))["topP"] == 0.01
    page.fill("#set-top-p-num", "0.8")
    page.fill("#set-max-tokens", "100")
    # Theme: the setting, or the system's while it is "system".
    html = page.locator("html")
    page.select_option("#set-theme", "dark")
    expect(html).to_have_attribute("data-theme", "dark")
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(33, 33, 33)"
    page.select_option("#set-theme", "system")
    expect(html).to_have_attribute("data-theme", "light")
    page.emulate_media(color_scheme="dark")
    expect(html).to_have_attribute("data-theme", "dark")
    page.emulate_media(color_scheme="light")
    expect(html).to_have_attribute("data-theme", "light")
    page.click("#settings .settings-foot .primary")

    _send(page, "Hi there")
    _wait_reply_done(page, 30_000)
    b = bodies[-1]
    assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
    assert b["messages"] == [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    assert (b["temperature"], b["top_p"], b["max_tokens"]) == (0.3, 0.8, 100)
    assert b.get("model") == page.locator("#model-name").get_attribute("data-model")
    assert auth[-1] == "Bearer sk-test-123"

    # Regenerate replaces the last reply. (The previous reply is done too, so wait for
    # the new one's text rather than for "done".)
    page.click(".regen-btn")
    expect(_last_reply(page).locator(".msg-content")).to_have_text("Second answer.", timeout=30_000)
    assert page.locator(".msg.assistant").count() == 1
    assert bodies[-1]["messages"] == b["messages"]

    # Edit the last user message: the reply after it is regenerated.
    page.click(".msg.user .edit-btn")
    # The box moves its caret to the end on the next frame: a fill before that frame
    # would append to the old text instead of replacing it.
    expect(page.locator(".edit-box")).to_be_focused()
    page.fill(".edit-box", "Hello again")
    page.press(".edit-box", "Enter")
    expect(_last_reply(page).locator(".msg-content")).to_have_text("Third answer.", timeout=30_000)
    assert page.locator(".msg.user .bubble").inner_text() == "Hello again"
    assert bodies[-1]["messages"][-1] == {"role": "user", "content": "Hello again"}

    # Any user message can be edited, not only the last: the turns after it are replaced.
    _send(page, "Tell me more")
    expect(_last_reply(page).locator(".msg-content")).to_have_text("Fourth.", timeout=30_000)
    first = page.locator(".msg.user").first
    first.hover()
    first.locator(".edit-btn").click()
    expect(page.locator(".edit-box")).to_be_focused()
    page.fill(".edit-box", "Start over")
    page.press(".edit-box", "Enter")
    expect(_last_reply(page).locator(".msg-content")).to_have_text("Fifth.", timeout=30_000)
    assert page.locator(".msg.user .bubble").all_inner_texts() == ["Start over"]
    assert page.locator(".msg.assistant").count() == 1
    assert bodies[-1]["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Start over"},
    ]

    # Rename, export and delete from the sidebar.
    item = page.locator(".conv-item.active")
    item.hover()
    item.locator("button[title='Rename']").click()
    page.fill(".conv-rename", "My chat")
    page.press(".conv-rename", "Enter")
    item = page.locator(".conv-item", has_text="My chat")
    assert item.count() == 1
    expect(item.locator(".conv-open")).to_be_focused()  # keyboard focus is not dropped with the input
    item.hover()
    with page.expect_download() as dl:
        item.locator("button[title='Export as JSON']").click()
    exported = json.loads(Path(dl.value.path()).read_text())
    assert exported["title"] == "My chat"
    assert [m["role"] for m in exported["messages"]] == ["user", "assistant"]
    assert exported["messages"][1]["content"] == "Fifth."
    item.hover()
    item.locator("button[title='Delete']").click()
    item.locator("button[title='Click again to delete']").click()
    assert page.locator(".conv-item").count() == 0
    assert page.locator("#empty").is_visible()

    # Import is reachable from the keyboard: Enter on it opens the file picker (held back here).
    page.eval_on_selector(
        "#import-file", "input => input.addEventListener('click', e => { e.preventDefault(); window.__picker = true; })"
    )
    page.focus("#import")
    page.keyboard.press("Enter")
    page.wait_for_function("() => window.__picker === true")


def test_an_attached_image_is_sent_as_a_data_url_content_part(page, tmp_path):
    from PIL import Image

    drop = """bytes => {
      const files = new DataTransfer();
      files.items.add(new File([new Uint8Array(bytes)], 'dropped.png', { type: 'image/png' }));
      document.querySelector('#scroller').dispatchEvent(new DragEvent('drop', { dataTransfer: files, bubbles: true, cancelable: true }));
    }"""
    picture = tmp_path / "square.png"
    Image.new("RGB", (8, 6), (200, 30, 40)).save(picture)
    expect(page.locator("#attach")).to_be_hidden()  # the default model takes text only
    page.evaluate(drop, list(picture.read_bytes()))  # a dropped image is refused at once
    expect(page.locator(".toast.error")).to_contain_text("takes text only")
    expect(page.locator("#attachments")).to_be_hidden()

    def models_taking_images(route):
        response = route.fetch()
        body = response.json()
        for card in body["data"]:
            card["input_modalities"] = ["text", "image"]
        route.fulfill(response=response, json=body)

    page.route("**/v1/models", models_taking_images)
    page.reload()
    _wait_ready(page)
    expect(page.locator("#attach")).to_be_visible()
    paste = """([bytes, text]) => {
      const data = new DataTransfer();
      data.items.add(new File([new Uint8Array(bytes)], 'pasted.png', { type: 'image/png' }));
      if (text) data.setData('text/plain', text);
      const paste = new ClipboardEvent('paste', { clipboardData: data, bubbles: true, cancelable: true });
      document.querySelector('#input').dispatchEvent(paste);
      return paste.defaultPrevented;
    }"""
    # Text copied with a picture of it (as office apps do) is pasted as text; a lone image is attached.
    assert page.evaluate(paste, [list(picture.read_bytes()), "a | table"]) is False
    expect(page.locator("#attachments")).to_be_hidden()
    assert page.evaluate(paste, [list(picture.read_bytes()), ""]) is True
    expect(page.locator("#attachments img")).to_have_count(1)
    page.click("#attachments .remove")
    page.evaluate(drop, list(picture.read_bytes()))  # dropped on the page: attached
    expect(page.locator("#attachments img")).to_have_count(1)
    page.click("#attachments .remove")
    page.set_input_files("#attach-input", str(picture))
    expect(page.locator("#attachments img")).to_have_count(1)
    bodies = _mock_replies(page, ["A red rectangle."])
    _send(page, "What is in this picture?")
    _wait_reply_done(page, 30_000)
    text, image = bodies[0]["messages"][-1]["content"]
    assert text == {"type": "text", "text": "What is in this picture?"}
    prefix, data = image["image_url"]["url"].split(",", 1)
    assert image["type"] == "image_url" and prefix == "data:image/png;base64"
    assert base64.b64decode(data) == picture.read_bytes()
    expect(page.locator(".msg.user .msg-images img")).to_have_count(1)
    expect(page.locator("#attachments")).to_be_hidden()
    _send(page, "And its colour?")  # the image stays in the history
    _wait_reply_done(page, 30_000)
    assert bodies[1]["messages"][0]["content"][1]["image_url"]["url"] == image["image_url"]["url"]

    # The server's model takes text only (only its card was changed): its 400 is shown,
    # and the conversation goes on without the image, which would fail every request.
    page.unroute("**/v1/chat/completions")
    _send(page, "Describe it once more.")
    error = _last_reply(page).locator(".msg-error")
    expect(error).to_contain_text("takes text only")
    bodies = _mock_replies(page, ["Without the picture."])
    error.locator("button", has_text="Remove the images").click()
    expect(_last_reply(page).locator(".msg-content")).to_have_text("Without the picture.")
    assert all(isinstance(m["content"], str) for m in bodies[0]["messages"]), bodies[0]["messages"]
    expect(page.locator(".msg.user .msg-images img")).to_have_count(0)


def _stored_conversations(pg) -> list[dict]:
    return json.loads(pg.evaluate("localStorage.getItem('xinfer.ui.conversations.v1')") or "{}").get(
        "conversations", []
    )


def _error_body(message: str, code: str | None = None, param: str | None = None) -> str:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}})


@pytest.mark.timeout(120)
def test_a_bad_imported_or_stored_conversation_never_stops_the_page(page, tmp_path):
    red = "data:image/png;base64,iVBORw0KGgo="
    bad = {
        "conversations": [
            {
                "id": "a",
                "title": "<img src=x onerror=alert(1)>",
                "updated": "soon",
                "messages": [
                    {
                        "role": "user",
                        "content": "hi",
                        "images": ["javascript:alert(1)", "https://example.invalid/x.png", red],
                    },
                    {
                        "role": "assistant",
                        "content": "<b>hello</b>",
                        "stats": {"tps": "NaN", "ttftMs": None, "promptTokens": 7},
                    },
                    {"role": "system", "content": "dropped"},
                    None,
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "parts"},
                            {"type": "image_url", "image_url": {"url": red}},
                        ],
                    },
                    {"role": "assistant", "content": {"not": "text"}},
                    {"role": "assistant", "content": None, "error": 42, "stopped": "yes", "reasoning": ["x"]},
                    {"role": "assistant", "content": "failed", "error": "boom"},
                ],
            }
        ]
    }
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    page.set_input_files("#import-file", str(path))
    expect(page.locator(".toast")).to_contain_text("Imported 1 conversation")
    expect(page.locator(".msg")).to_have_count(5)
    assert page.locator(".msg.user .bubble").all_inner_texts() == ["hi", "parts"]
    assert page.locator(".msg.user .msg-images img").evaluate_all("els => els.map(e => e.src)") == [red, red]
    first = page.locator(".msg.assistant").first
    expect(first.locator(".msg-content")).to_have_text("<b>hello</b>")
    expect(first.locator(".stat-in")).to_have_text("7 in")
    assert first.locator(".stat-tps").count() == 0
    expect(page.locator(".msg.assistant").last.locator(".err-detail")).to_have_text("boom")
    stored = _stored_conversations(page)[0]["messages"]
    assert stored[1]["stats"] == {"promptTokens": 7}
    assert "error" not in stored[3] and "stopped" not in stored[3] and "reasoning" not in stored[3]

    # Whatever is in storage (written by an older page, or by hand) is cleaned the same way on load.
    raw = json.dumps({"version": 1, "conversations": [bad["conversations"][0], "junk", {"messages": "no"}]})
    page.evaluate("raw => localStorage.setItem('xinfer.ui.conversations.v1', raw)", raw)
    page.reload()
    _wait_ready(page)
    expect(page.locator(".conv-item")).to_have_count(1)
    page.locator(".conv-item .conv-open").click()
    expect(page.locator(".msg")).to_have_count(5)
    page.click("#new-chat")
    expect(page.locator("#empty")).to_be_visible()
    _mock_replies(page, ["Fine."])
    _send(page, "still works")
    expect(_last_reply(page).locator(".msg-content")).to_have_text("Fine.")


@pytest.mark.timeout(120)
def test_a_conversation_that_outgrows_the_context_goes_on_without_its_oldest_turns(page):
    context = 100  # tokens; one token per 4 characters
    bodies: list[dict] = []

    def tokens(messages) -> int:
        return sum(len(m["content"]) for m in messages) // 4

    def handle(route):
        body = json.loads(route.request.post_data or "{}")
        bodies.append(body)
        n = tokens(body["messages"])
        if n > context:
            message = (
                f"the prompt has {n} tokens, the model's context is {context} tokens: "
                "shorten the prompt to leave room for at least one generated token"
            )
            route.fulfill(
                status=400,
                content_type="application/json",
                body=_error_body(message, "context_length_exceeded", "messages"),
            )
        else:
            _fulfill_sse(route, _sse([{"content": f"Reply {len(bodies)}."}]))

    page.route("**/v1/chat/completions", handle)
    questions = [f"Question {i}: " + "tell me about the sea " * 3 for i in range(1, 6)]  # 20 tokens each
    for q in questions[:4]:
        _send(page, q)
        _wait_reply_done(page, 30_000)
    assert len(bodies) == 4
    # The fifth no longer fits with all the history: it goes out without the oldest turns.
    _send(page, questions[4])
    expect(_last_reply(page).locator(".msg-content")).to_have_text(re.compile(r"Reply \d+\."))
    assert _last_reply(page).locator(".msg-content").inner_text() == f"Reply {len(bodies)}."
    assert tokens(bodies[-1]["messages"]) <= context
    assert bodies[-1]["messages"][-1]["content"] == questions[4].strip()
    assert [m["content"] for m in bodies[-1]["messages"] if m["role"] == "user"] == [q.strip() for q in questions[-2:]]
    expect(page.locator(".msg.user.omitted")).to_have_count(3)
    expect(page.locator(".context-note")).to_contain_text("outgrew the model's context")
    expect(page.locator(".msg.user.unsent")).to_have_count(0)
    expect(page.locator(".msg-error:visible")).to_have_count(0)

    # A message too long by itself is the one blamed, and the next one goes on without it.
    _send(page, "A very long message. " * 40)
    err = _last_reply(page).locator(".msg-error")
    expect(err).to_contain_text("This message is too long for this model")
    _send(page, "Short again")
    expect(_last_reply(page).locator(".msg-content")).to_have_text(re.compile(r"Reply \d+\."))
    expect(page.locator(".msg.user.unsent")).to_have_count(1)
    assert bodies[-1]["messages"][-1]["content"] == "Short again"


@pytest.mark.timeout(120)
def test_a_message_sent_while_the_model_loads_waits_and_goes_out_by_itself(page):
    _answer_json(page, "**/health", 503, '{"status": "loading"}')
    page.reload()
    _wait_ready(page)
    expect(page.locator("#status-dot.loading")).to_have_count(1)
    bodies = _mock_replies(page, ["Loaded."])
    _send(page, "Hello early")
    expect(_last_reply(page).locator(".msg-wait")).to_be_visible()
    with page.expect_request("**/health"):  # the page looks again, and still holds the message
        pass
    expect(_last_reply(page).locator(".msg-wait")).to_be_visible()
    assert bodies == [], "the message was sent to a server still loading its model"
    page.unroute("**/health")
    expect(_last_reply(page).locator(".msg-content")).to_have_text("Loaded.")
    assert len(bodies) == 1 and bodies[0]["messages"][-1]["content"] == "Hello early"
    expect(page.locator(".msg-error:visible")).to_have_count(0)
    page.unroute("**/v1/chat/completions")

    # The same when only the chat request finds the model loading (the page thought it ready).
    calls: list[int] = []

    def loading_once(route):
        calls.append(1)
        if len(calls) == 1:
            route.fulfill(
                status=503, content_type="application/json", body=_error_body("the engine is loading", "unavailable")
            )
        else:
            _fulfill_sse(route, _sse([{"content": "Now loaded."}]))

    page.route("**/v1/chat/completions", loading_once)
    _send(page, "Hello again")
    expect(_last_reply(page).locator(".msg-content")).to_have_text("Now loaded.")
    assert len(calls) == 2
    expect(page.locator(".msg-error:visible")).to_have_count(0)


@pytest.mark.timeout(120)
def test_the_status_dot_tells_a_server_gone_or_shutting_down(page):
    # A 503 from a server shutting down: the dot and banner say so (not "Connected").
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=503,
            content_type="application/json",
            body=_error_body("the server is shutting down: the answer was cut off before it ended", "unavailable"),
        ),
    )
    _answer_json(page, "**/health", 503, '{"status": "draining"}')
    _send(page, "hello")
    expect(_last_reply(page).locator(".msg-error")).to_contain_text("shutting down")
    expect(page.locator("#status-dot.loading")).to_have_count(1)
    expect(page.locator("#banner")).to_contain_text("cannot take requests now (draining)")
    page.unroute("**/health")
    page.unroute("**/v1/chat/completions")

    # A server killed while the page is idle shows within the page's periodic check.
    page.clock.install()
    page.reload()
    _wait_ready(page)
    expect(page.locator("#status-dot.online:not(.loading)")).to_have_count(1)
    page.route("**/health", lambda route: route.abort("connectionrefused"))
    page.route("**/v1/models", lambda route: route.abort("connectionrefused"))
    page.clock.run_for(15_000)
    expect(page.locator("#status-dot.offline")).to_have_count(1)
    expect(page.locator("#banner")).to_contain_text("Cannot reach the xInfer server")
    page.unroute("**/health")
    page.unroute("**/v1/models")
    page.clock.run_for(4_000)
    expect(page.locator("#status-dot.online:not(.loading)")).to_have_count(1)
    expect(page.locator("#banner")).to_be_hidden()


@pytest.mark.timeout(120)
def test_a_changed_api_key_is_fetched_again(page):
    keys = {"page": "sk-one", "server": "sk-one"}
    page.route(
        "**/ui/config.json",
        lambda route: route.fulfill(
            status=200, content_type="application/json", body=json.dumps({"api_key": keys["page"]})
        ),
    )
    page.reload()
    _wait_ready(page)
    auth: list[str | None] = []

    def chat(route):
        auth.append(route.request.headers.get("authorization"))
        if auth[-1] == f"Bearer {keys['server']}":
            _fulfill_sse(route, _sse([{"content": "Hello."}]))
        else:
            message = "a valid API key is required: send Authorization: Bearer <key> or x-api-key: <key>"
            route.fulfill(status=401, content_type="application/json", body=_error_body(message, "invalid_api_key"))

    page.route("**/v1/chat/completions", chat)
    # The server restarted with another key, which the UI's config now gives: asked again with it.
    keys.update(page="sk-two", server="sk-two")
    _send(page, "hi")
    expect(_last_reply(page).locator(".msg-content")).to_have_text("Hello.")
    assert auth == ["Bearer sk-one", "Bearer sk-two"]
    # A key that still does not work: the user is told what to do.
    keys.update(page="sk-three", server="sk-four")
    _send(page, "hi again")
    err = _last_reply(page).locator(".msg-error")
    expect(err).to_contain_text("API key changed")
    expect(err).to_contain_text("reload the page")
    expect(err.locator("button", has_text="Reload")).to_be_visible()
    assert auth[2:] == ["Bearer sk-two", "Bearer sk-three"]


@pytest.mark.timeout(120)
def test_a_long_streamed_reply_ends_drawn_whole(page):
    page.evaluate(HELD_STREAMS)
    _send(page, "Write a lot")
    page.wait_for_function("() => window.__streams.length === 1")
    words = ["word ", "**bold** ", "`code` ", "text, ", "\n\n", "- item ", "| a | b |\n", "more ", "[l](https://e.x) "]
    pieces = [("\n\n```python\nx = 1\n```\n\n" if i % 97 == 0 else words[i % len(words)]) for i in range(3000)]
    for k in range(0, len(pieces), 300):
        page.evaluate("pieces => pieces.forEach((p) => window.__push(0, p))", pieces[k : k + 300])
        page.wait_for_timeout(30)
    # The last piece comes right before the end: the final drawing must have it.
    page.evaluate("() => { window.__push(0, '\\n\\nThe **end**.'); window.__end(0); }")
    _wait_reply_done(page, 30_000)
    content = _last_reply(page).locator(".msg-content")
    expect(content.locator("p").last).to_have_text("The end.")
    streamed = content.inner_html()
    page.reload()  # drawn at once from storage
    _wait_ready(page)
    assert content.inner_html() == streamed


def test_right_to_left_text_reads_right_to_left(page):
    arabic = "مرحبا، كيف حالك؟"
    _mock_replies(page, ["أنا بخير، شكرا.\n\nEnglish paragraph.\n\n```\ncode()\n```"])
    page.fill("#input", arabic)
    assert page.eval_on_selector("#input", "e => e.matches(':dir(rtl)')")
    page.press("#input", "Enter")
    _wait_reply_done(page, 30_000)
    assert page.eval_on_selector(".msg.user .bubble", "e => e.matches(':dir(rtl)')")
    paragraphs = _last_reply(page).locator(".msg-content p")
    assert paragraphs.evaluate_all("els => els.map(e => e.matches(':dir(rtl)'))") == [True, False]
    assert _last_reply(page).locator(".code-block").evaluate("e => e.matches(':dir(ltr)')")


def test_max_tokens_saves_whole_numbers_and_shows_what_is_saved(page):
    def saved():
        return json.loads(page.evaluate(f"localStorage.getItem({SETTINGS_KEY!r})"))["maxTokens"]

    page.click("#open-settings")
    box = page.locator("#set-max-tokens")
    box.fill("1e3")
    assert saved() == 1000
    box.press("Tab")
    expect(box).to_have_value("1000")
    for wrong in ("1.5", "0", "-5"):
        box.fill(wrong)
        assert saved() == 1000, wrong
        assert box.evaluate("e => !e.checkValidity()"), wrong
        box.press("Tab")
        expect(box).to_have_value("1000")
    box.fill("")
    assert saved() is None
    box.fill("256")
    page.click("#settings .settings-foot .primary")
    assert saved() == 256


def _stored_settings(pg) -> dict:
    return json.loads(pg.evaluate(f"localStorage.getItem({SETTINGS_KEY!r})"))


def _sampling_sent(pg, bodies: list[dict], text: str) -> dict:
    """Send `text` (answered by _mock_replies) and return the sampling fields of its request."""
    n = len(bodies)
    _send(pg, text)
    expect(_last_reply(pg).locator(".msg-content")).to_have_text("Fine.")
    assert len(bodies) == n + 1
    return {key: bodies[-1][key] for key in ("temperature", "top_p") if key in bodies[-1]}


def _expect_auto(pg, name: str, auto: bool) -> None:
    """The settings dialog shows `name` (temperature, top-p) as Auto, or as a value, in all three controls."""
    expect(pg.locator(f"#set-{name}-auto")).to_have_attribute("aria-pressed", "true" if auto else "false")
    box = pg.locator(f"#set-{name}-num")
    expect(box).to_have_attribute("placeholder", "Auto")
    if auto:
        expect(box).to_have_value("")
        expect(pg.locator(f"#set-{name}")).to_have_class(re.compile(r"\bauto\b"))
        expect(pg.locator(f"#set-{name}")).to_have_attribute("aria-valuetext", "Auto (server default)")
    else:
        expect(box).not_to_have_value("")
        expect(pg.locator(f"#set-{name}")).not_to_have_class(re.compile(r"\bauto\b"))


@pytest.mark.timeout(120)
def test_temperature_and_top_p_are_auto_unless_set(bare_page):
    """By default the page sends no temperature or top_p, so the server's default applies (its flags,
    else the model's generation_config.json); a value set is sent, and cleared is Auto again."""
    page = bare_page
    bodies = _mock_replies(page, ["Fine."])
    assert _sampling_sent(page, bodies, "hello") == {}
    page.click("#open-settings")
    _expect_auto(page, "temperature", True)
    _expect_auto(page, "top-p", True)

    page.fill("#set-temperature-num", "0.3")
    _expect_auto(page, "temperature", False)
    expect(page.locator("#set-temperature")).to_have_value("0.3")  # the range follows
    _expect_auto(page, "top-p", True)
    assert (_stored_settings(page)["temperature"], _stored_settings(page)["topP"]) == (0.3, None)
    page.click("#settings .settings-foot .primary")
    assert _sampling_sent(page, bodies, "set") == {"temperature": 0.3}

    # Clearing the box is Auto again.
    page.click("#open-settings")
    expect(page.locator("#set-temperature-num")).to_have_value("0.3")
    page.fill("#set-temperature-num", "")
    _expect_auto(page, "temperature", True)
    page.locator("#set-temperature-num").press("Tab")  # left empty: stays empty
    expect(page.locator("#set-temperature-num")).to_have_value("")
    assert _stored_settings(page)["temperature"] is None
    page.click("#settings .settings-foot .primary")
    assert _sampling_sent(page, bodies, "cleared") == {}

    # From the keyboard: the range moves off Auto from where it rests (1); the toggle goes back
    # to Auto, and off it to the value the range shows.
    page.click("#open-settings")
    page.focus("#set-temperature")
    page.keyboard.press("ArrowLeft")
    _expect_auto(page, "temperature", False)
    expect(page.locator("#set-temperature-num")).to_have_value("0.95")
    page.focus("#set-temperature-auto")
    page.keyboard.press("Space")
    _expect_auto(page, "temperature", True)
    page.focus("#set-top-p-auto")
    page.keyboard.press("Enter")
    _expect_auto(page, "top-p", False)
    expect(page.locator("#set-top-p-num")).to_have_value("1")
    page.fill("#set-top-p-num", "0.5")
    page.click("#settings .settings-foot .primary")
    assert _sampling_sent(page, bodies, "toggled") == {"top_p": 0.5}

    # A value set now is kept, even one of the old defaults; "Reset to defaults" is Auto.
    page.click("#open-settings")
    page.fill("#set-temperature-num", "0.7")
    page.fill("#set-top-p-num", "0.95")
    page.reload()
    _wait_ready(page)
    assert _sampling_sent(page, bodies, "kept") == {"temperature": 0.7, "top_p": 0.95}
    page.click("#open-settings")
    expect(page.locator("#set-temperature-num")).to_have_value("0.7")
    page.click("#settings-reset")
    _expect_auto(page, "temperature", True)
    _expect_auto(page, "top-p", True)
    page.click("#settings .settings-foot .primary")
    assert _sampling_sent(page, bodies, "reset") == {}


@pytest.mark.timeout(120)
def test_settings_saved_with_the_old_default_sampling_load_as_auto(page):
    """The page used to send temperature 0.7 and top_p 0.95 unless changed: those values, saved
    without a version, load as Auto; others are kept (and cleaned)."""
    bodies = _mock_replies(page, ["Fine."])
    cases = [
        ({"temperature": 0.7, "topP": 0.95}, {}),
        ({"temperature": 1.2}, {"temperature": 1.2}),
        ({"temperature": 0.3, "topP": 0.95}, {"temperature": 0.3}),
        ({"temperature": 0.7, "topP": 0.9}, {"top_p": 0.9}),
        ({"temperature": "hot", "topP": 7}, {"top_p": 1}),
    ]
    for stored, sent in cases:
        page.evaluate("([key, s]) => localStorage.setItem(key, JSON.stringify(s))", [SETTINGS_KEY, stored])
        page.reload()
        _wait_ready(page)
        assert _sampling_sent(page, bodies, "hello") == sent, stored
    page.click("#open-settings")
    _expect_auto(page, "temperature", True)
    _expect_auto(page, "top-p", False)
    expect(page.locator("#set-top-p-num")).to_have_value("1")


@pytest.mark.timeout(120)
def test_escape_stops_a_reply_from_anywhere_but_an_open_dialog(page):
    page.evaluate(HELD_STREAMS)
    _send(page, "Go on")
    page.wait_for_function("() => window.__streams.length === 1")
    page.evaluate("window.__push(0, 'Some text')")
    expect(_last_reply(page).locator(".msg-content")).to_have_text("Some text")
    # Escape in the settings dialog closes it, and only that.
    page.click("#open-settings")
    expect(page.locator("#settings")).to_be_visible()
    page.keyboard.press("Escape")
    expect(page.locator("#settings")).to_be_hidden()
    expect(page.locator("#stop")).to_be_visible()
    # With the focus off the message box, Escape still stops the reply.
    page.locator(".conv-item .conv-open").focus()
    page.keyboard.press("Escape")
    expect(_last_reply(page).locator(".stat-stopped")).to_be_visible()
    expect(page.locator("#send")).to_be_visible()


@pytest.mark.timeout(120)
def test_a_full_browser_storage_is_said_until_saving_works_again(page):
    big = "data:image/png;base64," + "A" * 200_000
    old = {
        "id": "old",
        "title": "Old pictures",
        "created": 1,
        "updated": 1,
        "messages": [{"id": "m1", "role": "user", "content": "look", "images": [big]}],
    }
    page.evaluate(
        "c => localStorage.setItem('xinfer.ui.conversations.v1', JSON.stringify({version: 1, conversations: [c]}))", old
    )
    page.reload()
    _wait_ready(page)
    # Storage that takes 100,000 characters more (window.__room) than this: the old images do not fit.
    page.evaluate(
        """() => {
          const real = Storage.prototype.setItem;
          window.__room = 100000;
          Storage.prototype.setItem = function (key, value) {
            if (String(value).length > window.__room) throw new DOMException('full', 'QuotaExceededError');
            return real.call(this, key, value);
          };
        }"""
    )
    page.click("#new-chat")
    _mock_replies(page, ["Saved."])
    _send(page, "hello")
    expect(_last_reply(page).locator(".msg-content")).to_have_text("Saved.")
    expect(page.locator(".toast")).to_contain_text("images were removed from 1 older conversation")
    expect(page.locator("#storage-banner")).to_be_hidden()
    stored = _stored_conversations(page)
    assert [c["title"] for c in stored] == ["hello", "Old pictures"]
    assert "images" not in stored[1]["messages"][0] and stored[1]["messages"][0]["imagesRemoved"] == 1

    # Nothing more to free: a lasting warning, until a save works again.
    page.evaluate("window.__room = 100")
    _send(page, "not saved")
    expect(_last_reply(page).locator(".msg-content")).to_have_text("Saved.")
    banner = page.locator("#storage-banner")
    expect(banner).to_contain_text("Browser storage is full")
    expect(banner).to_contain_text("not saved")
    page.evaluate("window.__room = 100000")
    _send(page, "saved again")
    expect(banner).to_be_hidden()
    assert len(_stored_conversations(page)[0]["messages"]) == 6
    page.locator(".conv-item", has_text="Old pictures").locator(".conv-open").click()
    expect(page.locator(".images-removed")).to_have_text("1 image removed to free browser storage")


@pytest.mark.timeout(120)
def test_stored_settings_of_the_wrong_type_load_as_defaults(server, browser):
    """Settings written by hand or by another page are read field by field: a system prompt that is not text
    broke every message (its reply stayed "streaming" for ever, and Stop could not end it)."""
    stored = {"systemPrompt": 5, "theme": ["dark"], "temperature": "hot", "topP": {}, "maxTokens": "many"}
    with _open_page(server, browser, stored) as page:
        bodies = _mock_replies(page, ["Fine."])
        expect(page.locator("#sys-indicator")).to_be_hidden()
        _send(page, "hello")
        expect(_last_reply(page).locator(".msg-content")).to_have_text("Fine.")
        assert bodies[0]["messages"] == [{"role": "user", "content": "hello"}]
        assert not {"temperature", "top_p", "max_tokens"} & bodies[0].keys(), bodies[0]
        page.click("#open-settings")
        expect(page.locator("#set-system")).to_have_value("")
        expect(page.locator("#set-theme")).to_have_value("system")
        page.click("#settings .settings-foot .primary")

        # A reply that cannot be drawn (here the sidebar, once) still ends: the conversation is not left busy.
        page.eval_on_selector(
            "#conv-list",
            "list => { list.replaceChildren = () => { delete list.replaceChildren; throw new Error('draw failed'); }; }",
        )
        _send(page, "again")
        expect(_last_reply(page).locator(".msg-error")).to_contain_text("draw failed")
        expect(page.locator("#send")).to_be_visible()
        _send(page, "once more")
        expect(_last_reply(page).locator(".msg-content")).to_have_text("Fine.")


def test_a_code_block_named_like_an_object_property_is_shown(page):
    """A fence's language is looked up among the highlighter's own names only: "constructor" found
    Object.prototype's, and the whole reply was replaced by "This message could not be shown"."""
    names = ["constructor", "__proto__", "toString", "hasOwnProperty"]
    _mock_replies(page, ["The answer.\n\n" + "".join(f"```{name}\nx = 1\n```\n\n" for name in names)])
    _send(page, "some code")
    reply = _last_reply(page)
    expect(reply.locator(".code-lang")).to_have_text(names)
    expect(reply.locator(".msg-content p")).to_have_text("The answer.")
    expect(reply.locator(".regen-btn")).to_be_attached()
    expect(page.locator(".msg.broken")).to_have_count(0)


# Milliseconds renderMarkdown takes on each of `cases` ({name: markdown}), into a reply's container.
RENDER_TIMES = """async (cases) => {
  const { renderMarkdown } = await import(new URL('ui/static/markdown.js', document.baseURI).href);
  const times = {};
  for (const [name, src] of Object.entries(cases)) {
    const box = document.createElement('div');
    box.dir = 'auto';
    const start = performance.now();
    renderMarkdown(src, box);
    times[name] = performance.now() - start;
  }
  return times;
}"""


@pytest.mark.timeout(300)
def test_markdown_renders_long_and_unclosed_text_in_linear_time(page):
    """Each of these took 1.5 to 40 s (the tab frozen, on each redraw and each load of the page): dir=auto
    set on an element before its children went in or out (Chromium works its direction out again for each
    one), and each opener that never closes searched for to the end of the text. Now well under a second."""
    n = 20_000
    cases = {
        "one-word lines": "word\n" * n,
        "paragraphs": "word\n\n" * n,
        "a list item of many lines": "- word\n" + "  word\n" * n,
        "unclosed bold": " **a" * n,
        "unclosed italic": " _a" * n,
        "unclosed strike": " ~~a" * n,
        "unclosed bold italic": "***a " * n,
        "unclosed math": "\\(" * 2 * n,
        "unclosed link targets": "[a](" * n,
        "unclosed brackets": "![" * n,
        "URLs without a host": "http:///" * n,
        "a URL ending in parentheses": "https://a.example/" + ")" * n,
    }
    times = page.evaluate(RENDER_TIMES, cases)
    slow = {name: round(ms) for name, ms in times.items() if ms > 1000}
    assert not slow, f"renderMarkdown took (ms): {slow}"


@pytest.mark.timeout(120)
def test_an_import_with_repeated_ids_keeps_its_conversations_apart(page, tmp_path):
    """Ids were made unique only against the conversations already here: two of one file with the same id
    showed the same messages (and were deleted together), and messages with one id opened one edit box each."""

    def messages(name: str) -> list[dict]:
        return [
            {"id": "m", "role": "user", "content": f"first of {name}"},
            {"id": "m", "role": "assistant", "content": f"reply of {name}"},
            {"id": "m", "role": "user", "content": f"second of {name}"},
        ]

    data = [
        {"id": "same", "title": "Chat A", "updated": 5, "messages": messages("A")},
        {"id": "same", "title": "Chat B", "updated": 4, "messages": messages("B")},
    ]
    path = tmp_path / "repeated.json"
    path.write_text(json.dumps(data))
    page.set_input_files("#import-file", str(path))
    expect(page.locator(".toast")).to_contain_text("Imported 2 conversations")
    page.locator(".conv-item", has_text="Chat B").locator(".conv-open").click()
    expect(page.locator(".msg.user .bubble")).to_have_text(["first of B", "second of B"])
    page.locator(".msg.user").last.locator(".edit-btn").click()
    expect(page.locator(".edit-box")).to_have_count(1)
    expect(page.locator(".edit-box")).to_have_value("second of B")
    page.press(".edit-box", "Escape")
    for conv in _stored_conversations(page):
        ids = [m["id"] for m in conv["messages"]]
        assert len(set(ids)) == 3, (conv["title"], ids)

    item = page.locator(".conv-item", has_text="Chat A")
    item.hover()
    item.locator("button[title='Delete']").click()
    item.locator("button[title='Click again to delete']").click()
    expect(page.locator(".conv-item")).to_have_text(["Chat B"])


# The ids of the messages whose node, or whose markdown's nodes, were drawn after the nodes were tagged.
REDRAWN = """() => [...document.querySelectorAll('#messages .msg')]
  .filter((m) => !m.__drawn || [...m.querySelectorAll('.msg-content *')].some((n) => !n.__drawn))
  .map((m) => m.dataset.msgId)"""


@pytest.mark.timeout(120)
def test_a_long_conversation_draws_again_only_the_messages_that_change(page):
    """Each change drew every message again, its markdown parsed again: about a second at 500 turns when a
    reply started and ended, and when an edit box opened or closed."""
    reply = "An answer with **bold**, `code`, a [link](https://example.com) and a list:\n\n- one\n- two\n\n```python\nx = 1\n```"
    messages = []
    for i in range(60):
        messages += [
            {"id": f"u{i}", "role": "user", "content": f"Question {i}?"},
            {"id": f"a{i}", "role": "assistant", "content": reply},
        ]
    conv = {"id": "long", "title": "Long", "created": 1, "updated": 2, "messages": messages}
    page.evaluate(
        """c => {
          localStorage.setItem('xinfer.ui.conversations.v1', JSON.stringify({version: 1, conversations: [c]}));
          localStorage.setItem('xinfer.ui.current.v1', c.id);
        }""",
        conv,
    )
    page.reload()
    _wait_ready(page)
    expect(page.locator(".msg")).to_have_count(120)
    page.evaluate("() => document.querySelectorAll('#messages *').forEach((n) => { n.__drawn = true; })")

    _mock_replies(page, ["Fine."])
    _send(page, "One more")
    _wait_reply_done(page, 30_000)
    expect(_last_reply(page).locator(".msg-content")).to_have_text("Fine.")
    # The new exchange, and the question before it (no longer the last one, its buttons are no longer kept in view).
    redrawn = page.evaluate(REDRAWN)
    assert len(redrawn) == 3 and redrawn[0] == "u59", redrawn

    page.focus("[data-msg-id='u30'] .edit-btn")
    page.keyboard.press("Enter")
    expect(page.locator(".edit-box")).to_be_focused()
    page.keyboard.press("Escape")
    expect(page.locator(".edit-box")).to_have_count(0)
    assert page.evaluate(REDRAWN)[:2] == ["u30", "u59"]
    assert len(page.evaluate(REDRAWN)) == 4


@pytest.mark.timeout(120)
def test_the_model_card_is_read_again_once_the_model_has_loaded(page):
    """A model that finished loading between the page's /v1/models and /health kept the card the server gave
    while loading (no context size, text only) until a reload: no attach button for a model that reads images."""
    listed: list[int] = []

    def models(route):
        response = route.fetch()
        body = response.json()
        for card in body["data"]:
            if listed:
                card["input_modalities"] = ["text", "image"]  # a model that reads images, loaded
            else:
                card["max_model_len"] = None  # the card while it loads
                card["input_modalities"] = ["text"]
        listed.append(1)  # ... and it has loaded right after
        route.fulfill(response=response, json=body)

    def health(route):
        if listed:
            route.continue_()
        else:
            route.fulfill(status=503, content_type="application/json", body='{"status": "loading"}')

    page.route("**/v1/models", models)
    page.route("**/health", health)
    page.reload()
    _wait_ready(page)
    expect(page.locator("#model-ctx")).to_be_visible()
    expect(page.locator("#attach")).to_be_visible()


@pytest.mark.timeout(120)
def test_keyboard_focus_goes_to_the_message_box_when_its_button_goes(page):
    """Regenerate, Retry, a suggestion, and the edit box's Enter and Escape take away the element that had the
    focus: it fell to the page (Tab started again at the top), where Send and Stop give it to the message box."""
    message_box = page.locator("#input")

    def press(selector: str) -> None:
        page.focus(selector)
        page.keyboard.press("Enter")

    _mock_replies(page, ["Reply."])
    press(".suggestion")
    _wait_reply_done(page, 30_000)
    expect(message_box).to_be_focused()
    press(".regen-btn")
    _wait_reply_done(page, 30_000)
    expect(message_box).to_be_focused()
    press(".msg.user .edit-btn")
    expect(page.locator(".edit-box")).to_be_focused()
    page.keyboard.press("Escape")
    expect(message_box).to_be_focused()
    press(".msg.user .edit-btn")
    expect(page.locator(".edit-box")).to_be_focused()
    page.keyboard.press("Enter")
    _wait_reply_done(page, 30_000)
    expect(message_box).to_be_focused()

    page.unroute("**/v1/chat/completions")
    _answer_json(page, "**/v1/chat/completions", 500, _error_body("boom"))
    _send(page, "fail")
    expect(_last_reply(page).locator(".msg-error")).to_contain_text("boom")
    page.unroute("**/v1/chat/completions")
    _mock_replies(page, ["Reply."])
    press(".msg-error button")
    expect(_last_reply(page).locator(".msg-content")).to_have_text("Reply.")
    expect(message_box).to_be_focused()


def test_a_wide_table_scrolls_sideways_on_a_phone(page):
    """Table cells kept the replies' overflow-wrap: anywhere, which let a wide table squeeze its words
    letter by letter ("C/o/u/n/t/r/y") instead of scrolling in its wrapper."""
    page.set_viewport_size({"width": 360, "height": 740})
    header = ["Name", "Country", "Population", "Capital", "Language", "Currency", "Continent", "Timezone"]
    row = ["Switzerland", "Confederation", "8,700,000", "Bern", "Multilingual", "Franc", "Europe", "CET"]
    _mock_replies(page, ["| " + " | ".join(header) + " |\n|" + "---|" * 8 + "\n| " + " | ".join(row) + " |"])
    _send(page, "a table")
    wrap = _last_reply(page).locator(".table-wrap")
    expect(wrap.locator("td")).to_have_count(8)
    lines = wrap.locator("th, td").evaluate_all(
        "cells => cells.map((c) => { const r = document.createRange(); r.selectNodeContents(c); return r.getClientRects().length; })"
    )
    assert lines == [1] * 16, f"lines of each cell's one word: {lines}"
    assert wrap.evaluate("w => w.scrollWidth > w.clientWidth"), "the table does not scroll"


def test_titles_and_the_system_prompt_note_are_cut_between_characters(page):
    """Cut at 57 UTF-16 units, an emoji there lost its second half: a lone surrogate, shown as U+FFFD
    in the sidebar and the tab's title, and saved so."""
    family = "👨‍👩‍👧"  # one character: five code points, eight UTF-16 units
    page.click("#open-settings")
    page.fill("#set-system", "b" * 56 + family + " and more")
    page.click("#settings .settings-foot .primary")
    expect(page.locator("#sys-indicator")).to_have_text("System prompt: " + "b" * 56 + family + "…")

    _mock_replies(page, ["Fine."])
    _send(page, "a" * 56 + "😀 and the rest of a long first message")
    title = "a" * 56 + "😀…"
    expect(page.locator(".conv-item.active .conv-title")).to_have_text(title)
    expect(page).to_have_title(f"{title} · xInfer")
    assert _stored_conversations(page)[0]["title"] == title


def test_a_link_in_a_links_text_is_shown_as_text(page):
    """Links may not hold links (CommonMark): the text of one made nested <a> elements."""
    _mock_replies(
        page,
        [
            "[[inner](https://a.example/)](https://b.example/), [**x [y](https://c.example/)**](https://d.example/)"
            " and [see https://e.example/](https://f.example/)"
        ],
    )
    _send(page, "links")
    content = _last_reply(page).locator(".msg-content")
    expect(content).to_have_text("inner, x y and see https://e.example/")
    links = content.locator("a").evaluate_all("els => els.map((a) => [a.getAttribute('href'), a.textContent])")
    assert links == [
        ["https://b.example/", "inner"],
        ["https://d.example/", "x y"],
        ["https://f.example/", "see https://e.example/"],
    ], links
