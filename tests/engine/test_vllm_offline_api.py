"""What code written for vLLM's offline API asks of ``LLM`` beyond generating (a QA pass with vLLM's documented
calls found each of these missing): the tokenizer ``get_tokenizer()`` returns answering as the HF one vLLM
returns, ``chat``'s own template and its text parts, ``CompletionOutput.finished()``, vLLM's engine options, and
bad values refused naming the field. On the embedded default model (SmolLM2-135M-Instruct Q4_1), whose
tokenizer transformers also reads from the GGUF file."""

from __future__ import annotations

import pytest

from tests.loading.gguf_models import SMOLLM, hf_tokenizer
from xinfer import LLM, SamplingParams
from xinfer.errors import WrongTypeError

HI = [{"role": "user", "content": "What is 2+2?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=6)
PLAIN_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def llm():
    return LLM(num_blocks=64, max_model_len=256)


def test_the_tokenizer_answers_as_the_hf_one(llm):
    tok, hf = llm.get_tokenizer(), hf_tokenizer(SMOLLM)
    text = "Hello, world! 2+2=4"
    assert tok(text)["input_ids"] == hf(text)["input_ids"]
    assert tok([text, "hi"])["input_ids"] == hf([text, "hi"])["input_ids"]
    assert (tok.eos_token_id, tok.bos_token_id) == (hf.eos_token_id, hf.bos_token_id)
    assert len(tok) == len(hf)
    ids = hf(text)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert tok.convert_tokens_to_ids(hf.convert_ids_to_tokens(ids)) == ids
    assert tok.batch_decode([ids, ids[:2]]) == hf.batch_decode([ids, ids[:2]])
    assert tok.get_vocab() == hf.get_vocab()
    rendered = tok.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    assert rendered == hf.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(HI) == tok.encode(rendered, add_special_tokens=False)


def test_chat_renders_with_the_template_it_is_given(llm):
    out = llm.chat(HI, GREEDY, use_tqdm=False, chat_template=PLAIN_TEMPLATE)[0]
    assert out.prompt == "[user] What is 2+2?\n[assistant] "
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)


def test_text_parts_reach_a_string_template_as_one_string(llm):
    """SmolLM2's template adds ``content`` to strings: a message of text parts is their text, joined by newlines, as
    vLLM's "auto" content format and the server give it ("openai" keeps the parts, which that template cannot
    write)."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+2?"}]}]
    joined = [{"role": "user", "content": "What is\n2+2?"}]
    got = llm.chat(parts, GREEDY, use_tqdm=False)[0]
    assert got.prompt == llm.chat(joined, GREEDY, use_tqdm=False)[0].prompt
    assert got.outputs[0].finished() and got.finished  # a method of a choice, a field of the request (vLLM's)
    with pytest.raises(ValueError, match="chat_template_content_format 'json'"):
        llm.chat(parts, GREEDY, chat_template_content_format="json")


def test_bad_values_are_refused_naming_them(llm):
    with pytest.raises(TypeError):  # a misspelled keyword is not a template variable
        llm.chat(HI, GREEDY, add_generation_promt=False)
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate("Hi", GREEDY, lora_request=object())
    with pytest.raises(WrongTypeError, match="logit_bias must be a dict"):
        SamplingParams(logit_bias=[1, 2])


def test_vllm_engine_options(tmp_path):
    """``gpu_memory_utilization`` is ``kv_fraction``; ``trust_remote_code`` changes nothing; ``tokenizer_mode`` takes
    "auto"; ``max_logprobs`` bounds the logprobs a request asks for."""
    llm = LLM(num_blocks=16, max_model_len=64, gpu_memory_utilization=0.5, trust_remote_code=True,
              tokenizer_mode="auto", max_logprobs=3)  # fmt: skip
    assert llm.engine.config.cache.kv_fraction == 0.5
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=2, logprobs=3), use_tqdm=False)[0]
    assert all(len(entry) >= 3 for entry in out.outputs[0].logprobs)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field} 4 is more than max_logprobs 3"):
            llm.generate("Hi", SamplingParams(max_tokens=2, **{field: 4}), use_tqdm=False)
    with pytest.raises(ValueError, match="tokenizer_mode 'slow'"):
        LLM(tokenizer_mode="slow")
    with pytest.raises(TypeError, match="not both"):
        LLM(gpu_memory_utilization=0.5, kv_fraction=0.5)


def test_allowed_token_ids_are_the_only_tokens_generated(llm):
    """vLLM's ``allowed_token_ids``: greedy takes the likeliest of them (by the unconstrained step's log-probabilities),
    and sampling never leaves them."""
    first = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=1, logprobs=-1),
                         use_tqdm=False)[0].outputs[0].logprobs[0]  # fmt: skip
    ranked = sorted(first, key=lambda token: -first[token])
    allowed = [ranked[8], ranked[4]]
    greedy = SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=allowed)
    assert llm.generate("The capital of France is", greedy, use_tqdm=False)[0].outputs[0].token_ids == [ranked[4]]
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed)
    assert set(llm.generate("Hi", sampled, use_tqdm=False)[0].outputs[0].token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="allowed_token_ids token ids must be below the vocabulary's"):
        llm.generate("Hi", SamplingParams(allowed_token_ids=[10**9]), use_tqdm=False)


def contains(tokens: list[int], run: list[int]) -> bool:
    return any(tokens[i : i + len(run)] == run for i in range(len(tokens) - len(run) + 1))


def test_bad_words_are_never_generated(llm):
    """vLLM's ``bad_words``: the greedy answer without them holds a one-token word and a word of several tokens;
    with them banned, neither token run appears, and greedy takes what it would have where no ban applies."""
    tok = llm.get_tokenizer()
    prompt = "The capital of France is"
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    runs = {w: tok.encode(" " + w, add_special_tokens=False) for w in plain.text.split()}
    written = {w: run for w, run in runs.items() if contains(plain.token_ids, run)}  # after a space, as a word
    single = next(w for w, run in written.items() if len(run) == 1)
    multi = next(w for w, run in written.items() if len(run) >= 2)
    for word in (single, multi):
        banned = SamplingParams(temperature=0, max_tokens=12, bad_words=[word])
        got = llm.generate(prompt, banned, use_tqdm=False)[0].outputs[0].token_ids
        run = written[word]
        assert not contains(got, run), word
        first = plain.token_ids.index(run[-1]) if len(run) == 1 else None
        if first is not None:  # the tokens before the first place the ban applies are the plain answer's
            assert got[:first] == plain.token_ids[:first]
    with pytest.raises(ValueError, match="bad_words must not be empty or blank"):
        SamplingParams(bad_words=[" "])
    with pytest.raises(WrongTypeError, match="bad_words must be a list of strings"):
        SamplingParams(bad_words="Paris")


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    tokens = llm.get_tokenizer().encode("one two three four five six seven eight")
    cut = SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=3)
    got = llm.generate([tokens], cut, use_tqdm=False)[0]
    assert got.prompt_token_ids == tokens[-3:]
    alone = llm.generate([tokens[-3:]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert got.outputs[0].token_ids == alone.outputs[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1"):
        SamplingParams(truncate_prompt_tokens=0)


def test_clone_is_a_deep_copy():
    params = SamplingParams(stop=["a"], logit_bias={1: 2.0})
    copy = params.clone()
    copy.stop.append("b")
    assert copy == SamplingParams(stop=["a", "b"], logit_bias={1: 2.0}) and params.stop == ["a"]


def test_reset_prefix_cache_makes_the_next_prompt_cold(llm):
    prompt = " ".join(["a long prompt shared by every run"] * 8)
    params = SamplingParams(temperature=0, max_tokens=2)
    cold = llm.generate(prompt, params, use_tqdm=False)[0]
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens >= 32
    llm.reset_prefix_cache()
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == cold.outputs[0].token_ids


# an agent loop's history, as OpenAI clients send it: the assistant's content null beside its calls, whose
# arguments are JSON text
TOOL_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]  # fmt: skip
TOJSON_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m['content'] }}{% for c in m.tool_calls or [] %}"
    "<call {{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}{% endfor %}[assistant] "
)
RESULT = "[tool] sunny[assistant] "


def test_chat_converts_tool_call_history_as_the_server_does(llm):
    """vLLM's (and the server's): arguments reach the template as an object, so ``tojson`` writes them once, and a
    null content as "" (SmolLM2's template adds ``content`` to a string)."""
    from xinfer.server.prompts import render_chat
    from xinfer.server.protocol import ChatMessage

    out = llm.chat(TOOL_HISTORY, GREEDY, use_tqdm=False, chat_template=TOJSON_TEMPLATE)[0]
    assert out.prompt == '[user] Weather in Paris?[assistant] <call get_weather {"city": "Paris"}>' + RESULT
    server = render_chat(llm.get_tokenizer(), [ChatMessage.model_validate(m) for m in TOOL_HISTORY])
    assert llm.chat(TOOL_HISTORY, GREEDY, use_tqdm=False)[0].prompt == server
    assert TOOL_HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the caller's, as it was


def test_logprobs_true_is_one(llm):
    """vLLM's ``SamplingParams`` takes ``logprobs=True`` (OpenAI's habit) as 1, ``prompt_logprobs`` too; ``False``
    is no logprobs."""
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=True, prompt_logprobs=True)
    got = llm.generate("The capital of France is", params, use_tqdm=False)[0]
    one = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=3, logprobs=1,
                                                                   prompt_logprobs=1), use_tqdm=False)[0]  # fmt: skip
    assert got.outputs[0].finish_reason == "length" and got.outputs[0].logprobs == one.outputs[0].logprobs
    assert got.prompt_logprobs == one.prompt_logprobs
    assert SamplingParams(logprobs=False, prompt_logprobs=False) == SamplingParams()


def test_the_tokenizer_returns_hf_batch_encodings(llm):
    """``tok(text)`` and ``apply_chat_template(..., return_dict=True)`` as transformers' ``BatchEncoding``:
    ``.input_ids`` as well as ``["input_ids"]``, and torch tensors with ``return_tensors="pt"``, batched as HF's."""
    import torch
    from transformers import BatchEncoding

    tok, hf = llm.get_tokenizer(), hf_tokenizer(SMOLLM)
    text = "Hello, world! 2+2=4"
    encoding = tok(text)
    assert isinstance(encoding, BatchEncoding)
    assert (encoding.input_ids, encoding.attention_mask) == (hf(text).input_ids, hf(text).attention_mask)
    for texts in (text, [text, text]):
        ours, theirs = tok(texts, return_tensors="pt"), hf(texts, return_tensors="pt")
        assert torch.equal(ours.input_ids, theirs.input_ids)
        assert torch.equal(ours["attention_mask"], theirs["attention_mask"])
    chat = tok.apply_chat_template(HI, return_dict=True)
    theirs = hf.apply_chat_template(HI, add_generation_prompt=True, return_dict=True)
    assert isinstance(chat, BatchEncoding) and chat.input_ids == theirs["input_ids"] == tok.apply_chat_template(HI)
    assert chat["attention_mask"] == [1] * len(chat.input_ids)
    as_tensor = tok.apply_chat_template(HI, return_tensors="pt")
    assert torch.equal(as_tensor, hf.apply_chat_template(HI, add_generation_prompt=True, return_tensors="pt",
                                                         return_dict=False))  # fmt: skip


def test_vllm_constructor_values():
    """vLLM's ``dtype`` may be a ``torch.dtype``, named as its string form; ``seed=None`` (its older default) is
    the seed 0 its V1 engine runs with."""
    import torch

    from xinfer.config import EngineConfig

    assert EngineConfig.from_kwargs(dtype=torch.bfloat16).model.dtype == "bfloat16"
    assert EngineConfig.from_kwargs(dtype=torch.float16).model.dtype == "float16"
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        EngineConfig.from_kwargs(dtype=torch.int8)
    llm = LLM(num_blocks=16, max_model_len=64, dtype=torch.float32, seed=None)
    assert (llm.engine.config.model.dtype, llm.engine.config.model.seed) == ("float32", 0)
    assert llm.generate("Hi", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_chat_template_kwargs_win_over_the_arguments_they_name(llm):
    """vLLM's ``LLM.chat`` updates its template arguments with ``chat_template_kwargs``."""
    without_prompt = llm.chat(HI, GREEDY, use_tqdm=False, add_generation_prompt=False)[0].prompt
    got = llm.chat(HI, GREEDY, use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False})[0]
    assert got.prompt == without_prompt and not got.prompt.endswith("assistant\n")
    assert llm.chat(HI, GREEDY, use_tqdm=False, chat_template_kwargs={"tools": None})[0].prompt.endswith("assistant\n")
    continued = [*HI, {"role": "assistant", "content": "It is"}]
    kwargs = {"add_generation_prompt": False, "continue_final_message": True}
    assert llm.chat(continued, GREEDY, use_tqdm=False, chat_template_kwargs=kwargs)[0].prompt.endswith("It is")
    templated = llm.chat(HI, GREEDY, use_tqdm=False, chat_template_kwargs={"chat_template": PLAIN_TEMPLATE})[0]
    assert templated.prompt == "[user] What is 2+2?\n[assistant] "
    with pytest.raises(ValueError, match="continue_final_message needs add_generation_prompt=False"):
        llm.chat(continued, GREEDY, chat_template_kwargs={"continue_final_message": True})


@pytest.mark.parametrize(
    "part",
    [
        {"type": "input_text", "text": "Hi"},
        {"type": "output_text", "text": "Hi"},
        {"type": "refusal", "refusal": "Hi"},
        {"type": "thinking", "thinking": "Hi"},
    ],
)
def test_parts_vllm_reads_as_text_are_text(llm, part):
    as_text = llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)[0].prompt
    assert llm.chat([{"role": "user", "content": [part]}], GREEDY, use_tqdm=False)[0].prompt == as_text


def test_an_image_part_for_a_text_only_model_is_refused_naming_it(llm):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    message = {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}
    with pytest.raises(ValueError, match=r"^messages\.1\.content\.1: an image part \('image_url'\), but the model "
                                         r"takes text only"):  # fmt: skip
        llm.chat([{"role": "system", "content": "Be brief."}, message], GREEDY)
    with pytest.raises(ValueError, match=r"^messages\.1\.0\.content\.1: an image part \('image_pil'\)"):
        llm.chat([HI, [{"role": "user", "content": [{"type": "text", "text": "?"}, {"type": "image_pil",
                                                                                     "image_pil": object()}]}]], GREEDY)  # fmt: skip
