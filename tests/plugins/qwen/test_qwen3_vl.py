"""Qwen3-VL through the engine against transformers' Qwen3VLForConditionalGeneration (tiny random
config, fp32, CPU, synthetic images): greedy tokens and log-probabilities with images in the
prompt, chunked prefill cutting through an image, the same image twice in a batch, the encoder cache."""

from __future__ import annotations

import pytest
import torch

from tests.plugins.hf_parity import assert_output_matches_hf, hf_greedy
from tests.plugins.qwen.vl_fixtures import (
    GREEDY,
    assert_matches_hf,
    hf_inputs,
    save_randomized,
    synthetic_image,
    text,
    tiny_vl_config,
    with_images,
)
from xinfer import LLM, SamplingParams


@pytest.fixture(scope="module")
def models(tiny_qwen3_vl):
    hf, folder = tiny_qwen3_vl
    return hf, LLM(model=str(folder), dtype="float32", num_blocks=96), folder


def test_one_image_matches_transformers(models):
    hf, llm, _ = models
    assert_matches_hf(hf, llm, with_images(text(5, 1), "image", text(7, 2)), [synthetic_image(40, 24)])


def test_two_images_of_different_grids_match_transformers(models):
    # the text after each image goes on from max(rows, columns) of its grid: the second image's
    # positions and the decode positions depend on both
    hf, llm, _ = models
    ids = with_images(text(3, 3), "image", text(4, 4), "image", text(2, 5))
    assert_matches_hf(hf, llm, ids, [synthetic_image(56, 16, seed=1), synthetic_image(20, 44, seed=2)])


def test_chunked_prefill_cutting_through_the_image_matches_transformers(models):
    hf, _, folder = models
    chunked = LLM(model=str(folder), dtype="float32", num_blocks=96, max_num_batched_tokens=8)
    ids = with_images(text(5, 6), "image", text(6, 7))
    assert_matches_hf(hf, chunked, ids, [synthetic_image(48, 32, seed=3)])


def test_mm_processor_kwargs_replace_the_image_processors_settings(models):
    """vLLM's mm_processor_kwargs: a lower max_pixels (the usual way to spend fewer tokens on an image) resizes
    the image as transformers' processor given it does; the saved preprocessor config's bound is 4x higher."""
    hf, _, folder = models
    fewer = LLM(model=str(folder), dtype="float32", num_blocks=96, mm_processor_kwargs={"max_pixels": 8 * 8 * 6})
    ids = with_images(text(4, 8), "image", text(3, 9))
    image = synthetic_image(48, 32, seed=4)
    assert_matches_hf(hf, fewer, ids, [image], max_pixels=8 * 8 * 6)
    assert len(hf_inputs(ids, [image])[0]) > len(hf_inputs(ids, [image], max_pixels=8 * 8 * 6)[0])


def test_mm_processor_kwargs_for_a_model_that_takes_no_images_is_refused(tmp_path):
    from transformers import LlamaConfig

    from tests.tiny_models import COMMON, save_tiny_model

    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    with pytest.raises(ValueError, match="takes no images: mm_processor_kwargs"):
        LLM(model=str(tmp_path), dtype="float32", mm_processor_kwargs={"max_pixels": 1024})


def test_same_image_twice_in_a_batch_gives_the_tokens_alone_and_hits_the_encoder_cache(models):
    _, llm, _ = models
    image = synthetic_image(32, 32, seed=4)
    ids = with_images(text(4, 8), "image", text(3, 9))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    hits = llm.engine.encoder_cache.hits
    twice = llm.generate([prompt, dict(prompt)], params)
    assert [o.outputs[0].token_ids for o in twice] == [alone, alone]
    assert llm.engine.encoder_cache.hits > hits


def test_another_image_with_the_same_tokens_changes_the_output(models):
    hf, llm, _ = models
    ids = with_images(text(6, 10), "image", text(2, 11))
    first = synthetic_image(32, 24, seed=5)
    second = synthetic_image(32, 24, seed=6)
    llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": first}}], GREEDY)
    assert_matches_hf(hf, llm, ids, [second])  # a prefix-cache hit on the first image's blocks would differ


def test_prompt_logprobs_with_two_images_are_transformers_logits(models):
    hf, llm, _ = models
    ids = with_images(text(5, 1), "image", text(4, 2), "image", text(3, 3))
    images = [synthetic_image(40, 24, seed=1), synthetic_image(20, 36, seed=2)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}], params)[0]
    expanded, inputs = hf_inputs(ids, images)
    with torch.inference_mode():
        expected = hf(input_ids=torch.tensor([expanded]), **inputs).logits[0, :-1].log_softmax(-1)
    following = torch.tensor(expanded[1:])
    got = torch.tensor([entry[token] for entry, token in zip(out.prompt_logprobs[1:], expanded[1:])])
    torch.testing.assert_close(got, expected.gather(1, following[:, None])[:, 0], atol=1e-4, rtol=0)


def test_text_alone_matches_transformers(models):
    hf, llm, _ = models
    tokens = text(20, 12)
    out = llm.generate([tokens], GREEDY)[0].outputs[0]
    assert_output_matches_hf(hf, tokens, out, GREEDY.max_tokens)


def test_deepstack_features_reach_the_text_model(models):
    """Without DeepStack's additions the tokens or log-probabilities differ (the check above is not
    blind to them)."""
    hf, _, _ = models
    ids = with_images(text(5, 1), "image", text(7, 2))
    expanded, inputs = hf_inputs(ids, [synthetic_image(40, 24)])
    expected = hf_greedy(hf, expanded, 4, **inputs)
    language_model = hf.model.language_model
    original = language_model._deepstack_process
    language_model._deepstack_process = lambda hidden, mask, embeds: hidden
    try:
        without = hf_greedy(hf, expanded, 4, **inputs)
    finally:
        language_model._deepstack_process = original
    assert without != expected


# 48: 2I != hidden, the layouts tell apart; 32: gate_up square, read in transformers' layout as transformers does
@pytest.mark.parametrize("inner", [48, 32])
def test_moe_text_model_with_an_image_matches_transformers(tmp_path, inner):
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from tests.plugins.hf_parity import spread_routing

    dense = tiny_vl_config()
    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=inner, decoder_sparse_step=1)
    config = Qwen3VLMoeConfig(text_config={**dense.text_config.to_dict(), **experts},
                              vision_config=dense.vision_config.to_dict(), image_token_id=dense.image_token_id,
                              video_token_id=dense.video_token_id, vision_start_token_id=dense.vision_start_token_id,
                              vision_end_token_id=dense.vision_end_token_id,
                              architectures=["Qwen3VLMoeForConditionalGeneration"])  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = Qwen3VLMoeForConditionalGeneration(config).float().eval()
    spread_routing(hf)
    save_randomized(hf, tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=64)
    assert_matches_hf(hf, llm, with_images(text(4, 13), "image", text(5, 14)), [synthetic_image(40, 24, seed=7)])


def test_preempted_sequences_with_images_match_transformers(models):
    """Two prompts of 3 and 4 blocks of 16, each with an image, in a pool of 7 blocks: decoding
    preempts one, which is recomputed from its image (positions and embeddings again)."""
    hf, _, folder = models
    small = LLM(model=str(folder), dtype="float32", num_blocks=7, max_model_len=80)
    images = [synthetic_image(40, 24, seed=11), synthetic_image(48, 32, seed=12)]  # 15 and 24 tokens
    ids = [with_images(text(20, 15), "image", text(7, 16)), with_images(text(16, 17), "image", text(10, 18))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    outputs = small.generate([{"prompt_token_ids": i, "multi_modal_data": {"image": m}} for i, m in zip(ids, images)],
                             params)  # fmt: skip
    assert small.engine.stats().num_preemptions > 0
    for i, image, out in zip(ids, images, outputs):
        expanded, inputs = hf_inputs(i, [image])
        assert_output_matches_hf(hf, expanded, out.outputs[0], params.max_tokens, **inputs)
