"""Tensor parallelism over ``torch.distributed``: the group and parts layers are built for
(:mod:`~xinfer.distributed.group`), the ranks' processes and their start-up
(:mod:`~xinfer.distributed.ranks`), and the other ranks' loop (:mod:`~xinfer.distributed.worker`)."""

from xinfer.distributed.group import SINGLE, Part, TensorParallel, WorkerFailed, building_for, current

__all__ = ["SINGLE", "Part", "TensorParallel", "WorkerFailed", "building_for", "current"]
