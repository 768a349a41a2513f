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
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import torch

from xinfer.engine.engine import EngineStats, KVCacheFull, LLMEngine, StepOutput
from xinfer.sampling import SamplingParams

log = logging.getLogger("xinfer")


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


@dataclass
class RequestHandle:
    """One client request: ``n`` engine sequences whose outputs share one queue."""

    request_id: str
    num_prompt_tokens: int
    child_ids: list[str]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: dict[int, float] = field(default_factory=dict)
    inter_token_latencies: list[float] = field(default_factory=list)
    num_generated: int = 0
    cached_tokens: dict[int, int] = field(default_factory=dict)  # per choice
    finish_reasons: dict[int, str] = field(default_factory=dict)
    accepted: asyncio.Future | None = None

    @property
    def finished(self) -> bool:
        return len(self.finish_reasons) == len(self.child_ids)


EngineFactory = Callable[[], LLMEngine]


class AsyncEngine:
    def __init__(
        self,
        factory: EngineFactory,
        max_waiting: int = 256,
        stall_timeout: float = 300.0,
        on_request_done: Callable[[RequestHandle], None] | None = None,
    ):
        self.factory = factory
        self.max_waiting = max_waiting
        self.stall_timeout = stall_timeout
        self.on_request_done = on_request_done
        self.engine: LLMEngine | None = None
        self.state = EngineState.LOADING
        self.error: str | None = None
        self.stats = EngineStats(0, 0, 0.0, 0, 0, 0)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._num_adding = 0  # sequences sent to the engine thread, not yet in its queue
        self._handles: dict[str, tuple[RequestHandle, int]] = {}  # child id -> (handle, choice index)
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

    def health(self) -> tuple[bool, str]:
        """(healthy, status word); a step running longer than ``stall_timeout`` counts as stuck."""
        if self.state is EngineState.READY and self._step_started is not None:
            if time.monotonic() - self._step_started > self.stall_timeout:
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
        """Ends every request now: each stream gets its ``abort`` at once, and the engine
        thread frees the sequences after its current step (which may take long)."""
        for handle in {id(h): h for h, _ in self._handles.values()}.values():
            self._deliver_aborts(self.abort(handle))

    def stop(self, timeout: float = 10.0) -> None:
        if self.state is not EngineState.DEAD:
            self.state = EngineState.STOPPED
        self._send("stop", None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- requests (event-loop side) ---------------------------------------------

    async def submit(self, children: list[tuple[list[int], SamplingParams]], num_prompt_tokens: int) -> RequestHandle:
        """Queues one request: a sequence per (prompt token ids, params) entry, its choices.
        ``num_prompt_tokens`` counts each distinct prompt once (for usage and metrics).

        Returns once the engine accepted them all; raises ``ValueError`` (a bad prompt
        or params, from the engine), :class:`QueueFull` or :class:`EngineUnavailable`.
        """
        self._check_available()
        waiting = self.stats.num_waiting + self._num_adding
        if waiting >= self.max_waiting:
            raise QueueFull(f"{waiting} sequences are waiting (limit {self.max_waiting}); retry later")
        request_id = f"req-{next(self._ids)}"
        child_ids = [f"{request_id}-{i}" for i in range(len(children))]
        handle = RequestHandle(request_id, num_prompt_tokens, child_ids)
        handle.accepted = self.loop.create_future()
        for index, child_id in enumerate(child_ids):
            self._handles[child_id] = (handle, index)
        self._send("add", (handle, children))
        self._num_adding += len(children)
        try:
            await handle.accepted
        except BaseException:
            self.abort(handle)
            for child_id in child_ids:
                self._handles.pop(child_id, None)
            raise
        finally:
            self._num_adding -= len(children)
        return handle

    async def stream(self, handle: RequestHandle) -> AsyncIterator[tuple[int, StepOutput]]:
        """Yields (choice index, delta) until every choice finished. Leaving early
        (the client went away) aborts the request and frees its blocks."""
        try:
            while not handle.finished:
                item = await handle.queue.get()
                if isinstance(item, BaseException):
                    raise item
                index, output = item
                if index in handle.finish_reasons:  # an abort that crossed the choice's last output
                    continue
                if output.finished:
                    handle.finish_reasons[index] = output.finish_reason or "abort"
                yield index, output
        finally:
            self.release(handle)

    def release(self, handle: RequestHandle) -> None:
        """Ends ``handle``'s life: aborts what still runs and stops routing its outputs."""
        if not handle.finished:
            self.abort(handle)
        self._forget(handle)

    def abort(self, handle: RequestHandle) -> list[str]:
        """Stops ``handle``'s unfinished choices in the engine; returns their ids."""
        live = [child_id for i, child_id in enumerate(handle.child_ids) if i not in handle.finish_reasons]
        if live:
            self._send("abort", live)
        return live

    async def embed(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        """Final hidden states [T, hidden] of each prompt, computed between steps."""
        self._check_available()
        future = self.loop.create_future()
        self._send("embed", (token_ids, future))
        return await future

    def _check_available(self) -> None:
        if self.state is not EngineState.READY:
            detail = f": {self.error}" if self.error else ""
            raise EngineUnavailable(f"the engine is {self.state.value}{detail}")

    def _forget(self, handle: RequestHandle) -> None:
        removed = False
        for child_id in handle.child_ids:
            removed |= self._handles.pop(child_id, None) is not None
        if removed and self.on_request_done is not None:
            self.on_request_done(handle)

    def _send(self, command: str, payload: Any) -> None:
        with self._wake:
            self._commands.append((command, payload))
            self._wake.notify()

    # ---- the engine thread ------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self.factory()
        except BaseException as error:  # noqa: BLE001 - reported through /health
            log.exception("loading the model failed")
            self._die(f"loading failed: {error}")
            self._loaded.set()
            return
        if self.state is EngineState.LOADING:
            self.state = EngineState.READY
        self._loaded.set()
        try:
            self._loop()
        except BaseException as error:  # noqa: BLE001
            log.exception("the engine loop died")
            self._die(f"{type(error).__name__}: {error}")

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._wake:
                while not self._commands and not engine.has_unfinished():
                    self._wake.wait()
                commands = list(self._commands)
                self._commands.clear()
            for command, payload in commands:
                if command == "stop":
                    return
                self._handle_command(command, payload)
            if engine.has_unfinished():
                self._step_started = time.monotonic()
                outputs = engine.step()
                self._step_started = None
                self._snapshot()
                if outputs:
                    self.loop.call_soon_threadsafe(self._deliver, outputs)

    def _handle_command(self, command: str, payload: Any) -> None:
        engine = self.engine
        if command == "add":
            handle, children = payload
            try:
                for child_id, (prompt, params) in zip(handle.child_ids, children):
                    engine.add_request(child_id, prompt, params)
            except Exception as error:  # noqa: BLE001 - the request fails, the loop goes on
                for child_id in handle.child_ids:
                    engine.abort(child_id)
                self._resolve(handle.accepted, error=error)
            else:
                self._resolve(handle.accepted, result=None)
        elif command == "abort":
            for child_id in payload:
                engine.abort(child_id)
        elif command == "embed":
            token_ids, future = payload
            try:
                self._resolve(future, result=[engine.hidden_states(ids).float().cpu() for ids in token_ids])
            except (ValueError, KVCacheFull) as error:
                self._resolve(future, error=error)
        self._snapshot()

    def _resolve(self, future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
        def set_outcome() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        self.loop.call_soon_threadsafe(set_outcome)

    def _snapshot(self) -> None:
        self.stats = self.engine.stats()

    def _die(self, message: str) -> None:
        self.state, self.error = EngineState.DEAD, message
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._fail_all, EngineUnavailable(f"the engine loop died: {message}"))

    # ---- back on the event loop ---------------------------------------------------

    def _deliver(self, outputs: list[StepOutput]) -> None:
        now = time.monotonic()
        for output in outputs:
            owner = self._handles.get(output.request_id)
            if owner is None:
                continue
            handle, index = owner
            handle.first_token_time = handle.first_token_time or now
            previous = handle.last_token_time.get(index)
            if previous is not None:
                handle.inter_token_latencies.append(now - previous)
            handle.last_token_time[index] = now
            handle.num_generated += len(output.token_ids)
            handle.cached_tokens[index] = output.num_cached_tokens
            handle.queue.put_nowait((index, output))

    def _deliver_aborts(self, child_ids: list[str]) -> None:
        for child_id in child_ids:
            owner = self._handles.get(child_id)
            if owner is not None:
                handle, index = owner
                aborted = StepOutput(child_id, [], "", finished=True, finish_reason="abort")
                handle.queue.put_nowait((index, aborted))

    def _fail_all(self, error: BaseException) -> None:
        for handle, _ in list(self._handles.values()):
            handle.queue.put_nowait(error)
            if handle.accepted is not None and not handle.accepted.done():
                handle.accepted.set_exception(error)
