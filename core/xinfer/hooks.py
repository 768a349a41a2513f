"""Hook specifications of xinfer's plugin system (pluggy project "xinfer").

A plugin is a module named by an entry point in the group ``xinfer``. It implements
any of the hooks below with ``@hookimpl``. Hooks return names and lazy
``"module:attribute"`` strings so that discovering plugins imports neither torch
nor a device runtime.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import pluggy

PROJECT = "xinfer"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class BackendSpec:
    """A hardware backend.

    ``ops`` and ``is_available`` are "module:attribute" strings: the first names a
    class implementing :class:`xinfer.ops.Ops`, the second a function returning
    whether the backend can run on this machine. Among available backends for a
    device type, the highest ``priority`` wins unless one is asked for by name.
    ``memory`` optionally names a class taking the ``torch.device`` and implementing
    :class:`xinfer.backend.DeviceMemory`; without one, the KV cache is sized from
    available host memory. ``one_device``: the machine's accelerator of this type is always one
    device (a Mac's GPU), so ``--d`` has nothing to choose and is ignored.
    """

    name: str
    device_type: str
    ops: str
    is_available: str
    priority: int = 0
    memory: str | None = None
    one_device: bool = False


@hookspec
def xinfer_architectures() -> dict[str, str]:
    """Model classes by HF ``architectures`` name, as "module:Class" strings."""


@hookspec
def xinfer_backends() -> list[BackendSpec]:
    """Hardware backends this plugin provides."""


@hookspec
def xinfer_gguf_architectures() -> dict[str, str]:
    """GGUF adapters by GGUF ``general.architecture`` name, as "module:attribute" strings.

    The attribute is an adapter object, or a class instantiated without arguments, with
    (see :class:`xinfer.loading.gguf.GGUFAdapter`):

    - ``model_type: str | None``: the transformers ``model_type`` of the config to build
      (``None``: the GGUF architecture name itself);
    - ``config(metadata, fields, tensor_names) -> dict``: config fields to add or override,
      given the GGUF metadata, the generic fields already read from it and the names of the
      file's tensors;
    - ``undo_conversion(hf_name, tensor, config) -> Tensor``: the HF checkpoint value of a
      dequantized float32 tensor, undoing what llama.cpp's converter changed (a Q/K row
      permutation, an offset stored on norm weights, ...).

    Subclass :class:`xinfer.loading.gguf.GGUFAdapter` (the identity) to override only
    what differs. An architecture without an adapter loads through the identity.
    """


@dataclass(frozen=True)
class OpSpec:
    """An op a plugin ships (an architecture's MLA or Gated DeltaNet, say), which models
    call with :func:`xinfer.ops.call`.

    ``reference`` is a "module:function" string naming its plain-torch implementation,
    which runs on any torch device; ``kernels`` names, by backend name, functions of the
    same signature that a backend runs instead. A backend runs its kernel from here,
    else its own method of the op's name, else the reference. A fused op is an op whose
    reference composes other ops (``xinfer.ops.rms_norm``, ``xinfer.ops.linear``, ...):
    every backend runs it, and any may fuse it.

    ``activations`` names, by backend name, the activations a kernel that takes an ``activation`` computes (HF
    names, as :data:`xinfer.activations.ACTIVATIONS`); a kernel not named there computes every one, as the
    reference does. Start-up refuses a model whose modules call the op with another
    (:func:`xinfer.layers.activation.check_op_activations_run_on`).
    """

    name: str
    reference: str
    kernels: Mapping[str, str] = field(default_factory=dict)
    activations: Mapping[str, frozenset[str]] = field(default_factory=dict)


@hookspec
def xinfer_ops() -> list[OpSpec]:
    """Ops this plugin provides, beyond those every backend implements (:class:`xinfer.ops.Ops`)."""


@hookspec
def xinfer_kv_formats() -> dict[str, str]:
    """KV cache formats by name (``--kvcache-dtype``), as "module:attribute" strings naming a
    :class:`xinfer.kv.KVFormat` (a key codec, a value codec and which sides are rotated; see
    docs/kv-cache.md). Attention reads a format through the backend: a backend declares the
    formats it has kernels for (``kv_formats``), and the plain-torch base reads any."""


@hookspec
def xinfer_config_classes() -> dict[str, str]:
    """transformers config classes by ``model_type``, as "module:Class" strings, for model types transformers
    does not know.

    xinfer registers them with ``transformers.AutoConfig.register`` before it reads a model's ``config.json``
    (or builds the config of a GGUF whose adapter names that ``model_type``), so that a new architecture needs
    no change to transformers. The class subclasses ``transformers.PretrainedConfig`` and sets ``model_type``
    to its key. Where transformers knows the ``model_type``, its own class is used.
    """


@hookspec
def xinfer_transformers_releases() -> dict[str, str]:
    """The oldest transformers release this plugin reads each ``model_type`` with, for those newer than xinfer's
    floor (``{"gemma4": "5.15.0"}``): the one that added it, or a later one whose config holds what the plugin reads.

    A model whose ``config.json`` (or GGUF adapter) names one is refused on an older transformers (one that knows
    the type or not) in one line naming the release to install.
    """


@hookspec
def xinfer_weight_formats() -> dict[str, str]:
    """Quantized weight formats by name, as "module:attribute" strings naming a
    :class:`xinfer.quant.WeightFormat` (or a class instantiated without arguments): its block
    geometry, ``dequantize`` (the reference every backend can run), optionally ``quantize``
    (``--isq``) and kernels by backend name. Weights in it are :class:`xinfer.quant.QuantizedTensor`
    and reach ``xinfer.ops.linear`` and ``xinfer.ops.fused_moe`` as such (docs/plugins.md,
    "Quantized weights")."""
