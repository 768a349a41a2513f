import json

import pytest
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from tests.tiny_models import COMMON, save_tiny_model
from xinfer import LLM
from xinfer.loading.weights import MissingWeightsError
from xinfer.registry import UnknownArchitectureError


def test_unknown_architecture_lists_the_registered_ones(tmp_path):
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["NoSuchForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownArchitectureError) as error:
        LLM(model=str(tmp_path), dtype="float32")
    assert "'NoSuchForCausalLM'" in str(error.value)
    assert "LlamaForCausalLM" in str(error.value) and "Qwen3ForCausalLM" in str(error.value)


def test_missing_weight_is_named(tmp_path):
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(MissingWeightsError) as error:
        LLM(model=str(tmp_path), dtype="float32")
    assert "model.layers.1.self_attn.k_proj.weight" in str(error.value)  # the checkpoint's name, not the merged one


def test_missing_weights_are_named_with_the_tensors_the_model_did_not_read(tmp_path):
    """A checkpoint whose names lack the model's prefix: the error named the missing weights only, not the
    same tensors there under other names."""
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({name.removeprefix("model."): t for name, t in tensors.items()}, tmp_path / "model.safetensors")
    with pytest.raises(MissingWeightsError, match=r"; it has \d+ tensor\(s\) the model does not read: embed_tokens"):
        LLM(model=str(tmp_path), dtype="float32")


def test_a_tensor_in_two_files_is_refused_naming_both(tmp_path):
    """Without an index every *.safetensors file is read (as vLLM does): a stray copy beside model.safetensors
    replaced its weights without a word (transformers reads model.safetensors alone)."""
    from xinfer.loading.errors import ModelFileError

    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    name = "model.layers.0.mlp.down_proj.weight"
    save_file({name: load_file(tmp_path / "model.safetensors")[name] * 2}, tmp_path / "extra.safetensors")
    with pytest.raises(ModelFileError, match=rf"model\.safetensors: tensor {name} is in extra\.safetensors too"):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=16)


def test_checkpoint_tensors_the_model_leaves_unread_are_named_in_one_line(tmp_path, caplog):
    """A field the model does not read (here MLP biases the Llama config does not ask for) is reported by
    pattern, not dropped without a word."""
    import torch

    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    for layer in range(COMMON["num_hidden_layers"]):
        tensors[f"model.layers.{layer}.mlp.down_proj.bias"] = torch.ones(COMMON["hidden_size"])
    save_file(tensors, path, metadata={"format": "pt"})
    with caplog.at_level("INFO", logger="xinfer.loading.weights"):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=32)
    lines = [r.getMessage() for r in caplog.records if "not used by the model" in r.getMessage()]
    layers = COMMON["num_hidden_layers"]
    assert lines == [f"{layers} checkpoint tensor(s) not used by the model: model.layers.*.mlp.down_proj.bias"]


def test_a_max_model_len_past_the_models_positions_is_refused(tmp_path):
    """Positions past ``max_position_embeddings`` have no rotary row (and were never trained): refused at
    start-up in one line, not an index error in the first long step."""
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    with pytest.raises(
        ValueError, match=r"max_model_len 2048 is more than the model's max_position_embeddings \(512\)"
    ):
        LLM(model=str(tmp_path), dtype="float32", max_model_len=2048)


def test_sharded_checkpoint_with_index_loads(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"])
    model = AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=32)
    ours = llm.engine.model.model.embed_tokens.weight
    assert torch.equal(ours, model.model.embed_tokens.weight)


def test_dummy_weights_need_no_checkpoint(tmp_path):
    LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", load_format="dummy", num_blocks=32)
    weight = llm.engine.model.model.layers[0].mlp.down_proj.weight
    assert weight.std() > 0.01  # random, never zeros


# ---- bad files: one line naming the file and what is wrong ---------------------------------------------------


def _truncated_gguf(tmp_path, keep: float | int):
    from tests.loading.gguf_models import SMOLLM, gguf_path

    source = gguf_path(SMOLLM)
    data = source.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    return path, len(data)


def test_a_truncated_gguf_says_how_much_of_it_is_there(tmp_path):
    from xinfer.loading.errors import amount
    from xinfer.loading.gguf_file import GGUFFile, GGUFFormatError

    path, full = _truncated_gguf(tmp_path, 0.5)
    with pytest.raises(GGUFFormatError) as error:
        GGUFFile(path)
    held = path.stat().st_size
    assert str(error.value) == f"{path}: truncated: {amount(held)} of the {amount(full)} the header promises"


def test_a_gguf_cut_inside_its_header_says_so(tmp_path):
    from xinfer.loading.gguf_file import GGUFFile, GGUFFormatError

    path, _ = _truncated_gguf(tmp_path, 1000)
    with pytest.raises(GGUFFormatError, match="truncated: 1,000 bytes end inside the header"):
        GGUFFile(path)


def _bad_model(tmp_path, kind: str):
    if kind == "truncated gguf":
        return _truncated_gguf(tmp_path, 0.5)[0], "truncated: "
    if kind == "empty gguf":
        (tmp_path / "empty.gguf").write_bytes(b"")
        return tmp_path / "empty.gguf", "empty file (0 bytes)"
    if kind == "not a gguf":
        (tmp_path / "text.gguf").write_text("hello, world\n")
        return tmp_path / "text.gguf", "is not a GGUF file"
    if kind == "unknown GGUF architecture":
        return _gguf_of_architecture(tmp_path / "model.gguf", "nosucharch"), "GGUF architecture 'nosucharch' is known"
    if kind == "GGUF of per-layer KV head counts that differ":
        sizes = dict(context_length=64, embedding_length=32, head_count=4, layer_norm_rms_eps=1e-6, vocab_size=8)
        path = _gguf_of_architecture(tmp_path / "model.gguf", "llama", head_count_kv=[2, 1], **sizes)
        return path, "llama.attention.head_count_kv: per-layer values [2, 1] differ"
    if kind == "GGUF without the sizes llama.cpp requires":  # (transformers' defaults must not stand in)
        missing = "llama.context_length, llama.embedding_length, llama.attention.head_count, llama.attention."
        return _gguf_of_architecture(tmp_path / "model.gguf", "llama"), f"the metadata has no {missing}layer_norm_rms"
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    weights = tmp_path / "model.safetensors"
    if kind == "config without weights":
        weights.unlink()
        return tmp_path, "has config.json but no weights: no *.safetensors file"
    if kind == "truncated safetensors":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        return tmp_path, "model.safetensors: not a readable safetensors file, truncated or corrupt"
    if kind == "index naming a missing shard":
        shard = "model-00002-of-00002.safetensors"
        index = {"weight_map": {"model.embed_tokens.weight": "model.safetensors", "lm_head.weight": shard}}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
        return tmp_path, f"{shard}: missing (model.safetensors.index.json names it)"
    config = tmp_path / "config.json"
    if kind == "invalid config.json":
        config.write_text(config.read_text()[:-20])
        return tmp_path, "config.json: not valid JSON"
    fields = json.loads(config.read_text())
    if kind == "unknown model_type":
        fields["model_type"] = "no-such-type"
        config.write_text(json.dumps(fields))
        return tmp_path, "model_type 'no-such-type' is known neither to transformers"
    if kind in CONFIG_VALUES:
        field, value, message = CONFIG_VALUES[kind]
        config.write_text(json.dumps({**fields, field: value}))
        return tmp_path, message
    fields["architectures"] = ["NoSuchForCausalLM"]
    config.write_text(json.dumps(fields))
    return tmp_path, "unknown architecture 'NoSuchForCausalLM'"


CONFIG_VALUES = {  # config.json fields transformers' config class or the model cannot take
    "a field of the wrong type": ("hidden_size", "64", "Field 'hidden_size' expected int, got str (value: '64')"),
    "zero attention heads": ("num_attention_heads", 0, "config.json: ZeroDivisionError: integer modulo by zero"),
    "no layers": ("num_hidden_layers", 0, "the config's num_hidden_layers is 0: a model has at least one layer"),
    "architectures not a list": ("architectures", "LlamaForCausalLM", "'architectures' is a list of class names"),
}


BAD = [
    "truncated gguf", "empty gguf", "not a gguf", "invalid config.json", "unknown model_type", "unknown architecture",
    "unknown GGUF architecture", "GGUF without the sizes llama.cpp requires", "GGUF of per-layer KV head counts that differ",
    "config without weights", "truncated safetensors", "index naming a missing shard",
    *CONFIG_VALUES,
]  # fmt: skip


def _gguf_of_architecture(path, architecture: str, **metadata):
    """A one-block file of ``architecture`` with one tensor and the ``metadata`` given (GGUFWriter's ``add_KEY``)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(2 if "head_count_kv" in metadata else 1)
    for key, value in metadata.items():
        getattr(writer, f"add_{key}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("kind", BAD)
def test_a_bad_model_is_one_line_naming_the_file(tmp_path, kind):
    from xinfer.loading.loader import check_model

    path, what = _bad_model(tmp_path, kind)
    with pytest.raises(ValueError) as error:
        check_model(path)
    message = str(error.value)
    assert "\n" not in message and str(path) in message and what in message


def _xinfer(*args: str, available_memory: int | None = None, unknown_model_type: str | None = None):
    """The ``xinfer`` command on the CPU; ``available_memory``: what the host's memory query says;
    ``unknown_model_type``: a model_type the installed transformers is made not to know."""
    import os
    import subprocess
    import sys

    code = "import sys; from xinfer.cli import main; sys.exit(main())"
    if available_memory is not None:
        code = f"import xinfer.engine.memory_plan as m; m.available_host_memory = lambda: {available_memory}; {code}"
    if unknown_model_type is not None:
        code = f"from transformers import CONFIG_MAPPING; del CONFIG_MAPPING._mapping[{unknown_model_type!r}]; {code}"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "XINFER_CPU": "1"})  # fmt: skip


@pytest.mark.parametrize("kind, mode", [("truncated gguf", "--i"), ("invalid config.json", "serve")])
def test_the_command_line_says_it_in_one_line_and_the_traceback_at_log_debug(tmp_path, kind, mode):
    path, what = _bad_model(tmp_path, kind)
    flags = ["--m", str(path)] + (["--i"] if mode == "--i" else ["--port", "0"])
    result = _xinfer(*flags)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"xinfer: {path}") and what in line
    debug = _xinfer(*flags, "--log", "debug")
    assert debug.returncode == 2 and "Traceback (most recent call last)" in debug.stderr and what in debug.stderr


# transformers' releases: 5.5.0 added gemma4 (and gemma4_text), 5.15.0 its per_layer_config, which xinfer-gemma reads
GEMMA4_INSTALL = 'pip install -U "transformers>=5.15.0"'


def _forget_model_type(monkeypatch, model_type: str) -> None:
    """The installed transformers made into a release older than ``model_type``."""
    from transformers import CONFIG_MAPPING

    monkeypatch.delitem(CONFIG_MAPPING._mapping, model_type)


def _gemma4_config(folder):
    (folder / "config.json").write_text(
        json.dumps({"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"]})
    )
    return folder / "config.json"


def test_a_model_type_the_installed_transformers_lacks_names_the_release_to_install(tmp_path, monkeypatch):
    import transformers

    from xinfer.loading.loader import check_model

    _forget_model_type(monkeypatch, "gemma4")
    file = _gemma4_config(tmp_path)
    with pytest.raises(ValueError) as error:
        check_model(tmp_path)
    assert str(error.value) == (
        f"{file}: model_type 'gemma4' is unknown to the installed transformers {transformers.__version__}; "
        f"xinfer reads it with transformers 5.15.0 or newer: {GEMMA4_INSTALL}"
    )


def test_a_release_that_knows_the_model_type_but_is_older_than_the_plugin_reads_names_the_release(
    tmp_path, monkeypatch
):
    from xinfer.loading import model_types
    from xinfer.loading.loader import check_model

    monkeypatch.setattr(model_types.transformers, "__version__", "5.14.0")  # the module it reads the release of
    file = _gemma4_config(tmp_path)
    with pytest.raises(ValueError) as error:
        check_model(tmp_path)
    assert str(error.value) == (
        f"{file}: model_type 'gemma4' needs transformers 5.15.0 or newer (installed: 5.14.0): {GEMMA4_INSTALL}"
    )


def test_a_gguf_whose_model_type_the_installed_transformers_lacks_names_the_release_to_install(tmp_path, monkeypatch):
    from xinfer.loading.loader import check_model

    _forget_model_type(monkeypatch, "gemma4_text")
    path = _gguf_of_architecture(tmp_path / "model.gguf", "gemma4")
    with pytest.raises(ValueError) as error:
        check_model(path)
    message = str(error.value)
    assert message.startswith(f"{path} (GGUF architecture 'gemma4'): model_type 'gemma4_text' is unknown")
    assert message.endswith(GEMMA4_INSTALL)


def test_the_command_line_names_the_transformers_release_a_model_type_needs_in_one_line(tmp_path):
    file = _gemma4_config(tmp_path)
    result = _xinfer("--m", str(tmp_path), "--i", unknown_model_type="gemma4")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"xinfer: {file}: model_type 'gemma4' is unknown")
    assert line.endswith(GEMMA4_INSTALL)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(max_model_len=2048), "max_model_len 2048 is more than the model's max_position_embeddings (512)"),
        (dict(isq="q9_9"), "isq (--isq) 'q9_9' is not a format weights can be quantized to"),
        (dict(load_format="gguf"), "load_format (--load-format) 'gguf' cannot read"),
    ],
)
def test_settings_the_model_cannot_run_with_are_refused_before_it_loads(tmp_path, settings, message):
    from xinfer.config import ModelConfig
    from xinfer.loading.loader import check_model

    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    with pytest.raises(ValueError) as error:
        check_model(tmp_path, ModelConfig(**settings))
    assert message in str(error.value)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(dtype="int4"), "unknown dtype 'int4'"),
        (dict(device="gpu0"), "unknown device 'gpu0'"),
        (dict(device="xpu"), "no backend can run device 'xpu' on this machine"),
        (dict(model="/no/such/folder"), "model '/no/such/folder' is neither a local folder"),
    ],
)
def test_bad_engine_options_raise_value_errors_naming_them(options, message):
    with pytest.raises(ValueError) as error:
        LLM(**{"dtype": "float32", **options})
    assert message in str(error.value)


def test_a_tensor_of_the_wrong_shape_is_refused_before_the_server_starts(tmp_path):
    """The files' headers give every tensor's shape: the fit check's loading on the meta device finds it, and the
    command ends in one line naming the tensor and both shapes."""
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:10]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    result = _xinfer("--m", str(tmp_path), "--port", "0")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert (
        line == "xinfer: weight model.layers.1.mlp.up_proj.weight: checkpoint shape (10, 64) != model shape (160, 64)"
    )


def test_a_server_whose_model_fails_to_load_says_why_on_its_last_line(tmp_path):
    """A GPTQ weight whose g_idx names a group beyond its scales' (a value, not a shape: found only as the weights
    load, after the server started): it exits 1, its last line naming the weight, no traceback."""
    from tests.quant.test_int4_checkpoints import write_int4_checkpoint

    write_int4_checkpoint(tmp_path, "gptq")
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.g_idx"][0] = 1000
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    result = _xinfer("--m", str(tmp_path), "--port", "0")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("xinfer: the model could not be loaded: model.layers.1.mlp.up_proj.weight: gptq tensors")


def test_the_terminal_refuses_a_model_without_a_tokenizer_before_loading_it(tmp_path, capsys):
    from xinfer.chat import run
    from xinfer.server.args import parse_args

    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    capsys.readouterr()  # the save's progress bar
    assert run(parse_args(["--m", str(tmp_path), "--cpu", "--prompts", "Hi"])) == 2
    expected = f"xinfer: {tmp_path} has no tokenizer.json; the terminal needs the model's tokenizer\n"
    assert capsys.readouterr().err == expected


def test_weights_that_run_the_device_out_of_memory_are_one_line_with_the_sizes(tmp_path, monkeypatch):
    """Where the allocator runs out as the weights load (a GPU's; here its error is raised by hand, as torch
    raises it), the error says so with the weight files' size, not the allocator's multi-line advice."""
    import torch

    import xinfer.engine.build

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nIf reserved but unallocated...")

    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    monkeypatch.setattr(xinfer.engine.build, "load_model", out_of_memory)
    with pytest.raises(ValueError) as error:
        LLM(model=str(tmp_path), dtype="float32", device="cpu")  # a device without memory statistics
    size = (tmp_path / "model.safetensors").stat().st_size / 2**30
    assert str(error.value).startswith(
        f"the model's weights do not fit in cpu's memory: it ran out loading {tmp_path} ({size:.2f} GiB of weight "
        f"files) (CUDA out of memory. Tried to allocate 2.00 GiB.): use a smaller model or quantize it at load "
        f"(--isq q4_k), or free the device"
    )  # the CPU backend's ranks would share its memory: no --d


@pytest.mark.parametrize(
    "options, remedy",
    [(dict(num_blocks=4), "raise num_blocks"), (dict(kv_fraction=1e-9), "give the cache more memory (--kv-fraction)")],
)
def test_a_cache_too_small_for_one_sequence_says_which_setting_to_change(tmp_path, options, remedy):
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    with pytest.raises(ValueError) as error:
        LLM(model=str(tmp_path), dtype="float32", device="cpu", **options)  # the CPU plans without profiling
    assert str(error.value).endswith(f"fewer than max_model_len=512: lower max_model_len (--max-model-len) or {remedy}")


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("tokenizer.json", '{"model": ', "tokenizer.json: not a tokenizer ("),
        ("tokenizer_config.json", "{not json", "tokenizer_config.json: not valid JSON: "),
    ],
)
def test_a_broken_tokenizer_file_is_a_value_error_naming_it(tmp_path, name, text, message):
    from xinfer.text.tokenizer import Tokenizer

    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}')
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError) as error:
        Tokenizer.from_folder(tmp_path)
    assert str(error.value).startswith(f"{tmp_path}/{message}") and "\n" not in str(error.value)


def test_a_tokenizer_given_as_a_path_is_read_from_there(tmp_path):
    """vLLM's LLM takes ``tokenizer`` as a path: so does ours, and a path without one is a ValueError naming it
    (it was an AttributeError at the first prompt)."""
    model, words = tmp_path / "model", tmp_path / "words"
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), model)
    words.mkdir()
    (words / "tokenizer.json").write_text(
        '{"model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1}, "unk_token": "a"}}'
    )
    llm = LLM(model=str(model), dtype="float32", num_blocks=32, tokenizer=str(words))
    assert llm.tokenizer.encode("b") == [1]
    with pytest.raises(ValueError, match=f"^tokenizer '{model}': not an HF folder holding tokenizer.json, nor a"):
        LLM(model=str(model), dtype="float32", num_blocks=32, tokenizer=str(model))


# the KV cache of one sequence of COMMON's 512 positions: K and V of each layer's KV heads (head_dim 16)
ONE_SEQUENCE_KV = 2 * COMMON["num_hidden_layers"] * COMMON["num_key_value_heads"] * 16 * 512


def mib(text: str, before: str) -> float:
    """The size in MiB written just before ``before`` in ``text``."""
    return float(text.split(before)[0].split()[-2])


@pytest.mark.parametrize("dtype, size", [("float32", 4), ("bfloat16", 2)])
def test_a_model_that_cannot_fit_is_refused_before_its_weights_load(tmp_path, monkeypatch, dtype, size):
    """With less available memory than the weights (in the dtype asked for) and one full-context sequence's KV
    cache, ``LLM`` refuses in one line giving the sizes and what is available, and never reads the weights."""
    import xinfer.engine.build
    import xinfer.engine.memory_plan

    def never(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    checkpoint = sum(t.numel() * size for t in load_file(tmp_path / "model.safetensors").values()) / 2**20
    monkeypatch.setattr(xinfer.engine.build, "load_model", never)
    monkeypatch.setattr(xinfer.engine.memory_plan, "available_host_memory", lambda: 2**18)
    with pytest.raises(ValueError) as error:
        LLM(model=str(tmp_path), dtype=dtype)
    message = str(error.value)
    assert "\n" not in message and message.startswith("the model does not fit in cpu's memory: its weights take ")
    weights = mib(message, " and the KV cache")
    rotary = 512 * 16 * 4 / 2**20  # the model's buffer of each position's cos and sin (float32)
    assert checkpoint - 0.006 <= weights <= checkpoint + rotary + 0.006  # sizes printed to 0.01 MiB
    assert f"the KV cache of one 512-token sequence {ONE_SEQUENCE_KV * size / 2**20:.2f} MiB" in message
    assert "and 0.25 MiB are available" in message


def test_a_model_that_just_fits_loads(tmp_path, monkeypatch):
    import xinfer.engine.memory_plan

    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    needed = []
    check = xinfer.engine.memory_plan.check_fits

    def checking(model, *args):
        needed.append(xinfer.engine.memory_plan.tensor_bytes(model) + ONE_SEQUENCE_KV * 4)
        check(model, *args[:-3], needed[-1], *args[-2:])  # exactly what it needs available
        with pytest.raises(ValueError, match="does not fit"):
            check(model, *args[:-3], needed[-1] - 1, *args[-2:])

    monkeypatch.setattr(xinfer.engine.build, "check_fits", checking)
    LLM(model=str(tmp_path), dtype="float32", num_blocks=32)
    assert needed


def test_the_command_line_refuses_a_model_that_cannot_fit_in_one_line(tmp_path):
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    result = _xinfer("--m", str(tmp_path), "--port", "0", available_memory=1 << 19)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("xinfer: the model does not fit in cpu's memory: its weights take ")
    assert "and 0.50 MiB are available" in line


def test_dtype_auto_says_when_it_runs_the_checkpoint_in_another_dtype(tmp_path, caplog):
    """On the CPU auto runs a bf16 checkpoint in fp32 (vLLM logs its casts; transformers keeps bf16): said in one
    line, not only in --help."""
    import logging

    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    with caplog.at_level(logging.INFO, logger="xinfer"):
        LLM(model=str(tmp_path), num_blocks=64)
    assert "dtype auto: the checkpoint's bfloat16 runs as float32 on the cpu (--dtype sets another)" in caplog.text


def test_a_folder_with_a_slow_tokenizer_only_says_it_and_text_matching_options_are_refused(tmp_path, caplog):
    """A folder with tokenizer.model and no tokenizer.json started without a tokenizer and without a word (text
    prompts failed later); stop strings were taken and never matched (bad_words were refused)."""
    import logging

    from xinfer import SamplingParams

    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"sentencepiece")
    with caplog.at_level(logging.WARNING, logger="xinfer"):
        llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=64)
    assert f"{tmp_path} has no tokenizer.json (xinfer does not read tokenizer.model)" in caplog.text
    for options in (dict(stop=["ab"]), dict(bad_words=["ab"])):
        with pytest.raises(ValueError, match="need the model's tokenizer: this model has none"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, **options), use_tqdm=False)
