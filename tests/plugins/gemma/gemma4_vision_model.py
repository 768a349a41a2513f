"""Tiny random Gemma4ForConditionalGeneration checkpoints (vision encoder, embedder, text model) and
transformers' image processor for them: the references of the Gemma 4 vision tests."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
from transformers import (
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    Gemma4VisionConfig,
    PreTrainedTokenizerFast,
)
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


WORDS = ["look", "at", "this", "and", "tell", "me", "what", "you", "see"]
# content lists with {"type": "image"} items, as HF templates take them (Gemma 4's writes <|image|>)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|image|>"
    "{% else %}{{ p['text'] }}{% endif %}{% if not loop.last %} {% endif %}{% endfor %}{% endif %} {% endfor %}"
)


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer that knows Gemma 4's image tokens, with a chat template writing ``<|image|>``."""
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, " ": 4, **{w: 5 + i for i, w in enumerate(WORDS)}}
    vocab |= {"<|image|>": IMAGE, "<|image>": BOI, "<image|>": EOI}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r" |[^\s]+"), behavior="isolated")
    backend.add_special_tokens(["<pad>", "<eos>", "<bos>", "<|image|>", "<|image>", "<image|>"])
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", chat_template=CHAT_TEMPLATE)  # fmt: skip


def image_processor(**settings) -> Gemma4ImageProcessorPil:
    """transformers' image processor; ``settings``: its other fields (``resample``, ``do_normalize``...)."""
    return Gemma4ImageProcessorPil(patch_size=VISION["patch_size"], max_soft_tokens=MAX_SOFT_TOKENS,
                                   pooling_kernel_size=VISION["pooling_kernel_size"], **settings)  # fmt: skip


def save_model(
    folder: Path, variant: str, vision: dict | None = None, **image_settings
) -> Gemma4ForConditionalGeneration:
    """The checkpoint of ``variant``; ``vision``: config fields over its vision config's, ``image_settings``:
    its image processor's (:func:`image_processor`)."""
    settings = VARIANTS[variant]
    text = Gemma4TextConfig(**{**DENSE, **settings["text"], "architectures": None, "pad_token_id": 0,
                               "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB})  # fmt: skip
    config = Gemma4Config(
        text_config=text.to_dict(), vision_config=Gemma4VisionConfig(**{**VISION, **settings["vision"], **(vision or {})}).to_dict(),
        architectures=["Gemma4ForConditionalGeneration"], **SPECIAL_TOKENS,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = Gemma4ForConditionalGeneration(config).float().eval()
    randomize_gemma4(hf)
    randomize_vision(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    image_processor(**image_settings).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
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
