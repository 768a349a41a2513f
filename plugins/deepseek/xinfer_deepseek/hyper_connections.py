"""Manifold-constrained hyper-connections (mHC, DeepSeek V4): the residual is ``N`` (``hc_mult``)
parallel streams [T, N, D]. Around each block, weights computed from the streams (RMS-normed
without weight, one linear map) collapse them into the block's input and mix the block's
output back::

    pre, post, comb = split(rms(streams) @ fn.T * scale + base)   # N, N and N x N per token
    input   = sum_i (sigmoid(pre_i) + eps) * streams_i
    streams = 2 sigmoid(post)_i * block(input) + sum_j comb_ji * streams_j

``comb`` is ``softmax(rows) + eps`` made doubly stochastic by ``hc_sinkhorn_iters`` alternating
column and row normalisations (Sinkhorn-Knopp). All of it in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _rms(x: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    """One block's mHC (HF names ``fn``, ``base``, ``scale``): :meth:`collapse` gives the block's
    input and the weights that :meth:`expand` mixes its output with."""

    def __init__(self, streams: int, hidden: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.streams, self.sinkhorn_iters, self.hc_eps, self.norm_eps = streams, sinkhorn_iters, hc_eps, norm_eps
        size = (2 + streams) * streams
        self.fn = nn.Parameter(torch.empty(size, streams * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(size, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def collapse(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The block's input [T, D] (in the streams' dtype), ``post`` [T, N] and ``comb`` [T, N, N]."""
        n = self.streams
        mixes = F.linear(_rms(streams.flatten(1).float(), self.norm_eps), self.fn.float())
        pre, post, comb = mixes.split([n, n, n * n], dim=-1)
        pre_base, post_base, comb_base = self.base.split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        pre = torch.sigmoid(pre * pre_scale + pre_base) + self.hc_eps
        post = 2 * torch.sigmoid(post * post_scale + post_base)
        comb = torch.softmax(comb.unflatten(-1, (n, n)) * comb_scale + comb_base.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return collapsed, post, comb

    @staticmethod
    def expand(output: Tensor, streams: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        """The streams after the block: its ``output`` [T, D] spread by ``post``, the old ``streams``
        mixed by ``comb`` (stream ``k`` gets ``sum_j comb[j, k] * streams_j``)."""
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """The streams collapsed into one before the final norm (HF names ``hc_fn``, ``hc_base``, ``hc_scale``)."""

    def __init__(self, streams: int, hidden: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(streams, streams * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(streams, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: Tensor) -> Tensor:
        mixes = F.linear(_rms(streams.flatten(1).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
