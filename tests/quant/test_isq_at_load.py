"""``--isq`` quantizes each weight as it loads: the same packed model as loading every float weight first and
quantizing after (the path it replaces, written out here), while the float weights alive at once never
exceed one layer's; and the start-up fit check counts the weights packed."""

from __future__ import annotations

import logging

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, Qwen2MoeConfig

import xinfer.loading.loader
from tests.tiny_models import COMMON, prefill_logits, prompt, save_tiny_model
from xinfer import LLM, registry
from xinfer.backend import splits_memory
from xinfer.config import EngineConfig
from xinfer.distributed.group import TensorParallel, building_for
from xinfer.engine.memory_plan import check_fits, weight_remedies
from xinfer.loading.loader import (
    build_model,
    checkpoint_tensors,
    held_model,
    init_dummy_weights,
    load_config,
    load_model,
)
from xinfer.quant import QuantizedTensor, get_weight_format
from xinfer.quant.dispatch import replace_parameter
from xinfer.quant.isq import isq_formats, packed

CPU, FP32 = torch.device("cpu"), torch.float32
# every row a whole block of each format (q4_k's and q6_k's are 256 values)
WIDE = dict(COMMON, hidden_size=256, intermediate_size=256, head_dim=64)
CONFIGS = {
    "llama": lambda: LlamaConfig(**WIDE, tie_word_embeddings=True, architectures=["LlamaForCausalLM"]),
    # stacked experts, a gated shared expert (its one-row gate stays float) and a router
    "qwen2-moe": lambda: Qwen2MoeConfig(
        **WIDE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=256,
        decoder_sparse_step=1, tie_word_embeddings=False, architectures=["Qwen2MoeForCausalLM"],
    ),
}  # fmt: skip
# one format of each family --isq quantizes to: GGUF's legacy blocks, its k-quants, FP8, the FP4s
FORMATS = ["q4_0", "q4_k", "fp8", "mxfp4", "nvfp4"]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny_model(CONFIGS[request.param](), folder)
    return folder


def load_then_quantize(folder, load_format: str, isq: str):
    """The model as ``--isq`` gave it before it quantized at load: every weight loaded in float, then each
    weight its module declares quantizable (``quantized_weights``) whose rows are whole blocks packed."""
    fmt = get_weight_format(isq)
    model = xinfer.loading.loader.build_model(load_config(folder), CPU, FP32)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        model.load_weights(checkpoint_tensors(folder, load_format, model))
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if (name in getattr(module, "quantized_weights", ()) and not isinstance(param, QuantizedTensor)
                    and param.dim() >= 2 and param.shape[-1] % fmt.block_values == 0):  # fmt: skip
                raw = torch.cat([fmt.quantize(rows.float()) for rows in param.data.flatten(0, -2).split(4096)])
                replace_parameter(model, param, QuantizedTensor(raw.reshape(*param.shape[:-1], -1), fmt, param.shape))
    return model


def assert_same_tensors(got: torch.nn.Module, expected: torch.nn.Module) -> None:
    got_params = dict(got.named_parameters(remove_duplicate=False))
    expected_params = dict(expected.named_parameters(remove_duplicate=False))
    assert got_params.keys() == expected_params.keys()
    packed = 0
    for name, want in expected_params.items():
        have = got_params[name]
        assert isinstance(have, QuantizedTensor) == isinstance(want, QuantizedTensor), name
        if isinstance(want, QuantizedTensor):
            packed += 1
            assert (have.format.name, have.logical_shape) == (want.format.name, want.logical_shape), name
            assert torch.equal(have.raw, want.raw), f"{name}: packed bytes differ"
        else:
            assert have.dtype == want.dtype and torch.equal(have, want), name
    assert packed, "some weights are packed"
    for (name, have), (_, want) in zip(got.named_buffers(), expected.named_buffers(), strict=True):
        assert torch.equal(have, want), name


@pytest.mark.parametrize("isq", FORMATS)
@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_quantizing_as_the_weights_load_gives_the_same_model(checkpoint, load_format, isq):
    got = load_model(checkpoint, load_config(checkpoint), CPU, FP32, load_format, isq)
    assert_same_tensors(got, load_then_quantize(checkpoint, load_format, isq))
    assert not any(p.is_meta for p in got.parameters())


@pytest.mark.parametrize("rank", [0, 1])
def test_each_tensor_parallel_rank_quantizes_its_part_as_it_loads(checkpoint, rank):
    with building_for(TensorParallel(rank=rank, size=2)):
        got = load_model(checkpoint, load_config(checkpoint), CPU, FP32, "safetensors", "q8_0")
        assert_same_tensors(got, load_then_quantize(checkpoint, "safetensors", "q8_0"))


def float_bytes(model: torch.nn.Module) -> int:
    """The float bytes the model's parameters hold now (those left unallocated hold none)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.dtype.is_floating_point and not p.is_meta)


def one_layer_bound(packed: torch.nn.Module) -> int:
    """The float bytes of every weight ``packed`` keeps float, plus the float bytes (fp32) of the largest
    layer's packed weights: a decoder layer's, or the embedding's or the LM head's alone."""
    kept = float_bytes(packed)
    layers: dict[str, int] = {}
    for name, param in packed.named_parameters():
        if isinstance(param, QuantizedTensor):
            parts = name.split(".")
            layer = ".".join(parts[:3]) if parts[1] == "layers" else name
            layers[layer] = layers.get(layer, 0) + param.logical_shape.numel() * 4
    assert len(layers) > 2
    return kept + max(layers.values())


def peak_float_bytes(monkeypatch, isq: str, load) -> int:
    """The most float bytes the model being built held in its parameters at any quantization ``load`` makes
    (float bytes only grow between two, so the peak is at one of them)."""
    fmt = get_weight_format(isq)
    built: list[torch.nn.Module] = []
    peak = [0]
    original_build, original_quantize = xinfer.loading.loader.build_model, fmt.quantize

    def build(*args, **kwargs):
        built.append(original_build(*args, **kwargs))
        return built[-1]

    def quantize(values):
        if built:  # (isq_format probes the quantizer before the model is built)
            peak[0] = max(peak[0], float_bytes(built[-1]))
        return original_quantize(values)

    with monkeypatch.context() as patch:
        patch.setattr(xinfer.loading.loader, "build_model", build)
        patch.setattr(fmt, "quantize", quantize)
        load()
    return peak[0]


@pytest.fixture(scope="module", params=["F32", "Q8_0"])
def moe_gguf(request, tmp_path_factory):
    """A tiny MiniMax-M2 (stacked experts) as a GGUF file, its matrices F32 or packed as Q8_0, the experts' rows
    whole blocks of the K formats (256 values)."""
    from tests.plugins.converted_gguf import checkpoint_tensors as hf_tensors
    from tests.plugins.converted_gguf import write_converted_gguf
    from tests.plugins.minimax.test_minimax_m2 import minimax_m2_config
    from tests.plugins.minimax.test_minimax_m2_gguf import metadata_writer

    folder = tmp_path_factory.mktemp(f"moe-{request.param}")
    config = save_tiny_model(minimax_m2_config(hidden_size=256, intermediate_size=256), folder).config
    path = folder / "tiny.gguf"
    qtype = getattr(gguf.GGMLQuantizationType, request.param)
    write_converted_gguf(path, "minimax-m2", config, hf_tensors(folder), config.num_hidden_layers,
                         metadata_writer(config), quantize=None if request.param == "F32" else qtype)  # fmt: skip
    return path


def test_a_gguf_file_quantizes_its_float_weights_as_they_load_and_keeps_its_packed_ones(moe_gguf, caplog):
    """... and says so once, naming the formats kept (``xinfer --isq q4_k`` on a Q4_1 file was silently the file)."""
    with caplog.at_level(logging.WARNING, logger="xinfer"):
        got = load_model(moe_gguf, load_config(moe_gguf), CPU, FP32, "gguf", "q4_0")
    assert_same_tensors(got, load_then_quantize(moe_gguf, "gguf", "q4_0"))
    kept = sorted({p.format.name for p in got.parameters() if isinstance(p, QuantizedTensor)} - {"q4_0"})
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--isq")]
    expected = [f"--isq q4_0: the weights the checkpoint holds packed ({', '.join(kept)}) stay as they are: --isq "
                "packs float weights"] if kept else []  # fmt: skip
    assert warnings == expected


@pytest.mark.parametrize("isq, fallback", [("q2_k", "q4_0"), ("q3_k", "q4_0"), ("q4_k", "q5_0"), ("q5_k", "q5_1"),
                                           ("q6_k", "q8_0")])  # fmt: skip
def test_rows_that_are_not_whole_k_blocks_take_the_type_llama_cpp_gives_them(tmp_path, isq, fallback):
    """A K type's super-blocks are 256 values: the weights whose rows are not (hidden 96: q/k/v, gate/up, the
    tables) take the 32-value type llama.cpp's quantizer falls back to, the others (down: 256) the type asked for."""
    save_tiny_model(LlamaConfig(**dict(WIDE, hidden_size=96, head_dim=24), tie_word_embeddings=False), tmp_path)
    floats = dict(load_model(tmp_path, load_config(tmp_path), CPU, FP32, "safetensors").named_parameters())
    got = load_model(tmp_path, load_config(tmp_path), CPU, FP32, "safetensors", isq)
    formats = {name: p.format.name for name, p in got.named_parameters() if isinstance(p, QuantizedTensor)}
    assert set(formats) == {name for name, p in floats.items() if p.dim() == 2}
    for name, fmt in formats.items():
        assert fmt == (isq if floats[name].shape[1] % 256 == 0 else fallback), name
        assert torch.equal(dict(got.named_parameters())[name].raw, packed(floats[name], get_weight_format(fmt)).raw)
    assert {fmt for name, fmt in formats.items() if "down_proj" in name} == {isq}


def test_weights_no_block_fits_stay_float_and_a_line_says_so(tmp_path, caplog):
    """Hidden 48: no row is a whole number of Q8_0's 32 values but down's (intermediate 256). They stayed float
    without a word; a warning names them now. ``--isq w2`` on a dense model packs nothing: a warning says why."""
    save_tiny_model(LlamaConfig(**dict(WIDE, hidden_size=48, head_dim=12), tie_word_embeddings=False), tmp_path)
    with caplog.at_level(logging.WARNING, logger="xinfer"):
        got = load_model(tmp_path, load_config(tmp_path), CPU, FP32, "safetensors", "q8_0")
    left = sorted(name for name, p in got.named_parameters() if p.dim() == 2 and not isinstance(p, QuantizedTensor))
    assert left and all("down_proj" not in name for name in left)
    [line] = [r.getMessage() for r in caplog.records if "stay float" in r.getMessage()]
    assert line.startswith(f"--isq q8_0: {len(left)} weights stay float, their rows not whole blocks of 32 values (")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="xinfer"):
        load_model(tmp_path, load_config(tmp_path), CPU, FP32, "safetensors", "w2")
    assert [r.getMessage() for r in caplog.records] == [
        "--isq w2 packs the routed experts alone: this model has none, so no weight is packed"
    ]


def stacked_experts(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if len(getattr(p, "logical_shape", p.shape)) == 3}


def test_w2_packs_the_routed_experts_alone_in_q2_k_and_the_model_computes_with_their_values(tmp_path):
    """``--isq w2`` (xInfer's 2-bit mode): every stacked experts' weight in Q2_K, packed from its float values; every
    other weight as the checkpoint has it; and the model's logits are the float model's with the experts' values
    replaced by what the Q2_K bytes stand for."""
    folder = tmp_path
    save_tiny_model(CONFIGS["qwen2-moe"](), folder)
    floats = build_model(load_config(folder), CPU, FP32)  # as the checkpoint has them (not yet finish_loading's)
    floats.load_weights(checkpoint_tensors(folder, "safetensors", floats))
    got = load_model(folder, load_config(folder), CPU, FP32, "safetensors", "w2")
    q2_k, want = get_weight_format("q2_k"), dict(floats.named_parameters())
    experts = stacked_experts(floats)
    assert experts and {n for n, p in got.named_parameters() if isinstance(p, QuantizedTensor)} == experts
    for name, param in got.named_parameters():
        if name in experts:
            assert param.format is q2_k and param.logical_shape == want[name].shape, name
            assert torch.equal(param.raw.flatten(0, -2), q2_k.quantize(want[name].flatten(0, -2))), name
        else:
            assert torch.equal(param, want[name]), name
    llm = LLM(model=str(folder), dtype="float32", device="cpu", isq="w2", num_blocks=32)
    reference = LLM(model=str(folder), dtype="float32", device="cpu", num_blocks=32)
    for name in experts:  # the float model runs its shared expert as one more routed one: it keeps its values
        module, leaf = name.rsplit(".", 1)
        param = getattr(reference.engine.model.get_submodule(module), leaf)
        routed = dict(got.named_parameters())[name].dequantize()
        replace_parameter(reference.engine.model, param, torch.cat((routed, param.data[len(routed) :])))
    ids = prompt(21)
    got_logits, expected = prefill_logits(llm.engine, ids), prefill_logits(reference.engine, ids)
    torch.testing.assert_close(got_logits, expected, rtol=1e-4, atol=1e-4)


def test_w2_packs_a_gguf_files_experts_again_from_their_values(moe_gguf):
    """A file whose experts are packed (Q8_0) or float: under ``--isq w2`` its experts take Q2_K, packed from the
    file's values (decoded an expert at a time), and every other tensor is held as without ``--isq``."""
    config = load_config(moe_gguf)
    kept = dict(load_model(moe_gguf, config, CPU, FP32, "gguf").named_parameters())
    got = load_model(moe_gguf, config, CPU, FP32, "gguf", "w2")
    q2_k, experts = get_weight_format("q2_k"), stacked_experts(got)
    assert experts
    for name, param in got.named_parameters():
        original = kept[name]
        if name in experts:
            values = original.dequantize() if isinstance(original, QuantizedTensor) else original.data
            assert param.format is q2_k and param.logical_shape == values.shape, name
            assert torch.equal(param.raw.flatten(0, -2), q2_k.quantize(values.flatten(0, -2))), name
        elif isinstance(original, QuantizedTensor):
            assert param.format is original.format and torch.equal(param.raw, original.raw), name
        else:
            assert torch.equal(param, original), name


def held_as(model) -> dict[str, tuple]:
    """Each parameter's format (or dtype), shape and bytes."""
    return {name: (p.format.name if isinstance(p, QuantizedTensor) else p.dtype, tuple(p.shape), p.nbytes)
            for name, p in model.named_parameters(remove_duplicate=False)}  # fmt: skip


@pytest.mark.parametrize("isq", [None, "q8_0", "w2"])
def test_the_fit_check_counts_each_weight_of_a_gguf_file_as_loading_holds_it(moe_gguf, isq):
    """The model the fit check counts, from the file's header on the meta device, holds each weight (stacked
    experts packed by their loader, float ones quantized by --isq) as loading does."""
    config = load_config(moe_gguf)
    held = held_model(moe_gguf, config, FP32, "gguf", isq)
    assert all(p.is_meta for p in held.parameters())
    assert held_as(held) == held_as(load_model(moe_gguf, config, CPU, FP32, "gguf", isq))


def test_a_tied_config_with_a_different_head_in_the_checkpoint_packs_each_from_its_own_values(tmp_path):
    """A tied embedding and LM head both in the checkpoint with different values are untied as transformers unties
    them (xinfer.loading.tied): each is packed from its own tensor, as quantizing after a float load packs them."""
    hf = save_tiny_model(CONFIGS["llama"](), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = torch.randn_like(hf.model.embed_tokens.weight)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    got = load_model(tmp_path, load_config(tmp_path), CPU, FP32, "safetensors", "q8_0")
    assert_same_tensors(got, load_then_quantize(tmp_path, "safetensors", "q8_0"))
    assert got.lm_head.weight is not got.model.embed_tokens.weight
    head = packed(tensors["lm_head.weight"], get_weight_format("q8_0"))
    assert torch.equal(got.lm_head.weight.dequantize(), head.dequantize())


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_no_more_than_one_layer_of_float_weights_is_alive_while_loading(checkpoint, monkeypatch, load_format):
    config = load_config(checkpoint)
    packed = load_model(checkpoint, config, CPU, FP32, load_format, "q8_0")
    bound = one_layer_bound(packed)
    peak = peak_float_bytes(monkeypatch, "q8_0", lambda: load_model(checkpoint, config, CPU, FP32, load_format, "q8_0"))
    assert 0 < peak <= bound, f"{peak} float bytes alive while loading, more than one layer's {bound}"
    # the measure tells the two apart: loading everything first holds the whole float model
    before = peak_float_bytes(monkeypatch, "q8_0", lambda: load_then_quantize(checkpoint, load_format, "q8_0"))
    assert before > bound


def engine_config(folder, **options) -> EngineConfig:
    return EngineConfig.from_kwargs(model=str(folder), dtype="float32", device="cpu", **options)


def fit_check(folder, available: int, **options) -> None:
    model = held_model(folder, load_config(folder), FP32, "auto", options.get("isq"))
    check_fits(model, engine_config(folder, **options), 512, FP32, available, "cpu's memory", False)


@pytest.fixture(scope="module")
def llama_sizes(tmp_path_factory):
    """A tiny Llama's folder, its float weights' bytes, the same packed as q4_k (the GGUF block of 256 values
    in 144 bytes, llama.cpp's block_q4_K), as the CPU backend holds them and the KV cache of one 512-token
    sequence (fp32). The CPU backend repacks each linear's q4_k for torch's int4 matmul (every row count a
    multiple of 16 here): ``_convert_weight_to_int4pack_for_cpu``'s K / 2 bytes of nibbles a row, and a bf16
    scale and zero per 32 values, 20 bytes per 32 values, the tied embedding too (its rows are read back from
    that layout)."""
    folder = tmp_path_factory.mktemp("llama-fit")
    hf = save_tiny_model(CONFIGS["llama"](), folder)
    matrices = sum(p.numel() for p in hf.parameters() if p.dim() == 2)
    vectors = sum(p.numel() for p in hf.parameters() if p.dim() == 1)
    rotary = 512 * 64 * 4  # the model's cos/sin buffer of each position (fp32)
    float_weights = (matrices + vectors) * 4 + rotary
    q4_k = matrices // 256 * 144 + vectors * 4 + rotary
    cpu_q4_k = matrices // 32 * 20 + vectors * 4 + rotary
    kv = 2 * WIDE["num_hidden_layers"] * WIDE["num_key_value_heads"] * 64 * 512 * 4
    return folder, float_weights, q4_k, cpu_q4_k, kv


def mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.2f} MiB"


def test_a_model_that_fits_only_quantized_is_accepted_with_isq(llama_sizes):
    folder, float_weights, q4_k, _, kv = llama_sizes
    available = q4_k + kv  # exactly what the quantized model needs
    assert float_weights + kv > available
    fit_check(folder, available, isq="q4_k")
    with pytest.raises(ValueError, match="does not fit"):
        fit_check(folder, available - 1, isq="q4_k")
    with pytest.raises(ValueError) as error:
        fit_check(folder, available)
    message = str(error.value)
    assert message.startswith(f"the model does not fit in cpu's memory: its weights take {mib(float_weights)} and")
    assert "quantize it at load (--isq q4_k)" in message and "--d" not in message


def test_a_model_that_does_not_fit_even_quantized_is_one_line_with_both_sizes(llama_sizes, monkeypatch):
    """Through LLM on the CPU backend: refused before any weight loads, naming the packed and the float size,
    suggesting neither --isq (given) nor --d (the CPU's ranks share one memory)."""
    import xinfer.engine.build
    import xinfer.engine.memory_plan

    def never(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    folder, float_weights, _, q4_k, kv = llama_sizes  # as the CPU backend holds them
    monkeypatch.setattr(xinfer.engine.build, "load_model", never)
    monkeypatch.setattr(xinfer.engine.memory_plan, "available_host_memory", lambda: q4_k + kv - 1)
    with pytest.raises(ValueError) as error:
        LLM(model=str(folder), dtype="float32", isq="q4_k")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(
        f"the model does not fit in cpu's memory: its weights take {mib(q4_k)} quantized to q4_k "
        f"({mib(float_weights)} in float32) and the KV cache of one 512-token sequence {mib(kv)}, "
        f"{mib(q4_k + kv)} in all, and {mib(q4_k + kv - 1)} are available: use a smaller model, "
    )
    assert "--isq" not in message and "--d" not in message


def test_a_model_that_fits_only_quantized_loads_with_isq(llama_sizes, monkeypatch):
    import xinfer.engine.memory_plan

    folder, _, _, q4_k, kv = llama_sizes  # as the CPU backend holds them
    monkeypatch.setattr(xinfer.engine.memory_plan, "available_host_memory", lambda: q4_k + kv)
    with pytest.raises(ValueError, match="does not fit"):
        LLM(model=str(folder), dtype="float32", num_blocks=64)
    llm = LLM(model=str(folder), dtype="float32", isq="q4_k", num_blocks=64)
    assert isinstance(llm.engine.model.lm_head.weight, QuantizedTensor)


def test_splitting_over_devices_is_suggested_only_where_each_part_gets_memory_of_its_own():
    specs = {spec.name: spec for spec in registry.backends()}
    assert not splits_memory(specs["cpu"])  # the CPU's ranks share the host's memory
    if "cuda" in specs:
        assert splits_memory(specs["cuda"])
    if "metal" in specs:
        assert not splits_memory(specs["metal"])  # one device
    assert "split it over devices (--d 0,1)" in weight_remedies(engine_config("m"), splits=True)
    assert not any("--d" in remedy for remedy in weight_remedies(engine_config("m"), splits=False))
    split = engine_config("m", tensor_parallel_size=2)
    assert "split it over more devices (--d)" in weight_remedies(split, splits=True)


class DividesByReciprocal(torch.overrides.TorchFunctionMode):
    """Division of a tensor by a Python number as CUDA computes it: a multiplication by the number's
    reciprocal in float32, which differs from the quotient in the last bit for most divisors."""

    DIVISIONS = (torch.Tensor.__truediv__, torch.Tensor.div, torch.div, torch.true_divide)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.DIVISIONS and len(args) == 2 and isinstance(args[1], (int, float)) and not kwargs:
            x, divisor = args
            return x * (torch.tensor(1.0) / torch.tensor(float(divisor))).to(x.dtype)
        return func(*args, **kwargs)


@pytest.mark.parametrize("fmt", isq_formats())
def test_a_quantizer_packs_the_same_codes_whichever_way_the_device_divides(fmt):
    """``--isq`` on a GPU packs what it packs on the CPU: a quantizer's scale a last bit off rounds some
    values to other codes (q4_k on CUDA gave values 7 % of the weight's largest away)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(512, 4096, generator=generator) * torch.logspace(-2, 1, 512)[:, None]
    with DividesByReciprocal():
        on_a_gpu = packed(weight, get_weight_format(fmt))
    assert torch.equal(on_a_gpu.raw, packed(weight, get_weight_format(fmt)).raw)
