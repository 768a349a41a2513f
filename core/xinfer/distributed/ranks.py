"""The processes of a tensor-parallel engine and how they meet.

Every rank is a process; they meet through ``torch.distributed`` at ``master_addr:master_port``
(a TCP store on node 0), as ``torchrun`` does. Node 0's first rank is the engine's process: it
keeps the scheduler and the sampler and sends the other ranks each step's batch
(:meth:`Ranks.send`); every other rank runs :func:`xinfer.distributed.worker.follow`. On each node
the first rank's process starts the node's other ranks (``spawn``) and watches them: one that
exits fails the engine's next step (or the one under way) with :class:`WorkerFailed` rather than
leaving it waiting.

Two groups: the layers' collectives on the device's backend (NCCL on CUDA, gloo on the CPU),
with ``timeout``, and the host messages on gloo, with ``timeout`` on the first rank, which sends them,
and none on the others, which wait for them (an idle engine sends nothing).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import socket
import threading
import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from xinfer.config import DeviceConfig, EngineConfig, ParallelConfig
from xinfer.distributed.group import TensorParallel, WorkerFailed

log = logging.getLogger("xinfer")

IDLE_TIMEOUT = datetime.timedelta(days=365)
DEATH_GRACE_SECONDS = 5.0  # host messages: a worker waits as long as the engine idles
JOINED = "xinfer/joined"  # the store's count of the ranks that joined it


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_device(device: DeviceConfig, parallel: ParallelConfig, local_rank: int) -> DeviceConfig:
    """The device of this node's rank ``local_rank``: its accelerator of ``device_ids`` (default: the
    local rank's index), or the CPU (every rank) where the engine runs on the CPU or there is no accelerator."""
    accelerator = torch.accelerator.current_accelerator()
    if device.device == "cpu" or (accelerator is None and parallel.device_ids is None):
        return device.model_copy(update={"device": "cpu"})
    if accelerator is None:
        raise ValueError(f"device ids {parallel.device_ids} name accelerators, and this machine has none")
    ids = parallel.device_ids or list(range(parallel.ranks_per_node))
    if max(ids) >= (count := torch.accelerator.device_count()):
        raise ValueError(f"tensor_parallel_size {parallel.tensor_parallel_size}: this node's ranks need "
                         f"{accelerator.type} devices {', '.join(map(str, ids))}, and it has {count}")  # fmt: skip
    return device.model_copy(update={"device": str(torch.device(accelerator.type, ids[local_rank]))})


class Ranks:
    """This process's rank in a started group, and the node's other ranks' processes where it started them."""

    active: Ranks | None = None  # the group of this process, while it is open

    def __init__(self, parallel: ParallelConfig, rank: int, device: torch.device, processes: list[BaseProcess]):
        self.parallel, self.processes = parallel, processes
        self.failure: str | None = None
        # one thread reaps a process at a time: the other's waitpid would fail (ECHILD) and leave it no exit code
        self._reaping = threading.RLock()
        backend = dist.get_default_backend_for_device(device)
        if device.index is not None:  # the rank's accelerator is the current one (NCCL's communicators bind to it)
            torch.accelerator.set_device_index(device.index)
        dist.init_process_group(
            backend, store=_met(parallel, rank, processes), rank=rank, world_size=parallel.tensor_parallel_size,
            timeout=datetime.timedelta(seconds=parallel.timeout),
        )  # fmt: skip
        # the other ranks wait for the next message as long as the engine idles; the first rank's sends give up on
        # a rank that hangs after the group's timeout, as its collectives do (gloo's timeouts are each process's)
        control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=parallel.timeout) if rank == 0
                                 else IDLE_TIMEOUT)  # fmt: skip
        self.tp = TensorParallel(rank, parallel.tensor_parallel_size, dist.group.WORLD, control)
        self._watcher = threading.Thread(target=self._watch, name="xinfer-ranks", daemon=True)
        self._watcher.start()
        Ranks.active = self

    @classmethod
    def start(cls, parallel: ParallelConfig, device: DeviceConfig) -> Ranks:
        """This node's ranks: this process the first, the others started here."""
        from xinfer.distributed.worker import main  # which imports this module

        if parallel.master_port is None:
            parallel = parallel.model_copy(update={"master_port": free_port()})
        first = parallel.node_rank * parallel.ranks_per_node
        context = multiprocessing.get_context("spawn")
        processes: list[BaseProcess] = []
        for local in range(1, parallel.ranks_per_node):
            process = context.Process(target=main, args=(parallel, first + local, rank_device(device, parallel, local)),
                                      name=f"xinfer-rank-{first + local}", daemon=True)  # fmt: skip
            process.start()
            processes.append(process)
        own = rank_device(device, parallel, 0)
        return cls(parallel, first, device_of(own), processes)

    # ---- messages from the first rank -----------------------------------------------

    def send(self, message: Any) -> None:
        """Rank 0: ``message`` to every other rank."""
        self.check()
        with self.failing_as_workers():
            dist.broadcast_object_list([message], group=self.tp.control, group_src=0)

    def receive(self) -> Any:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, group=self.tp.control, group_src=0)
        return box[0]

    def share(self, tensor: Tensor) -> None:
        """Rank 0's ``tensor`` into every rank's (on the device: what the host has not read yet)."""
        dist.broadcast(tensor, group=self.tp.group, group_src=0)

    # ---- failure -------------------------------------------------------------------------

    def check(self) -> None:
        if self.failure is not None:
            raise WorkerFailed(self.failure)

    @contextlib.contextmanager
    def failing_as_workers(self) -> Iterator[None]:
        """A collective (or anything) that fails on this rank mid-step leaves the ranks out of step: it
        raises :class:`WorkerFailed`, naming the rank that died where one of this node's did (gloo fails
        on a closed connection before the dead process is reaped: it is waited for, briefly), and every
        later step fails alike."""
        try:
            yield
        except WorkerFailed:
            raise
        except RuntimeError as error:
            deadline = time.monotonic() + DEATH_GRACE_SECONDS
            while self.failure is None and time.monotonic() < deadline:
                self._watch_once()
                time.sleep(0.05)
            self.failure = self.failure or f"the tensor-parallel step failed: {str(error).splitlines()[0]}"
            raise WorkerFailed(self.failure) from error

    def _watch(self) -> None:
        sentinels = {process.sentinel: process for process in self.processes}
        while sentinels and self.failure is None:
            for sentinel in multiprocessing.connection.wait(list(sentinels)):
                process = sentinels.pop(sentinel)  # type: ignore[arg-type]  # what wait() is given
                if not self._closing:
                    self._died(process)

    def _watch_once(self) -> None:
        with self._reaping:
            for process in self.processes:
                if not process.is_alive() and not self._closing:
                    self._died(process)

    def _died(self, process: BaseProcess) -> None:
        # reaped, so that its exit code is known: its sentinel is ready once it closed its files, and a large
        # process can take seconds more to be torn down on a busy machine
        with self._reaping:
            process.join(10.0)
            code = "" if process.exitcode is None else f" with code {process.exitcode}"
            if self.failure is None:
                self.failure = (f"tensor-parallel worker {process.name} (pid {process.pid}) exited{code}: "
                                "the engine cannot step")  # fmt: skip
                log.error("%s", self.failure)

    _closing = False

    def close(self) -> None:
        """Rank 0: the other ranks exit; the group is closed."""
        self._closing = True
        if self.tp.first and self.failure is None:
            with contextlib.suppress(RuntimeError, WorkerFailed):
                self.send(("exit",))
        for process in self.processes:
            process.join(10.0)
            if process.is_alive():
                process.kill()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        if Ranks.active is self:
            Ranks.active = None


def _met(parallel: ParallelConfig, rank: int, processes: list[BaseProcess]) -> dist.Store:
    """The group's store (a TCP store the first rank holds, as ``torchrun``'s), once every rank has joined it.
    Until then this node's ``processes`` are watched: one that exits first fails start-up at once, naming it,
    where the rendezvous would wait for it the whole timeout."""
    assert parallel.master_port is not None, "Ranks.start picks a free port"
    size, timeout = parallel.tensor_parallel_size, datetime.timedelta(seconds=parallel.timeout)
    store = dist.TCPStore(parallel.master_addr, parallel.master_port, size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)  # fmt: skip
    joined, deadline = store.add(JOINED, 1), time.monotonic() + parallel.timeout
    while joined < size:
        if dead := next((process for process in processes if not process.is_alive()), None):
            dead.join(10.0)
            raise WorkerFailed(f"tensor-parallel worker {dead.name} (pid {dead.pid}) exited with code "
                               f"{dead.exitcode} before the ranks met")  # fmt: skip
        if time.monotonic() > deadline:
            raise WorkerFailed(f"{joined} of {size} tensor-parallel ranks met at {parallel.master_addr}:"
                               f"{parallel.master_port} in {parallel.timeout:g} s (--tp-timeout)")  # fmt: skip
        time.sleep(0.05)
        joined = store.add(JOINED, 0)
    return store


def device_of(device: DeviceConfig) -> torch.device:
    from xinfer.backend import select_backend

    return select_backend(device)[2]


@contextlib.contextmanager
def started(**parallel: Any) -> Iterator[Ranks]:
    """Ranks that engines of this process (``LLM(tensor_parallel_size=...)``) use one after another
    instead of starting their own (tests start one group for many models)."""
    config = EngineConfig.from_kwargs(**parallel)
    ranks = Ranks.start(config.parallel, config.device)
    try:
        yield ranks
    finally:
        ranks.close()
