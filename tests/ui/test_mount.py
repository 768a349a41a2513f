"""``mount_ui`` on a bare FastAPI app (no model, no browser), and a check that the
page's scripts never put HTML strings into the DOM."""

from __future__ import annotations

import re

import fastapi
from fastapi.testclient import TestClient

from xinfer.server.ui import STATIC_DIR, mount_ui


def _client(api_key):
    app = fastapi.FastAPI()
    mount_ui(app, api_key)
    return TestClient(app)


def test_index_static_and_config():
    c = _client(None)
    r = c.get("/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert '<script type="module" src="ui/static/app.js">' in r.text
    for name, kind in [("app.js", "javascript"), ("markdown.js", "javascript"), ("style.css", "text/css")]:
        r = c.get(f"/ui/static/{name}")
        assert r.status_code == 200, name
        assert kind in r.headers["content-type"], (name, r.headers["content-type"])
        assert r.headers["cache-control"] == "no-cache"
    assert c.get("/ui/static/nope.js").status_code == 404
    assert c.get("/ui/config.json").json() == {"api_key": None}


def test_config_gives_the_api_key():
    r = _client("sk-123").get("/ui/config.json")
    assert r.json() == {"api_key": "sk-123"}
    assert r.headers["cache-control"] == "no-store"


def test_every_referenced_file_is_shipped():
    html = (STATIC_DIR / "index.html").read_text()
    refs = re.findall(r'(?:src|href)="ui/static/([^"]+)"', html)
    assert refs
    for js in STATIC_DIR.glob("*.js"):
        refs += re.findall(r"from '\./([^']+)'", js.read_text())
    for ref in refs:
        assert (STATIC_DIR / ref).is_file(), ref


def test_scripts_use_no_html_sinks():
    sinks = re.compile(
        r"\.(innerHTML|outerHTML|insertAdjacentHTML)\s*=|insertAdjacentHTML\(|document\.write|\beval\(|new Function\("
    )
    scripts = sorted(STATIC_DIR.glob("*.js"))
    assert {"app.js", "markdown.js"} <= {js.name for js in scripts}  # the page's script and its import
    for js in scripts:
        for n, line in enumerate(js.read_text().splitlines(), 1):
            if line.lstrip().startswith("//"):
                continue
            assert not sinks.search(line), f"{js.name}:{n}: {line.strip()}"
