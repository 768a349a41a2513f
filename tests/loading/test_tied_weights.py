"""Tied word embeddings against transformers' ``from_pretrained`` (fp32, CPU), whatever the checkpoint holds under
``lm_head.weight`` and wherever it holds it: in the file before the embeddings (safetensors orders a file's tensors
by name), in a shard after theirs, in a shard before theirs. A config that ties them with a checkpoint holding a
different head is not tied (transformers unties it and warns); one holding the same values, or the head alone, is
tied; an untied config whose checkpoint lacks the head is one error (transformers draws a random head). Llama, Qwen3,
Gemma 3's text model and Qwen3-MoE in every case; image-text checkpoints and the plugins that tie their own head
with a different head."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen3Config, Qwen3MoeConfig

from tests.plugins.hf_parity import assert_prefill_logits_match, randomize, spread_routing
from tests.plugins.test_checkpoint_layouts import MODEL_TYPES, TOKENS, saved, transformers_reading
from tests.tiny_models import COMMON, gemma3_config, prefill_logits, prompt, save_tiny_model
from xinfer import LLM
from xinfer.loading.loader import build_model
from xinfer.loading.weights import MissingWeightsError

HEAD, EMBEDDINGS = "lm_head.weight", "model.embed_tokens.weight"
CONFIGS: dict[str, Callable[..., PretrainedConfig]] = {
    "llama": lambda **tie: LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"], **tie),
    "qwen3": lambda **tie: Qwen3Config(**COMMON, head_dim=32, architectures=["Qwen3ForCausalLM"], **tie),
    "gemma3-text": lambda **tie: gemma3_config(**tie),  # embeddings scaled by sqrt(hidden), the head not
    "qwen3-moe": lambda **tie: Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": 2}, head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"], **tie,
    ),
}  # fmt: skip


def saved_tensors(model_type: str, folder: Path, tie: bool) -> dict[str, torch.Tensor]:
    """A tiny random model of ``model_type`` (norms, biases and routers made to matter) saved by transformers into
    ``folder``; returns its tensors as saved (no head where ``tie``), the file then removed for the test to write."""
    hf = save_tiny_model(CONFIGS[model_type](tie_word_embeddings=tie), folder)
    randomize(hf)
    spread_routing(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    return tensors


def write(folder: Path, tensors: dict[str, torch.Tensor], layout: str) -> None:
    """``tensors`` as safetensors in ``layout``: ``one file`` (the head read before the embeddings), ``head in a
    later shard`` or ``head in an earlier shard`` (an index naming two files, read in the order of their names)."""
    if layout == "one file":
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return
    rest, head = {n: t for n, t in tensors.items() if n != HEAD}, {HEAD: tensors[HEAD]}
    files = (rest, head) if layout == "head in a later shard" else (head, rest)
    shards = {f"model-0000{i}-of-00002.safetensors": held for i, held in enumerate(files, 1)}
    weight_map = {}
    for shard, held in shards.items():
        save_file(held, folder / shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(held, shard)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def transformers_model(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def served(folder: Path) -> LLM:
    return LLM(model=str(folder), dtype="float32", num_blocks=32)


LAYOUTS = ["one file", "head in a later shard", "head in an earlier shard"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_a_tied_config_with_a_different_head_in_the_checkpoint_runs_untied_as_transformers(
    tmp_path, caplog, model_type, layout
):
    """Untied with one warning, as transformers warns."""
    tensors = saved_tensors(model_type, tmp_path, tie=True)
    tensors[HEAD] = torch.randn(tensors[EMBEDDINGS].shape, generator=torch.Generator().manual_seed(7)) * 0.1
    write(tmp_path, tensors, layout)
    hf = transformers_model(tmp_path)
    assert hf.lm_head.weight is not hf.model.embed_tokens.weight  # the reference: each its own
    with caplog.at_level("WARNING", logger="xinfer.loading.tied"):
        llm = served(tmp_path)
    warnings = [r.getMessage() for r in caplog.records if r.name == "xinfer.loading.tied"]
    assert len(warnings) == 1 and warnings[0].startswith(f"the config ties {HEAD} to {EMBEDDINGS}"), warnings
    model = llm.engine.model
    assert torch.equal(model.lm_head.weight, tensors[HEAD])
    assert torch.equal(model.model.embed_tokens.weight, tensors[EMBEDDINGS])
    assert_prefill_logits_match(hf, llm, 17)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_a_tied_config_with_the_same_head_in_the_checkpoint_stays_tied(tmp_path, model_type):
    tensors = saved_tensors(model_type, tmp_path, tie=True)
    tensors[HEAD] = tensors[EMBEDDINGS].clone()
    write(tmp_path, tensors, "one file")
    hf = transformers_model(tmp_path)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    llm = served(tmp_path)
    assert llm.engine.model.lm_head.weight is llm.engine.model.model.embed_tokens.weight
    assert_prefill_logits_match(hf, llm, 17)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_a_tied_config_whose_checkpoint_holds_only_the_head_embeds_with_it(tmp_path, model_type):
    """transformers ties the parameter that exists: the embeddings are the stored head."""
    tensors = saved_tensors(model_type, tmp_path, tie=True)
    tensors[HEAD] = tensors.pop(EMBEDDINGS)
    write(tmp_path, tensors, "one file")
    hf = transformers_model(tmp_path)
    assert torch.equal(hf.model.embed_tokens.weight, tensors[HEAD])
    llm = served(tmp_path)
    model = llm.engine.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, tensors[HEAD])
    assert_prefill_logits_match(hf, llm, 17)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_an_untied_config_whose_checkpoint_lacks_the_head_is_one_error_naming_it(tmp_path, model_type):
    """transformers loads it with a random head (reported missing); xinfer refuses, naming the head."""
    tensors = saved_tensors(model_type, tmp_path, tie=False)
    del tensors[HEAD]
    write(tmp_path, tensors, "one file")
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] == {HEAD}
    with pytest.raises(
        MissingWeightsError, match=r"^checkpoint lacks 1 weight\(s\) the model needs: lm_head\.weight"
    ) as error:
        served(tmp_path)
    assert "tie_word_embeddings false" in str(error.value)  # the likelier mistake: the config, not the file


@pytest.mark.parametrize("model_type", ["gemma3", "qwen3_5", "gemma4_text", "deepseek_v4"])
def test_a_different_head_unties_image_text_models_and_those_tying_in_their_plugin(tmp_path, model_type):
    """Image-text checkpoints (transformers ties by the wrapper's config; Qwen3.5's text config ties too) and the
    architectures that tie their own head (Gemma 4, DeepSeek V4), the head in a shard after the embeddings."""
    saved(model_type, MODEL_TYPES[model_type].head, tmp_path, tie_word_embeddings=True)
    tensors = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    embeddings = next(name for name in tensors if name.endswith("embed_tokens.weight"))
    tensors[HEAD] = torch.randn(tensors[embeddings].shape, generator=torch.Generator().manual_seed(7)) * 0.1
    write(tmp_path, tensors, "head in a later shard")
    hf = transformers_reading(tmp_path)
    assert torch.equal(hf.lm_head.weight, tensors[HEAD])
    llm = served(tmp_path)
    assert torch.equal(llm.engine.model.lm_head.weight, tensors[HEAD])
    tokens = prompt(12, vocab_size=TOKENS)
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(prefill_logits(llm.engine, tokens), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("same", [True, False], ids=["same head", "different head"])
def test_tensors_already_read_are_compared_through_the_parameter_they_filled(tmp_path, same):
    """A stream of tensors already read (as a GGUF file's are) is not kept alive for the comparison: the head is
    compared with the embeddings' parameter, with the same outcome."""
    tensors = saved_tensors("llama", tmp_path, tie=True)
    tensors[HEAD] = tensors[EMBEDDINGS].clone() if same else torch.randn(tensors[EMBEDDINGS].shape)
    model = build_model(CONFIGS["llama"](tie_word_embeddings=True), torch.device("cpu"), torch.float32)
    model.load_weights(sorted(tensors.items(), key=lambda item: item[0] == HEAD))  # the head last
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == same
    assert torch.equal(model.lm_head.weight, tensors[HEAD])
    assert torch.equal(model.model.embed_tokens.weight, tensors[EMBEDDINGS])
