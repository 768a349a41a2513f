"""A rank other than the engine's: it builds its part of each engine the first rank builds, then runs
the forward of every step the first rank sends it (the sampler is the first rank's alone).

Messages (:meth:`~xinfer.distributed.ranks.Ranks.send`): ``("build", config, tokenizer)``,
``("step", batch, has_pending)`` (then, with pending inputs, the batch's input ids on the device),
``("hidden", batch)``, ``("release",)`` (the engine is gone), ``("exit",)``.
"""

from __future__ import annotations

import gc
import logging
import os
import sys

import torch

from xinfer import ops
from xinfer.cache.state_pool import copy_slots
from xinfer.config import DeviceConfig, EngineConfig, ParallelConfig
from xinfer.distributed.ranks import Ranks, device_of, rank_device
from xinfer.engine.runner import ModelRunner
from xinfer.loading.errors import first_line
from xinfer.ops import HostBatch

log = logging.getLogger("xinfer")


def main(parallel: ParallelConfig, rank: int, device: DeviceConfig) -> None:
    """A rank's process, started by its node's first rank."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s rank {rank}: %(message)s")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // parallel.ranks_per_node))
    ranks = Ranks(parallel, rank, device_of(device), [])
    try:
        follow(ranks, device)
    finally:
        ranks.close()


def follow(ranks: Ranks, device: DeviceConfig) -> None:
    """Runs what the first rank sends until it says exit (or goes away: the collective raises)."""
    from xinfer.engine.build import build_engine

    runner: ModelRunner | None = None
    while True:
        kind, *payload = ranks.receive()
        if kind == "exit":
            return
        if kind == "release":
            runner = None
            gc.collect()
        elif kind == "build":
            config, tokenizer = payload
            config = config.model_copy(update={"device": config.device.model_copy(update={"device": device.device})})
            try:
                runner = build_engine(config, tokenizer, ranks.tp).runner
                runner.ranks = ranks
            except Exception as error:  # noqa: BLE001 - the first rank fails alike, and says so
                log.warning("building the engine failed: %s", first_line(error))
        else:  # a forward, after the state copies the first rank made since the last one
            assert runner is not None, "a forward before the engine was built"
            *payload, state_copies = payload
            copy_slots(runner.state_caches, state_copies)
            if kind == "step":
                _step(runner, *payload)
            elif kind == "hidden":
                runner.hidden_states(*payload)
            else:
                assert kind == "logprobs", kind
                runner.prompt_logprobs(*payload)


@torch.inference_mode()
def _step(runner: ModelRunner, batch: HostBatch, has_pending: bool) -> None:
    with ops.use(runner.backend):
        runner.eager_forward(batch, None, share_inputs=has_pending)


def run_node(config: EngineConfig) -> int:
    """A node other than the first (``--node-rank`` > 0): its ranks follow the first node's engine
    until it exits. 0 when it did, 1 when the group failed."""
    ranks = Ranks.start(config.parallel, config.device)
    log.info("node %d: ranks %d.. joined; following the engine on %s", config.parallel.node_rank, ranks.tp.rank,
             config.parallel.master_addr)  # fmt: skip
    try:
        follow(ranks, rank_device(config.device, config.parallel, 0))
    except RuntimeError as error:
        print(f"xinfer: the tensor-parallel group failed: {first_line(error)}", file=sys.stderr)
        return 1
    finally:
        ranks.close()
    return 0
