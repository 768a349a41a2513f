"""Every activation a config may name is transformers' (its ACT2FN), by name and alias, plain and gated."""

import pytest
import torch
from transformers.activations import ACT2FN

from xinfer import ops
from xinfer.layers.activation import ACTIVATIONS, ALIASES, activation, gated_activation
from xinfer_cpu.ops import CpuOps

# the two of transformers' with weights of their own (a checkpoint would hold them): not served
WITH_WEIGHTS = {"prelu", "xielu"}
NAMES = sorted(set(ACT2FN) - WITH_WEIGHTS)


def test_every_weightless_activation_of_transformers_is_known():
    assert set(NAMES) == set(ACTIVATIONS) | set(ALIASES)


@pytest.mark.parametrize("name", NAMES)
def test_activation_is_transformers(name):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 4
    torch.testing.assert_close(activation(name)(x), ACT2FN[name](x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_gated_activation_is_act_of_gate_times_up(name):
    gate, up = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1)) * 4
    with ops.use(CpuOps()):  # the fused ones are the backend's ops
        got = gated_activation(name)(torch.cat([gate, up], dim=-1))
    torch.testing.assert_close(got, ACT2FN[name](gate) * up, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("name", sorted(WITH_WEIGHTS))
def test_an_activation_with_weights_is_one_error(name):
    with pytest.raises(NotImplementedError, match=f"hidden_act {name!r} is not supported"):
        gated_activation(name)
