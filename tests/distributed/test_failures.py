"""A tensor-parallel worker that dies: the requests under way fail with an error naming it, later
ones too, at once; nothing waits for the dead rank. The server answers the streams under way with
the error and exits non-zero."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import openai
import pytest
from transformers import LlamaConfig

from tests.server.live import LiveServer
from tests.tiny_models import COMMON, prompt, save_tiny_model
from xinfer import LLM, SamplingParams
from xinfer.distributed import WorkerFailed

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
DIED = r"tensor-parallel worker xinfer-rank-1 \(pid \d+\) exited with code -9"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), folder)
    return folder


def test_a_killed_worker_fails_the_request_under_way_and_the_next(llama):
    with LLM(model=str(llama), dtype="float32", num_blocks=64, tensor_parallel_size=2) as llm:
        stream = llm.stream([prompt(5)], LONG)
        next(stream)  # the request is under way
        assert llm.engine.ranks is not None
        os.kill(llm.engine.ranks.processes[0].pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerFailed, match=DIED):
            for _ in stream:
                pass
        assert time.monotonic() - started < 30
        with pytest.raises(WorkerFailed, match=DIED):
            llm.generate([prompt(3)], LONG)


def test_a_hung_worker_is_given_up_after_the_timeout(llama):
    """A rank that stops answering (stopped, deadlocked) fails the step after ``timeout`` as the layers'
    collectives do: the first rank waited on the step's message to it for ever (the host messages' group had
    no timeout, so that idle ranks may wait)."""
    with LLM(model=str(llama), dtype="float32", num_blocks=64, tensor_parallel_size=2, timeout=15) as llm:
        stream = llm.stream([prompt(5)], LONG)
        next(stream)
        assert llm.engine.ranks is not None
        worker = llm.engine.ranks.processes[0].pid
        os.kill(worker, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(WorkerFailed, match="Timed out"):
                for _ in stream:
                    pass
            assert time.monotonic() - started < 30
        finally:
            os.kill(worker, signal.SIGKILL)


def test_the_server_fails_its_streams_and_exits_non_zero(llama):
    server = LiveServer("--m", str(llama), "--cpu", "--d", "0,1", "--dtype", "f32", name="tp-worker-death").start()
    try:
        assert server.proc is not None
        worker = _worker(server.proc.pid)
        killer = threading.Timer(2.0, os.kill, (worker, signal.SIGKILL))  # while the answer is under way
        with server.client().completions.create(model=str(llama), prompt=prompt(5), max_tokens=500,
                                                 stream=True, temperature=0) as stream:  # fmt: skip
            killer.start()
            with pytest.raises(openai.APIError, match="exited with code -9"):
                for _ in stream:
                    pass
        assert server.proc.wait(60) == 1
        assert "the engine died: tensor-parallel worker" in server.log_tail()
    finally:
        server.stop()


def _worker(pid: int) -> int:
    """The rank process ``pid`` started (Linux; multiprocessing also starts a resource tracker)."""
    tasks = Path(f"/proc/{pid}/task")
    children = [int(child) for task in tasks.iterdir() for child in (task / "children").read_text().split()]
    return next(child for child in children if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes())


def _exit_at_once() -> None:
    os._exit(3)


def test_a_worker_that_exits_before_the_ranks_meet_fails_start_up_at_once():
    """The rendezvous waited the whole timeout (300 s by default) for a rank whose process was already gone."""
    import multiprocessing

    from xinfer.config import EngineConfig
    from xinfer.distributed.ranks import _met, free_port

    parallel = EngineConfig.from_kwargs(tensor_parallel_size=2, master_port=free_port(), timeout=120).parallel
    worker = multiprocessing.get_context("spawn").Process(target=_exit_at_once, name="xinfer-rank-1")
    worker.start()
    started = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"worker xinfer-rank-1 \(pid \d+\) exited with code 3 before the ranks met"):
        _met(parallel, 0, [worker])
    assert time.monotonic() - started < 30


def test_ranks_that_do_not_meet_in_the_timeout_are_named():
    from xinfer.config import EngineConfig
    from xinfer.distributed.ranks import _met, free_port

    parallel = EngineConfig.from_kwargs(tensor_parallel_size=3, master_port=free_port(), timeout=1).parallel
    with pytest.raises(WorkerFailed, match=r"^1 of 3 tensor-parallel ranks met at 127\.0\.0\.1:\d+ in 1 s"):
        _met(parallel, 0, [])
