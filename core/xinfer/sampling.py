"""What a request asks of generation: how to pick tokens, and when to stop."""

from __future__ import annotations

import copy
import json
import logging
import numbers
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from xinfer.errors import WrongTypeError
from xinfer.grammar.spec import StructuredOutputs

log = logging.getLogger("xinfer")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # the text ends after the stop string, not before it
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (-1: every token's)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (after the first; -1: every token's)
    skip_special_tokens: bool = True
    # vLLM's: a fast tokenizer's decode (xinfer's) joins special tokens as its decoder does, and vLLM's fast path
    # ignores it too; taken for vLLM's callers
    spaces_between_special_tokens: bool = True
    detokenize: bool = True  # False: no text (token ids only), as vLLM's
    structured_outputs: StructuredOutputs | None = None  # a dict of its fields is taken too
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI: -100 bans, 100 forces)
    allowed_token_ids: list[int] | None = None  # vLLM's: the only tokens it may generate
    truncate_prompt_tokens: int | None = None  # vLLM's: only the prompt's last N tokens run (-1: the context's worth)
    bad_words: list[str] | None = None  # vLLM's: words never generated (their last token banned where it ends one)

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs.of(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("logprobs", "prompt_logprobs"):
            setattr(self, name, _logprobs_of_bool(getattr(self, name)))
        self._check_types()
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:  # vLLM's: unseeded
            self.seed = None
        _check(self.n >= 1, f"n must be at least 1, got {self.n}")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            log.warning("temperature %s raised to %s (vLLM's floor: 1 / T overflows below it)", self.temperature,
                        MIN_TEMPERATURE)  # fmt: skip
            self.temperature = MIN_TEMPERATURE
        _check(self.top_k >= 0, f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        _check(self.top_k < 2**63, f"top_k must be below 2**63 (an int64), got {self.top_k}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        _check(all(self.stop), "stop strings must not be empty")
        _check(all(word.strip() for word in self.bad_words or ()), "bad_words must not be empty or blank")
        _check(self.detokenize or not self.stop, "stop strings need detokenize=True (they match the text)")
        _check(all(t >= 0 for t in self.stop_token_ids), f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        for name in ("logprobs", "prompt_logprobs"):  # -1: the whole vocabulary (vLLM's)
            value = getattr(self, name)
            _check(value is None or value >= -1, f"{name} must be >= 0, or -1 for the whole vocabulary, got {value}")
        _check(
            self.truncate_prompt_tokens is None
            or self.truncate_prompt_tokens >= 1
            or self.truncate_prompt_tokens == -1,
            f"truncate_prompt_tokens must be -1 (the context) or at least 1, got {self.truncate_prompt_tokens}",
        )
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = sorted({int(token) for token in self.allowed_token_ids})
            _check(bool(self.allowed_token_ids), "allowed_token_ids must not be empty")
            _check(self.allowed_token_ids[0] >= 0, f"allowed_token_ids must be >= 0, got {self.allowed_token_ids[0]}")
        if self.logit_bias:
            self.logit_bias = {int(token): float(bias) for token, bias in self.logit_bias.items()}
            _check(min(self.logit_bias) >= 0, f"logit_bias token ids must be >= 0, got {min(self.logit_bias)}")
            _check(
                all(-100 <= bias <= 100 for bias in self.logit_bias.values()),
                "logit_bias values must be in [-100, 100]",
            )

    def _check_types(self) -> None:
        """Numbers where numbers go, strings and token ids in the stop lists, before their ranges are checked."""
        for name in INTEGERS:
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) and (value is not None or name not in OPTIONAL):
                raise WrongTypeError(f"{name} must be an integer{' or None' if name in OPTIONAL else ''}, "
                                     f"got {type(value).__name__} {value!r}")  # fmt: skip
        for name in REALS:
            value = getattr(self, name)
            if not isinstance(value, numbers.Real):
                raise WrongTypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
        if not (self.stop is None or _all_of(self.stop, str)):
            raise WrongTypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not (self.stop_token_ids is None or _all_of(self.stop_token_ids, numbers.Integral)):
            raise WrongTypeError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        if not (self.logit_bias is None or isinstance(self.logit_bias, dict)):
            raise WrongTypeError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
        if not (self.bad_words is None or _all_of(self.bad_words, str)):
            raise WrongTypeError(f"bad_words must be a list of strings, got {self.bad_words!r}")
        if not (self.allowed_token_ids is None or _all_of(self.allowed_token_ids, numbers.Integral)):
            raise WrongTypeError(f"allowed_token_ids must be a list of token ids, got {self.allowed_token_ids!r}")

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's)."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _logprobs_of_bool(value: Any) -> Any:
    """vLLM's ``logprobs=True`` (OpenAI's habit) is 1; ``False``, which vLLM leaves a bool, is None: no logprobs,
    as OpenAI's ``false``."""
    if isinstance(value, bool):
        return 1 if value else None
    return value


# vLLM's: a temperature above 0 and below it samples at it (only 0 is greedy)
MIN_TEMPERATURE = 0.01

INTEGERS = ("n", "top_k", "min_tokens", "max_tokens", "seed", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")
OPTIONAL = ("max_tokens", "seed", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")
REALS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


# generation_config.json's fields a request's sampling takes its defaults from (vLLM's), as SamplingParams names them
RECOMMENDED_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                      "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}  # fmt: skip
GENERATION_CONFIG = "generation_config.json"
GENERATION_CONFIG_CHOICES = "'auto' (the model's folder), 'none' (vLLM's 'vllm') or a folder holding one"


def recommended_sampling(generation_config: str, model_path: Path) -> dict[str, Any]:
    """The sampling defaults a checkpoint's authors recommend, as vLLM applies them: the values of
    :data:`RECOMMENDED_FIELDS` in ``generation_config.json`` (``max_new_tokens`` as ``max_tokens``).
    ``generation_config``: "auto" reads the one in ``model_path`` (an HF folder; a .gguf file has none), "none"
    (or vLLM's "vllm") reads none, anything else is a folder holding one, which must be readable. A value that
    :class:`SamplingParams` refuses is left out with a warning: a checkpoint's file should not stop a start."""
    check_generation_config(generation_config)
    if generation_config in ("none", "vllm"):
        return {}
    file = (model_path if generation_config == "auto" else Path(generation_config).expanduser()) / GENERATION_CONFIG
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        if generation_config != "auto":  # the file asked for
            raise ValueError(f"generation_config {generation_config!r}: {file} is not JSON ({error})") from None
        log.warning("%s: not read (%s); no recommended sampling", file, error)
        return {}
    recommended = {}
    for key, name in RECOMMENDED_FIELDS.items():
        value = config.get(key) if isinstance(config, dict) else None
        if value is None:
            continue
        try:
            SamplingParams(**{name: value})
        except ValueError as error:
            log.warning("%s: %s %r left out: %s", file, key, value, error)
            continue
        recommended[name] = value
    return recommended


def check_generation_config(generation_config: str) -> None:
    """Refuses a ``generation_config`` that is no choice and no folder holding one (before a model loads)."""
    if generation_config in ("auto", "none", "vllm"):
        return
    folder = Path(generation_config).expanduser()
    if not folder.is_dir():
        raise ValueError(f"generation_config {generation_config!r}: not a folder; {GENERATION_CONFIG_CHOICES}")
    if not (folder / GENERATION_CONFIG).is_file():
        raise ValueError(f"generation_config {generation_config!r}: the folder holds no {GENERATION_CONFIG}")


def truncated(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """A prompt as ``truncate_prompt_tokens`` (``keep``) cuts it: its last ``keep`` tokens (-1: the context's
    worth; None: all)."""
    if keep is None:
        return token_ids
    return token_ids[-(max_model_len if keep == -1 else keep) :]


def _all_of(values: object, kind: type) -> bool:
    return isinstance(values, (list, tuple)) and all(isinstance(value, kind) for value in values)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class SampledRow(NamedTuple):
    """What a step's sampled row draws with: its request's params, the request's seed
    (every request has one), and the index in its sequence of the token being drawn."""

    params: SamplingParams
    seed: int
    position: int


class SamplingBatch:
    """The sampling parameters of a step's sampled rows, one tensor per field, as views
    of one byte buffer (:meth:`nbytes` of them): a batch travels to the device in one
    copy, alone (:meth:`to`) or as part of a recorded step's input buffer.

    ``temperature`` 0 is greedy;
    ``top_k`` 0 is off; ``seed`` and ``position`` (the index in its sequence of the token
    being drawn) key each row's noise. Rows past
    the ones written are greedy padding. Row ``i`` of a batch samples row ``i`` of
    the logits (:meth:`xinfer.ops.Ops.sample`); a batch may hold more rows than them."""

    INTS = ("seed", "position", "top_k")  # int64
    FLOATS = ("temperature", "top_p", "min_p")  # float32

    seed: Tensor
    position: Tensor
    top_k: Tensor
    temperature: Tensor
    top_p: Tensor
    min_p: Tensor

    def __init__(self, buffer: Tensor, num_rows: int):
        self.buffer, self.num_rows = buffer, num_rows
        ints = buffer[: 8 * len(self.INTS) * num_rows].view(torch.int64).view(len(self.INTS), num_rows)
        floats = buffer[8 * len(self.INTS) * num_rows :].view(torch.float32).view(len(self.FLOATS), num_rows)
        for name, view in [*zip(self.INTS, ints), *zip(self.FLOATS, floats)]:
            setattr(self, name, view)

    @classmethod
    def nbytes(cls, num_rows: int) -> int:
        return (8 * len(cls.INTS) + 4 * len(cls.FLOATS)) * num_rows

    @classmethod
    def empty(cls, num_rows: int) -> SamplingBatch:
        return cls(torch.zeros(cls.nbytes(num_rows), dtype=torch.uint8), num_rows)

    @classmethod
    def of(cls, rows: list[SampledRow], num_rows: int | None = None) -> SamplingBatch:
        """A host batch of ``rows``, padded to ``num_rows``."""
        batch = cls.empty(len(rows) if num_rows is None else num_rows)
        batch.write(rows)
        return batch

    def write(self, rows: list[SampledRow]) -> None:
        """Rows ``0 .. len(rows)`` from ``rows``; the rest greedy. One packing call into the
        (host) buffer: a step's host time counts."""
        pad = [0] * (self.num_rows - len(rows))
        ints = [_int64(row.seed) for row in rows] + pad
        ints += [row.position for row in rows] + pad
        ints += [row.params.top_k for row in rows] + pad
        zeros = [0.0] * len(pad)
        floats = [0.0 if row.params.greedy else row.params.temperature for row in rows] + zeros
        floats += [row.params.top_p for row in rows] + [1.0] * len(pad)
        floats += [row.params.min_p for row in rows] + zeros
        struct.pack_into(f"<{len(ints)}q{len(floats)}f", self.buffer.numpy().data, 0, *ints, *floats)

    def to(self, device: torch.device) -> SamplingBatch:
        return SamplingBatch(self.buffer.to(device, non_blocking=True), self.num_rows)


def _int64(seed: int) -> int:
    """``seed`` wrapped into int64 (choice ``i`` of a request seeded near the top adds ``i``)."""
    return (seed + 2**63) % 2**64 - 2**63
