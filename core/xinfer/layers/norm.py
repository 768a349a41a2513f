import torch
from torch import Tensor, nn

from xinfer import ops
from xinfer.distributed.group import Part, Slice, current


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight``; with ``residual``, adds it first and
    returns ``(normed, x + residual)``.

    ``weight_offset``: the checkpoint stores ``w`` where the model multiplies by
    ``weight_offset + w`` (Gemma: 1); the offset is added at load.
    """

    def __init__(self, dim: int, eps: float = 1e-6, weight_offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, residual: Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual)

    def project(
        self, x: Tensor, residual: Tensor | None, weight: Tensor, bias: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(linear(norm(h), weight, bias), norm(h), h)`` for ``h = x + residual`` (``x``
        without one): the norm in the prologue of the projection it feeds
        (:func:`xinfer.ops.norm_linear`)."""
        return ops.norm_linear(x, residual, self.weight, self.eps, weight, bias)

    def from_checkpoint(self, name: str, tensor: Tensor) -> Tensor:
        # in fp32, as the references add it at run time: 1 + w rounded in a bf16 checkpoint's dtype is off by up to
        # 2**-8 (the model's dtype rounds it once more where it is not fp32)
        return tensor.float() + self.weight_offset if self.weight_offset else tensor


class LayerNorm(nn.Module):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim (vision towers), in fp32;
    with ``residual``, adds it first and returns ``(normed, x + residual)`` (one launch on CUDA)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor, residual: Tensor | None = None):
        return ops.layer_norm(x, self.weight, self.bias, self.eps, residual)


def head_norms(q_norm: RMSNorm, k_norm: RMSNorm) -> ops.HeadNorms:
    """A model's per-head q/k norms as the one argument ``ops.rotary`` applies them from
    (the two share their eps)."""
    return ops.HeadNorms(q_norm.weight, k_norm.weight, q_norm.eps)


class SplitRMSNorm(RMSNorm):
    """An RMSNorm over a vector of ``dim`` values of which this rank holds ``part`` (and that part of
    the weight): the mean square is summed over the ranks (a replicated part counted on each of its
    ranks, as the denominator is)."""

    def __init__(self, dim: int, part: Part, eps: float = 1e-6):
        super().__init__(part.size(dim), eps)
        self.tp, self.part = current(), part

    def forward(self, x: Tensor, residual: Tensor | None = None):
        if self.tp.size == 1:
            return super().forward(x, residual)
        assert residual is None, "a split norm is not fused with the residual"
        x32 = x.float()
        square = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True))
        return (x32 * torch.rsqrt(square / (x.shape[-1] * self.tp.size) + self.eps) * self.weight.float()).to(x.dtype)

    def project(
        self, x: Tensor, residual: Tensor | None, weight: Tensor, bias: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        if self.tp.size == 1:
            return super().project(x, residual, weight, bias)
        assert residual is None, "a split norm is not fused with the residual"
        normed = self(x)  # (its mean square needs every rank's part)
        return ops.linear(normed, weight, bias), normed, x

    def rank_slice(self, name: str, shard: str | None, shape: torch.Size) -> Slice:
        return self.part.slice(shape[0])
