"""Every transformers class of each model type xinfer serves, saved with ``save_pretrained``, against transformers'
own forward of the saved folder (fp32, CPU): prefill logits and greedy tokens. The classes: the one a plugin
registers (``*ForCausalLM``, ``*ForConditionalGeneration``), transformers' base model (``*Model``: no LM head, its
embeddings tied; served by the class with a head, as transformers' auto classes load it), and a text-only class
loaded from an image-text checkpoint and saved again (its tensors keep the image-text names); and image-text
checkpoints as transformers 5.10 to 5.23 saved them (the text model's prefix doubled); and checkpoints saved under
transformers' in-memory names (``save_original_format=False``: fused experts, no renames reverted). Below them, what
cannot run is one error: a base model whose embeddings are not tied (no head), a base model no plugin has a head
for, and a base model's checkpoint lacking a weight."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from tests.plugins.deepseek.configs import deepseek_v2_config, deepseek_v3_config, glm4_moe_lite_config
from tests.plugins.deepseek.test_deepseek_v4 import deepseek_v4_config, randomize_v4
from tests.plugins.deepseek.test_deepseek_v32 import deepseek_v32_config
from tests.plugins.gemma import gemma3_vision_model, test_gemma4_conditional
from tests.plugins.gemma.test_gemma4 import DENSE, randomize_gemma4
from tests.plugins.glm.configs import glm4_config, glm4_moe_config, glm_config
from tests.plugins.hf_parity import assert_output_matches_hf, randomize, spread_routing
from tests.plugins.minimax.test_minimax_m2 import minimax_m2_config
from tests.plugins.qwen import test_qwen3_5_vl
from tests.plugins.qwen.test_qwen3_next import EXPERTS, HYBRID, randomize_hybrid
from tests.plugins.qwen.vl_fixtures import tiny_vl_config
from tests.plugins.test_config_variants import qwen2_moe, qwen3_moe
from tests.tiny_models import COMMON, gemma3_config, prefill_logits, prompt
from xinfer import LLM, SamplingParams
from xinfer.loading.errors import ModelFileError
from xinfer.loading.weights import MissingWeightsError
from xinfer.registry import UnknownArchitectureError

NEW_TOKENS = 6
TOKENS = 256  # prompts draw below every model's media tokens
HYBRID_MOE = {**{k: v for k, v in HYBRID.items() if k != "intermediate_size"}, **EXPERTS}


def qwen3_5(moe: bool, **overrides) -> PretrainedConfig:
    """An image-text Qwen3.5 (its text model tied where ``overrides`` say so, on both configs as transformers reads
    the wrapper's)."""
    text = {**(HYBRID_MOE if moe else HYBRID), "rope_parameters": test_qwen3_5_vl.ROPE, **overrides,
            "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text"}  # fmt: skip
    wrapper = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    return wrapper(text_config=text, vision_config=test_qwen3_5_vl.VISION, **test_qwen3_5_vl.TOKENS, **overrides)


def qwen3_vl(moe: bool, **overrides) -> PretrainedConfig:
    dense = tiny_vl_config(**overrides)
    if not moe:
        dense.tie_word_embeddings = overrides.get("tie_word_embeddings", False)
        return dense
    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    tokens = {key: getattr(dense, key) for key in
              ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}  # fmt: skip
    return transformers.Qwen3VLMoeConfig(text_config={**dense.text_config.to_dict(), **experts},
                                         vision_config=dense.vision_config.to_dict(), **tokens, **overrides)  # fmt: skip


def gemma3(**overrides) -> PretrainedConfig:
    text = gemma3_config(pad_token_id=0, **overrides)
    vision = transformers.SiglipVisionConfig(**gemma3_vision_model.VISION)
    return transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), boi_token_index=gemma3_vision_model.BOI,
        mm_tokens_per_image=gemma3_vision_model.TOKENS_PER_IMAGE, eoi_token_index=gemma3_vision_model.EOI,
        image_token_index=gemma3_vision_model.SOFT,
    )  # fmt: skip


def gemma4_text(**overrides) -> PretrainedConfig:
    return transformers.Gemma4TextConfig(**{**DENSE, **overrides})


def gemma4(**overrides) -> PretrainedConfig:
    vocab = test_gemma4_conditional.VOCAB
    text = gemma4_text(pad_token_id=0, vocab_size=vocab, vocab_size_per_layer_input=vocab, **overrides)
    vision = transformers.Gemma4VisionConfig(**test_gemma4_conditional.VISION)
    return transformers.Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                     **test_gemma4_conditional.SPECIAL_TOKENS)  # fmt: skip


@dataclass(frozen=True)
class ModelType:
    config: Callable[..., PretrainedConfig]  # takes config fields (tie_word_embeddings)
    head: str  # the class a plugin registers
    base: str | None  # transformers' base model of the model type
    randomizers: tuple[Callable[[torch.nn.Module], None], ...] = field(default=())


MODEL_TYPES = {
    "llama": ModelType(lambda **o: transformers.LlamaConfig(**{**COMMON, **o}), "LlamaForCausalLM", "LlamaModel"),
    "mistral": ModelType(lambda **o: transformers.MistralConfig(**{**COMMON, **o}), "MistralForCausalLM",
                         "MistralModel"),
    "phi3": ModelType(lambda **o: transformers.Phi3Config(**{**COMMON, **o}), "Phi3ForCausalLM", "Phi3Model"),
    "qwen2": ModelType(lambda **o: transformers.Qwen2Config(**{**COMMON, **o}), "Qwen2ForCausalLM", "Qwen2Model"),
    "qwen3": ModelType(lambda **o: transformers.Qwen3Config(**{**COMMON, **o}), "Qwen3ForCausalLM", "Qwen3Model"),
    "qwen2_moe": ModelType(lambda **o: qwen2_moe(shared_expert_intermediate_size=24, **o),
                           "Qwen2MoeForCausalLM", "Qwen2MoeModel"),
    "qwen3_moe": ModelType(qwen3_moe, "Qwen3MoeForCausalLM", "Qwen3MoeModel"),
    "qwen3_next": ModelType(lambda **o: transformers.Qwen3NextConfig(**{**HYBRID, **EXPERTS, "mlp_only_layers": [1],
                                                                        **o}),
                            "Qwen3NextForCausalLM", "Qwen3NextModel", (randomize_hybrid,)),
    "qwen3_5_text": ModelType(lambda **o: transformers.Qwen3_5TextConfig(**{**HYBRID, **o}), "Qwen3_5ForCausalLM",
                              "Qwen3_5TextModel", (randomize_hybrid,)),
    "qwen3_5_moe_text": ModelType(lambda **o: transformers.Qwen3_5MoeTextConfig(**{**HYBRID_MOE, **o}),
                                  "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextModel", (randomize_hybrid,)),
    "qwen3_5": ModelType(lambda **o: qwen3_5(False, **o), "Qwen3_5ForConditionalGeneration", "Qwen3_5Model",
                         (randomize_hybrid,)),
    "qwen3_5_moe": ModelType(lambda **o: qwen3_5(True, **o), "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeModel",
                             (randomize_hybrid,)),
    "qwen3_vl": ModelType(lambda **o: qwen3_vl(False, **o), "Qwen3VLForConditionalGeneration", "Qwen3VLModel"),
    "qwen3_vl_moe": ModelType(lambda **o: qwen3_vl(True, **o), "Qwen3VLMoeForConditionalGeneration",
                              "Qwen3VLMoeModel"),
    "gemma3_text": ModelType(gemma3_config, "Gemma3ForCausalLM", "Gemma3TextModel"),
    "gemma3": ModelType(gemma3, "Gemma3ForConditionalGeneration", "Gemma3Model"),
    "gemma4_text": ModelType(gemma4_text, "Gemma4ForCausalLM", "Gemma4TextModel", (randomize_gemma4,)),
    "gemma4": ModelType(gemma4, "Gemma4ForConditionalGeneration", "Gemma4Model", (randomize_gemma4,)),
    "glm": ModelType(glm_config, "GlmForCausalLM", "GlmModel"),
    "glm4": ModelType(glm4_config, "Glm4ForCausalLM", "Glm4Model"),
    "glm4_moe": ModelType(glm4_moe_config, "Glm4MoeForCausalLM", "Glm4MoeModel"),
    "glm4_moe_lite": ModelType(glm4_moe_lite_config, "Glm4MoeLiteForCausalLM", "Glm4MoeLiteModel"),
    "deepseek_v2": ModelType(deepseek_v2_config, "DeepseekV2ForCausalLM", "DeepseekV2Model"),
    "deepseek_v3": ModelType(deepseek_v3_config, "DeepseekV3ForCausalLM", "DeepseekV3Model"),
    "deepseek_v32": ModelType(deepseek_v32_config, "DeepseekV32ForCausalLM", "DeepseekV32Model"),
    "deepseek_v4": ModelType(deepseek_v4_config, "DeepseekV4ForCausalLM", "DeepseekV4Model",
                             (randomize_v4,)),
    "minimax_m2": ModelType(minimax_m2_config, "MiniMaxM2ForCausalLM", "MiniMaxM2Model"),
}  # fmt: skip


def saved(model_type: str, cls: str, folder: Path, original_format: bool = True, **fields) -> Path:
    """A random ``cls`` of ``model_type`` (its norms, biases and routers randomized), saved to ``folder``;
    ``original_format`` False: under transformers' in-memory names (experts fused, no renames reverted)."""
    spec = MODEL_TYPES[model_type]
    config = spec.config(**fields)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, cls)(config).float().eval()
    for randomizer in (randomize, spread_routing, *spec.randomizers):
        randomizer(model)
    model.save_pretrained(folder, safe_serialization=True, save_original_format=original_format)
    return folder


def saved_in_memory_format(model_type: str, cls: str, folder: Path) -> Path:
    return saved(model_type, cls, folder, original_format=False)


def saved_tied(model_type: str, cls: str, folder: Path) -> Path:
    return saved(model_type, cls, folder, tie_word_embeddings=True)


def resaved_from_image_text(model_type: str, cls: str, folder: Path) -> Path:
    """The image-text checkpoint of ``model_type`` loaded by transformers as ``cls`` and saved again."""
    source = saved(model_type, MODEL_TYPES[model_type].head, folder / "image-text")
    getattr(transformers, cls).from_pretrained(source, dtype=torch.float32).save_pretrained(folder / "text")
    return folder / "text"


def saved_with_the_text_model_prefix_doubled(model_type: str, cls: str, folder: Path) -> Path:
    """The checkpoint as transformers 5.10 to 5.23 saved it: the text model's ``model.language_model.``
    (``language_model.model.`` for Gemma 3) written ``model.language_model.model.`` (``language_model.model.model.``)."""
    saved(model_type, cls, folder)
    tensors = load_file(folder / "model.safetensors")
    text_model = re.compile(r"^(model\.language_model|language_model\.model)\.")
    save_file({text_model.sub(r"\1.model.", name): tensor for name, tensor in tensors.items()},
              folder / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    return folder


def transformers_reading(folder: Path) -> torch.nn.Module:
    """The saved folder as transformers' auto classes read it with a head: image-text-to-text where the model type
    has such a class, else causal LM."""
    config = transformers.AutoConfig.from_pretrained(folder)
    auto = AutoModelForImageTextToText if config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES else AutoModelForCausalLM  # fmt: skip
    return auto.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


CASES = [  # (model type, class, how its checkpoint is written, a tag for the test's id)
    *((model_type, spec.head, saved, "") for model_type, spec in MODEL_TYPES.items()),
    *((model_type, spec.base, saved_tied, "") for model_type, spec in MODEL_TYPES.items()),
    ("qwen3_5", "Qwen3_5ForCausalLM", resaved_from_image_text, "from-image-text"),
    ("qwen3_5_moe", "Qwen3_5MoeForCausalLM", resaved_from_image_text, "from-image-text"),
    *((model_type, MODEL_TYPES[model_type].head, saved_with_the_text_model_prefix_doubled, "5.10-5.23")
      for model_type in ("gemma3", "gemma4", "qwen3_vl", "qwen3_5")),
    *((model_type, MODEL_TYPES[model_type].head, saved_in_memory_format, "in-memory-format")
      for model_type in ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text", "qwen3_vl_moe", "gemma3", "deepseek_v3",
                         "deepseek_v4", "minimax_m2")),
]  # fmt: skip


@pytest.fixture(
    scope="module", params=CASES, ids=lambda case: "-".join(part for part in (case[0], case[1], case[3]) if part)
)
def models(request, tmp_path_factory):
    model_type, cls, checkpoint, tag = request.param
    folder = checkpoint(model_type, cls, tmp_path_factory.mktemp(f"{model_type}-{cls}{tag}"))
    return transformers_reading(folder), LLM(model=str(folder), dtype="float32", num_blocks=64)


def test_prefill_logits_match_transformers(models):
    hf, llm = models
    tokens = prompt(12, vocab_size=TOKENS)
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    got = prefill_logits(llm.engine, tokens)
    error = ((got - expected).abs().max(dim=-1).values / expected.abs().max(dim=-1).values).max()
    assert error <= 1e-4, f"max|diff|/max|HF logit| = {error:.2e} (worst position)"


def test_greedy_tokens_match_transformers(models):
    hf, llm = models
    tokens = prompt(9, vocab_size=TOKENS, seed=1)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    out = llm.generate([tokens], params)[0].outputs[0]
    assert_output_matches_hf(hf, tokens, out, NEW_TOKENS)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5", "gemma4_text"])
def test_a_base_model_without_tied_embeddings_is_refused_naming_its_head_class(tmp_path, model_type):
    spec = MODEL_TYPES[model_type]
    saved(model_type, spec.base, tmp_path, tie_word_embeddings=False)
    message = f"config.json names {spec.base}, transformers' base model without an LM head, and does not tie"
    with pytest.raises(ModelFileError, match=re.escape(message)):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64)


def test_a_base_model_no_plugin_has_a_head_for_is_an_unknown_architecture(tmp_path):
    text = tiny_vl_config().text_config  # Qwen3-VL's text model: transformers has no causal-LM class of it
    text.tie_word_embeddings = True
    torch.manual_seed(0)
    transformers.Qwen3VLTextModel(text).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(UnknownArchitectureError, match="unknown architecture 'Qwen3VLTextModel'"):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64)


def test_a_base_models_checkpoint_lacking_a_weight_names_it(tmp_path):
    saved("qwen3", "Qwen3Model", tmp_path, tie_word_embeddings=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["layers.1.self_attn.k_norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MissingWeightsError, match=re.escape("model.layers.1.self_attn.k_norm.weight")):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64)
