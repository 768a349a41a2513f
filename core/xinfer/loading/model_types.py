"""Whether the installed transformers reads a config's ``model_type`` as xinfer's plugins need, and which release
to install where not."""

from __future__ import annotations

import transformers
from packaging.version import Version
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from xinfer import registry
from xinfer.loading.errors import ModelFileError


def check_model_type(model_type: str, source: str) -> None:
    """Refuses in one line a ``model_type`` that neither transformers nor a plugin's config class knows (call
    :func:`xinfer.registry.register_config_classes` first), or one whose plugin needs a newer transformers
    (``xinfer_transformers_releases``), naming the release to install."""
    installed = transformers.__version__
    needed = registry.transformers_release(model_type)
    install = f'pip install -U "transformers>={needed}"'
    if model_type not in CONFIG_MAPPING:
        if needed is None:
            raise ModelFileError(
                f"{source}: model_type {model_type!r} is known neither to transformers {installed} nor to an "
                f"installed plugin (a plugin adds one with the xinfer_config_classes hook)"
            )
        raise ModelFileError(
            f"{source}: model_type {model_type!r} is unknown to the installed transformers {installed}; "
            f"xinfer reads it with transformers {needed} or newer: {install}"
        )
    if needed is not None and Version(installed) < Version(needed):
        raise ModelFileError(
            f"{source}: model_type {model_type!r} needs transformers {needed} or newer (installed: {installed}): "
            f"{install}"
        )
