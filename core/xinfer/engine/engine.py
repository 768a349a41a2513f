"""The engine: sequences in, one scheduled model step at a time, their new tokens out."""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from xinfer.config import EngineConfig
from xinfer.distributed.group import SINGLE, TensorParallel
from xinfer.engine.build import build_engine
from xinfer.engine.failures import RequestFailed, log_failure
from xinfer.engine.sampler import SampledTokens, bad_word_token_ids, reads_earlier_tokens
from xinfer.engine.scheduler import ScheduledSeq
from xinfer.engine.sequence import PENDING, Sequence
from xinfer.logprob import Logprob
from xinfer.multimodal.encoder_cache import EncoderCache
from xinfer.multimodal.inputs import MultiModalModel, MultiModalProcessor, PlaceholderRange, expand_prompt
from xinfer.ops import HostBatch
from xinfer.sampling import SamplingParams

if TYPE_CHECKING:
    from xinfer.distributed.ranks import Ranks
    from xinfer.grammar.matcher import GrammarCompiler


T = TypeVar("T")


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
    num_steps: int = 0
    num_step_sequences: int = 0  # summed over the steps: over num_steps, the mean batch
    num_step_tokens: int = 0  # computed (prompt and generated), summed over the steps
    num_free_seqs: int = 0  # sequences the running batch has room for (max_num_seqs less those running)


@dataclass
class StepOutput:
    """What one step added to one sequence."""

    request_id: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # why the engine failed it (finish reason "error")
    # ended by its last token, a stop token id or EOS: vLLM leaves that token's text out (but for
    # include_stop_str_in_output)
    stop_token: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLMEngine:
    """Steps the parts start-up builds (:func:`xinfer.engine.build.build_engine`)."""

    def __init__(self, config: EngineConfig, tokenizer: Any = None):
        self.ranks: Ranks | None = None
        self._owns_ranks, tp = False, SINGLE
        if config.parallel.tensor_parallel_size > 1:
            config, tp = self._lead_ranks(config, tokenizer)
        try:
            with self.ranks.failing_as_workers() if self.ranks is not None else contextlib.nullcontext():
                parts = build_engine(config, tokenizer, tp)
        except BaseException:
            self.shutdown()
            raise
        self.config = parts.config
        self.model_path = parts.model_path
        self.hf_config = parts.hf_config
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.dtype = parts.dtype
        self.kv_format = parts.kv_format
        self.runner = parts.runner
        self.runner.ranks = self.ranks
        self.model, self.ops, self.device = self.runner.model, self.runner.backend, self.runner.device
        self.cache = parts.cache
        self.scheduler = parts.scheduler
        self.eos_token_ids, self.tokenizer_eos_ids = parts.eos_token_ids, parts.tokenizer_eos_ids
        self.mm_processor: MultiModalProcessor | None = None  # for a model that takes images
        if isinstance(self.model, MultiModalModel):
            self.mm_processor = self.model.multimodal_processor(self.tokenizer)
        self.sequences: dict[str, Sequence] = {}
        self.in_flight: SampledTokens | None = None  # the last step launched, not yet read back
        self._grammars: GrammarCompiler | None = None

    def _lead_ranks(self, config: EngineConfig, tokenizer: Any) -> tuple[EngineConfig, TensorParallel]:
        """Under tensor parallelism: the ranks of this process's open group (:func:`xinfer.distributed.ranks.started`)
        or new ones, told to build their parts; this process is the first rank."""
        from xinfer.distributed.ranks import Ranks, rank_device  # torch.distributed only where it is used

        parallel = config.parallel
        if parallel.node_rank != 0:
            raise ValueError(
                f"node_rank {parallel.node_rank}: only node 0 runs the engine; the other nodes follow it "
                f"(xinfer --num-nodes {parallel.num_nodes} --node-rank {parallel.node_rank} --master-addr ...)"
            )
        device = rank_device(config.device, parallel, 0)  # devices this machine lacks: refused before ranks start
        ranks = Ranks.active
        if ranks is None or ranks.parallel.tensor_parallel_size != parallel.tensor_parallel_size:
            ranks, self._owns_ranks = Ranks.start(parallel, config.device), True
        self.ranks = ranks
        config = config.model_copy(update={"device": device})
        ranks.send(("build", config, _picklable(tokenizer)))
        return config, ranks.tp

    def check_ranks(self) -> None:
        """Raises :class:`~xinfer.distributed.WorkerFailed` if a tensor-parallel rank has died."""
        if self.ranks is not None:
            self.ranks.check()

    def shutdown(self) -> None:
        """Under tensor parallelism: the other ranks drop this engine (and exit, if it started them)."""
        ranks, self.ranks = self.ranks, None
        if ranks is None:
            return
        if self._owns_ranks:
            ranks.close()
        else:
            with contextlib.suppress(RuntimeError):
                ranks.send(("release",))

    @property
    def modalities(self) -> list[str]:
        """What the model takes besides text (``image``)."""
        return sorted(self.mm_processor.placeholders) if self.mm_processor is not None else []

    @property
    def encoder_cache(self) -> EncoderCache:
        """Encoder outputs by image content (its ``hits`` count the images not encoded again)."""
        return self.runner.encoder_cache

    def multimodal_prompt(
        self, token_ids: list[int], data: Mapping[str, Any] | None
    ) -> tuple[list[int], list[PlaceholderRange]]:
        """``token_ids`` with each placeholder of ``data``'s items (vLLM's ``multi_modal_data``:
        ``{"image": image or [images]}``) expanded, and where each item's embeddings go."""
        if not data:
            return list(token_ids), []
        if self.mm_processor is None:
            raise ValueError(f"the model {self.config.model.model or 'default'} takes text only, not {', '.join(data)}")
        items = []
        for modality, values in data.items():
            if modality not in self.mm_processor.placeholders:
                raise ValueError(f"the model takes {', '.join(self.modalities)}, not {modality}")
            for value in values if isinstance(values, (list, tuple)) else [values]:
                items.append(self.mm_processor.process(modality, value))
        return expand_prompt(self.mm_processor, token_ids, items)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        multimodal: list[PlaceholderRange] | None = None,
    ) -> Sequence:
        """Queues a sequence; ``multimodal``: where its images' embeddings go (:meth:`multimodal_prompt`)."""
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
        if params.logprobs is not None:
            params = replace(params, logprobs=self._top_n("logprobs", params.logprobs))
        for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids)):
            if ids and max(ids) >= self.hf_config.vocab_size:
                raise ValueError(f"{name} token ids must be below the vocabulary's {self.hf_config.vocab_size}")
        max_num_tokens = min(self.max_model_len, num_prompt + (params.max_tokens or self.max_model_len))
        if params.seed is None:  # every request draws from a seed of its own (see engine/sampler.py)
            params = replace(params, seed=self.runner.sampler.new_seed())
        whole_items = self._check_multimodal(multimodal or [], num_prompt)
        seq = Sequence(request_id, prompt_token_ids, params, self.eos_token_ids, max_num_tokens=max_num_tokens,
                       multimodal=list(multimodal or []), whole_items=whole_items)  # fmt: skip
        if params.structured_outputs is not None:
            seq.constraint = self.grammars().compile(params.structured_outputs)
        for name, words in (("stop strings", params.stop), ("bad_words", params.bad_words)):
            if words and self.tokenizer is None:  # (stop strings match the text, which only a tokenizer gives)
                raise ValueError(f"{name} need the model's tokenizer: this model has none")
        if params.bad_words:
            seq.bad_word_ids = bad_word_token_ids(params.bad_words, self.tokenizer, self.hf_config.vocab_size)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def grammars(self) -> GrammarCompiler:
        """The compiler of structured-output constraints for this model's vocabulary (built
        when a first request asks for one)."""
        if self._grammars is None:
            from xinfer.grammar.matcher import GrammarCompiler  # llguidance: only where constraints are asked for

            self._grammars = GrammarCompiler(self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids)
        return self._grammars

    def _check_multimodal(self, ranges: list[PlaceholderRange], num_prompt: int) -> bool:
        """Refuse ranges the engine cannot run; whether the sequence's chunks keep items whole."""
        if not ranges:
            return False
        if not isinstance(self.model, MultiModalModel):
            raise ValueError(f"the model {self.config.model.model or 'default'} takes text only")
        if any(r.offset < 0 or r.end > num_prompt for r in ranges):
            raise ValueError("an image's tokens lie outside the prompt")
        whole = self.model.attend_within_items
        budget = self.config.scheduler.max_num_batched_tokens
        if whole and (longest := max(r.item.num_embeddings for r in ranges)) > budget:
            raise ValueError(f"an image takes {longest} tokens, more than max_num_batched_tokens ({budget}): "
                             f"this model computes an image's tokens in one step")  # fmt: skip
        return whole

    @torch.inference_mode()
    def hidden_states(self, token_ids: list[int]) -> torch.Tensor:
        """Final hidden states [T, hidden] over ``token_ids`` (embeddings, prompt scoring)."""
        return torch.cat(self._in_steps(token_ids, None, lambda batch, _start, _end: self.runner.hidden_states(batch)))

    @torch.inference_mode()
    def prompt_logprobs(
        self, token_ids: list[int], top_n: int, multimodal: list[PlaceholderRange] | None = None
    ) -> list[dict[int, Logprob] | None]:
        """Each token's log-probability after the tokens before it (``None`` for the first), with
        the ``top_n`` likeliest tokens there (-1: all): the logprobs of a prompt echoed back; ``multimodal``:
        where its images' embeddings go, as :meth:`add_request`'s."""
        top_n = self._top_n("prompt_logprobs", top_n)

        def score(batch: HostBatch, start: int, end: int) -> list[dict[int, Logprob]]:
            return self.runner.prompt_logprobs(batch, token_ids[start + 1 : end + 1], top_n)

        entries: list[dict[int, Logprob] | None] = [None]
        for step in self._in_steps(token_ids, multimodal, score):
            entries += step
        return entries

    def _in_steps(
        self,
        token_ids: list[int],
        multimodal: list[PlaceholderRange] | None,
        run: Callable[[HostBatch, int, int], T],
    ) -> list[T]:
        """``run(batch, start, end)`` on each step of ``token_ids`` (and the images ``multimodal``
        places) through the model as one sequence, whose positions ``start:end`` the step computes:
        chunked as its prefill would be (at most ``max_num_batched_tokens`` a step, so activations
        stay within the profiled ones and a sliding window's pool needs only its window and a step),
        through blocks borrowed from the pools between engine steps."""
        if not token_ids:
            raise ValueError("the input is empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"the input has {len(token_ids)} tokens, the model's context is {self.max_model_len} tokens"
            )
        self._check_vocab(token_ids)
        ranges = list(multimodal or [])
        seq = Sequence("whole-input", token_ids, SamplingParams(), multimodal=ranges,
                       whole_items=self._check_multimodal(ranges, len(token_ids)))  # fmt: skip
        budget = self.config.scheduler.max_num_batched_tokens  # past the model's context switch (build_engine)
        results: list[T] = []
        try:
            while (start := seq.num_computed_tokens) < len(token_ids):
                end = seq.chunk_end(start, min(len(token_ids), start + budget))
                assert end > start, "an image longer than a step is refused by _check_multimodal"
                if not self.cache.allocate(seq, end):
                    raise KVCacheFull("the KV cache is full; retry later")
                results.append(run(self.runner.prepare([ScheduledSeq(seq, end - start)]), start, end))
                seq.num_computed_tokens = end
                self.cache.trim(seq)
        finally:
            self.cache.release(seq)
        return results

    def _check_vocab(self, token_ids: list[int]) -> None:
        vocab_size = self.hf_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got {min(token_ids)}..{max(token_ids)}")

    def _top_n(self, name: str, top_n: int) -> int:
        """How many alternatives per token ``top_n`` asks for (-1: the whole vocabulary); more than the vocabulary
        has is refused."""
        vocab_size = self.hf_config.vocab_size
        if top_n > vocab_size:
            raise ValueError(f"{name} must be at most the vocabulary's {vocab_size} tokens, got {top_n}")
        return vocab_size if top_n == -1 else top_n

    def abort(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def stats(self) -> EngineStats:
        scheduler, cache = self.scheduler, self.cache
        return EngineStats(len(scheduler.running), len(scheduler.waiting), cache.usage, cache.queries, cache.hits,
                           scheduler.num_preemptions, scheduler.num_steps, scheduler.num_step_sequences,
                           scheduler.num_step_tokens, max(0, scheduler.max_num_seqs - len(scheduler.running)))  # fmt: skip

    def step(self) -> list[StepOutput]:
        """Launches the next step, then reads back the one before it and returns what it
        added: the host schedules and prepares a step while the device runs the previous
        one. Sequences whose last token is still on the device are scheduled with it
        (:data:`~xinfer.engine.sequence.PENDING`); one that turns out to have stopped
        has run one step for nothing, and that step's token is dropped."""
        scheduled = self.scheduler.schedule()
        previous, self.in_flight = self.in_flight, None
        outputs: list[StepOutput] = []
        if previous is not None and any(reads_earlier_tokens(s.seq) for s in scheduled):
            outputs, previous = self._read_back(previous), None
            scheduled = [s for s in scheduled if not s.seq.finished]  # stopped by that token: their blocks are freed

        def read_previous() -> None:  # on the host while the device runs the forward
            nonlocal outputs, previous
            if previous is not None:
                outputs, previous = self._read_back(previous), None

        failed: list[StepOutput] = []
        sampled = self._launch(scheduled, previous, read_previous, failed) if scheduled else None
        read_previous()
        for item in scheduled:
            if not item.seq.finished:
                item.seq.num_computed_tokens += item.num_new_tokens
                self.cache.commit(item.seq)
                self.cache.trim(item.seq)
        if sampled is not None:
            failed += [self._fail(seq, error) for seq, error in sampled.failures]
            for seq in sampled.seqs:
                if not seq.finished:
                    seq.token_ids.append(PENDING)
            self.in_flight = sampled
        return outputs + failed

    def _launch(
        self,
        scheduled: list[ScheduledSeq],
        previous: SampledTokens | None,
        read_previous: Callable[[], None],
        failed: list[StepOutput],
    ) -> SampledTokens | None:
        """The runner's step of ``scheduled``. A sequence whose packing fails ends with its error (in ``failed``)
        and the step is packed again without it: nothing was launched yet."""
        # grammar masks follow every earlier token: read back before sampling, not before the forward
        before_sampling = read_previous if any(s.seq.constraint is not None for s in scheduled) else None
        while scheduled:
            try:
                return self.runner.step(scheduled, previous, before_sampling)
            except RequestFailed as failure:
                failed.append(self._fail(failure.seq, failure.error))
                scheduled = [s for s in scheduled if s.seq is not failure.seq]
        return None

    def _fail(self, seq: Sequence, error: BaseException) -> StepOutput:
        """Ends ``seq`` with ``error``, freeing its blocks, state slot and grammar."""
        reason = log_failure(seq.request_id, error)
        self.scheduler.finish(seq, "error")
        seq.constraint = None
        self.sequences.pop(seq.request_id, None)
        return StepOutput(seq.request_id, [], finish_reason="error", error=reason)

    def _read_back(self, sampled: SampledTokens) -> list[StepOutput]:
        result = sampled.result()
        outputs = []
        for seq, token, logprobs in zip(sampled.seqs, result.token_ids, result.logprobs):
            if seq.finished:  # stopped or aborted since this step was launched
                continue
            try:
                outputs.append(self._append(seq, token, logprobs))
            except Exception as error:  # noqa: BLE001 - its grammar refusing the token, say: it fails alone
                outputs.append(self._fail(seq, error))
        return outputs

    def _append(self, seq: Sequence, token: int, logprobs: dict[int, Logprob] | None) -> StepOutput:
        assert seq.token_ids[-1] == PENDING
        seq.token_ids[-1] = token
        if seq.constraint is not None:
            seq.constraint.accept(token)
        reason, stop_reason, stop_token = self._finish_reason(seq, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self.sequences[seq.request_id]
        token_logprobs = [logprobs] if logprobs is not None else []
        return StepOutput(seq.request_id, [token], token_logprobs, seq.num_cached_tokens, reason, stop_reason,
                          stop_token=stop_token)  # fmt: skip

    def _finish_reason(self, seq: Sequence, token: int) -> tuple[str | None, int | None, bool]:
        """Why ``token`` ends ``seq``, if it does, and whether it is a stop token (a stop token id or
        EOS); stop strings are the output processor's."""
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                return "stop", token, True
            if token in seq.eos_token_ids and not params.ignore_eos:
                return "stop", None if token in self.tokenizer_eos_ids else token, True
        if seq.constraint is not None and seq.constraint.done:  # the grammar allows nothing more
            return "stop", None, False
        if seq.at_limit:  # max_tokens or the context
            return "length", None, False
        return None, None, False


def _picklable(tokenizer: Any) -> Any:
    """``tokenizer`` if it can be sent to the other ranks; else None (they load the model's own)."""
    try:
        pickle.dumps(tokenizer)
    except Exception:  # noqa: BLE001 - anything that cannot be pickled
        return None
    return tokenizer
