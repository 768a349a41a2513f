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

import gc
from dataclasses import dataclass

import torch

from xinfer import ops
from xinfer.backend import DeviceMemory
from xinfer.config import EngineConfig
from xinfer.engine.kv_cache import allocate_kv_cache, bytes_per_block, host_kv_budget
from xinfer.engine.kv_calibration import KeyTransforms
from xinfer.engine.runner import ModelRunner
from xinfer.engine.sampler import Sampler
from xinfer.engine.sequence import Sequence
from xinfer.kv import KVFormat, get_format
from xinfer.ops import HostBatch
from xinfer.sampling import SamplingParams

GiB = 1 << 30
DEFAULT_KV_FRACTION = 0.9
MAX_NUM_SEQS_CAP = 256
TOKENS_PER_SEQ = 1024  # a typical prompt and answer
PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=5)


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.2f} GiB"


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
    limit if shorter), at most 256: more would only be preempted."""
    return max(1, min(MAX_NUM_SEQS_CAP, capacity_tokens // min(TOKENS_PER_SEQ, max_model_len)))


@dataclass(frozen=True)
class MemoryPlan:
    num_blocks: int
    block_size: int
    block_bytes: int
    max_num_seqs: int
    max_num_seqs_derived: bool
    source: str  # what the KV cache was sized from
    weights: int
    activations: int | None  # None: not measured
    graphs: int | None
    num_shadows: int = 0  # exact blocks for the recent window
    shadow_bytes: int = 0  # of one, over all layers

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        activations = gib(self.activations) if self.activations is not None else "not measured"
        graphs = gib(self.graphs) if self.graphs is not None else "none"
        shadows = (
            f", recent-window shadows {gib(self.num_shadows * self.shadow_bytes)} ({self.num_shadows} blocks)"
            if self.num_shadows else ""
        )  # fmt: skip
        return (
            f"memory plan ({self.source}): weights {gib(self.weights)}, activation peak {activations}, "
            f"CUDA graph reserve {graphs}, KV pool {gib(self.num_blocks * self.block_bytes)} = "
            f"{self.capacity_tokens} tokens ({self.num_blocks} blocks of {self.block_size}){shadows}, "
            f"max_num_seqs {self.max_num_seqs}{' (derived)' if self.max_num_seqs_derived else ''}"
        )


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


def plan_memory(
    config: EngineConfig,
    runner: ModelRunner,
    max_model_len: int,
    dtype: torch.dtype,
    kv_format: KVFormat,
    memory: DeviceMemory | None,
    baseline: tuple[int, int] | None,
    key_transforms: KeyTransforms | None = None,
) -> MemoryPlan:
    """Size the KV cache (in blocks) and ``max_num_seqs``, measuring the device when it
    can (over a one-block cache, which the caller's allocation of the planned cache
    replaces)."""
    cache, scheduler = config.cache, config.scheduler
    block_bytes = bytes_per_block(runner.model, cache.block_size, dtype, kv_format)
    weights = tensor_bytes(runner.model)
    activations = graphs = None
    if cache.num_blocks is not None:
        num_blocks, source = cache.num_blocks, "num_blocks given"
    elif memory is None or baseline is None:
        budget = host_kv_budget(cache.kv_fraction)
        num_blocks, source = budget // block_bytes, f"{gib(budget)} of available host memory"
    else:
        num_seqs = scheduler.max_num_seqs or MAX_NUM_SEQS_CAP
        capture = not config.device.enforce_eager
        profile = profile_device(
            runner, memory, baseline, config, max_model_len, dtype, kv_format, num_seqs, capture, key_transforms
        )
        fraction = cache.kv_fraction or DEFAULT_KV_FRACTION
        num_blocks = kv_budget(profile, fraction) // block_bytes
        source = f"kv_fraction {fraction:g} of {gib(profile.total)}, other {gib(profile.other)}"
        activations, graphs = profile.activations, profile.graphs
    derived = scheduler.max_num_seqs is None and cache.num_blocks is None
    shadow_bytes = bytes_per_block(runner.model, cache.block_size, dtype, get_format("auto"))

    def shadows_and_pool(max_num_seqs: int) -> tuple[int, int]:
        """The recent window's shadow blocks for ``max_num_seqs`` sequences, and the
        quantized blocks left beside them (a planned pool gives up their bytes)."""
        shadows = shadow_blocks(max_num_seqs, scheduler.max_num_batched_tokens, cache.kv_recent_window, cache.block_size)
        if cache.num_blocks is not None:
            return shadows, num_blocks
        return shadows, num_blocks - -(-shadows * shadow_bytes // block_bytes)

    if derived:  # as many as the pool holds once their shadows are out of it (fewer sequences, fewer shadows)
        max_num_seqs = derive_max_num_seqs(num_blocks * cache.block_size, max_model_len)
        max_num_seqs = derive_max_num_seqs(max(0, shadows_and_pool(max_num_seqs)[1]) * cache.block_size, max_model_len)
    else:  # a pool sized by hand (tests, forced preemption) keeps the usual default
        max_num_seqs = scheduler.max_num_seqs or MAX_NUM_SEQS_CAP
    num_shadows, num_blocks = shadows_and_pool(max_num_seqs)
    capacity = num_blocks * cache.block_size
    if capacity < max_model_len:
        shadows = (f" beside the recent window's {num_shadows} exact blocks (a smaller --kv-recent-window or "
                   f"--prefill-chunk-size needs fewer)" if num_shadows else "")  # fmt: skip
        raise ValueError(
            f"the KV cache holds {max(capacity, 0)} tokens ({max(num_blocks, 0)} blocks of {cache.block_size})"
            f"{shadows}, fewer than max_model_len={max_model_len}: lower max_model_len (--max-model-len) or give "
            f"the cache more memory (--kv-fraction)"
        )
    return MemoryPlan(
        num_blocks, cache.block_size, block_bytes, max_num_seqs, derived, source, weights, activations, graphs,
        num_shadows, shadow_bytes,
    )  # fmt: skip


def tensor_bytes(module: torch.nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def profile_device(
    runner: ModelRunner,
    memory: DeviceMemory,
    baseline: tuple[int, int],
    config: EngineConfig,
    max_model_len: int,
    dtype: torch.dtype,
    kv_format: KVFormat,
    num_seqs: int,
    capture: bool,
    key_transforms: KeyTransforms | None = None,
) -> DeviceProfile:
    """Measure a step's activation peak and the step graphs, over a one-block cache
    (with the real cache's key transforms, so the graphs compile the same kernels)."""
    free_at_start, total = baseline
    block_size = config.cache.block_size
    allocate_kv_cache(runner.model, 1, block_size, dtype, runner.device, kv_format, key_transforms)
    num_tokens = config.scheduler.max_num_batched_tokens
    activations = peak_activations(runner, memory, profile_batch(num_tokens, max_model_len, block_size), num_seqs)
    graphs = graph_memory(runner, memory, num_seqs, num_tokens, max_model_len) if capture else 0
    weights = tensor_bytes(runner.model)
    free, _ = memory.info()
    other = max(0, free_at_start - free - weights)
    return DeviceProfile(total, free_at_start, weights, other, activations, graphs)


def profile_batch(num_tokens: int, max_model_len: int, block_size: int) -> HostBatch:
    """``num_tokens`` dummy prompt tokens in sequences no longer than the context
    limit, writing no KV (slot -1) and reading block 0."""
    full, rest = divmod(num_tokens, max_model_len)
    batch = HostBatch([], [], [], [0], [], [], [])
    for length in [max_model_len] * full + [rest] * (rest > 0):
        batch.input_ids += [0] * length
        batch.positions += range(length)
        batch.slot_mapping += [-1] * length
        batch.cu_seqlens_q.append(batch.cu_seqlens_q[-1] + length)
        batch.seq_lens.append(length)
        batch.block_tables.append([0] * -(-length // block_size))
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
