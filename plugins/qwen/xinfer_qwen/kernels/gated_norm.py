"""The gated RMSNorm of a Gated DeltaNet layer's output, ``rms_norm(o) * silu(z)`` per head, in
one launch (:func:`xinfer_qwen.deltanet_ops.gated_rms_norm` is its reference): the norm, the
SiLU and the product were three at batch 1, each costing more than its bytes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer.kernel_api import launch_chain


@triton.jit
def gated_rms_norm_head(x, z, weight, dim, eps):
    """``rms_norm(x) * silu(z)`` of one head's values ``x`` [D] (zeros past ``dim``), ``z`` and
    ``weight`` in fp32: the norm rounded to the dtype of ``x`` first, as the reference."""
    x32 = x.to(tl.float32)
    normed = (x32 * tl.rsqrt(tl.sum(x32 * x32, axis=0) / dim + eps)).to(x.dtype).to(tl.float32)
    return weight * normed * (z * tl.sigmoid(z))


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, weight_ptr, out_ptr, stride_x_t, stride_x_h, stride_z_t, stride_z_h, heads, dim, eps,
    BLOCK: tl.constexpr, ENTER: tl.constexpr,
):  # fmt: skip
    """One (row, head) of ``out`` [T, H, D] (contiguous)."""
    ENTER()
    row, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x_t + head * stride_x_h + cols, mask=mask, other=0.0)
    z = tl.load(z_ptr + row * stride_z_t + head * stride_z_h + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = gated_rms_norm_head(x, z, weight, dim, eps)
    tl.store(out_ptr + (row * heads + head) * dim + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """See :func:`xinfer_qwen.deltanet_ops.gated_rms_norm`; ``x`` and ``z`` [T, H, D] may be views
    with row and head strides (``z`` columns of the layer's projection)."""
    x, z = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, z))
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads * dim, dtype=x.dtype, device=x.device)
    if tokens:
        block = triton.next_power_of_2(dim)
        _gated_rms_norm_kernel[(tokens, heads)](
            x, z, weight, out, *x.stride()[:2], *z.stride()[:2], heads, dim, eps, BLOCK=block,
            num_warps=1 if block <= 256 else 4, **launch_chain(x.device),
        )  # fmt: skip
    return out
