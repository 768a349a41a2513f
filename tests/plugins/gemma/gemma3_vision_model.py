"""A tiny random Gemma3ForConditionalGeneration (SigLIP encoder, projector, text model) with a word-level
tokenizer that knows Gemma 3's image tokens, and transformers' processor over both: the references of the
Gemma 3 vision tests."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessorPil,
    Gemma3Processor,
    PreTrainedTokenizerFast,
    SiglipVisionConfig,
)

from tests.plugins.hf_parity import randomize
from tests.tiny_models import gemma3_config

WORDS = ["look", "at", "this", "and", "that", "tell", "me", "what", "you", "see", "picture", "then", "again"]
SPECIAL = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
BOI, EOI, SOFT = 300, 301, 302  # <start_of_image>, <end_of_image>, <image_soft_token>
TOKENS_PER_IMAGE = 9  # 6x6 patches of 4 pixels, pooled 2x2 into 3x3
# content lists with {"type": "image"} items, as HF templates take them (Gemma 3's writes <start_of_image>)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image>"
    "{% else %}{{ p['text'] }}{% endif %}{% if not loop.last %} {% endif %}{% endfor %}{% endif %} {% endfor %}"
)
VISION = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, image_size=24,
              patch_size=4, layer_norm_eps=1e-6, vision_use_head=False)  # fmt: skip


def tokenizer() -> PreTrainedTokenizerFast:
    """Words, spaces, and runs of up to 4 newlines each one token (as Gemma's tokenizer has them, up to 31)."""
    vocab = {**SPECIAL, "\n\n": 4, " ": 5, **{w: 6 + i for i, w in enumerate(WORDS)}, "\n": 20, "\n\n\n": 21,
             "\n\n\n\n": 22}  # fmt: skip
    vocab |= {"<start_of_image>": BOI, "<end_of_image>": EOI, "<image_soft_token>": SOFT}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n+| |[^\s]+"), behavior="isolated")
    backend.add_special_tokens(["<pad>", "<eos>", "<bos>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>",
        chat_template=CHAT_TEMPLATE,
    )  # fmt: skip


def processor(**image_settings) -> Gemma3Processor:
    """transformers' processor; ``image_settings``: its image processor's (``resample``, ``image_mean``, ``size``...)."""
    size = VISION["image_size"]
    images = Gemma3ImageProcessorPil(**{"size": {"height": size, "width": size}, **image_settings})
    return Gemma3Processor(image_processor=images, tokenizer=tokenizer(), image_seq_length=TOKENS_PER_IMAGE)


def save_model(folder: Path, vision: dict | None = None, **text_overrides) -> Gemma3ForConditionalGeneration:
    """``vision``: SigLIP config fields over :data:`VISION`."""
    text = gemma3_config(architectures=None, pad_token_id=0, **text_overrides)
    config = Gemma3Config(
        text_config=text.to_dict(), vision_config=SiglipVisionConfig(**{**VISION, **(vision or {})}).to_dict(),
        mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=BOI, eoi_token_index=EOI, image_token_index=SOFT,
        architectures=["Gemma3ForConditionalGeneration"],
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(config).float().eval()
    randomize(hf, ("norm.weight", ".bias", "layer_norm1.weight", "layer_norm2.weight", "post_layernorm.weight"))
    with torch.no_grad():  # HF starts the projection at zero: random, at the scale of the text embeddings
        hf.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2)
    hf.save_pretrained(folder, safe_serialization=True)
    tokenizer().save_pretrained(folder)
    return hf


def image(seed: int, size: tuple[int, int] = (40, 30)) -> Image.Image:
    """A synthetic RGB image with structure: gradients, a bright square, noise."""
    generator = torch.Generator().manual_seed(seed)
    h, w = size[1], size[0]
    y, x = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
    pixels = torch.stack([x, y, (x + y) / 2]) * 200 + torch.rand(3, h, w, generator=generator) * 55
    top, left = (
        int(torch.randint(0, h // 2, (1,), generator=generator)),
        int(torch.randint(0, w // 2, (1,), generator=generator)),
    )
    pixels[:, top : top + h // 3, left : left + w // 3] = 250
    return Image.fromarray(pixels.round().clamp(0, 255).byte().permute(1, 2, 0).numpy(), "RGB")
