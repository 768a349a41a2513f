"""A real ``python -m xinfer.server`` in a subprocess on 127.0.0.1, for tests."""

from __future__ import annotations

import json as jsonlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = float(os.environ.get("XINFER_TEST_STARTUP_TIMEOUT", "300"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(
        self, *flags: str, api_key: str | None = None, env: dict[str, str] | None = None, name: str = "server"
    ):
        self.flags = list(flags)
        self.api_key = api_key
        self.env = {**os.environ, **(env or {})}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = REPO / "test-output" / f"{name}-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> LiveServer:
        self.log_path.parent.mkdir(exist_ok=True)
        cmd = [sys.executable, "-m", "xinfer.server", "--host", "127.0.0.1", "--port", str(self.port), *self.flags]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        self.log = open(self.log_path, "w")  # noqa: SIM115 - the server writes it until stop()
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server was not healthy after {STARTUP_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0, **kwargs)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path: str, json=None, **kwargs) -> httpx.Response:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        kwargs.setdefault("timeout", 120)
        return httpx.post(self.url + path, json=json, headers=headers, **kwargs)

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.url + path, headers={**self.headers, **kwargs.pop("headers", {})}, timeout=120, **kwargs)

    def events(self, path: str, json: dict) -> list[tuple[str | None, dict]]:
        """A streamed answer's server-sent events: (``event:`` name or None, JSON data), ``[DONE]`` left out."""
        events, name = [], None
        with httpx.stream("POST", self.url + path, json=json, headers=self.headers, timeout=120) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("event: "):
                    name = line.removeprefix("event: ")
                elif line.startswith("data: ") and line != "data: [DONE]":
                    events.append((name, jsonlib.loads(line.removeprefix("data: "))))
                    name = None
        return events

    def metrics(self) -> dict[str, float]:
        """Samples of ``/metrics`` by name (labels kept in the key when present)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                samples[key] = float(value)
        return samples

    def stop(self, timeout: float = 60) -> int | None:
        if self.proc is None:
            return None
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.log.close()
