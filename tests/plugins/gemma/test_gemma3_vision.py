"""Gemma3ForConditionalGeneration with images against transformers' model and processor (fp32, CPU):
the prompt expansion, greedy tokens and log-probabilities, prefill chunks around an image, the
encoder cache, and prefix caching keyed by image content."""

import json

import pytest
from transformers import Gemma3Processor

from tests.plugins.gemma.gemma3_vision_model import BOI, SOFT, TOKENS_PER_IMAGE, image, processor, save_model
from tests.plugins.hf_parity import assert_output_matches_hf, hf_greedy
from xinfer import LLM, SamplingParams

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
TEXT = "look at <start_of_image> and tell me what you see"


@pytest.fixture(scope="module")
def hf_and_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3-vision")
    return save_model(folder), folder


@pytest.fixture(scope="module")
def llm(hf_and_folder):
    return LLM(model=str(hf_and_folder[1]), dtype="float32", num_blocks=64)


def hf_inputs(text: str, images, **image_settings) -> dict:
    return dict(processor(**image_settings)(text=text, images=images, return_tensors="pt"))


def assert_matches_hf(hf, text: str, images, output, **image_settings) -> None:
    inputs = hf_inputs(text, images, **image_settings)
    assert output.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert_output_matches_hf(hf, output.prompt_token_ids, output.outputs[0], NEW_TOKENS,
                             pixel_values=inputs["pixel_values"], token_type_ids=inputs["token_type_ids"])  # fmt: skip


def test_greedy_tokens_and_logprobs_match_hf(hf_and_folder, llm):
    hf, _ = hf_and_folder
    out = llm.generate({"prompt": TEXT, "multi_modal_data": {"image": image(1)}}, GREEDY)[0]
    assert_matches_hf(hf, TEXT, [image(1)], out)


def test_the_reference_tells_bidirectional_image_attention_from_causal(hf_and_folder):
    """The check above can fail on the mask: transformers' causal run over the same inputs differs."""
    hf, _ = hf_and_folder
    inputs = hf_inputs(TEXT, [image(1)])
    ids = inputs["input_ids"][0].tolist()
    _, both_ways = hf_greedy(hf, ids, 1, pixel_values=inputs["pixel_values"], token_type_ids=inputs["token_type_ids"])
    _, causal = hf_greedy(hf, ids, 1, pixel_values=inputs["pixel_values"])
    assert abs(both_ways[0] - causal[0]) > 1e-3


def test_two_images_and_token_ids_with_placeholders(hf_and_folder, llm):
    hf, _ = hf_and_folder
    text = "look at <start_of_image> then <start_of_image> and tell me"
    images = [image(2), image(3, (30, 50))]
    ids = processor().tokenizer(text)["input_ids"]
    assert ids.count(BOI) == 2
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, GREEDY)[0]
    assert_matches_hf(hf, text, images, out)


def test_prefill_chunks_end_before_an_image_not_inside_it(hf_and_folder):
    """With 12 tokens a step the first chunk would end inside the image (tokens 7 to 16): it ends at 7,
    the next takes the whole image; the tokens are transformers'."""
    hf, folder = hf_and_folder
    llm = LLM(model=str(folder), dtype="float32", num_blocks=64, max_num_batched_tokens=12)
    out = llm.generate({"prompt": TEXT, "multi_modal_data": {"image": image(1)}}, GREEDY)[0]
    assert_matches_hf(hf, TEXT, [image(1)], out)


def test_a_chunk_cutting_through_an_image_takes_its_slice_of_the_embeddings(hf_and_folder):
    """Where image tokens attend causally (as Qwen3-VL's do; transformers' Gemma 3 without token_type_ids),
    chunks of 12 tokens cut the image (tokens 7 to 16) and each takes its part of the encoder output."""
    hf, folder = hf_and_folder
    llm = LLM(model=str(folder), dtype="float32", num_blocks=64, max_num_batched_tokens=12)
    llm.engine.model.attend_within_items = False
    out = llm.generate({"prompt": TEXT, "multi_modal_data": {"image": image(1)}}, GREEDY)[0]
    inputs = hf_inputs(TEXT, [image(1)])
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert_output_matches_hf(hf, out.prompt_token_ids, out.outputs[0], NEW_TOKENS, pixel_values=inputs["pixel_values"])
    cache = llm.engine.encoder_cache
    assert (cache.misses, cache.hits) == (1, 1)  # encoded for the first chunk, looked up for the second


def test_an_image_longer_than_a_step_is_refused(hf_and_folder):
    llm = LLM(model=str(hf_and_folder[1]), dtype="float32", num_blocks=64, max_num_batched_tokens=TOKENS_PER_IMAGE - 1)
    with pytest.raises(ValueError, match="more than max_num_batched_tokens"):
        llm.generate({"prompt": TEXT, "multi_modal_data": {"image": image(1)}}, GREEDY)


def test_the_same_image_twice_in_a_batch_is_encoded_once_and_again_not_at_all(hf_and_folder, llm):
    hf, _ = hf_and_folder
    texts = ["look at <start_of_image> and tell me", "tell me what you see <start_of_image> again"]
    cache = llm.engine.encoder_cache
    misses, hits = cache.misses, cache.hits
    pair = llm.generate([{"prompt": text, "multi_modal_data": {"image": image(8)}} for text in texts], GREEDY)
    assert cache.misses == misses + 1
    for text, out in zip(texts, pair):
        assert_matches_hf(hf, text, [image(8)], out)
    third = "what you see <start_of_image> and that"  # no prefix in common: its image is looked up
    llm.generate({"prompt": third, "multi_modal_data": {"image": image(8)}}, GREEDY)
    assert cache.misses == misses + 1 and cache.hits == hits + 1


def test_the_same_tokens_with_another_image_do_not_hit_the_prefix_cache(hf_and_folder, llm):
    hf, _ = hf_and_folder
    text = "look at this and that picture and <start_of_image> tell me what you see"  # text to 16, image 18 to 27
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": image(5)}}, GREEDY)[0]
    again = llm.generate({"prompt": text, "multi_modal_data": {"image": image(5)}}, GREEDY)[0]
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == first.outputs[0].token_ids
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": image(6)}}, GREEDY)[0]
    assert other.num_cached_tokens == 16  # the text block, not the one holding the other image
    assert_matches_hf(hf, text, [image(6)], other)


def test_a_palette_image_with_other_colours_is_another_image(hf_and_folder, llm):
    """Found by fuzzing: two palette images with the same indices and other palettes (or a transparent index)
    hashed alike, so the second took the first's encoder output and prefix-cache blocks."""
    hf, _ = hf_and_folder
    first = image(9).convert("P")
    llm.generate({"prompt": TEXT, "multi_modal_data": {"image": first}}, GREEDY)
    recoloured = first.copy()
    palette = first.getpalette()
    recoloured.putpalette(palette[3:] + palette[:3])  # each index shows its neighbour's colour
    transparent = first.copy()
    transparent.info["transparency"] = first.getpixel((0, 0))
    for other in (recoloured, transparent):
        out = llm.generate({"prompt": TEXT, "multi_modal_data": {"image": other}}, GREEDY)[0]
        assert out.num_cached_tokens == 0
        assert_matches_hf(hf, TEXT, [other], out)


def test_a_prefix_hit_ending_inside_an_image_computes_the_rest_of_it(hf_and_folder, llm):
    """The first block (16 tokens) holds part of the image; a prompt that shares it and goes on otherwise
    takes the rest of the image's embeddings from its encoder output."""
    hf, _ = hf_and_folder
    shared = "look at this and <start_of_image>"  # image at 11 to 20
    llm.generate({"prompt": shared + " tell me", "multi_modal_data": {"image": image(7)}}, GREEDY)
    text = shared + " what you see again"
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": image(7)}}, GREEDY)[0]
    assert out.num_cached_tokens == 16
    assert_matches_hf(hf, text, [image(7)], out)


def test_chat_takes_image_parts(hf_and_folder, llm):
    hf, _ = hf_and_folder
    messages = [{"role": "user", "content": [{"type": "text", "text": "look at"},
                                             {"type": "image_pil", "image_pil": image(9)}]}]  # fmt: skip
    out = llm.chat(messages, GREEDY)[0]
    text = processor().tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "look at"}, {"type": "image"}]}], tokenize=False
    )
    assert_matches_hf(hf, text.removeprefix("<bos>"), [image(9)], out)


def test_a_text_only_model_refuses_images(tmp_path):
    from tests.tiny_models import gemma3_config, save_tiny_model

    save_tiny_model(gemma3_config(), tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=32)
    with pytest.raises(ValueError, match="takes text only"):
        llm.generate({"prompt_token_ids": [5, 6, 7], "multi_modal_data": {"image": image(1)}})


@pytest.mark.parametrize("text", ["look at\n<start_of_image>\n\nthis", "look\n\n<start_of_image><start_of_image>\nat"])
def test_newlines_beside_an_image_join_its_newlines_as_transformers_tokenizes_them(hf_and_folder, llm, text):
    """Found by fuzzing with Gemma's tokenizer: transformers writes "\\n\\n" around an image into the text, where
    "\\n" and "\\n\\n" become one token "\\n\\n\\n" (a chat turn "user\\n" then an image); xinfer wrote two."""
    hf, _ = hf_and_folder
    images = [image(1), image(2)][: text.count("<start_of_image>")]
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY)[0]
    assert {21, 22} & set(out.prompt_token_ids)  # runs of 3 and 4 newlines
    assert_matches_hf(hf, text, images, out)


def test_placeholders_and_images_must_agree(llm):
    with pytest.raises(ValueError, match="1 image placeholder"):
        llm.generate({"prompt": TEXT, "multi_modal_data": {"image": [image(1), image(2)]}})


def test_a_checkpoint_with_its_own_activation_processor_and_tying_matches_hf(tmp_path):
    """SigLIP's hidden_act, the saved processor's filter and statistics, and the wrapper's
    tie_word_embeddings (true, which rules over its text config's false) are the checkpoint's; the text
    config's final_logit_softcapping is not (transformers' Gemma3ForConditionalGeneration never soft-caps)."""
    settings = dict(resample=3, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    hf = save_model(tmp_path, vision=dict(hidden_act="quick_gelu"), tie_word_embeddings=False,
                    final_logit_softcapping=5.0)  # fmt: skip
    processor(**settings).save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=32)
    out = llm.generate({"prompt": TEXT, "multi_modal_data": {"image": image(1)}}, GREEDY)[0]
    assert_matches_hf(hf, TEXT, [image(1)], out, **settings)


def test_a_patch_grid_pooling_to_another_token_count_is_refused_as_transformers_does(tmp_path):
    """Found by fuzzing: 5x5 patches pool (kernel 5 // 3 = 1) to 25 soft tokens, not the config's 9; transformers
    refuses the image, xinfer wrote 9 of the 25 into the prompt. The checkpoint is refused at load."""
    hf = save_model(tmp_path, vision=dict(image_size=20))
    inputs = hf_inputs(TEXT, [image(1)], size={"height": 20, "width": 20})
    with pytest.raises(ValueError, match="do not match"):
        hf(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"], token_type_ids=inputs["token_type_ids"])
    with pytest.raises(ValueError, match=r"mm_tokens_per_image=9 .* 5 patches a side"):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=32)


def test_a_patch_grid_whose_pooling_drops_a_row_matches_hf(tmp_path):
    """7x7 patches pool by 7 // 3 = 2 into 3x3 (the last row and column of patches dropped), as transformers'."""
    hf = save_model(tmp_path, vision=dict(image_size=28))
    processor(size={"height": 28, "width": 28}).save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=32)
    out = llm.generate({"prompt": TEXT, "multi_modal_data": {"image": image(1)}}, GREEDY)[0]
    assert_matches_hf(hf, TEXT, [image(1)], out, size={"height": 28, "width": 28})


def test_a_vision_encoder_of_other_than_three_channels_is_refused_at_load(tmp_path):
    """Found by sweeping: with num_channels=1 transformers' encoder fails on the processor's RGB pixels; xinfer
    failed in its patch GEMM at the request."""
    hf = save_model(tmp_path, vision=dict(num_channels=1))
    inputs = hf_inputs(TEXT, [image(1)])
    with pytest.raises(RuntimeError, match="channels"):
        hf(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"], token_type_ids=inputs["token_type_ids"])
    with pytest.raises(ValueError, match=r"num_channels=1: images reach the encoder as RGB \(3\)"):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=32)


def test_a_vision_width_not_split_evenly_into_heads_is_refused_at_load(tmp_path):
    """Found by sweeping: transformers refuses to build SigLIP with 48 split over 5 heads; a checkpoint saying so
    failed inside xinfer's encoder attention at the request."""
    with pytest.raises(ValueError, match="embed_dim must be divisible by num_heads"):
        save_model(tmp_path / "hf", vision=dict(num_attention_heads=5))
    save_model(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["vision_config"]["num_attention_heads"] = 5
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"vision_config.hidden_size 48 is not a multiple of num_attention_heads 5"):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=32)


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        (
            dict(size={"height": 28, "width": 28}),
            r"size \{'height': 28, 'width': 28\} is not the vision config's image_size",
        ),
        (dict(do_resize=False), "do_resize is false"),
    ],
)
def test_an_image_processor_handing_the_encoder_another_size_is_refused_at_load(tmp_path, settings, error):
    """Found by sweeping: a saved processor whose size is not SigLIP's image_size, or that does not resize, gives
    transformers' encoder more patches than it has positions for; xinfer resized to image_size and answered."""
    hf = save_model(tmp_path)
    processor(**settings).save_pretrained(tmp_path)
    inputs = hf_inputs(TEXT, [image(1, (37, 29))], **settings)
    with pytest.raises(RuntimeError, match="must match the size"):
        hf(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"], token_type_ids=inputs["token_type_ids"])
    with pytest.raises(ValueError, match=error):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=32)


def test_a_processor_writing_another_number_of_soft_tokens_is_refused_at_load(tmp_path):
    """Found by sweeping: a saved processor whose image_seq_length (4) is not the config's mm_tokens_per_image (9)
    writes 4 soft tokens an image, and transformers' model refuses them; xinfer wrote 9 and answered."""
    hf = save_model(tmp_path)
    image_processor = processor().image_processor
    short = Gemma3Processor(image_processor=image_processor, tokenizer=processor().tokenizer, image_seq_length=4)
    short.save_pretrained(tmp_path)
    inputs = dict(short(text=TEXT, images=[image(1)], return_tensors="pt"))
    with pytest.raises(ValueError, match="do not match"):
        hf(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"], token_type_ids=inputs["token_type_ids"])
    with pytest.raises(ValueError, match=r"image_seq_length \(4\) is not the config's mm_tokens_per_image \(9\)"):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=32)


@pytest.mark.parametrize("tokens_per_image", [36, 4])
def test_other_soft_token_counts_match_hf(tmp_path, monkeypatch, tokens_per_image):
    """Swept: 6x6 patches left unpooled (36 soft tokens) or pooled 3x3 (4), with two images of other shapes."""
    import tests.plugins.gemma.gemma3_vision_model as checkpoint

    monkeypatch.setattr(checkpoint, "TOKENS_PER_IMAGE", tokens_per_image)
    hf = save_model(tmp_path)
    processor().save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=64)
    text = "look at <start_of_image> then <start_of_image> and tell me"
    images = [image(2, (90, 20)), image(3, (17, 23))]
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY)[0]
    assert out.prompt_token_ids.count(SOFT) == 2 * tokens_per_image
    assert_matches_hf(hf, text, images, out)
