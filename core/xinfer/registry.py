"""Plugin discovery: entry points of group ``xinfer`` loaded into one pluggy manager."""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from typing import Any

import pluggy

from xinfer import hooks


class UnknownArchitectureError(ValueError):
    pass


@dataclass(frozen=True)
class PluginInfo:
    name: str
    version: str
    hooks: list[str]
    architectures: list[str]
    backends: list[str]


BUILTIN = "xinfer-builtin"  # what the core registers through its own hooks (the quantized KV formats)


def _allowed_plugins() -> set[str] | None:
    names = os.environ.get("XINFER_PLUGINS", "").strip()
    return {n.strip() for n in names.split(",") if n.strip()} or None


def make_plugin_manager(allowed: set[str] | None = None) -> pluggy.PluginManager:
    """A manager with every installed plugin, or only those named in ``allowed``."""
    pm = pluggy.PluginManager(hooks.PROJECT)
    pm.add_hookspecs(hooks)
    pm.register(importlib.import_module("xinfer.kv.builtin"), BUILTIN)
    if allowed is None:
        pm.load_setuptools_entrypoints(hooks.PROJECT)
    for name in sorted(allowed or ()):
        pm.load_setuptools_entrypoints(hooks.PROJECT, name)
    return pm


@functools.cache
def plugin_manager() -> pluggy.PluginManager:
    return make_plugin_manager(_allowed_plugins())


def load_object(ref: str) -> Any:
    """Import "package.module:attribute"."""
    module, _, attr = ref.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def architectures(pm: pluggy.PluginManager | None = None) -> dict[str, str]:
    pm = pm or plugin_manager()
    merged: dict[str, str] = {}
    for found in reversed(pm.hook.xinfer_architectures()):  # first registered wins
        merged.update(found)
    return merged


def backends(pm: pluggy.PluginManager | None = None) -> list[hooks.BackendSpec]:
    pm = pm or plugin_manager()
    return [spec for found in pm.hook.xinfer_backends() for spec in found]


def model_class(architecture: str, pm: pluggy.PluginManager | None = None) -> type:
    known = architectures(pm)
    if architecture not in known:
        listed = ", ".join(sorted(known)) or "none"
        raise UnknownArchitectureError(
            f"unknown architecture {architecture!r}; registered architectures: {listed}. "
            f"Install the plugin that provides it (e.g. pip install xinfer-<family>)."
        )
    return load_object(known[architecture])


def plugins(pm: pluggy.PluginManager | None = None) -> list[PluginInfo]:
    pm = pm or plugin_manager()
    versions = {id(plugin): dist.version for plugin, dist in pm.list_plugin_distinfo()}
    infos = []
    for name, plugin in pm.list_name_plugin():
        impls = [h.name for h in pm.get_hookcallers(plugin) or []]
        arch = getattr(plugin, "xinfer_architectures", None)
        back = getattr(plugin, "xinfer_backends", None)
        infos.append(
            PluginInfo(
                name=name,
                version=versions.get(id(plugin), "?"),
                hooks=sorted(impls),
                architectures=sorted(arch()) if arch else [],
                backends=[b.name for b in back()] if back else [],
            )
        )
    return infos


def op_specs(pm: pluggy.PluginManager | None = None) -> dict[str, hooks.OpSpec]:
    """Plugins' ops by name (:func:`xinfer.ops.call`); the first registered wins."""
    pm = pm or plugin_manager()
    return {spec.name: spec for found in reversed(pm.hook.xinfer_ops()) for spec in found}


def kv_formats(pm: pluggy.PluginManager | None = None) -> dict[str, Any]:
    """KV cache formats registered through ``xinfer_kv_formats``, by name (first registered wins)."""
    pm = pm or plugin_manager()
    merged: dict[str, str] = {}
    for found in reversed(pm.hook.xinfer_kv_formats()):
        merged.update(found)
    return {name: load_object(ref) for name, ref in merged.items()}
