"""Engine settings, validated once at construction (pydantic)."""

from __future__ import annotations

from typing import Any, Literal, get_args

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from xinfer.kv.formats import get_format

DTYPES = {
    **dict.fromkeys(["bfloat16", "bf16"], torch.bfloat16),
    **dict.fromkeys(["float16", "fp16", "f16", "half"], torch.float16),
    **dict.fromkeys(["float32", "fp32", "f32", "float"], torch.float32),
}


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: object, info: ValidationInfo) -> object:
        """pydantic takes ``True`` for the number 1 (``max_model_len=True``): a bool only where a field is one."""
        annotation = cls.model_fields[str(info.field_name)].annotation
        if isinstance(value, bool) and annotation is not bool and bool not in get_args(annotation):
            raise ValueError(f"must be {_type_name(annotation)}, got {value!r}")
        return value


def _type_name(annotation: object) -> str:
    kinds = [a for a in get_args(annotation) or (annotation,) if a is not type(None)]
    return " or ".join(getattr(kind, "__name__", str(kind)) for kind in kinds) + (
        " or None" if type(None) in get_args(annotation) else ""
    )


class ModelConfig(_Config):
    model: str | None = None  # HF folder, .gguf file or folder holding one; None: the embedded default
    dtype: str = "auto"  # auto, bfloat16/bf16, float16/f16, float32/f32; a torch.dtype is taken as its name
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = "auto"
    isq: str | None = None  # quantize float weights at load to this packed format (q8_0, q4_k, ...)
    max_model_len: int | None = Field(None, gt=0)  # context limit; default: the model's
    hf_overrides: dict[str, Any] | None = None  # config.json fields replaced (a sub-config's: merged), as vLLM's
    # models that take images: their image processor's settings (preprocessor_config.json's fields) replaced, as
    # vLLM's: Qwen-VL's max_pixels / min_pixels, Gemma 4's max_soft_tokens, ...
    mm_processor_kwargs: dict[str, Any] | None = None
    seed: int = Field(0, ge=-(2**63), lt=2**64)  # what torch.manual_seed takes; None (vLLM's): 0
    # models that take images: encoder outputs kept for images seen again (LRU), in embedding rows in all
    # (a Gemma 3 image is 256)
    encoder_cache_size: int = Field(8192, ge=0)

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_name(cls, dtype: object) -> object:
        """vLLM's ``dtype=torch.bfloat16``: the name its string form gives."""
        return dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype

    @field_validator("seed", mode="before")
    @classmethod
    def _seed_none_is_zero(cls, seed: object) -> object:
        """vLLM's older default ``seed=None``, which its V1 engine (and ours) runs as 0."""
        return 0 if seed is None else seed

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, name: str) -> str:
        if name != "auto" and name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}")
        return name


class CacheConfig(_Config):
    block_size: int = Field(16, gt=0)  # tokens per KV block
    num_blocks: int | None = Field(None, gt=0)  # KV blocks; overrides the memory plan
    # GPU: share of the device's total memory this engine may use for weights, activations, CUDA graphs and KV
    # cache, the KV cache getting what is left (default 0.9); CPU: share of the free RAM after loading the weights
    # that the KV cache gets (default: a quarter, at most 2 GiB)
    kv_fraction: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    # auto: the model dtype; fp8: rotated e4m3 K, e4m3 V; turbo8: rotated 8-bit K, 4-bit V; turbo4/turbo3: rotated
    # 4-/3-bit K, 4-bit V (-lm: Lloyd-Max levels for the rotated keys); see docs/kv-cache.md
    kv_cache_dtype: str = "auto"
    # quantized caches: each query reads the keys and values of its last N positions, and of its sequence's first
    # block, unquantized (shadow blocks in the model dtype); 0: off. See docs/kv-cache.md
    kv_recent_window: int = Field(0, ge=0)
    # models with recurrent layers (Gated DeltaNet, Mamba): share of the cache memory their per-sequence states get,
    # which bounds how many sequences run at once; default: enough for max_num_seqs, at most half
    mamba_fraction: float | None = Field(None, gt=0, lt=1, allow_inf_nan=False)
    enable_prefix_caching: bool = True
    state_snapshot_interval: int = Field(
        1024,
        gt=0,
        description="models with recurrent layers, with prefix caching: a prompt's recurrent state is snapshotted "
        "every N tokens (rounded down to a multiple of block_size), and at its last block boundary; see docs/cache-kinds.md",
    )

    @field_validator("kv_cache_dtype")
    @classmethod
    def _known_format(cls, name: str) -> str:
        get_format(name)  # an unknown name raises, naming the known ones
        return name


class SchedulerConfig(_Config):
    # sequences in a running batch; default: as many as the planned KV cache holds at 1024 tokens each
    # (max_model_len if shorter), at most 256; exactly 256 when num_blocks is given
    max_num_seqs: int | None = Field(None, gt=0)
    max_num_batched_tokens: int = Field(8192, gt=0)  # tokens per step; longer prefills are chunked


class DeviceConfig(_Config):
    device: str = "auto"  # auto, cpu, cuda, cuda:1, ...
    backend: str | None = None  # backend plugin by name; default: the best available
    enforce_eager: bool = False  # no CUDA graphs

    @field_validator("device")
    @classmethod
    def _known_device(cls, name: str) -> str:
        if name != "auto":
            try:
                torch.device(name)
            except RuntimeError:
                raise ValueError(f"unknown device {name!r}; give auto, cpu, or a device type and index "
                                 f"such as cuda, cuda:1, mps") from None  # fmt: skip
        return name


class ParallelConfig(_Config):
    """Tensor parallelism: one process per rank (docs/distributed.md)."""

    tensor_parallel_size: int = Field(1, gt=0)  # ranks over all nodes
    device_ids: list[int] | None = None  # this node's accelerator per local rank (--d 0,1); default 0, 1, ...
    num_nodes: int = Field(1, gt=0)  # machines sharing the ranks evenly; node 0 serves, the others follow it
    node_rank: int = Field(0, ge=0)
    master_addr: str = "127.0.0.1"  # node 0's address, where the ranks meet
    master_port: int | None = Field(None, gt=0, lt=65536)  # default (one node): a free port
    timeout: float = Field(300.0, gt=0)  # seconds a collective may wait for a rank before failing

    @model_validator(mode="after")
    def _fits(self) -> ParallelConfig:
        if self.tensor_parallel_size % self.num_nodes:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} does not split evenly over {self.num_nodes} nodes"
            )
        if self.node_rank >= self.num_nodes:
            raise ValueError(f"node_rank {self.node_rank} is not one of the {self.num_nodes} nodes (0..)")
        if self.num_nodes > 1 and self.master_port is None:
            raise ValueError("several nodes meet at master_addr:master_port: give master_port (--master-port)")
        if self.device_ids is not None and len(self.device_ids) != self.ranks_per_node:
            raise ValueError(
                f"{len(self.device_ids)} device ids for {self.ranks_per_node} ranks on this node "
                f"(tensor_parallel_size {self.tensor_parallel_size} over {self.num_nodes} nodes)"
            )
        return self

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.num_nodes


class EngineConfig(_Config):
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    device: DeviceConfig = DeviceConfig()
    parallel: ParallelConfig = ParallelConfig()

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Build from flat keyword arguments (``dtype=..., block_size=...``)."""
        groups = {name: type(field.default) for name, field in cls.model_fields.items()}
        values: dict[str, dict] = {name: {} for name in groups}
        for key, value in kwargs.items():
            owner = next((g for g, c in groups.items() if key in c.model_fields), None)
            if owner is None:
                known = sorted(f for c in groups.values() for f in c.model_fields)
                raise TypeError(f"unknown engine option {key!r}; known options: {', '.join(known)}")
            values[owner][key] = value
        return cls(**{g: c(**values[g]) for g, c in groups.items()})


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` as ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


def resolve_dtype(name: str, config_dtype: torch.dtype | str | None, device_type: str) -> torch.dtype:
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    if device_type == "cpu":
        return torch.float32
    if isinstance(config_dtype, str):
        config_dtype = DTYPES.get(config_dtype.removeprefix("torch."))
    return config_dtype if config_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
