"""Gemma4ForConditionalGeneration's checkpoint on text prompts: xinfer matches transformers' model
(fp32, CPU); an audio tower's tensors are skipped with one log line (images: test_gemma4_vision.py)."""

import logging

import pytest
import torch
from safetensors.torch import load_file
from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig, Gemma4VisionConfig

from tests.plugins.gemma.test_gemma4 import DENSE, E_MODEL, randomize_gemma4
from tests.plugins.hf_parity import (
    assert_greedy_tokens_and_logprobs_match,
    assert_output_matches_hf,
    assert_prefill_logits_match,
)
from tests.tiny_models import COMMON, prefill_logits, prompt
from xinfer import LLM, SamplingParams
from xinfer_gemma.gemma4 import text_part

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16)  # fmt: skip
VOCAB = COMMON["vocab_size"] + 8  # the special tokens past the ids prompts draw from (HF masks them as media)
SPECIAL_TOKENS = dict(
    image_token_id=VOCAB - 7, boi_token_id=VOCAB - 6, eoi_token_id=VOCAB - 5, video_token_id=VOCAB - 4,
    boa_token_id=VOCAB - 3, eoa_token_index=VOCAB - 2, audio_token_id=VOCAB - 1,
)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4-vision")
    text = Gemma4TextConfig(  # pad_token_id: HF masks the media placeholders with it
        **{
            **DENSE,
            **E_MODEL,
            "architectures": None,
            "pad_token_id": 0,
            "vocab_size": VOCAB,
            "vocab_size_per_layer_input": VOCAB,
        },
    )
    config = Gemma4Config(
        text_config=text.to_dict(), vision_config=Gemma4VisionConfig(**VISION).to_dict(),
        architectures=["Gemma4ForConditionalGeneration"], **SPECIAL_TOKENS,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = Gemma4ForConditionalGeneration(config).float().eval()
    randomize_gemma4(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, folder


@pytest.fixture(scope="module")
def models(checkpoint):
    hf, folder = checkpoint
    return hf, LLM(model=str(folder), dtype="float32", num_blocks=64, max_num_batched_tokens=32)


def test_the_audio_tower_is_skipped_with_one_log_line(checkpoint, caplog):
    _, folder = checkpoint
    tensors = load_file(folder / "model.safetensors")
    audio = {
        "model.audio_tower.layers.0.weight": torch.ones(1),
        "model.embed_audio.embedding_projection.weight": torch.ones(1),
    }
    with caplog.at_level(logging.INFO, logger="xinfer_gemma.gemma4"):
        names = [name for name, _ in text_part({**tensors, **audio}.items())]
    assert not any(name.startswith(("model.audio_tower.", "model.embed_audio.")) for name in names)
    assert "model.embed_tokens.weight" in names and "model.vision_tower.patch_embedder.input_proj.weight" in names
    assert len([r for r in caplog.records if "audio" in r.getMessage()]) == 1


@pytest.mark.parametrize("length", (3, 61))
def test_prefill_logits_match_hf(models, length):
    assert_prefill_logits_match(*models, length)


def test_greedy_tokens_and_logprobs_match_hf(models):
    assert_greedy_tokens_and_logprobs_match(*models, 40)


def test_media_placeholders_in_a_text_prompt_are_embedded_as_the_pad_token(models):
    """transformers embeds every image, video and audio placeholder as the pad token (with its per-layer
    inputs), images given or not: so does xinfer, in a text prompt's tokens and in the ones it generates."""
    hf, llm = models
    media = [SPECIAL_TOKENS[name] for name in ("image_token_id", "video_token_id", "audio_token_id")]
    tokens = prompt(9, seed=5) + media + prompt(7, seed=6)
    assert 0 not in tokens  # the pad: transformers' generate takes it for padding
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(prefill_logits(llm.engine, tokens), expected, atol=1e-4, rtol=0)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    assert_output_matches_hf(hf, tokens, llm.generate([tokens], params)[0].outputs[0], 8)
