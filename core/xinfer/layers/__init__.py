"""Model building blocks. They compute through :mod:`xinfer.ops`, never a backend directly."""

from xinfer.layers.activation import GeluTanhAndMul, SiluAndMul
from xinfer.layers.attention import Attention
from xinfer.layers.embedding import LMHead, VocabEmbedding
from xinfer.layers.linear import Linear, MergedLinear
from xinfer.layers.norm import RMSNorm, head_norms
from xinfer.layers.rotary import RotaryEmbedding, rope_parameters

__all__ = [
    "Attention",
    "GeluTanhAndMul",
    "LMHead",
    "Linear",
    "MergedLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "VocabEmbedding",
    "head_norms",
    "rope_parameters",
]
