"""Start-up, the one path from an engine config to the finished parts an engine steps:
select the backend, load the model, calibrate, plan memory, allocate, capture."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from transformers import PretrainedConfig

from xinfer import registry
from xinfer.backend import DeviceMemory, check_support, device_memory, select_backend, splits_memory
from xinfer.cache.allocate import CacheLayout, allocate_caches
from xinfer.cache.block_pool import BlockPool
from xinfer.cache.manager import CacheManager
from xinfer.cache.recent_window import RecentWindow
from xinfer.cache.specs import AttentionSpec, TokenVectorSpec
from xinfer.cache.state_pool import SlotCopy, StatePool
from xinfer.config import CacheConfig, EngineConfig, dtype_name, resolve_dtype
from xinfer.distributed.group import SINGLE, TensorParallel, building_for
from xinfer.engine.kv_calibration import calibrate_keys, calibration_ids
from xinfer.engine.memory_plan import (
    MemoryPlan,
    available_bytes,
    check_fits,
    gib,
    held_by_every_rank,
    memory_baseline,
    plan_memory,
    weight_remedies,
)
from xinfer.engine.runner import ModelRunner
from xinfer.engine.scheduler import Scheduler
from xinfer.forward_context import forward_context
from xinfer.hooks import BackendSpec
from xinfer.kv import KVFormat, get_format
from xinfer.layers.activation import check_op_activations_run_on
from xinfer.layers.moe import check_experts_run_on
from xinfer.layers.rotary import context_limit
from xinfer.loading.errors import first_line
from xinfer.loading.loader import architecture_of, check_model, checkpoint_bytes, held_model, load_model
from xinfer.loading.resolve import resolve_model_path
from xinfer.ops import HostBatch, Ops
from xinfer.quant.dispatch import prepare_weights
from xinfer.text.tokenizer import Tokenizer, as_ids, declared_eos_ids, has_tokenizer

if TYPE_CHECKING:
    from xinfer.model import CausalLM

log = logging.getLogger("xinfer")


@dataclass(frozen=True)
class EngineParts:
    """What start-up hands the engine, finished."""

    config: EngineConfig  # with the planned max_num_seqs
    model_path: Path  # the model's files: an HF folder or a .gguf file
    hf_config: Any
    tokenizer: Any
    eos_token_ids: frozenset[int]
    tokenizer_eos_ids: frozenset[int]  # of eos_token_ids, those a finish names no stop_reason for (vLLM's)
    max_model_len: int
    dtype: torch.dtype
    kv_format: KVFormat
    runner: ModelRunner  # its caches allocated, its graphs captured
    cache: CacheManager
    scheduler: Scheduler


def build_engine(config: EngineConfig, tokenizer: Any = None, tp: TensorParallel = SINGLE) -> EngineParts:
    """Every part of an engine for ``config`` (``tokenizer``: the model's own if None); under tensor
    parallelism, rank ``tp.rank``'s (every rank runs this, its collectives in the same order)."""
    if tp.size > 1 and not config.device.enforce_eager:
        log.info("tensor parallel %d: steps run eagerly (no CUDA graphs across ranks yet)", tp.size)
        config = config.model_copy(update={"device": config.device.model_copy(update={"enforce_eager": True})})
    spec, ops, device, path, hf_config = check_start(config)
    cache = config.cache
    memory = device_memory(spec, device)
    baseline = memory_baseline(memory)
    dtype = model_dtype(config, hf_config, device.type)
    saved = getattr(hf_config, "dtype", None)
    if config.model.dtype == "auto" and saved is not None and dtype_name(saved) != dtype_name(dtype):
        log.info("dtype auto: the checkpoint's %s runs as %s on the %s (--dtype sets another)", dtype_name(saved),
                 dtype_name(dtype), device.type)  # fmt: skip
    torch.manual_seed(config.model.seed)
    with building_for(tp), _weights_must_fit(path, config, device, memory, splits_memory(spec)):
        release_cached = memory.release_cached if memory is not None else None
        model = load_model(path, hf_config, device, dtype, config.model.load_format, config.model.isq, release_cached)
    prepare_weights(model, ops)
    if not model.cuda_graphs and not config.device.enforce_eager:
        log.info("%s runs without step graphs: its ops read the step's metadata on the host", type(model).__name__)
        config = config.model_copy(update={"device": config.device.model_copy(update={"enforce_eager": True})})
    max_model_len = _max_model_len(config, hf_config)
    config = _step_past_context_switch(config, model, max_model_len)
    tokenizer = _load_tokenizer(path) if tokenizer is None else _given_tokenizer(tokenizer)
    kv_format = get_format(cache.kv_cache_dtype)
    layout = CacheLayout.of(model)
    _refuse_a_format_no_layer_stores(kv_format, layout)
    kv_format.refuse_head_dims(
        {kind.head_dim for layer in layout.layers if isinstance(kind := layer.cache_spec(), AttentionSpec)}
    )
    runner = ModelRunner(model, ops, cache.block_size, device, config.model.seed,
                         len(layout.groups), bool(layout.state_layers), config.model.encoder_cache_size)  # fmt: skip
    key_transforms = None
    if kv_format.rotate_keys and layout.attention_layers:

        def forward(batch: HostBatch) -> Tensor:
            input_ids, positions, step = runner.to_device(batch)
            with forward_context(step):
                return model(input_ids, positions)

        ids = calibration_ids(tokenizer, hf_config.vocab_size, hf_config.max_position_embeddings)
        key_transforms = calibrate_keys(forward, ops, layout, ids, cache.block_size, dtype, device)
    plan = plan_memory(config, runner, layout, max_model_len, dtype, kv_format, memory, baseline, key_transforms)
    plan = held_by_every_rank(plan, tp)
    allocate_caches(
        layout, plan.num_blocks, cache.block_size, dtype, device, kv_format,
        plan.num_state_slots + plan.num_snapshot_slots,
        key_transforms, [pool.num_shadows for pool in plan.pools], cache.kv_recent_window,
    )  # fmt: skip
    scheduler_config = config.scheduler.model_copy(update={"max_num_seqs": plan.max_num_seqs})
    config = config.model_copy(update={"scheduler": scheduler_config})
    runner.state_caches = layout.state_caches()
    cache_manager = _cache_manager(plan, cache, runner.copy_state_slot)
    log.info("%s, KV cache format %s", plan.describe(), kv_format.name)
    if not config.device.enforce_eager:
        runner.capture_graphs(plan.max_num_seqs, scheduler_config.max_num_batched_tokens, max_model_len,
                              shadows=any(pool.num_shadows for pool in plan.pools))  # fmt: skip
    scheduler = Scheduler(scheduler_config, cache_manager, runner.model.context_switch,
                          runner.model.recompute_past_switch)  # fmt: skip
    eos_token_ids = _eos_ids(path, hf_config, tokenizer)
    return EngineParts(config, path, hf_config, tokenizer, eos_token_ids, _tokenizer_eos_ids(hf_config, tokenizer),
                       max_model_len, dtype, kv_format, runner, cache_manager, scheduler)  # fmt: skip


def check_start(config: EngineConfig) -> tuple[BackendSpec, Ops, torch.device, Path, PretrainedConfig]:
    """What start-up refuses before it builds anything, each in one line: no backend for the device, an option
    the backend does not run, a model that is not there, cannot load with these settings or does not fit in the
    device's memory. Returns the backend, its ops and device, the model's path and its config."""
    spec, ops, device = select_backend(config.device)
    check_support(spec, ops, config)
    path = resolve_model_path(config.model.model)
    hf_config = check_model(path, config.model)
    dtype = model_dtype(config, hf_config, device.type)
    with building_for(TensorParallel(0, config.parallel.tensor_parallel_size)):  # one rank's part
        model = held_model(path, hf_config, dtype, config.model.load_format, config.model.isq)
    check_experts_run_on(model, ops)
    check_op_activations_run_on(model, ops)
    prepare_weights(model, ops)  # as the backend repacks them
    max_model_len = _max_model_len(config, hf_config)
    available = available_bytes(device_memory(spec, device))
    check_fits(model, config, max_model_len, dtype, available, f"{device}'s memory", splits_memory(spec))
    return spec, ops, device, path, hf_config


def model_dtype(config: EngineConfig, hf_config: PretrainedConfig, device_type: str) -> torch.dtype:
    """The dtype the model runs in (:func:`resolve_dtype`), never one its architecture does not run in
    (``CausalLM.unstable_dtypes``): asked for, it is refused in one line; ``auto`` takes bf16 instead (as vLLM)."""
    dtype = resolve_dtype(config.model.dtype, getattr(hf_config, "dtype", None), device_type)
    model_class = registry.model_class(architecture_of(hf_config))
    if (why := getattr(model_class, "unstable_dtypes", {}).get(dtype)) is None:
        return dtype
    if config.model.dtype != "auto":
        raise ValueError(f"{model_class.__name__} does not run in {dtype_name(dtype)}: {why} (--dtype bf16 or f32)")
    return torch.bfloat16


@contextlib.contextmanager
def _weights_must_fit(
    path: Path, config: EngineConfig, device: torch.device, memory: DeviceMemory | None, splits: bool
) -> Iterator[None]:
    """Out of device memory while the weights load: one line with the numbers, not the allocator's message."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        files = "" if config.model.load_format == "dummy" else f" ({gib(checkpoint_bytes(path))} of weight files)"
        free, total = memory.info() if memory is not None else (None, None)
        held = f"; the device has {gib(free)} free of {gib(total)}" if free is not None and total else ""
        remedies = [*weight_remedies(config, splits), "free the device"]
        raise ValueError(
            f"the model's weights do not fit in {device}'s memory: it ran out loading {path}{files}{held} "
            f"({first_line(error)}): {', '.join(remedies[:-1])}, or {remedies[-1]}"
        ) from None


def _max_model_len(config: EngineConfig, hf_config: Any) -> int:
    """The longest sequence: the one asked for, else the model's (check_model checked the one asked for)."""
    return config.model.max_model_len or context_limit(hf_config)


def _step_past_context_switch(config: EngineConfig, model: CausalLM, max_model_len: int) -> EngineConfig:
    """``config`` with steps of more tokens than the model's context switch where a sequence may be longer
    than it: such a sequence's first prefill step must reach past it for all its KV to be the long kind
    (the scheduler waits for a budget that does, which a smaller step never gives)."""
    switch, budget = model.context_switch, config.scheduler.max_num_batched_tokens
    if switch is None or max_model_len <= switch or budget > switch:
        return config
    log.info("max_num_batched_tokens raised from %d to %d: a sequence longer than %s's context switch (%d tokens) "
             "computes its first step past it", budget, switch + 1, type(model).__name__, switch)  # fmt: skip
    scheduler = config.scheduler.model_copy(update={"max_num_batched_tokens": switch + 1})
    return config.model_copy(update={"scheduler": scheduler})


def _refuse_a_format_no_layer_stores(kv_format: KVFormat, layout: CacheLayout) -> None:
    """Attention stores every format; a per-token vector only those it declares an encoding for."""
    encodings = {name for layer in layout.layers if isinstance(spec := layer.cache_spec(), TokenVectorSpec)
                 for name in spec.encoded}  # fmt: skip
    if kv_format.name == "auto" or layout.attention_layers or kv_format.name in encodings:
        return
    raise ValueError(
        f"kv_cache_dtype (--kvcache-dtype) {kv_format.name!r} encodes attention K and V, which this model does not "
        f"cache (its layers cache one vector per token, as multi-head latent attention's latent): use "
        f"{' or '.join([*sorted(encodings), 'auto'])}"
    )


def _cache_manager(plan: MemoryPlan, cache: CacheConfig, copy_slot: SlotCopy) -> CacheManager:
    """The planned pools, each given its recent window's shadows where it has them, and state slots
    whose states ``copy_slot`` copies."""
    pools = []
    for pool in plan.pools:
        shadows = RecentWindow(pool.num_shadows, cache.kv_recent_window, cache.block_size) if pool.num_shadows else None
        pools.append(BlockPool(pool.num_blocks, cache.block_size, pool.window, shadows))
    slots = StatePool(plan.num_state_slots, plan.num_snapshot_slots, copy_slot) if plan.num_state_slots else None
    return CacheManager(pools, cache.enable_prefix_caching, slots, cache.state_snapshot_interval, cache.block_size)


def _given_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer given to ``LLM``: an object that encodes, or (as vLLM takes it) the path of an HF folder or
    ``.gguf`` file holding one."""
    if not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    path = Path(tokenizer).expanduser()
    if not (path.exists() and has_tokenizer(path)):
        raise ValueError(f"tokenizer {str(tokenizer)!r}: not an HF folder holding tokenizer.json, nor a .gguf file")
    return Tokenizer.from_path(path)


def _eos_ids(path: Path, hf_config: Any, tokenizer: Any) -> frozenset[int]:
    """Every EOS the model declares: its tokenizer's, its config's, and (tokenizer or not) its folder's
    ``generation_config.json``'s, where transformers' ``generate`` takes them from."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or ())
    ids.update(as_ids(getattr(hf_config, "eos_token_id", None)))
    if path.is_dir():
        ids.update(declared_eos_ids(path))
    return frozenset(ids)


def _tokenizer_eos_ids(hf_config: Any, tokenizer: Any) -> frozenset[int]:
    """The EOS vLLM stops on with no ``stop_reason``: the tokenizer's ``eos_token_id`` (a tokenizer object
    without one: the ids it declares; no tokenizer: the config's). vLLM makes the other EOS ids a model
    declares stop token ids, each the ``stop_reason`` of the choices it ends."""
    if getattr(tokenizer, "eos_token_id", None) is not None:
        return frozenset([tokenizer.eos_token_id])
    if tokenizer is not None:
        return frozenset(getattr(tokenizer, "eos_token_ids", None) or ())
    return frozenset(as_ids(getattr(hf_config, "eos_token_id", None)))


# tokenizer files of the slow tokenizers, which xinfer does not read (their fast tokenizer.json it does)
SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")


def _load_tokenizer(path: Path) -> Tokenizer | None:
    if has_tokenizer(path):
        return Tokenizer.from_path(path)
    if slow := [name for name in SLOW_TOKENIZER_FILES if (path / name).is_file()]:
        log.warning("%s has no tokenizer.json (xinfer does not read %s): prompts must be token ids; transformers' "
                    "tokenizer.save_pretrained writes one", path, ", ".join(slow))  # fmt: skip
    return None
