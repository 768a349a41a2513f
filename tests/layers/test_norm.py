"""The norms against transformers' modules (fp32, CPU)."""

from __future__ import annotations

import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from xinfer import ops
from xinfer.layers.norm import RMSNorm
from xinfer.torch_ops import TorchOps


def test_a_zero_centred_norm_from_a_bf16_checkpoint_multiplies_by_one_plus_w_in_fp32():
    """Gemma's and Qwen3.5's norms multiply by 1 + w, which transformers computes in fp32 at run time: added in
    the checkpoint's bf16 at load, it was off by up to 2**-8 (logits 5e-3 apart on a tiny Gemma 3)."""
    torch.manual_seed(0)
    reference = Gemma3RMSNorm(64, eps=1e-6)
    reference.weight.data = (torch.randn(64) / 8).to(torch.bfloat16)  # as a bf16 checkpoint holds it
    norm = RMSNorm(64, eps=1e-6, weight_offset=1.0)
    norm.weight.data.copy_(norm.from_checkpoint("weight", reference.weight.data))
    x = torch.randn(5, 64)
    with ops.use(TorchOps()):
        torch.testing.assert_close(norm(x), reference(x), rtol=1e-6, atol=1e-6)
