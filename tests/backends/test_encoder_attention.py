"""The CUDA backend's encoder attention (non-causal, within each segment of a flat batch: the
patches of each image) against the plain-torch reference, which runs torch's
scaled-dot-product attention image by image. Conventions as in test_cuda_kernels.py."""

from __future__ import annotations

import pytest
import torch

from tests.backends.test_cuda_kernels import CPU, DEVICE, ON_GPU, check, matrix, rand, ref32
from xinfer_cuda.kernels.encoder_attention import encoder_attention

# (segment lengths, heads, KV heads, head dim); a zero length is an empty segment
SMALL = [
    ([37], 4, 4, 64),
    ([5, 16, 1, 33], 4, 2, 72),  # a head dim no power of two (Qwen3-VL's and SigLIP's 72), GQA
    ([16, 0, 17], 2, 1, 32),
    ([3], 2, 2, 16),
]
LARGE = [
    ([4096], 16, 16, 72),  # one 1024x1024 image in Qwen3-VL-8B's encoder
    ([4096, 256, 1024, 4096], 16, 16, 72),  # several images of a step, in one launch
    ([4096, 4096], 16, 16, 72),  # two Gemma 3 (SigLIP) images
    ([700, 129], 12, 12, 128),
]


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def reference(q, k, v, cu, scale):
    return CPU.encoder_attention(ref32(q), ref32(k), ref32(v), cu.cpu(), scale)


@pytest.mark.parametrize("case, dtype", matrix(SMALL, LARGE, [torch.bfloat16]))
def test_encoder_attention(case, dtype):
    lengths, heads, kv_heads, head_dim = case
    total = sum(lengths)
    q, k, v = rand(total, heads, head_dim, dtype=dtype), rand(total, kv_heads, head_dim, dtype=dtype), rand(total, kv_heads, head_dim, dtype=dtype)  # fmt: skip
    cu, scale = cu_seqlens(lengths), head_dim**-0.5
    check(encoder_attention(q, k, v, cu, scale), reference(q, k, v, cu, scale), dtype)


def test_encoder_attention_reads_views_of_merged_qkv():
    """q, k, v as the vision towers make them: strided views of one projection's output [T, 3, H, D]."""
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    lengths, heads, head_dim = [20, 9], 2, 40
    qkv = rand(sum(lengths), 3, heads, head_dim, dtype=dtype, scale=2.0)
    q, k, v = qkv.unbind(1)
    cu = cu_seqlens(lengths)
    check(encoder_attention(q, k, v, cu, 0.3), reference(q, k, v, cu, 0.3), dtype)


def test_segments_do_not_see_each_other():
    """Changing one image's keys and values leaves the other's outputs as they were."""
    lengths, heads, head_dim = [18, 23], 2, 16
    q, k, v = (rand(sum(lengths), heads, head_dim) for _ in range(3))
    cu = cu_seqlens(lengths)
    out = encoder_attention(q, k, v, cu, 0.5)
    k[18:], v[18:] = rand(23, heads, head_dim), rand(23, heads, head_dim)
    again = encoder_attention(q, k, v, cu, 0.5)
    assert torch.equal(out[:18], again[:18])
    assert not torch.allclose(out[18:], again[18:])


def test_qwen3_vl_tower_on_the_cuda_kernels_matches_transformers():
    """The whole vision tower (rotary, encoder attention over three images of two grids and a
    two-frame clip, the mergers) through the CUDA backend's ops, against transformers' fp32 model."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from tests.plugins.qwen.vl_fixtures import load_hf_state, randomize_vision, tiny_vision_config
    from xinfer import ops
    from xinfer_cuda.ops import CudaOps
    from xinfer_qwen.vl_vision import VisionEncoder

    config = tiny_vision_config()
    config._attn_implementation = "eager"
    hf = Qwen3VLVisionModel(config).eval()
    randomize_vision(hf)
    ours = VisionEncoder(config).eval()
    load_hf_state(ours, hf)
    ours.to(DEVICE)
    grids = torch.tensor([[1, 6, 10], [1, 2, 4], [2, 4, 2], [1, 2, 4]])
    patches = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 4 * 4)
    with torch.inference_mode():
        out = hf(patches, grid_thw=grids)
        expected = torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)
        with ops.use(CudaOps()):
            got = ours(patches.to(DEVICE), [tuple(g) for g in grids.tolist()])
    check(got, expected, torch.float32)
