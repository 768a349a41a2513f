"""The offline Python API, shaped like vLLM's: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from xinfer.config import EngineConfig
from xinfer.engine.engine import LLMEngine
from xinfer.engine.output import CompletionOutput, OutputProcessor, RequestOutput
from xinfer.errors import WrongTypeError
from xinfer.sampling import SamplingParams, check_generation_config, recommended_sampling, truncated
from xinfer.text.chat_messages import TEXT_PART_FIELDS, render_messages, template_content

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "Prompt"]

Prompt = str | list[int] | dict[str, Any]
Params = SamplingParams | Sequence[SamplingParams] | None


class LLM:
    """An engine running in this process.

    A prompt is a string, token ids, or vLLM's dict: ``{"prompt": str}`` or
    ``{"prompt_token_ids": [...]}``, with ``"multi_modal_data": {"image": image or [images]}``
    (``PIL.Image.Image``) for a model that takes images; the prompt marks each image with
    the model's placeholder (Gemma 3: ``<start_of_image>``), which is expanded into the
    image's tokens.

    ``LLM(model="path", dtype="bfloat16", block_size=16, ...)`` takes any option of
    :class:`xinfer.config.EngineConfig` by name; ``tensor_parallel_size=2`` splits the model
    over two processes (docs/distributed.md). ``tokenizer``: one that encodes, or the path of an HF
    folder or ``.gguf`` file holding one (default: the model's own). vLLM's ``gpu_memory_utilization``
    is ``kv_fraction``; its ``max_logprobs`` bounds a request's ``logprobs`` and ``prompt_logprobs``
    (default, or -1: no bound but the vocabulary); its ``trust_remote_code`` changes nothing (no model code
    is ever loaded from a checkpoint) and ``tokenizer_mode`` takes "auto" alone.

    ``generation_config``: where requests without sampling params take their defaults from, as vLLM's: "auto"
    (default) the model folder's ``generation_config.json`` (its temperature, top_k, top_p, min_p,
    repetition_penalty and max_new_tokens; Qwen3's: temperature 0.6, top_k 20, top_p 0.95), "none" (or vLLM's
    "vllm") :class:`SamplingParams`' own defaults, or a folder holding a ``generation_config.json``.
    """

    def __init__(self, model: str | None = None, tokenizer: Any = None, **options: Any):
        options, self.max_logprobs = _vllm_options(options)
        generation_config = options.pop("generation_config", "auto")
        check_generation_config(generation_config)
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **options), tokenizer)
        self.recommended_sampling = recommended_sampling(generation_config, self.engine.model_path)
        self.processor = OutputProcessor(self.engine)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Under tensor parallelism, ends the other ranks' processes (they end with this process too)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: Params = None,
        use_tqdm: bool = True,
        lora_request: None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Renders each conversation with the model's chat template (or ``chat_template``, a template's
        source), then generates; vLLM's signature. Messages are OpenAI's, converted as the server converts
        them: null content as "", assistant tool calls' arguments (JSON text) as objects. A message's content
        may be a list of parts: ``{"type": "text", "text": ...}`` (vLLM's ``input_text``, ``output_text``,
        ``refusal`` and ``thinking`` parts are read as text too) and, for a model that takes images,
        ``{"type": "image_pil", "image_pil": PIL image}`` (vLLM's name; ``"image"`` with the image under
        ``"image"`` too), which the template receives as ``{"type": "image"}``; a model that takes text only
        refuses an image part. ``chat_template_content_format``: "string" gives the
        template a message of text parts alone as one string, the parts joined by newlines (most templates
        write ``content`` as a string); "openai" the list of parts; "auto" (as the server does) the list
        where the template loops over a message's content, else one string: vLLM's detection.
        ``continue_final_message``: the prompt ends with the final message's text (with
        ``add_generation_prompt=False``), which the answer goes on with. The template's own variables come
        as ``chat_template_kwargs``, whose values win over the arguments they name, as vLLM's."""
        _no_lora(lora_request)
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format {chat_template_content_format!r}: one of "
                             f"{', '.join(CONTENT_FORMATS)}")  # fmt: skip
        # vLLM's: chat_template_kwargs win over the arguments they name
        options = {
            "chat_template": chat_template,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "tools": tools,
            **(chat_template_kwargs or {}),
        }
        if options["continue_final_message"] and options["add_generation_prompt"]:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        conversations, fields = _conversations(messages)
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as token ids to generate()")
        source = options.pop("chat_template")
        template = (
            tokenizer.template_from(source) if source is not None else tokenizer.chat_template_for(options["tools"])
        )
        if template is None:
            raise ValueError("this model has no chat template: pass chat_template, or prompts to generate()")
        content_format = (
            template.content_format if chat_template_content_format == "auto" else chat_template_content_format
        )
        takes_images = bool(self.engine.modalities)
        prompts = []
        for conversation, field in zip(conversations, fields):
            conversation, images = _conversation_for_template(conversation, content_format, takes_images, field)
            text = render_messages(template, conversation, **options)
            # the template writes BOS itself
            prompt = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
            prompts.append({**prompt, "multi_modal_data": {"image": images}} if images else prompt)
        return self.generate(prompts, sampling_params, use_tqdm)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: Params = None,
        use_tqdm: bool = True,
        lora_request: None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs in the order of ``prompts``. ``use_tqdm``: a
        progress bar of the finished requests (on stderr)."""
        _no_lora(lora_request)
        outputs = self._add(prompts, sampling_params)
        with tqdm(total=len(outputs), desc="Generating", unit="request", disable=not use_tqdm) as bar:
            for delta in self.processor.run(outputs):
                bar.update(delta.finished)
        return outputs

    def stream(self, prompts: Prompt | Sequence[Prompt], sampling_params: Params = None) -> Iterator[RequestOutput]:
        """Yields, as each step produces them, deltas: a ``RequestOutput`` holding only
        the new tokens and text of one choice of one request."""
        yield from self.processor.run(self._add(prompts, sampling_params))

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def reset_prefix_cache(self) -> None:
        """vLLM's: later prompts find no prefix computed before (a benchmark's cold runs)."""
        self.engine.cache.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` sample with when given none: the model's recommended sampling (see
        ``generation_config``), else :class:`SamplingParams`' defaults."""
        return SamplingParams(**self.recommended_sampling)

    def _add(self, prompts, params) -> list[RequestOutput]:
        prompts = _prompt_list(prompts)
        params = self.get_default_sampling_params() if params is None else params
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else _params_list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        for p in params:
            self._check_logprobs(p)
        outputs = []
        try:
            for prompt, p in zip(prompts, params):
                text, token_ids = self._tokenize(prompt)
                data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
                if p.truncate_prompt_tokens is not None:
                    if data:
                        raise ValueError("truncate_prompt_tokens cannot cut a prompt with images")
                    token_ids = truncated(token_ids, p.truncate_prompt_tokens, self.engine.max_model_len)
                token_ids, multimodal = self.engine.multimodal_prompt(token_ids, data)
                outputs.append(self.processor.add(str(next(self._ids)), token_ids, p, text, multimodal))
        except Exception:
            for output in outputs:
                self.processor.abort(output.request_id)
            raise
        return outputs

    def _check_logprobs(self, params: SamplingParams) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if self.max_logprobs not in (None, -1) and asked is not None and not 0 <= asked <= self.max_logprobs:
                raise ValueError(
                    f"{name} {asked} is more than max_logprobs {self.max_logprobs} (LLM(max_logprobs=...))"
                )

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
            if isinstance(prompt.get("prompt"), str):
                return self._tokenize(prompt["prompt"])
            raise WrongTypeError(f"a prompt dict holds 'prompt' (a string) or 'prompt_token_ids' (a list of token "
                                 f"ids), got {_described(prompt)}")  # fmt: skip
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Sequence):
            return None, _token_ids(prompt)
        raise WrongTypeError(f"a prompt is {PROMPT_FORMS}, got {_described(prompt)}")


PROMPT_FORMS = "a string, a list of token ids, or a dict with 'prompt' or 'prompt_token_ids'"
CONTENT_FORMATS = ("auto", "string", "openai")
IMAGE_PARTS = ("image_pil", "image", "image_url", "input_image")  # vLLM's names of a content part holding an image


def _vllm_options(options: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """``options`` with vLLM's names of xinfer's options renamed and those that change nothing here taken out,
    and ``max_logprobs`` (see :class:`LLM`)."""
    options = dict(options)
    if "gpu_memory_utilization" in options:
        if "kv_fraction" in options:
            raise TypeError("give gpu_memory_utilization (vLLM's name) or kv_fraction, not both")
        options["kv_fraction"] = options.pop("gpu_memory_utilization")
    options.pop("trust_remote_code", None)
    mode = options.pop("tokenizer_mode", "auto")
    if mode != "auto":
        raise ValueError(f"tokenizer_mode {mode!r}: only 'auto' (the checkpoint's tokenizer.json or GGUF vocabulary)")
    max_logprobs = options.pop("max_logprobs", None)
    if max_logprobs is not None and (not isinstance(max_logprobs, int) or isinstance(max_logprobs, bool)):
        raise WrongTypeError(f"max_logprobs must be an integer, got {_described(max_logprobs)}")
    return options, max_logprobs


def _no_lora(lora_request: object) -> None:
    if lora_request is not None:
        raise ValueError("lora_request: xinfer serves no LoRA adapters; merge the adapter into the weights")


def _prompt_list(prompts: Any) -> list[Any]:
    """``prompts`` as a list of prompts (one prompt is a list of one)."""
    if isinstance(prompts, (str, dict)) or _is_token_list(prompts):
        return [prompts]
    if isinstance(prompts, Sequence):
        return list(prompts)
    raise WrongTypeError(f"prompts: {PROMPT_FORMS}, or a list of those; got {_described(prompts)}")


def _params_list(params: Any) -> list[SamplingParams]:
    if isinstance(params, Sequence) and all(isinstance(p, SamplingParams) for p in params):
        return list(params)
    raise WrongTypeError(f"sampling_params: a SamplingParams or a list of them, got {_described(params)}")


def _token_ids(values: Any) -> list[int]:
    """Token ids as Python ints (numpy's too); anything else is refused."""
    try:
        return [operator.index(value) for value in values]
    except TypeError:
        raise WrongTypeError(f"token ids are integers, got {_described(values)}") from None


def _described(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _conversations(messages: Any) -> tuple[list[list[dict[str, Any]]], list[str]]:
    """``messages`` as a list of conversations (one conversation is a list of one), and where each is in
    ``messages``, as errors name it: ``messages`` itself, or ``messages.N`` of a list of conversations."""
    if isinstance(messages, list) and messages and isinstance(messages[0], dict) and _all_dicts(messages):
        return [messages], ["messages"]
    if isinstance(messages, list) and all(_all_dicts(c) for c in messages):
        return messages, [f"messages.{c}" for c in range(len(messages))]
    raise WrongTypeError(f"messages: a list of message dicts ({{'role': ..., 'content': ...}}), or a list of such "
                         f"lists; got {_described(messages)}")  # fmt: skip


def _all_dicts(conversation: Any) -> bool:
    return isinstance(conversation, list) and all(isinstance(message, dict) for message in conversation)


def _conversation_for_template(
    conversation: list[dict[str, Any]], content_format: str, takes_images: bool, field: str
) -> tuple[list[dict[str, Any]], list[Any]]:
    """The conversation with its content parts as templates read them (:func:`_part_for_template`), and the
    images in order; a message of text parts alone as one string, its parts joined by newlines, where
    ``content_format`` is "string". ``field``: where the conversation is in ``chat``'s ``messages``."""
    images: list[Any] = []
    messages = []
    for i, message in enumerate(conversation):
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                part, image = _part_for_template(part, takes_images, f"{field}.{i}.content.{j}")
                parts.append(part)
                if image is not None:
                    images.append(image)
            message = {**message, "content": template_content(parts, content_format)}
        messages.append(message)
    return messages, images


def _part_for_template(part: dict[str, Any], takes_images: bool, field: str) -> tuple[dict[str, Any], Any]:
    """A content part as templates read it, and its image: a part vLLM reads as text (:data:`TEXT_PART_FIELDS`)
    as ``{"type": "text", "text": ...}``, an image part (``image_pil``, ``image``) as ``{"type": "image"}``."""
    kind = part.get("type")
    if kind in TEXT_PART_FIELDS:
        text = part.get(TEXT_PART_FIELDS[kind])
        if not isinstance(text, str):
            raise ValueError(f"{field}: a part of type {kind!r} needs its {TEXT_PART_FIELDS[kind]!r} (a string)")
        return {"type": "text", "text": text}, None
    if kind in IMAGE_PARTS and not takes_images:
        raise ValueError(f"{field}: an image part ({kind!r}), but the model takes text only: it cannot read images")
    if kind in ("image_pil", "image") and part.get(kind) is not None:
        return {"type": "image"}, part[kind]
    return part, None


def _is_token_list(prompts: Any) -> bool:
    return isinstance(prompts, list) and bool(prompts) and all(isinstance(t, int) for t in prompts)
