"""``--hf-overrides``: fields of a model's config replaced before it is read, as vLLM's flag does (say, the
YaRN rope scaling a model card recommends for contexts past the trained one, without editing config.json)."""

from __future__ import annotations

import copy
from typing import Any

from transformers import PretrainedConfig


def overridden(
    fields: dict[str, Any], overrides: dict[str, Any], config_class: type[PretrainedConfig] | None = None
) -> dict[str, Any]:
    """``fields`` (a config.json's) with each field of ``overrides`` replaced, but a sub-config's (a
    multimodal model's ``text_config``, ...) updated field by field, as vLLM updates its nested configs."""
    sub_configs = getattr(config_class, "sub_configs", None) or {}
    merged = dict(fields)
    for name, value in overrides.items():
        if name in sub_configs and isinstance(value, dict) and isinstance(merged.get(name), dict):
            merged[name] = overridden(merged[name], value, sub_configs[name])
        else:
            merged[name] = copy.deepcopy(value)  # (transformers completes a config's dicts in place)
    return merged
