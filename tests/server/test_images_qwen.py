"""A Qwen3-VL image in a chat request, through the official openai client against a live server
running a tiny Qwen3-VL model whose chat template writes Qwen's image markers: the answer is the
offline engine's for the same image (the image's tokens expanded, the M-RoPE positions applied)."""

from __future__ import annotations

import base64
import io
import shutil

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.plugins.qwen.vl_fixtures import (
    IMAGE,
    VIDEO,
    VISION_END,
    VISION_START,
    synthetic_image,
    tiny_vl_config,
)
from tests.server.live import LiveServer
from xinfer import LLM, SamplingParams

WORDS = ["what", "is", "in", "this", "picture", "describe", "it"]
# content lists with {"type": "image"} items, as Qwen's templates take them
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|> {% endfor %}<|im_start|>assistant "
)
SPECIAL = {"<|im_start|>": 1, "<|im_end|>": 2, "<unk>": 3, "<|vision_start|>": VISION_START,
           "<|vision_end|>": VISION_END, "<|image_pad|>": IMAGE, "<|video_pad|>": VIDEO}  # fmt: skip


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {**SPECIAL, " ": 4, "user": 5, "assistant": 6, **{w: 7 + i for i, w in enumerate(WORDS)}}
    vocab |= {f"w{i}": i for i in set(range(tiny_vl_config().text_config.vocab_size)) - set(vocab.values())}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r" |[^\s]+"), behavior="isolated")
    backend.add_special_tokens(list(SPECIAL))
    # every id a word of its own: the answers' texts tell their tokens apart
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", unk_token="<unk>",
                                   chat_template=CHAT_TEMPLATE)  # fmt: skip


@pytest.fixture(scope="module")
def qwen_server(tiny_qwen3_vl, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-vl-server")
    shutil.copytree(tiny_qwen3_vl[1], folder, dirs_exist_ok=True)  # with a tokenizer of its own
    tokenizer().save_pretrained(folder)
    live = LiveServer("--m", str(folder), "--dtype", "f32", "--served-model-name", "tiny-qwen-vl",
                      "--max-model-len", "256", name="qwen-vl-server").start()  # fmt: skip
    yield live, folder
    live.stop()


def data_url(picture) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}"


def test_an_image_answer_is_the_offline_engines(qwen_server):
    live, folder = qwen_server
    client = live.client(timeout=120)
    picture = synthetic_image(40, 24, seed=9)
    answer = client.chat.completions.create(
        model="tiny-qwen-vl", max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "what is in this picture"},
                                               {"type": "image_url", "image_url": {"url": data_url(picture)}}]}],
    )  # fmt: skip
    llm = LLM(model=str(folder), dtype="float32", num_blocks=32, max_model_len=256)
    prompt = "<|im_start|>user what is in this picture<|vision_start|><|image_pad|><|vision_end|><|im_end|> <|im_start|>assistant "
    offline = llm.generate({"prompt": prompt, "multi_modal_data": {"image": picture}},
                           SamplingParams(temperature=0, max_tokens=6))[0]  # fmt: skip
    assert answer.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert offline.prompt_token_ids.count(IMAGE) == 15  # 40x24 pixels: 6x10 patches of 4, 3x5 merged
    assert answer.choices[0].message.content == offline.outputs[0].text != ""
