"""Images in chat requests, through the official openai client against a live server running a tiny
Gemma 3 vision model: data URLs work; every bad image is a 400 with the standard error body, and the
server stays healthy."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest

from tests.plugins.gemma.gemma3_vision_model import TOKENS_PER_IMAGE, image, save_model
from tests.server.live import LiveServer
from xinfer.server.media import parse_limits

MAX_PIXELS = 100 * 100


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "allowed").mkdir()
    image(1).save(folder / "allowed" / "picture.png")
    image(1).save(folder / "outside.png")
    return folder


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory, media_dir):
    folder = tmp_path_factory.mktemp("gemma3-vision-server")
    save_model(folder)
    live = LiveServer(
        "--m", str(folder), "--dtype", "f32", "--served-model-name", "tiny-vision", "--max-model-len", "256",
        "--limit-mm-per-prompt", '{"image": 2}', "--max-image-pixels", str(MAX_PIXELS),
        "--allowed-local-media-path", str(media_dir / "allowed"), name="vision-server",
    ).start()  # fmt: skip
    yield live
    live.stop()


@pytest.fixture(scope="module")
def vision_client(vision_server):
    return vision_server.client(timeout=120)


def data_url(picture, fmt: str = "PNG", media_type: str = "image/png") -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format=fmt)
    return f"data:{media_type};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def ask(client: openai.OpenAI, *urls: str, text: str = "look at this"):
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return client.chat.completions.create(
        model="tiny-vision", messages=[{"role": "user", "content": [{"type": "text", "text": text}, *parts]}],
        max_tokens=4, temperature=0,
    )  # fmt: skip


def test_models_list_the_input_modalities(vision_server):
    card = httpx.get(vision_server.url + "/v1/models").json()["data"][0]
    assert card["input_modalities"] == ["text", "image"]


@pytest.mark.parametrize("fmt, media_type", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")])
def test_a_data_url_image_is_answered(vision_client, fmt, media_type):
    answer = ask(vision_client, data_url(image(2), fmt, media_type))
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 4
    text_only = ask(vision_client)
    assert answer.usage.prompt_tokens - text_only.usage.prompt_tokens >= TOKENS_PER_IMAGE + 2  # boi, eoi


def test_the_answer_is_the_offline_engines_for_the_same_image(vision_client, vision_server):
    """The server's tokens are those of the offline API for the same prompt and image."""
    from xinfer import LLM, SamplingParams

    llm = LLM(model=str(vision_server.flags[1]), dtype="float32", num_blocks=32, max_model_len=256)
    for seed in (3, 4):
        answer = vision_client.chat.completions.create(
            model="tiny-vision", max_tokens=4, temperature=0, logprobs=True,
            messages=[{"role": "user", "content": [{"type": "text", "text": "look at this"},
                                                   {"type": "image_url", "image_url": {"url": data_url(image(seed))}}]}],
        )  # fmt: skip
        offline = llm.generate(
            {"prompt": "look at this <start_of_image> ", "multi_modal_data": {"image": image(seed)}},
            SamplingParams(temperature=0, max_tokens=4),
        )[0]
        assert answer.choices[0].message.content == offline.outputs[0].text
        assert answer.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_an_allowed_local_file_is_read(vision_client, media_dir):
    """The file's picture is answered as the same picture sent inline."""
    from_file = ask(vision_client, (media_dir / "allowed" / "picture.png").as_uri())
    inline = ask(vision_client, data_url(image(1)))
    assert from_file.choices[0].message.content == inline.choices[0].message.content
    assert (from_file.usage.prompt_tokens, from_file.usage.completion_tokens) == (inline.usage.prompt_tokens, 4)


def _png_bytes(picture) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


BAD_IMAGES = {
    "not base64": ("data:image/png;base64,@@@not-base64@@@", "base64"),
    "corrupt": ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n garbage" * 8).decode(), "image"),
    "truncated": ("data:image/png;base64," + base64.b64encode(_png_bytes(image(1))[:300]).decode(), "truncated"),
    "too large": ("LARGE", "more than the limit"),
    "unsupported media type": ("data:image/svg+xml;base64," + base64.b64encode(b"<svg/>").decode(), "media type"),
    "text media type": ("data:text/plain;base64,aGVsbG8=", "media type"),
    "remote URL": ("https://example.com/cat.png", "--allow-remote-media"),
    "file outside the allowed dir": ("OUTSIDE", "must name a file under"),
    "unknown scheme": ("ftp://example.com/cat.png", "scheme"),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_a_bad_image_is_a_400_and_the_server_stays_healthy(vision_client, vision_server, media_dir, case):
    url, words = BAD_IMAGES[case]
    url = {"LARGE": data_url(image(1, (120, 100))), "OUTSIDE": (media_dir / "outside.png").as_uri()}.get(url, url)
    with pytest.raises(openai.BadRequestError) as error:
        ask(vision_client, url)
    body = error.value.body
    assert words in body["message"] and body["type"] == "invalid_request_error", body
    assert body["param"].startswith("messages.0.content")
    assert httpx.get(vision_server.url + "/health").status_code == 200
    assert ask(vision_client).usage.completion_tokens == 4


def test_more_images_than_the_limit_is_a_400(vision_client):
    with pytest.raises(openai.BadRequestError, match=r"3 images, more than this server takes per prompt \(2"):
        ask(vision_client, *[data_url(image(i)) for i in range(3)])


def test_an_image_to_a_text_only_model_is_a_400_naming_it(client, model):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=model, max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image(1))}}]}],
        )  # fmt: skip
    assert f"the model {model!r} takes text only" in error.value.body["message"]
    models = client.models.list().data
    assert models[0].model_extra["input_modalities"] == ["text"]


@pytest.mark.parametrize("text, limits", [("image=4", {"image": 4}), ('{"image": 2, "video": 0}', {"image": 2, "video": 0}),
                                          ("image=1,video=2", {"image": 1, "video": 2})])  # fmt: skip
def test_limits_take_both_syntaxes(text, limits):
    assert parse_limits(text) == limits


@pytest.mark.parametrize("text", ["image", "image=many", '{"image": -1}', "[1]"])
def test_bad_limits_are_refused(text):
    with pytest.raises(ValueError, match=r"MODALITY=N|at least 0"):
        parse_limits(text)


def test_a_bad_limit_flag_is_one_line():
    import subprocess
    import sys

    code = "import sys; from xinfer.cli import main; sys.exit(main())"
    result = subprocess.run([sys.executable, "-c", code, "--limit-mm-per-prompt", "image=lots"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "xinfer: --limit-mm-per-prompt: expected MODALITY=N[,MODALITY=N] or JSON like {\"image\": 4}, got 'image=lots'"
    ]


def test_an_image_block_on_the_messages_api(vision_server, vision_client):
    """Anthropic's base64 image block is the same image as OpenAI's data URL: the same prompt, the same answer."""
    import anthropic

    claude = anthropic.Anthropic(base_url=vision_server.url, api_key="unused", max_retries=0, timeout=120)
    url = data_url(image(2))
    source = {"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}
    content = [{"type": "text", "text": "look at this"}, {"type": "image", "source": source}]
    turns = [{"role": "user", "content": content}]
    message = claude.messages.create(model="tiny-vision", max_tokens=4, messages=turns, extra_body={"temperature": 0})
    expected = ask(vision_client, url)
    assert message.content[0].text == expected.choices[0].message.content
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == expected.usage.prompt_tokens
    counted = claude.messages.count_tokens(model="tiny-vision", messages=turns)
    assert counted.input_tokens == expected.usage.prompt_tokens


def test_an_image_in_a_tool_result_is_the_tool_messages_image(vision_server, vision_client):
    """A tool_result's image block (a screenshot tool, say) is read as an image of the tool message, as OpenAI's
    tool message with an image part is: the same prompt, the same answer (it was refused as not text)."""
    import anthropic

    claude = anthropic.Anthropic(base_url=vision_server.url, api_key="unused", max_retries=0, timeout=120)
    url = data_url(image(3))
    source = {"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}
    call = {"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
        {"type": "text", "text": "look"}, {"type": "image", "source": source}]}  # fmt: skip
    turns = [{"role": "user", "content": "look"}, {"role": "assistant", "content": [call]},
             {"role": "user", "content": [result]}]  # fmt: skip
    message = claude.messages.create(model="tiny-vision", max_tokens=4, messages=turns, extra_body={"temperature": 0})
    openai_call = {"id": "toolu_1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}
    expected = vision_client.chat.completions.create(model="tiny-vision", max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": "look"}, {"role": "assistant", "content": "", "tool_calls": [openai_call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": [
            {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]},
    ])  # fmt: skip
    assert message.content[0].text == expected.choices[0].message.content
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == expected.usage.prompt_tokens
    text_only = claude.messages.count_tokens(model="tiny-vision", messages=[*turns[:2], {"role": "user", "content": [
        {**result, "content": [{"type": "text", "text": "look"}]}]}])  # fmt: skip
    assert expected.usage.prompt_tokens - text_only.input_tokens >= TOKENS_PER_IMAGE


def test_a_bad_image_on_the_responses_and_messages_apis_names_their_own_field(vision_server, vision_client):
    """Those routes translate their bodies into a chat's: an image error named the chat's field
    (messages.1.content.1.image_url, counting the instructions as a message)."""
    import anthropic

    bad = "data:image/png;base64,@@@"
    parts = [{"type": "input_text", "text": "look"}, {"type": "input_image", "image_url": bad}]
    with pytest.raises(openai.BadRequestError) as error:
        vision_client.responses.create(model="tiny-vision", instructions="be brief", max_output_tokens=16,
                                       input=[{"role": "user", "content": "hi"}, {"role": "user", "content": parts}])  # fmt: skip
    assert error.value.body["param"] == "input.1.content.1.image_url"
    claude = anthropic.Anthropic(base_url=vision_server.url, api_key="unused", max_retries=0, timeout=120)
    source = {"type": "base64", "media_type": "image/png", "data": "@@@"}
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model="tiny-vision", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image", "source": source}]}
        ])  # fmt: skip
    assert refused.value.body["error"]["message"].startswith("messages.0.content.1.source: ")
