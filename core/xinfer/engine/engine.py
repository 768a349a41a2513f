"""The engine: sequences in, one scheduled model step at a time, their new tokens out."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from xinfer.backend import check_support, device_memory, select_backend
from xinfer.cache.allocate import CacheLayout, allocate_caches
from xinfer.cache.block_pool import BlockPool
from xinfer.cache.manager import CacheManager
from xinfer.cache.state_pool import StatePool
from xinfer.config import EngineConfig, resolve_dtype
from xinfer.engine.kv_calibration import calibrate_keys
from xinfer.engine.memory_plan import memory_baseline, plan_memory
from xinfer.engine.runner import ModelRunner
from xinfer.engine.sampler import SampledTokens
from xinfer.engine.scheduler import ScheduledSeq, Scheduler
from xinfer.engine.sequence import PENDING, Sequence
from xinfer.kv import get_format
from xinfer.loading.loader import load_config, load_model
from xinfer.loading.resolve import resolve_model_path
from xinfer.sampling import SamplingParams
from xinfer.text.tokenizer import Tokenizer

log = logging.getLogger("xinfer")


class KVCacheFull(RuntimeError):
    """The KV pool has no room for the request right now; retrying later may succeed."""


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_cache_queries: int  # in blocks
    prefix_cache_hits: int
    num_preemptions: int


@dataclass
class StepOutput:
    """What one step added to one sequence."""

    request_id: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Any = None):
        self.config = config
        self.backend, self.ops, self.device = select_backend(config.device)
        check_support(self.backend, self.ops, config)
        memory = device_memory(self.backend, self.device)
        baseline = memory_baseline(memory)
        path = resolve_model_path(config.model.model)
        self.model_path = path
        self.hf_config = load_config(path)
        self.dtype = resolve_dtype(config.model.dtype, getattr(self.hf_config, "dtype", None), self.device.type)
        torch.manual_seed(config.model.seed)
        self.model = load_model(path, self.hf_config, self.device, self.dtype, config.model.load_format)
        self.max_model_len = config.model.max_model_len or self.hf_config.max_position_embeddings
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(path)
        self.eos_token_ids = frozenset(_eos_ids(self.hf_config, self.tokenizer))
        cache = config.cache
        self.kv_format = get_format(cache.kv_cache_dtype)
        if cache.kv_recent_window and cache.kv_cache_dtype == "auto":
            raise ValueError(
                "kv_recent_window (--kv-recent-window) keeps recent keys exact beside a quantized "
                "cache: choose one with kv_cache_dtype (--kvcache-dtype fp8, turbo8, turbo4, turbo3)"
            )
        layout = CacheLayout.of(self.model)
        self.runner = ModelRunner(self.model, self.ops, cache.block_size, self.device, config.model.seed,
                                  len(layout.groups), bool(layout.state_layers))  # fmt: skip
        key_transforms = calibrate_keys(self, layout)
        plan = plan_memory(
            config, self.runner, layout, self.max_model_len, self.dtype, self.kv_format, memory, baseline,
            key_transforms,
        )  # fmt: skip
        allocate_caches(
            layout, plan.num_blocks, cache.block_size, self.dtype, self.device, self.kv_format, plan.num_state_slots,
            key_transforms, [pool.num_shadows for pool in plan.pools], cache.kv_recent_window,
        )  # fmt: skip
        scheduler = config.scheduler.model_copy(update={"max_num_seqs": plan.max_num_seqs})
        self.config = config = config.model_copy(update={"scheduler": scheduler})
        pools = [
            BlockPool(pool.num_blocks, cache.block_size, pool.window, pool.num_shadows, cache.kv_recent_window)
            for pool in plan.pools
        ]
        states = StatePool(plan.num_state_slots) if plan.num_state_slots else None
        self.cache = CacheManager(pools, cache.enable_prefix_caching, states)
        if states is not None and cache.enable_prefix_caching:
            log.info("prefix caching is off: this model has recurrent layers, whose states are not snapshotted yet")
        self.scheduler = Scheduler(scheduler, self.cache)
        log.info("%s, KV cache format %s", plan.describe(), self.kv_format.name)
        if not config.device.enforce_eager:
            self.runner.capture_graphs(plan.max_num_seqs, scheduler.max_num_batched_tokens, self.max_model_len,
                                       shadows=any(pool.num_shadows for pool in plan.pools))  # fmt: skip
        self.sequences: dict[str, Sequence] = {}
        self.in_flight: SampledTokens | None = None  # the last step launched, not yet read back

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        num_prompt = len(prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"the prompt has {num_prompt} tokens, the model's context is {self.max_model_len} tokens: "
                f"the prompt must be shorter to leave room for at least one generated token"
            )
        self._check_vocab(prompt_token_ids)
        max_num_tokens = min(self.max_model_len, num_prompt + (params.max_tokens or self.max_model_len))
        if params.seed is None:  # every request draws from a seed of its own (see engine/sampler.py)
            params = replace(params, seed=self.runner.sampler.new_seed())
        seq = Sequence(request_id, prompt_token_ids, params, self.eos_token_ids, max_num_tokens=max_num_tokens)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return seq

    @torch.inference_mode()
    def hidden_states(self, token_ids: list[int]) -> torch.Tensor:
        """Final hidden states [T, hidden] over ``token_ids`` (embeddings, prompt scoring),
        through blocks borrowed from the KV pool for one forward, between steps."""
        if not token_ids:
            raise ValueError("the input is empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"the input has {len(token_ids)} tokens, the model's context is {self.max_model_len} tokens"
            )
        self._check_vocab(token_ids)
        seq = Sequence("hidden-states", token_ids, SamplingParams())
        if not self.cache.allocate(seq, len(token_ids)):
            self.cache.release(seq)
            raise KVCacheFull("the KV cache is full; retry later")
        try:
            return self.runner.hidden_states(self.runner.prepare([ScheduledSeq(seq, len(token_ids))]))
        finally:
            self.cache.release(seq)

    def _check_vocab(self, token_ids: list[int]) -> None:
        vocab_size = self.hf_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got {min(token_ids)}..{max(token_ids)}")

    def abort(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=self.cache.usage,
            prefix_cache_queries=self.cache.queries,
            prefix_cache_hits=self.cache.hits,
            num_preemptions=self.scheduler.num_preemptions,
        )

    def step(self) -> list[StepOutput]:
        """Launches the next step, then reads back the one before it and returns what it
        added: the host schedules and prepares a step while the device runs the previous
        one. Sequences whose last token is still on the device are scheduled with it
        (:data:`~xinfer.engine.sequence.PENDING`); one that turns out to have stopped
        has run one step for nothing, and that step's token is dropped."""
        scheduled = self.scheduler.schedule()
        previous, self.in_flight = self.in_flight, None
        outputs = []
        if previous is not None and any(s.seq.params.has_penalties for s in scheduled):
            outputs, previous = self._read_back(previous), None  # penalties count every earlier token
        sampled = self.runner.step(scheduled, previous) if scheduled else None
        if previous is not None:
            outputs = self._read_back(previous)
        for item in scheduled:
            if not item.seq.finished:
                item.seq.num_computed_tokens += item.num_new_tokens
                self.cache.commit(item.seq)
                self.cache.trim(item.seq)
        if sampled is not None:
            for seq in sampled.seqs:
                if not seq.finished:
                    seq.token_ids.append(PENDING)
            self.in_flight = sampled
        return outputs

    def _read_back(self, sampled: SampledTokens) -> list[StepOutput]:
        result = sampled.result()
        return [
            self._append(seq, token, logprobs)
            for seq, token, logprobs in zip(sampled.seqs, result.token_ids, result.logprobs)
            if not seq.finished  # stopped or aborted since this step was launched
        ]

    def _append(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> StepOutput:
        assert seq.token_ids[-1] == PENDING
        seq.token_ids[-1] = token
        reason, stop_reason = self._finish_reason(seq, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self.sequences[seq.request_id]
        return StepOutput(
            seq.request_id,
            [token],
            [logprobs] if logprobs is not None else [],
            seq.num_cached_tokens,
            finish_reason=reason,
            stop_reason=stop_reason,
        )

    def _finish_reason(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        """Why ``token`` ends ``seq``, if it does; stop strings are the output processor's."""
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                return "stop", token
            if token in seq.eos_token_ids and not params.ignore_eos:
                return "stop", None
        if seq.at_limit:  # max_tokens or the context
            return "length", None
        return None, None


def _load_tokenizer(path: Path) -> Tokenizer | None:
    if path.suffix == ".gguf" or (path / "tokenizer.json").is_file():
        return Tokenizer.from_path(path)
    return None


def _eos_ids(hf_config: Any, tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "eos_token_ids", None) or ())
    eos = getattr(hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids
