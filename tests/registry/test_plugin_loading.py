"""The plugin-loading rules: a broken plugin is skipped with one warning and named where it matters; two plugins
registering one name resolve by the documented precedence, with a warning naming both."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from tests.registry.fake_plugins import architectures_plugin, install
from xinfer import registry

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA = "xinfer_llama.llama:LlamaForCausalLM"


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on the path whose plugins :func:`registry.discover` finds; what it discovers is what the registry
    answers from."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path


def use(monkeypatch, found: registry.Discovery) -> registry.Discovery:
    monkeypatch.setattr(registry, "discovery", lambda: found)
    return found


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == registry.__name__]


def test_a_plugin_that_fails_to_import_is_skipped_with_one_warning(site, monkeypatch, caplog):
    install(site, "broken", "import xinfer_no_such_dependency\n")
    found = use(monkeypatch, registry.discover())
    assert "broken" not in found.order and "llama" in found.order and "cpu" in found.order
    assert warnings_of(caplog) == [
        "plugin 'broken' (xinfer-broken) failed to load and is skipped: "
        "ModuleNotFoundError: No module named 'xinfer_no_such_dependency'"
    ]
    assert registry.model_class("LlamaForCausalLM").__name__ == "LlamaForCausalLM"
    listed = {info.name: info for info in registry.plugins()}
    assert listed["broken"].error == "ModuleNotFoundError: No module named 'xinfer_no_such_dependency'"
    assert listed["llama"].error is None


def test_a_request_no_loaded_plugin_serves_names_the_broken_ones(site, monkeypatch):
    install(site, "broken", "raise RuntimeError('the plugin is broken')\n")
    use(monkeypatch, registry.discover())
    with pytest.raises(registry.UnknownArchitectureError) as error:
        registry.model_class("FooForCausalLM")
    assert "'FooForCausalLM'" in str(error.value)
    assert "broken (RuntimeError: the plugin is broken)" in str(error.value)


def test_a_registered_class_that_cannot_be_imported_names_its_plugin(site, monkeypatch):
    install(site, "lazy", architectures_plugin({"FooForCausalLM": "xinfer_no_such_module:Foo"}))
    use(monkeypatch, registry.discover())
    with pytest.raises(registry.PluginError) as error:
        registry.model_class("FooForCausalLM")
    assert str(error.value).startswith("plugin 'lazy' registers xinfer_no_such_module:Foo, which cannot be loaded")


def test_a_third_party_plugin_overrides_a_built_in_one_with_a_warning(site, monkeypatch, caplog):
    install(site, "myllama", architectures_plugin({"LlamaForCausalLM": "my_llama:Llama"}))
    found = use(monkeypatch, registry.discover())
    assert registry.architectures()["LlamaForCausalLM"] == "my_llama:Llama"
    assert [r.plugin for r in found.tables["xinfer_architectures"]["LlamaForCausalLM"]] == ["myllama", "llama"]
    (warning,) = warnings_of(caplog)
    assert "'LlamaForCausalLM' is registered by plugins 'myllama' and 'llama'" in warning
    assert "XINFER_PREFER=llama" in warning


def test_xinfer_prefer_names_the_winner_without_a_warning(site, monkeypatch, caplog):
    install(site, "myllama", architectures_plugin({"LlamaForCausalLM": "my_llama:Llama"}))
    use(monkeypatch, registry.discover(preferred=["llama"]))
    assert registry.architectures()["LlamaForCausalLM"] == LLAMA
    assert warnings_of(caplog) == []


def test_between_third_party_plugins_the_order_does_not_depend_on_installation(site, monkeypatch):
    install(site, "zeta", architectures_plugin({"FooForCausalLM": "zeta:Foo"}))
    install(site, "alpha", architectures_plugin({"FooForCausalLM": "alpha:Foo"}))
    assert use(monkeypatch, registry.discover()).tables["xinfer_architectures"]["FooForCausalLM"][0].plugin == "alpha"
    assert registry.discover(preferred=["zeta"]).tables["xinfer_architectures"]["FooForCausalLM"][0].plugin == "zeta"


def test_xinfer_plugins_loads_only_those_named(site):
    found = registry.discover(allowed=["llama", "cpu"])
    assert sorted(found.order) == ["cpu", "llama"] and found.broken == {}


def xinfer(site, *args: str) -> subprocess.CompletedProcess:
    code = "import sys; from xinfer.cli import main; sys.exit(main())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), REPO])}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_xinfer_plugins_lists_a_broken_plugin_and_exits_0(tmp_path):
    install(tmp_path, "broken", "import xinfer_no_such_dependency\n")
    result = xinfer(tmp_path, "plugins")
    assert result.returncode == 0, result.stderr
    error = "ModuleNotFoundError: No module named 'xinfer_no_such_dependency'"
    assert f"broken 1.0  BROKEN, skipped\n  error: {error}" in result.stdout
    assert "LlamaForCausalLM" in result.stdout
    assert result.stderr.strip().splitlines() == [
        "plugin 'broken' (xinfer-broken) failed to load and is skipped: "
        "ModuleNotFoundError: No module named 'xinfer_no_such_dependency'"
    ]
