"""Bad command-line input and bad ``LLM(...)`` arguments: refused at once in one line naming what is wrong
(tests/server/test_cli.py has the rest)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from xinfer import LLM
from xinfer.config import EngineConfig
from xinfer.loading.resolve import ModelNotFoundError, resolve_model_path
from xinfer.server.args import parse_args
from xinfer.server.launch import engine_config, listeners, one_line, prepare


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line ``xinfer argv`` is refused with (before anything loads)."""
    with pytest.raises(SystemExit) as exit_:
        prepare(parse_args(argv))
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("flag", ["--shutdown-timeout", "--health-stall-timeout", "--mcp-timeout", "--pd-timeout"])
def test_a_nan_duration_is_refused(flag, capsys):
    """nan compares false with everything, so a bare ``value < minimum`` let it through."""
    with pytest.raises(SystemExit) as exit_:
        parse_args([flag, "nan"])
    assert exit_.value.code == 2 and f"argument {flag}: must be at least" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["kv_fraction", "mamba_fraction"])
def test_a_nan_fraction_is_refused_as_not_finite(field):
    """nan failed the upper bound's check, with "should be less than or equal to 1"."""
    with pytest.raises(ValueError, match=f"{field}\n.*finite number"):
        LLM(model="/no/such/model", **{field: float("nan")})


def test_a_nan_kv_fraction_is_one_line_naming_the_flag(capsys):
    assert (
        refused(["--kv-fraction", "nan", "--cpu"], capsys)
        == "xinfer: --kv-fraction nan: input should be a finite number"
    )


@pytest.mark.parametrize("seed", [str(2**64), str(-(2**63) - 1)])
def test_a_seed_torch_cannot_take_is_refused_naming_the_flag(seed):
    """It failed only once the server was up: "the model could not be loaded: Overflow when unpacking long long"."""
    with pytest.raises(ValidationError) as error:
        engine_config(parse_args(["--seed", seed, "--cpu"]), Path("model"))
    assert one_line(error.value).startswith(f"--seed {seed}: input should be")
    with pytest.raises(ValueError, match="seed"):
        LLM(model="/no/such/model", seed=int(seed))


def test_the_widest_seeds_are_taken():
    for seed in (2**64 - 1, -(2**63)):
        assert EngineConfig.from_kwargs(seed=seed).model.seed == seed


@pytest.mark.parametrize("field", ["max_model_len", "seed", "kv_fraction", "max_num_seqs", "dtype"])
def test_a_bool_is_not_taken_for_a_number_or_a_name(field):
    """pydantic's lax mode read ``LLM(max_model_len=True)`` as a context of 1 token."""
    with pytest.raises(ValueError, match=f"{field}\n.*must be .*, got True"):
        LLM(model="/no/such/model", **{field: True})
    assert EngineConfig.from_kwargs(enforce_eager=True).device.enforce_eager is True


def test_an_empty_model_is_refused_instead_of_reading_the_working_directory(capsys, monkeypatch):
    """``--m ""`` (or ``XINFER_MODEL=``) said ". has neither config.json nor a .gguf file"."""
    assert refused(["--m", ""], capsys) == (
        "xinfer: model '' is empty: give a hub id (org/name), an HF folder or a .gguf file"
    )
    monkeypatch.setenv("XINFER_MODEL", "")
    assert refused([], capsys).startswith("xinfer: model '' is empty")
    with pytest.raises(ModelNotFoundError, match="is empty"):
        LLM(model="")


def test_a_missing_f_file_is_named_as_f(tmp_path, capsys):
    """It said "model '<folder>/x.gguf' is neither a local folder, a .gguf file nor a hub id"."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    assert refused(["--m", str(tmp_path), "--f", "x.gguf"], capsys) == (
        f"xinfer: --f x.gguf: no such file in {tmp_path} (its .gguf files: a.gguf)"
    )
    file = tmp_path / "a.gguf"
    assert refused(["--m", str(file), "--f", "x.gguf"], capsys) == (
        f"xinfer: --f x.gguf picks a file inside a folder, and {file} is a file: give it alone"
    )
    assert resolve_model_path(str(tmp_path), "a.gguf") == file  # the file that is there is still picked
    assert "'/no/such/dir' is neither" in refused(["--m", "/no/such/dir", "--f", "x.gguf"], capsys)


def test_a_ui_port_that_is_the_api_port_is_named(capsys):
    """It said "Address already in use; another process listens there": the clash is the command's own two ports."""
    with pytest.raises(SystemExit) as exit_:
        listeners(parse_args(["--ui-server", "--port", "8102", "--ui-port", "8102"]))
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "xinfer: --ui-port 8102 is the API's --port: the chat UI needs a port of its own"
    )


CONFIG_REFUSALS = {
    # transformers' own check of the rope parameters raises a KeyError
    "llama3 rope without low_freq_factor": (
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 16}},
        "config.json: Missing required keys in `rope_parameters` for 'rope_type'='llama3': {'low_freq_factor'}",
    ),
    # xinfer's refusals of values it does not serve (NotImplementedError)
    "unknown rope type": ({"rope_parameters": {"rope_type": "foo", "rope_theta": 1e4}}, "rope_type 'foo' is not"),
    "unknown activation": ({"hidden_act": "prelu"}, "hidden_act 'prelu' is not supported"),
    # transformers divides by zero building the model; NaN logits for the next two
    "yarn at base 1": (
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 4.0}},
        "rope_theta 1.0 with rope_type 'yarn' is not supported",
    ),
    "base 0": ({"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}}, "rope_theta 0.0 with rope_type"),
    "linear factor 0": (
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 0.0}},
        "rope_parameters factor 0.0 with rope_type 'linear' is not supported",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CONFIG_REFUSALS))
def test_a_config_value_not_served_is_one_line(tmp_path, capsys, case):
    """Refusals other than ValueErrors ended the command in a traceback."""
    import json

    from transformers import LlamaConfig

    from tests.tiny_models import COMMON, save_tiny_model

    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    edit, message = CONFIG_REFUSALS[case]
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    capsys.readouterr()  # (transformers' progress bar)
    assert message in refused(["--m", str(tmp_path), "--cpu"], capsys)


@pytest.mark.parametrize("flag", ["--hf-overrides", "--mm-processor-kwargs"])
@pytest.mark.parametrize("text, message", [("{rope", "not valid JSON"), ("[1]", "expected a JSON object of fields")])
def test_json_flags_that_are_not_a_json_object_are_refused(flag, text, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args([flag, text])
    assert exit_.value.code == 2 and f"argument {flag}: {message}" in capsys.readouterr().err


def test_hf_overrides_and_mm_processor_kwargs_reach_the_model_config():
    config = engine_config(
        parse_args(["--hf-overrides", '{"rope_scaling": {"rope_type": "yarn"}}', "--mm-processor-kwargs",
                    '{"max_pixels": 802816}', "--cpu"]), Path("m"),
    )  # fmt: skip
    assert config.model.hf_overrides == {"rope_scaling": {"rope_type": "yarn"}}
    assert config.model.mm_processor_kwargs == {"max_pixels": 802816}
