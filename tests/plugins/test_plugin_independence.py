"""No plugin distribution (plugins/*, and backends/*, which are plugins too) uses another: none
imports another's packages, names their modules in a lazy "module:attribute" string, or
depends on it in its pyproject. What they share belongs in the core."""

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = sorted(
    path.parent for path in [*ROOT.glob("plugins/*/pyproject.toml"), *ROOT.glob("backends/*/pyproject.toml")]
)
MODULE_STRING = re.compile(r"^(\w+)(\.\w+)*:\w+$")  # "xinfer_qwen.kernels.conv1d:causal_conv1d"


def packages(distribution: Path) -> set[str]:
    return {path.parent.name for path in distribution.glob("*/__init__.py")}


def imported_names(source: str) -> Iterator[str]:
    """The top-level packages a module imports, or names in a "module:attribute" string."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_STRING.match(node.value):
            yield node.value.split(".")[0].split(":")[0]


def test_every_distribution_is_found():
    names = {path.name for path in DISTRIBUTIONS}
    assert {"cpu", "cuda", "deepseek", "llama", "qwen"} <= names
    assert all(packages(path) for path in DISTRIBUTIONS)


def test_the_scan_sees_imports_and_module_strings():
    source = 'import xinfer_a.x\nfrom xinfer_b import y\nfrom . import z\nK = {"cuda": "xinfer_c.k:f"}\nS = "a: b"\n'
    assert set(imported_names(source)) == {"xinfer_a", "xinfer_b", "xinfer_c"}


@pytest.mark.parametrize("distribution", DISTRIBUTIONS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_a_plugin_imports_no_other_plugin(distribution):
    others = {name for path in DISTRIBUTIONS if path != distribution for name in packages(path)}
    found = {
        f"{path.relative_to(ROOT)} uses {name}"
        for package in packages(distribution)
        for path in (distribution / package).rglob("*.py")
        for name in imported_names(path.read_text())
        if name in others
    }
    assert not found, "\n".join(sorted(found))


@pytest.mark.parametrize("distribution", DISTRIBUTIONS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_a_plugin_depends_on_no_other_plugin(distribution):
    project = tomllib.loads((distribution / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {}).values()
    requirements = [*project.get("dependencies", []), *(requirement for extra in extras for requirement in extra)]
    names = {re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0].lower() for requirement in requirements}
    assert not {name for name in names if name.startswith("xinfer")}, names
