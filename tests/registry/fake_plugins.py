"""Plugins "installed" for a test: a module and a ``.dist-info`` with its entry point, in a folder put on the path
(importlib.metadata finds such a distribution exactly as one pip installed)."""

from __future__ import annotations

import textwrap
from pathlib import Path


def install(site: Path, name: str, module_source: str, distribution: str | None = None, version: str = "1.0") -> None:
    """Installs module ``xinfer_<name>_plugin`` (``module_source``) as entry point ``name`` of group ``xinfer``."""
    distribution = distribution or f"xinfer-{name}"
    module = f"xinfer_{name}_plugin"
    (site / f"{module}.py").write_text(textwrap.dedent(module_source))
    info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[xinfer]\n{name} = {module}\n")


def architectures_plugin(architectures: dict[str, str]) -> str:
    return f"""
    from xinfer.hooks import hookimpl

    @hookimpl
    def xinfer_architectures():
        return {architectures!r}
    """
