"""The user-facing pages (README.md and docs/*.md) and their code, for the tests that check the docs against the
code. docs/kv-cache-history.md is left out: its commands are records of past runs as they were typed, and it says
where a flag has since been removed."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted(set((REPO / "docs").glob("*.md")) - {REPO / "docs" / "kv-cache-history.md"})]
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
SPAN = re.compile(r"`([^`]+)`")


def code_blocks(text: str, languages: tuple[str, ...]) -> list[str]:
    """The fenced blocks of these languages ("" for none), but the guide's plugin files (``file=``)."""
    return [body for language, info, body in FENCE.findall(text) if language in languages and "file=" not in info]


def inline_code(text: str) -> list[str]:
    """The inline code spans outside fenced blocks, each on one line."""
    return [span.replace("\n", " ") for span in SPAN.findall(FENCE.sub("", text))]


def guide_file_names(text: str) -> list[str]:
    """The files of the plugin a page builds (its ``file=`` blocks)."""
    return [info.split("file=", 1)[1].split()[0] for _, info, _ in FENCE.findall(text) if "file=" in info]
