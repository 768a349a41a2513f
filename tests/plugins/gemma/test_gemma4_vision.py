"""Gemma4ForConditionalGeneration with images against transformers' model and image processor (fp32,
CPU): preprocessing of square and non-square images, greedy tokens and log-probabilities for an
E-model (causal image tokens, per-layer embeddings) and the MoE variant (image tokens both ways in
the sliding layers, clipped linears, standardized vision output), the encoder cache."""

import copy
import json

import httpx
import pytest
import torch
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

from tests.plugins.gemma.gemma3_vision_model import image
from tests.plugins.gemma.gemma4_vision_model import BOI, EOI, IMAGE, VARIANTS, image_processor, save_model
from tests.plugins.hf_parity import assert_output_matches_hf, hf_greedy
from tests.server.live import LiveServer
from tests.server.test_images import data_url
from tests.tiny_models import prompt
from xinfer import LLM, SamplingParams
from xinfer_gemma.gemma4_vision import Gemma4ImageProcessor

NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
SIZES = [(40, 30), (36, 36), (20, 90)]  # (width, height): wide, square, tall


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"gemma4-vision-{request.param}")
    hf = save_model(folder, request.param)
    return hf, LLM(model=str(folder), dtype="float32", num_blocks=64, max_num_batched_tokens=128)


def with_images(text: list[int], *images) -> dict:
    """A prompt of ``text`` with an image token after its 5th token and, for a second image, before
    its last 3."""
    ids = text[:5] + [IMAGE] + (text[5:-3] + [IMAGE] + text[-3:] if len(images) > 1 else text[5:])
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": list(images)}}


def hf_inputs(prompt_ids: list[int], images, **image_settings) -> dict:
    """transformers' processor's layout: each image token becomes <|image>, its soft tokens, <image|>."""
    processed = image_processor(**image_settings)(images, return_tensors="pt")
    ids: list[int] = []
    soft = iter(processed["num_soft_tokens_per_image"])
    for token in prompt_ids:
        ids += [BOI, *[IMAGE] * int(next(soft)), EOI] if token == IMAGE else [token]
    mm_token_type_ids = torch.tensor([[int(t == IMAGE) for t in ids]])
    return dict(ids=ids, pixel_values=processed["pixel_values"], image_position_ids=processed["image_position_ids"],
                mm_token_type_ids=mm_token_type_ids)  # fmt: skip


def assert_matches_hf(hf, request: dict, output, **image_settings) -> None:
    inputs = hf_inputs(request["prompt_token_ids"], request["multi_modal_data"]["image"], **image_settings)
    assert output.prompt_token_ids == inputs.pop("ids")
    assert_output_matches_hf(hf, output.prompt_token_ids, output.outputs[0], NEW_TOKENS, **inputs)


@pytest.mark.parametrize("size", SIZES)
def test_patches_and_soft_tokens_are_transformers(models, size):
    _, llm = models
    processor = llm.engine.mm_processor
    assert isinstance(processor, Gemma4ImageProcessor)
    item = processor.process("image", image(1, size))
    expected = image_processor()([image(1, size)], return_tensors="pt")
    patches = item.data["patches"]
    assert item.num_embeddings == int(expected["num_soft_tokens_per_image"][0])
    torch.testing.assert_close(patches, expected["pixel_values"][0, : len(patches)], atol=1e-6, rtol=0)
    rows, columns = item.extra["grid"]
    assert expected["image_position_ids"][0, len(patches) - 1].tolist() == [columns - 1, rows - 1]


def test_greedy_tokens_and_logprobs_match_hf(models):
    hf, llm = models
    request = with_images(prompt(12, seed=1), image(1))
    assert_matches_hf(hf, request, llm.generate(request, GREEDY)[0])


def test_two_images_of_other_shapes_match_hf(models):
    hf, llm = models
    request = with_images(prompt(14, seed=2), image(2, SIZES[1]), image(3, SIZES[2]))
    assert_matches_hf(hf, request, llm.generate(request, GREEDY)[0])


@pytest.mark.parametrize("models", ["e-model"], indirect=True)  # causal image tokens: chunks may cut an image
def test_chunks_cutting_through_an_image_take_their_slices(models):
    """With 24 tokens a step the image (tokens 6 to 68) spans four chunks, each with its part of the
    embeddings and of the per-layer inputs."""
    hf, llm = models
    chunked = LLM(model=llm.engine.config.model.model, dtype="float32", num_blocks=64, max_num_batched_tokens=24)
    request = with_images(prompt(12, seed=1), image(1))
    assert_matches_hf(hf, request, chunked.generate(request, GREEDY)[0])


@pytest.mark.parametrize("models", ["moe"], indirect=True)  # the engine's side: one variant tells it
def test_the_same_image_twice_in_a_batch_is_encoded_once_and_again_not_at_all(models):
    hf, llm = models
    cache = llm.engine.encoder_cache
    misses = cache.misses
    requests = [with_images(prompt(10, seed=4), image(8)), with_images(prompt(11, seed=5), image(8))]
    for request, output in zip(requests, llm.generate(requests, GREEDY)):
        assert_matches_hf(hf, request, output)  # each as transformers gives it alone
    assert cache.misses == misses + 1  # the second prompt takes the first's output (a step later: a cache hit)
    hits = cache.hits
    llm.generate(with_images(prompt(9, seed=6), image(8)), GREEDY)  # no prefix in common: its image is looked up
    assert (cache.misses, cache.hits) == (misses + 1, hits + 1)


@pytest.mark.parametrize("models", ["moe"], indirect=True)  # the variant whose image tokens attend both ways
def test_the_reference_tells_both_ways_from_causal(models):
    """The MoE variant's check can fail on the mask: transformers' causal run over its inputs differs."""
    hf, _ = models
    inputs = hf_inputs(with_images(prompt(12, seed=1), image(1))["prompt_token_ids"], [image(1)])
    ids, both_ways_inputs = inputs.pop("ids"), dict(inputs)
    inputs.pop("mm_token_type_ids")
    _, both_ways = hf_greedy(hf, ids, 1, **both_ways_inputs)
    _, causal = hf_greedy(hf, ids, 1, **inputs)
    assert abs(both_ways[0] - causal[0]) > 1e-3


def test_a_checkpoint_with_its_own_activation_and_image_processor_matches_hf(tmp_path):
    """The encoder's hidden_activation and the saved image processor's filter and normalization are
    the checkpoint's."""
    settings = dict(resample=2, do_normalize=True, image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.3, 0.4])
    hf = save_model(tmp_path, "e-model", vision=dict(hidden_activation="silu"), **settings)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=64, max_num_batched_tokens=128)
    request = with_images(prompt(12, seed=1), image(1, (37, 29)))
    assert_matches_hf(hf, request, llm.generate(request, GREEDY)[0], **settings)


@pytest.mark.parametrize("models", ["moe"], indirect=True)  # the processor's: one variant tells it
def test_without_do_convert_rgb_only_rgb_images_are_taken(models):
    """transformers keeps a gray image's one channel (its patches then fit no encoder) and refuses an RGBA one;
    xinfer converted both (found by a QA pass). An RGB image is transformers' whatever the setting."""
    processor = copy.copy(models[1].engine.mm_processor)
    processor.convert_rgb = False
    rgb = image(1, (37, 29))
    expected = Gemma4ImageProcessorPil(**{**image_processor().to_dict(), "do_convert_rgb": False})(
        [rgb], return_tensors="pt"
    )
    patches = processor.process("image", rgb).data["patches"]
    torch.testing.assert_close(patches, expected["pixel_values"][0, : len(patches)], atol=1e-6, rtol=0)
    for mode in ("L", "RGBA"):
        with pytest.raises(ValueError, match=f"a {mode} image: this model takes RGB images alone"):
            processor.process("image", rgb.convert(mode))


@pytest.mark.parametrize("models", ["moe"], indirect=True)  # the processor's: one variant tells it
def test_an_image_with_more_patches_a_side_than_position_embeddings_is_refused(models):
    _, llm = models
    with pytest.raises(ValueError, match=r"a 300x4 image resizes to 210x3 patches, .* position_embedding_size \(64\)"):
        llm.engine.mm_processor.process("image", image(1, (300, 4)))


def test_the_server_answers_an_image_as_the_offline_engine_does(tmp_path):
    folder = tmp_path / "model"
    save_model(folder, "e-model")
    llm = LLM(model=str(folder), dtype="float32", num_blocks=64, max_num_batched_tokens=128)
    offline = llm.generate({"prompt": "look at <|image|> tell me ", "multi_modal_data": {"image": image(3)}},
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]  # fmt: skip
    live = LiveServer("--m", str(folder), "--dtype", "f32", "--served-model-name", "tiny-gemma4",
                      "--max-model-len", "256", name="gemma4-vision-server").start()  # fmt: skip
    try:
        card = httpx.get(live.url + "/v1/models").json()["data"][0]
        assert card["input_modalities"] == ["text", "image"]
        content = [{"type": "text", "text": "look at"}, {"type": "image_url", "image_url": {"url": data_url(image(3))}},
                   {"type": "text", "text": "tell me"}]  # fmt: skip
        answer = live.client(timeout=120).chat.completions.create(
            model="tiny-gemma4", messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0
        )
    finally:
        live.stop()
    assert answer.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert answer.choices[0].message.content == offline.outputs[0].text


@pytest.mark.parametrize(
    ("vision", "error"),
    [
        (dict(head_dim=18), r"head_dim=18 is not a multiple of 4"),
        (dict(num_attention_heads=3, num_key_value_heads=2), "num_attention_heads 3 is not a multiple of num_key_"),
        (dict(num_attention_heads=2, num_key_value_heads=4), "num_attention_heads 2 is not a multiple of num_key_"),
        (dict(pooling_kernel_size=1), r"pooling_kernel_size=1: transformers' encoder keeps the padding patches"),
    ],
)
def test_an_encoder_transformers_cannot_run_is_refused_at_load(tmp_path, monkeypatch, vision, error):
    """Found by sweeping: transformers' rotary gives a head of 18 a table of 20, its encoder without pooling keeps
    the padding patches instead of the image's, and it cannot group 3 (or 2) query heads over 2 (or 4) key and value
    heads; xinfer served the first two and failed inside its attention at the request on the others."""
    import tests.plugins.gemma.gemma4_vision_model as checkpoint

    monkeypatch.setitem(checkpoint.VISION, "pooling_kernel_size", vision.get("pooling_kernel_size", 3))
    hf = save_model(tmp_path, "e-model", vision=vision)
    inputs = hf_inputs(with_images(prompt(12, seed=1), image(1, (37, 29)))["prompt_token_ids"], [image(1, (37, 29))])
    with pytest.raises(RuntimeError, match=r"split_with_sizes|must match the size"):
        hf(input_ids=torch.tensor([inputs.pop("ids")]), **inputs)
    with pytest.raises(ValueError, match=error):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64)


@pytest.mark.parametrize(
    ("settings", "hf_error", "error"),
    [
        (dict(patch_size=8), "cannot be multiplied", r"the image processor's patch_size \(8\) is not the vision config's \(4\)"),
        (dict(pooling_kernel_size=2), "Cannot pool", r"the image processor's pooling_kernel_size \(2\) is not the vision config's"),
        (dict(do_resize=False), "cannot reshape", "do_resize is false"),
    ],
)  # fmt: skip
def test_an_image_processor_cutting_patches_the_encoder_does_not_take_is_refused_at_load(
    tmp_path, settings, hf_error, error
):
    """Found by sweeping: transformers' processor cuts patches by its own patch and pooling sizes, or leaves the
    image unresized (then cannot cut a 37x29 image), and its encoder fails on them; xinfer used the vision config's."""
    hf = save_model(tmp_path, "e-model")
    processor = Gemma4ImageProcessorPil(**{**image_processor().to_dict(), **settings})
    processor.save_pretrained(tmp_path)
    with pytest.raises((RuntimeError, ValueError), match=hf_error):
        processed = processor([image(1, (37, 29))], return_tensors="pt")
        hf.model.vision_tower(processed["pixel_values"], processed["image_position_ids"])
    with pytest.raises(ValueError, match=error):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64)


def test_a_soft_token_budget_transformers_processor_does_not_take_is_refused_at_load(tmp_path):
    """Found by sweeping: transformers' image processor refuses max_soft_tokens 100 when it loads; xinfer took it."""
    save_model(tmp_path, "e-model")
    settings = json.loads((tmp_path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**settings, "max_soft_tokens": 100}))
    with pytest.raises(ValueError, match="must be one of"):
        Gemma4ImageProcessorPil.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"max_soft_tokens \(100\) is not one of \(70, 140, 280, 560, 1120\)"):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64)


@pytest.mark.parametrize(
    "vision",
    [dict(pooling_kernel_size=2, patch_size=3), dict(head_dim=12, num_attention_heads=4, num_key_value_heads=2)],
    ids=["pool-2-patch-3", "head-12-grouped"],
)
def test_other_patch_pooling_and_head_shapes_match_hf(tmp_path, monkeypatch, vision):
    """Swept: a 2x2 pooling of 3-pixel patches (the processor's grid follows the vision config's, as a checkpoint's
    does), and heads of 12 (3 rotary frequencies a half) grouped two to a key and value head."""
    import tests.plugins.gemma.gemma4_vision_model as checkpoint

    for field in ("pooling_kernel_size", "patch_size"):
        monkeypatch.setitem(checkpoint.VISION, field, vision.get(field, checkpoint.VISION[field]))
    hf = save_model(tmp_path, "e-model", vision=vision)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=128, max_num_batched_tokens=256)
    request = with_images(prompt(14, seed=2), image(2, (37, 29)), image(3, (7, 5)))
    assert_matches_hf(hf, request, llm.generate(request, GREEDY)[0])
