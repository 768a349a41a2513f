"""How an engine shares out memory: weights, activations, step CUDA graphs, and the
KV cache, which gets what is left; and how many sequences may run at once.

With a backend that keeps memory statistics (:class:`xinfer.backend.DeviceMemory`),
``kv_fraction`` is, like vLLM's ``gpu_memory_utilization``, the share of the device's
total memory this engine may use. After the weights are loaded, one forward of
``max_num_batched_tokens`` tokens, followed by the logits and sampling of as many
sequences as a step can sample, measures the activation peak; one capture of the
step graphs against a one-block cache measures theirs (about one more such peak, in
the graphs' own pool; graphs record the cache's addresses, so the engine captures
them again once the real cache exists). Without statistics (the CPU), the KV cache
gets a share of the available host memory.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from dataclasses import dataclass

import torch

from xinfer import ops
from xinfer.backend import DeviceMemory
from xinfer.cache.allocate import CacheLayout, allocate_caches
from xinfer.config import EngineConfig
from xinfer.distributed.group import TensorParallel
from xinfer.engine.kv_calibration import KeyTransforms
from xinfer.engine.runner import ModelRunner
from xinfer.engine.sampler import Sampler
from xinfer.engine.sequence import Sequence
from xinfer.kv import KVFormat, get_format
from xinfer.ops import HostBatch, PageBatch
from xinfer.quant import QuantizedTensor
from xinfer.sampling import SamplingParams

GiB = 1 << 30
DEFAULT_KV_FRACTION = 0.9
# 1024 was tried (eighth session): a simulation of the ShareGPT-like 8B run gave no gain over 256 (the longest
# answer's decode steps bound it), and the host's per-step work at ~800 rows nears the device's; not measured on the H200
MAX_NUM_SEQS_CAP = 256
DEFAULT_MAX_NUM_SEQS = 256  # where the pool is sized by hand (num_blocks)
TOKENS_PER_SEQ = 1024  # a typical prompt and answer
CPU_DEFAULT_BUDGET = 2 << 30
DEFAULT_STATE_SHARE = 0.5  # at most this share of the cache budget goes to recurrent states by default
STATE_SLOTS_PER_SNAPSHOT = 4  # prefix caching: a state snapshot slot per 4 sequence slots, from the pools' share
PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=5)


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.2f} GiB"


def readable(num_bytes: float) -> str:
    """In GiB, or MiB below one GiB."""
    return gib(num_bytes) if num_bytes >= GiB else f"{num_bytes / (1 << 20):.2f} MiB"


@dataclass(frozen=True)
class DeviceProfile:
    """What an engine measured on its device, in bytes."""

    total: int
    free_at_start: int  # before the engine loaded anything
    weights: int  # the model's parameters and buffers
    other: int  # what else the engine holds between steps: runtime, kernels, workspaces
    activations: int  # peak of the largest step above what was held before it
    graphs: int  # step CUDA graphs


def kv_budget(profile: DeviceProfile, fraction: float) -> int:
    """Bytes for the KV cache: ``fraction`` of the device's total memory less what the
    engine needs besides. Raises ValueError when nothing is left."""
    p = profile
    allowed = int(p.total * fraction)
    if p.free_at_start < allowed:
        raise ValueError(
            f"kv_fraction {fraction:g} asks for {gib(allowed)} of the device's {gib(p.total)}, but only "
            f"{gib(p.free_at_start)} were free at start-up (other processes hold the rest): "
            f"lower kv_fraction (--kv-fraction) or free the device"
        )
    needed = p.weights + p.activations + p.graphs + p.other
    if needed >= allowed:
        raise ValueError(
            f"no memory left for the KV cache: weights {gib(p.weights)} + activation peak {gib(p.activations)} "
            f"+ CUDA graphs {gib(p.graphs)} + other {gib(p.other)} = {gib(needed)} reach kv_fraction {fraction:g} "
            f"of {gib(p.total)} ({gib(allowed)}): raise kv_fraction (--kv-fraction), lower max_num_batched_tokens "
            f"(--prefill-chunk-size) or max_num_seqs (--max-num-seqs), or use a smaller model"
        )
    return allowed - needed


def derive_max_num_seqs(capacity_tokens: int, max_model_len: int) -> int:
    """As many sequences as the KV cache holds at a typical length each (the context
    limit if shorter): more would only be preempted; at most MAX_NUM_SEQS_CAP."""
    return max(1, min(MAX_NUM_SEQS_CAP, capacity_tokens // min(TOKENS_PER_SEQ, max_model_len)))


@dataclass(frozen=True)
class PoolPlan:
    """One page group's pool."""

    window: int | None
    num_blocks: int
    block_bytes: int  # of one block, over the group's layers
    num_shadows: int = 0  # exact blocks for the recent window
    shadow_bytes: int = 0  # of one, over the group's layers

    def describe(self, block_size: int) -> str:
        reach = "every position" if self.window is None else f"window {self.window}"
        shadows = (f", recent-window shadows {gib(self.num_shadows * self.shadow_bytes)} ({self.num_shadows} blocks)"
                   if self.num_shadows else "")  # fmt: skip
        return (f"{reach}: {gib(self.num_blocks * self.block_bytes)} = {self.num_blocks * block_size} tokens "
                f"({self.num_blocks} blocks of {block_size}){shadows}")  # fmt: skip


@dataclass(frozen=True)
class MemoryPlan:
    pools: list[PoolPlan]  # one per page group
    block_size: int
    max_num_seqs: int
    max_num_seqs_derived: bool
    source: str  # what the cache was sized from
    weights: int
    activations: int | None  # None: not measured
    graphs: int | None
    num_state_slots: int = 0
    state_slot_bytes: int = 0
    num_snapshot_slots: int = 0  # beside the sequences' slots, for the prefix cache's state snapshots

    @property
    def num_blocks(self) -> list[int]:
        return [pool.num_blocks for pool in self.pools]

    def describe(self) -> str:
        activations = gib(self.activations) if self.activations is not None else "not measured"
        graphs = gib(self.graphs) if self.graphs is not None else "none"
        pools = "; ".join(pool.describe(self.block_size) for pool in self.pools) or "none"
        slots = self.num_state_slots + self.num_snapshot_slots
        snapshots = f" + {self.num_snapshot_slots} snapshots" if self.num_snapshot_slots else ""
        states = (f", recurrent states {gib(slots * self.state_slot_bytes)} "
                  f"({self.num_state_slots} slots{snapshots})" if self.num_state_slots else "")  # fmt: skip
        return (
            f"memory plan ({self.source}): weights {gib(self.weights)}, activation peak {activations}, "
            f"CUDA graph reserve {graphs}, KV pool {pools}{states}, "
            f"max_num_seqs {self.max_num_seqs}{' (derived)' if self.max_num_seqs_derived else ''}"
        )


def blocks_kept(num_tokens: int, window: int | None, block_size: int) -> int:
    """Blocks a sequence of ``num_tokens`` holds in a pool: all of them, or as many as its
    window reaches (a partial block at each end)."""
    blocks = -(-num_tokens // block_size)
    return blocks if window is None else min(blocks, -(-(window - 1) // block_size) + 1)


def split_budget(
    budget: int, block_bytes: list[int], windows: list[int | None], block_size: int, typical_len: int, step_tokens: int
) -> list[int]:
    """Blocks per pool: as many typical sequences as ``budget`` holds, each keeping in
    every pool what :func:`blocks_kept` says, and beside them in each windowed pool the
    blocks of one step's prompt tokens (written before the window moves past them). The
    first pool takes what rounding leaves."""
    kept = [blocks_kept(typical_len, w, block_size) for w in windows]
    steps = [0 if w is None else -(-step_tokens // block_size) for w in windows]
    fixed = sum(n * b for n, b in zip(steps, block_bytes))
    num_seqs = max(0, budget - fixed) / sum(k * b for k, b in zip(kept, block_bytes))
    blocks = [int(num_seqs * k) + s for k, s in zip(kept, steps)]
    blocks[0] = (budget - sum(n * b for n, b in zip(blocks[1:], block_bytes[1:]))) // block_bytes[0]
    return blocks


def shadow_blocks(max_num_seqs: int, max_num_batched_tokens: int, window: int, block_size: int) -> int:
    """Shadows the recent window can hold at once: per running sequence its first block,
    the blocks within ``window`` of its next token and a partial one at each end, and
    every block of a step's prompt chunks until the step is done."""
    if not window:
        return 0
    return max_num_seqs * (-(-window // block_size) + 3) + -(-max_num_batched_tokens // block_size)


def memory_baseline(memory: DeviceMemory | None) -> tuple[int, int] | None:
    """Free and total device memory before the engine loads anything."""
    if memory is None:
        return None
    memory.release_cached()
    return memory.info()


def host_kv_budget(fraction: float | None) -> int:
    """Bytes of available host memory for the cache: ``fraction`` of it, else a
    quarter up to 2 GiB."""
    available = available_host_memory()
    return int(available * fraction) if fraction else min(CPU_DEFAULT_BUDGET, available // 4)


def available_host_memory() -> int:
    """What the kernel could hand out without swapping (Linux's MemAvailable, which
    counts reclaimable page cache; free pages alone can be a small part of it)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_memory(
    config: EngineConfig,
    runner: ModelRunner,
    layout: CacheLayout,
    max_model_len: int,
    dtype: torch.dtype,
    kv_format: KVFormat,
    memory: DeviceMemory | None,
    baseline: tuple[int, int] | None,
    key_transforms: KeyTransforms | None = None,
) -> MemoryPlan:
    """Size each pool (in blocks), the recurrent-state slots and ``max_num_seqs``,
    measuring the device when it can (over one-block caches, which the caller's
    allocation of the planned caches replaces)."""
    cache, scheduler = config.cache, config.scheduler
    block_size, step_tokens = cache.block_size, scheduler.max_num_batched_tokens
    windows = [group.window for group in layout.groups]
    block_bytes = layout.block_bytes(block_size, kv_format, dtype)
    shadow_bytes = layout.block_bytes(block_size, get_format("auto"), dtype)
    slot_bytes = layout.slot_bytes(dtype)
    snapshots = bool(slot_bytes) and cache.enable_prefix_caching
    typical_len = min(TOKENS_PER_SEQ, max_model_len)
    weights = tensor_bytes(runner.model)
    derived = scheduler.max_num_seqs is None and cache.num_blocks is None
    wanted_seqs = scheduler.max_num_seqs or (MAX_NUM_SEQS_CAP if derived else DEFAULT_MAX_NUM_SEQS)
    activations = graphs = budget = None
    if cache.num_blocks is not None:
        source = "num_blocks given"
    elif memory is None or baseline is None:
        budget = host_kv_budget(cache.kv_fraction) // config.parallel.ranks_per_node  # the node's ranks share it
        source = f"{gib(budget)} of available host memory"
    else:  # measured over one-block caches with the real cache's key transforms (the graphs compile its kernels)
        allocate_caches(layout, [1] * len(windows), block_size, dtype, runner.device, kv_format, 1, key_transforms)
        profile = profile_device(runner, layout, memory, baseline, config, max_model_len, wanted_seqs)
        fraction = cache.kv_fraction or DEFAULT_KV_FRACTION
        budget = kv_budget(profile, fraction)
        source = f"kv_fraction {fraction:g} of {gib(profile.total)}, other {gib(profile.other)}"
        activations, graphs = profile.activations, profile.graphs

    def snapshot_slots(num_slots: int) -> int:
        return -(-num_slots // STATE_SLOTS_PER_SNAPSHOT) if snapshots else 0

    def blocks_beside(num_slots: int) -> list[int]:
        """Each pool's blocks once ``num_slots`` recurrent states and their snapshots are out of the budget."""
        if budget is None:
            return [cache.num_blocks or 0] * len(windows)
        left = budget - (num_slots + snapshot_slots(num_slots)) * slot_bytes
        return split_budget(left, block_bytes, windows, block_size, typical_len, step_tokens) if windows else []

    num_slots = 0
    if slot_bytes:
        share = cache.mamba_fraction or (DEFAULT_STATE_SHARE if windows else 1.0)
        per_slot = float(slot_bytes)  # where no pool is, the snapshots come out of the states' share (else the pools')
        if snapshots and not windows:
            per_slot += slot_bytes / STATE_SLOTS_PER_SNAPSHOT
        num_slots = wanted_seqs if budget is None else int(budget * share // per_slot)
        if cache.mamba_fraction is None:
            num_slots = min(num_slots, wanted_seqs)
        if num_slots == 0:
            assert budget is not None  # (without a budget there are as many slots as sequences)
            raise ValueError(
                f"no room for one sequence's recurrent state ({readable(per_slot)}) in its share of the cache "
                f"({readable(budget * share)}): raise --mamba-fraction or give the cache more memory (--kv-fraction)"
            )
    blocks = blocks_beside(num_slots)

    def with_shadows(max_num_seqs: int) -> list[PoolPlan]:
        """Each pool with the recent window's shadows for ``max_num_seqs`` sequences,
        which a planned pool gives up blocks for (fewer sequences, fewer shadows)."""
        shadows = shadow_blocks(max_num_seqs, step_tokens, cache.kv_recent_window, block_size)
        return [
            PoolPlan(w, n - (0 if budget is None else -(-shadows * s // b)), b, shadows, s)
            for w, n, b, s in zip(windows, blocks, block_bytes, shadow_bytes)
        ]

    def typical_seqs(pools: list[PoolPlan]) -> int:
        """How many typical sequences every pool (and the state slots) holds."""
        fits = [max(0, p.num_blocks - (0 if p.window is None else -(-step_tokens // block_size)))
                // blocks_kept(typical_len, p.window, block_size) for p in pools]  # fmt: skip
        return min(fits + ([num_slots] if num_slots else []))

    if derived:
        without_shadows = [PoolPlan(w, n, b) for w, n, b in zip(windows, blocks, block_bytes)]
        max_num_seqs = derive_max_num_seqs(typical_seqs(without_shadows) * typical_len, max_model_len)
        max_num_seqs = derive_max_num_seqs(typical_seqs(with_shadows(max_num_seqs)) * typical_len, max_model_len)
        if slot_bytes and cache.mamba_fraction is None and max_num_seqs < num_slots:
            num_slots = max_num_seqs  # the states no sequence would use go back to the pools
            blocks = blocks_beside(num_slots)
    else:  # a pool sized by hand (tests, forced preemption) keeps the usual default
        max_num_seqs = min(wanted_seqs, num_slots) if num_slots else wanted_seqs
    pools = with_shadows(max_num_seqs)
    for pool in pools:
        check_pool_holds_a_sequence(pool, max_model_len, block_size, step_tokens, cache.num_blocks is not None)
    return MemoryPlan(pools, block_size, max_num_seqs, derived, source, weights, activations, graphs, num_slots,
                      slot_bytes, snapshot_slots(num_slots))  # fmt: skip


def held_by_every_rank(plan: MemoryPlan, tp: TensorParallel) -> MemoryPlan:
    """Under tensor parallelism, the plan every rank can hold (each number at its least over the
    ranks): the first rank's scheduler hands out the same blocks and slots on every rank."""
    pools = plan.pools
    values = tp.min_over_ranks([plan.max_num_seqs, plan.num_state_slots, plan.num_snapshot_slots,
                                *(p.num_blocks for p in pools), *(p.num_shadows for p in pools)])  # fmt: skip
    max_num_seqs, num_state_slots, num_snapshot_slots = values[:3]
    blocks, shadows = values[3 : 3 + len(pools)], values[3 + len(pools) :]
    pools = [dataclasses.replace(p, num_blocks=b, num_shadows=n) for p, b, n in zip(pools, blocks, shadows)]
    return dataclasses.replace(plan, pools=pools, max_num_seqs=max_num_seqs, num_state_slots=num_state_slots,
                               num_snapshot_slots=num_snapshot_slots)  # fmt: skip


def blocks_of_a_sequence(max_model_len: int, window: int | None, block_size: int, step_tokens: int) -> int:
    """The blocks a pool needs for one sequence of ``max_model_len`` tokens (with a window: and one step's
    prompt tokens, written before the window moves past them)."""
    needed = blocks_kept(max_model_len, window, block_size)
    if window is not None:
        needed = min(-(-max_model_len // block_size), needed + -(-step_tokens // block_size))
    return needed


def check_fits(model: torch.nn.Module, config: EngineConfig, max_model_len: int, dtype: torch.dtype,
               available: int, where: str, splits: bool) -> None:  # fmt: skip
    """Refuses, before any weight is read, a model whose weights (``model``: on the meta device as the engine
    will hold it, split over its ranks, its weights packed where loading and the backend keep them packed:
    :func:`xinfer.loading.loader.held_model`) and the KV cache of one sequence of ``max_model_len`` tokens
    need more than the ``available`` bytes of ``where``. ``splits``: whether splitting the model over devices
    would give each part memory of its own."""
    layout, cache = CacheLayout.of(model), config.cache
    block_bytes = layout.block_bytes(cache.block_size, get_format(cache.kv_cache_dtype), dtype)
    step_tokens = config.scheduler.max_num_batched_tokens
    kv = layout.slot_bytes(dtype) + sum(
        b * blocks_of_a_sequence(max_model_len, group.window, cache.block_size, step_tokens)
        for group, b in zip(layout.groups, block_bytes)
    )
    weights = tensor_bytes(model)
    if weights + kv <= available:
        return
    size = readable(weights)
    if packed := (unpacked := float_bytes(model, dtype)) != weights:
        how = f"quantized to {config.model.isq}" if config.model.isq else "packed"
        size += f" {how} ({readable(unpacked)} in {str(dtype).removeprefix('torch.')})"
    remedies = [*weight_remedies(config, splits, packed), "use a shorter context (--max-model-len)", "free memory"]
    raise ValueError(
        f"the model does not fit in {where}: its weights take {size} and the KV cache of one {max_model_len}-token "
        f"sequence {readable(kv)}, {readable(weights + kv)} in all, and {readable(available)} are available: "
        f"{', '.join(remedies[:-1])}, or {remedies[-1]}"
    )


def weight_remedies(config: EngineConfig, splits: bool, packed: bool = False) -> list[str]:
    """What makes a model's weights take less of each device, of what applies: ``--isq`` where not given and
    the checkpoint is not ``packed`` already (a GGUF file, a quantized checkpoint), ``--d`` where ``splits``
    (devices of their own memory: the CPU's ranks would share the host's)."""
    if config.model.isq:
        remedies = ["use a smaller model"]
    elif packed:
        remedies = ["use a smaller model or a smaller quantization of it"]
    else:
        remedies = ["use a smaller model or quantize it at load (--isq q4_k)"]
    if splits:
        split = config.parallel.tensor_parallel_size > 1
        remedies.append("split it over more devices (--d)" if split else "split it over devices (--d 0,1)")
    return remedies


def available_bytes(memory: DeviceMemory | None) -> int:
    """What the device can still hand out: its free memory, or where the backend keeps no statistics
    (it computes in host memory), the host's available memory."""
    return memory.info()[0] if memory is not None else available_host_memory()


def check_pool_holds_a_sequence(
    pool: PoolPlan, max_model_len: int, block_size: int, step_tokens: int, blocks_given: bool = False
) -> None:
    """One sequence of ``max_model_len`` tokens must fit in ``pool`` (``blocks_given``: sized by num_blocks)."""
    needed = blocks_of_a_sequence(max_model_len, pool.window, block_size, step_tokens)
    if pool.num_blocks >= needed:
        return
    shadows = (f" beside the recent window's {pool.num_shadows} exact blocks (a smaller --kv-recent-window or "
               f"--prefill-chunk-size needs fewer)" if pool.num_shadows else "")  # fmt: skip
    pool_name = "KV cache" if pool.window is None else f"KV cache of the layers with window {pool.window}"
    keeps = "" if pool.window is None else f" (it keeps {needed * block_size} of them there)"
    more = "raise num_blocks" if blocks_given else "give the cache more memory (--kv-fraction)"
    raise ValueError(
        f"the {pool_name} holds {max(pool.num_blocks, 0) * block_size} tokens ({max(pool.num_blocks, 0)} blocks of "
        f"{block_size}){shadows}, fewer than max_model_len={max_model_len}{keeps}: lower max_model_len "
        f"(--max-model-len) or {more}"
    )


def tensor_bytes(module: torch.nn.Module) -> int:
    """The bytes ``module``'s parameters and buffers take (a packed weight: its bytes), on its device or,
    built on the meta device, as they would."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def float_bytes(module: torch.nn.Module, dtype: torch.dtype) -> int:
    """:func:`tensor_bytes` with each packed weight counted in ``dtype``."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(t.logical_shape.numel() * size if isinstance(t, QuantizedTensor) else t.numel() * t.element_size()
               for t in [*module.parameters(), *module.buffers()])  # fmt: skip


def profile_device(
    runner: ModelRunner,
    layout: CacheLayout,
    memory: DeviceMemory,
    baseline: tuple[int, int],
    config: EngineConfig,
    max_model_len: int,
    num_seqs: int,
) -> DeviceProfile:
    """Measure a step's activation peak and the step graphs (over the caches the layers hold)."""
    free_at_start, total = baseline
    num_tokens = config.scheduler.max_num_batched_tokens
    batch = profile_batch(num_tokens, max_model_len, config.cache.block_size, len(layout.groups),
                          bool(layout.state_layers))  # fmt: skip
    activations = peak_activations(runner, memory, batch, num_seqs)
    capture = not config.device.enforce_eager
    graphs = graph_memory(runner, memory, num_seqs, num_tokens, max_model_len) if capture else 0
    weights = tensor_bytes(runner.model)
    free, _ = memory.info()
    other = max(0, free_at_start - free - weights)
    return DeviceProfile(total, free_at_start, weights, other, activations, graphs)


def profile_batch(
    num_tokens: int, max_model_len: int, block_size: int, num_page_groups: int = 1, states: bool = False
) -> HostBatch:
    """``num_tokens`` dummy prompt tokens in sequences no longer than the context
    limit, writing no KV (slot -1), reading block 0 (and state slot 0)."""
    full, rest = divmod(num_tokens, max_model_len)
    batch = HostBatch([], [], [0], [], [], [PageBatch() for _ in range(num_page_groups)])
    for length in [max_model_len] * full + [rest] * (rest > 0):
        batch.input_ids += [0] * length
        batch.positions += range(length)
        batch.cu_seqlens_q.append(batch.cu_seqlens_q[-1] + length)
        batch.seq_lens.append(length)
        for page in batch.pages:
            page.slot_mapping += [-1] * length
            page.block_tables.append([0] * -(-length // block_size))
        if states:
            batch.state_slots.append(0)
    return batch


def peak_activations(runner: ModelRunner, memory: DeviceMemory, batch: HostBatch, num_seqs: int) -> int:
    """Peak bytes above what is held now of a forward over ``batch``, then of the
    logits and sampling of up to ``num_seqs`` of its rows (as a step does)."""
    memory.release_cached()
    before = memory.allocated()
    memory.reset_peak()
    hidden = runner.hidden_states(batch)
    rows = min(num_seqs, hidden.shape[0])
    seqs = [Sequence(f"profile-{i}", [0], PROFILE_SAMPLING) for i in range(rows)]
    with torch.inference_mode(), ops.use(runner.backend):
        logits = runner.model.compute_logits(hidden[:rows])
        Sampler(runner.device)(logits, seqs)
    del hidden, logits
    peak = memory.peak() - before
    memory.release_cached()
    return max(0, peak)


def graph_memory(runner: ModelRunner, memory: DeviceMemory, num_seqs: int, num_tokens: int, max_model_len: int) -> int:
    """Device bytes the step graphs (up to ``num_seqs`` sequences and ``num_tokens``
    tokens) hold, about one step's activations (0 where the backend captures none);
    the graphs are dropped again."""
    memory.release_cached()
    free_before, _ = memory.info()
    runner.capture_graphs(num_seqs, num_tokens, max_model_len)
    if runner.graphs is None:
        return 0
    memory.release_cached()
    free_after, _ = memory.info()
    runner.graphs = None
    gc.collect()  # the graphs' memory pool goes back only once nothing refers to them
    memory.release_cached()
    return max(0, free_before - free_after)
