"""The xinfer command line, without loading a model."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_pages import DOCS, code_blocks, inline_code
from tests.server.live import REPO
from xinfer.cli import main, plugins_parser
from xinfer.config import CacheConfig, SchedulerConfig
from xinfer.server.args import build_parser, flags_problem, parse_args
from xinfer.server.launch import engine_config, listeners

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


@pytest.mark.parametrize("command", [[], ["serve"], ["chat"], ["plugins"]], ids=["xinfer", "serve", "chat", "plugins"])
def test_each_command_has_its_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith(f"usage: {' '.join(['xinfer', *command])} [-h]"), out[:200]
    if command != ["plugins"]:
        assert all(f"xinfer {name}" in out for name in ("[serve]", "chat", "plugins [--json]")), out[-800:]


def test_an_unknown_command_is_one_line(capsys):
    assert main(["srve", "--m", "model.gguf"]) == 2
    assert (
        capsys.readouterr().err
        == "xinfer: unknown command 'srve': choose one of serve, chat, plugins (xinfer --help)\n"
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


@pytest.mark.parametrize("flag", ["--num-speculative-tokens", "--draft-model", "--prefix-cache-max-tokens"])
def test_each_later_flag_is_refused_naming_itself(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args([flag, "3"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1 and lines[0].startswith(f"xinfer: {flag} ("), lines
    assert lines[0].endswith("is not available yet in this version of xinfer"), lines


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


def test_plugins_says_when_xinfer_plugins_names_none_installed():
    result = xinfer("plugins", env={"XINFER_PLUGINS": "nosuch"})
    assert result.returncode == 0
    assert (
        result.stdout
        == "no plugin loaded: XINFER_PLUGINS=nosuch names none of those installed (unset it to list them)\n"
    )
    assert "XINFER_PLUGINS names 'nosuch', which is not installed (installed: " in result.stderr


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


def test_a_list_flag_from_the_environment_is_split_into_its_values(monkeypatch):
    """``--allowed-origins A B`` as ``XINFER_ALLOWED_ORIGINS``: separated by spaces or commas (it was split into
    characters)."""
    monkeypatch.setenv("XINFER_ALLOWED_ORIGINS", "https://a.com, https://b.org")
    assert parse_args([]).allowed_origins == ["https://a.com", "https://b.org"]
    monkeypatch.setenv("XINFER_ALLOWED_ORIGINS", "")
    assert parse_args([]).allowed_origins == []


def test_bad_environment_values_are_one_clear_error():
    result = xinfer(env={"XINFER_MAX_NUM_SEQS": "many"})
    assert result.returncode == 2 and "XINFER_MAX_NUM_SEQS='many'" in result.stderr
    result = xinfer(env={"XINFER_CPU": "maybe"})
    assert result.returncode == 2 and "XINFER_CPU" in result.stderr


def test_defaults_match_xinfer():
    """The server's defaults are the engine's (EngineConfig) and the README's (http://127.0.0.1:8000/v1)."""
    args = build_parser().parse_args([])
    assert args.port == 8000 and args.prefill_chunk_size == SchedulerConfig().max_num_batched_tokens
    assert args.model is None and args.disable_prefix_cache is not CacheConfig().enable_prefix_caching
    assert not args.ui_server


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


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--dtype", "int4"], "argument --dtype: invalid choice: 'int4'"),
        (["--kvcache-dtype", "fp9"], "argument --kvcache-dtype: invalid choice: 'fp9'"),
        (["--port", "70000"], "argument --port: must be a port from 0 to 65535, got 70000"),
        (["--port", "-1"], "argument --port: must be a port from 0 to 65535, got -1"),
        (["--master-port", "0"], "argument --master-port: must be a port from 1 to 65535, got 0"),
        (["--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value: 'many'"),
        (["--prefill-chunk-size", "0"], "argument --prefill-chunk-size: must be at least 1, got 0"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype is vLLM's flag: give --kvcache-dtype"),
        (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization is vLLM's flag: give --kv-fraction"),
        (["--max-modle-len", "4096"], "did you mean --max-model-len?"),
        (["serve", "--temprature", "0"], "did you mean --temperature?"),
        (["plugins", "--jsn"], "did you mean --json?"),
    ],
)
def test_a_flag_error_is_one_line_naming_the_flag(argv, expected, capsys):
    """argparse prints its whole usage, dozens of lines, before the error: xinfer prints the error alone."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    prog = "xinfer serve" if argv[0] == "serve" else "xinfer plugins" if argv[0] == "plugins" else "xinfer"
    assert exit_.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"{prog}: ") and expected in lines[0] and lines[0].endswith(f"(see {prog} --help)")


def test_a_port_in_use_or_a_host_not_here_is_one_line_before_the_model_loads(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            listeners(parse_args(["--port", str(port)]))
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err == (
            f"xinfer: cannot listen on 127.0.0.1:{port}: Address already in use; another process listens there "
            "(choose another --port)\n"
        )
        with pytest.raises(SystemExit) as exit_:  # the chat UI's port: the flag to change is --ui-port
            listeners(parse_args(["--port", "0", "--ui-server", "--ui-port", str(port)]))
        assert exit_.value.code == 2 and capsys.readouterr().err.endswith("(choose another --ui-port)\n")
    with pytest.raises(SystemExit) as exit_:
        listeners(parse_args(["--host", "999.1.1.1"]))
    (line,) = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and line.startswith("xinfer: --host 999.1.1.1: not an address to listen on")


def test_port_0_listens_on_a_free_port_for_the_api_and_the_ui():
    groups = listeners(parse_args(["--port", "0", "--ui-server"]))
    try:
        ports = [group[0].getsockname()[1] for group in groups]
        assert len(ports) == 2 and 0 not in ports and ports[0] != ports[1]
        with socket.create_connection(("127.0.0.1", ports[0]), timeout=5):
            pass  # listening: a connection is taken
    finally:
        for sock in (sock for group in groups for sock in group):
            sock.close()


def test_ctrl_c_while_the_model_loads_ends_in_one_line_without_a_traceback(monkeypatch, capsys):
    """Ctrl+C raises KeyboardInterrupt wherever the terminal's engine is (here as it is built); the server
    handles SIGINT itself (tests/server/test_lifecycle.py)."""
    import xinfer.chat

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(xinfer.chat, "LLMEngine", interrupted)
    assert main(["--prompts", "Hi", "--cpu"]) == 130
    assert capsys.readouterr().err.endswith("\nxinfer: interrupted\n")
    assert xinfer.chat.main(["--cpu"]) == 130  # python -m xinfer.chat
    assert capsys.readouterr().err.endswith("\nxinfer: interrupted\n")


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--temperature", "-1"], "--temperature -1.0: temperature must be >= 0, got -1.0"),
        (["--top-p", "0"], "--top-p 0.0: top_p must be in (0, 1], got 0.0"),
        (["--top-k", "-2"], "--top-k -2: top_k must be -1, 0 (off) or positive, got -2"),
        (["--max-tokens", "0"], "--max-tokens 0: max_tokens must be at least 1, got 0"),
        (["--frequency-penalty", "2.5"], "--frequency-penalty 2.5: frequency_penalty must be in [-2, 2], got 2.5"),
        (["--repetition-penalty", "0"], "--repetition-penalty 0.0: repetition_penalty must be > 0, got 0.0"),
        (
            ["--generation-config", "/no/such"],
            "--generation-config '/no/such': not a folder; 'auto' (the model's "
            "folder), 'none' (vLLM's 'vllm') or a folder holding one",
        ),
        (["--prompts", " | "], "--prompts holds no prompt (prompts are separated by |)"),
    ],
)
def test_sampling_defaults_out_of_range_and_no_prompts_are_refused_before_loading(argv, line, capsys):
    """A default every request would be refused for (400), or a --prompts with none: refused at once."""
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2 and capsys.readouterr().err == f"xinfer: {line}\n"


def test_batch_without_prompts_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--batch", "4"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "xinfer: --batch copies the prompts of --prompts: give --prompts too\n"
    assert parse_args(["--prompts", "Hi", "--batch", "4"]).batch == 4


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


# The flags the docs use, against the parsers (no model is loaded).
FLAG = re.compile(r"--[a-z][a-z0-9-]*")
SCRIPT = re.compile(r"(?:^|/)(\w+\.py)$")
OTHER_PROGRAMS = {"pip", "git", "make", "pytest"}


def doc_commands(text: str) -> list[str]:
    """Each line of the page's shell blocks (continuations joined, comments cut) and each inline code span,
    split at ``;`` and ``&&``."""
    commands = []
    for body in code_blocks(text, ("bash", "sh", "")):
        commands += [line.split(" #", 1)[0] for line in body.replace("\\\n", " ").splitlines()]
    commands += inline_code(text)
    return [part.strip() for command in commands for part in re.split(r" ?(?:;|&&) ", command)]


def words_of(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:  # a span quoting half a command
        return command.split()


def script_flags(name: str) -> set[str] | None:
    """A benchmark script's flags, as its source spells them (``"--tokens"``; ``f"--{name}"`` loops: ``"fp8"``)."""
    path = REPO / "benchmarks" / name
    if not path.is_file():
        return None
    source = path.read_text()
    quoted = set(re.findall(r"[\"'](--[a-z][a-z0-9-]*)[\"'=]", source))
    if 'f"--{' not in source:
        return quoted
    return quoted | {f"--{word}" for word in re.findall(r"[\"']([a-z][a-z0-9-]*)[\"']", source)}


def xinfer_flags() -> set[str]:
    parsers = (build_parser(), plugins_parser())
    return {option for parser in parsers for action in parser._actions for option in action.option_strings}


def flags_of(words: list[str]) -> list[str]:
    return [word.split("=", 1)[0] for word in words if FLAG.fullmatch(word.split("=", 1)[0])]


def doc_flag_problems(doc: Path) -> list[str]:
    """Flags a page uses that its command lacks, and xinfer command lines that do not parse."""
    text, known, problems = doc.read_text(), xinfer_flags(), []
    scripts = {name: flags for name in set(re.findall(r"\b(\w+\.py)\b", text)) if (flags := script_flags(name))}
    for command in doc_commands(text):
        words = words_of(command)
        if not words or words[0] in OTHER_PROGRAMS or ("--" not in command and words[0] != "xinfer"):
            continue
        at = next((i for i, word in enumerate(words) if (m := SCRIPT.search(word)) and m.group(1) in scripts), None)
        if at is not None:  # a benchmark's command line
            script = SCRIPT.search(words[at]).group(1)  # type: ignore[union-attr]
            problems += [f"{flag} is not a flag of {script}: {command}" for flag in flags_of(words[at + 1 :])
                         if flag not in scripts[script]]  # fmt: skip
            continue
        # xinfer's, or a bare flag: xinfer's, or one of a benchmark this page names (kv-cache.md's --formats)
        allowed = known.union(*scripts.values())
        problems += [f"{flag} is not a flag of xinfer: {command}" for flag in flags_of(words) if flag not in allowed]
        if words[0] == "xinfer" and not {"-h", "--help", "plugins"} & set(words):
            problems += [f"{problem}: {command}" for problem in xinfer_parse_problems(words[1:])]
    return problems


def xinfer_parse_problems(argv: list[str]) -> list[str]:
    parser = build_parser()
    parser.exit_on_error = False
    try:
        args, unknown = parser.parse_known_args(argv[1:] if argv[:1] in (["serve"], ["chat"]) else argv)
    except argparse.ArgumentError as error:
        return [f"does not parse ({error})"]
    if unknown:
        return [f"does not parse ({' '.join(unknown)})"]
    problem = flags_problem(args)
    return [problem] if problem else []


@pytest.mark.parametrize("doc", DOCS, ids=[doc.name for doc in DOCS])
def test_every_flag_the_docs_use_is_a_flag_of_its_command(doc):
    assert doc_flag_problems(doc) == []


def test_the_doc_check_finds_a_flag_that_does_not_exist(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\nxinfer --m a --ui-server\nxinfer --kvcache-type fp8   # a typo\n```\n"
        "Prose with `--max-num-seq 8`, `--kvcache-dtype turbo9` and `--pd-client` alone.\n"
        "`python benchmarks/offline.py --shape smollm2-135m --no-such-flag`\n"
    )
    problems = doc_flag_problems(page)
    assert [p.split(":")[0] for p in problems] == [
        "--kvcache-type is not a flag of xinfer",
        "does not parse (--kvcache-type fp8)",
        "--max-num-seq is not a flag of xinfer",
        "--no-such-flag is not a flag of offline.py",
    ]
    assert xinfer_parse_problems(["--kvcache-dtype", "turbo9"]) != []
    assert xinfer_parse_problems(["--pd-client"]) == [
        "--pd-client needs --pd-url (the prefill server), and --pd-url needs --pd-client"
    ]


@pytest.mark.parametrize("parser", [build_parser(), plugins_parser()], ids=["xinfer", "xinfer plugins"])
def test_every_flag_has_a_help_text(parser):
    for action in parser._actions:
        assert action.help and action.help is not argparse.SUPPRESS and len(action.help) > 10, action.option_strings


def test_python_m_xinfer_server_is_xinfer_itself():
    """``python -m xinfer.server --prompts ...`` answers the prompts (it started a server, ignoring them)."""
    result = subprocess.run(
        [sys.executable, "-m", "xinfer.server", "--prompts", "Hi", "--max-tokens", "2", "--max-model-len", "128"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("[0] Hi\n") and "1 requests, 2 tokens" in result.stdout


def test_no_backend_loaded_is_one_line_naming_xinfer_plugins():
    result = xinfer("--max-model-len", "64", env={"XINFER_PLUGINS": "llama"})
    assert result.returncode == 2
    assert result.stderr == "xinfer: no backend plugin is loaded: XINFER_PLUGINS=llama names none\n"
