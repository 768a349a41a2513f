"""Gemma3ForCausalLM against HF transformers' modeling code (fp32, CPU)."""

import pytest
import torch

from tests.tiny_models import gemma3_config, prefill_logits, prompt, save_tiny_model
from xinfer import LLM, SamplingParams

CONFIGS = {
    "gemma3": lambda: gemma3_config(),
    "gemma3-softcaps": lambda: gemma3_config(attn_logit_softcapping=20.0, final_logit_softcapping=5.0),
}
PROMPT_LENGTHS = (3, 17, 61)  # 17 and 61 run past the 16-token window


def _randomize_norms(model: torch.nn.Module) -> None:
    # HF initializes Gemma norm weights to 0 (a scale of 1); random ones check the 1 + w
    generator = torch.Generator().manual_seed(1)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.5)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(CONFIGS[request.param](), folder)
    _randomize_norms(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, LLM(model=str(folder), dtype="float32", num_blocks=64)


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_prefill_logits_match_hf(models, length):
    hf, llm = models
    tokens = prompt(length)
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    got = prefill_logits(llm.engine, tokens)
    error = ((got - expected).abs().max(dim=-1).values / expected.abs().max(dim=-1).values).max()
    assert error <= 1e-4, f"max|diff|/max|HF logit| = {error:.2e} (worst position)"


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_greedy_tokens_match_hf_generate(models, length):
    hf, llm = models
    tokens = prompt(length, seed=1)
    expected = hf.generate(torch.tensor([tokens]), max_new_tokens=32, min_new_tokens=32, do_sample=False)[
        0, length:
    ].tolist()
    out = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected


def test_the_rope_fields_of_transformers_4_turn_each_layer_as_transformers_5_reads_them():
    """transformers 4's Gemma 3 config holds the global layers' rope in ``rope_theta`` and ``rope_scaling`` and the
    sliding layers' (unscaled) base in ``rope_local_base_freq``; transformers 5 reads those fields into per-layer-type
    ``rope_parameters``. A model built from the fields as transformers 4 holds them turns each layer alike."""
    from types import SimpleNamespace

    from xinfer.loading.loader import build_model

    legacy = dict(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})
    current = gemma3_config(rope_parameters=None, **legacy)
    assert set(current.rope_parameters) == {"full_attention", "sliding_attention"}  # transformers 5 read them
    as_transformers_4 = SimpleNamespace(**{**current.to_dict(), "rope_parameters": None, **legacy})

    def tables(config) -> list[torch.Tensor]:
        model = build_model(config, torch.device("cpu"), torch.float32)
        return [layer.self_attn.rotary_emb.cos_sin for layer in model.model.layers]

    expected = tables(current)
    assert not torch.equal(expected[0][:, :8], expected[1][:, :8])  # a sliding layer and a global one turn apart
    for got, want in zip(tables(as_transformers_4), expected, strict=True):
        assert torch.equal(got, want)


def test_float16_is_refused_when_asked_for_and_auto_takes_bf16_for_a_float16_checkpoint(tmp_path):
    """Gemma 3's activations outgrow float16 (vLLM refuses it the same way): asked for, one line before anything
    loads; under ``auto``, a checkpoint saved in float16 runs in bf16 on a GPU, as vLLM picks it."""
    from xinfer.config import EngineConfig
    from xinfer.engine.build import model_dtype

    config = gemma3_config()
    save_tiny_model(config, tmp_path)
    with pytest.raises(ValueError, match=r"^Gemma3ForCausalLM does not run in float16: its activations outgrow"):
        LLM(model=str(tmp_path), dtype="float16")
    config.dtype = torch.float16
    assert model_dtype(EngineConfig.from_kwargs(model=str(tmp_path)), config, "cuda") == torch.bfloat16
    assert model_dtype(EngineConfig.from_kwargs(model=str(tmp_path)), config, "cpu") == torch.float32
