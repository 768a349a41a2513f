"""Plugin discovery: entry points of group ``xinfer`` loaded into one pluggy manager.

The rules (the README's "Plugin loading"):

- A plugin that fails to load (its module raises, or imports a missing dependency) is skipped with one warning
  naming it and the error; the others load. ``xinfer plugins`` lists it as broken, and a request for an
  architecture no loaded plugin registers names it.
- ``XINFER_PLUGINS=a,b`` loads only the plugins named.
- Where several plugins register the same name (an architecture, a GGUF architecture, a model_type), the first in
  precedence order wins: the plugins named in ``XINFER_PREFER`` (in that order), then plugins from other
  distributions than xinfer's own, then xinfer's own (each group by entry-point name). So a third-party plugin
  overrides a built-in one; start-up warns with both names unless ``XINFER_PREFER`` settled it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, cast

import pluggy

from xinfer import hooks
from xinfer.loading.errors import first_line

log = logging.getLogger(__name__)

BUILT_IN_DISTRIBUTIONS = frozenset(
    {"xinfer-llama", "xinfer-qwen", "xinfer-gemma", "xinfer-glm", "xinfer-minimax", "xinfer-deepseek", "xinfer-cpu",
     "xinfer-cuda", "xinfer-metal"}
)  # fmt: skip
"""This repository's plugins: any other plugin registering one of their names overrides them."""

# hooks returning {name: "module:attribute"}, and what their names are called in messages
NAMED_HOOKS = {
    "xinfer_architectures": "architecture",
    "xinfer_gguf_architectures": "GGUF architecture",
    "xinfer_config_classes": "model_type",
    "xinfer_kv_formats": "KV cache format",
    "xinfer_weight_formats": "weight format",
}
BUILTIN = "xinfer-builtin"
"""What the core registers through its own hooks (the quantized KV and weight formats), below every plugin."""


class UnknownArchitectureError(ValueError):
    pass


class PluginError(ValueError):
    """What a plugin registered cannot be loaded."""


@dataclass(frozen=True)
class Registered:
    """A name's registration: the plugin that made it, and the "module:attribute" it names."""

    plugin: str
    ref: str


@dataclass(frozen=True)
class PluginInfo:
    name: str
    version: str
    hooks: list[str]
    architectures: list[str]
    gguf_architectures: list[str]
    backends: dict[str, str]  # name -> "available", "unavailable" or why it cannot tell
    error: str | None = None  # why it failed to load (then it registers nothing)


@dataclass
class Discovery:
    """The plugins found: the loaded ones in a pluggy manager, in precedence order, and the broken ones."""

    manager: pluggy.PluginManager
    order: list[str] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)  # plugin -> "ErrorType: message"
    tables: dict[str, dict[str, list[Registered]]] = field(default_factory=dict)  # hook -> name -> registrations

    def rank(self, plugin: str) -> int:
        return self.order.index(plugin) if plugin in self.order else len(self.order)


def _names(variable: str) -> list[str] | None:
    names = [n.strip() for n in os.environ.get(variable, "").split(",") if n.strip()]
    return names or None


def discover(
    allowed: list[str] | None = None, preferred: list[str] | None = None, modules: dict[str, Any] | None = None
) -> Discovery:
    """Loads the installed plugins (only those in ``allowed`` if given), the ``preferred`` ones first, after the
    plugin ``modules`` given by name (registered in this process, as an application embedding xinfer or a test
    does), and the core's own defaults last."""
    pm = pluggy.PluginManager(hooks.PROJECT)
    pm.add_hookspecs(hooks)
    pm.register(importlib.import_module("xinfer.builtin"), BUILTIN)
    found = Discovery(pm)
    for name, module in (modules or {}).items():
        pm.register(module, name=name)
        found.order.append(name)
    preferred = preferred or []
    entry_points: dict[str, importlib.metadata.EntryPoint] = {}
    for entry_point in importlib.metadata.entry_points(group=hooks.PROJECT):
        entry_points.setdefault(entry_point.name, entry_point)
    for name in sorted(set(allowed or ()) - set(entry_points)):
        log.warning("XINFER_PLUGINS names %r, which is not installed (installed: %s)",
                    name, ", ".join(sorted(entry_points)))  # fmt: skip
    if allowed is not None:
        entry_points = {name: ep for name, ep in entry_points.items() if name in allowed}

    def precedence(entry_point: importlib.metadata.EntryPoint) -> tuple[int, int, str]:
        if entry_point.name in preferred:
            return 0, preferred.index(entry_point.name), entry_point.name
        return 1 + (_distribution(entry_point) in BUILT_IN_DISTRIBUTIONS), 0, entry_point.name

    for entry_point in sorted(entry_points.values(), key=precedence):
        dist = entry_point.dist
        found.versions[entry_point.name] = dist.version if dist else "?"
        try:
            pm.register(entry_point.load(), name=entry_point.name)
        except Exception as error:  # noqa: BLE001 - a broken plugin must not take the others down
            found.broken[entry_point.name] = f"{type(error).__name__}: {first_line(error)}"
            log.warning("plugin %r (%s) failed to load and is skipped: %s",
                        entry_point.name, _distribution(entry_point), found.broken[entry_point.name])  # fmt: skip
            continue
        found.order.append(entry_point.name)
    for hook in NAMED_HOOKS:
        found.tables[hook] = _collect(found, hook)
    _warn_conflicts(found, preferred)
    return found


def _distribution(entry_point: importlib.metadata.EntryPoint) -> str:
    return entry_point.dist.name if entry_point.dist else "?"


def _ranked(found: Discovery, hook: str) -> list[pluggy.HookImpl]:
    """The plugins' implementations of ``hook``, in precedence order."""
    return sorted(getattr(found.manager.hook, hook).get_hookimpls(), key=lambda impl: found.rank(impl.plugin_name))


def _collect(found: Discovery, hook: str) -> dict[str, list[Registered]]:
    """Each name registered through ``hook``, with its registrations in precedence order."""
    table: dict[str, list[Registered]] = defaultdict(list)
    for impl in _ranked(found, hook):
        try:
            registered = cast("dict[str, str]", impl.function())
        except Exception as error:  # noqa: BLE001
            log.warning("plugin %r: %s() failed and is skipped: %s: %s",
                        impl.plugin_name, hook, type(error).__name__, first_line(error))  # fmt: skip
            continue
        for name, ref in registered.items():
            table[name].append(Registered(impl.plugin_name, ref))
    return dict(table)


def _warn_conflicts(found: Discovery, preferred: list[str]) -> None:
    for hook, kind in NAMED_HOOKS.items():
        for name, registrations in found.tables[hook].items():
            if len(registrations) < 2:
                continue
            winner, others = registrations[0].plugin, [r.plugin for r in registrations[1:]]
            report = log.info if winner in preferred else log.warning
            report("%s %r is registered by plugins %r and %s; plugin %r wins (XINFER_PREFER=%s would choose %r)",
                   kind, name, winner, " and ".join(map(repr, others)), winner, others[0], others[0])  # fmt: skip


@functools.cache
def discovery() -> Discovery:
    return discover(_names("XINFER_PLUGINS"), _names("XINFER_PREFER"))


def load_object(ref: str) -> Any:
    """Import "package.module:attribute"."""
    module, _, attr = ref.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def load_registered(registered: Registered) -> Any:
    """What a plugin registered, imported; a failure names the plugin."""
    try:
        return load_object(registered.ref)
    except Exception as error:  # whatever the plugin's import raised
        raise PluginError(
            f"plugin {registered.plugin!r} registers {registered.ref}, which cannot be loaded: "
            f"{type(error).__name__}: {first_line(error)}"
        ) from error


def _winners(hook: str) -> dict[str, Registered]:
    return {name: registrations[0] for name, registrations in discovery().tables[hook].items()}


def architectures() -> dict[str, str]:
    """Model classes by HF architecture name, as "module:Class" strings."""
    return {name: registered.ref for name, registered in _winners("xinfer_architectures").items()}


def gguf_architectures() -> dict[str, Registered]:
    return _winners("xinfer_gguf_architectures")


def backends() -> list[hooks.BackendSpec]:
    impls = _ranked(discovery(), "xinfer_backends")
    return [spec for impl in impls for spec in cast("list[hooks.BackendSpec]", impl.function())]


def model_class(architecture: str) -> type:
    registered = _winners("xinfer_architectures")
    if architecture not in registered:
        listed = ", ".join(sorted(registered)) or "none"
        broken = discovery().broken
        hint = (
            f"plugins that failed to load may provide it: {'; '.join(f'{n} ({e})' for n, e in broken.items())}"
            if broken
            else "install the plugin that provides it (from xinfer's repository: pip install ./plugins/<family>)"
        )
        raise UnknownArchitectureError(
            f"unknown architecture {architecture!r}; registered architectures: {listed}; {hint}"
        )
    return load_registered(registered[architecture])


@functools.cache
def register_config_classes() -> None:
    """Hands transformers the config classes plugins register for model_types it does not know."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type, registered in _winners("xinfer_config_classes").items():
        if model_type in CONFIG_MAPPING:
            log.debug("model_type %r: transformers' own config class is used, not plugin %r's",
                      model_type, registered.plugin)  # fmt: skip
            continue
        try:
            AutoConfig.register(model_type, load_registered(registered))
        except ValueError as error:
            raise PluginError(f"plugin {registered.plugin!r}'s config class for {model_type!r}: {error}") from error


def transformers_release(model_type: str) -> str | None:
    """The oldest transformers release the plugin serving ``model_type`` reads it with, where it declares one."""
    for impl in _ranked(discovery(), "xinfer_transformers_releases"):
        releases = cast("dict[str, str]", impl.function())
        if model_type in releases:
            return releases[model_type]
    return None


def plugins() -> list[PluginInfo]:
    found = discovery()
    infos = []
    for name, plugin in found.manager.list_name_plugin():
        if name == BUILTIN:
            continue  # the core's own, not a plugin
        registered = {hook: sorted(n for n, r in found.tables[hook].items() if any(x.plugin == name for x in r))
                      for hook in NAMED_HOOKS}  # fmt: skip
        specs = plugin.xinfer_backends() if hasattr(plugin, "xinfer_backends") else []
        infos.append(
            PluginInfo(
                name=name,
                version=found.versions.get(name, "?"),
                hooks=sorted(caller.name for caller in found.manager.get_hookcallers(plugin) or []),
                architectures=registered["xinfer_architectures"],
                gguf_architectures=registered["xinfer_gguf_architectures"],
                backends={spec.name: _availability(spec) for spec in specs},
            )
        )
    for name, error in found.broken.items():
        infos.append(PluginInfo(name, found.versions.get(name, "?"), [], [], [], {}, error))
    return sorted(infos, key=lambda info: info.name)


def _availability(spec: hooks.BackendSpec) -> str:
    try:
        return "available" if load_object(spec.is_available)() else "unavailable"
    except Exception as error:  # noqa: BLE001
        return f"cannot tell: {type(error).__name__}: {first_line(error)}"


def kv_formats() -> dict[str, Any]:
    """KV cache formats registered through ``xinfer_kv_formats``, by name."""
    return {name: load_registered(registered) for name, registered in _winners("xinfer_kv_formats").items()}


def weight_formats() -> dict[str, Any]:
    """Quantized weight formats registered through ``xinfer_weight_formats``, by name (classes instantiated)."""
    formats = {}
    for name, registered in _winners("xinfer_weight_formats").items():
        loaded = load_registered(registered)
        formats[name] = loaded() if isinstance(loaded, type) else loaded
    return formats


def op_specs() -> dict[str, hooks.OpSpec]:
    """Plugins' ops by name (:func:`xinfer.ops.call`), the first in precedence order winning."""
    specs: dict[str, hooks.OpSpec] = {}
    for impl in _ranked(discovery(), "xinfer_ops"):
        for spec in cast("list[hooks.OpSpec]", impl.function()):
            specs.setdefault(spec.name, spec)
    return specs
