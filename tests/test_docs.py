"""The docs match the code. The files README.md and docs/*.md name exist, and so do the modules, classes and
functions they name (``xinfer.ops.call``, ``xinfer_cuda.ops``). Their Python examples run as written:
each page's blocks in order, in one namespace (a block may use the names of the one before). Blocks that load a model
(``LLM(``) only import, and must import or define every name they use (loading one takes longer than this suite can
spend); the other blocks run whole, then each ``@hookimpl`` they define is called (the specs it builds take their
arguments, the "module:attribute" names it returns load, but in the reader's own packages) and each method a
backend's ops class or weight kernels class overrides has the parameters of the method it overrides. The flags they
use: tests/server/test_cli.py; the guide's plugin and the hook table: tests/plugins/test_plugin_guide.py."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.docs_pages import DOCS, REPO, code_blocks, guide_file_names, inline_code
from xinfer.config import EngineConfig
from xinfer.hooks import PROJECT
from xinfer.quant import WeightKernels
from xinfer.registry import load_object
from xinfer.torch_ops import TorchOps

# the packages the examples' reader writes: a backend, a plugin, the guide's plugin (test_plugin_guide.py installs it)
READERS_PACKAGES = ("xinfer_xpu", "xinfer_foo", "xinfer_community")
BASES = (TorchOps, WeightKernels)


def readers_package(name: str) -> ModuleType:
    """A package of the reader's: any module or attribute imported from it is another such package."""
    package = ModuleType(name)
    package.__getattr__ = lambda attribute: readers_package(f"{name}.{attribute}")  # type: ignore[method-assign]
    return package


def imports_only(source: str) -> str:
    return "\n".join(
        ast.unparse(node) for node in ast.parse(source).body if isinstance(node, ast.Import | ast.ImportFrom)
    )


def undefined_names(source: str, namespace: dict) -> set[str]:
    """The names a block reads that neither it, the blocks before it nor Python defines."""
    tree = ast.parse(source)
    defined = set(namespace) | set(dir(builtins))
    defined |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    defined |= {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)
                for a in n.names}  # fmt: skip
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - defined


def run_examples(doc: Path) -> list:
    """What each block defines, in order (a later block may define a name again)."""
    namespace: dict = {"__name__": f"docs_{doc.stem}"}
    defined: list = []
    for block in code_blocks(doc.read_text(), ("python",)):
        if "LLM(" in block:
            assert not undefined_names(block, namespace), f"{doc.name}: {block}"
            block = imports_only(block)
        before = dict(namespace)
        exec(compile(block, str(doc), "exec"), namespace)
        defined += [value for name, value in namespace.items() if before.get(name) is not value]
    return defined


def overridden_methods(defined: list) -> list[tuple[str, list[str], list[str]]]:
    """(class.method, its parameters, the base method's) for every method an example class overrides."""
    found = []
    for cls in [value for value in defined if isinstance(value, type) and issubclass(value, BASES)]:
        base = next(b for b in BASES if issubclass(cls, b))
        for name, function in vars(cls).items():
            if inspect.isfunction(function) and callable(getattr(base, name, None)):
                parameters = list(inspect.signature(function).parameters)
                found.append(
                    (f"{cls.__name__}.{name}", parameters, list(inspect.signature(getattr(base, name)).parameters))
                )
    return found


@pytest.mark.parametrize(
    "doc", [doc for doc in DOCS if code_blocks(doc.read_text(), ("python",))], ids=lambda d: d.name
)
def test_python_examples_run_as_written(doc, monkeypatch):
    for name in READERS_PACKAGES:
        monkeypatch.setitem(sys.modules, name, readers_package(name))
    defined = run_examples(doc)
    for function in [value for value in defined if inspect.isfunction(value) and hasattr(value, f"{PROJECT}_impl")]:
        registered = function()
        refs = registered.values() if isinstance(registered, dict) else []
        for ref in [ref for ref in refs if not ref.startswith(READERS_PACKAGES)]:
            assert load_object(ref) is not None, f"{function.__name__}: {ref}"
    for method, parameters, expected in overridden_methods(defined):
        assert parameters == expected, method


FILE_NAME = re.compile(r"(?<![\w/.:-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|sh|toml|json|txt))\b")
ELSEWHERE = {
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "tokenizer_config.json",
    "convert_hf_to_gguf.py",
}  # a checkpoint's files, llama.cpp's converter


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_file_a_page_names_exists(doc):
    """A name with a folder is a path from the repository's root, from the page's folder, or from a package's
    (``server/routes/chat.py``: core/xinfer's); a bare name is a file anywhere in the repository."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    text = doc.read_text()
    guide = {name for file in guide_file_names(text) for name in (file, file.rsplit("/", 1)[-1])}
    missing = [
        name
        for name in sorted(set(FILE_NAME.findall(text)) - ELSEWHERE - guide)
        if not (doc.parent / name).exists() and not any(f == name or f.endswith(f"/{name}") for f in tracked)
    ]
    assert missing == []


DOTTED_NAME = re.compile(r"(?<![\w.])(xinfer(?:_\w+)?(?:\.\w+)+)")


def resolves(name: str) -> bool:
    """``name`` is a module, or an attribute (of an attribute...) of the longest module it starts with."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for part in parts[end:]:
            if not hasattr(found, part):
                return False
            found = getattr(found, part)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_xinfer_name_a_page_gives_exists(doc):
    names = {name for span in inline_code(doc.read_text()) for name in DOTTED_NAME.findall(span)}
    assert [name for name in sorted(names) if not name.startswith("xinfer_community.") and not resolves(name)] == []


def engine_options() -> set[str]:
    return {name for group in EngineConfig.model_fields.values() for name in type(group.default).model_fields}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_keyword_a_page_gives_llm_is_an_engine_option(doc):
    text = doc.read_text()
    keywords = {word for call in re.findall(r"\bLLM\(([^()]*)\)", text) for word in re.findall(r"(\w+)=", call)}
    if doc.name == "README.md":  # "Every engine option of EngineConfig is a keyword of LLM (`block_size`, ...)"
        listed = re.search(r"is a keyword of `LLM` \((.*?)\)\.", text, re.DOTALL)
        assert listed, "the README's list of LLM's keywords moved: update this test"
        keywords |= set(re.findall(r"`(\w+)", listed.group(1)))
    assert keywords - engine_options() - {"model", "tokenizer", "generation_config"} == set()


def test_the_readmes_architecture_line_counts_are_those_of_the_files():
    """The plugin table's counts (``xinfer_plugin/file.py`` N) are the files' code lines as benchmarks/code_lines.py counts
    them: they went stale as the plugins grew. Every architecture file of a plugin is in the table."""
    from benchmarks.code_lines import code_lines

    text = (REPO / "README.md").read_text()
    table = text[text.index("| architecture | model | GGUF adapter |") :].split("\n\n", 1)[0]
    counted = {name: int(count) for name, count in re.findall(r"`(xinfer_\w+/\w+\.py)` (\d+)", table)}
    files = {name: REPO / "plugins" / name.split("/")[0].removeprefix("xinfer_") / name for name in counted}
    assert {name: code_lines(path.read_text()) for name, path in files.items()} == counted
    not_architecture = {"__init__.py", "plugin.py"}
    listed = {path.resolve() for path in files.values()}
    unlisted = [path.relative_to(REPO) for path in sorted(REPO.glob("plugins/*/xinfer_*/*.py"))
                if path.name not in not_architecture and path.resolve() not in listed]  # fmt: skip
    assert unlisted == []
