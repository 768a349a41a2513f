"""Tiny random Gemma4ForConditionalGeneration checkpoints (vision encoder, embedder, text model) and
transformers' image processor for them: the references of the Gemma 4 vision tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig, Gemma4VisionConfig
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

from tests.plugins.gemma.test_gemma4 import DENSE, E_MODEL, MOE, randomize_gemma4
from tests.plugins.gemma.test_gemma4_conditional import SPECIAL_TOKENS, VOCAB

IMAGE, BOI, EOI = SPECIAL_TOKENS["image_token_id"], SPECIAL_TOKENS["boi_token_id"], SPECIAL_TOKENS["eoi_token_id"]
MAX_SOFT_TOKENS = 70  # the smallest budget transformers' processor takes: 630 patches of 4 pixels
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=16, patch_size=4, pooling_kernel_size=3, position_embedding_size=64)  # fmt: skip
VARIANTS = {
    # per-layer embeddings and KV sharing; image tokens attend causally, as in the E-models
    "e-model": dict(text=E_MODEL, vision={}),
    # experts beside the MLP; image tokens both ways in sliding layers; clipped linears, standardized output
    "moe": dict(text={**MOE, "use_bidirectional_attention": "vision"},
                vision={"use_clipped_linears": True, "standardize": True}),
}  # fmt: skip


def image_processor() -> Gemma4ImageProcessorPil:
    return Gemma4ImageProcessorPil(patch_size=VISION["patch_size"], max_soft_tokens=MAX_SOFT_TOKENS,
                                   pooling_kernel_size=VISION["pooling_kernel_size"])  # fmt: skip


def save_model(folder: Path, variant: str) -> Gemma4ForConditionalGeneration:
    settings = VARIANTS[variant]
    text = Gemma4TextConfig(**{**DENSE, **settings["text"], "architectures": None, "pad_token_id": 0,
                               "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB})  # fmt: skip
    config = Gemma4Config(
        text_config=text.to_dict(), vision_config=Gemma4VisionConfig(**VISION, **settings["vision"]).to_dict(),
        architectures=["Gemma4ForConditionalGeneration"], **SPECIAL_TOKENS,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = Gemma4ForConditionalGeneration(config).float().eval()
    randomize_gemma4(hf)
    randomize_vision(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    image_processor().save_pretrained(folder)
    return hf


def randomize_vision(hf: Gemma4ForConditionalGeneration) -> None:
    """Position tables, standardization and clipping bounds away from their initial values (clipping
    bounds that do clip), and the embedder at the scale of the text embeddings."""
    generator = torch.Generator().manual_seed(5)
    tower = hf.model.vision_tower
    with torch.no_grad():
        table = tower.patch_embedder.position_embedding_table
        table.copy_(torch.randn(table.shape, generator=generator))
        if tower.config.standardize:
            tower.std_bias.copy_(torch.randn(tower.std_bias.shape, generator=generator))
            tower.std_scale.copy_(0.5 + torch.rand(tower.std_scale.shape, generator=generator))
        for name, buffer in tower.named_buffers():
            if name.endswith(("input_min", "output_min")):
                buffer.fill_(-0.8 if "input" in name else -0.6)
            elif name.endswith(("input_max", "output_max")):
                buffer.fill_(0.9 if "input" in name else 0.7)
        hf.model.embed_vision.embedding_projection.weight.normal_(0, 0.2, generator=generator)
