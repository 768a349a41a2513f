"""GGUF configs and weights against transformers' GGUF loader (and the HF weights they
came from, for files written here the way llama.cpp's converter writes them)."""

import math
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Phi3Config, Qwen2Config, Qwen3Config

from tests.llama_cpp_oracle import assert_llama_cpp_agrees
from tests.loading.gguf_models import MODELS, gguf_path, hf_model, reference_llm
from tests.plugins.converted_gguf import add_tiny_vocabulary
from tests.plugins.hf_parity import randomize
from tests.tiny_models import prefill_logits, prompt
from xinfer import LLM
from xinfer.loading.gguf import iter_gguf_weights, load_gguf_config
from xinfer.loading.gguf_file import GGUFFile
from xinfer.loading.loader import build_model
from xinfer.quant import QuantizedTensor, get_weight_format
from xinfer.quant.gguf_formats import GGUF_FORMATS

# fields whose value says where a file came from or how it was loaded, not what the model is
_PROVENANCE = {
    "_name_or_path",
    "_model_name_or_path",
    "architectures",
    "transformers_version",
    "dtype",
    "quantization_config",
}


def _differences(ours, reference) -> dict:
    a, b = ours.to_dict(), reference.to_dict()
    return {k: (a.get(k), b.get(k)) for k in (set(a) | set(b)) - _PROVENANCE if a.get(k) != b.get(k)}


@pytest.mark.parametrize("model", MODELS)
def test_config_matches_transformers(model):
    ours, reference = load_gguf_config(gguf_path(model)), hf_model(model).config
    assert type(ours) is type(reference)
    assert _differences(ours, reference) == {}
    assert ours.architectures == [AutoModelForCausalLM._model_mapping[type(reference)].__name__]


def test_gemma3_config_reads_what_llama_cpp_hard_codes():
    config = load_gguf_config(gguf_path("gemma3"))
    # Gemma-3-270M's published config.json: 5 sliding layers then a global one, local rope
    # base 10k, global 1M, window 512, queries scaled by head_dim 256, tied embeddings
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert (config.sliding_window, config.head_dim, config.query_pre_attn_scalar) == (512, 256, 256)
    assert config.tie_word_embeddings


@pytest.mark.parametrize("model", MODELS)
def test_weights_match_transformers(model):
    """Every tensor, packed ones dequantized (q/k rows reordered in their packed form), equals transformers'."""
    path = gguf_path(model)
    reference = hf_model(model).state_dict()
    config = load_gguf_config(path)
    ours = dict(iter_gguf_weights(path, config, checkpoint_names(config)))
    assert len(ours) == len(GGUFFile(path).tensors), "a tensor of the file has no HF name"
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert set(ours) == set(reference) - tied
    for name, tensor in ours.items():
        values = tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor  # packed: as the file
        assert values.dtype == torch.float32
        assert torch.equal(values, reference[name]), name


# -- files written here the way llama.cpp's converter writes qwen2 / qwen3 -----------------

TINY = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    bos_token_id=1,
    eos_token_id=2,
)
TINY_MODELS = {
    "llama": lambda: LlamaConfig(**TINY, tie_word_embeddings=False),
    "qwen2": lambda: Qwen2Config(**TINY, tie_word_embeddings=False),
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True),
    "phi3": lambda: Phi3Config(**TINY, pad_token_id=0, partial_rotary_factor=0.5, tie_word_embeddings=False),
}
# stored exactly, so that they compare with the HF originals: the q/k rows prove that the loader
# undoes llama's permutation, and that neither the file nor the loader permutes them for the others
EXACT = ("q_proj", "k_proj", "norm", "bias")


def halves_to_pairs(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """The rows of each head reordered as llama.cpp's converter does for ``llama``'s q/k (it rotates adjacent
    pairs): [x0..x(d/2-1), y0..y(d/2-1)] -> [x0, y0, x1, y1, ...]."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def converted_tensor(hf_name: str, tensor: torch.Tensor, config) -> torch.Tensor:
    if config.model_type == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return halves_to_pairs(tensor, config.num_attention_heads)
    if config.model_type == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return halves_to_pairs(tensor, config.num_key_value_heads)
    return tensor


def llama3_rope_factors(config) -> torch.Tensor:
    """The divisor of each rotated pair's frequency that llama.cpp's converter writes (``rope_freqs``) for a
    rope of type ``llama3``: 1 for short wavelengths, ``factor`` for long ones, a blend between."""
    rope = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    wavelengths = 2 * math.pi * rope["rope_theta"] ** (torch.arange(0, head_dim, 2).double() / head_dim)
    context, low, high = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"]
    smooth = (context / wavelengths - low) / (high - low)
    blended = 1 / ((1 - smooth) / rope["factor"] + smooth)
    factors = torch.where(wavelengths > context / low, rope["factor"], blended)
    return torch.where(wavelengths < context / high, 1.0, factors).float()


def longrope_attention_factor(config) -> float:
    """The converter's LongRoPE scale of cos and sin, from the context ratio alone (the checkpoint's
    ``attention_factor`` it does not read): sqrt(1 + ln(ratio) / ln(original context)), 1 where not longer."""
    original = config.original_max_position_embeddings
    ratio = config.max_position_embeddings / original
    return math.sqrt(1 + math.log(ratio) / math.log(original)) if ratio > 1 else 1.0


def _storage(hf_name: str) -> gguf.GGMLQuantizationType:
    if any(part in hf_name for part in EXACT):
        return gguf.GGMLQuantizationType.F32
    if "embed" in hf_name or "lm_head" in hf_name:
        return gguf.GGMLQuantizationType.F16
    return gguf.GGMLQuantizationType.Q8_0


def _quantize(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """llama.cpp's bytes of ``values`` in ``qtype``: the gguf package's where it quantizes to the
    type, else the core's (the K formats)."""
    try:
        return gguf.quants.quantize(values, qtype)
    except NotImplementedError:
        return get_weight_format(qtype.name.lower()).quantize(torch.from_numpy(values)).numpy()


def write_gguf(
    model,
    arch: str,
    path: Path,
    storage: Callable[[str], gguf.GGMLQuantizationType] = _storage,
    experts: int = 0,
) -> None:
    """``model`` as llama.cpp's converter writes it, each tensor in the type ``storage`` gives its HF name
    (``experts``: the count a Mixtral's metadata would have, its tensors not written)."""
    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if "head_dim" in config.to_diff_dict():
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if config.rope_parameters.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(config.rope_parameters["factor"])
        writer.add_rope_scaling_orig_ctx_len(config.rope_parameters["original_max_position_embeddings"])
        if (beta_fast := config.rope_parameters.get("beta_fast")) is not None:
            writer.add_rope_scaling_yarn_beta_fast(beta_fast)
        if (beta_slow := config.rope_parameters.get("beta_slow")) is not None:
            writer.add_rope_scaling_yarn_beta_slow(beta_slow)
        if (attention_factor := config.rope_parameters.get("attention_factor")) is not None:
            writer.add_rope_scaling_yarn_attn_factor(attention_factor)
    if experts:
        writer.add_expert_count(experts)
    if arch == "llama":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    if arch == "phi3":  # the rotated dimensions of a head, as llama.cpp's converter writes them
        head_dim = config.hidden_size // config.num_attention_heads
        writer.add_rope_dimension_count(int(head_dim * config.rope_parameters["partial_rotary_factor"]))
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_sliding_window(config.sliding_window or 0)  # 0: none (Phi-4)
        if config.rope_parameters.get("rope_type") == "longrope":  # the long-context models' (and their factors)
            writer.add_rope_scaling_attn_factors(longrope_attention_factor(config))
    add_tiny_vocabulary(writer, config.vocab_size, pre="qwen2")
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if config.pad_token_id is not None:
        writer.add_pad_token_id(config.pad_token_id)
    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), config.num_hidden_layers
    )
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        qtype = storage(hf_name)
        values = converted_tensor(hf_name, tensor, config).float().numpy()
        data = values if qtype == gguf.GGMLQuantizationType.F32 else _quantize(values, qtype)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", data, raw_dtype=qtype)
    if config.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config).numpy())
    if config.rope_parameters.get("rope_type") == "longrope":  # one pair for the whole model
        for kind in ("long", "short"):
            factors = np.array(config.rope_parameters[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def tiny_gguf(request, tmp_path_factory):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY_MODELS[request.param]()).float()
    path = tmp_path_factory.mktemp(request.param) / "tiny.gguf"
    write_gguf(model, request.param, path)
    return path, model


def test_tiny_config_matches_transformers(tiny_gguf):
    path, original = tiny_gguf
    reference = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    ours = load_gguf_config(path)
    assert type(ours) is type(reference)
    # transformers reads no head_dim for qwen3 (it keeps its 128 default): ours is the file's
    differences = _differences(ours, reference)
    if "head_dim" in differences:
        assert differences.pop("head_dim")[0] == GGUFFile(path).metadata["qwen3.attention.key_length"]
    # transformers reads no rope.dimension_count for phi3 (it rotates whole heads): ours is the original's
    for field in ("rope_parameters", "partial_rotary_factor"):
        if field in differences:
            assert differences.pop(field)[0] == original.config.to_dict()[field]
    assert differences == {}


def test_tiny_weights_match_transformers_and_the_originals(tiny_gguf):
    path, original = tiny_gguf
    config = load_gguf_config(path)
    reference = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float32
    ).state_dict()
    ours = dict(iter_gguf_weights(path, config, checkpoint_names(config)))
    expected = original.state_dict()
    assert set(ours) == set(expected) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    for name, packed in ours.items():
        tensor = packed.dequantize() if isinstance(packed, QuantizedTensor) else packed
        assert isinstance(packed, QuantizedTensor) == (_storage(name) in PACKED), name
        assert torch.equal(tensor, reference[name]), name
        if _storage(name) == gguf.GGMLQuantizationType.F32:
            assert torch.equal(tensor, expected[name]), name
        else:
            torch.testing.assert_close(tensor, expected[name], atol=2e-2 * expected[name].abs().max(), rtol=0)


PACKED = {gguf.GGMLQuantizationType[f.name.upper()] for f in GGUF_FORMATS}


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def f32_gguf(request, tmp_path_factory):
    """A tiny model with random norms and biases, every tensor F32 (so llama.cpp computes in fp32), and xinfer's
    LLM of it."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY_MODELS[request.param]()).float()
    randomize(model)
    path = tmp_path_factory.mktemp(f"{request.param}-f32") / "tiny.gguf"
    write_gguf(model, request.param, path, storage=lambda _: gguf.GGMLQuantizationType.F32)
    return LLM(model=str(path), dtype="float32", num_blocks=64), path


def test_llama_cpp_reads_the_tiny_gguf_alike(f32_gguf):
    assert_llama_cpp_agrees(*f32_gguf)


# -- dequantization of each block type -------------------------------------------------------

K_AND_LEGACY = ["Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _file_with(tmp_path: Path, qtype: gguf.GGMLQuantizationType, raw: np.ndarray) -> GGUFFile:
    writer = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    writer.add_tensor("t.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(tmp_path / "t.gguf")


@pytest.mark.parametrize("type_name", K_AND_LEGACY)
def test_dequantize_matches_transformers_kernels(tmp_path, type_name):
    from transformers.integrations.gguf.dequant import dequantize as reference

    from xinfer.loading.gguf import dequantize

    qtype = gguf.GGMLQuantizationType[type_name]
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (4, 3 * block_bytes), dtype=np.uint8)
    ours = dequantize(_file_with(tmp_path, qtype, raw), "t.weight")
    expected = reference(torch.from_numpy(raw.reshape(-1)), int(qtype)).reshape(4, 3 * block)
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_dequantize_float_types(tmp_path, type_name):
    from xinfer.loading.gguf import dequantize

    qtype = gguf.GGMLQuantizationType[type_name]
    values = torch.randn(4, 64)
    stored = values.to({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[type_name])
    raw = stored.view(torch.uint8).numpy() if type_name != "F32" else stored.numpy()
    ours = dequantize(_file_with(tmp_path, qtype, raw), "t.weight")
    assert torch.equal(ours, stored.float())


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1"])
def test_dequantize_q5_recovers_values(tmp_path, type_name):
    from xinfer.loading.gguf import dequantize

    qtype = gguf.GGMLQuantizationType[type_name]
    values = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    ours = dequantize(_file_with(tmp_path, qtype, gguf.quants.quantize(values, qtype)), "t.weight")
    # 5 bits over each block of 32: within one step (range/31) of the original
    steps = (values.reshape(4, 2, 32).max(-1) - values.reshape(4, 2, 32).min(-1)) / 31
    error = np.abs(ours.numpy() - values).reshape(4, 2, 32).max(-1)
    assert (error <= steps).all()


def checkpoint_names(config) -> set[str]:
    return build_model(config, torch.device("meta"), torch.float32).checkpoint_names()


def test_tiny_phi3_runs_like_transformers(tmp_path):
    """A Phi3 GGUF with partial rotary (rope.dimension_count) through the engine: the
    logits of transformers' model over the same dequantized weights, with the rotary
    share the file names (transformers' own GGUF reading rotates whole heads)."""
    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(TINY_MODELS["phi3"]()).float()
    path = tmp_path / "tiny.gguf"
    write_gguf(original, "phi3", path)
    llm = reference_llm(path, dtype="float32", num_blocks=64)  # the packed Q8_0 weights dequantized per call
    config = load_gguf_config(path)
    reference = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float32
    )
    tokens = prompt(37, vocab_size=TINY["vocab_size"])
    expected = reference(torch.tensor([tokens])).logits[0]
    got = prefill_logits(llm.engine, tokens)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    whole_heads = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    assert not torch.allclose(whole_heads(torch.tensor([tokens])).logits[0], expected, atol=1e-3)


def test_yarn_gguf_runs_with_llama_cpps_betas_and_scale(tmp_path):
    """The converter writes YaRN's beta_fast, beta_slow and attention_factor where the checkpoint sets them;
    llama.cpp reads none of them for qwen3 (nor llama, qwen2, glm4...): it keeps betas 32 and 1 and scales
    attention by the factor alone. transformers' model of the checkpoint, which uses them, is not the file's."""
    torch.manual_seed(0)
    rope = {**YARN_ROPE, "beta_fast": 8.0, "beta_slow": 2.0, "attention_factor": 1.3}
    original = AutoModelForCausalLM.from_config(Qwen3Config(**{**TINY, "rope_parameters": rope}, head_dim=32)).float()
    randomize(original)
    path = tmp_path / "tiny.gguf"
    write_gguf(original, "qwen3", path, storage=lambda _: gguf.GGMLQuantizationType.F32)
    llm = LLM(model=str(path), dtype="float32", num_blocks=64)
    assert_llama_cpp_agrees(llm, path)
    tokens = prompt(29, vocab_size=TINY["vocab_size"])
    with torch.inference_mode():
        checkpoints = original(torch.tensor([tokens])).logits[0]
    assert not torch.allclose(prefill_logits(llm.engine, tokens), checkpoints, atol=1e-3)


def test_llama_gguf_with_biases_runs_like_transformers_and_llama_cpp(tmp_path):
    """Llama's optional biases (``attention_bias``: q, k, v and o; ``mlp_bias``), which the converter writes
    under the gguf names and llama.cpp adds wherever the file has them: the file's config says so only by the
    tensors, and a loader that keeps transformers' defaults (no biases) drops them all."""
    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(
        LlamaConfig(**TINY, attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    ).float()
    randomize(original)
    path = tmp_path / "tiny.gguf"
    write_gguf(original, "llama", path, storage=lambda _: gguf.GGMLQuantizationType.F32)
    llm = LLM(model=str(path), dtype="float32", num_blocks=64)
    tokens = prompt(29, vocab_size=TINY["vocab_size"])
    with torch.inference_mode():
        expected = original(torch.tensor([tokens])).logits[0]
    assert (prefill_logits(llm.engine, tokens) - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert_llama_cpp_agrees(llm, path)


def test_phi3_gguf_attends_past_the_window_as_llama_cpp(tmp_path):
    """The converter writes Phi-3's sliding window, which llama.cpp does not apply (it disables the window
    for phi3): a prompt longer than it attends to every earlier position."""
    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(TINY_MODELS["phi3"]()).float()
    original.config.sliding_window = 8
    randomize(original)
    path = tmp_path / "tiny.gguf"
    write_gguf(original, "phi3", path, storage=lambda _: gguf.GGMLQuantizationType.F32)
    assert GGUFFile(path).metadata["phi3.attention.sliding_window"] == 8
    assert_llama_cpp_agrees(LLM(model=str(path), dtype="float32", num_blocks=64), path, length=29)


def test_mixtral_gguf_is_one_clear_error(tmp_path):
    """llama.cpp's converter writes Mixtral as architecture ``llama`` with experts."""
    torch.manual_seed(0)
    path = tmp_path / "tiny.gguf"
    write_gguf(AutoModelForCausalLM.from_config(TINY_MODELS["llama"]()).float(), "llama", path, experts=8)
    with pytest.raises(ValueError, match=r"llama.expert_count: .*mixture of experts .* no MixtralForCausalLM"):
        load_gguf_config(path)


def phi3_longrope(partial_rotary_factor: float, **overrides) -> Phi3Config:
    """Phi-3.5's LongRoPE in small: trained at 256 positions (llama.cpp's contexts are multiples of 256), 1024
    after, per-frequency factors far from 1 and from each other."""
    pairs = int(TINY["hidden_size"] // TINY["num_attention_heads"] * partial_rotary_factor) // 2
    generator = torch.Generator().manual_seed(2)
    rope = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=partial_rotary_factor,
                short_factor=(1 + 2 * torch.rand(pairs, generator=generator)).tolist(),
                long_factor=(4 + 40 * torch.rand(pairs, generator=generator)).tolist())  # fmt: skip
    settings = dict(TINY, max_position_embeddings=1024, original_max_position_embeddings=256, rope_parameters=rope,
                    pad_token_id=0, tie_word_embeddings=False)  # fmt: skip
    return Phi3Config(**{**settings, **overrides})


LONGROPE_MODELS = {
    "phi3.5": lambda: phi3_longrope(0.5),
    "phi4-mini": lambda: phi3_longrope(0.75, tie_word_embeddings=True),  # a quarter of each head not rotated
}


@pytest.mark.parametrize(
    ("model", "context", "length", "factors"),
    [
        ("phi3.5", 256, 40, "short"),  # a context within the original: the short factors
        ("phi3.5", 512, 300, "long"),  # past it: the long ones, for a prompt past it
        # by default the file's context (llama.cpp's -c 0): the long factors for a prompt within the original
        # too, which transformers turns by the short ones
        ("phi3.5", None, 40, "long"),
        ("phi4-mini", 512, 300, "long"),
    ],
)
def test_phi3_gguf_with_longrope_runs_as_llama_cpp(tmp_path, model, context, length, factors):
    """llama.cpp's converter writes LongRoPE as a rope_factors_long and a rope_factors_short tensor, the original
    context and the attention factor it computes; llama.cpp turns every position by the long factors where the
    context it serves a sequence is longer than the original, else by the short ones, whatever the sequence's
    length. Served with that context (max_model_len; None: the file's), xinfer is llama.cpp; transformers' model of the checkpoint,
    which picks the factors by the sequence's length, agrees only where that picks the same ones."""
    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(LONGROPE_MODELS[model]()).float()
    randomize(original)
    path = tmp_path / "tiny.gguf"
    write_gguf(original, "phi3", path, storage=lambda _: gguf.GGMLQuantizationType.F32)
    llm = LLM(model=str(path), dtype="float32", num_blocks=80, max_model_len=context)
    assert_llama_cpp_agrees(llm, path, length=length, n_ctx=context or original.config.max_position_embeddings)
    tokens = prompt(length, vocab_size=TINY["vocab_size"])
    with torch.inference_mode():
        checkpoints = original(torch.tensor([tokens])).logits[0]
    by_length = "long" if length > original.config.original_max_position_embeddings else "short"
    error = (prefill_logits(llm.engine, tokens) - checkpoints).abs().max() / checkpoints.abs().max()
    assert (error <= 1e-4) == (by_length == factors), f"max|diff|/max|transformers' logit| = {error:.2e}"


# Llama 3.1's rope in small: pairs of wavelength 6 keep their frequency, 20 and 63 are blended, the rest divided by 8
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)  # fmt: skip


# Qwen2.5's long-context YaRN in small
YARN_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)
SCALED_ROPES = {
    # the converter writes a llama3 rope as no metadata but a rope_freqs tensor of divisors, one per rotated
    # pair, which llama.cpp applies at every position
    "llama3": lambda: LlamaConfig(**{**TINY, "rope_parameters": LLAMA3_ROPE}),
    # YaRN as rope.scaling metadata: type, factor and the original context
    "yarn": lambda: Qwen3Config(**{**TINY, "rope_parameters": YARN_ROPE}, head_dim=32),
}


@pytest.mark.parametrize("rope", sorted(SCALED_ROPES))
def test_scaled_rope_gguf_runs_like_transformers_and_llama_cpp(tmp_path, rope):
    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(SCALED_ROPES[rope]()).float()
    randomize(original)
    path = tmp_path / "tiny.gguf"
    arch = original.config.model_type
    write_gguf(original, arch, path, storage=lambda _: gguf.GGMLQuantizationType.F32)
    llm = LLM(model=str(path), dtype="float32", num_blocks=64)
    tokens = prompt(29, vocab_size=TINY["vocab_size"])
    with torch.inference_mode():
        expected = original(torch.tensor([tokens])).logits[0]
    got = prefill_logits(llm.engine, tokens)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert_llama_cpp_agrees(llm, path)
