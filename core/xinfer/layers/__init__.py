"""Model building blocks. They compute through :mod:`xinfer.ops`, never a backend directly.

An architecture composes them: most are a :class:`DecoderForCausalLM` with a :class:`DecoderSpec`.
"""

from xinfer.layers.activation import GeluAndMul, GeluTanhAndMul, SiluAndMul, activation, gated_activation
from xinfer.layers.attention import Attention
from xinfer.layers.causal_lm import DecoderForCausalLM, DecoderSpec
from xinfer.layers.decoder import DecoderModel
from xinfer.layers.decoder_layer import DecoderLayer, NormsItsInput, SandwichDecoderLayer, normed_block
from xinfer.layers.embedding import LMHead, VocabEmbedding
from xinfer.layers.linear import ColumnLinear, FloatLinear, Linear, MergedLinear, RowLinear
from xinfer.layers.mlp import GatedMLP
from xinfer.layers.moe import MoE, Router, Routing
from xinfer.layers.norm import LayerNorm, RMSNorm, SplitRMSNorm, head_norms
from xinfer.layers.rotary import RotaryEmbedding, pairs_to_halves, rope_parameters
from xinfer.layers.self_attention import SelfAttention

__all__ = [
    "Attention",
    "ColumnLinear",
    "DecoderForCausalLM",
    "DecoderLayer",
    "DecoderModel",
    "DecoderSpec",
    "GatedMLP",
    "GeluAndMul",
    "GeluTanhAndMul",
    "LMHead",
    "LayerNorm",
    "FloatLinear",
    "Linear",
    "MergedLinear",
    "MoE",
    "NormsItsInput",
    "RMSNorm",
    "RotaryEmbedding",
    "RowLinear",
    "Router",
    "Routing",
    "SandwichDecoderLayer",
    "SelfAttention",
    "SiluAndMul",
    "SplitRMSNorm",
    "VocabEmbedding",
    "activation",
    "gated_activation",
    "head_norms",
    "normed_block",
    "pairs_to_halves",
    "rope_parameters",
]
