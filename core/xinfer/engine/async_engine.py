"""The engine loop on its own thread, fed and drained from an asyncio event loop.

The thread owns the :class:`LLMEngine`: it builds it (so the server answers
``/health`` while the weights load), takes commands between steps (add, abort,
embed), runs steps while there is work, and hands each step's outputs to the
event loop, where every request reads them from its own queue.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from xinfer.distributed.group import WorkerFailed
from xinfer.engine.engine import EngineStats, KVCacheFull, LLMEngine
from xinfer.engine.failures import RequestError, RequestFailed
from xinfer.engine.output import CompletionOutput, OutputProcessor, RequestOutput
from xinfer.loading.errors import first_line
from xinfer.sampling import SamplingParams

T = TypeVar("T")
log = logging.getLogger("xinfer")


IDLE_CHECK_SECONDS = 1.0


# a prompt's token ids and sampling, and where its image embeddings go (a one-prompt request with images)
EngineEntry = tuple[list[int], SamplingParams] | tuple[list[int], SamplingParams, list[Any]]


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"
    STOPPED = "stopped"


class EngineUnavailable(RuntimeError):
    """The engine takes no requests now (loading, shutting down, dead): 503."""


class QueueFull(RuntimeError):
    """Too many requests are waiting: 429."""


class TooManySequences(ValueError):
    """A request asks for more sequences than one request may: 400."""

    def __init__(self, asked: int, limit: int):
        super().__init__(f"the request asks for {asked} sequences; one request may ask for at most {limit}")
        self.asked, self.limit = asked, limit


@dataclass
class RequestHandle:
    """One client request: one or more prompts, each an engine request with its choices,
    whose outputs share one queue. Choice ``i * n + j`` is choice ``j`` of prompt ``i``."""

    outputs: list[RequestOutput]  # each prompt's, as far as :meth:`AsyncEngine.stream` has read
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: dict[tuple[int, int], float] = field(default_factory=dict)  # by (prompt, choice)
    inter_token_latencies: list[float] = field(default_factory=list)
    num_generated: int = 0
    accepted: asyncio.Future | None = None
    remote_cached_tokens: int | None = None  # prompt tokens another server's prefix cache held (it prefilled them)

    @property
    def choices(self) -> list[CompletionOutput]:
        return [choice for output in self.outputs for choice in output.outputs]

    @property
    def finished(self) -> bool:
        return all(output.finished for output in self.outputs)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(output.prompt_token_ids) for output in self.outputs)

    @property
    def num_cached_tokens(self) -> int:
        if self.remote_cached_tokens is not None:
            return self.remote_cached_tokens
        return sum(output.num_cached_tokens for output in self.outputs)


class AsyncEngine:
    def __init__(self, factory: Callable[[], LLMEngine], max_waiting: int = 256, stall_timeout: float = 300.0):
        self.factory = factory
        self.max_waiting = max_waiting
        self.stall_timeout = stall_timeout
        self.on_request_done: Callable[[RequestHandle], None] | None = None  # the metrics' hook
        self.engine: LLMEngine | None = None
        self.state = EngineState.LOADING
        self.error: str | None = None
        self.stats = EngineStats(0, 0, 0.0, 0, 0, 0)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._num_adding = 0  # sequences sent to the engine thread, not yet in its queue
        self._handles: dict[str, tuple[RequestHandle, int]] = {}  # engine request id -> (handle, prompt position)
        self._commands: deque[tuple[str, Any]] = deque()
        self._wake = threading.Condition()
        self._step_started: float | None = None
        self._loaded = threading.Event()
        self._thread = threading.Thread(target=self._run, name="xinfer-engine", daemon=True)

    # ---- lifecycle -------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        return self._loaded.wait(timeout)

    @property
    def running(self) -> bool:
        """Whether the engine thread runs (it ends stopped, or dead: see ``state``)."""
        return self._thread.is_alive()

    def health(self) -> tuple[bool, str]:
        """(healthy, status word); a step running longer than ``stall_timeout`` counts as stuck."""
        started = self._step_started
        if self.state is EngineState.READY and started is not None and time.monotonic() - started > self.stall_timeout:
            return False, "stalled"
        return self.state is EngineState.READY, self.state.value

    def begin_drain(self) -> None:
        if self.state in (EngineState.READY, EngineState.LOADING):
            self.state = EngineState.DRAINING

    @property
    def num_in_flight(self) -> int:
        return len({id(handle) for handle, _ in self._handles.values()})

    async def wait_idle(self, timeout: float) -> bool:
        """Waits until no request is in flight; False if ``timeout`` ran out first."""
        deadline = time.monotonic() + timeout
        while self._handles and time.monotonic() < deadline and self._thread.is_alive():
            await asyncio.sleep(0.05)
        return not self._handles

    def abort_all(self) -> None:
        """Ends every request now (the server shuts down): each stream raises :class:`EngineUnavailable` after
        what it was given so far, at once, and the engine thread frees the sequences after its current step
        (which may take long). An unfinished answer is an error, not a finish reason: OpenAI's and Anthropic's
        have none for it."""
        cut_off = EngineUnavailable("the server is shutting down: the answer was cut off before it ended")
        for handle in {id(h): h for h, _ in self._handles.values()}.values():
            self.abort(handle)
            handle.queue.put_nowait(cut_off)

    def stop(self, timeout: float = 10.0) -> None:
        if self.state is not EngineState.DEAD:
            self.state = EngineState.STOPPED
        self._send("stop", None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- requests (event-loop side) ---------------------------------------------

    async def submit(self, prompts: Sequence[EngineEntry]) -> RequestHandle:
        """Queues one request: an engine request per (prompt token ids, params) entry,
        each with the ``n`` choices of its params; a third element, where the prompt's image
        embeddings go (:meth:`LLMEngine.multimodal_prompt`).

        Returns once the engine accepted them all; raises ``ValueError`` (a bad prompt
        or params, from the engine; :class:`TooManySequences`), :class:`QueueFull` or
        :class:`EngineUnavailable`.
        """
        self.check_sequences(sum(entry[1].n for entry in prompts))
        self._check_available()
        # the sequences that wait to start: those queued or being added beyond the running batch's room
        waiting = self.stats.num_waiting + self._num_adding - self.stats.num_free_seqs
        if waiting >= self.max_waiting:
            raise QueueFull(f"{waiting} sequences are waiting (limit {self.max_waiting}); retry later")
        request_id = f"req-{next(self._ids)}"
        handle = RequestHandle(
            [RequestOutput.empty(f"{request_id}-{i}", entry[0], entry[1]) for i, entry in enumerate(prompts)]
        )
        handle.accepted = self._event_loop.create_future()
        for position, output in enumerate(handle.outputs):
            self._handles[output.request_id] = (handle, position)
        self._num_adding += len(handle.choices)  # until the engine thread's answer reaches the loop (_resolve)
        self._send("add", (handle, prompts))
        try:
            await handle.accepted
        except BaseException:
            self.abort(handle)
            for output in handle.outputs:
                self._handles.pop(output.request_id, None)
            raise
        return handle

    def check_sequences(self, num_sequences: int) -> None:
        """One request may ask for as many sequences (its prompts times ``n``) as the queue holds (``max_waiting``):
        more could never run beside other clients' requests, would hold the engine for all of them, and cost host
        memory before the first step. (The engine runs more than ``max_num_seqs`` of them in turns: no hang.)"""
        if num_sequences > self.max_waiting:
            raise TooManySequences(num_sequences, self.max_waiting)

    async def stream(self, handle: RequestHandle) -> AsyncIterator[tuple[int, CompletionOutput]]:
        """Yields (request-wide choice index, what a step added to that choice) until every
        choice finished, keeping ``handle.outputs`` up to date. Leaving early (the client
        went away) aborts the request and frees its blocks. A choice the engine failed raises
        :class:`~xinfer.engine.failures.RequestError` (the request's other choices are aborted)."""
        # the request-wide index of each prompt's first choice, not summed again for every token
        first_choice = list(itertools.accumulate((len(output.outputs) for output in handle.outputs), initial=0))
        try:
            while not handle.finished:
                item = await handle.queue.get()
                if isinstance(item, BaseException):
                    raise item
                position, delta = item
                output, choice = handle.outputs[position], delta.outputs[0]
                output.add(delta)
                if choice.error is not None:
                    raise RequestError(f"the request failed: {choice.error}")
                yield first_choice[position] + choice.index, choice
        finally:
            self.release(handle)

    async def collect(self, handle: RequestHandle) -> list[CompletionOutput]:
        """Waits until every choice finished; returns them in request-wide index order."""
        async for _ in self.stream(handle):
            pass
        return handle.choices

    def release(self, handle: RequestHandle) -> None:
        """Ends ``handle``'s life: aborts what still runs and stops routing its outputs."""
        if not handle.finished:
            self.abort(handle)
        self._forget(handle)

    def abort(self, handle: RequestHandle) -> list[str]:
        """Stops ``handle``'s unfinished engine requests; returns their ids."""
        live = [output.request_id for output in handle.outputs if not output.finished]
        if live:
            self._send("abort", live)
        return live

    async def embed(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        """Final hidden states [T, hidden] of each prompt, computed between steps."""
        self._check_available()
        future = self._event_loop.create_future()
        self._send("embed", (token_ids, future))
        return await future

    async def call(self, work: Callable[[LLMEngine], T]) -> T:
        """``work(engine)``'s result, run on the engine thread between steps (its caches are
        not changing then)."""
        self._check_available()
        future = self._event_loop.create_future()
        self._send("call", (work, future))
        return await future

    @property
    def _event_loop(self) -> asyncio.AbstractEventLoop:
        assert self.loop is not None, "start() binds the event loop"
        return self.loop

    def _check_available(self) -> None:
        # draining, the server refuses new requests (xinfer.server.in_flight); those it is answering go on, with
        # their later rounds (MCP tool calls)
        if self.state not in (EngineState.READY, EngineState.DRAINING):
            detail = f": {self.error}" if self.error else ""
            raise EngineUnavailable(f"the engine is {self.state.value}{detail}")

    def _forget(self, handle: RequestHandle) -> None:
        removed = False
        for output in handle.outputs:
            removed |= self._handles.pop(output.request_id, None) is not None
        if removed and self.on_request_done is not None:
            self.on_request_done(handle)

    def _send(self, command: str, payload: Any) -> None:
        with self._wake:
            self._commands.append((command, payload))
            self._wake.notify()

    # ---- the engine thread ------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self.factory()
            processor = OutputProcessor(engine)
        except BaseException as error:  # reported through /health
            log.error("loading the model failed: %s: %s", type(error).__name__, first_line(error))
            log.debug("loading the model failed", exc_info=True)  # the traceback with --log debug
            self._die(f"loading failed: {str(error).strip() or type(error).__name__}")
            self._loaded.set()
            return
        self.engine = engine
        self.stats = engine.stats()  # the batch's room, before the first request is taken (none is yet)
        if self.state is EngineState.LOADING:
            self.state = EngineState.READY
        self._loaded.set()
        try:
            self._loop(engine, processor)
        except WorkerFailed as error:  # no traceback: the message says it all
            log.error("the engine loop died: %s", error)
            self._die(str(error))
        except BaseException as error:
            log.exception("the engine loop died")
            self._die(f"{type(error).__name__}: {error}")
        finally:
            engine.shutdown()

    def _loop(self, engine: LLMEngine, processor: OutputProcessor) -> None:
        # adds and embeds whose whole-prompt forward (prompt logprobs, hidden states) found no free blocks: they
        # wait, in order, for those the running sequences free; later adds and embeds wait behind them
        blocked: deque[tuple[str, Any]] = deque()
        while True:
            with self._wake:
                while not self._commands and not engine.has_unfinished() and not blocked:
                    self._wake.wait(IDLE_CHECK_SECONDS)
                    engine.check_ranks()  # a tensor-parallel rank that died while idle ends the engine too
                commands = list(self._commands)
                self._commands.clear()
            for command, payload in commands:
                if command == "stop":
                    return
                if command == "abort":
                    blocked = deque(c for c in blocked if not self._aborted(c, set(payload)))
                waits = command in ("add", "embed") and bool(blocked)
                if waits or not self._handle_command(engine, processor, command, payload):
                    blocked.append((command, payload))
            while blocked and self._handle_command(engine, processor, *blocked[0]):
                blocked.popleft()
            if engine.has_unfinished():
                self._step_started = time.monotonic()
                outputs = processor.step()
                self._step_started = None
                self._publish_stats(engine)
                if outputs:
                    self._event_loop.call_soon_threadsafe(self._deliver, outputs)

    def _handle_command(self, engine: LLMEngine, processor: OutputProcessor, command: str, payload: Any) -> bool:
        """Runs ``command``; False where it must wait for blocks the running sequences hold (see ``_loop``)."""
        if command == "add":
            handle, prompts = payload
            try:
                for output, (prompt, params, *multimodal) in zip(handle.outputs, prompts):
                    added = processor.add(output.request_id, prompt, params, None, *multimodal)
                    output.prompt_logprobs = added.prompt_logprobs  # read once the request is accepted
            except Exception as error:  # noqa: BLE001 - the request fails, the loop goes on
                for output in handle.outputs:
                    processor.abort(output.request_id)
                if isinstance(error, KVCacheFull) and engine.has_unfinished():
                    return False
                self._resolve(handle.accepted, error=error, added=len(handle.choices))
            else:
                self._resolve(handle.accepted, result=None, added=len(handle.choices))
        elif command == "abort":
            for request_id in payload:
                processor.abort(request_id)
        elif command == "embed":
            token_ids, future = payload
            try:
                self._resolve(future, result=[engine.hidden_states(ids).float().cpu() for ids in token_ids])
            except KVCacheFull as error:
                if engine.has_unfinished():
                    return False
                self._resolve(future, error=error)
            except (ValueError, RequestFailed) as error:
                self._resolve(future, error=error)
        elif command == "call":
            work, future = payload
            try:
                self._resolve(future, result=work(engine))
            except Exception as error:  # noqa: BLE001 - the caller's error; the loop goes on
                self._resolve(future, error=error)
        self._publish_stats(engine)
        return True

    def _aborted(self, command: tuple[str, Any], request_ids: set[str]) -> bool:
        """Whether an abort of ``request_ids`` ends a waiting ``command``: an add of those requests (its client
        left), which then never happens."""
        kind, payload = command
        if kind != "add" or not any(output.request_id in request_ids for output in payload[0].outputs):
            return False
        self._resolve(
            payload[0].accepted, error=EngineUnavailable("the request was aborted"), added=len(payload[0].choices)
        )
        return True

    def _publish_stats(self, engine: LLMEngine) -> None:
        """``stats`` set on the event loop, after the answers to the commands before it: a request the engine has
        queued is counted once, in its waiting sequences, never also as being added (``_num_adding``)."""
        stats = engine.stats()
        self._event_loop.call_soon_threadsafe(setattr, self, "stats", stats)

    def _resolve(
        self, future: asyncio.Future, result: Any = None, error: BaseException | None = None, added: int = 0
    ) -> None:
        """``future``'s outcome set on the event loop; ``added``: the sequences of a request the engine took
        (or refused), no longer being added once it is."""

        def set_outcome() -> None:
            self._num_adding -= added
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        self._event_loop.call_soon_threadsafe(set_outcome)

    def _die(self, message: str) -> None:
        self.state, self.error = EngineState.DEAD, message
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._fail_all, EngineUnavailable(f"the engine loop died: {message}"))

    # ---- back on the event loop ---------------------------------------------------

    def _deliver(self, deltas: list[RequestOutput]) -> None:
        now = time.monotonic()
        for delta in deltas:
            owner = self._handles.get(delta.request_id)
            if owner is None:
                continue
            handle, position = owner
            choice = (position, delta.outputs[0].index)
            handle.first_token_time = handle.first_token_time or now
            previous = handle.last_token_time.get(choice)
            if previous is not None:
                handle.inter_token_latencies.append(now - previous)
            handle.last_token_time[choice] = now
            handle.num_generated += len(delta.outputs[0].token_ids)
            handle.queue.put_nowait((position, delta))

    def _fail_all(self, error: BaseException) -> None:
        for handle, _ in list(self._handles.values()):
            handle.queue.put_nowait(error)
            if handle.accepted is not None and not handle.accepted.done():
                handle.accepted.set_exception(error)
