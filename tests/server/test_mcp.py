"""MCP servers through the official SDK: an MCP stdio server written in the tests with the
SDK's server side (tests/server/mcp_server.py), exercised through xinfer's connections (tools,
a tool's own error, a crash mid-call, a hang mid-call, one that never answers, one that exits)
and end to end through a live server with the official anthropic client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import openai
import pytest

from tests.server.live import REPO, LiveServer
from xinfer.server.mcp.chat import mcp_items
from xinfer.server.mcp.client import MCPHub, MCPUnavailable
from xinfer.server.mcp.config import ServerSpec, read_config, server_specs
from xinfer.server.mcp.loop import RanCall
from xinfer.server.messages.convert import chat_messages
from xinfer.server.messages.protocol import CountTokensRequest
from xinfer.server.tools import Call

SERVER = str(Path(__file__).with_name("mcp_server.py"))
TIMEOUT_S = 8.0  # a Python MCP server starts in a few seconds on a busy 2-core machine


def spec(name: str, mode: str = "tools") -> ServerSpec:
    return ServerSpec(name, sys.executable, [SERVER, mode])


def test_servers_from_the_flags_and_claude_desktops_config(tmp_path):
    config = tmp_path / "mcp.json"
    python = sys.executable  # a program that is there (each command is looked for at start-up)
    servers = {"calc": {"command": python, "args": ["calc.py"], "env": {"X": "1"}}, "fs": {"command": python}}
    config.write_text(json.dumps({"mcpServers": servers}))
    specs = server_specs(python, "server.js --port 'a b'", str(config))
    assert specs == [
        ServerSpec("calc", python, ["calc.py"], {"X": "1"}),
        ServerSpec("fs", python, []),
        ServerSpec("mcp", python, ["server.js", "--port", "a b"]),
    ]


def test_a_server_program_that_is_not_there_is_refused_at_start_up(tmp_path):
    with pytest.raises(ValueError, match=r"^--mcp-command: no program 'no-such-mcp-server' \(not a path to one"):
        server_specs("no-such-mcp-server", None, None)
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"fs": {"command": "/no/such/fs-server"}}}))
    with pytest.raises(ValueError, match=r"mcpServers\.fs\.command: no program '/no/such/fs-server'"):
        server_specs(None, None, str(config))


@pytest.mark.parametrize(
    ("content", "named"),
    [
        (None, "cannot be read"),
        ("{not json", "not valid JSON"),
        ('{"servers": {}}', "mcpServers"),
        ('{"mcpServers": {"web": {"url": "http://x"}}}', "only stdio servers"),
        ('{"mcpServers": {"a": {"command": "x", "args": "y"}}}', "args must be a list"),
        ('{"mcpServers": {"a": {"command": "x", "env": {"K": 1}}}}', "env must map"),
        ('{"mcpServers": {"a": {"command": "no-such-program"}}}', "no program 'no-such-program'"),
    ],
)
def test_a_bad_config_is_one_line_naming_the_problem(tmp_path, content, named):
    path = tmp_path / "mcp.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=named):
        read_config(path)
    code = "import sys; from xinfer.cli import main; sys.exit(main())"
    result = subprocess.run([sys.executable, "-c", code, "--mcp-config", str(path)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and named in lines[0], result.stderr


def test_a_non_utf8_config_an_unbalanced_quote_and_an_empty_command_are_named(tmp_path):
    """A config file that is not UTF-8 and an unbalanced quote in --mcp-args gave lines naming no flag; an empty
    --mcp-command started the server without MCP, without a word."""
    path = tmp_path / "mcp.json"
    path.write_bytes(b'\xff\xfe{"mcpServers": {}}')
    with pytest.raises(ValueError, match=rf"^--mcp-config {path}: not UTF-8 text$"):
        read_config(path)
    with pytest.raises(ValueError, match=r"^--mcp-args \"'unbalanced\": no closing quotation"):
        server_specs(sys.executable, "'unbalanced", None)
    with pytest.raises(ValueError, match=r"^--mcp-command: empty"):
        server_specs("", None, None)


def test_a_tool_no_model_can_call_is_left_out_with_a_warning_and_the_others_offered(caplog):
    """MCP allows tool names of 128 characters, OpenAI's function tools 64: such a tool, offered, made every
    request asking for its server's tools a 400 blaming the client."""
    import logging

    from mcp.types import Tool

    from xinfer.server.mcp.client import usable_tools

    long_name, schema = "t" * 70, {"type": "object", "properties": {"a": {"type": "integer"}}}
    tools = [Tool(name=long_name, input_schema=schema), Tool(name="add", input_schema=schema)]
    with caplog.at_level(logging.WARNING, logger="xinfer"):
        assert [tool.name for tool in usable_tools("calc", tools)] == ["add"]
    assert f"MCP server 'calc': tool '{long_name}' left out" in caplog.text


def test_calls_crashes_and_hangs():
    async def scenario():
        hub = MCPHub([spec("tools")], TIMEOUT_S)
        server = hub.servers["tools"]
        try:
            tools = await hub.tools(hub.check_names(None))
            tools_listed = {"add", "shout", "refuse", "crash", "hang", "wait", "slow", "pid", "flood", "contents"}
            assert set(tools) == tools_listed | {"structured"}
            assert tools["add"][1].input_schema["required"] == ["a", "b"]
            assert (await server.call("add", {"a": 2, "b": 3})).text == "5"
            assert (await server.call("contents", {})).text.splitlines() == [
                "before", "[image: image/png]", "[audio: audio/wav]", "noted",
                "[resource link: report.pdf file:///report.pdf]", "after",
            ]  # fmt: skip
            assert json.loads((await server.call("structured", {})).text) == {"city": "Paris", "temp_c": 21}
            refused = await server.call("refuse", {"reason": "no"})
            assert refused.is_error and "refused: no" in refused.text
            with pytest.raises(MCPUnavailable, match="closed the connection while calling 'crash'") as crashed:
                await server.call("crash", {})
            assert not crashed.value.timed_out
            assert (await server.call("shout", {"text": "back"})).text == "BACK"  # restarted
            pid = (await server.call("pid", {})).text
            started = time.monotonic()
            hang = asyncio.create_task(server.call("hang", {}))
            await asyncio.sleep(TIMEOUT_S - 2)
            # another request's call, still running when the hanging one times out: that one fails alone
            assert (await server.call("wait", {"seconds": 3})).text == "waited"
            with pytest.raises(MCPUnavailable, match=r"did not answer the call of 'hang' within 8 s") as hung:
                await hang
            assert hung.value.timed_out and time.monotonic() - started < TIMEOUT_S + 10
            assert (await server.call("pid", {})).text == pid  # the same process
            assert (await server.call("add", {"a": 1, "b": 1})).text == "2"
        finally:
            await hub.close()

    asyncio.run(scenario())


def test_a_server_that_died_while_idle_is_started_again_before_the_call():
    async def scenario():
        hub = MCPHub([spec("tools")], TIMEOUT_S)
        server = hub.servers["tools"]
        try:
            pid = int((await server.call("pid", {})).text)
            os.kill(pid, signal.SIGKILL)
            for _ in range(50):  # until the transport has seen the process's stdout end
                if not server.connected:
                    break
                await asyncio.sleep(0.1)
            assert not server.connected
            assert int((await server.call("pid", {})).text) != pid
        finally:
            await hub.close()

    asyncio.run(scenario())


def test_servers_that_never_answer_or_exit():
    async def scenario():
        hub = MCPHub([spec("silent", "silent"), spec("gone", "exit")], TIMEOUT_S)
        try:
            with pytest.raises(MCPUnavailable, match="'silent' did not start within 8 s") as silent:
                await hub.servers["silent"].connect()
            assert silent.value.timed_out
            with pytest.raises(MCPUnavailable, match="'gone' failed to start") as gone:
                await hub.servers["gone"].connect()
            assert not gone.value.timed_out
            with pytest.raises(ValueError, match="no MCP server named 'other'"):
                hub.check_names(["other"])
        finally:
            await hub.close()

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def mcp_server(tmp_path_factory):
    config = tmp_path_factory.mktemp("mcp") / "mcp.json"
    servers = {"tools": {"command": sys.executable, "args": [SERVER]},
               "silent": {"command": sys.executable, "args": [SERVER, "silent"]}}  # fmt: skip
    config.write_text(json.dumps({"mcpServers": servers}))
    live = LiveServer("--max-model-len", "1024", "--mcp-config", str(config), "--mcp-timeout", str(TIMEOUT_S),
                      name="mcp-server").start()  # fmt: skip
    yield live
    live.stop()


@pytest.fixture(scope="module")
def mcp_claude(mcp_server):
    return anthropic.Anthropic(base_url=mcp_server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def mcp_model(mcp_server):
    return mcp_server.client().models.list().data[0].id


TURNS = [{"role": "user", "content": "What is 2 + 3?"}]


def test_a_hanging_server_is_a_504_and_blocks_no_one(mcp_claude, mcp_model):
    def silent():
        with pytest.raises(anthropic.APIStatusError) as caught:
            mcp_claude.messages.create(model=mcp_model, max_tokens=4, messages=TURNS, extra_body={"mcp": ["silent"]})
        return caught.value, time.monotonic()

    with ThreadPoolExecutor(2) as pool:
        failing = pool.submit(silent)
        time.sleep(0.5)
        plain = mcp_claude.messages.create(model=mcp_model, max_tokens=4, messages=TURNS)
        plain_done = time.monotonic()
        error, failed_at = failing.result()
    assert plain.content[0].text and plain_done < failed_at  # answered while the other request waited
    assert error.status_code == 504 and error.body["type"] == "error"
    assert "'silent' did not start within 8 s" in error.body["error"]["message"]


def test_requests_name_configured_servers(mcp_claude, mcp_model, claude):
    with pytest.raises(anthropic.BadRequestError, match="no MCP server named 'nope'"):
        mcp_claude.messages.create(model=mcp_model, max_tokens=4, messages=TURNS, extra_body={"mcp": ["nope"]})
    with pytest.raises(anthropic.BadRequestError, match="no MCP servers"):
        claude.messages.create(model=mcp_model, max_tokens=4, messages=TURNS, extra_body={"mcp": True})
    counted = mcp_claude.messages.count_tokens(model=mcp_model, messages=TURNS, extra_body={"mcp": ["tools"]})
    assert counted.input_tokens > 0
    # a model without a tool parser answers in text: one round, nothing called
    answer = mcp_claude.messages.create(model=mcp_model, max_tokens=4, messages=TURNS, extra_body={"mcp": ["tools"]})
    assert [block.type for block in answer.content] == ["text"]


@pytest.fixture(scope="module")
def claude(server):
    from tests.server.conftest import API_KEY

    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def test_an_mcp_call_is_run_and_its_result_fed_back(mcp_claude, mcp_model):
    """The call is forced (a grammar holds the model to it) in the first round only; the server runs it
    on the MCP server and the model answers after reading the result."""
    answer = mcp_claude.messages.create(
        model=mcp_model, max_tokens=40, messages=TURNS, tool_choice={"type": "tool", "name": "add"},
        extra_body={"mcp": ["tools"], "temperature": 0},
    )  # fmt: skip
    kinds = [block.type for block in answer.content]
    assert kinds[:2] == ["mcp_tool_use", "mcp_tool_result"], answer
    use, result = answer.content[0], answer.content[1]
    assert use.name == "add" and use.server_name == "tools" and set(use.input) == {"a", "b"}
    assert result.tool_use_id == use.id and not result.is_error
    assert result.content[0]["text"] == str(use.input["a"] + use.input["b"])
    assert kinds[-1] == "text" and answer.stop_reason in ("end_turn", "max_tokens")


@pytest.fixture(scope="module")
def mcp_openai(mcp_server):
    return mcp_server.client(timeout=120)


ADD = {"type": "function", "function": {"name": "add"}}


def test_chat_runs_an_mcp_call_and_feeds_its_result_back(mcp_openai, mcp_model):
    """The same rounds on /v1/chat/completions: the forced call is run on the MCP server, its result
    goes back through the chat template, and the model answers; the run call is in ``mcp_calls``."""
    answer = mcp_openai.chat.completions.create(
        model=mcp_model, max_tokens=16, messages=TURNS, tool_choice=ADD, temperature=0, extra_body={"mcp": ["tools"]}
    )
    message = answer.choices[0].message
    [ran] = message.mcp_calls
    arguments = json.loads(ran["arguments"])
    assert ran["name"] == "add" and ran["server_name"] == "tools" and set(arguments) == {"a", "b"}
    assert ran["output"] == str(arguments["a"] + arguments["b"]) and not ran["is_error"]
    assert message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")

    streamed = mcp_openai.chat.completions.create(
        model=mcp_model, max_tokens=16, messages=TURNS, tool_choice=ADD, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"mcp": ["tools"]},
    )  # fmt: skip
    chunks = list(streamed)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    [streamed_ran] = [item for d in deltas for item in (d.model_extra or {}).get("mcp_calls") or []]
    assert streamed_ran["index"] == 0  # as a tool_calls entry's, which openai's stream() helper merges by
    assert {k: v for k, v in streamed_ran.items() if k not in ("id", "index")} == {
        k: v for k, v in ran.items() if k != "id"
    }
    assert "".join(d.content or "" for d in deltas) == message.content  # greedy: the same final answer
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
    # every round's reasoning tokens, as a chat completion counts its own (none: SmolLM2 does not reason)
    assert answer.usage.completion_tokens_details.reasoning_tokens == 0
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 0


def test_chat_mcp_errors(mcp_openai, mcp_model):
    flood = {"type": "function", "function": {"name": "flood"}}
    with pytest.raises(openai.BadRequestError) as flooded:  # the tool's result, not the client's messages, too long
        mcp_openai.chat.completions.create(model=mcp_model, max_tokens=8, messages=TURNS, tool_choice=flood,
                                           extra_body={"mcp": ["tools"]})  # fmt: skip
    error = flooded.value.body
    assert error["message"].startswith("the MCP tools' results (characters: flood 100,000) make the conversation")
    assert error["code"] == "context_length_exceeded" and error["param"] is None
    crash = {"type": "function", "function": {"name": "crash"}}
    with pytest.raises(openai.APIStatusError) as crashed:
        mcp_openai.chat.completions.create(model=mcp_model, max_tokens=8, messages=TURNS, tool_choice=crash,
                                           extra_body={"mcp": ["tools"]})  # fmt: skip
    assert crashed.value.status_code == 502
    assert "'tools' closed the connection while calling 'crash'" in str(crashed.value)
    stream = mcp_openai.chat.completions.create(model=mcp_model, max_tokens=8, messages=TURNS, tool_choice=crash,
                                                stream=True, extra_body={"mcp": ["tools"]})  # fmt: skip
    with pytest.raises(openai.APIError, match="closed the connection while calling 'crash'"):
        list(stream)
    # the server is started again for the next request
    again = mcp_openai.chat.completions.create(model=mcp_model, max_tokens=16, messages=TURNS, tool_choice=ADD,
                                               extra_body={"mcp": ["tools"]})  # fmt: skip
    assert again.choices[0].message.mcp_calls[0]["name"] == "add"
    with pytest.raises(openai.BadRequestError, match="no MCP server named 'nope'") as refused:
        mcp_openai.chat.completions.create(model=mcp_model, max_tokens=4, messages=TURNS, extra_body={"mcp": ["nope"]})
    assert refused.value.body["param"] == "mcp"
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        mcp_openai.chat.completions.create(model=mcp_model, max_tokens=4, messages=TURNS, n=2,
                                           extra_body={"mcp": ["tools"]})  # fmt: skip
    own_add = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.function\.name 'add' is also an MCP server's tool"):
        mcp_openai.chat.completions.create(model=mcp_model, max_tokens=4, messages=TURNS, tools=[own_add],
                                           extra_body={"mcp": ["tools"]})  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="'other', which is not in tools"):
        mcp_openai.chat.completions.create(model=mcp_model, max_tokens=4, messages=TURNS, extra_body={"mcp": ["tools"]},
                                           tool_choice={"type": "function", "function": {"name": "other"}})  # fmt: skip


def test_a_call_cut_by_max_tokens_is_not_run(mcp_openai, mcp_claude, mcp_model):
    """A round that ran out of tokens may end inside a call's arguments: its calls come back as they are."""
    answer = mcp_openai.chat.completions.create(
        model=mcp_model, max_tokens=8, messages=TURNS, tool_choice=ADD, temperature=0, extra_body={"mcp": ["tools"]}
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and not choice.message.mcp_calls
    [cut] = choice.message.tool_calls
    assert cut.function.name == "add"
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.function.arguments)  # cut short, as the model wrote it
    streamed = mcp_openai.chat.completions.create(
        model=mcp_model, max_tokens=8, messages=TURNS, tool_choice=ADD, temperature=0, stream=True,
        extra_body={"mcp": ["tools"]},
    )  # fmt: skip
    chunks = [c for c in streamed if c.choices]
    assert not any((c.choices[0].delta.model_extra or {}).get("mcp_calls") for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    message = mcp_claude.messages.create(
        model=mcp_model, max_tokens=8, messages=TURNS, tool_choice={"type": "tool", "name": "add"},
        extra_body={"mcp": ["tools"], "temperature": 0},
    )  # fmt: skip
    assert message.stop_reason == "max_tokens"
    assert [block.type for block in message.content] == ["tool_use"]


def test_a_messages_answer_with_mcp_blocks_can_be_sent_back(mcp_claude, mcp_model):
    answer = mcp_claude.messages.create(
        model=mcp_model, max_tokens=24, messages=TURNS, tool_choice={"type": "tool", "name": "add"},
        extra_body={"mcp": ["tools"], "temperature": 0},
    )  # fmt: skip
    assert answer.content[0].type == "mcp_tool_use"
    assistant = [block.model_dump() for block in answer.content]
    turns = [*TURNS, {"role": "assistant", "content": assistant}, {"role": "user", "content": "And 4 + 4?"}]
    # the model reads the calls and their results as it did when the server ran them
    body = CountTokensRequest.model_validate({"messages": turns})
    use, result = answer.content[0], answer.content[1]
    converted = chat_messages(body, takes_images=False)
    assert converted[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": json.dumps(use.input)}
    assert converted[2] == {"role": "tool", "tool_call_id": use.id, "content": result.content[0]["text"]}
    assert [m["role"] for m in converted] == ["user", "assistant", "tool", "assistant", "user"]
    again = mcp_claude.messages.create(model=mcp_model, max_tokens=4, messages=turns, extra_body={"mcp": ["tools"]})
    assert again.content


def test_streamed_mcp_calls_count_on_across_rounds():
    """openai's chat.completions.stream() merges every delta's ``mcp_calls`` into one list, by index."""
    from openai.lib.streaming._deltas import accumulate_delta

    def ran(name: str) -> RanCall:
        return RanCall(Call(f"call_{name}", name, {}), "tools", "out", False)

    first = mcp_items([ran("a"), ran("b")], first_index=0)
    second = mcp_items([ran("c")], first_index=len(first))
    merged: dict = {}
    for items in (first, second):
        merged = accumulate_delta(merged, {"mcp_calls": [item.model_dump() for item in items]})
    assert [item["name"] for item in merged["mcp_calls"]] == ["a", "b", "c"]
    assert "index" not in mcp_items([ran("a")])[0].model_dump()  # a whole answer's list has no index


def test_paged_tools_a_changed_list_and_a_result_its_schema_refuses():
    """Tools after the first page of tools/list were never offered; a server's notifications/tools/list_changed
    was dropped (the list frozen at start); a structuredContent failing the tool's outputSchema reset a healthy
    server (502) where it is the tool's error, which the model reads."""
    lowlevel = ServerSpec("low", sys.executable, [str(Path(__file__).with_name("mcp_lowlevel_server.py"))])

    async def scenario():
        hub = MCPHub([lowlevel], TIMEOUT_S)
        server = hub.servers["low"]
        try:
            assert set(await hub.tools(hub.check_names(None))) == {"alpha", "grow", "beta", "badout"}
            assert (await server.call("beta", {})).text == "beta ran"
            assert (await server.call("grow", {})).text == "grown"
            for _ in range(50):  # the list is fetched again apart from the call
                if "sprout" in await hub.tools([server]):
                    break
                await asyncio.sleep(0.1)
            assert (await server.call("sprout", {})).text == "sprout ran"
            session = server._session
            bad = await server.call("badout", {})
            assert bad.is_error and "Invalid structured content returned by tool badout" in bad.text
            assert server._session is session and (await server.call("alpha", {})).text == "alpha ran"  # kept
        finally:
            await hub.close()

    asyncio.run(scenario())


def test_two_servers_with_a_tool_of_one_name_are_warned_of(caplog):
    import logging

    async def scenario():
        hub = MCPHub([spec("one"), spec("two")], TIMEOUT_S)
        try:
            with caplog.at_level(logging.WARNING, logger="xinfer"):
                tools = await hub.tools(hub.check_names(["two", "one"]))
                await hub.tools(hub.check_names(["two", "one"]))
            assert tools["add"][0].name == "two"
        finally:
            await hub.close()

    asyncio.run(scenario())
    warned = [r.getMessage() for r in caplog.records if "both have a tool 'add'" in r.getMessage()]
    assert warned == ["MCP servers 'two' and 'one' both have a tool 'add': the first named, 'two', serves it"]


def test_once_the_rounds_are_spent_the_model_answers_with_no_tools():
    """At --mcp-max-rounds the next round's MCP calls went to the client as its own calls, which it cannot run."""
    from xinfer.server.mcp.config import MCPSettings
    from xinfer.server.mcp.loop import MCPRounds
    from xinfer.server.protocol import ChatCompletionRequest

    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": TURNS, "tools": [ADD], "tool_choice": "auto"}
    )
    rounds = MCPRounds(None, None, MCPSettings(MCPHub([], TIMEOUT_S), max_rounds=2), chat, {})  # type: ignore[arg-type]
    assert rounds.next_request().tool_choice == "auto"
    rounds.rounds_run = 2
    assert rounds.next_request().tool_choice == "none" and rounds.chat.tool_choice == "auto"


def test_sigterm_waits_for_a_request_whose_mcp_call_runs(tmp_path):
    """The drain waited for the engine's work only: a request waiting on a tool had none, so the server exited at
    once and the client got a bare 500. Now the call's result is fed back, the answer comes, then the server
    exits 0."""
    started = tmp_path / "started"
    config = tmp_path / "mcp.json"
    tools = {"command": sys.executable, "args": [SERVER], "env": {"MCP_TEST_STARTED": str(started)}}
    config.write_text(json.dumps({"mcpServers": {"tools": tools}}))
    live = LiveServer("--max-model-len", "1024", "--mcp-config", str(config), "--shutdown-timeout", "120",
                      name="mcp-drain").start()  # fmt: skip
    try:
        client = live.client(timeout=120)
        model = client.models.list().data[0].id
        slow = {"type": "function", "function": {"name": "slow"}}
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(client.chat.completions.create, model=model, max_tokens=4, messages=TURNS,
                                 tool_choice=slow, extra_body={"mcp": ["tools"]})  # fmt: skip
            for _ in range(2400):
                if started.exists():
                    break
                time.sleep(0.05)
            assert started.exists(), live.log_tail()
            live.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(openai.APIConnectionError):  # no new connections while draining
                live.client().models.list()
            [ran] = answer.result().choices[0].message.mcp_calls
        assert ran["name"] == "slow" and ran["output"] == "slept"
        assert live.proc.wait(60) == 0
    finally:
        live.stop()
