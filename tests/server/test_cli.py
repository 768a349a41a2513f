"""The xinfer command line, without loading a model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.live import REPO
from xinfer.config import CacheConfig
from xinfer.server.args import build_parser, parse_args
from xinfer.server.launch import engine_config

ISSUE_FLAGS = [
    "--m",
    "--model",
    "--w",
    "--f",
    "--d",
    "--dtype",
    "--cpu",
    "--kvcache-dtype",
    "--max-num-seqs",
    "--max-model-len",
    "--max-tokens",
    "--kv-fraction",
    "--prefill-chunk-size",
    "--disable-prefix-cache",
    "--disable-cuda-graph",
    "--temperature",
    "--top-k",
    "--top-p",
    "--frequency-penalty",
    "--presence-penalty",
    "--seed",
    "--host",
    "--port",
    "--ui-server",
    "--api-key",
    "--i",
    "--isq",
    "--num-speculative-tokens",
    "--draft-model",
    "--pd-server",
    "--pd-client",
    "--pd-url",
    "--mcp-config",
    "--mcp-command",
    "--mcp-args",
    "--enforce-parser",
    "--max-waiting",
    "--shutdown-timeout",
    "--mamba-fraction",
    "--state-snapshot-interval",
]


def xinfer(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    code = "import sys; from xinfer.cli import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_help_lists_every_flag():
    result = xinfer("--help")
    assert result.returncode == 0
    for flag in ISSUE_FLAGS:
        assert flag in result.stdout, flag


@pytest.mark.parametrize(
    "flags, feature",
    [
        (["--num-speculative-tokens", "2"], "speculative"),
    ],
)
def test_later_features_are_refused_in_one_line(flags, feature):
    result = xinfer(*flags)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and feature in lines[0] and "not available yet" in lines[0], result.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-nodes", "2"], "give --master-port"),
        (["--num-nodes", "2", "--node-rank", "2", "--master-port", "29500"], "--node-rank 2 is not one of the 2"),
        (["--d", "0,0"], "distinct device ids"),
        (["--pd-client"], "--pd-client needs --pd-url"),
        (["--pd-server", "--pd-client", "--pd-url", "http://x"], "a server takes one role"),
        (["--pd-server", "--disable-prefix-cache"], "need the prefix cache"),
        (["--d", "gpu0"], "device ids such as 0 or 0,1"),
    ],
)
def test_bad_parallel_flags_are_refused(flags, message):
    result = xinfer(*flags)
    assert result.returncode == 2
    assert message in result.stderr.strip().splitlines()[-1], result.stderr


def test_plugins_lists_name_version_hooks_and_registrations():
    result = xinfer("plugins")
    assert result.returncode == 0
    assert "llama" in result.stdout and "hooks: xinfer_architectures" in result.stdout
    assert "LlamaForCausalLM" in result.stdout and "GGUF architectures: llama, phi3" in result.stdout
    assert "backends: cpu (available)" in result.stdout
    import torch

    cuda = "available" if torch.cuda.is_available() else "unavailable"
    assert f"backends: cuda ({cuda})" in result.stdout


def test_plugins_json_into_a_closed_pipe_ends_quietly():
    code = "import sys; from xinfer.cli import main; sys.exit(main())"
    reader_gone = subprocess.Popen([sys.executable, "-c", code, "plugins", "--json"], cwd=REPO,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    reader_gone.stdout.close()  # as `| head` does once it has its lines, here before the first one
    assert reader_gone.wait(timeout=120) == 0
    assert reader_gone.stderr.read() == b""


def test_environment_sets_flags_and_the_command_line_wins(monkeypatch):
    monkeypatch.setenv("XINFER_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("XINFER_PORT", "9000")
    monkeypatch.setenv("XINFER_CPU", "yes")
    monkeypatch.setenv("XINFER_MODEL", "/models/a.gguf")
    monkeypatch.setenv("XINFER_API_KEY", "sk-env")
    args = parse_args(["--port", "9100"])
    assert (args.max_num_seqs, args.port, args.cpu, args.model, args.api_key) == (
        8,
        9100,
        True,
        "/models/a.gguf",
        "sk-env",
    )
    assert parse_args(["--m", "/models/b"]).model == "/models/b"


def test_bad_environment_values_are_one_clear_error():
    result = xinfer(env={"XINFER_MAX_NUM_SEQS": "many"})
    assert result.returncode == 2 and "XINFER_MAX_NUM_SEQS='many'" in result.stderr
    result = xinfer(env={"XINFER_CPU": "maybe"})
    assert result.returncode == 2 and "XINFER_CPU" in result.stderr


def test_defaults_match_xinfer():
    args = build_parser().parse_args([])
    assert args.port == 8000 and args.prefill_chunk_size == 8192 and args.model is None
    assert not args.disable_prefix_cache and not args.ui_server


@pytest.mark.parametrize("flag, value", [("--max-model-len", "-5"), ("--max-num-seqs", "0")])
def test_an_engine_value_out_of_range_is_one_line_naming_the_flag(flag, value):
    result = xinfer(flag, value)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"xinfer: {flag} {value}: ") and "greater than 0" in lines[0], lines


def test_a_missing_model_file_is_one_line():
    result = xinfer("--m", "/no/such/model.gguf")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "/no/such/model.gguf" in result.stderr


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--max-waiting", "0"),
        ("--shutdown-timeout", "-1"),
        ("--max-body-bytes", "0"),
        ("--health-stall-timeout", "-5"),
    ],
)
def test_out_of_range_server_values_are_refused(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args([flag, value])
    assert exit_.value.code == 2 and f"{flag}: must be at least" in capsys.readouterr().err
    env_name = "XINFER_" + flag.lstrip("-").upper().replace("-", "_")
    result = xinfer(env={env_name: value})
    assert result.returncode == 2 and f"{env_name}={value!r}: must be at least" in result.stderr


def test_recurrent_state_flags_reach_the_engine_config():
    """--mamba-fraction and --state-snapshot-interval set the cache options LLM takes by the
    same names (tests/cache/test_cache_kinds.py checks the plan they give)."""
    default = engine_config(parse_args([]), Path("model")).cache
    assert (default.mamba_fraction, default.state_snapshot_interval) == (
        CacheConfig().mamba_fraction,
        CacheConfig().state_snapshot_interval,
    )
    given = engine_config(parse_args(["--mamba-fraction", "0.3", "--state-snapshot-interval", "256"]), Path("m")).cache
    assert (given.mamba_fraction, given.state_snapshot_interval) == (0.3, 256)


@pytest.mark.parametrize(
    "flag, value, error",
    [
        ("--mamba-fraction", "0", "must be between 0 and 1"),
        ("--mamba-fraction", "1", "must be between 0 and 1"),
        ("--mamba-fraction", "-0.5", "must be between 0 and 1"),
        ("--mamba-fraction", "half", "invalid float value"),
        ("--state-snapshot-interval", "0", "must be at least 1"),
    ],
)
def test_bad_recurrent_state_values_are_refused(flag, value, error, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args([flag, value])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and flag in lines[-1] and error in lines[-1]
