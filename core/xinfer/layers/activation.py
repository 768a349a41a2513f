"""Activations as the layers apply them: ``act(gate) * up`` as the backend's op where it has one, and the plain
functions (:mod:`xinfer.activations`) by the config's name, one error naming the field where xinfer has none; a
plugin op's activation is checked against what the backend's kernel of it computes at start-up."""

from collections.abc import Callable, Collection
from dataclasses import dataclass

from torch import Tensor, nn

from xinfer import ops
from xinfer.activations import ACTIVATIONS, ALIASES, act_and_mul


class SiluAndMul(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return ops.silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return ops.gelu_tanh_and_mul(x)


class GeluAndMul(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return ops.gelu_and_mul(x)


class ActAndMul(nn.Module):
    """``act(gate) * up`` in torch on every backend, for the activations no model in wide use has: no backend
    fuses them."""

    def __init__(self, act: Callable[[Tensor], Tensor]):
        super().__init__()
        self.act = act

    def forward(self, x: Tensor) -> Tensor:
        return act_and_mul(self.act, x)


FUSED_GATED: dict[str, type[nn.Module]] = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul, "gelu": GeluAndMul}
"""``act(gate) * up`` as one op of the backend's, by the HF config's name of ``act``."""


def _known(name: str, supported: Collection[str], field: str) -> str:
    name = ALIASES.get(name, name)
    if name not in supported:
        raise NotImplementedError(f"{field} {name!r} is not supported; supported: {', '.join([*supported, *ALIASES])}")
    return name


def activation_name(name: str, field: str = "hidden_act") -> str:
    """The name ``name`` (the config's ``field``) goes by in :data:`ACTIVATIONS`, as ``ops.fused_moe`` takes it;
    one error naming both where xinfer has no such activation."""
    return _known(name, ACTIVATIONS, field)


def gated_activation(name: str, field: str = "hidden_act") -> nn.Module:
    """``act(gate) * up`` for the ``act`` a config's ``field`` names: the backend's op where it has one."""
    name = _known(name, ACTIVATIONS, field)
    return FUSED_GATED[name]() if name in FUSED_GATED else ActAndMul(ACTIVATIONS[name])


def activation(name: str, field: str = "hidden_act") -> Callable[[Tensor], Tensor]:
    """The plain activation a config's ``field`` names; one error naming both where xinfer has none."""
    return ACTIVATIONS[_known(name, ACTIVATIONS, field)]


@dataclass(frozen=True)
class OpActivation:
    """A plugin op a module calls with an activation, and the config's field that names it."""

    op: str
    activation: str  # as :data:`ACTIVATIONS` names it
    field: str = "hidden_act"


def check_op_activations_run_on(model: nn.Module, backend: ops.Ops) -> None:
    """One error, naming the config's field, where a module of ``model`` calls a plugin op with an activation that
    the backend's kernel of it does not compute (:func:`xinfer.ops.activations_of`); a module declares those calls
    in its ``op_activations``, a tuple of :class:`OpActivation`."""
    for module in model.modules():
        for call in getattr(module, "op_activations", ()):
            refuse_uncomputed(call.activation, call.field, ops.activations_of(call.op, backend), call.op, backend)


def refuse_uncomputed(activation: str, field: str, supported: Collection[str] | None, where: str, backend: ops.Ops):
    """One error, naming the config's ``field``, where ``activation`` is not among those ``backend``'s kernel of
    ``where`` computes (``supported``; None: every one)."""
    if supported is not None and activation not in supported:
        raise NotImplementedError(
            f"{field} {activation!r} is not supported in {where} on {backend.name}; "
            f"supported there: {', '.join(sorted(supported))} (every one on cpu)"
        )
